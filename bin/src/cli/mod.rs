//! The command line: the server's commands (`run`, `check-config`), the tools (`bench`, `fuzz`,
//! `hash-token`) and the client commands that talk to a running service ([`commands`] runs them
//! through [`client`]).

pub mod bench;
pub mod client;
pub mod commands;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

/// The release and the git revision built from, as `--version` and the status say them.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("SERVICE_REVISION"),
    ")"
);

#[derive(Parser)]
#[command(
    name = "timer-service",
    version = VERSION,
    about = "A durable, multi-tenant, broker-agnostic timer service"
)]
pub struct Cli {
    /// Config file (TOML). Default: config/timer-service.toml when it exists.
    #[arg(long, short, global = true, env = "TIMER_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the service: ingest commands, fire timers, serve the HTTP API.
    Run,
    /// Print the effective configuration (secrets redacted); exit 1 naming what is wrong.
    CheckConfig,
    /// Print the SHA-256 of an API key, for `[[http.keys]] sha256`. Reads the key from
    /// standard input when it is not given (keeps it out of the shell's history).
    HashToken {
        /// The key; `-` or nothing: the first line of standard input.
        key: Option<String>,
    },
    /// Measure lateness, herd, ingest, pending and restart on the configured store and broker
    /// (in this process, on a fresh temp SQLite file or PostgreSQL schema and broker resources
    /// of its own, never the configured data).
    Bench(bench::Options),
    /// Feed generated inputs to the command decoder: every one must get a typed answer.
    Fuzz {
        /// How many inputs.
        #[arg(long, default_value_t = 1_000_000)]
        inputs: u64,
        /// Seed of the generator (the same seed gives the same inputs).
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Talk to a running service through its HTTP API.
    #[command(flatten)]
    Client(Client),
}

/// The commands that talk to a running service through its HTTP API.
#[derive(Subcommand)]
pub enum Client {
    /// Schedule (or reschedule) a timer through a running service's HTTP API; or, with
    /// --file, every command of a file through the batch endpoint.
    Schedule {
        #[arg(long, required_unless_present = "file")]
        tenant: Option<String>,
        /// The service call id (the timer's id within the tenant).
        #[arg(long, required_unless_present = "file")]
        id: Option<String>,
        /// A file of ScheduleTimer commands (a JSON array, or one JSON object per line), sent
        /// in batches through POST /v1/timers/batch.
        #[arg(long, conflicts_with_all = ["tenant", "id", "at", "due_in", "correlation_id", "payload"])]
        file: Option<PathBuf>,
        /// Commands per batch with --file (at most the service's limits.max_batch).
        #[arg(long, default_value_t = 1000, requires = "file")]
        batch_size: usize,
        /// Due time as RFC 3339 with offset, e.g. 2027-01-15T10:00:00+01:00.
        #[arg(long, conflicts_with = "due_in")]
        at: Option<String>,
        /// Due after this long, e.g. 1s, 2m 30s.
        #[arg(long = "in", value_parser = humantime::parse_duration)]
        due_in: Option<Duration>,
        #[arg(long)]
        correlation_id: Option<String>,
        /// Opaque JSON echoed back in the DueTimeReached event.
        #[arg(long)]
        payload: Option<String>,
        #[command(flatten)]
        api: Api,
    },
    /// Show a timer: state, due time, when it fired, attempts.
    Get(TimerArgs),
    /// Cancel a scheduled or paused timer.
    Cancel(TimerArgs),
    /// Pause a timer: it does not fire until resumed.
    Pause {
        #[command(flatten)]
        timer: TimerArgs,
        /// Why; kept in the timer's history.
        #[arg(long)]
        note: Option<String>,
    },
    /// Resume a paused timer: a one-shot timer whose due time passed fires at once; a series
    /// goes on with its next occurrence from now (the ones missed are skipped).
    Resume(TimerArgs),
    /// Schedule a Failed timer again: published at once, its attempts back to 0.
    Retry(TimerArgs),
    /// Fire one extra DueTimeReached now ("trigger": "manual"), without moving the schedule.
    Trigger(TimerArgs),
    /// Report that the work an occurrence's event triggered is done (a TimerCompleted): frees a
    /// series with overlap skip or bufferOne, stops a one-shot timer's re-fires.
    Complete {
        #[command(flatten)]
        timer: TimerArgs,
        /// The event's payload.occurrence (default: the last fired one).
        #[arg(long)]
        occurrence: Option<u32>,
        /// How the work ended.
        #[arg(long, value_parser = ["succeeded", "failed"])]
        outcome: Option<String>,
        /// Kept in the timer's history (cut at 1 KiB).
        #[arg(long)]
        message: Option<String>,
    },
    /// A timer's history of changes, oldest first: one page, or every entry with --all (then
    /// one per line).
    History {
        #[command(flatten)]
        timer: TimerArgs,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Cancel, pause, resume or retry every timer of a tenant that the filters match, page by
    /// page.
    Bulk {
        #[arg(long)]
        tenant: String,
        #[arg(long, value_parser = ["cancel", "pause", "resume", "retry"])]
        action: String,
        #[command(flatten)]
        filter: FilterArgs,
        /// With --action pause: the note each paused timer's history gets.
        #[arg(long)]
        note: Option<String>,
        #[command(flatten)]
        api: Api,
    },
    /// This instance's version, store and broker health, counts, next due time and what fired
    /// in the last minute.
    Status {
        #[command(flatten)]
        api: Api,
    },
    /// List a tenant's timers, earliest due first, with filters; one page, or every page with
    /// --all (then one timer per line).
    List(ListArgs),
    /// Counts per state, next due time and recent failures: of one tenant, or of every tenant.
    Summary {
        /// One tenant; without it, every tenant (a page of them: --limit, --cursor).
        #[arg(long, conflicts_with_all = ["limit", "cursor"])]
        tenant: Option<String>,
        #[arg(long)]
        limit: Option<usize>,
        #[arg(long)]
        cursor: Option<String>,
        #[command(flatten)]
        api: Api,
    },
}

/// Which of a tenant's timers `list` and `bulk` take, as `GET /v1/tenants/{tenant}/timers`
/// filters them.
#[derive(clap::Args)]
pub struct FilterArgs {
    /// scheduled, paused, reached, cancelled or failed; repeat it or separate with commas for
    /// several.
    #[arg(long)]
    state: Vec<String>,
    /// Only timers whose id starts with this.
    #[arg(long)]
    prefix: Option<String>,
    /// Due at or after this time (RFC 3339 with offset, or epoch milliseconds).
    #[arg(long)]
    due_after: Option<String>,
    /// Due before this time (RFC 3339 with offset, or epoch milliseconds).
    #[arg(long)]
    due_before: Option<String>,
    /// Only recurring timers (true) or only one-shot timers (false).
    #[arg(long)]
    recurring: Option<bool>,
    /// Only Scheduled timers whose last publish failed (true), or all but those (false).
    #[arg(long)]
    retrying: Option<bool>,
}

impl FilterArgs {
    /// The filters as (name, value) pairs of the list's query string.
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut pairs: Vec<(&'static str, String)> = self
            .state
            .iter()
            .flat_map(|s| s.split(','))
            .filter(|s| !s.is_empty())
            .map(|s| ("state", s.to_owned()))
            .collect();
        let optional = [
            ("prefix", self.prefix.clone()),
            ("dueAfter", self.due_after.clone()),
            ("dueBefore", self.due_before.clone()),
            ("recurring", self.recurring.map(|r| r.to_string())),
            ("retrying", self.retrying.map(|r| r.to_string())),
        ];
        pairs.extend(optional.into_iter().filter_map(|(k, v)| Some((k, v?))));
        pairs
    }

