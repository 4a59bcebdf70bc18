#!/usr/bin/env bash
# Builds and lints what `--all-features` does not: the default build of the binary (the README's
# run command) and each plugin feature alone, so code that compiles (or is used) only next to
# another feature fails here. Called by scripts/test.sh before the servers start; runs alone
# too: bash scripts/builds.sh
set -euo pipefail
cd "$(dirname "$0")/.."

started=$(date +%s)
failed=()
# run COMMAND...: runs it, and remembers it when it fails (all are tried, then the script fails).
run() { echo "+ $*" >&2; "$@" || failed+=("$*"); }
# lint PACKAGE [CARGO ARGS...]: clippy with warnings as errors (dependencies are only checked).
lint() { run cargo clippy -p "$@" -- -D warnings; }

# features DIR: the cargo features of the crate in DIR (from its Cargo.toml), `default` left out,
# so a new plugin's feature is linted without touching this script.
features() {
    awk '/^\[features\]/ { on = 1; next } /^\[/ { on = 0 } on && /^[A-Za-z0-9_-]+ *=/ { print $1 }' \
        "$1/Cargo.toml" | grep -vx default
}

run cargo build -p timer-service
lint timer-service
for feature in $(features bin); do
    lint timer-service --no-default-features --features "$feature"
done
for feature in $(features stores); do
    lint timer-stores --no-default-features --features "$feature"
done
for feature in $(features brokers); do
    lint timer-brokers --no-default-features --features "$feature"
done
echo "default and single-feature builds took $(( $(date +%s) - started )) s" >&2
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
