#!/usr/bin/env bash
# Builds the previous release (scripts/previous-release: its git revision and release) from git
# history, once, into ~/.cache/timer-service/previous-<revision>-<features>/timer-service, for
# the upgrade tests (bin/tests/rolling_upgrade.rs). Only the binary is kept; its build directory is removed after.
# Usage: bash scripts/previous.sh build   build it when missing
#        bash scripts/previous.sh env     print the variables the test reads
#                                         (TIMER_TEST_PREVIOUS_BIN, TIMER_TEST_PREVIOUS_RELEASE)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/timer-service
read -r REVISION RELEASE < <(grep -v '^#' scripts/previous-release | head -n 1)
# What the tests need of it: PostgreSQL and NATS (the rolling upgrade), SQLite and the memory
# broker (the upgrade in place).
FEATURES=postgres,nats,sqlite,memory
ROOT="$CACHE/previous-$REVISION-${FEATURES//,/-}"
BIN="$ROOT/timer-service"

log() { echo "previous.sh: $*" >&2; }

build() {
    [ -x "$BIN" ] && return 0
    if ! git cat-file -e "$REVISION^{commit}" 2>/dev/null; then
        log "revision $REVISION is not in this clone's history; fetching it"
        git fetch -q --unshallow 2>/dev/null || git fetch -q origin "$REVISION" || {
            log "cannot get revision $REVISION (release $RELEASE): clone with its history"
            exit 1
        }
    fi
    log "building timer-service $RELEASE ($REVISION) into $ROOT (once)"
    local started src
    started=$(date +%s)
    src="$ROOT.src"
    rm -rf "$src"
    mkdir -p "$src"
    git archive "$REVISION" | tar -x -C "$src"
    # Its own target directory (the suite's binaries keep theirs), without debug info (faster).
    (cd "$src" && BUILD_REVISION="${REVISION:0:12}" CARGO_TARGET_DIR="$ROOT.build" \
        cargo build --locked -q -p timer-service --no-default-features --features "$FEATURES" \
        --config 'profile.dev.debug=0' >&2)
    mkdir -p "$ROOT"
    cp "$ROOT.build/debug/timer-service" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
    rm -rf "$ROOT.build" "$src"
    log "built in $(( $(date +%s) - started )) s"
}

case "${1:-}" in
    build) build ;;
    env)
        echo "export TIMER_TEST_PREVIOUS_BIN=$BIN"
        echo "export TIMER_TEST_PREVIOUS_RELEASE=$RELEASE"
        ;;
    *) echo "usage: $0 build|env" >&2; exit 2 ;;
esac
