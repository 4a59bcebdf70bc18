-- no-transaction
-- oldest release: 0.1.0
-- Serves the count of Failed timers (GET /v1/status, the dashboard) and the list filter
-- state=failed: without it both read every finished timer (timers_finished holds the fired
-- ones too, until they are purged). Built CONCURRENTLY, outside a transaction, so schedules
-- and fires go on while it builds; an invalid index a failed build left is dropped and built
-- again by the migration runner (stores/src/postgres/migrate.rs). IF NOT EXISTS: a build that
-- finished before its record was written is not built again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS timers_failed ON timers (tenant_id, due_at, service_call_id)
    WHERE state = 3
