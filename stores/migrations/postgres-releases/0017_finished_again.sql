-- oldest release: 0.1.0
-- Up to 0.2.0, a TimerCompleted of a timer that had finished (a Reached one-shot timer, say)
-- emptied its finished_at and reached_at: finished, but never purged. Such a row counts as
-- finished from this upgrade on, so engine.retention purges it that long after. A data fix
-- only: every release reads the column as it did.
UPDATE timers
   SET finished_at = (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT
 WHERE state IN (1, 2, 3) AND finished_at IS NULL;
