//! `dropin`: kvindex and NVIDIA Dynamo's standalone indexer fed by the same vLLM engines (vLLM's
//! own `ZmqEventPublisher`, one PUB socket per engine, both indexes subscribed to it) and asked
//! the same `POST /query`; every answer is checked against what the engines' caches hold.
//!
//! Three phases, each replayed from the Mooncake trace, then checked at rest: LRU eviction
//! from the tail (where Dynamo is exact), eviction that leaves holes, and an engine restart
//! (a new process on the same socket, its sequence from 0, an empty cache, new content).

use crate::harness::{free_port, free_port_pair, http_get, Bridge, Daemon, NatsProcess};
use crate::trace::{block_tokens, chain_hashes, mock_local_hash, request_blocks, Holes, PrefixCache, SplitMix64, TraceRequest};
use anyhow::{bail, ensure, Context, Result};
use kvindex::config::Config;
use kvindex_bridge::BridgeConfig;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Instance ids: engine `e` is `ID_BASE + e` in both indexes.
const ID_BASE: u64 = 1000;
/// The model both indexes are asked about.
const MODEL: &str = "dropin";

/// What a run replays and where its parts are.
#[derive(Clone, Debug)]
pub struct DropinSettings {
    /// vLLM engines, one process and PUB socket each.
    pub engines: usize,
    /// Trace requests replayed in each phase.
    pub requests: usize,
    /// Each engine's LRU capacity, in blocks.
    pub capacity: usize,
    /// Each trace block becomes this many blocks.
    pub factor: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Fraction of evictions that leave holes in the holes phase.
    pub hole_rate: f64,
    /// Queries asked per phase (trace requests replayed in it, evenly spaced).
    pub queries: usize,
    /// Seconds each phase's answers may take to settle before they count as wrong.
    pub settle_s: u64,
    /// The trace.
    pub trace: Vec<TraceRequest>,
    /// What `scripts/fetch-engines` printed: vLLM's `kv_events` module and its Python.
    pub engines_dir: PathBuf,
    /// `tests/engines/engine.py`, which runs the engine's publisher.
    pub engine_script: PathBuf,
    /// The `dynamo-indexer` binary (`peers/dynamo-indexer`); none: kvindex alone.
    pub dynamo: Option<PathBuf>,
}

/// One phase's outcome, at rest.
#[derive(Debug, Serialize)]
pub struct PhaseReport {
    /// What the phase did to the engines.
    pub phase: &'static str,
    /// Queries asked of each index.
    pub queries: usize,
    /// Answers that differ from what the engines hold, by index.
    pub kvindex_wrong: usize,
    pub dynamo_wrong: Option<usize>,
    /// kvindex answers that flag a worker stale (Dynamo has no such flag).
    pub kvindex_stale: usize,
    /// Queries where the two indexes answered differently.
    pub differ: Option<usize>,
    /// Blocks the engines hold of the queries, summed over workers: what there was to find.
    pub held_blocks: u64,
    /// From the phase's last event until every kvindex answer was right, ms (none: never in
    /// the settle time).
    pub kvindex_exact_ms: Option<u64>,
    pub dynamo_exact_ms: Option<u64>,
    /// One wrong answer of each, for the record: query, truth, answer (instance -> blocks).
    pub kvindex_example: Option<String>,
    pub dynamo_example: Option<String>,
}

