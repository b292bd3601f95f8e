//! The `kvindex-tools` command line (also reached as `kvindex demo`, `bench`, `e2e`, `gen`,
//! `bridge-bench` and `shard-bench`, which the daemon's CLI forwards here).

use crate::bench::{self, BenchConfig, Mode};
use crate::indexers::Indexer;
use crate::trace::{self, MockConfig, MockEngine};
use crate::workload::Workload;
use crate::{alloc, keepup, stream};
use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "kvindex-tools", version, about = "kvindex's development tools: the demo, benchmarks, workload generators")]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
    /// Parse the command line, then exit without running it (tests check deployment files so).
    #[arg(long, global = true, hide = true)]
    check_args: bool,
}

#[derive(Subcommand)]
enum Command {
    /// See it work: NATS, the daemon, mock engines and a KV-aware router on a real trace,
    /// with live figures and the hit rate against round-robin and random routing.
    Demo(DemoArgs),
    /// Replay a trace or stream against index backends and report throughput, latency, memory.
    Bench(BenchArgs),
    /// Run NATS, the daemon, mock engines and a router together; report throughput and latency.
    E2e(E2eArgs),
    /// Turn a Mooncake trace into a JSONL replay stream with the mock engine.
    Gen(GenArgs),
    /// Measure the bridge: a fake engine's ZMQ batches to applied in kvindex, blocks per second.
    BridgeBench(BridgeBenchArgs),
    /// What NATS itself costs here (a bare request-reply and publish), beside a kvindex
    /// lookup and an event to applied over the same server, at the same rate.
    NatsFloor(NatsFloorArgs),
    /// Measure sharding by worker: S shards and one daemon, each a process, on the same
    /// stream (apply CPU and memory per process, merged lookups against one daemon's).
    ShardBench(ShardBenchArgs),
    /// kvindex beside NVIDIA Dynamo's standalone indexer, fed by the same vLLM publishers and
    /// asked the same `POST /query`, each answer checked against the engines (`scripts/dropin`).
    Dropin(DropinArgs),
    /// Print the configuration reference (docs/CONFIGURATION.md), generated from the code.
    ConfigReference,
}

/// Parses the command line and runs the tool it names.
pub fn main() -> Result<()> {
    let cli = Cli::parse();
    if cli.check_args {
        return Ok(());
    }
    // The tools print tables and log only trouble; RUST_LOG overrides that.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    match cli.cmd {
        Command::Bench(a) => bench_cmd(a),
        Command::E2e(a) => e2e_cmd(a),
        Command::Demo(a) => demo_cmd(a),
        Command::Gen(a) => gen_cmd(a),
        Command::ShardBench(a) => shard_bench_cmd(a),
        Command::Dropin(a) => dropin_cmd(a),
        Command::ConfigReference => {
            print!("{}", crate::config_reference::markdown());
            Ok(())
        }
        Command::NatsFloor(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let r = rt.block_on(crate::nats_floor::run(a.n, a.rate))?;
            println!("{}", serde_json::to_string_pretty(&r)?);
            Ok(())
        }
        Command::BridgeBench(a) => {
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            let r = rt.block_on(crate::bridge_bench::run(a.batches, a.events, a.blocks, a.rate))?;
            println!("{}", serde_json::to_string_pretty(&r)?);
            Ok(())
        }
    }
}

/// Where the workload comes from.
#[derive(Args, Clone)]
struct Source {
    /// Mooncake trace (JSONL) to run through the mock engine.
    #[arg(long, default_value = "data/traces/conversation_trace.jsonl", conflicts_with = "stream")]
    trace: PathBuf,
    /// Replay stream (JSONL) to use instead of a trace. `bench` takes it more than once to
    /// compare streams in one run (rounds alternate them, as they do backends).
    #[arg(long)]
    stream: Vec<PathBuf>,
    /// Mock engine: number of workers.
    #[arg(long, default_value_t = 16)]
    workers: u64,
    /// Mock engine: LRU capacity of each worker, in blocks.
    #[arg(long, default_value_t = 16384)]
    capacity: usize,
    /// Mock engine: each trace block becomes this many blocks.
    #[arg(long, default_value_t = 16)]
    factor: u64,
    /// Mock engine: seed of the worker choice.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Use only the trace's first N requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Mock engine: fraction of evictions that remove a random block of the victim's sequence
    /// instead of its tail, its children staying cached (holes).
    #[arg(long, default_value_t = 0.0)]
    hole_rate: f64,
}

