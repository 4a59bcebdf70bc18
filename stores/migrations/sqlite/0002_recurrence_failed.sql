-- Recurring timers: the recurrence (cron pattern, time zone, optional end and maximum, as JSON)
-- and how many occurrences fired. A recurring row stays Scheduled; due_at is its next occurrence.
-- New state code 3: Failed (publishing failed engine.max_attempts times).
-- lease_until: when the live lease of lease_owner ends (NULL when none): a cancel is refused
-- while it lies ahead, whatever available_at says after a reschedule.
ALTER TABLE timers ADD COLUMN recurrence TEXT;
ALTER TABLE timers ADD COLUMN occurrences INTEGER NOT NULL DEFAULT 0;
ALTER TABLE timers ADD COLUMN lease_until INTEGER;
