//! One row of `timers` decoded with the dialect's column types ([`TimerRow`]).

use std::marker::PhantomData;

use sqlx::{ColumnIndex, Database, Decode, Row, Type};
use timer_core::policy::{Policy, Work};
use timer_core::{
    ClaimedTimer, Error, Message, MessageMeta, Recurrence, Result, Target, Timer, TimerKey,
    TimerState, Timestamp, TraceContext,
};

use super::{db_err, Dialect};

/// A counter as stored, clamped into `u32` (a negative one reads as 0).
fn count(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

/// One row of `timers`, decoded with the dialect's column types.
pub(crate) struct TimerRow<'r, D: Dialect> {
    row: &'r <D::Db as Database>::Row,
    dialect: PhantomData<D>,
}

impl<'r, D> TimerRow<'r, D>
where
    D: Dialect,
    &'static str: ColumnIndex<<D::Db as Database>::Row>,
    i64: Decode<'r, D::Db> + Type<D::Db>,
    String: Decode<'r, D::Db> + Type<D::Db>,
    Vec<u8>: Decode<'r, D::Db> + Type<D::Db>,
{
    pub(crate) fn of(row: &'r <D::Db as Database>::Row) -> Self {
        TimerRow {
            row,
            dialect: PhantomData,
        }
    }

    fn get<T: Decode<'r, D::Db> + Type<D::Db>>(&self, column: &'static str) -> Result<T> {
        self.row
            .try_get(column)
            .map_err(|e| db_err::<D>("reading a timer", e))
    }

    fn time(&self, column: &'static str) -> Result<Timestamp> {
        self.get(column).map(Timestamp::from_millis)
    }

    fn count(&self, column: &'static str) -> Result<u32> {
        Ok(count(self.get::<D::Count>(column)?.into()))
    }

    pub(crate) fn key(&self) -> Result<TimerKey> {
        Ok(TimerKey {
            tenant_id: self.get("tenant_id")?,
            service_call_id: self.get("service_call_id")?,
        })
    }

    /// A JSON column (`recurrence`, `policy`, `work`, `target`) read with its type's parser;
    /// NULL is `None`.
    fn json<T>(&self, column: &'static str, parse: fn(&str) -> Result<T>) -> Result<Option<T>> {
        self.get::<Option<String>>(column)?
            .as_deref()
            .map(parse)
            .transpose()
    }

    /// The `message` body and its `message_meta`.
    fn message(&self) -> Result<Option<Message>> {
        let Some(body) = self.get::<Option<Vec<u8>>>("message")? else {
            return Ok(None);
        };
        let meta = match self.get::<Option<String>>("message_meta")? {
            Some(text) => MessageMeta::from_json(&text)?,
            None => MessageMeta::default(),
        };
        Ok(Some(Message { body, meta }))
    }

    /// The `state` column.
    fn state(&self) -> Result<TimerState> {
        let code: i64 = self.get::<D::State>("state")?.into();
        TimerState::from_code(code)
            .ok_or_else(|| Error::internal(format!("{} store: unknown state code {code}", D::NAME)))
    }

    /// A row a claim returned.
    /// The claimed timer of this row; `None`, with an error logged, when the row cannot be read
    /// (JSON a later release wrote, or edited by hand): it stays leased and is claimed again
    /// when its lease ends, perhaps by an instance that can read it. One such row must not
    /// take the rest of its batch with it, whose leases would hold them for as long.
    pub(crate) fn claimed_readable(&self) -> Option<ClaimedTimer> {
        match self.claimed() {
            Ok(claimed) => Some(claimed),
            Err(e) => {
                let key = self
                    .key()
                    .map_or_else(|_| "?".to_owned(), |k| k.to_string());
                tracing::error!(
                    timer = %key,
                    error = %e.chain(),
                    "a claimed timer cannot be read; it is left to its lease and claimed again \
                     when that ends"
                );
                None
            }
        }
    }

    pub(crate) fn claimed(&self) -> Result<ClaimedTimer> {
        Ok(ClaimedTimer {
            key: self.key()?,
            due_at: self.time("due_at")?,
            registered_at: self.time("registered_at")?,
            correlation_id: self.get("correlation_id")?,
            payload: self.get("payload")?,
            attempts: self.count("attempts")?,
            revision: self.get("revision")?,
            recurrence: self.json("recurrence", Recurrence::from_json)?,
            occurrences: self.count("occurrences")?,
            policy: self.json("policy", Policy::from_json)?,
            work: self.json("work", Work::from_json)?,
            target: self.json("target", Target::from_json)?,
            message: self.message()?,
            trace: TraceContext::from_stored(
                self.get::<Option<String>>("traceparent")?.as_deref(),
                self.get::<Option<String>>("tracestate")?.as_deref(),
            ),
        })
    }

    /// A row of [`TIMER_COLUMNS`](super::TIMER_COLUMNS): what a claim returns, with the state,
    /// the last fire and the lease besides.
    pub(crate) fn timer(&self) -> Result<Timer> {
        let ClaimedTimer {
            key,
            due_at,
            registered_at,
            correlation_id,
            payload,
            attempts,
            revision: _,
            recurrence,
            occurrences,
            policy,
            work,
            target,
            message,
            trace,
        } = self.claimed()?;
        Ok(Timer {
            key,
            due_at,
            state: self.state()?,
            registered_at,
            reached_at: self
                .get::<Option<i64>>("reached_at")?
                .map(Timestamp::from_millis),
            correlation_id,
            payload,
            attempts,
            last_error: self.get("last_error")?,
            lease_owner: self.get("lease_owner")?,
            available_at: self.time("available_at")?,
            recurrence,
            occurrences,
            policy,
            work,
            target,
            message,
            trace,
        })
    }
}
