//! Every broker plugin of `timer_brokers::PLUGINS` end to end on the built binary: the shared
//! scenarios of `timer_conformance::scenarios` (a malformed command dead-lettered, an
//! unreachable server, a command kept unacknowledged while the store refuses writes, the
//! service killed during ingest, 10,000 timers through a service restart and a server outage
//! by SIGKILL), then what each broker has of its own (the modules below). A
//! broker inside the service (memory) runs the scenarios that make sense through its HTTP API.
//!
//! A broker whose server is not there is ignored with the reason (a failure under
//! `TIMER_TEST_REQUIRE=1`; `bash scripts/test.sh` starts every server and sets
//! `TIMER_TEST_<BROKER>_*`, the data directory too, because some trials restart the server).
//!
//! Each broker's trials run one at a time, in its lane (`timer_conformance::lanes`), since some
//! stop its server; the brokers' lanes run side by side, and a trial that measures time runs
//! alone. `--test-threads=1` runs every trial one after another.

#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
#[cfg(feature = "rabbitmq")]
mod rabbitmq;

use std::sync::Arc;

use libtest_mimic::Arguments;
use timer_conformance::scenarios::{self, BrokerCase, BrokerTraits};
use timer_conformance::Check;
use timer_core::StorePlugin;

const BIN: &str = env!("CARGO_BIN_EXE_timer-service");

fn main() {
    let mut args = Arguments::from_args();
    let sqlite = timer_stores::PLUGINS
        .get("sqlite")
        .expect("the sqlite store is compiled in");
    // Stores that outlive the service, for the ingest kill.
    let durable: Vec<&'static StorePlugin> = timer_stores::PLUGINS
        .iter()
        .filter(|store| store.kind != "memory")
        .collect();
    let mut trials = Vec::new();
    for plugin in timer_brokers::PLUGINS.iter() {
        let (traits, own) = of_its_own(plugin.kind);
        let case = BrokerCase {
            plugin,
            store: sqlite,
            bin: BIN.into(),
            traits,
        };
        trials.extend(scenarios::trials(case, &durable, own()));
    }
    // A thread for every trial: one whose lane is taken waits there without a core, and the
    // others go on (fewer threads could all be waiting on one lane while another is free).
    args.test_threads.get_or_insert(trials.len().max(1));
    libtest_mimic::run(&args, trials).exit();
}

/// What a broker's module says about it: how it differs in the scenarios, and its own checks.
type OwnChecks = fn() -> Vec<Check<Arc<BrokerCase>>>;

fn of_its_own(kind: &str) -> (BrokerTraits, OwnChecks) {
    match kind {
        #[cfg(feature = "nats")]
        "nats" => (nats::traits(), nats::checks),
        #[cfg(feature = "kafka")]
        "kafka" => (kafka::traits(), kafka::checks),
        #[cfg(feature = "rabbitmq")]
        "rabbitmq" => (rabbitmq::traits(), rabbitmq::checks),
        _ => (BrokerTraits::default(), Vec::new),
    }
}
