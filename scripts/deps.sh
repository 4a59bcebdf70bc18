#!/usr/bin/env bash
# Build dependencies of a build with every feature, installed with apt when missing: pkg-config
# and OpenSSL's headers (rdkafka's TLS links the system OpenSSL), make and perl (librdkafka is
# compiled from its bundled sources). The embedded default (`cargo run -p timer-service`) needs
# none of them. Called by .ci/run and scripts/test.sh before they build.
set -euo pipefail
export LC_ALL=C
log() { echo "[deps] $*" >&2; }

missing=()
command -v pkg-config >/dev/null || missing+=(pkg-config)
command -v make >/dev/null || missing+=(make)
command -v perl >/dev/null || missing+=(perl)
if ! command -v pkg-config >/dev/null || ! pkg-config --exists openssl 2>/dev/null; then
    missing+=(libssl-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
    log "missing: ${missing[*]}; install them (apt-get install -y ${missing[*]}) or run as root"
    exit 1
fi
log "installing ${missing[*]} with apt"
DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
