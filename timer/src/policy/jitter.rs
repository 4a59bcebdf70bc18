//! Jitter: the offset of each occurrence's fire time, derived from the timer's key, and the
//! check that it keeps occurrences in order.

use std::time::Duration;

use super::{Policy, JITTER_CHECKED_OCCURRENCES};
use crate::model::{TimerKey, Timestamp};
use crate::recurrence::Schedule;

/// The offset in [0, `jitter`) of the occurrence at `nominal` of `key`: the same for the same
/// occurrence, every time (a name hash of key and occurrence).
pub fn jitter_offset(key: &TimerKey, nominal: Timestamp, jitter: Duration) -> Duration {
    let span = u64::try_from(jitter.as_millis()).unwrap_or(u64::MAX);
    if span == 0 {
        return Duration::ZERO;
    }
    let name = format!(
        "{}\u{0}{}\u{0}{}",
        key.tenant_id,
        key.service_call_id,
        nominal.as_millis()
    );
    let hash = uuid::Uuid::new_v5(&JITTER_NAMESPACE, name.as_bytes()).into_bytes();
    let mut word = [0u8; 8];
    word.copy_from_slice(&hash[..8]);
    Duration::from_millis(u64::from_be_bytes(word) % span)
}

/// Namespace of the jitter hash (a fixed random UUID; never change it: fire times would move).
const JITTER_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x0b8e_52d1_7c4f_4a39_9e06_3f2a_61d8_c5b7);

/// When the occurrence at `nominal` fires under `policy`: `nominal` plus its jitter offset.
pub fn fire_time(key: &TimerKey, nominal: Timestamp, policy: Option<&Policy>) -> Timestamp {
    match policy.and_then(|p| p.jitter) {
        Some(jitter) => nominal.saturating_add(jitter_offset(key, nominal, jitter)),
        None => nominal,
    }
}

/// Whether `jitter` fits the series: shorter than the shortest gap between two of its next
/// [`JITTER_CHECKED_OCCURRENCES`] occurrences from `first` on. `Err` names that gap.
pub fn check_jitter(
    schedule: &Schedule,
    first: Timestamp,
    jitter: Duration,
) -> Result<(), Duration> {
    let mut shortest: Option<Duration> = None;
    let mut at = first;
    for _ in 1..JITTER_CHECKED_OCCURRENCES {
        let Some(next) = schedule.after(at) else {
            break;
        };
        let gap = next.duration_since(at);
        shortest = Some(shortest.map_or(gap, |s| s.min(gap)));
        at = next;
    }
    match shortest {
        Some(gap) if jitter >= gap => Err(gap),
        _ => Ok(()),
    }
}
