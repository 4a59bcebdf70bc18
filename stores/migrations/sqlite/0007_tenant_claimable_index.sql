-- Fair claims (timer_core::fair): a claim in a backlog visits the tenants that have Scheduled
-- rows, one index probe to step to the next tenant and one to see whether its earliest row is
-- due, then takes each due tenant's earliest rows. This index serves all three, so the cost of a
-- claim grows with the number of tenants it visits, not with the number of rows due.
CREATE INDEX timers_tenant_claimable ON timers (tenant_id, available_at) WHERE state = 0;
