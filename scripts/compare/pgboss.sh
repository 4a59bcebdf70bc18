#!/usr/bin/env bash
# Side by side with pg-boss (BENCHMARKS.md, "How we compare"): runs the lateness workload on
# pg-boss 10.4.2 (the last release for Node 20) against the PostgreSQL at DATABASE_URL.
#
#   DATABASE_URL=postgresql://postgres:postgres@127.0.0.1:15432/test bash scripts/compare/pgboss.sh
#
# Env: POLL_SECONDS (2, pg-boss's default; 0.5 is its minimum), BATCH (500), TIMERS (10000),
# SPREAD_MS (10000), RUNS (3). Needs node and npm; pg-boss goes to ~/.cache/timer-service/pgboss-10.4.2 (once).
set -euo pipefail
: "${DATABASE_URL:?set DATABASE_URL to the PostgreSQL to use}"
command -v node >/dev/null && command -v npm >/dev/null || { echo "node and npm are needed" >&2; exit 1; }
dir=${XDG_CACHE_HOME:-$HOME/.cache}/timer-service/pgboss-10.4.2
if [ ! -d "$dir/node_modules/pg-boss" ]; then
    mkdir -p "$dir"
    (cd "$dir" && npm init -y >/dev/null && npm install --no-audit --no-fund pg-boss@10.4.2 >&2)
fi
cp "$(dirname "$0")/pgboss.mjs" "$dir/pgboss.mjs"
for run in $(seq 1 "${RUNS:-3}"); do
    echo "run $run of ${RUNS:-3}" >&2
    (cd "$dir" && node pgboss.mjs)
done
