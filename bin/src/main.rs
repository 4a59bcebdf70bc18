//! The timer-service binary: CLI, config, plugin assembly, HTTP API.

mod actions;
mod api;
mod auth;
mod batch;
mod bench;
mod client;
mod config;
mod control;
mod counted;
mod fuzz;
mod http;
mod https;
mod plugins;
mod ui;
// The docs cover every plugin, so their generator and checks need every plugin compiled in.
#[cfg(all(
    test,
    feature = "sqlite",
    feature = "postgres",
    feature = "nats",
    feature = "rabbitmq",
    feature = "kafka"
))]
mod reference;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use timer_core::engine::metric;
use timer_core::{Engine, SystemClock};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::config::{Config, LogFormat};

#[derive(Parser)]
#[command(
    name = "timer-service",
    version,
    about = "A durable, multi-tenant, broker-agnostic timer service"
)]
struct Cli {
    /// Config file (TOML). Default: config/timer-service.toml when it exists.
    #[arg(long, short, global = true, env = "TIMER_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
        /// Entries per page, 1 to 1000 (the service's default: 100).
        #[arg(long)]
        limit: Option<usize>,
        /// Where to go on: the nextCursor of the page before.
        #[arg(long, conflicts_with = "all")]
        cursor: Option<String>,
        #[arg(long)]
        all: bool,
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
        #[arg(long)]
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
struct FilterArgs {
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

