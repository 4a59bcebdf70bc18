-- Timers, keyed by (tenant_id, service_call_id). Times are UTC epoch milliseconds (INTEGER), so
-- comparisons are exact and indexable. state: 0 Scheduled, 1 Reached, 2 Cancelled.
-- available_at is when the row may next be claimed: the due time, or the end of a lease or of a
-- retry backoff. It is never before due_at.
CREATE TABLE timers (
    tenant_id       TEXT    NOT NULL,
    service_call_id TEXT    NOT NULL,
    due_at          INTEGER NOT NULL,
    state           INTEGER NOT NULL DEFAULT 0,
    registered_at   INTEGER NOT NULL,
    reached_at      INTEGER,
    finished_at     INTEGER,
    correlation_id  TEXT,
    payload         TEXT,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    lease_owner     TEXT,
    available_at    INTEGER NOT NULL,
    revision        INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, service_call_id)
);

-- Serves claim_due (state = 0 AND available_at <= now ORDER BY available_at) and next_due_at.
CREATE INDEX timers_claimable ON timers (available_at) WHERE state = 0;

-- Serves purge of finished rows.
CREATE INDEX timers_finished ON timers (finished_at) WHERE state <> 0;
