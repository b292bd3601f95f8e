//! The `kvindex` command line: `serve`, `bridge`, the operator's commands (`health`, `config`,
//! `workers`, `lookup`, `dump`), and the development tools forwarded to `kvindex-tools`.
//!
//! - this file: the commands and their flags, logging, dispatch;
//! - [`inspect`]: `workers`, `lookup` and `dump` over the daemon's inspect API;
//! - [`http`]: the plain HTTP client those and `health` use;
//! - [`tools`]: `demo`, `bench`, `e2e`, `gen`, `bridge-bench`, `shard-bench` forwarded.

pub mod http;
pub mod inspect;
mod tools;

use crate::config::{explain_table, Config, ConnectFlags, Flags};
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use kvindex_bridge::{BridgeConfig, BridgeFlags};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "kvindex", version, about = "Global KV-cache block index for KV-aware LLM routing")]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
    /// Parse the command line, then exit without running it (tests check deployment files so).
    #[arg(long, global = true, hide = true)]
    check_args: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: ingest KV events from NATS, answer lookups, serve metrics.
    Serve(ServeArgs),
    /// Beside an engine (vLLM, SGLang; docs/ENGINES.md): its ZMQ KV events in, kvindex's protocol out.
    Bridge(BridgeArgs),
    /// Ask a running kvindex's HTTP server: exit 0 if the path answers 200 (a container
    /// healthcheck that needs no curl).
    Health(HealthArgs),
    /// Print the configuration `serve` would run with (given the same flags), each value with
    /// the layer it comes from: default, file, environment variable or flag.
    Config(ServeArgs),
    /// What a running kvindex knows of each worker: blocks per tier, epoch, last heard, stale
    /// and why (its inspect API).
    Workers(WorkersArgs),
    /// Ask a running kvindex who holds a prompt's prefix, by tokens or local hashes.
    Lookup(LookupArgs),
    /// A worker's blocks in a running kvindex, as a replay stream (JSONL).
    Dump(DumpArgs),
    /// See it work: NATS, the daemon, mock engines and a KV-aware router on a real trace
    /// (runs `kvindex-tools demo`).
    #[command(disable_help_flag = true)]
    Demo(ToolArgs),
    /// Replay a trace or stream against index backends (runs `kvindex-tools bench`).
    #[command(disable_help_flag = true)]
    Bench(ToolArgs),
    /// NATS, the daemon, mock engines and a router on one machine (runs `kvindex-tools e2e`).
    #[command(disable_help_flag = true)]
    E2e(ToolArgs),
    /// A Mooncake trace as a JSONL replay stream (runs `kvindex-tools gen`).
    #[command(disable_help_flag = true)]
    Gen(ToolArgs),
    /// The bridge's throughput (runs `kvindex-tools bridge-bench`).
    #[command(disable_help_flag = true)]
    BridgeBench(ToolArgs),
    /// Shards against one daemon (runs `kvindex-tools shard-bench`).
    #[command(disable_help_flag = true)]
    ShardBench(ToolArgs),
}

/// A development tool's arguments, passed on as they are.
#[derive(Args)]
struct ToolArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

/// What `serve` and `bridge` share besides NATS: the configuration file and the log format.
#[derive(Args)]
struct DaemonFlags {
    /// Config file (default: config/kvindex.toml if present).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
}

/// Flags of `serve`; each overrides the config file and the `KVINDEX_*` environment.
#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    daemon: DaemonFlags,
    #[command(flatten)]
    flags: Flags,
}

/// Flags of `bridge`; each overrides the config file's `[bridge]` table and `KVINDEX_BRIDGE_*`.
#[derive(Args)]
struct BridgeArgs {
    #[command(flatten)]
    daemon: DaemonFlags,
    #[command(flatten)]
    connect: ConnectFlags,
    #[command(flatten)]
    bridge: BridgeFlags,
}

#[derive(Args)]
struct HealthArgs {
    /// The daemon's metrics_addr (the same variable as `serve`'s; 0.0.0.0 reaches this host).
    #[arg(long, env = "KVINDEX_METRICS_ADDR", default_value = "127.0.0.1:9464")]
    addr: String,
    /// /readyz (ready: in the lookup group) or /healthz (alive).
    #[arg(long, default_value = "/readyz")]
    path: String,
}

