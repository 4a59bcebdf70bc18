//! The options of `timer-service bench` (`tools::bench` runs it).

use std::time::Duration;

use super::client::ClientTls;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    Lateness,
    Herd,
    /// A herd of one tenant and a trickle of 8 others: the others' lateness while it drains.
    Fairness,
    Ingest,
    /// `--pending` timers far in the future, then the lateness workload on top; RSS reported.
    Pending,
    /// `--pending` timers and one past due in the store, then the engine starts: time to the
    /// first fire.
    Restart,
    /// `--pending` timers in one tenant, then list pages over HTTP: answer times.
    List,
    /// `--pending` far-future 1 KiB messages (RSS reported), then `--timers` delayed messages
    /// through the broker's delay ingress over `--over`: their lateness at the destinations.
    Delay,
    /// `--timers` timers with an HTTP target, due evenly over `--over`, called on a receiver of
    /// the bench on 127.0.0.1: their lateness at the receiver.
    Webhook,
    All,
}

/// What `timer-service bench` measures, and how often.
#[derive(Debug, clap::Args)]
pub struct Options {
    #[arg(long, value_enum, default_value = "all")]
    pub workload: Workload,
    /// Timers per run (list: requests per page).
    #[arg(long, default_value_t = 10_000)]
    pub timers: usize,
    /// Lateness workload: spread the due times over this long (fairness: the trickle goes on
    /// this long after the herd is due).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub over: Duration,
    /// Runs per workload; the table shows the median.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Engines sharing the store (each with its own connection pool), as separate
    /// instances would; for lateness and herd.
    #[arg(long, default_value_t = 1)]
    pub instances: usize,
    /// Pending (far-future) timers for the pending, restart, list and delay workloads.
    #[arg(long, default_value_t = 1_000_000)]
    pub pending: usize,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// How the HTTP workloads' client speaks HTTPS, when the config sets http.tls_cert.
    #[command(flatten)]
    pub tls: ClientTls,
}
