#!/usr/bin/env bash
# ChromeDriver on 127.0.0.1 for the dashboard's browser tests; it starts a headless Chromium per
# session itself.
#
#   chromium.sh install              apt-get install chromium chromium-driver when missing
#   chromium.sh start DATA_DIR       start (or probe a running one); prints `export ...` lines
#   chromium.sh stop DATA_DIR        stop by the recorded pid (never by name)
#
# Env: CHROMEDRIVER_PORT (19515). The tests find the browser at TIMER_TEST_CHROMIUM
# (/usr/bin/chromium) and the driver at TIMER_TEST_WEBDRIVER_URL.
set -euo pipefail
export LC_ALL=C

SERVER=chromium
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT=${CHROMEDRIVER_PORT:-19515}

install() {
    command -v chromium >/dev/null || apt_install chromium chromium
    command -v chromedriver >/dev/null || apt_install chromium-driver chromedriver
}

ours() { alive_with "$1" "--port=$PORT"; }

status_ready() (
    exec 2>/dev/null
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || exit 1
    printf 'GET /status HTTP/1.1\r\nHost: 127.0.0.1:%s\r\nConnection: close\r\n\r\n' "$PORT" >&3
    # ChromeDriver keeps the connection open after the body (which has no final newline): read
    # for a moment, then look at what came.
    { timeout 1 cat <&3 || true; } | grep -q '"ready": *true'
)

start() {
    command -v chromedriver >/dev/null || die "chromedriver not found; run: $0 install"
    if ! running; then
        require_free "$PORT" chromedriver
        nohup chromedriver --port="$PORT" --allowed-ips=127.0.0.1 \
            --log-path="$DATA_DIR/chromedriver.log" </dev/null >>"$DATA_DIR/chromedriver.stdout" 2>&1 &
        echo $! >"$PIDFILE"
        log "started pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (log $DATA_DIR/chromedriver.log)"
    fi
    wait_ready 30 "$DATA_DIR/chromedriver.stdout" status_ready
    echo "export TIMER_TEST_WEBDRIVER_URL=http://127.0.0.1:$PORT"
    echo "export TIMER_TEST_CHROMIUM=$(command -v chromium)"
    echo "export TIMER_TEST_CHROMEDRIVER_PID=$(cat "$PIDFILE")"
}

stop() { stop_recorded; }

server_main "$@"
