-- Timers, keyed by (tenant_id, service_call_id). Times are UTC epoch milliseconds (BIGINT), the
-- same form every store uses, so comparisons are exact and indexable.
-- state: 0 Scheduled, 1 Reached, 2 Cancelled. available_at is when the row may next be claimed:
-- the due time, or the end of a lease or of a retry backoff; never before due_at.
CREATE TABLE timers (
    tenant_id       TEXT     NOT NULL,
    service_call_id TEXT     NOT NULL,
    due_at          BIGINT   NOT NULL,
    state           SMALLINT NOT NULL DEFAULT 0,
    registered_at   BIGINT   NOT NULL,
    reached_at      BIGINT,
    finished_at     BIGINT,
    correlation_id  TEXT,
    payload         TEXT,
    attempts        INTEGER  NOT NULL DEFAULT 0,
    last_error      TEXT,
    lease_owner     TEXT,
    available_at    BIGINT   NOT NULL,
    revision        BIGINT   NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, service_call_id)
);

-- Serves claim_due (state = 0 AND available_at <= now ORDER BY available_at ... SKIP LOCKED),
-- next_due_at and the pending count; holds only Scheduled rows.
CREATE INDEX timers_claimable ON timers (available_at) WHERE state = 0;

-- Serves purge of finished rows.
CREATE INDEX timers_finished ON timers (finished_at) WHERE state <> 0;
