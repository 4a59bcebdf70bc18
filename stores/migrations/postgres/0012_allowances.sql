-- Rate allowances shared by every instance on this schema (limits.rate.shared): one row per
-- kind ('rate': schedules, 'fire': fires) and tenant, holding the theoretical arrival time of a
-- generic cell rate algorithm in microseconds since the epoch. A missing row is a full
-- allowance; rows whose time has passed are deleted now and then.
CREATE TABLE timer_allowances (
    kind      TEXT   NOT NULL,
    tenant_id TEXT   COLLATE "C" NOT NULL,
    tat       BIGINT NOT NULL,
    PRIMARY KEY (kind, tenant_id)
);
