-- Serves the control plane's list of a tenant's timers: ordered by due time, then service call
-- id, read page by page from where the last page ended (keyset pagination).
CREATE INDEX timers_tenant_due ON timers (tenant_id, due_at, service_call_id);
