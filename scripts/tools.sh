#!/usr/bin/env bash
# The cargo tools the test command runs besides the tests, each built once (`cargo install
# --locked`) into ~/.cache/timer-service/<tool>-<version>:
#   mdbook          builds the book (docs/); a missing page or include fails the build
#   cargo-machete   finds dependencies that no source file uses
# Usage: bash scripts/tools.sh install       build what is missing
#        bash scripts/tools.sh bin TOOL      print the path of TOOL's binary
set -euo pipefail

CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/timer-service

# name version crate-features
TOOLS=(
    "mdbook 0.5.4 search"
    "cargo-machete 0.9.2 -"
)

log() { echo "tools.sh: $*" >&2; }

bin_of() { # name version
    echo "$CACHE/$1-$2/bin/$1"
}

install_one() { # name version features
    local name=$1 version=$2 features=$3 bin root started
    bin=$(bin_of "$name" "$version")
    [ -x "$bin" ] && return 0
    command -v cargo >/dev/null || { log "cargo is needed to build $name"; exit 1; }
    root="$CACHE/$name-$version"
    log "building $name $version into $root (once)"
    started=$(date +%s)
    local args=(--version "$version" --locked --root "$root")
    if [ "$features" != - ]; then
        args+=(--no-default-features --features "$features")
    fi
    # Its own target dir under the cache, so a rerun after an interruption resumes the build.
    CARGO_TARGET_DIR="$root.build" cargo install "$name" "${args[@]}" >&2
    rm -rf "$root.build"
    log "$name built in $(( $(date +%s) - started )) s"
}

case "${1:-}" in
    install)
        for tool in "${TOOLS[@]}"; do
            # shellcheck disable=SC2086
            install_one $tool
        done
        ;;
    bin)
        for tool in "${TOOLS[@]}"; do
            read -r name version _ <<<"$tool"
            if [ "$name" = "${2:-}" ]; then
                bin_of "$name" "$version"
                exit 0
            fi
        done
        log "unknown tool ${2:-}"
        exit 1
        ;;
    *)
        echo "usage: $0 install | bin TOOL" >&2
        exit 2
        ;;
esac
