//! End-to-end scenarios every broker plugin passes, on the built `timer-service` binary: a
//! malformed command is dead-lettered while the events keep flowing; an unreachable server is a
//! one-line error; `PauseTimer` and `ResumeTimer` hold a timer back and let it go; a service
//! killed during ingest loses no command (on every durable store); 10,000 timers survive a
//! service restart during ingest and a server outage while they fire; a tenant flooding at 10
//! times its rate limit is slowed without holding up another; a series with `overlap: skip`
//! fires only after each `TimerCompleted`; `bench --workload delay` sees every message arrive.
//!
//! Like the conformance suite, each scenario is an async check function; [`trials`] runs them
//! for one broker plugin. The service gets fresh resources from the plugin's `isolated` config,
//! written with a store section to a TOML file (`TIMER_CONFIG`); the test sends commands and
//! reads events and dead letters with the plugin's
//! [`TestClient`](timer_core::plugin::TestClient), and takes the server down with the script its
//! [`TestServer`](timer_core::plugin::TestServer) names. What differs between brokers is data in
//! [`BrokerTraits`].
//!
//! Here: the broker cases, their traits and [`trials`]; `setup.rs` gives a scenario its service,
//! `ingest.rs`, `control.rs` and `resilience.rs` hold the scenarios.

mod control;
mod delivery;
mod ingest;
mod resilience;
mod setup;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use timer_core::plugin::BrokerConfig;
use timer_core::{BrokerPlugin, StorePlugin};

use crate::e2e::ScriptedServer;
use crate::{server_trial_in, Check};

pub use control::{
    an_overlap_skip_series_fires_after_each_completion,
    pause_and_resume_commands_hold_a_timer_back_and_let_it_go,
};
pub use delivery::{
    a_timers_own_message_arrives_at_its_target_and_a_cancelled_one_does_not,
    an_event_its_destination_refuses_is_retried_alone, delivered_cancelled_and_dead_lettered,
    refusing_destination_setup,
    ten_thousand_delayed_messages_through_the_native_ingress_survive_a_kill,
    the_delay_bench_sees_every_message_arrive,
};
pub use ingest::{
    a_bound_broker_takes_commands_of_its_tenant_only,
    a_flooding_tenant_is_slowed_and_the_others_are_not,
    malformed_command_is_dead_lettered_and_events_keep_flowing,
};
#[cfg(feature = "sqlite")]
pub use resilience::a_command_stays_unacknowledged_while_the_store_refuses_writes;
pub use resilience::{
    an_unreachable_server_is_a_one_line_error, service_killed_during_ingest_loses_no_command,
    ten_thousand_timers_survive_a_service_restart_and_a_server_outage,
};
pub use setup::{commands, envelope, fires, timers, Setup};

/// One broker under test, and the store the service keeps its timers in.
#[derive(Clone)]
pub struct BrokerCase {
    pub plugin: &'static BrokerPlugin,
    pub store: &'static StorePlugin,
    /// The `timer-service` binary under test.
    pub bin: PathBuf,
    pub traits: BrokerTraits,
}

/// What differs between brokers in these scenarios. Where a broker can promise more than the
/// others, its bound is here, not a weaker one for all.
#[derive(Clone)]
pub struct BrokerTraits {
    /// `[broker]` keys the service gets on top of the isolated config.
    pub settings: Value,
    /// Timers whose event may arrive more than once (always with the same id) after a server
    /// outage; `None`: no bound beyond the same id.
    pub max_repeated: Option<usize>,
    /// A `[broker]` section pointing at a closed port, and how the last line of `run` must
    /// start; `{port}` in them stands for the port. The address carries the password `secret`
    /// where it can: it must not be shown.
    pub unreachable: Option<(Value, &'static str)>,
    /// How many commands the service's consumer has acknowledged to the broker, where the
    /// broker tells (Kafka: the group's committed offsets). They must all be stored.
    pub acknowledged: Option<for<'a> fn(&'a dyn BrokerConfig) -> BoxFuture<'a, u64>>,
    /// Why the test server cannot hand a killed consumer's commands to its successor, where it
    /// cannot: the ingest-kill scenario is left out, saying so.
    pub no_takeover: Option<&'static str>,
    /// The tenant the broker binds its test client's commands to with `broker.bind_tenant`
    /// (the NATS subject's last token, the Kafka key, the RabbitMQ user).
    pub bound_tenant: &'static str,
}