/// Where the daemon's inspect API is.
#[derive(Args)]
struct InspectFlags {
    /// The daemon's inspect_addr (the same variable as `serve`'s).
    #[arg(long, env = "KVINDEX_INSPECT_ADDR", default_value = "127.0.0.1:9466")]
    addr: String,
    /// Its inspect_token, if it has one.
    #[arg(long, env = "KVINDEX_INSPECT_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

impl InspectFlags {
    fn api(self) -> inspect::Api {
        inspect::Api { addr: self.addr, token: self.token }
    }
}

#[derive(Args)]
struct WorkersArgs {
    #[command(flatten)]
    inspect: InspectFlags,
    /// Print the API's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct LookupArgs {
    #[command(flatten)]
    inspect: InspectFlags,
    /// Token ids, whitespace- or comma-separated or a JSON array.
    #[arg(long, conflicts_with_all = ["text", "hashes"])]
    tokens_file: Option<PathBuf>,
    /// A text whose UTF-8 bytes are the token ids (no tokenizer: for byte-level models and
    /// tests; give a real model's ids with --tokens-file).
    #[arg(long, conflicts_with = "hashes")]
    text: Option<String>,
    /// The blocks' local hashes, comma-separated.
    #[arg(long, value_delimiter = ',')]
    hashes: Option<Vec<u64>>,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// The LoRA adapter of the request.
    #[arg(long)]
    lora_name: Option<String>,
    /// The cache salt of the request.
    #[arg(long)]
    salt: Option<String>,
    /// Tokens after each block its hash also covers (vLLM's num_hash_lookahead_tokens).
    #[arg(long)]
    lookahead: Option<u32>,
    /// At most this many matches, deepest first.
    #[arg(long)]
    max_matches: Option<u32>,
    /// Print the answer's JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct DumpArgs {
    #[command(flatten)]
    inspect: InspectFlags,
    /// The worker id.
    #[arg(long)]
    worker: u64,
    /// Its dp rank.
    #[arg(long, default_value_t = 0)]
    dp_rank: u32,
    /// Output file (`-` for stdout).
    #[arg(long, short, default_value = "-")]
    out: String,
    /// Prints the worker's device block count and digest instead of its blocks, to compare
    /// two replicas (or a replica and the publisher's log) at a glance.
    #[arg(long)]
    digest: bool,
}

/// Parses the command line and runs the command it names.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    if cli.check_args {
        return Ok(());
    }
    init_logging(&cli.cmd);
    match cli.cmd {
        Command::Serve(a) => serve_cmd(a),
        Command::Bridge(a) => bridge_cmd(a),
        Command::Health(a) => health_cmd(a),
        Command::Config(a) => config_cmd(a),
        Command::Workers(a) => workers_cmd(a),
        Command::Lookup(a) => lookup_cmd(a),
        Command::Dump(a) => dump_cmd(a),
        Command::Demo(a) => tools::forward("demo", &a.args),
        Command::Bench(a) => tools::forward("bench", &a.args),
        Command::E2e(a) => tools::forward("e2e", &a.args),
        Command::Gen(a) => tools::forward("gen", &a.args),
        Command::BridgeBench(a) => tools::forward("bridge-bench", &a.args),
        Command::ShardBench(a) => tools::forward("shard-bench", &a.args),
    }
}

/// The daemons log their own lifecycle (as JSON lines with `--log-json`); the other commands
/// log only trouble. `RUST_LOG` overrides either.
fn init_logging(cmd: &Command) {
    let (daemon, json) = match cmd {
        Command::Serve(a) => (true, a.daemon.log_json),
        Command::Bridge(a) => (true, a.daemon.log_json),
        _ => (false, false),
    };
    let default = if daemon { "info,async_nats=warn" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        logs.json().init();
    } else {
        logs.init();
    }
}

fn serve_cmd(a: ServeArgs) -> Result<()> {
    let cfg = Config::load(a.daemon.config.as_deref(), Config::env(), &a.flags).map_err(anyhow::Error::msg)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("kvindex").build()?;
    rt.block_on(crate::service::serve(cfg, shutdown_signal()))
}