impl Source {
    fn mock(&self) -> MockConfig {
        MockConfig {
            workers: self.workers,
            capacity: self.capacity,
            factor: self.factor,
            seed: self.seed,
            hole_rate: self.hole_rate,
        }
    }

    /// The one workload: the stream, or the trace through the mock engine.
    fn load(&self) -> Result<Workload> {
        match self.stream.as_slice() {
            [] => {
                let mut trace = trace::read_trace_file(&self.trace)?;
                trace.truncate(self.requests.unwrap_or(usize::MAX));
                Ok(Workload::from_timed(MockEngine::run(self.mock(), &trace)))
            }
            [path] => read_workload(path),
            _ => bail!("only `bench` compares streams; give --stream once"),
        }
    }

    /// Every `--stream` with its file name (or the trace's one workload, unnamed).
    fn load_all(&self) -> Result<Vec<(String, Workload)>> {
        if self.stream.len() < 2 {
            return Ok(vec![(String::new(), self.load()?)]);
        }
        self.stream
            .iter()
            .map(|p| Ok((p.file_name().unwrap_or(p.as_os_str()).to_string_lossy().into_owned(), read_workload(p)?)))
            .collect()
    }
}

fn read_workload(path: &std::path::Path) -> Result<Workload> {
    let f = std::fs::File::open(path).with_context(|| format!("opening stream {}", path.display()))?;
    Ok(Workload::new(stream::read_stream(std::io::BufReader::new(f))?, None))
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    source: Source,
    /// Backends to compare, side by side (smg-positional and smg-chain: built with `--features peers`).
    #[arg(long, value_delimiter = ',', default_value = "runs,positional")]
    backends: Vec<Indexer>,
    /// What to measure.
    #[arg(long, value_delimiter = ',', default_value = "sequential,end-state,events,lookups,concurrent")]
    modes: Vec<Mode>,
    /// Apply threads in the concurrent mode.
    #[arg(long, default_value_t = 2)]
    apply_threads: usize,
    /// Lookup threads in the concurrent mode.
    #[arg(long, default_value_t = 1)]
    lookup_threads: usize,
    /// Jump of the positional index's search.
    #[arg(long, default_value_t = kvindex_core::PositionalConfig::default().jump)]
    jump: usize,
    /// Matches a lookup returns at most, the deepest, sorted; 0 (the default, as the daemon
    /// answers) for every match, each index in its own form (kvindex's depth groups, a peer's
    /// list or map of every worker's depth, unsorted).
    #[arg(long, default_value_t = 0)]
    max_matches: usize,
    /// Instead of the modes: open-loop runs on the trace's timeline compressed by each factor,
    /// events through the apply pool and lookups from lookup threads, the drain counted; reports
    /// whether each index kept up (within 1.10x of the offered window) and where it stops.
    #[arg(long)]
    keep_up: bool,
    /// Timeline compression factors of --keep-up.
    #[arg(long, value_delimiter = ',', default_value = "250,500,1000,2000,4000,8000")]
    speedups: Vec<f64>,
    /// With --keep-up: also write the points to FILE.json and the plot to FILE.svg.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Instead of the modes: replay the trace this many times through the same engines
    /// (constant churn), then clear and expire every worker; report the index's memory after each.
    #[arg(long)]
    churn: Option<usize>,
    /// Rounds: each runs every backend once, the order reversed every other round; rows report
    /// each mode's best run and, for the second backend on, its median ratio to the first.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Print JSON (one object per backend and mode) instead of a table.
    #[arg(long)]
    json: bool,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
    /// Compare every end-state answer with the reference model's (a column of how many differ).
    #[arg(long)]
    check: bool,
}

