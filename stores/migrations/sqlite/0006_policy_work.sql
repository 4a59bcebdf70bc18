-- Recurring and completion policies (#22): `policy` is what the ScheduleTimer gave (overlap,
-- completionTimeout, catchUp, catchUpLimit, catchUpWindow, jitter; JSON of
-- `timer_core::policy::Policy`), `work` what the engine records about the timer's fires (the
-- occurrence awaiting its completion, a buffered one, counts; JSON of
-- `timer_core::policy::Work`). Both NULL for a timer without them: existing rows keep their
-- behaviour.
ALTER TABLE timers ADD COLUMN policy TEXT;
ALTER TABLE timers ADD COLUMN work TEXT;
