//! The timer-service binary: reads the command line and the config, then runs the server
//! ([`server`]), a tool ([`tools`]) or a client command ([`cli`]).
//!
//! The modules form layers, each importing only those below it: `main` → `cli`, `server`,
//! `tools` → `http` → `config`, `plugins` (a test checks there is no cycle).

mod cli;
mod config;
mod http;
mod plugins;
mod server;
mod telemetry;
mod tools;

#[cfg(test)]
mod crates;
#[cfg(test)]
mod layers;
#[cfg(test)]
mod sizes;
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

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};

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
            eprintln!("error: {}", timer_core::error::one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    // Needs no config: a key can be hashed before there is one.
    if let Command::HashToken { key } = &cli.command {
        return cli::commands::hash_token(key.as_deref());
    }
    let config =
        config::figment(cli.config.as_deref()).and_then(|figment| config::load(&figment))?;
    match cli.command {
        Command::HashToken { .. } => Ok(()),
        Command::Run => server::run(config).await,
        Command::CheckConfig => {
            server::prepare(&config)?;
            let rendered = config::render_redacted(&config)?;
            print!("{rendered}");
            Ok(())
        }
        Command::Bench(options) => tools::bench::run(config, options).await,
        Command::Fuzz { inputs, seed } => tools::fuzz::run(inputs, seed, &config.limits),
        Command::Client(command) => cli::commands::run(command, &config).await,
    }
}