#[derive(Args)]
struct DemoArgs {
    /// Mooncake trace (JSONL) whose requests arrive on their timeline.
    #[arg(long, default_value = "data/traces/conversation_trace.jsonl")]
    trace: PathBuf,
    /// Use only the trace's first N requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Timeline compression: 60 plays the trace's hour in a minute; 0 as fast as possible.
    #[arg(long, default_value_t = 60.0)]
    speed: f64,
    /// Workers (engines) per fleet.
    #[arg(long, default_value_t = 16)]
    workers: u64,
    /// LRU capacity of each worker, in blocks.
    #[arg(long, default_value_t = 16384)]
    capacity: usize,
    /// Each trace block (512 tokens) becomes this many blocks.
    #[arg(long, default_value_t = 16)]
    factor: u64,
    /// Router cost: blocks to compute + this x the worker's active blocks.
    #[arg(long, default_value_t = 1.0)]
    load_weight: f64,
    /// Seed of the random policy.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Use this NATS server instead of starting nats-server on a free loopback port.
    #[arg(long)]
    nats_url: Option<String>,
    /// Feed and ask a kvindex already running on that NATS (its /metrics address, e.g.
    /// kvindex:9464) instead of starting one here.
    #[arg(long, requires = "nats_url")]
    kvindex: Option<String>,
    /// Subject prefix of kvindex.
    #[arg(long, default_value = "kv")]
    prefix: String,
    /// Skip the bursts after the trace (requests sharing a new prefix, routed with and without
    /// predicted placements).
    #[arg(long)]
    no_burst: bool,
    /// A Python with kvindex's client installed (what `scripts/python-client` prints): one
    /// more fleet is routed through the Python client.
    #[arg(long)]
    python: Option<PathBuf>,
    /// Shards of kvindex sharded by worker (their own NATS server partitions the workers;
    /// the router's lookups gather every shard): the same hit rate as one index.
    #[arg(long, default_value_t = 1)]
    shards: u32,
    /// Play the trace again and again until interrupted (a load generator for dashboards).
    #[arg(long = "loop")]
    repeat: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct E2eArgs {
    #[command(flatten)]
    source: Source,
    /// Use this NATS server instead of starting nats-server on a free loopback port.
    #[arg(long)]
    nats_url: Option<String>,
    /// Offered event rates in blocks/s, one run each; 0 = as fast as possible.
    #[arg(long, value_delimiter = ',', default_value = "0,1000000")]
    rates: Vec<f64>,
    /// Lookups per second issued while events flow.
    #[arg(long, default_value_t = 5000.0)]
    lookup_rate: f64,
    /// Apply threads of the daemon.
    #[arg(long, default_value_t = 1)]
    apply_threads: usize,
    /// Durable mode: events through a JetStream stream; restarts rebuild from the last snapshot and the stream after it, then from the stream alone.
    #[arg(long)]
    jetstream: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ShardBenchArgs {
    #[command(flatten)]
    source: Source,
    /// Shards to compare with one daemon.
    #[arg(long, default_value_t = 3)]
    shards: u32,
    /// Lookups timed on each side, one at a time.
    #[arg(long, default_value_t = 5000)]
    lookups: usize,
    /// Rounds, each with fresh servers and daemons.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct DropinArgs {
    /// Mooncake trace (JSONL) the engines serve.
    #[arg(long, default_value = "data/traces/conversation_trace.jsonl")]
    trace: PathBuf,
    /// The `dynamo-indexer` binary (built from `peers/dynamo-indexer`); without it kvindex
    /// is checked alone.
    #[arg(long)]
    dynamo: Option<PathBuf>,
    /// What `scripts/fetch-engines` printed (vLLM's publisher and its Python).
    #[arg(long)]
    engines_dir: PathBuf,
    /// The script that runs an engine's publisher.
    #[arg(long, default_value = "tests/engines/engine.py")]
    engine_script: PathBuf,
    /// vLLM engines, each its own process and PUB socket.
    #[arg(long, default_value_t = 8)]
    engines: usize,
    /// Trace requests replayed in each phase.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Each engine's LRU capacity, in blocks.
    #[arg(long, default_value_t = 2048)]
    capacity: usize,
    /// Each trace block becomes this many blocks.
    #[arg(long, default_value_t = 2)]
    factor: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Fraction of evictions that leave holes in the holes phase.
    #[arg(long, default_value_t = 0.3)]
    hole_rate: f64,
    /// Queries per phase.
    #[arg(long, default_value_t = 300)]
    queries: usize,
    /// Seconds a phase's answers may take to settle.
    #[arg(long, default_value_t = 10)]
    settle_s: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn dropin_cmd(a: DropinArgs) -> Result<()> {
    let s = crate::dropin::DropinSettings {
        engines: a.engines,
        requests: a.requests,
        capacity: a.capacity,
        factor: a.factor,
        block_size: a.block_size,
        hole_rate: a.hole_rate,
        queries: a.queries,
        settle_s: a.settle_s,
        trace: crate::trace::read_trace_file(&a.trace)?,
        engines_dir: a.engines_dir,
        engine_script: a.engine_script,
        dynamo: a.dynamo,
    };
    let reports = tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(crate::dropin::run(&s))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else {
        print!("{}", crate::dropin::table(&reports));
        for r in &reports {
            for (who, e) in [("kvindex", &r.kvindex_example), ("Dynamo", &r.dynamo_example)] {
                if let Some(e) = e {
                    println!("{}, {who}: {e}", r.phase);
                }
            }
        }
    }
    Ok(())
}

#[derive(Args)]
struct GenArgs {
    #[command(flatten)]
    source: Source,
    /// Instead of the trace: N root blocks whose hashes are built to collide in an unseeded
    /// table, then an honest worker's chain (a hash-flooding attack, for `bench --stream`).
    #[arg(long)]
    flood: Option<u64>,
    /// With --flood: random keys instead (the control).
    #[arg(long, requires = "flood")]
    random_keys: bool,
    /// Output file (`-` for stdout).
    #[arg(long, short, default_value = "-")]
    out: String,
}

#[derive(Args)]
struct NatsFloorArgs {
    /// Requests (and publishes) per path.
    #[arg(long, default_value_t = 5000)]
    n: u64,
    /// Per second, paced (the service benchmark asks 500 lookups a second).
    #[arg(long, default_value_t = 500.0)]
    rate: f64,
}

#[derive(Args)]
struct BridgeBenchArgs {
    /// Engine batches to send.
    #[arg(long, default_value_t = 20000)]
    batches: u64,
    /// BlockStored events per batch.
    #[arg(long, default_value_t = 4)]
    events: u64,
    /// Blocks (16 tokens each) per event.
    #[arg(long, default_value_t = 16)]
    blocks: u64,
    /// Offered blocks per second; 0 as fast as the bridge takes them.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
}

fn shard_bench_cmd(a: ShardBenchArgs) -> Result<()> {
    let wl = a.source.load()?;
    eprintln!("workload: {} event blocks, {} lookups to cycle through", wl.stored_blocks + wl.removed_blocks, wl.lookups);
    let cfg = crate::shard_bench::ShardBenchConfig { shards: a.shards, lookups: a.lookups, rounds: a.rounds };
    let rounds =
        tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(crate::shard_bench::run(&wl, &cfg))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rounds)?);
    } else {
        print!("{}", crate::shard_bench::table(&rounds));
    }
    Ok(())
}

