-- Fast takeover (#23): every running instance is listed here while it holds its session-level
-- advisory lock (on hashtextextended('timer-service <schema> <owner>', 0)); a listed owner whose
-- lock is free died, and `take_over` releases its leases at once (stores/src/postgres/owners.rs).
CREATE TABLE timer_instances (
    owner TEXT COLLATE "C" PRIMARY KEY,
    joined_at BIGINT NOT NULL
);
-- The leases an owner holds, found without reading the other timers. Small: a row leaves it when
-- its claim is settled (or re-claimed by another owner).
CREATE INDEX timers_leased ON timers (lease_owner) WHERE state = 0 AND lease_owner IS NOT NULL;
