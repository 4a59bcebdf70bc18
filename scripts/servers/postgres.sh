#!/usr/bin/env bash
# A private PostgreSQL 15 cluster on 127.0.0.1 for the tests.
#
#   postgres.sh install              apt-get install postgresql when its binaries are missing
#   postgres.sh start DATA_DIR       start (initdb on first use); prints `export ...` lines
#   postgres.sh stop DATA_DIR        stop by the recorded pid (never by name)
#
# Env: PG_PORT (15432), PG_PASSWORD (postgres), PG_DB (test), PG_FAST=1 (fsync off: faster,
# not crash-safe). Root cannot run postgres, so as root the server runs as user `postgres`,
# and DATA_DIR must be reachable by that user (use a directory under /tmp). TLS is on, with a
# certificate from a throwaway CA made by tls.sh (DATA_DIR/tls/ca.pem, exported as
# TIMER_TEST_POSTGRES_CA).
set -euo pipefail
export LC_ALL=C

SERVER=postgres
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PORT=${PG_PORT:-15432}
PASSWORD=${PG_PASSWORD:-postgres}
DB=${PG_DB:-test}

bindir() {
    local d=/usr/lib/postgresql/15/bin
    [ -x "$d/postgres" ] || d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    echo "$d"
}

install() {
    local d; d=$(bindir)
    if [ -n "$d" ] && [ -x "$d/postgres" ]; then return 0; fi
    apt_install postgresql PostgreSQL
}

psql_ok() { # BINDIR URL ARGS...: psql answers
    PGPASSWORD=$PASSWORD "$1/psql" -X -q -tA "${@:2}" >/dev/null 2>&1
}

as_pg() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

ours() { alive_with "$1" "-D $PGDATA"; } # the postmaster of this data dir

start() {
    local d; d=$(bindir)
    [ -x "$d/postgres" ] || die "PostgreSQL binaries not found; run: $0 install"
    mkdir -p "$DATA_DIR"
    [ "$(id -u)" = 0 ] && chown postgres "$DATA_DIR"
    as_pg test -x "$DATA_DIR" || die "user postgres cannot enter $DATA_DIR; use a directory under /tmp"
    local url_admin="postgresql://postgres:$PASSWORD@127.0.0.1:$PORT/postgres"
    local url="postgresql://postgres:$PASSWORD@127.0.0.1:$PORT/$DB"
    if ! running; then
        require_free "$PORT"
        if [ ! -s "$PGDATA/PG_VERSION" ]; then
            rm -rf "$PGDATA"
            as_pg mkdir -m 0700 "$PGDATA"
            local pw="$DATA_DIR/.pw"
            printf '%s\n' "$PASSWORD" >"$pw"
            [ "$(id -u)" = 0 ] && chown postgres "$pw"
            as_pg "$d/initdb" -D "$PGDATA" -U postgres --pwfile="$pw" --auth-host=scram-sha-256 \
                --auth-local=trust -E UTF8 --locale=C.UTF-8 --no-sync >"$DATA_DIR/initdb.log" 2>&1 \
                || { rm -f "$pw"; cat "$DATA_DIR/initdb.log" >&2; die "initdb failed"; }
            rm -f "$pw"
            echo "include_if_exists = 'test.conf'" | as_pg tee -a "$PGDATA/postgresql.conf" >/dev/null
        fi
        # TLS on (clients that do not ask for it still connect in plain text), with a
        # certificate from a throwaway CA the TLS tests trust (TIMER_TEST_POSTGRES_CA).
        tls_files "$DATA_DIR/tls"
        [ "$(id -u)" = 0 ] && chown -R postgres "$DATA_DIR/tls"
        {
            echo "listen_addresses = '127.0.0.1'"
            echo "ssl = on"
            echo "ssl_cert_file = '$DATA_DIR/tls/server.pem'"
            echo "ssl_key_file = '$DATA_DIR/tls/server-key.pem'"
            echo "port = $PORT"
            echo "unix_socket_directories = ''"
            echo "max_connections = 300"
            if [ "${PG_FAST:-0}" = 1 ]; then
                echo "fsync = off"; echo "synchronous_commit = off"; echo "full_page_writes = off"
            fi
        } | as_pg tee "$PGDATA/test.conf" >/dev/null
        # After a kill -9 the old postmaster lingers as a zombie for a moment.
        wait_zombie "$(head -n 1 "$PGDATA/postmaster.pid" 2>/dev/null || true)" 10
        as_pg touch "$DATA_DIR/postgres.log"
        as_pg "$d/pg_ctl" -D "$PGDATA" -l "$DATA_DIR/postgres.log" -w -t 60 start >/dev/null \
            || { tail -n 20 "$DATA_DIR/postgres.log" >&2; die "pg_ctl start failed"; }
        head -n 1 "$PGDATA/postmaster.pid" >"$PIDFILE"
        log "started pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (log $DATA_DIR/postgres.log)"
    fi
    wait_ready 60 "$DATA_DIR/postgres.log" psql_ok "$d" "$url_admin" -c 'select 1'
    if [ "$(PGPASSWORD=$PASSWORD "$d/psql" -X -tA "$url_admin" -c "select 1 from pg_database where datname = '$DB'")" != 1 ]; then
        PGPASSWORD=$PASSWORD "$d/psql" -X -q "$url_admin" -c "create database \"$DB\"" >/dev/null
    fi
    echo "export TIMER_TEST_POSTGRES_URL=$url"
    echo "export TIMER_TEST_POSTGRES_PID=$(cat "$PIDFILE")"
    echo "export TIMER_TEST_POSTGRES_DIR=$DATA_DIR"
    echo "export TIMER_TEST_POSTGRES_CA=$DATA_DIR/tls/ca.pem"
}

stop() { stop_recorded INT 30 QUIT; } # INT: fast shutdown

configure() { PGDATA=$DATA_DIR/pgdata; }

server_main "$@"
