//! Runs the Store and Broker conformance suites against every compiled-in plugin. Trial names:
//! `conformance::store::<plugin>::<check>`, `conformance::broker::<plugin>::<check>`.
//! A plugin whose server is missing shows its trials as ignored (reason printed), or fails them
//! when `TIMER_TEST_REQUIRE=1`.

use std::sync::Arc;

use libtest_mimic::{Arguments, Failed, Trial};
use timer_conformance::fixtures::{broker_factories, require_servers, store_factories};
use timer_conformance::{broker, store};

fn runtime() -> Result<tokio::runtime::Runtime, Failed> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Failed::from(format!("tokio runtime: {e}")))
}

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for factory in store_factories() {
        let factory: Arc<dyn timer_conformance::fixtures::StoreFactory> = Arc::from(factory);
        let missing = factory.unavailable();
        announce("store", factory.name(), &missing);
        for check in store::checks() {
            let factory = factory.clone();
            let missing = missing.clone();
            let name = format!("conformance::store::{}::{}", factory.name(), check.name);
            let ignored = missing.is_some() && !require_servers();
            trials.push(
                Trial::test(name, move || {
                    if let Some(why) = missing {
                        return Err(
                            format!("server required (TIMER_TEST_REQUIRE=1) but {why}").into()
                        );
                    }
                    runtime()?.block_on(async {
                        let fresh = factory.fresh().await.map_err(|e| Failed::from(e.chain()))?;
                        (check.run)(fresh.store.clone()).await;
                        Ok(())
                    })
                })
                .with_ignored_flag(ignored),
            );
        }
    }
    for factory in broker_factories() {
        let factory: Arc<dyn timer_conformance::fixtures::BrokerFactory> = Arc::from(factory);
        let missing = factory.unavailable();
        announce("broker", factory.name(), &missing);
        for check in broker::checks() {
            let factory = factory.clone();
            let missing = missing.clone();
            let name = format!("conformance::broker::{}::{}", factory.name(), check.name);
            let ignored = missing.is_some() && !require_servers();
            trials.push(
                Trial::test(name, move || {
                    if let Some(why) = missing {
                        return Err(
                            format!("server required (TIMER_TEST_REQUIRE=1) but {why}").into()
                        );
                    }
                    runtime()?.block_on(async {
                        let fixture = factory.fresh().await.map_err(|e| Failed::from(e.chain()))?;
                        (check.run)(fixture).await;
                        Ok(())
                    })
                })
                .with_ignored_flag(ignored),
            );
        }
    }
    libtest_mimic::run(&args, trials).exit();
}

fn announce(suite: &str, plugin: &str, missing: &Option<String>) {
    if let Some(why) = missing {
        if require_servers() {
            eprintln!(
                "conformance::{suite}::{plugin}: {why}; TIMER_TEST_REQUIRE=1, so its trials fail"
            );
        } else {
            eprintln!("conformance::{suite}::{plugin}: ignored: {why}");
        }
    }
}
