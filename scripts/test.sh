#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, starts every server the tests
# need on 127.0.0.1, runs all tests of every compiled plugin, stops what it started, and prints a
# summary. Usage: bash scripts/test.sh [extra cargo test args]
#
# Servers needed today: none beyond SQLite on temp files and the in-process broker. The server
# plugins (postgres, nats, rabbitmq, kafka) add their start/stop scripts here as they land.
set -euo pipefail
cd "$(dirname "$0")/.."

# This script provides every server, so a test that cannot reach one is a failure, not a skip.
export TIMER_TEST_REQUIRE="${TIMER_TEST_REQUIRE:-1}"

log="$(mktemp -t timer-service-test.XXXXXX)"
trap 'rm -f "$log"' EXIT

started=$(date +%s)
status=0
# A hung test must not hold CI until its hard limit.
timeout --signal=INT 40m \
    cargo test --workspace --all-features --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?

awk '
    /^test result:/ {
        for (i = 1; i <= NF; i++) {
            if ($(i) ~ /^passed;?$/)  passed  += $(i - 1)
            if ($(i) ~ /^failed;?$/)  failed  += $(i - 1)
            if ($(i) ~ /^ignored;?$/) ignored += $(i - 1)
        }
    }
    END { printf "\nsummary: %d passed, %d failed, %d ignored\n", passed, failed, ignored }
' "$log"
echo "tests took $(( $(date +%s) - started )) s"
exit "$status"
