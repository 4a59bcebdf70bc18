#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what is missing, starts every server the tests
# need on 127.0.0.1, runs all tests of every compiled plugin, stops what it started, and prints a
# summary. First it compiles the default build and each plugin feature alone (scripts/builds.sh).
# Usage: bash scripts/test.sh [extra cargo test args]
#
# Besides the tests: cargo-machete (no unused dependency) and mdbook (the book in docs/ builds),
# built once into ~/.cache/timer-service (scripts/tools.sh); and the previous release, built
# from git history for the rolling-upgrade test (scripts/previous.sh).
# Servers: PostgreSQL (scripts/servers/postgres.sh), NATS with JetStream (scripts/servers/nats.sh),
# RabbitMQ (scripts/servers/rabbitmq.sh), a Kafka-protocol broker (tansu, scripts/servers/kafka.sh;
# built once into ~/.cache/timer-service, about 12 minutes on 2 cores), and ChromeDriver with
# Debian's Chromium for the dashboard (scripts/servers/chromium.sh); and libfaketime for the
# clock-jump tests (scripts/servers/faketime.sh).
# SQLite runs on temp files and the memory broker in process.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/deps.sh # build dependencies of --all-features, installed with apt when missing

# The default build and each plugin feature alone compile (before any server starts).
bash scripts/builds.sh

# The tools besides the tests, built once into ~/.cache/timer-service (scripts/tools.sh).
bash scripts/tools.sh install
# The previous release, built once from git history into ~/.cache/timer-service for the
# rolling-upgrade test (scripts/previous.sh).
bash scripts/previous.sh build
eval "$(bash scripts/previous.sh env)"
# No dependency that no source file uses.
"$(bash scripts/tools.sh bin cargo-machete)"
# The book builds, without a warning (mdbook only warns of an {{#include}} it cannot find); its
# links and anchors are checked by the docs tests with the rest.
book="$(mktemp -d /tmp/timer-service-book.XXXXXX)"
"$(bash scripts/tools.sh bin mdbook)" build docs --dest-dir "$book" 2>&1 | tee "$book.log"
rm -rf "$book"
if grep -E 'WARN|ERROR' "$book.log" >/dev/null; then
    echo "the book has warnings (above)" >&2
    rm -f "$book.log"
    exit 1
fi
rm -f "$book.log"

# This script provides every server, so a test that cannot reach one is a failure, not a skip.
export TIMER_TEST_REQUIRE="${TIMER_TEST_REQUIRE:-1}"

# Servers keep their data in a fresh directory under /tmp (the postgres user must reach it).
servers="$(mktemp -d /tmp/timer-service-test.XXXXXX)"
chmod 755 "$servers"
log="$servers/test.log"
stop_servers() {
    for name in postgres nats rabbitmq kafka chromium faketime; do
        bash "scripts/servers/$name.sh" stop "$servers/$name" || true
    done
    rm -rf "$servers"
}
trap stop_servers EXIT

# The first free port at or after $1 on 127.0.0.1.
free_port() {
    local port=$1
    while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
    echo "$port"
}

# server NAME [VAR=VALUE...]: installs scripts/servers/NAME.sh's server when missing, starts it
# with those variables in $servers/NAME and exports what it prints.
server() {
    local name=$1 out; shift
    bash "scripts/servers/$name.sh" install
    # Assigned first, so a failed start stops the script (set -e does not see inside eval "$(...)").
    out=$(env "$@" bash "scripts/servers/$name.sh" start "$servers/$name")
    eval "$out"
}

server postgres PG_PORT="$(free_port 15432)"
echo "PostgreSQL: $TIMER_TEST_POSTGRES_URL (pid $TIMER_TEST_POSTGRES_PID)"

server nats NATS_PORT="$(free_port 14222)"
echo "NATS: $TIMER_TEST_NATS_URL (pid $TIMER_TEST_NATS_PID)"

# Its own epmd; amqps is on the AMQP port + 1 and the Erlang distribution port on + 100, so
# take the first port P from 16572 with all three free.
rabbit_port=$(free_port 16572)
while [ "$(free_port $((rabbit_port + 1)))" != $((rabbit_port + 1)) ] \
    || [ "$(free_port $((rabbit_port + 100)))" != $((rabbit_port + 100)) ]; do
    rabbit_port=$(free_port $((rabbit_port + 1)))
done
server rabbitmq RABBITMQ_PORT="$rabbit_port" RABBITMQ_EPMD_PORT="$(free_port 16369)"
echo "RabbitMQ: $TIMER_TEST_RABBITMQ_URL"

server kafka KAFKA_PORT="$(free_port 19092)"
echo "Kafka (tansu): $TIMER_TEST_KAFKA_BROKERS (pid $TIMER_TEST_KAFKA_PID)"

# The dashboard's browser tests: ChromeDriver, which starts a headless Chromium per session.
server chromium CHROMEDRIVER_PORT="$(free_port 19515)"
echo "ChromeDriver: $TIMER_TEST_WEBDRIVER_URL (pid $TIMER_TEST_CHROMEDRIVER_PID)"

# The clock-jump tests move the service's wall clock with libfaketime (not a server).
server faketime
echo "libfaketime: $TIMER_TEST_FAKETIME"

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
