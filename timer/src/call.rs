//! The `Caller` contract: destinations the service calls itself, one fire at a time, beside the
//! broker (HTTP targets: webhooks). A broker takes a batch and confirms it; a call is one
//! request with an answer of its own, which may be slow, may ask to be tried later, or may
//! refuse for good. So the engine does not wait for calls with its batch: each call runs on its
//! own while its lease is held, and settles by itself ([`Called`]), so one slow endpoint never
//! holds back the fires of another endpoint, tenant or the broker.

use std::time::Duration;

use async_trait::async_trait;

use crate::broker::OutboundEvent;
use crate::outbound::{MessageMeta, Target};

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Called {
    /// The destination took it (an HTTP 2xx); `answer` says how, for the timer's history
    /// (`200 in 12 ms`).
    Delivered { answer: String },
    /// Not this time (a 5xx, 408, 429, a connection error, a timeout): tried again after the
    /// engine's backoff, or `not_before` from now if that is later (`Retry-After`), up to
    /// `engine.max_attempts`.
    Retry {
        error: String,
        not_before: Option<Duration>,
    },
    /// Refused for good (another 4xx, a redirect not followed, a target no longer allowed): the
    /// timer fails at once (`TimerFailed` to the dead-letter destination) with `error`.
    Refused { error: String },
    /// The caller has too many calls waiting for this destination already: handed back to be
    /// fired again after `after`, with no attempt counted, so a destination that is slow to
    /// answer holds a bounded number of claims.
    Busy { after: Duration },
}

#[async_trait]
pub trait Caller: Send + Sync + 'static {
    /// The caller's name (`webhook`), as logs and metrics name it.
    fn name(&self) -> &'static str;

    /// Whether `target` is one of this caller's (an HTTP target has a `url`); the others go to
    /// the broker.
    fn takes(&self, target: &Target) -> bool;

    /// Whether this caller can deliver to `target`, and the destination's name as
    /// `targets.allow` patterns match it (the URL): `Err` says what is wrong, and the engine
    /// refuses the timer (reason `invalid_target`), as for [`Broker::check_target`].
    ///
    /// [`Broker::check_target`]: crate::broker::Broker::check_target
    fn check_target(&self, target: &Target) -> Result<String, String>;

    /// Whether this caller can send a timer's own message (its content type and headers) to
    /// one of its targets: `Err` says what is wrong, and the engine refuses the timer.
    fn check_message(&self, _meta: &MessageMeta) -> Result<(), String> {
        Ok(())
    }

    /// Delivers one fire: `event.target` is one this caller [`takes`](Self::takes). Bounded in
    /// time by the caller itself; the engine holds the timer's lease meanwhile.
    async fn call(&self, event: &OutboundEvent) -> Called;
}