/// One engine: vLLM's publisher in a Python process, driven over its stdin.
struct Engine {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Engine {
    /// On `port` (PUB) and `port + 1` (replay ROUTER), as vLLM binds them.
    async fn start(s: &DropinSettings, port: u16) -> Result<Engine> {
        let mut child = Command::new(s.engines_dir.join("venv/bin/python"))
            .arg(&s.engine_script)
            .arg("vllm")
            .arg(s.engines_dir.join("src"))
            .arg(format!("tcp://*:{port}"))
            .arg(format!("tcp://*:{}", port + 1))
            .args(["10000", "0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting the engine's publisher")?;
        let stdin = child.stdin.take().context("the engine's stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("the engine's stdout")?).lines();
        let line = stdout.next_line().await?.unwrap_or_default();
        ensure!(line.trim() == "ready", "the engine on port {port} said {line:?}, not ready");
        Ok(Engine { child, stdin, stdout })
    }

    /// Publishes one batch and returns once it is on the PUB socket.
    async fn publish(&mut self, events: Value) -> Result<()> {
        self.stdin.write_all(format!("{}\n", json!({ "events": events })).as_bytes()).await?;
        let line = self.stdout.next_line().await?.unwrap_or_default();
        ensure!(line.starts_with("sent "), "the engine said {line:?}");
        Ok(())
    }

    async fn quit(mut self) {
        let _ = self.stdin.write_all(b"{\"quit\": true}\n").await;
        let _ = self.child.kill().await;
    }
}

/// The engines, what each one holds, and the trace position.
struct Fleet {
    /// The engines' processes, by engine.
    engines: Vec<Engine>,
    /// Each engine's PUB port (its replay ROUTER on the next): a restart binds them again.
    ports: Vec<u16>,
    /// What each engine holds: the truth answers are checked against.
    caches: Vec<PrefixCache>,
    /// The caches' shared LRU clock.
    clock: u64,
    /// The next trace request to replay.
    next: usize,
}

/// A trace request's blocks, numbered.
fn globals(req: &TraceRequest, factor: u64) -> Vec<u64> {
    request_blocks(req, factor).collect()
}

/// The engine's block hashes of a request's blocks (a chain, so a block's hash names its
/// prefix), kept below 2^63 for both decoders.
fn engine_hashes(globals: &[u64]) -> Vec<u64> {
    let locals: Vec<u64> = globals.iter().map(|&g| mock_local_hash(g)).collect();
    chain_hashes(&locals).into_iter().map(|h| h >> 1).collect()
}

/// A query's truth or answer: instance id -> device blocks matched (none listed: 0).
type Depths = BTreeMap<u64, u64>;

/// One index's answer to `POST /query`, in blocks per instance, and whether it flags one
/// stale (kvindex's `stale`).
async fn ask(addr: &str, toks: &[u32], bs: u32) -> Result<(Depths, bool)> {
    let body = json!({ "token_ids": toks, "model_name": MODEL }).to_string();
    let (code, text) = kvindex::cli::http::request(addr, "POST", "/query", None, Some(&body)).await.context("no answer")?;
    ensure!(code == 200, "{addr} answered {code}: {text}");
    let answer: Value = serde_json::from_str(&text).context("reading the answer")?;
    let mut depths = Depths::new();
    let mut stale = false;
    for (id, i) in answer["instances"].as_object().into_iter().flatten() {
        stale |= i["stale"].as_bool() == Some(true);
        let (Ok(id), Some(gpu)) = (id.parse::<u64>(), i["gpu"].as_u64()) else { continue };
        if gpu > 0 {
            depths.insert(id, gpu / bs as u64);
        }
    }
    Ok((depths, stale))
}

impl Fleet {
    /// Replays the next `n` trace requests, request `r` on engine `r mod engines`.
    async fn replay(&mut self, s: &DropinSettings, n: usize, hole_rate: f64, rng: &mut SplitMix64) -> Result<Vec<usize>> {
        let mut replayed = Vec::with_capacity(n);
        for _ in 0..n {
            let r = self.next % s.trace.len();
            self.next += 1;
            let e = r % self.engines.len();
            let g = globals(&s.trace[r], s.factor);
            let hashes = engine_hashes(&g);
            let holes = (hole_rate > 0.0).then_some(Holes { rng: &mut *rng, rate: hole_rate });
            let served = self.caches[e].serve(&hashes, s.capacity, &mut self.clock, holes);
            let mut events = Vec::new();
            if !served.evicted.is_empty() {
                events.push(json!({"type": "BlockRemoved", "block_hashes": served.evicted, "medium": "GPU"}));
            }
            // Past a hole the request's blocks may still be held: those are stored again, as
            // an engine stores a computed chain whole.
            let from = served.hit;
            if from < hashes.len() {
                events.push(json!({
                    "type": "BlockStored",
                    "block_hashes": hashes[from..],
                    "parent_block_hash": from.checked_sub(1).map(|p| hashes[p]),
                    "token_ids": block_tokens(g[from..].iter().copied(), s.block_size as u64),
                    "block_size": s.block_size,
                    "medium": "GPU",
                }));
            }
            if !events.is_empty() {
                self.engines[e].publish(Value::Array(events)).await?;
            }
            replayed.push(r);
        }
        Ok(replayed)
    }

    /// What the engines hold of request `r`, in blocks per instance.
    fn truth(&self, s: &DropinSettings, r: usize) -> Depths {
        let hashes = engine_hashes(&globals(&s.trace[r], s.factor));
        (self.caches.iter().enumerate())
            .map(|(e, c)| (ID_BASE + e as u64, c.hits(&hashes) as u64))
            .filter(|&(_, d)| d > 0)
            .collect()
    }

    /// Publishes a probe block on engine `e` until the indexes at `addrs` answer with it
    /// (their subscriptions reached the socket), then removes it.
    async fn probe(&mut self, e: usize, bs: u32, addrs: &[&str]) -> Result<()> {
        let g = [u32::MAX as u64 / bs as u64 - 1 - e as u64];
        let hash = (1u64 << 62) + e as u64;
        let toks = block_tokens(g, bs as u64);
        let deadline = Instant::now() + Duration::from_secs(30);
        let id = ID_BASE + e as u64;
        'wait: loop {
            let stored = json!({"type": "BlockStored", "block_hashes": [hash], "parent_block_hash": null,
                                "token_ids": toks, "block_size": bs, "medium": "GPU"});
            self.engines[e].publish(json!([stored])).await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
            for a in addrs {
                if ask(a, &toks, bs).await.ok().and_then(|(d, _)| d.get(&id).copied()) != Some(1) {
                    ensure!(Instant::now() < deadline, "engine {e}'s probe never reached {a}");
                    continue 'wait;
                }
            }
            break;
        }
        self.engines[e].publish(json!([{"type": "BlockRemoved", "block_hashes": [hash], "medium": "GPU"}])).await
    }
}

/// Asks both indexes every query until each is right or `settle_s` passes; counts what is
/// still wrong then.
async fn check(
    s: &DropinSettings,
    fleet: &Fleet,
    phase: &'static str,
    kv: &str,
    dy: Option<&str>,
    replayed: &[usize],
) -> Result<PhaseReport> {
    let step = (replayed.len() / s.queries.max(1)).max(1);
    let queries: Vec<usize> = replayed.iter().step_by(step).copied().take(s.queries).collect();
    let truths: Vec<Depths> = queries.iter().map(|&r| fleet.truth(s, r)).collect();
    let toks: Vec<Vec<u32>> =
        queries.iter().map(|&r| block_tokens(request_blocks(&s.trace[r], s.factor), s.block_size as u64)).collect();
    let start = Instant::now();
    let (mut kv_exact, mut dy_exact) = (None, None);
    loop {
        let mut report = PhaseReport {
            phase,
            queries: queries.len(),
            kvindex_wrong: 0,
            dynamo_wrong: dy.map(|_| 0),
            kvindex_stale: 0,
            differ: dy.map(|_| 0),
            held_blocks: truths.iter().flat_map(|t| t.values()).sum(),
            kvindex_exact_ms: None,
            dynamo_exact_ms: None,
            kvindex_example: None,
            dynamo_example: None,
        };
        for ((q, truth), t) in queries.iter().zip(&truths).zip(&toks) {
            let (a, stale) = ask(kv, t, s.block_size).await?;
            report.kvindex_stale += usize::from(stale);
            let say = |got: &Depths| format!("request {q}: engines hold {truth:?}, answered {got:?}");
            if &a != truth {
                report.kvindex_wrong += 1;
                report.kvindex_example.get_or_insert_with(|| say(&a));
            }
            if let Some(dy) = dy {
                let (b, _) = ask(dy, t, s.block_size).await?;
                if &b != truth {
                    *report.dynamo_wrong.get_or_insert(0) += 1;
                    report.dynamo_example.get_or_insert_with(|| say(&b));
                }
                *report.differ.get_or_insert(0) += usize::from(a != b);
            }
        }
        let ms = start.elapsed().as_millis() as u64;
        if report.kvindex_wrong == 0 {
            kv_exact.get_or_insert(ms);
        }
        if report.dynamo_wrong.unwrap_or(0) == 0 {
            dy_exact.get_or_insert(ms);
        }
        let settled = kv_exact.is_some() && dy_exact.is_some();
        if settled || start.elapsed() > Duration::from_secs(s.settle_s) {
            report.kvindex_exact_ms = kv_exact;
            report.dynamo_exact_ms = dy_exact;
            return Ok(report);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Dynamo's indexer as its own process, each engine registered as its users register one
/// (`POST /register`, with its replay endpoint).
async fn start_dynamo(s: &DropinSettings, bin: &std::path::Path, port: u16, engine_ports: &[u16]) -> Result<Child> {
    let mut child = Command::new(bin)
        .args(["--port", &port.to_string(), "--model", MODEL])
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let addr = format!("127.0.0.1:{port}");
    while http_get(&addr, "/health").await.map(|r| r.0) != Some(200) {
        if let Some(status) = child.try_wait()? {
            bail!("Dynamo's indexer exited: {status}");
        }
        ensure!(Instant::now() < deadline, "Dynamo's indexer did not answer /health in 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (e, p) in engine_ports.iter().enumerate() {
        let body = json!({
            "instance_id": ID_BASE + e as u64,
            "endpoint": format!("tcp://127.0.0.1:{p}"),
            "replay_endpoint": format!("tcp://127.0.0.1:{}", p + 1),
            "model_name": MODEL,
            "block_size": s.block_size,
        });
        let (code, text) = kvindex::cli::http::request(&addr, "POST", "/register", None, Some(&body.to_string()))
            .await
            .context("registering")?;
        ensure!(code == 201, "Dynamo's indexer refused engine {e}: {code} {text}");
    }
    Ok(child)
}

/// Runs the three phases.
pub async fn run(s: &DropinSettings) -> Result<Vec<PhaseReport>> {
    ensure!(s.engines > 0 && !s.trace.is_empty(), "no engines or an empty trace");
    let nats = NatsProcess::start()?;
    let query_addr = format!("127.0.0.1:{}", free_port()?);
    let daemon = Daemon::start(Config {
        prefix: "dropin".into(),
        metrics_addr: format!("127.0.0.1:{}", free_port()?),
        inspect_addr: format!("127.0.0.1:{}", free_port()?),
        query_addr: query_addr.clone(),
        block_size: Some(s.block_size),
        worker_ttl: 0,
        ..Config::with_nats_url(nats.url())
    })
    .await?;
    let mut fleet = Fleet { engines: Vec::new(), ports: Vec::new(), caches: Vec::new(), clock: 0, next: 0 };
    for _ in 0..s.engines {
        let port = free_port_pair()?;
        fleet.engines.push(Engine::start(s, port).await?);
        fleet.ports.push(port);
        fleet.caches.push(PrefixCache::default());
    }
    let mut bridges = Vec::new();
    for (e, port) in fleet.ports.iter().enumerate() {
        let mut cfg = BridgeConfig { prefix: "dropin".into(), ..BridgeConfig::default() };
        cfg.nats.nats_url = nats.url();
        cfg.bridge.zmq = format!("tcp://127.0.0.1:{port}");
        cfg.bridge.replay = Some(format!("tcp://127.0.0.1:{}", port + 1));
        cfg.bridge.worker_id = Some(ID_BASE + e as u64);
        cfg.bridge.block_size = Some(s.block_size);
        cfg.bridge.metrics_addr = format!("127.0.0.1:{}", free_port()?);
        bridges.push(Bridge::start(cfg).await?);
    }
    let dynamo_port = free_port()?;
    let dynamo_addr = format!("127.0.0.1:{dynamo_port}");
    let mut dynamo = match &s.dynamo {
        Some(bin) => Some(start_dynamo(s, bin, dynamo_port, &fleet.ports).await?),
        None => None,
    };
    let (kv, dy) = (query_addr.as_str(), dynamo.as_ref().map(|_| dynamo_addr.as_str()));
    for e in 0..s.engines {
        let both: Vec<&str> = std::iter::once(kv).chain(dy).collect();
        fleet.probe(e, s.block_size, &both).await?;
    }
    let mut rng = SplitMix64::new(42);
    let mut reports = Vec::new();
    let tail = fleet.replay(s, s.requests, 0.0, &mut rng).await?;
    reports.push(check(s, &fleet, "tail eviction", kv, dy, &tail).await?);
    let holes = fleet.replay(s, s.requests, s.hole_rate, &mut rng).await?;
    reports.push(check(s, &fleet, "eviction with holes", kv, dy, &holes).await?);
    // Engine 0 restarts: a new process on its socket, sequence from 0, nothing cached.
    let first = fleet.engines.remove(0);
    first.quit().await;
    fleet.engines.insert(0, Engine::start(s, fleet.ports[0]).await?);
    fleet.caches[0] = PrefixCache::default();
    // Only kvindex is waited for: Dynamo drops the new sequence as stale and never sees it.
    fleet.probe(0, s.block_size, &[kv]).await?;
    let after = fleet.replay(s, s.requests, 0.0, &mut rng).await?;
    // What the restarted engine was sent before and after, the earlier half by half.
    let before = tail.iter().chain(&holes).filter(|&&r| r % s.engines == 0);
    let mut replayed: Vec<usize> = before.step_by(2).copied().collect();
    replayed.extend(after.iter().filter(|&&r| r % s.engines == 0));
    reports.push(check(s, &fleet, "an engine restarts", kv, dy, &replayed).await?);
    for e in fleet.engines {
        e.quit().await;
    }
    for b in bridges {
        b.stop().await?;
    }
    if let Some(d) = dynamo.as_mut() {
        let _ = d.kill().await;
    }
    daemon.stop().await?;
    Ok(reports)
}

/// The phases as a Markdown table.
pub fn table(reports: &[PhaseReport]) -> String {
    let ms = |m: Option<u64>| m.map_or("never".to_string(), |m| format!("{m} ms"));
    let n = |v: Option<usize>| v.map_or("-".to_string(), |v| v.to_string());
    let mut out = String::from(
        "| phase | queries | blocks held | kvindex wrong | Dynamo wrong | kvindex stale | answers differ | kvindex exact after | Dynamo exact after |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        let dy_ms = if r.dynamo_wrong.is_some() { ms(r.dynamo_exact_ms) } else { "-".into() };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.phase,
            r.queries,
            r.held_blocks,
            r.kvindex_wrong,
            n(r.dynamo_wrong),
            r.kvindex_stale,
            n(r.differ),
            ms(r.kvindex_exact_ms),
            dy_ms
        );
    }
    out
}
