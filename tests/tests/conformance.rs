//! Runs the Store and Broker conformance suites against every compiled-in plugin of the
//! registries. Trial names: `conformance::store::<plugin>::<check>`,
//! `conformance::broker::<plugin>::<check>`. A plugin whose server is missing shows its trials
//! as ignored (reason printed), or fails them when `TIMER_TEST_REQUIRE=1`.

use libtest_mimic::Arguments;
use timer_conformance::fixtures::{fresh_broker, fresh_store};
use timer_conformance::{broker, server_trial, store};

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    for plugin in timer_stores::PLUGINS.iter() {
        for check in store::checks() {
            let name = format!("conformance::store::{}::{}", plugin.kind, check.name);
            trials.push(server_trial(
                &name,
                plugin.unavailable(),
                move || async move {
                    let fresh = fresh_store(plugin)
                        .await
                        .unwrap_or_else(|e| panic!("{}", e.chain()));
                    (check.run)(fresh.store.clone()).await;
                },
            ));
        }
    }
    for plugin in timer_brokers::PLUGINS.iter() {
        for check in broker::checks() {
            let name = format!("conformance::broker::{}::{}", plugin.kind, check.name);
            trials.push(server_trial(
                &name,
                plugin.unavailable(),
                move || async move {
                    let fresh = fresh_broker(plugin)
                        .await
                        .unwrap_or_else(|e| panic!("{}", e.chain()));
                    (check.run)(fresh.client.clone()).await;
                },
            ));
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
