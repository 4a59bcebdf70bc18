# What the server scripts share; sourced by each (`SERVER=name` set first). A script defines
# `install`, `start` and `stop` (or uses `stop_recorded`), optionally `configure` (run once
# DATA_DIR and PIDFILE are set) and `ours PID` (is PID this DATA_DIR's server?), then ends with
# `server_main "$@"`.
#
#   SCRIPT install             install the server when it is missing
#   SCRIPT start DATA_DIR      start (or probe a running one); prints `export ...` lines
#   SCRIPT stop DATA_DIR       stop by the recorded pid (never by name)

SERVERS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

log() { echo "[$SERVER] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# apt_install PACKAGE WHAT: installs PACKAGE with apt (WHAT names it in the error without root).
apt_install() {
    log "installing $1 with apt"
    [ "$(id -u)" = 0 ] || die "$2 is missing and installing it needs root (apt-get install -y $1)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >&2
}

# alive_with PID PATTERN: PID is alive and its command line contains PATTERN.
alive_with() {
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null || return 1
    tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "$2"
}

# poll SECONDS COMMAND...: COMMAND succeeds within SECONDS (tried every 0.1 s).
poll() {
    local i
    for (( i = $1 * 10; i > 0; i-- )); do
        "${@:2}" && return 0
        sleep 0.1
    done
    "${@:2}"
}

gone() { ! kill -0 "$1" 2>/dev/null; }
not_zombie() { [ -z "$1" ] || ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }

# wait_gone PID SECONDS: PID exits within SECONDS.
wait_gone() { poll "$2" gone "$1"; }

# After a kill -9 the old process lingers as a zombie for a moment; wait_zombie PID SECONDS
# waits for it to be reaped (PID may be empty).
wait_zombie() { poll "$2" not_zombie "$1" || true; }

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# require_free PORT [WHAT]: dies when something listens on 127.0.0.1:PORT.
require_free() {
    if port_busy "$1"; then die "port $1${2:+ ($2)} on 127.0.0.1 is already in use by another process"; fi
}

recorded_pid() { cat "$PIDFILE" 2>/dev/null || true; }

# The process recorded in PIDFILE is this DATA_DIR's server.
running() { [ -f "$PIDFILE" ] && ours "$(cat "$PIDFILE")"; }

# wait_ready SECONDS LOG CHECK...: runs CHECK until it succeeds; dies (with the end of LOG) when
# the recorded process exits first, or after SECONDS.
wait_ready() {
    local seconds=$1 logfile=$2; shift 2
    local deadline=$(( $(date +%s) + seconds ))
    until "$@"; do
        if gone "$(recorded_pid)"; then
            tail -n 30 "$logfile" >&2 || true
            die "$SERVER exited"
        fi
        [ "$(date +%s)" -lt "$deadline" ] || die "not ready after $seconds s; see $logfile"
        sleep 0.1
    done
}

# stop_recorded [SIGNAL SECONDS LAST_SIGNAL]: sends SIGNAL to the recorded server, and
# LAST_SIGNAL when it still runs after SECONDS (default TERM, 10 s, KILL).
stop_recorded() {
    [ -f "$PIDFILE" ] || { log "not running"; return 0; }
    local pid; pid=$(cat "$PIDFILE")
    if ! ours "$pid"; then rm -f "$PIDFILE"; log "stale pid file removed"; return 0; fi
    kill "-${1:-TERM}" "$pid"
    wait_gone "$pid" "${2:-10}" || kill "-${3:-KILL}" "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
    log "stopped pid $pid"
}

# tls_files DIR: a throwaway CA and a server certificate for 127.0.0.1 in DIR (tls.sh).
tls_files() { bash "$SERVERS_DIR/tls.sh" "$1"; }

server_main() {
    local cmd=${1:-}
    case $cmd in
        install) install ;;
        start|stop)
            DATA_DIR=${2:?usage: $0 $cmd DATA_DIR}
            mkdir -p "$DATA_DIR"
            DATA_DIR=$(cd "$DATA_DIR" && pwd -P)
            PIDFILE=$DATA_DIR/$SERVER.pid
            if declare -F configure >/dev/null; then configure; fi
            "$cmd" ;;
        *) die "usage: $0 install | start DATA_DIR | stop DATA_DIR" ;;
    esac
}
