//! The workloads over the HTTP API (ingest through `POST /v1/timers`, list pages), on a server
//! assembled by `server::app` as `run` assembles it.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use indicatif::ProgressBar;

use crate::cli::client::ClientTls;
use crate::config::Config;
use crate::http::listener::{self, Listening};

use super::rig::*;
use super::Run;

pub(super) async fn ingest_run(config: &Config, n: usize, tls: &ClientTls) -> anyhow::Result<Run> {
    let far = now_ms() + 86_400_000;
    let mut run = Run::new();

    // Broker path: commands on the in-process broker, read, decoded and stored in batches.
    let rig = start_rig(config, 1).await?;
    if let Some(hub) = &rig.hub {
        let bodies: Vec<String> = (0..n).map(|i| ingest_command('b', i, far)).collect();
        let bar = progress(n, "broker path");
        let started = Instant::now();
        for body in bodies {
            hub.send_command(body)?;
        }
        wait_pending(rig.engine.store(), n as u64, &bar).await?;
        bar.finish_and_clear();
        run.push((
            "broker path",
            "schedules/s",
            n as f64 / started.elapsed().as_secs_f64(),
        ));
    }
    rig.stop().await;

    // HTTP path: one timer per POST /v1/timers, 64 requests in flight.
    let rig = start_rig(config, 1).await?;
    let Served { base, client } = serve(&rig, config, tls).await?;
    let url = format!("{base}/v1/timers");
    let bar = progress(n, "http path");
    let started = Instant::now();
    let token = config.http.token.as_deref();
    let singles = (0..n).map(|i| (ingest_command('h', i, far), 1)).collect();
    let failures = post_all(&client, &url, token, singles, 64, &bar).await;
    let elapsed = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if failures > 0 {
        rig.stop().await;
        bail!("{failures} of {n} HTTP schedules failed");
    }
    run.push(("http path", "schedules/s", n as f64 / elapsed));

    // HTTP batch path: POST /v1/timers/batch with limits.max_batch commands each, 4 in flight.
    let url = format!("{base}/v1/timers/batch");
    let per_batch = config.limits.max_batch.max(1);
    let bar = progress(n, "http batches");
    let started = Instant::now();
    let batches: Vec<(String, usize)> = (0..n)
        .collect::<Vec<_>>()
        .chunks(per_batch)
        .map(|batch| {
            let commands: Vec<String> =
                batch.iter().map(|i| ingest_command('m', *i, far)).collect();
            (
                format!(r#"{{"commands":[{}]}}"#, commands.join(",")),
                batch.len(),
            )
        })
        .collect();
    let failures = post_all(&client, &url, token, batches, 4, &bar).await;
    let elapsed = started.elapsed().as_secs_f64();
    bar.finish_and_clear();
    rig.stop().await;
    if failures > 0 {
        bail!("{failures} of {n} schedules in HTTP batches failed");
    }
    run.push(("http batch path", "schedules/s", n as f64 / elapsed));
    Ok(run)
}

/// Serves the HTTP API on the rig's first engine, on a free port of 127.0.0.1, until the rig
/// stops.
pub(super) async fn serve(rig: &Rig, config: &Config, tls: &ClientTls) -> anyhow::Result<Served> {
    serve_counting(rig, config, tls, config.http.counts_max_age).await
}

/// The API a workload talks to: its root URL and a client for it.
pub(super) struct Served {
    /// `http://127.0.0.1:port`, or `https://` with http.tls_cert.
    base: String,
    client: reqwest::Client,
}

/// [`serve`], with counts shared for `counts_max_age` instead of `http.counts_max_age`.
pub(super) async fn serve_counting(
    rig: &Rig,
    config: &Config,
    tls: &ClientTls,
    counts_max_age: Duration,
) -> anyhow::Result<Served> {
    let prepared = crate::server::prepare(config)?;
    if prepared.auth.is_some() && config.http.token.is_none() {
        bail!(
            "the bench's HTTP workloads authenticate with http.token; with only http.keys or \
             http.jwt set, set http.token too"
        );
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("bind")?;
    let addr = listener.local_addr().context("addr")?;
    let scheme = if prepared.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let app = crate::server::app(
        config,
        crate::server::Serving {
            engine: rig.engine.clone(),
            auth: prepared.auth,
            metrics: None,
            memory_hub: rig.hub.clone(),
            shutdown: rig.shutdown.clone(),
            draining: tokio_util::sync::CancellationToken::new(),
            counts_max_age,
        },
    );
    tokio::spawn(listener::serve(
        listener,
        app,
        prepared.tls,
        Listening::of(&config.http),
        rig.shutdown.clone(),
    ));
    Ok(Served {
        base: format!("{scheme}://{addr}"),
        client: tls.builder()?.build().context("an HTTP client")?,
    })
}

/// `pending` timers in one tenant, then `requests` GETs of each of three list pages, one
/// after the other: the first page, a page 90% deep (by the cursor of paging there), and the
/// first page of a prefix that 1% of the timers have. Answer times as the client sees them.
pub(super) async fn list_run(
    config: &Config,
    pending: usize,
    requests: usize,
    tls: &ClientTls,
) -> anyhow::Result<Run> {
    let rig = start_rig_with(
        config,
        1,
        Preload {
            far: pending,
            one_tenant: true,
            ..Preload::default()
        },
    )
    .await?;
    let result = list_pages(&rig, config, pending, requests, tls).await;
    rig.stop().await;
    result
}

pub(super) async fn list_pages(
    rig: &Rig,
    config: &Config,
    pending: usize,
    requests: usize,
    tls: &ClientTls,
) -> anyhow::Result<Run> {
    let Served { base: root, client } = serve(rig, config, tls).await?;
    let token = config.http.token.as_deref();
    let base = format!("{root}/v1/tenants/{LIST_TENANT}/timers");
    let get = |url: String| {
        let request = client.get(url);
        let request = match token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        async move {
            let response = request.send().await.context("GET a list page")?;
            let status = response.status();
            let body: serde_json::Value = response.json().await.context("a JSON page")?;
            if !status.is_success() {
                bail!("the list answered {status}: {body}");
            }
            Ok(body)
        }
    };
    // Page there as a client would, 1,000 timers a page.
    let deep = pending * 9 / 10;
    let bar = progress(deep, "paging 90% in");
    let mut cursor: Option<String> = None;
    let mut seen = 0;
    while seen < deep {
        let url = match &cursor {
            Some(c) => format!("{base}?limit=1000&cursor={c}"),
            None => format!("{base}?limit=1000"),
        };
        let page = get(url).await?;
        let Some(next) = page["nextCursor"].as_str() else {
            bail!("the list ended after {seen} of {pending} timers");
        };
        cursor = Some(next.to_owned());
        seen += page["timers"].as_array().map_or(0, Vec::len);
        bar.set_position(seen as u64);
    }
    bar.finish_and_clear();
    let deep_cursor = cursor.unwrap_or_default();
    let mut run = Run::new();
    let pages = [
        (
            "first page p50",
            "first page p99",
            format!("{base}?limit=100"),
        ),
        (
            "deep page p50",
            "deep page p99",
            format!("{base}?limit=100&cursor={deep_cursor}"),
        ),
        // Ids are t00000000…: t0000 is the first 1% (up to 10,000 of 1,000,000).
        (
            "prefix page p50",
            "prefix page p99",
            format!("{base}?limit=100&prefix=t0000"),
        ),
    ];
    for (p50, p99, url) in pages {
        let (median, tail) = answer_times(
            requests,
            p50.trim_end_matches(" p50"),
            Duration::ZERO,
            || async {
                let page = get(url.clone()).await?;
                if page["timers"].as_array().is_none_or(Vec::is_empty) {
                    bail!("{url}: an empty page");
                }
                Ok(())
            },
        )
        .await?;
        run.push((p50, "ms", median));
        run.push((p99, "ms", tail));
    }
    // What the dashboard's overview asks every 2 s, both at once: the status and the first page
    // of tenant summaries (the 1M-timer tenant among them). The service shares one count for
    // `http.counts_max_age`, so time it both ways: as pollers see it (after a first request
    // that counted, one every 100 ms, while counts run in the background), and counting for
    // every request (a second server with `counts_max_age = 0s`).
    let overview = |root: String| {
        let get = &get;
        async move {
            let (status, summary) = tokio::join!(
                get(format!("{root}/v1/status")),
                get(format!("{root}/v1/summary?limit=100")),
            );
            status?;
            if summary?["tenants"].as_array().is_none_or(Vec::is_empty) {
                bail!("the summary lists no tenant");
            }
            Ok(())
        }
    };
    let shared = root.clone();
    overview(shared.clone()).await?;
    let (median, tail) =
        answer_times(requests, "overview", POLL_GAP, || overview(shared.clone())).await?;
    run.push(("overview p50", "ms", median));
    run.push(("overview p99", "ms", tail));
    // The second server's own client is not needed: the first one speaks to it as well.
    let counted = serve_counting(rig, config, tls, Duration::ZERO).await?.base;
    let (median, tail) = answer_times(
        requests.min(20),
        "overview, counting",
        Duration::ZERO,
        || overview(counted.clone()),
    )
    .await?;
    run.push(("overview counting p50", "ms", median));
    run.push(("overview counting p99", "ms", tail));
    run.push(("pending timers", "timers", pending as f64));
    run.push(("preload", "schedules/s", rig.preload_rate));
    Ok(run)
}

/// Between two requests of a poller in the overview bench.
pub(super) const POLL_GAP: Duration = Duration::from_millis(100);

/// Runs `one` `requests` times, one after the other and `gap` apart, with a progress bar: p50
/// and p99 of how long each took, in ms.
pub(super) async fn answer_times<F, Fut>(
    requests: usize,
    what: &str,
    gap: Duration,
    mut one: F,
) -> anyhow::Result<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let bar = progress(requests, what);
    let mut micros = Vec::with_capacity(requests);
    for _ in 0..requests {
        let started = Instant::now();
        one().await?;
        micros.push(i64::try_from(started.elapsed().as_micros()).unwrap_or(i64::MAX));
        bar.inc(1);
        if !gap.is_zero() {
            tokio::time::sleep(gap).await;
        }
    }
    bar.finish_and_clear();
    micros.sort_unstable();
    Ok((
        percentile(&micros, 0.5) / 1000.0,
        percentile(&micros, 0.99) / 1000.0,
    ))
}

/// The `i`-th command of an ingest run: 16 tenants, ids `<path><i>`, due at `far`.
pub(super) fn ingest_command(path: char, i: usize, far: i64) -> String {
    format!(
        r#"{{"tenantId":"bench-{}","serviceCallId":"{path}{i:08}","dueTimeMs":{far}}}"#,
        i % 16
    )
}

/// POSTs every body to `url`, `in_flight` at once, each carrying the given number of schedules;
/// returns how many schedules were in a request that did not succeed.
pub(super) async fn post_all(
    client: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    requests: Vec<(String, usize)>,
    in_flight: usize,
    bar: &ProgressBar,
) -> usize {
    futures::stream::iter(requests)
        .map(|(body, schedules)| {
            let request = client
                .post(url)
                .header("content-type", "application/json")
                .body(body);
            let request = match token {
                Some(token) => request.bearer_auth(token),
                None => request,
            };
            async move {
                let ok = matches!(request.send().await, Ok(r) if r.status().is_success());
                bar.inc(schedules as u64);
                if ok {
                    0
                } else {
                    schedules
                }
            }
        })
        .buffer_unordered(in_flight)
        .fold(0usize, |acc, f| async move { acc + f })
        .await
}
