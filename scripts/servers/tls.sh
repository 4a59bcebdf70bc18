#!/usr/bin/env bash
# A throwaway certificate authority, a server certificate for 127.0.0.1 and a client
# certificate, for the TLS tests.
#
#   tls.sh DIR      writes DIR/ca.pem, DIR/server.pem, DIR/server-key.pem, DIR/client.pem and
#                   DIR/client-key.pem (once; kept)
#
# The server certificate is signed by the CA, valid for 30 days, with subjectAltName
# IP:127.0.0.1 and DNS:localhost, so clients that verify the host name accept it.
set -euo pipefail
DIR=${1:?usage: $0 DIR}
mkdir -p "$DIR"
cd "$DIR"
# Kept while valid for at least another day; made again otherwise.
if [ -s ca.pem ] && [ -s server.pem ] && [ -s server-key.pem ] && [ -s client.pem ] \
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
# A client certificate (CN timer-service test client), for services that ask for one.
openssl req -newkey rsa:2048 -nodes -subj "/CN=timer-service test client" \
    -keyout client-key.pem -out client.csr 2>/dev/null
printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n' >client.ext
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 30 \
    -extfile client.ext -out client.pem 2>/dev/null
rm -f server.csr server.ext client.csr client.ext ca.srl
chmod 600 server-key.pem client-key.pem ca-key.pem
