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

PORT=${PG_PORT:-15432}
PASSWORD=${PG_PASSWORD:-postgres}
DB=${PG_DB:-test}
log() { echo "[postgres] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bindir() {
    local d=/usr/lib/postgresql/15/bin
    [ -x "$d/postgres" ] || d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    echo "$d"
}

install() {
    local d; d=$(bindir)
    if [ -n "$d" ] && [ -x "$d/postgres" ]; then return 0; fi
    log "installing postgresql with apt"
    [ "$(id -u)" = 0 ] || die "PostgreSQL is missing and installing it needs root (apt-get install -y postgresql)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
}

as_pg() {
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

ours() { # is $1 the postmaster of this data dir?
    [ -n "$1" ] && kill -0 "$1" 2>/dev/null \
        && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF -- "-D $PGDATA"
}

start() {
    local d; d=$(bindir)
    [ -x "$d/postgres" ] || die "PostgreSQL binaries not found; run: $0 install"
    mkdir -p "$DATA_DIR"
    [ "$(id -u)" = 0 ] && chown postgres "$DATA_DIR"
    as_pg test -x "$DATA_DIR" || die "user postgres cannot enter $DATA_DIR; use a directory under /tmp"
    local url_admin="postgresql://postgres:$PASSWORD@127.0.0.1:$PORT/postgres"
    local url="postgresql://postgres:$PASSWORD@127.0.0.1:$PORT/$DB"
    if ! { [ -f "$PIDFILE" ] && ours "$(cat "$PIDFILE")"; }; then
        if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
            die "port $PORT on 127.0.0.1 is already in use by another process"
        fi
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
        bash "$(dirname "$0")/tls.sh" "$DATA_DIR/tls"
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
        # After a kill -9 the old postmaster lingers as a zombie for a moment; wait for it.
        local old; old=$(head -n 1 "$PGDATA/postmaster.pid" 2>/dev/null || true)
        for _ in $(seq 1 100); do
            [ -n "$old" ] && grep -qs '^State:[[:space:]]*Z' "/proc/$old/status" || break
            sleep 0.1
        done
        as_pg touch "$DATA_DIR/postgres.log"
        as_pg "$d/pg_ctl" -D "$PGDATA" -l "$DATA_DIR/postgres.log" -w -t 60 start >/dev/null \
            || { tail -n 20 "$DATA_DIR/postgres.log" >&2; die "pg_ctl start failed"; }
        head -n 1 "$PGDATA/postmaster.pid" >"$PIDFILE"
        log "started pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (log $DATA_DIR/postgres.log)"
    fi
    local deadline=$(( $(date +%s) + 60 ))
    until PGPASSWORD=$PASSWORD "$d/psql" -X -q -tA "$url_admin" -c 'select 1' >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || die "not answering after 60 s; see $DATA_DIR/postgres.log"
        sleep 0.1
    done
    if [ "$(PGPASSWORD=$PASSWORD "$d/psql" -X -tA "$url_admin" -c "select 1 from pg_database where datname = '$DB'")" != 1 ]; then
        PGPASSWORD=$PASSWORD "$d/psql" -X -q "$url_admin" -c "create database \"$DB\"" >/dev/null
    fi
    echo "export TIMER_TEST_POSTGRES_URL=$url"
    echo "export TIMER_TEST_POSTGRES_PID=$(cat "$PIDFILE")"
    echo "export TIMER_TEST_POSTGRES_DIR=$DATA_DIR"
    echo "export TIMER_TEST_POSTGRES_CA=$DATA_DIR/tls/ca.pem"
}

stop() {
    [ -f "$PIDFILE" ] || { log "not running"; return 0; }
    local pid; pid=$(cat "$PIDFILE")
    if ! ours "$pid"; then rm -f "$PIDFILE"; log "stale pid file removed"; return 0; fi
    kill -INT "$pid"   # fast shutdown
    for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -QUIT "$pid" 2>/dev/null || true; fi
    rm -f "$PIDFILE"
    log "stopped pid $pid"
}

cmd=${1:-}
case $cmd in
    install) install ;;
    start|stop)
        DATA_DIR=${2:?usage: $0 $cmd DATA_DIR}
        mkdir -p "$DATA_DIR"
        DATA_DIR=$(cd "$DATA_DIR" && pwd -P)
        PGDATA=$DATA_DIR/pgdata
        PIDFILE=$DATA_DIR/postgres.pid
        "$cmd" ;;
    *) die "usage: $0 install | start DATA_DIR | stop DATA_DIR" ;;
esac
