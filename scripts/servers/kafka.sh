#!/usr/bin/env bash
# A private Kafka-protocol broker (tansu) on 127.0.0.1 for the tests.
#
#   kafka.sh install              build tansu 0.6.0 into ~/.cache/timer-service when it is missing
#   kafka.sh start DATA_DIR       start (or probe a running one); prints `export ...` lines
#   kafka.sh stop DATA_DIR        stop by the recorded pid (never by name)
#
# There is no Apache Kafka in the registries reachable here; tansu (crates.io, Apache-2.0) speaks
# the Kafka wire protocol. It needs a storage feature: `libsql` stores everything in
# DATA_DIR/tansu.db, so a restart on the same DATA_DIR (also after kill -9) keeps topics, messages
# and committed offsets. The first install compiles it (about 12 minutes on 2 cores, 59 MB);
# later runs reuse the cached binary.
#
# Env: KAFKA_PORT (19092), TANSU_ROOT (~/.cache/timer-service/tansu-0.6.0), TANSU_BIN (overrides
# the binary). tansu has no automatic topic creation: the service creates its topics itself.
set -euo pipefail
export LC_ALL=C

SERVER=kafka
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT=${KAFKA_PORT:-19092}
VERSION=0.6.0
ROOT=${TANSU_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/timer-service/tansu-$VERSION}
BIN=${TANSU_BIN:-$ROOT/bin/tansu}

install() {
    command -v sqlite3 >/dev/null || apt_install sqlite3 sqlite3
    if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -qF "$VERSION"; then
        return 0
    fi
    command -v cargo >/dev/null || die "cargo is needed to build tansu"
    log "building tansu $VERSION into $ROOT (once; about 12 minutes on 2 cores)"
    local started; started=$(date +%s)
    # Its own target dir under the cache, so a rerun after an interruption resumes the build.
    CARGO_TARGET_DIR="$ROOT.build" cargo install tansu --version "$VERSION" --locked \
        --features libsql --root "$ROOT" >&2
    rm -rf "$ROOT.build"
    log "tansu built in $(( $(date +%s) - started )) s"
}

ours() { # a tansu broker running in this data dir
    alive_with "$1" " broker --cluster-id" \
        && [ "$(readlink "/proc/$1/cwd" 2>/dev/null)" = "$DATA_DIR" ]
}

# A real Kafka request: ApiVersions v0 (api key 18, correlation id 1, client id "svc"); the
# answer must echo correlation id 1 with error code 0.
api_versions_ok() (
    exec 2>/dev/null
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || exit 1
    printf '\000\000\000\015\000\022\000\000\000\000\000\001\000\003svc' >&3
    hdr=$(timeout 3 head -c 10 <&3 | od -An -tx1 | tr -d ' \n')
    [ "${hdr:8:12}" = 000000010000 ]
)

# Metadata over the advertised address answers (tansu's own client).
metadata_ok() {
    (cd "$DATA_DIR" && timeout 10 "$BIN" topic list --broker "tcp://127.0.0.1:$PORT" >/dev/null 2>&1)
}

ready() { api_versions_ok && metadata_ok; }

# tansu 0.6.0 keeps record headers in a table without an index, and looks up the headers of
# every record it serves with a scan of all of them: each fetch slows down with every header
# ever stored (a consumer's lateness went from 6 ms to 1.3 s after 60,000 headers). The index
# its schema lacks, added once its tables exist.
index_headers() {
    command -v sqlite3 >/dev/null || die "sqlite3 is needed to index tansu's headers; run: $0 install"
    sqlite3 -cmd ".timeout 10000" "$DATA_DIR/tansu.db" \
        "create index if not exists header_record on header (topition, offset_id)" >/dev/null \
        || die "cannot add the header index to $DATA_DIR/tansu.db"
}

start() {
    [ -x "$BIN" ] || die "tansu not found at $BIN; run: $0 install"
    if ! running; then
        require_free "$PORT"
        wait_zombie "$(recorded_pid)" 5
        # tansu reads a `.env` from its working directory and resolves sqlite:// paths against
        # it, so it runs inside DATA_DIR.
        (
            cd "$DATA_DIR" || exit 1
            RUST_LOG=${RUST_LOG:-warn} nohup env -u SCHEMA_REGISTRY -u OTEL_EXPORTER_OTLP_ENDPOINT \
                "$BIN" broker --cluster-id timer-service-test \
                --listener-url "tcp://127.0.0.1:$PORT" \
                --advertised-listener-url "tcp://127.0.0.1:$PORT" \
                --storage-engine sqlite://tansu.db </dev/null >>"$DATA_DIR/tansu.log" 2>&1 &
            echo $! >"$PIDFILE"
        )
        log "started pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (log $DATA_DIR/tansu.log)"
    fi
    wait_ready 30 "$DATA_DIR/tansu.log" ready
    index_headers
    echo "export TIMER_TEST_KAFKA_BROKERS=127.0.0.1:$PORT"
    echo "export TIMER_TEST_KAFKA_PID=$(cat "$PIDFILE")"
    echo "export TIMER_TEST_KAFKA_DIR=$DATA_DIR"
    echo "export TIMER_TEST_KAFKA_BIN=$BIN"
}

stop() { stop_recorded; }

server_main "$@"
