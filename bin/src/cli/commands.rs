//! The client commands: each builds its request from the command line, sends it through
//! [`ApiClient`], and prints the answer as JSON.

use std::time::Duration;

use anyhow::Context;

use super::client::{self, Client as ApiClient};
use super::{Api, Client, TimerArgs};
use crate::config::Config;

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

/// `hash-token`: the SHA-256 of the key given, or of the first line of standard input.
pub fn hash_token(given: Option<&str>) -> anyhow::Result<()> {
    println!("{}", crate::http::auth::hash_token(&key_to_hash(given)?));
    Ok(())
}

/// Runs a client command against the service of `config` (or `--url`), printing its answer.
pub async fn run(command: Client, config: &Config) -> anyhow::Result<()> {
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
        ApiClient::new(&base, token, &api.tls)
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
    match command {
        Client::Schedule {
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
            let counts = client::schedule_all(&client, &commands, batch_size, &bar).await?;
            let refused = counts["outcomes"]["refused"].as_u64().unwrap_or(0);
            print(counts);
            if refused > 0 {
                anyhow::bail!(
                    "{refused} of {} commands were refused (each named above); the others \
                     were stored",
                    commands.len()
                );
            }
            Ok(())
        }
        Client::Schedule {
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
        Client::Get(t) => {
            print(api_client(&t.api)?.get(&t.tenant, &t.id).await?);
            Ok(())
        }
        Client::Cancel(t) => {
            print(api_client(&t.api)?.cancel(&t.tenant, &t.id).await?);
            Ok(())
        }
        Client::Pause { timer: t, note } => {
            let body = note.map(|note| serde_json::json!({ "note": note }));
            act(t, "pause", body).await
        }
        Client::Resume(t) => act(t, "resume", None).await,
        Client::Retry(t) => act(t, "retry", None).await,
        Client::Trigger(t) => act(t, "trigger", None).await,
        Client::Complete {
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
        Client::History { timer: t, page } => {
            let client = api_client(&t.api)?;
            let query = page.pairs();
            if !page.all {
                print(client.history(&t.tenant, &t.id, &query).await?);
                return Ok(());
            }
            print_every_page(query, "history", |q| {
                let (client, t) = (&client, &t);
                async move { client.history(&t.tenant, &t.id, &q).await }
            })
            .await
        }
        Client::Bulk {
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
        Client::Status { api } => {
            print(api_client(&api)?.status().await?);
            Ok(())
        }
        Client::List(args) => {
            let client = api_client(&args.api)?;
            let query = args.query();
            if !args.page.all {
                print(client.list(&args.tenant, &query).await?);
                return Ok(());
            }
            print_every_page(query, "timers", |q| {
                let (client, args) = (&client, &args);
                async move { client.list(&args.tenant, &q).await }
            })
            .await
        }
        Client::Summary {
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
