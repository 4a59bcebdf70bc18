-- oldest release: 0.1.0
-- Up to 0.2.0, a TimerCompleted of a timer that had finished (a Reached one-shot timer, say)
-- emptied its finished_at and reached_at: finished, but never purged. Such a row counts as
-- finished from this upgrade on, so engine.retention purges it that long after.
UPDATE timers
   SET finished_at = CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
 WHERE state IN (1, 2, 3) AND finished_at IS NULL;
