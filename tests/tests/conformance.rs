//! Runs the Store and Broker conformance suites against every compiled-in plugin of the
//! registries. Trial names: `conformance::store::<plugin>::<check>`,
//! `conformance::broker::<plugin>::<check>`. A plugin whose server is missing shows its trials
//! as ignored (reason printed), or fails them when `TIMER_TEST_REQUIRE=1`.

use std::future::Future;

use libtest_mimic::{Arguments, Trial};
use timer_conformance::fixtures::{fresh_broker, fresh_store};
use timer_conformance::{broker, server_trial, store, Check};

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for plugin in timer_stores::PLUGINS.iter() {
        let fresh = move || async move { fresh_store(plugin).await.map(|f| (f.it.clone(), f)) };
        let missing = plugin.unavailable();
        trials.extend(suite(
            "store",
            plugin.kind,
            missing.clone(),
            store::checks(),
            fresh,
        ));
        let reopenable = move || async move { fresh_store(plugin).await.map(|f| (f, ())) };
        trials.extend(suite(
            "store",
            plugin.kind,
            missing,
            store::restart_checks(),
            reopenable,
        ));
    }
    for plugin in timer_brokers::PLUGINS.iter() {
        let fresh = move || async move { fresh_broker(plugin).await.map(|f| (f.it.clone(), f)) };
        let missing = plugin.unavailable();
        trials.extend(suite(
            "broker",
            plugin.kind,
            missing.clone(),
            broker::checks(),
            fresh,
        ));
        let Some(server) = plugin.test_server else {
            continue; // in process: no server to take away
        };
        let proxied = move || async move {
            let fresh = fresh_broker(plugin).await?;
            let stand_in = match server.bypasses_proxies {
                None => broker::through_a_proxy(plugin, fresh).await,
                Some(_) => broker::on_a_private_server(plugin, fresh).await,
            };
            stand_in.map(|p| (p, ()))
        };
        trials.extend(suite(
            "broker",
            plugin.kind,
            missing,
            broker::server_gone_checks(),
            proxied,
        ));
    }
    libtest_mimic::run(&args, trials).exit();
}

/// One trial per check, each on a fresh resource from `fresh` (the resource, and what keeps it
/// alive until the check ends).
fn suite<R, K, F, Fut>(
    family: &str,
    kind: &str,
    missing: Option<String>,
    checks: Vec<Check<R>>,
    fresh: F,
) -> Vec<Trial>
where
    R: Send + 'static,
    K: Send + 'static,
    F: Fn() -> Fut + Copy + Send + 'static,
    Fut: Future<Output = timer_core::Result<(R, K)>>,
{
    checks
        .into_iter()
        .map(|check| {
            let name = format!("conformance::{family}::{kind}::{}", check.name);
            server_trial(&name, missing.clone(), move || async move {
                let (resource, _keep) = fresh().await.unwrap_or_else(|e| panic!("{}", e.chain()));
                (check.run)(resource).await;
            })
        })
        .collect()
}
