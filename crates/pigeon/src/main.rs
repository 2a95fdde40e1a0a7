//! The `pigeon` binary: `pigeon serve` runs the server; the other subcommands are tools
//! around it.

mod bench;
mod chat;

use clap::{Parser, Subcommand};
use pigeon_server::{Config, ServeArgs};
use std::process::ExitCode;

/// mimalloc instead of glibc's malloc: under load the server frees and allocates frames,
/// batches and journal records from many threads, and glibc's allocator was ~13 % of the
/// server's CPU in `perf`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "pigeon",
    version,
    about = "Pigeon: an instant-messaging back end"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the server (embedded store under ./data, 127.0.0.1:8080, no setup needed).
    Serve(ServeArgs),
    /// Load scenarios against a running server (or one started with --spawn), with a
    /// delivery check (lost, duplicated, out of order) on every run.
    Bench(bench::BenchArgs),
    /// A terminal chat client: one-shot commands for scripts, or a line-mode session.
    Chat(chat::ChatArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The bench prints its own progress; only the server's warnings join it.
    let default_filter = match cli.command {
        Cmd::Serve(_) => "info",
        Cmd::Bench(_) | Cmd::Chat(_) => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PIGEON_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pigeon: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Cmd::Serve(args) => runtime.block_on(serve(args)),
        Cmd::Bench(args) => runtime.block_on(bench::run(args)),
        Cmd::Chat(args) => runtime.block_on(chat::run(args)),
    }
}

async fn serve(args: ServeArgs) -> ExitCode {
    let cfg = match Config::resolve(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("pigeon: {e}");
            return ExitCode::from(2);
        }
    };
    let data_dir = cfg.data_dir.clone();
    let running = match pigeon_server::start(cfg).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pigeon: cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    if running.admin_key_generated {
        // The key alone after "admin key: ", so a script finds it with the simplest pattern.
        println!("pigeon: admin key: {}", running.app.admin_key);
        println!(
            "pigeon: (generated on this first start and kept in {}; --admin-key or PIGEON_ADMIN_KEY sets your own)",
            data_dir.display()
        );
    }
    println!("pigeon: listening on http://{}", running.addr);
    wait_for_signal().await;
    tracing::info!("shutting down");
    running.shutdown().await;
    ExitCode::SUCCESS
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
