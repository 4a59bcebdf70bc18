-- oldest release: 0.1.0
-- The instance list (GET /v1/status `instances`): which release and revision each live
-- instance runs and when it last said it is alive (its keeper connection writes it about every
-- second). Nullable: an instance of 0.1.0 joins without them, and is listed with nulls.
ALTER TABLE timer_instances
    ADD COLUMN version TEXT,
    ADD COLUMN revision TEXT,
    ADD COLUMN last_seen_at BIGINT;
