-- Tracing (#41): the W3C trace context a timer was scheduled in (`timer_core::TraceContext`),
-- sent with every fire. NULL for a timer stored before: each of its fires gets a fresh trace.
-- Nullable columns without a default: no table rewrite, and older instances ignore them.
ALTER TABLE timers ADD COLUMN traceparent TEXT;
ALTER TABLE timers ADD COLUMN tracestate TEXT;
