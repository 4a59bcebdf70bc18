#!/usr/bin/env bash
# libfaketime for the clock-jump tests (bin/tests/clock.rs): no server, a library the tests
# preload into the service to move its wall clock while it runs (its monotonic clock stays real).
#
#   faketime.sh install              apt-get install faketime when missing
#   faketime.sh start DATA_DIR       prints `export TIMER_TEST_FAKETIME=<the library>`
#   faketime.sh stop DATA_DIR        nothing to stop
set -euo pipefail
export LC_ALL=C

SERVER=faketime
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# The library for this machine's architecture, as Debian's package installs it.
library() {
    local lib
    lib="/usr/lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)/faketime/libfaketime.so.1"
    [ -f "$lib" ] && echo "$lib"
}

install() { library >/dev/null || apt_install faketime faketime; }

start() {
    local lib
    lib=$(library) || die "libfaketime not found; run: $0 install"
    echo "export TIMER_TEST_FAKETIME=$lib"
}

stop() { :; }

server_main "$@"
