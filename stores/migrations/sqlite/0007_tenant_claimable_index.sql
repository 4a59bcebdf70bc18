-- Fair claims (timer_core::fair): a claim in a backlog visits the tenants that have Scheduled
-- rows, one index probe to step to the next tenant and one to see whether its earliest row is
-- due, then takes each due tenant's earliest rows. This index serves all three, so the cost of a
-- claim grows with the number of tenants it visits, not with the number of rows due.
-- `available_at IS NOT NULL` (always true: the column is NOT NULL) is in the predicate so that
-- only a query that names available_at can use the index: a settle (state = 0 and a key) must
-- not, or a planner with statistics from a nearly empty table reads the index once per settled
-- key, every row of the tenant each time, instead of the primary key (as 0010 explains for
-- timers_leased).
CREATE INDEX timers_tenant_claimable ON timers (tenant_id, available_at)
    WHERE state = 0 AND available_at IS NOT NULL;
