-- Serves the list filter `retrying=true` (the dashboard's Failed page): a tenant's Scheduled timers
-- whose last publish failed, in list order. Without it the filter reads every timer of the tenant
-- to find the few that match. Only rows waiting for a retry are in it, so it stays small and
-- costs nothing on the usual schedule and fire.
CREATE INDEX timers_retrying ON timers (tenant_id, due_at, service_call_id)
    WHERE state = 0 AND attempts > 0;