fn bridge_cmd(a: BridgeArgs) -> Result<()> {
    let cfg = BridgeConfig::load(a.daemon.config.as_deref(), a.connect.nats_url, a.connect.prefix, &a.bridge)
        .map_err(anyhow::Error::msg)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("kvindex-bridge").build()?;
    rt.block_on(kvindex_bridge::run(cfg, shutdown_signal()))
}

fn config_cmd(a: ServeArgs) -> Result<()> {
    let values = Config::explain(a.daemon.config.as_deref(), Config::env(), &a.flags).map_err(anyhow::Error::msg)?;
    print!("{}", explain_table(&values));
    Ok(())
}

fn health_cmd(a: HealthArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    match rt.block_on(http::get(&a.addr, &a.path)) {
        Some((200, _)) => Ok(()),
        Some((code, body)) => bail!("{}{} answered {code}: {}", a.addr, a.path, body.trim()),
        None => bail!("{}{} does not answer", a.addr, a.path),
    }
}

/// Runs one request to the inspect API on a runtime of its own.
fn block_on<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(f)
}

fn workers_cmd(a: WorkersArgs) -> Result<()> {
    let all = block_on(a.inspect.api().workers())?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        print!("{}", inspect::workers_table(&all));
    }
    Ok(())
}

fn lookup_cmd(a: LookupArgs) -> Result<()> {
    let tokens = match (&a.tokens_file, &a.text) {
        (Some(f), _) => Some(inspect::read_tokens(f)?),
        (None, Some(t)) => Some(t.bytes().map(u32::from).collect()),
        (None, None) => None,
    };
    if tokens.is_none() && a.hashes.is_none() {
        bail!("give the request as --tokens-file, --text or --hashes");
    }
    let req = kvindex_client::protocol::LookupRequest {
        block_size: tokens.is_some().then_some(a.block_size),
        tokens,
        block_hashes: a.hashes,
        lora_name: a.lora_name,
        salt: a.salt,
        lookahead: a.lookahead,
        max_matches: a.max_matches,
        names: true,
        ..Default::default()
    };
    let resp = block_on(a.inspect.api().lookup(&req))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&resp)?);
    } else {
        print!("{}", inspect::answer_table(&resp));
    }
    Ok(())
}

fn dump_cmd(a: DumpArgs) -> Result<()> {
    let api = a.inspect.api();
    if a.digest {
        let all = block_on(api.workers())?;
        let w = all
            .iter()
            .find(|w| w["worker_id"].as_u64() == Some(a.worker) && w["dp_rank"].as_u64() == Some(u64::from(a.dp_rank)))
            .with_context(|| format!("this replica does not track worker {} rank {}", a.worker, a.dp_rank))?;
        let b = &w["blocks"];
        let part = |d: &serde_json::Value| (d[0].as_u64().unwrap_or(0), d[1].as_u64().unwrap_or(0));
        let (n, sum) = part(&b["digest"]);
        let mut line = format!("worker {} rank {}: {n} device blocks, digest {sum:016x}", a.worker, a.dp_rank);
        // The other parts where they hold anything, so that two replicas diff on every one.
        let others = [("host", &b["tier_digests"][0]), ("disk", &b["tier_digests"][1]), ("group", &b["group_digest"])];
        for (name, d) in others {
            if let (n @ 1.., sum) = part(d) {
                line += &format!("; {n} {name} blocks, digest {sum:016x}");
            }
        }
        println!("{line}");
        return Ok(());
    }
    let n = if a.out == "-" {
        block_on(api.dump(a.worker, a.dp_rank, &mut std::io::BufWriter::new(std::io::stdout().lock())))?
    } else {
        let f = std::fs::File::create(&a.out).with_context(|| format!("creating {}", a.out))?;
        block_on(api.dump(a.worker, a.dp_rank, &mut std::io::BufWriter::new(f)))?
    };
    eprintln!("{n} blocks of worker {} rank {}", a.worker, a.dp_rank);
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
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
    let _ = ctrl_c.await;
}
