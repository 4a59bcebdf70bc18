-- The control plane. New state code 4: Paused (not claimable; never purged: finished_at stays
-- NULL). history_seq: the number of the timer's last history entry.
ALTER TABLE timers ADD COLUMN history_seq BIGINT NOT NULL DEFAULT 0;

-- Each timer's changes (created, rescheduled, paused, resumed, skipped, triggered, fired,
-- publish_failed, given_up, cancelled), numbered per timer from 1; `change` is the JSON of
-- timer_core::Change. Written in the transaction of the change; the oldest beyond the limit per
-- timer are deleted as new ones come; deleted with the timer.
CREATE TABLE timer_history (
    tenant_id       TEXT   NOT NULL,
    service_call_id TEXT   NOT NULL,
    seq             BIGINT NOT NULL,
    at              BIGINT NOT NULL,
    change          TEXT   NOT NULL,
    PRIMARY KEY (tenant_id, service_call_id, seq),
    FOREIGN KEY (tenant_id, service_call_id) REFERENCES timers (tenant_id, service_call_id)
        ON DELETE CASCADE
);

-- Serves the count of Paused timers (the timer.paused gauge, the status).
CREATE INDEX timers_paused ON timers (tenant_id) WHERE state = 4;
