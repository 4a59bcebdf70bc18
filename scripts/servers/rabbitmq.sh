#!/usr/bin/env bash
# A private RabbitMQ node on 127.0.0.1 for the tests, with its own epmd.
#
#   rabbitmq.sh install              apt-get install rabbitmq-server when it is missing
#   rabbitmq.sh start DATA_DIR       start (or probe a running one); prints `export ...` lines
#   rabbitmq.sh stop DATA_DIR        stop by the recorded pids (never by name)
#
# Env: RABBITMQ_PORT (16572; amqps with a throwaway CA on +1, the Erlang distribution port on
# +100), RABBITMQ_EPMD_PORT (16369).
# User guest/guest (loopback only), vhost "/". Data (queues, messages) lives in DATA_DIR/mnesia,
# so a restart on the same DATA_DIR keeps durable queues and persistent messages.
set -euo pipefail
export LC_ALL=C.UTF-8   # the Elixir CLI tools misbehave under a non-UTF-8 locale

SERVER=rabbitmq
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
SBIN=/usr/lib/rabbitmq/bin

install() {
    [ -x "$SBIN/rabbitmq-server" ] && command -v epmd >/dev/null && return 0
    apt_install rabbitmq-server RabbitMQ
}
amqp_ready() ( # the server answers the AMQP 0-9-1 protocol header with Connection.Start
    exec 2>/dev/null
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || exit 1
    printf 'AMQP\000\000\011\001' >&3
    hdr=$(timeout 3 head -c 11 <&3 | od -An -tx1 | tr -d ' \n')
    [ "${hdr:0:6}" = 010000 ] && [ "${hdr:14:8}" = 000a000a ]
)

write_env() {
    mkdir -p "$DATA_DIR/mnesia" "$DATA_DIR/log" "$DATA_DIR/bin"
    cat >"$ENVFILE" <<EOV
export HOME='$DATA_DIR'
export LC_ALL=C.UTF-8
export ERL_EPMD_PORT=$EPMD_PORT
export ERL_EPMD_ADDRESS=127.0.0.1
export RABBITMQ_NODENAME='$NODENAME'
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT=$PORT
export RABBITMQ_DIST_PORT=$DIST_PORT
export RABBITMQ_MNESIA_BASE='$DATA_DIR/mnesia'
export RABBITMQ_LOG_BASE='$DATA_DIR/log'
export RABBITMQ_PID_FILE='$BEAM_PIDFILE'
export RABBITMQ_CONF_ENV_FILE='$DATA_DIR/rabbitmq-env.conf'
export RABBITMQ_CONFIG_FILE='$DATA_DIR/rabbitmq.conf'
export RABBITMQ_ADVANCED_CONFIG_FILE='$DATA_DIR/advanced.config'
export RABBITMQ_ENABLED_PLUGINS_FILE='$DATA_DIR/enabled_plugins'
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}'
EOV
    : >"$DATA_DIR/rabbitmq-env.conf"
    # amqps on the AMQP port + 1, with a certificate from a throwaway CA (tls.sh).
    tls_files "$DATA_DIR/tls"
    cat >"$DATA_DIR/rabbitmq.conf" <<EOC
log.console = false
log.file.level = info
listeners.ssl.1 = 127.0.0.1:$TLS_PORT
ssl_options.cacertfile = $DATA_DIR/tls/ca.pem
ssl_options.certfile = $DATA_DIR/tls/server.pem
ssl_options.keyfile = $DATA_DIR/tls/server-key.pem
ssl_options.verify = verify_none
ssl_options.fail_if_no_peer_cert = false
EOC
    echo "[]." >"$DATA_DIR/enabled_plugins"
    printf '#!/bin/sh\n. "%s"\nexec "%s/rabbitmqctl" "$@"\n' "$ENVFILE" "$SBIN" >"$DATA_DIR/bin/rabbitmqctl"
    chmod +x "$DATA_DIR/bin/rabbitmqctl"
    if [ ! -s "$DATA_DIR/.erlang.cookie" ]; then
        ( set +o pipefail; umask 077; tr -dc 'A-Z' </dev/urandom | head -c 32 >"$DATA_DIR/.erlang.cookie" )
    fi
    chmod 400 "$DATA_DIR/.erlang.cookie"
}

emit_env() {
    echo "export TIMER_TEST_RABBITMQ_URL=amqp://guest:guest@127.0.0.1:$PORT/%2f"
    echo "export TIMER_TEST_RABBITMQ_TLS_URL=amqps://guest:guest@127.0.0.1:$TLS_PORT/%2f"
    echo "export TIMER_TEST_RABBITMQ_CA=$DATA_DIR/tls/ca.pem"
    echo "export TIMER_TEST_RABBITMQ_DIR=$DATA_DIR"
    echo "export TIMER_TEST_RABBITMQ_BEAM_PID=$(cat "$BEAM_PIDFILE" 2>/dev/null || true)"
}

