//! The optional abilities both sqlx stores offer with the shared [`Statements`]: control, history
//! and queries, written once in [`sql_abilities!`] for each store that says where it reads and
//! writes ([`SqlAbilities`]). A macro and not a blanket impl: the traits are timer-core's, and the
//! orphan rule allows no `impl<T: SqlAbilities> TimerControl for T` here.

use std::sync::atomic::AtomicUsize;

use super::{Dialect, Statements};

/// A sqlx store whose control, history and query abilities are the shared statements.
pub(crate) trait SqlAbilities: Dialect + Sized {
    /// The statements on the connections that read.
    fn reads(&self) -> Statements<'_, Self>;

    /// The statements on the connection that writes.
    fn writes(&self) -> Statements<'_, Self>;

    /// History entries kept per timer
    /// ([`TimerHistory::set_limit`](timer_core::TimerHistory::set_limit)).
    fn history_kept(&self) -> &AtomicUsize;
}

/// `TimerControl`, `TimerHistory` and `TimerQueries` for `$store`, a [`SqlAbilities`]: control
/// actions and history records on its writes, reads on its reads, each change recorded up to
/// its history limit.
macro_rules! sql_abilities {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl timer_core::TimerControl for $store {
            async fn apply(
                &self,
                keys: &[timer_core::TimerKey],
                action: &timer_core::Action,
                now: timer_core::Timestamp,
            ) -> timer_core::Result<Vec<timer_core::ControlOutcome>> {
                let limit = <$store as $crate::sql::SqlAbilities>::history_kept(self)
                    .load(std::sync::atomic::Ordering::Relaxed);
                <$store as $crate::sql::SqlAbilities>::writes(self)
                    .apply(keys, action, now, limit)
                    .await
            }
        }

        #[async_trait::async_trait]
        impl timer_core::TimerHistory for $store {
            fn set_limit(&self, per_timer: usize) {
                <$store as $crate::sql::SqlAbilities>::history_kept(self)
                    .store(per_timer, std::sync::atomic::Ordering::Relaxed);
            }

            async fn read(
                &self,
                key: &timer_core::TimerKey,
                after: u64,
                limit: usize,
            ) -> timer_core::Result<Vec<timer_core::HistoryEntry>> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .history(key, after, limit)
                    .await
            }

            async fn record(
                &self,
                key: &timer_core::TimerKey,
                at: timer_core::Timestamp,
                change: &timer_core::Change,
            ) -> timer_core::Result<bool> {
                let limit = <$store as $crate::sql::SqlAbilities>::history_kept(self)
                    .load(std::sync::atomic::Ordering::Relaxed);
                <$store as $crate::sql::SqlAbilities>::writes(self)
                    .record(key, at, change, limit)
                    .await
            }
        }

        #[async_trait::async_trait]
        impl timer_core::TimerQueries for $store {
            async fn list(
                &self,
                tenant: &str,
                filter: &timer_core::TimerFilter,
                after: Option<&timer_core::PageAfter>,
                limit: usize,
            ) -> timer_core::Result<Vec<timer_core::Timer>> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .list(tenant, filter, after, limit)
                    .await
            }

            async fn list_keys(
                &self,
                tenant: &str,
                filter: &timer_core::TimerFilter,
                after: Option<&timer_core::PageAfter>,
                limit: usize,
            ) -> timer_core::Result<Vec<timer_core::PageAfter>> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .list_keys(tenant, filter, after, limit)
                    .await
            }

            async fn tenants(
                &self,
                after: Option<&str>,
                limit: usize,
            ) -> timer_core::Result<Vec<String>> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .tenants(after, limit)
                    .await
            }

            async fn summaries(
                &self,
                tenants: &[String],
                failed_since: timer_core::Timestamp,
                fired_since: timer_core::Timestamp,
            ) -> timer_core::Result<Vec<timer_core::TenantSummary>> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .summaries(tenants, failed_since, fired_since)
                    .await
            }

            async fn count(&self, state: timer_core::TimerState) -> timer_core::Result<u64> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .count(state)
                    .await
            }

            async fn backlog(
                &self,
                now: timer_core::Timestamp,
                limit: usize,
            ) -> timer_core::Result<timer_core::Backlog> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .backlog(now, limit)
                    .await
            }

            async fn leased(&self) -> timer_core::Result<u64> {
                <$store as $crate::sql::SqlAbilities>::reads(self)
                    .leased()
                    .await
            }
        }
    };
}

pub(crate) use sql_abilities;

/// [`FairSteps`](timer_core::fair::FairSteps) for `$store`, a [`SqlAbilities`]: the earliest
/// rows, the count of the due and the tenant visit are the shared statements on its writes;
/// the shares are its own `claim_shares` (one statement on PostgreSQL, one per tenant on
/// SQLite).
macro_rules! sql_fair_steps {
    ($store:ty) => {
        #[async_trait::async_trait]
        impl timer_core::fair::FairSteps for $store {
            async fn claim_earliest(
                &self,
                due: timer_core::Due,
                limit: usize,
                lease: &timer_core::Lease,
            ) -> timer_core::Result<Vec<timer_core::ClaimedTimer>> {
                <$store as $crate::sql::SqlAbilities>::writes(self)
                    .claim(due, limit, lease)
                    .await
            }

            async fn visit_tenants(
                &self,
                now: timer_core::Timestamp,
                after: &str,
                visits: usize,
            ) -> timer_core::Result<Vec<timer_core::fair::Visited>> {
                <$store as $crate::sql::SqlAbilities>::writes(self)
                    .visit_tenants(now, after, visits)
                    .await
            }

            async fn more_due_than(
                &self,
                due: timer_core::Due,
                limit: usize,
            ) -> timer_core::Result<bool> {
                <$store as $crate::sql::SqlAbilities>::writes(self)
                    .more_due_than(due, limit)
                    .await
            }

            async fn claim_of_tenants(
                &self,
                due: timer_core::Due,
                shares: &[(String, usize)],
                lease: &timer_core::Lease,
            ) -> timer_core::Result<Vec<timer_core::ClaimedTimer>> {
                self.claim_shares(due, shares, lease).await
            }
        }
    };
}

pub(crate) use sql_fair_steps;
