//! Wake-ups across instances: LISTEN on the schema's NOTIFY channel, forwarded to this
//! instance's firing tasks. The NOTIFYs themselves go out with the writes (`schedule`, `settle`
//! in store.rs).

use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use timer_core::Timestamp;
use tokio::sync::broadcast;
use tracing::{info, warn};

use super::root_cause;

/// Forwards NOTIFYs of `channel` to `tx`, reconnecting on loss. Whenever listening (re)starts it
/// sends the epoch so firing tasks replan (notices sent meanwhile are gone).
pub(super) async fn listen(pool: PgPool, channel: String, tx: broadcast::Sender<Timestamp>) {
    let pause = |failures: u32| Duration::from_millis(100 * u64::from(failures.min(50)));
    let mut failures = 0u32;
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                failures += 1;
                warn!(error = %root_cause(&e), "postgres store: LISTEN connection failed; retrying");
                tokio::time::sleep(pause(failures)).await;
                continue;
            }
        };
        if let Err(e) = listener.listen(&channel).await {
            failures += 1;
            warn!(error = %root_cause(&e), "postgres store: LISTEN failed; retrying");
            tokio::time::sleep(pause(failures)).await;
            continue;
        }
        failures = 0;
        // Schedules by other instances before LISTEN answered (at start, or while the
        // connection was down) went unheard: have the firing tasks replan.
        info!(channel = %channel, "postgres store: listening for wake-ups");
        let _ = tx.send(Timestamp::EPOCH);
        loop {
            match listener.try_recv().await {
                Ok(Some(n)) => {
                    if let Ok(ms) = n.payload().parse::<i64>() {
                        let _ = tx.send(Timestamp::from_millis(ms));
                    }
                }
                // The connection dropped; the next call reconnects and listens again.
                Ok(None) => {
                    warn!("postgres store: LISTEN connection lost; reconnecting");
                    let _ = tx.send(Timestamp::EPOCH);
                }
                Err(e) => {
                    warn!(error = %root_cause(&e), "postgres store: LISTEN connection failed");
                    break;
                }
            }
        }
        // A server that accepts and then drops connections must not make this a tight loop.
        failures += 1;
        tokio::time::sleep(pause(failures)).await;
    }
}
