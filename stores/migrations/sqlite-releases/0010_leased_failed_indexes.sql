-- oldest release: 0.1.0
-- The leases held now (the instance list's `leases`): only leased rows are in it.
CREATE INDEX timers_leased ON timers (lease_until) WHERE state = 0 AND lease_until IS NOT NULL;
-- Serves the count of Failed timers (GET /v1/status, the dashboard) and the list filter
-- state=failed, which otherwise read every finished timer.
CREATE INDEX timers_failed ON timers (tenant_id, due_at, service_call_id) WHERE state = 3;
