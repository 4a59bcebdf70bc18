#!/usr/bin/env bash
# A private NATS server with JetStream on 127.0.0.1 for the tests.
#
#   nats.sh install              apt-get install nats-server when it is missing
#   nats.sh start DATA_DIR       start (or probe a running one); prints `export ...` lines
#   nats.sh stop DATA_DIR        stop by the recorded pid (never by name)
#
# Env: NATS_PORT (14222). JetStream files live in DATA_DIR/jetstream, so a restart on the same
# DATA_DIR keeps streams, consumers and messages.
set -euo pipefail
export LC_ALL=C

PORT=${NATS_PORT:-14222}
log() { echo "[nats] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

install() {
    command -v nats-server >/dev/null && return 0
    log "installing nats-server with apt"
    [ "$(id -u)" = 0 ] || die "nats-server is missing and installing it needs root (apt-get install -y nats-server)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >&2
}

ours() { # is $1 the nats-server of this data dir?
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null \
        && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "-sd $DATA_DIR/jetstream"
}

# JetStream answers: request $JS.API.INFO over the client protocol and expect account info.
js_ready() (
    exec 2>/dev/null
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || exit 1
    IFS= read -r -t 2 line <&3 || exit 1
    case $line in INFO*) ;; *) exit 1 ;; esac
    printf 'CONNECT {"verbose":false,"headers":true,"no_responders":true}\r\nSUB _INBOX.probe 1\r\nPUB $JS.API.INFO _INBOX.probe 0\r\n\r\n' >&3
    while IFS= read -r -t 3 line <&3; do
        line=${line%$'\r'}
        case $line in
            PING) printf 'PONG\r\n' >&3 ;;
            "MSG _INBOX.probe "*)
                IFS= read -r -t 3 -N "${line##* }" payload <&3 || exit 1
                case $payload in *account_info_response*) case $payload in *'"error"'*) exit 1 ;; esac; exit 0 ;; esac
                exit 1 ;;
            HMSG*|-ERR*) exit 1 ;;
        esac
    done
    exit 1
)

start() {
    command -v nats-server >/dev/null || die "nats-server not found; run: $0 install"
    if ! { [ -f "$PIDFILE" ] && ours "$(cat "$PIDFILE")"; }; then
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
            die "port $PORT on 127.0.0.1 is already in use by another process"
        fi
        # After a kill -9 the old process lingers as a zombie for a moment; wait for it.
        local old; old=$(cat "$PIDFILE" 2>/dev/null || true)
        for _ in $(seq 1 50); do
            [ -n "$old" ] && grep -qs '^State:[[:space:]]*Z' "/proc/$old/status" || break
            sleep 0.1
        done
        mkdir -p "$DATA_DIR/jetstream"
        nohup nats-server -a 127.0.0.1 -p "$PORT" -js -sd "$DATA_DIR/jetstream" \
            -l "$DATA_DIR/nats.log" </dev/null >>"$DATA_DIR/nats.stdout" 2>&1 &
        echo $! >"$PIDFILE"
        log "started pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (log $DATA_DIR/nats.log)"
    fi
    local deadline=$(( $(date +%s) + 30 ))
    until js_ready; do
        kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { tail -n 20 "$DATA_DIR/nats.log" >&2 || true; die "nats-server exited"; }
        [ "$(date +%s)" -lt "$deadline" ] || die "JetStream not ready after 30 s; see $DATA_DIR/nats.log"
        sleep 0.1
    done
    echo "export TIMER_TEST_NATS_URL=nats://127.0.0.1:$PORT"
    echo "export TIMER_TEST_NATS_PID=$(cat "$PIDFILE")"
    echo "export TIMER_TEST_NATS_DIR=$DATA_DIR"
}

stop() {
    [ -f "$PIDFILE" ] || { log "not running"; return 0; }
    local pid; pid=$(cat "$PIDFILE")
    if ! ours "$pid"; then rm -f "$PIDFILE"; log "stale pid file removed"; return 0; fi
    kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PIDFILE"
    log "stopped pid $pid"
}

cmd=${1:-}
case $cmd in
    install) install ;;
    start|stop)
        DATA_DIR=${2:?usage: $0 $cmd DATA_DIR}
        mkdir -p "$DATA_DIR"
        DATA_DIR=$(cd "$DATA_DIR" && pwd -P)
        PIDFILE=$DATA_DIR/nats.pid
        "$cmd" ;;
    *) die "usage: $0 install | start DATA_DIR | stop DATA_DIR" ;;
esac