impl Default for BrokerTraits {
    fn default() -> Self {
        BrokerTraits {
            settings: json!({}),
            max_repeated: Some(0),
            unreachable: None,
            acknowledged: None,
            no_takeover: None,
            bound_tenant: "test",
        }
    }
}

/// Every scenario as a trial for `case.plugin`, named `brokers::<kind>::<scenario>`, and the
/// broker's `own` checks after them: the scenarios through the service's HTTP API for a broker
/// inside the service, all of them for a broker with a server (the ingest kill on every durable
/// store of `stores`). A trial whose server is not there is ignored with the reason. Each runs
/// in the broker's lane ([`crate::lanes`]): beside other brokers' trials, never beside another
/// of its own broker's (some stop its server); one that measures time runs alone.
pub fn trials(
    case: BrokerCase,
    stores: &[&'static StorePlugin],
    own: Vec<Check<Arc<BrokerCase>>>,
) -> Vec<libtest_mimic::Trial> {
    let kind = case.plugin.kind;
    let Some(server) = case.plugin.test_server else {
        let mut checks: Vec<Check<Arc<BrokerCase>>> = crate::checks![
            malformed_command_is_dead_lettered_and_events_keep_flowing,
            pause_and_resume_commands_hold_a_timer_back_and_let_it_go,
            an_overlap_skip_series_fires_after_each_completion,
        ];
        checks.push(crate::check!(a_flooding_tenant_is_slowed_and_the_others_are_not).alone());
        checks.extend(own);
        return to_trials(&format!("brokers::{kind}"), &Arc::new(case), None, checks);
    };
    let missing = ScriptedServer::of(&server).err();
    let mut checks = crate::checks![
        malformed_command_is_dead_lettered_and_events_keep_flowing,
        pause_and_resume_commands_hold_a_timer_back_and_let_it_go,
        an_overlap_skip_series_fires_after_each_completion,
        a_timers_own_message_arrives_at_its_target_and_a_cancelled_one_does_not,
        ten_thousand_delayed_messages_through_the_native_ingress_survive_a_kill,
        the_delay_bench_sees_every_message_arrive,
        an_unreachable_server_is_a_one_line_error,
        ten_thousand_timers_survive_a_service_restart_and_a_server_outage,
        a_bound_broker_takes_commands_of_its_tenant_only,
    ];
    checks.push(crate::check!(a_flooding_tenant_is_slowed_and_the_others_are_not).alone());
    #[cfg(feature = "sqlite")]
    if case.store.kind == "sqlite" {
        checks.extend(crate::checks![
            a_command_stays_unacknowledged_while_the_store_refuses_writes
        ]);
    }
    checks.extend(own);
    let mut trials = to_trials(
        &format!("brokers::{kind}"),
        &Arc::new(case.clone()),
        missing.clone(),
        checks,
    );
    if let Some(why) = server.not_restartable {
        trials.push(crate::known_gap_trial(
            format!("brokers::{kind}::timers_fire_through_an_outage_of_the_server"),
            why,
        ));
    }
    for store in stores {
        let prefix = format!("brokers::{kind}::on_{}", store.kind);
        if let Some(why) = case.traits.no_takeover {
            trials.push(crate::known_gap_trial(
                format!("{prefix}::service_killed_during_ingest_loses_no_command"),
                why,
            ));
            continue;
        }
        let case = Arc::new(BrokerCase {
            store,
            ..case.clone()
        });
        trials.extend(to_trials(
            &prefix,
            &case,
            missing.clone().or_else(|| store.unavailable()),
            crate::checks![service_killed_during_ingest_loses_no_command],
        ));
    }
    trials
}

fn to_trials(
    prefix: &str,
    case: &Arc<BrokerCase>,
    missing: Option<String>,
    checks: Vec<Check<Arc<BrokerCase>>>,
) -> Vec<libtest_mimic::Trial> {
    checks
        .into_iter()
        .map(|check| {
            let case = case.clone();
            server_trial_in(
                &format!("{prefix}::{}", check.name),
                missing.clone(),
                Some(check.lane(case.plugin.kind)),
                crate::TRIAL_LIMIT,
                move || (check.run)(case),
            )
        })
        .collect()
}

const WAIT: Duration = Duration::from_secs(60);
