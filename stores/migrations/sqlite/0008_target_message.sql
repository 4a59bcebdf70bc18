-- Delayed delivery (#39): `target` is where a timer's fires go in place of the events
-- destination (JSON object of `timer_core::Target`, in the broker's own terms), `message` the
-- producer's own bytes sent in place of the envelope, `message_meta` their content type and
-- headers (JSON of `timer_core::MessageMeta`). All NULL for a timer without them: existing
-- rows keep their behaviour.
ALTER TABLE timers ADD COLUMN target TEXT;
ALTER TABLE timers ADD COLUMN message BLOB;
ALTER TABLE timers ADD COLUMN message_meta TEXT;