start() {
    [ -x "$SBIN/rabbitmq-server" ] || die "RabbitMQ not found in $SBIN; run: $0 install"
    local epmd; epmd=$(command -v epmd) || die "epmd not found (Debian package erlang-base)"
    write_env
    if alive_with "$(recorded_pid)" rabbitmq-server; then
        amqp_ready || die "running but not answering AMQP; see $DATA_DIR/log"
        emit_env; return 0
    fi
    # A node whose launcher was killed (kill -9 of the beam) may linger; wait for it to go.
    local beam; beam=$(cat "$BEAM_PIDFILE" 2>/dev/null || true)
    if alive_with "$beam" "-home $DATA_DIR "; then
        wait_gone "$beam" 10 || die "beam.smp $beam still runs; stop it first: $0 stop $DATA_DIR"
    fi
    rm -f "$PIDFILE" "$BEAM_PIDFILE"
    if ! alive_with "$(cat "$EPMD_PIDFILE" 2>/dev/null || true)" "-port $EPMD_PORT"; then
        require_free "$EPMD_PORT" epmd
        nohup "$epmd" -port "$EPMD_PORT" -address 127.0.0.1 </dev/null >>"$DATA_DIR/log/epmd.log" 2>&1 &
        echo $! >"$EPMD_PIDFILE"
        poll 5 "$epmd" -port "$EPMD_PORT" -names >/dev/null 2>&1 || true
    fi
    for p in "$PORT" "$TLS_PORT" "$DIST_PORT"; do require_free "$p"; done
    (
        # shellcheck disable=SC1090
        . "$ENVFILE"
        cd "$DATA_DIR"
        nohup "$SBIN/rabbitmq-server" </dev/null >>"$DATA_DIR/log/startup.log" 2>&1 &
        echo $! >"$PIDFILE"
    )
    log "started rabbitmq-server pid $(cat "$PIDFILE") on 127.0.0.1:$PORT (logs $DATA_DIR/log)"
    wait_ready 90 "$DATA_DIR/log/startup.log" amqp_ready
    # The AMQP port answers a little before the node finished booting.
    "$DATA_DIR/bin/rabbitmqctl" -q await_startup --timeout 90 >/dev/null || die "await_startup failed; see $DATA_DIR/log"
    emit_env
}

stop() {
    local pid beam epmd
    pid=$(cat "$PIDFILE" 2>/dev/null || true)
    beam=$(cat "$BEAM_PIDFILE" 2>/dev/null || true)
    if alive_with "$pid" rabbitmq-server; then
        kill -TERM "$pid"
        wait_gone "$pid" 60 || log "launcher $pid still alive after 60 s"
    elif alive_with "$beam" "-home $DATA_DIR "; then
        kill -TERM "$beam"; wait_gone "$beam" 60 || true
    fi
    if alive_with "$beam" "-home $DATA_DIR "; then
        wait_gone "$beam" 10 || { kill -KILL "$beam" 2>/dev/null || true; wait_gone "$beam" 5 || true; }
    fi
    alive_with "$pid" rabbitmq-server && kill -KILL "$pid" 2>/dev/null || true
    rm -f "$PIDFILE" "$BEAM_PIDFILE"
    epmd=$(cat "$EPMD_PIDFILE" 2>/dev/null || true)
    if alive_with "$epmd" epmd; then
        kill -TERM "$epmd"; wait_gone "$epmd" 5 || kill -KILL "$epmd" 2>/dev/null || true
    fi
    rm -f "$EPMD_PIDFILE"
    log "stopped"
}

configure() {
    BEAM_PIDFILE=$DATA_DIR/rabbitmq-beam.pid
    EPMD_PIDFILE=$DATA_DIR/epmd.pid
    ENVFILE=$DATA_DIR/rabbitmq.env
    # Ports given now, else the ones this DATA_DIR used before (a restart keeps them).
    # shellcheck disable=SC1091
    [ -f "$DATA_DIR/ports" ] && . "$DATA_DIR/ports"
    PORT=${RABBITMQ_PORT:-${SAVED_PORT:-16572}}
    EPMD_PORT=${RABBITMQ_EPMD_PORT:-${SAVED_EPMD_PORT:-16369}}
    DIST_PORT=$((PORT + 100))
    TLS_PORT=$((PORT + 1))
    NODENAME=timer-test-$PORT@localhost
    printf 'SAVED_PORT=%s\nSAVED_EPMD_PORT=%s\n' "$PORT" "$EPMD_PORT" >"$DATA_DIR/ports"
}

server_main "$@"
