//! Plumbing every SDK-backed broker needs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use timer_core::{Delivery, Error, Result};

/// The commands delivered and not yet acknowledged: the tag the engine sees → what the SDK
/// needs to acknowledge it (a message, a delivery tag, a partition and offset).
pub(crate) struct DeliveryTags<T> {
    broker: &'static str,
    next: AtomicU64,
    pending: Mutex<HashMap<u64, T>>,
}

impl<T> DeliveryTags<T> {
    /// `broker` names the broker in errors.
    pub(crate) fn new(broker: &'static str) -> Self {
        DeliveryTags {
            broker,
            next: AtomicU64::new(1),
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps `handle` under a new tag; the delivery the engine gets carries that tag (and the
    /// tenant the broker binds it to, if any: [`Delivery::tenant`]).
    pub(crate) fn remember(
        &self,
        handle: T,
        body: Vec<u8>,
        tenant: Option<String>,
    ) -> Result<Delivery> {
        let tag = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock()?.insert(tag, handle);
        Ok(Delivery { tag, body, tenant })
    }

    /// The handles of `tags`, forgotten; tags not (or no longer) known are skipped.
    pub(crate) fn take(&self, tags: &[u64]) -> Result<Vec<T>> {
        let mut pending = self.lock()?;
        Ok(tags.iter().filter_map(|t| pending.remove(t)).collect())
    }

    /// Copies of the handles of `tags`, still remembered; tags not known are skipped.
    #[cfg(feature = "nats")]
    pub(crate) fn get(&self, tags: &[u64]) -> Result<Vec<T>>
    where
        T: Clone,
    {
        let pending = self.lock()?;
        Ok(tags
            .iter()
            .filter_map(|t| pending.get(t).cloned())
            .collect())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<u64, T>>> {
        self.pending.lock().map_err(|_| {
            Error::internal(format!(
                "{} broker: a thread panicked while holding the delivery tags",
                self.broker
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_new_and_taken_once() {
        let tags = DeliveryTags::new("test");
        let a = tags.remember("a", b"1".to_vec(), None).unwrap();
        let b = tags.remember("b", b"2".to_vec(), Some("t".into())).unwrap();
        assert_eq!(b.tenant.as_deref(), Some("t"));
        assert_ne!(a.tag, b.tag);
        assert_eq!(b.body, b"2");
        assert_eq!(tags.take(&[b.tag, 999, a.tag]).unwrap(), vec!["b", "a"]);
        assert!(tags.take(&[a.tag]).unwrap().is_empty());
    }
}
