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

SERVER=nats
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT=${NATS_PORT:-14222}

install() {
    command -v nats-server >/dev/null || apt_install nats-server nats-server
}

ours() { alive_with "$1" "-sd $DATA_DIR/jetstream"; }

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
    if ! running; then
        require_free "$PORT"
        wait_zombie "$(recorded_pid)" 5
        mkdir -p "$DATA_DIR/jetstream"
        nohup nats-server -a 127.0.0.1 -p "$PORT" -js -sd "$DATA_DIR/jetstream" \
            -l "$DATA_DIR/nats.log" </dev/null >>"$DATA_DIR/nats.stdout" 2>&1 &
        echo $! >"$PIDFILE"
        log "started pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (log $DATA_DIR/nats.log)"
    fi
    wait_ready 30 "$DATA_DIR/nats.log" js_ready
    echo "export TIMER_TEST_NATS_URL=nats://127.0.0.1:$PORT"
    echo "export TIMER_TEST_NATS_PID=$(cat "$PIDFILE")"
    echo "export TIMER_TEST_NATS_DIR=$DATA_DIR"
}

stop() { stop_recorded; }

server_main "$@"