    /// The filters as the JSON object of a bulk action.
    fn json(&self) -> serde_json::Value {
        let mut filter = serde_json::Map::new();
        for (name, value) in self.pairs() {
            match (name, filter.get_mut(name)) {
                ("state", Some(serde_json::Value::Array(states))) => states.push(value.into()),
                ("state", _) => {
                    filter.insert(name.into(), serde_json::json!([value]));
                }
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
struct ListArgs {
    #[arg(long)]
    tenant: String,
    #[command(flatten)]
    filter: FilterArgs,
    /// Timers per page, 1 to 1000 (the service's default: 100).
    #[arg(long)]
    limit: Option<usize>,
    /// Where to go on: the nextCursor of the page before.
    #[arg(long, conflicts_with = "all")]
    cursor: Option<String>,
    /// Follow nextCursor to the last page and print every timer, one JSON object per line.
    #[arg(long)]
    all: bool,
    #[command(flatten)]
    api: Api,
}

impl ListArgs {
    fn query(&self) -> Vec<(&'static str, String)> {
        let mut query = self.filter.pairs();
        let optional = [
            ("limit", self.limit.map(|n| n.to_string())),
            ("cursor", self.cursor.clone()),
        ];
        query.extend(optional.into_iter().filter_map(|(k, v)| Some((k, v?))));
        query
    }
}

/// One timer of a running service, by its key.
#[derive(clap::Args)]
struct TimerArgs {
    #[arg(long)]
    tenant: String,
    /// The service call id (the timer's id within the tenant).
    #[arg(long)]
    id: String,
    #[command(flatten)]
    api: Api,
}

#[derive(clap::Args)]
struct Api {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The key `hash-token` hashes: the argument, or the first line of standard input.
fn key_to_hash(given: Option<&str>) -> anyhow::Result<String> {
    let key = match given {
        Some(key) if key != "-" => key.to_owned(),
        _ => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .context("reading the key from standard input")?;
            line.trim_end_matches(['\r', '\n']).to_owned()
        }
    };
    if key.trim().is_empty() {
        anyhow::bail!("the key is empty");
    }
    Ok(key)
}

fn load_config(path: Option<&std::path::Path>) -> anyhow::Result<Config> {
    let figment = config::figment(path).map_err(|e| anyhow::anyhow!(e.chain()))?;
    config::load(&figment).map_err(|e| anyhow::anyhow!(e.chain()))
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    // Needs no config: a key can be hashed before there is one.
    if let Command::HashToken { key } = &cli.command {
        println!("{}", auth::hash_token(&key_to_hash(key.as_deref())?));
        return Ok(());
    }
    let config = load_config(cli.config.as_deref())?;
    // The API the client commands talk to: --url/--token, else http.addr/http.token.
    let api_client = |api: &Api| {
        let base = api.url.clone().unwrap_or_else(|| {
            let scheme = if config.http.tls_cert.is_some() {
                "https"
            } else {
                "http"
            };
            format!("{scheme}://{}", config.http.addr)
        });
        let token = api.token.clone().or_else(|| config.http.token.clone());
        client::Client::new(&base, token, &api.tls)
    };
    let print = |v: serde_json::Value| {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    };
    // `POST …/{action}` on one timer (pause, resume, retry, trigger, complete), the answer printed.
    let act = |t: TimerArgs, action: &'static str, body: Option<serde_json::Value>| {
        let client = api_client(&t.api);
        async move {
            print(client?.act(&t.tenant, &t.id, action, body).await?);
            Ok(())
        }
    };
    match cli.command {
        Command::HashToken { .. } => Ok(()),
        Command::Run => run(config).await,
        Command::Bench(options) => bench::run(config, options).await,
        Command::Fuzz { inputs, seed } => fuzz::run(inputs, seed, &config.limits),
        Command::CheckConfig => {
            print!(
                "{}",
                config::render_redacted(&config).map_err(|e| anyhow::anyhow!(e.chain()))?
            );
            Ok(())
        }
        Command::Schedule {
            file: Some(file),
            batch_size,
            api,
            ..
        } => {
            let commands = client::read_commands(&file)?;
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(commands.len() as u64),
                indicatif::ProgressDrawTarget::stderr(),
            );
            let client = api_client(&api)?;
            print(client::schedule_all(&client, &commands, batch_size, &bar).await?);
            Ok(())
        }
        Command::Schedule {
            tenant,
            id,
            at,
            due_in,
            correlation_id,
            payload,
            api,
            ..
        } => {
            // clap requires both without --file.
            let (Some(tenant), Some(id)) = (tenant, id) else {
                anyhow::bail!("give --tenant and --id, or --file");
            };
            let cmd = client::command(
                &tenant,
                &id,
                at.as_deref(),
                due_in,
                correlation_id.as_deref(),
                payload.as_deref(),
            )?;
            print(api_client(&api)?.schedule(cmd).await?);
            Ok(())
        }
        Command::Get(t) => {
            print(api_client(&t.api)?.get(&t.tenant, &t.id).await?);
            Ok(())
        }
        Command::Cancel(t) => {
            print(api_client(&t.api)?.cancel(&t.tenant, &t.id).await?);
            Ok(())
        }
        Command::Pause { timer: t, note } => {
            let body = note.map(|note| serde_json::json!({ "note": note }));
            act(t, "pause", body).await
        }
        Command::Resume(t) => act(t, "resume", None).await,
        Command::Retry(t) => act(t, "retry", None).await,
        Command::Trigger(t) => act(t, "trigger", None).await,
        Command::Complete {
            timer: t,
            occurrence,
            outcome,
            message,
        } => {
            let body = serde_json::json!({
                "occurrence": occurrence,
                "outcome": outcome,
                "message": message,
            });
            act(t, "complete", Some(body)).await
        }
        Command::History {
            timer: t,
            limit,
            cursor,
            all,
        } => {
            let client = api_client(&t.api)?;
            let mut query: Vec<(&'static str, String)> = Vec::new();
            query.extend(limit.map(|n| ("limit", n.to_string())));
            query.extend(cursor.map(|c| ("cursor", c)));
            if !all {
                print(client.history(&t.tenant, &t.id, &query).await?);
                return Ok(());
            }
            print_every_page(query, "history", |q| {
                let (client, t) = (&client, &t);
                async move { client.history(&t.tenant, &t.id, &q).await }
            })
            .await
        }
        Command::Bulk {
            tenant,
            action,
            filter,
            note,
            api,
        } => {
            let mut body = serde_json::json!({ "action": action, "filter": filter.json() });
            if let Some(note) = note {
                body["note"] = note.into();
            }
            let bar = indicatif::ProgressBar::new_spinner()
                .with_message(format!("{action} on tenant {tenant}, page by page…"));
            bar.enable_steady_tick(Duration::from_millis(200));
            let answer = api_client(&api)?.bulk(&tenant, &body).await;
            bar.finish_and_clear();
            print(answer?);
            Ok(())
        }
        Command::Status { api } => {
            print(api_client(&api)?.status().await?);
            Ok(())
        }
        Command::List(args) => {
            let client = api_client(&args.api)?;
            let query = args.query();
            if !args.all {
                print(client.list(&args.tenant, &query).await?);
                return Ok(());
            }
            print_every_page(query, "timers", |q| {
                let (client, args) = (&client, &args);
                async move { client.list(&args.tenant, &q).await }
            })
            .await
        }
        Command::Summary {
            tenant,
            limit,
            cursor,
            api,
        } => {
            let query: Vec<(&str, String)> =
                [("limit", limit.map(|n| n.to_string())), ("cursor", cursor)]
                    .into_iter()
                    .filter_map(|(k, v)| Some((k, v?)))
                    .collect();
            print(api_client(&api)?.summary(tenant.as_deref(), &query).await?);
            Ok(())
        }
    }
}

/// Prints each item of `field` of every page, one JSON object per line: `fetch` with `query`,
/// then again with the page's `nextCursor` as `cursor`, until a page has none.
async fn print_every_page<F, Fut>(
    mut query: Vec<(&'static str, String)>,
    field: &str,
    mut fetch: F,
) -> anyhow::Result<()>
where
    F: FnMut(Vec<(&'static str, String)>) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<serde_json::Value>>,
{
    loop {
        let page = fetch(query.clone()).await?;
        for item in page[field].as_array().into_iter().flatten() {
            println!("{item}");
        }
        let Some(cursor) = page["nextCursor"].as_str() else {
            return Ok(());
        };
        query.retain(|(k, _)| *k != "cursor");
        query.push(("cursor", cursor.to_owned()));
    }
}

fn init_logging(config: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(&config.log.level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match config.log.format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

fn init_metrics() -> anyhow::Result<PrometheusHandle> {
    // Seconds: from 1 ms (the precision we promise) to a minute.
    const BUCKETS: &[f64] = &[
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .context("metrics buckets")?
        .install_recorder()
        .context("installing the metrics recorder")?;
    metric::describe();
    Ok(handle)
}

async fn run(config: Config) -> anyhow::Result<()> {
    init_logging(&config);
    let metrics = init_metrics()?;
    let store = config
        .store
        .open()
        .await
        .map_err(|e| anyhow::anyhow!(e.chain()))?;
    let (broker, memory_hub) = plugins::broker(config.broker.as_ref())
        .await
        .map_err(|e| anyhow::anyhow!(e.chain()))?;
    let engine = Engine::new(
        store,
        broker,
        std::sync::Arc::new(SystemClock),
        config.engine.clone(),
        config.limits.clone(),
    );
    let tls = https::server_config(&config.http).map_err(|e| anyhow::anyhow!(e.chain()))?;
    let listener = tokio::net::TcpListener::bind(config.http.addr)
        .await
        .with_context(|| format!("cannot listen on http.addr {}", config.http.addr))?;
    // A name another running instance holds stops the start here, with its error.
    engine
        .join()
        .await
        .map_err(|e| anyhow::anyhow!(e.chain()))?;
    let shutdown = CancellationToken::new();
    let engine_task = engine.start(shutdown.clone());
    tokio::spawn(http::pending_gauge(engine.clone(), shutdown.clone()));
    let state = http::AppState {
        engine: engine.clone(),
        metrics: Some(metrics),
        memory_hub,
        shutdown: shutdown.clone(),
        counts: counted::Counts::new(config.http.counts_max_age),
        ready: counted::Cached::new("readiness", http::READY_MAX_AGE),
        streams: http::EventStreams::new(&config.http),
        auth: auth::Auth::from_config(&config.http)
            .map_err(|e| anyhow::anyhow!(e.chain()))?
            .map(std::sync::Arc::new),
    };
    let app = http::router(state, &config);
    info!(
        addr = %config.http.addr,
        https = tls.is_some(),
        store = engine.store().name(),
        broker = engine.broker().name(),
        instance = engine.instance_id(),
        "timer-service running"
    );
    tokio::spawn(signal(shutdown.clone()));
    let limits = https::Listening::of(&config.http);
    if let Err(e) = https::serve(listener, app, tls, limits, shutdown.clone()).await {
        error!(error = %e, "HTTP server failed");
        shutdown.cancel();
    }
    engine_task.await.context("engine task")?;
    info!("stopped");
    Ok(())
}

/// Cancels `shutdown` on SIGINT or SIGTERM.
async fn signal(shutdown: CancellationToken) {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => info!("SIGINT: shutting down"),
        _ = term => info!("SIGTERM: shutting down"),
    }
    shutdown.cancel();
}
