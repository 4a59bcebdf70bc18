#!/usr/bin/env bash
# A throwaway certificate authority and a server certificate for 127.0.0.1, for the TLS tests.
#
#   tls.sh DIR      writes DIR/ca.pem, DIR/server.pem and DIR/server-key.pem (once; kept)
#
# The server certificate is signed by the CA, valid for 30 days, with subjectAltName
# IP:127.0.0.1 and DNS:localhost, so clients that verify the host name accept it.
set -euo pipefail
DIR=${1:?usage: $0 DIR}
mkdir -p "$DIR"
cd "$DIR"
# Kept while valid for at least another day; made again otherwise.
if [ -s ca.pem ] && [ -s server.pem ] && [ -s server-key.pem ] \
    && openssl x509 -checkend 86400 -noout -in server.pem >/dev/null 2>&1; then
    exit 0
fi
command -v openssl >/dev/null || { echo "[tls] openssl is needed (apt-get install openssl)" >&2; exit 1; }
openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=timer-service test CA" \
    -keyout ca-key.pem -out ca.pem 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout server-key.pem -out server.csr 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 30 \
    -extfile server.ext -out server.pem 2>/dev/null
rm -f server.csr server.ext ca.srl
chmod 600 server-key.pem ca-key.pem