fn e2e_cmd(a: E2eArgs) -> Result<()> {
    let wl = a.source.load()?;
    eprintln!(
        "workload: {} event blocks ({} stored + {} removed), {} lookups to cycle through",
        wl.stored_blocks + wl.removed_blocks,
        wl.stored_blocks,
        wl.removed_blocks,
        wl.lookups
    );
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut rows = Vec::new();
    for rate in a.rates {
        let cfg = crate::e2e::E2eConfig {
            nats_url: a.nats_url.clone(),
            rate,
            lookup_rate: a.lookup_rate,
            apply_threads: a.apply_threads,
            jetstream: a.jetstream,
            progress: !a.json,
        };
        rows.push(rt.block_on(crate::e2e::run(&wl, &cfg))?);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", crate::e2e::table(&rows));
        if a.jetstream {
            print!("{}", crate::e2e::durable_lines(&rows));
        }
    }
    Ok(())
}

fn demo_cmd(a: DemoArgs) -> Result<()> {
    let mut trace = trace::read_trace_file(&a.trace)?;
    trace.truncate(a.requests.unwrap_or(usize::MAX));
    let cfg = crate::demo::DemoConfig {
        nats_url: a.nats_url,
        kvindex_metrics: a.kvindex,
        prefix: a.prefix,
        workers: a.workers,
        capacity: a.capacity,
        factor: a.factor,
        speed: a.speed,
        load_weight: a.load_weight,
        seed: a.seed,
        repeat: a.repeat,
        burst: !a.no_burst,
        shards: a.shards,
        python: a.python,
        live: if a.json { crate::demo::Live::Off } else { crate::demo::live_for_stdout() },
    };
    if !a.json {
        println!(
            "kvindex demo: {} requests of {}, at {}x; fleets of {} workers routed by kvindex (by events; by announcements alone) and without it",
            trace.len(),
            a.trace.display(),
            cfg.speed,
            cfg.workers
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let report = rt.block_on(crate::demo::run(&trace, &cfg, async {
        let _ = tokio::signal::ctrl_c().await;
    }))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", crate::demo::table(&report, &cfg));
    }
    Ok(())
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    alloc::enable();
    if let Some(passes) = a.churn {
        if !a.source.stream.is_empty() {
            bail!("--churn replays a trace through the mock engine; it does not take --stream");
        }
        let mut trace = trace::read_trace_file(&a.source.trace)?;
        trace.truncate(a.source.requests.unwrap_or(usize::MAX));
        let points = bench::churn(&trace, a.source.mock(), &a.backends, a.jump, passes, !a.no_progress && !a.json);
        if a.json {
            println!("{}", serde_json::to_string_pretty(&points)?);
        } else {
            print!("{}", bench::churn_table(&points));
        }
        return Ok(());
    }
    if a.keep_up && !a.source.stream.is_empty() {
        bail!("--keep-up issues ops at their trace times: give a trace, not a stream file");
    }
    let wls = a.source.load_all()?;
    for (name, wl) in &wls {
        eprintln!(
            "workload{}{name}: {} ops, {} lookups; blocks: {} lookup + {} stored + {} removed = {} block ops",
            if name.is_empty() { "" } else { " " },
            wl.ops.len(),
            wl.lookups,
            wl.lookup_blocks,
            wl.stored_blocks,
            wl.removed_blocks,
            wl.block_ops()
        );
    }
    let progress = !a.no_progress && !a.json;
    if a.keep_up {
        let cfg = keepup::KeepUpConfig {
            backends: a.backends,
            speedups: a.speedups,
            apply_threads: a.apply_threads,
            lookup_threads: a.lookup_threads,
            jump: a.jump,
            max_matches: (a.max_matches > 0).then_some(a.max_matches),
            progress,
        };
        let points = keepup::sweep(&wls[0].1, &cfg)?;
        if let Some(out) = &a.out {
            let json = out.with_extension("json");
            std::fs::write(&json, serde_json::to_string_pretty(&points)?)
                .with_context(|| format!("writing {}", json.display()))?;
            let svg = out.with_extension("svg");
            keepup::plot(&points, &svg).with_context(|| format!("plotting {}", svg.display()))?;
            eprintln!("wrote {} and {}", json.display(), svg.display());
        }
        if a.json {
            println!("{}", serde_json::to_string_pretty(&points)?);
        } else {
            print!("{}", keepup::table(&points));
        }
        return Ok(());
    }
    let cfg = BenchConfig {
        backends: a.backends,
        modes: a.modes,
        apply_threads: a.apply_threads,
        lookup_threads: a.lookup_threads,
        jump: a.jump,
        max_matches: (a.max_matches > 0).then_some(a.max_matches),
        progress,
        repeat: a.repeat,
        check: a.check,
    };
    let named: Vec<(&str, &Workload)> = wls.iter().map(|(n, w)| (n.as_str(), w)).collect();
    let rows = bench::run(&named, &cfg);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", bench::table(&rows));
    }
    Ok(())
}

fn gen_cmd(a: GenArgs) -> Result<()> {
    if let Some(n) = a.flood {
        let ops = crate::flood::flood_stream(n, !a.random_keys);
        return write_ops(&a.out, &ops);
    }
    let mut trace = trace::read_trace_file(&a.source.trace)?;
    trace.truncate(a.source.requests.unwrap_or(usize::MAX));
    let mut engine = MockEngine::new(a.source.mock());
    let mut ops = Vec::new();
    for r in &trace {
        engine.request(r, &mut ops);
    }
    let lines: Vec<stream::StreamOp> = ops.iter().map(|o| o.op.clone()).collect();
    write_ops(&a.out, &lines)?;
    eprintln!("{} ops from {} requests; {} blocks cached at the end", ops.len(), trace.len(), engine.cached_blocks());
    Ok(())
}

/// Writes a replay stream to `out` (`-`: stdout).
fn write_ops(out: &str, ops: &[stream::StreamOp]) -> Result<()> {
    if out == "-" {
        stream::write_stream(std::io::BufWriter::new(std::io::stdout().lock()), ops)
    } else {
        let f = std::fs::File::create(out).with_context(|| format!("creating {out}"))?;
        stream::write_stream(std::io::BufWriter::new(f), ops)
    }
}