    /// The filters as the JSON object of a bulk action. `--state` given with no state in it
    /// (`--state ""`, an empty shell variable) is sent as `[]`, which the service refuses: in a
    /// bulk action it would otherwise mean every state.
    fn json(&self) -> serde_json::Value {
        let mut filter = serde_json::Map::new();
        if !self.state.is_empty() {
            filter.insert("state".into(), serde_json::json!([]));
        }
        for (name, value) in self.pairs() {
            match (name, filter.get_mut(name)) {
                ("state", Some(serde_json::Value::Array(states))) => states.push(value.into()),
                ("recurring" | "retrying", _) => {
                    filter.insert(name.into(), (value == "true").into());
                }
                _ => {
                    filter.insert(name.into(), value.into());
                }
            }
        }
        filter.into()
    }
}

/// The filters and paging of `list`, as `GET /v1/tenants/{tenant}/timers` takes them.
#[derive(clap::Args)]
pub struct ListArgs {
    #[arg(long)]
    tenant: String,
    #[command(flatten)]
    filter: FilterArgs,
    #[command(flatten)]
    pub page: PageArgs,
    #[command(flatten)]
    api: Api,
}

/// One page of a list (`--limit`, `--cursor`), or every page (`--all`).
#[derive(clap::Args)]
pub struct PageArgs {
    /// Items per page, 1 to 1000 (the service's default: 100).
    #[arg(long)]
    limit: Option<usize>,
    /// Where to go on: the nextCursor of the page before.
    #[arg(long, conflicts_with = "all")]
    cursor: Option<String>,
    /// Follow nextCursor to the last page and print every item, one JSON object per line.
    #[arg(long)]
    pub all: bool,
}

impl PageArgs {
    /// `limit` and `cursor` as (name, value) pairs of a query string, those given.
    pub fn pairs(&self) -> Vec<(&'static str, String)> {
        let optional = [
            ("limit", self.limit.map(|n| n.to_string())),
            ("cursor", self.cursor.clone()),
        ];
        optional
            .into_iter()
            .filter_map(|(k, v)| Some((k, v?)))
            .collect()
    }
}

impl ListArgs {
    pub fn query(&self) -> Vec<(&'static str, String)> {
        let mut query = self.filter.pairs();
        query.extend(self.page.pairs());
        query
    }
}

/// One timer of a running service, by its key.
#[derive(clap::Args)]
pub struct TimerArgs {
    #[arg(long)]
    tenant: String,
    /// The service call id (the timer's id within the tenant).
    #[arg(long)]
    id: String,
    #[command(flatten)]
    api: Api,
}

#[derive(clap::Args)]
pub struct Api {
    /// Base URL of the service. Default: http://<http.addr from the config> (https:// when
    /// the config sets http.tls_cert).
    #[arg(long)]
    url: Option<String>,
    /// Bearer token (an API key or a JWT). Default: http.token from the config
    /// (TIMER_HTTP__TOKEN).
    #[arg(long)]
    token: Option<String>,
    #[command(flatten)]
    tls: client::ClientTls,
}

#[cfg(test)]
mod tests {
    use super::FilterArgs;

    fn filter(state: &[&str], prefix: Option<&str>) -> FilterArgs {
        FilterArgs {
            state: state.iter().map(|s| s.to_string()).collect(),
            prefix: prefix.map(str::to_owned),
            due_after: None,
            due_before: None,
            recurring: None,
            retrying: None,
        }
    }

    /// A bulk filter says what was given: no `--state` is any state, `--state ""` an empty list
    /// (refused by the service), never "any".
    #[test]
    fn a_bulk_filter_keeps_an_empty_state() {
        let json = |f: FilterArgs| f.json().to_string();
        assert_eq!(json(filter(&[], None)), "{}");
        assert_eq!(json(filter(&[""], None)), r#"{"state":[]}"#);
        assert_eq!(
            json(filter(&["paused,failed", "reached"], Some("o-"))),
            r#"{"prefix":"o-","state":["paused","failed","reached"]}"#
        );
    }
}
