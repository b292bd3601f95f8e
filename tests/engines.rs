//! `kvindex bridge` fed by the engines' own publisher code: the `kv_events` modules of the
//! vLLM and SGLang wheels (fetched by `scripts/fetch-engines`, run by `tests/engines/engine.py`
//! with their `ZmqEventPublisher`, event classes and msgpack encoder), into a real
//! `kvindex serve` over a real `nats-server`. Each case is what a router then gets back.

mod support;

use kvindex_bridge::{BridgeConfig, BridgeSettings};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::{local_hashes, with_extra_keys, LocalHash};
use kvindex_core::Tier;
use kvindex_tools::harness;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use support::{eventually, free_port, port_pair, Daemon, NatsServer};

const WORKER: u64 = 5;

/// Where `scripts/fetch-engines` put the engines' modules and their Python; fetched once.
fn engines_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let out = Command::new(root.join("scripts/fetch-engines")).output().expect("scripts/fetch-engines runs");
        assert!(out.status.success(), "fetching the engines failed: {}", String::from_utf8_lossy(&out.stderr));
        PathBuf::from(String::from_utf8(out.stdout).expect("a path").trim())
    })
}

/// One engine process: its own `ZmqEventPublisher` on `port` (+ its dp rank), replay ROUTER
/// on `replay` (+ rank) if any.
struct Engine {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Engine {
    /// Starts one on fresh ports (`replay`: with a replay socket), trying others when another
    /// process took them between choosing and binding: the engine, its port and replay port.
    fn launch(kind: &str, replay: bool, buffer_steps: u32, rank: u32) -> (Engine, u16, Option<u16>) {
        for _ in 0..5 {
            let (port, replay) = (port_pair(), replay.then(port_pair));
            if let Some(engine) = Engine::try_start(kind, port, replay, buffer_steps, rank) {
                return (engine, port, replay);
            }
        }
        panic!("the engine's publisher did not start on five pairs of free ports");
    }

    /// Starts one on `port` (a restart where the bridge expects it).
    fn start(kind: &str, port: u16, replay: Option<u16>, buffer_steps: u32, rank: u32) -> Engine {
        Engine::try_start(kind, port, replay, buffer_steps, rank).expect("the engine's publisher did not start")
    }

    /// Starts one; `None` if it does not say it is ready (its sockets could not bind).
    fn try_start(kind: &str, port: u16, replay: Option<u16>, buffer_steps: u32, rank: u32) -> Option<Engine> {
        let dir = engines_dir();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/engines/engine.py");
        let mut child = Command::new(dir.join("venv/bin/python"))
            .arg(script)
            .arg(kind)
            .arg(dir.join("src"))
            // A wildcard host: the engines bind only such endpoints (they connect to others).
            .arg(format!("tcp://*:{port}"))
            .arg(replay.map_or("-".to_string(), |r| format!("tcp://*:{r}")))
            .arg(buffer_steps.to_string())
            .arg(rank.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the engine's publisher starts");
        let stdin = child.stdin.take().expect("stdin");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let _ = stdout.read_line(&mut line);
        let engine = Engine { child, stdin, stdout };
        (line.trim() == "ready").then_some(engine)
    }

    /// Publishes one batch of `events` through the engine's publisher; returns its seq once
    /// it is on the PUB socket.
    fn publish(&mut self, events: Value) -> u64 {
        self.command(json!({ "events": events }))
    }

    fn command(&mut self, command: Value) -> u64 {
        writeln!(self.stdin, "{command}").expect("the engine reads");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("the engine answers");
        line.trim().strip_prefix("sent ").and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("engine said {line:?}"))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"quit": true}));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Tokens of blocks `from..to` of the prompt whose token i is i (4 tokens per block).
fn tokens(from: u32, to: u32) -> Vec<u32> {
    (from * 4..to * 4).collect()
}

fn stored(hashes: Value, parent: Value, from: u32, to: u32, more: Value) -> Value {
    let mut e = json!({
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens(from, to),
        "block_size": 4,
        "medium": "GPU",
    });
    if let (Some(e), Some(more)) = (e.as_object_mut(), more.as_object()) {
        e.extend(more.clone());
    }
    e
}

/// A 32-byte digest hash (vLLM's default without int hashes) ending in `n`.
fn digest(n: u8) -> String {
    format!("hex:{}{n:02x}", "00".repeat(31))
}

/// The bridge in this process, for `ranks` of engine `WORKER`.
struct Bridge(harness::Bridge);

impl Bridge {
    async fn start(daemon: &Daemon, port: u16, replay: Option<u16>, ranks: Vec<u32>) -> Bridge {
        let mut cfg = BridgeConfig { prefix: daemon.cfg.prefix.clone(), ..BridgeConfig::default() };
        cfg.nats = daemon.cfg.nats.clone();
        cfg.bridge = BridgeSettings {
            zmq: format!("tcp://127.0.0.1:{port}"),
            replay: replay.map(|r| format!("tcp://127.0.0.1:{r}")),
            worker_id: Some(WORKER),
            dp_ranks: ranks,
            block_size: None,
            metrics_addr: format!("127.0.0.1:{}", free_port()),
            replay_timeout_ms: 2000,
            ..BridgeSettings::default()
        };
        Bridge(harness::Bridge::start(cfg).await.expect("the bridge is ready once subscribed and connected to NATS"))
    }

    async fn metric(&self, sample: &str) -> f64 {
        self.0.metric(sample).await
    }

    /// Publishes empty batches until the bridge has heard one live: its subscription has
    /// reached the engine's PUB socket (a SUB hears nothing before that).
    async fn hears(&self, engine: &mut Engine) {
        let before = self.metric("kvindex_bridge_batches_total").await;
        let heard = eventually(20, || {
            engine.publish(json!([]));
            async move {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                (self.metric("kvindex_bridge_batches_total").await > before).then_some(())
            }
        })
        .await;
        assert!(heard.is_some(), "the bridge never heard the engine");
    }

    async fn stop(self) {
        self.0.stop().await.expect("the bridge stops cleanly");
    }
}

/// Worker `WORKER`'s device depth for `query` on `rank`, and whether it is stale.
async fn answer(router: &LookupClient, query: &Query, rank: u32) -> (u32, bool) {
    let a = router.lookup(query).await.expect("lookup answered");
    let m = a.matches.iter().find(|m| m.worker_id == WORKER && m.dp_rank == rank);
    let stale_alone = a.stale_workers.iter().any(|w| w.worker_id == WORKER && w.dp_rank == rank);
    (m.map_or(0, |m| m.blocks), m.map_or(stale_alone, |m| m.stale))
}

async fn wait_answer(router: &LookupClient, query: impl Fn() -> Query, rank: u32, want: (u32, bool)) {
    let got = eventually(20, || async { (answer(router, &query(), rank).await == want).then_some(()) }).await;
    assert!(got.is_some(), "rank {rank}: {:?} instead of {want:?} (depth, stale)", answer(router, &query(), rank).await);
}

async fn setup() -> (support::NatsProcess, Daemon, LookupClient) {
    let nats = NatsServer::start();
    let daemon = Daemon::start(&nats.url(), |_| {}).await;
    let client = async_nats::connect(nats.url()).await.expect("NATS");
    let router = LookupClient::new(client, &daemon.cfg.prefix);
    (nats, daemon, router)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_through_its_own_publisher() {
    let (_nats, daemon, router) = setup().await;
    let (mut engine, port, replay) = Engine::launch("vllm", true, 10_000, 0);
    let prompt: Vec<u32> = tokens(0, 16);
    let plain = |blocks: u32| Query::tokens(&prompt[..blocks as usize * 4], 4);

    // Started beside a running engine: seq 0-1 went out before the bridge subscribed. The
    // engine's replay buffer still holds them, and the bridge asks for them from 0.
    engine.publish(json!([stored(json!([1, 2]), Value::Null, 0, 2, json!({}))]));
    engine.publish(json!([stored(json!([digest(3)]), json!(2), 2, 3, json!({}))]));
    let bridge = Bridge::start(&daemon, port, replay, vec![0]).await;
    bridge.hears(&mut engine).await;
    wait_answer(&router, || plain(8), 0, (3, false)).await;
    assert_eq!(bridge.metric("kvindex_bridge_replays_total{result=\"ok\"}").await, 1.0);
    assert_eq!(bridge.metric("kvindex_bridge_incomplete{rank=\"0\"}").await, 0.0);

    // LoRA: vLLM sends the adapter as `lora_name` and first in every block's extra keys.
    let lora = json!({"lora_name": "sql", "lora_id": 1, "extra_keys": [["sql"], ["sql"]]});
    engine.publish(json!([stored(json!([11, 12]), Value::Null, 0, 2, lora)]));
    let lora_more = json!({"lora_name": "sql", "lora_id": 1, "extra_keys": [["sql"]]});
    engine.publish(json!([stored(json!([13]), json!(12), 2, 3, lora_more)]));
    let with_lora = |blocks: u32| plain(blocks).with_lora("sql");
    wait_answer(&router, || with_lora(8), 0, (3, false)).await;

    // A cache salt: vLLM carries it in the request's first block's extra keys only.
    let salted = json!({"extra_keys": [["tenant-a"], null]});
    engine.publish(json!([stored(json!([21, 22]), Value::Null, 0, 2, salted)]));
    engine.publish(json!([stored(json!([23]), json!(22), 2, 3, json!({}))]));
    let with_salt = |salt: &str| plain(8).with_salt(salt);
    wait_answer(&router, || with_salt("tenant-a"), 0, (3, false)).await;
    assert_eq!(answer(&router, &with_salt("tenant-b"), 0).await, (0, false), "another tenant shares nothing");
    // LoRA and salt together: the adapter first, the salt after.
    let both = json!({"lora_name": "sql", "extra_keys": [["sql", "tenant-a"], ["sql"]]});
    engine.publish(json!([stored(json!([31, 32]), Value::Null, 0, 2, both)]));
    wait_answer(&router, || with_lora(8).with_salt("tenant-a"), 0, (2, false)).await;

    // Multimodal: the image's (identifier, offset) pair after the adapter in its block's keys.
    let image = |id: &str| json!({"lora_name": "sql", "extra_keys": [["sql"], ["sql", [id, 0]]]});
    engine.publish(json!([stored(json!([41, 42]), Value::Null, 0, 2, image("img-a"))]));
    let image_locals = |id: &str| -> Vec<LocalHash> {
        let mut l = local_hashes(&prompt[..8], 4, Some("sql"), None);
        let mut keys = Vec::new();
        rmpv::encode::write_value(&mut keys, &rmpv::Value::Array(vec![rmpv::Value::Array(vec![id.into(), 0.into()])])).unwrap();
        l[1] = with_extra_keys(l[1], &keys);
        l
    };
    wait_answer(&router, || Query::hashes(&image_locals("img-a")), 0, (2, false)).await;
    assert_eq!(answer(&router, &Query::hashes(&image_locals("img-b")), 0).await.0, 1, "another image stops at its block");

    // Lookahead hashing: each block's identity covers the 2 tokens after it.
    let ahead = |n: u32| json!({"lookahead_token_ids": (1..=n).map(|b| vec![b * 4 + 100, b * 4 + 101]).collect::<Vec<_>>()});
    let mut la_prompt: Vec<u32> = prompt.clone();
    for b in 1..=3u32 {
        la_prompt[b as usize * 4] = b * 4 + 100;
        la_prompt[b as usize * 4 + 1] = b * 4 + 101;
    }
    let la = |p: &[u32]| {
        let mut t: Vec<u32> = p[..14].to_vec();
        t[0] = 1000;
        Query::tokens(&t, 4).with_lookahead(2)
    };
    // Blocks 0-2 of a prompt whose first token is 1000 (its own root), with lookahead.
    let mut la_tokens = la_prompt[..12].to_vec();
    la_tokens[0] = 1000;
    let mut ev = stored(json!([51, 52, 53]), Value::Null, 0, 3, ahead(3));
    ev["token_ids"] = json!(la_tokens);
    engine.publish(json!([ev]));
    wait_answer(&router, || la(&la_prompt), 0, (3, false)).await;
    let mut differs = la_prompt.clone();
    differs[13] = 7;
    assert_eq!(answer(&router, &la(&differs), 0).await.0, 2, "a token inside block 2's lookahead differs");

    // Tiers: STORAGE (vLLM's storage offload) is the disk tier, CPU the host tier.
    let storage = stored(json!([61, 62]), Value::Null, 0, 2, json!({"medium": "STORAGE"}));
    let cpu = stored(json!([61]), Value::Null, 0, 1, json!({"medium": "CPU"}));
    engine.publish(json!([storage, cpu]));
    let tiers = || plain(8).in_tiers(&[Tier::Device, Tier::Host, Tier::Disk]);
    let tiered = eventually(20, || async {
        let a = router.lookup(&tiers()).await.ok()?;
        let m = a.matches.into_iter().find(|m| m.worker_id == WORKER)?;
        (m.tiers.disk == Some(2) && m.tiers.host == Some(1)).then_some(())
    })
    .await;
    assert!(tiered.is_some(), "STORAGE blocks are on disk, CPU blocks in host memory");

    // An unknown medium is skipped and counted; so are a sliding-window group that does not
    // say its window (a kind kvindex cannot follow) and a remote block, and their batch's other
    // events still apply.
    let odd = stored(json!([71]), Value::Null, 3, 4, json!({"medium": "HBM_POOL"}));
    let window = stored(json!([72]), json!(digest(3)), 3, 4, json!({"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}));
    let remote = stored(json!([73]), json!(digest(3)), 3, 4, json!({"locality": "REMOTE"}));
    let next = stored(json!([74]), json!(digest(3)), 3, 4, json!({}));
    engine.publish(json!([odd, window, remote, next]));
    wait_answer(&router, || plain(8), 0, (4, false)).await;
    assert_eq!(bridge.metric("kvindex_bridge_skipped_events_total{reason=\"unknown_medium\"}").await, 1.0);
    assert_eq!(bridge.metric("kvindex_bridge_skipped_events_total{reason=\"unsupported_group\"}").await, 1.0);
    assert_eq!(bridge.metric("kvindex_bridge_skipped_events_total{reason=\"remote\"}").await, 1.0);

    // Removals by digest and by integer.
    engine.publish(json!([{"type": "BlockRemoved", "block_hashes": [digest(3)], "medium": "GPU"}]));
    wait_answer(&router, || plain(8), 0, (2, false)).await;

    // A burst of 5,000 batches, each storing a block and removing the one before.
    engine.command(json!({"events": [], "burst": 5000}));
    let last = |b: u32| Query::tokens(&[b, b + 1, b + 2, b + 3], 4);
    wait_answer(&router, || last(100_000 + 4 * 4999), 0, (1, false)).await;
    assert_eq!(answer(&router, &last(100_000), 0).await.0, 0, "every earlier block of the burst was removed");

    // The engine restarts (a new process on the same sockets, seq from 0, empty cache).
    drop(engine);
    let mut engine = Engine::start("vllm", port, replay, 10_000, 0);
    bridge.hears(&mut engine).await;
    wait_answer(&router, || plain(8), 0, (0, false)).await;
    engine.publish(json!([stored(json!([1]), Value::Null, 0, 1, json!({}))]));
    wait_answer(&router, || plain(8), 0, (1, false)).await;
    assert!(bridge.metric("kvindex_bridge_engine_restarts_total").await >= 1.0);
    assert_eq!(bridge.metric("kvindex_bridge_decode_failures_total{reason=\"bad_frames\"}").await, 0.0);

    bridge.stop().await;
    daemon.stop().await.unwrap();
}

/// A store of hybrid group `group` as vLLM's `take_events` annotates it (`kind`, `window`).
fn group_stored(group: u32, kind: &str, window: Option<u32>, hashes: Value, parent: Value, from: u32, to: u32) -> Value {
    let spec = json!({"group_idx": group, "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window});
    stored(hashes, parent, from, to, spec)
}

fn group_removed(group: u32, hashes: Value) -> Value {
    json!({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group})
}

/// A hybrid model as vLLM's hybrid allocator publishes it: group 0 sliding-window attention
/// (a 9-token window over 4-token blocks: the 2 blocks before the cut), group 1 full
/// attention, group 2 Mamba (a state at the cut). Sliding-window and Mamba stores leave their
/// null blocks out of `block_hashes`, as vLLM does, while `token_ids` still spans them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_hybrid_model_answers_what_every_group_can_serve() {
    let (nats, daemon, router) = setup().await;
    let (mut engine, port, replay) = Engine::launch("vllm", true, 10_000, 0);
    let bridge = Bridge::start(&daemon, port, replay, vec![0]).await;
    bridge.hears(&mut engine).await;
    let prompt: Vec<u32> = tokens(0, 6);
    let first = |blocks: u32| Query::tokens(&prompt[..blocks as usize * 4], 4);

    // A 6-block prefill, the groups in vLLM's order: the window keeps blocks 2-5, Mamba the
    // state after block 5, full attention every block.
    engine.publish(json!([
        group_stored(0, "sliding_window", Some(9), json!([103, 104, 105, 106]), Value::Null, 0, 6),
        group_stored(1, "full_attention", None, json!([101, 102, 103, 104, 105, 106]), Value::Null, 0, 6),
        group_stored(2, "mamba", None, json!([106]), Value::Null, 0, 6),
    ]));
    wait_answer(&router, || first(6), 0, (6, false)).await;
    // Cut after block 4: no Mamba state there, nor before: nothing is reusable.
    assert_eq!(answer(&router, &first(5), 0).await, (0, false));

    // A Mamba checkpoint after block 3 (vLLM's prefill checkpoints): 4 blocks are reusable;
    // and a Mamba block whose hash full attention never held is counted, not placed.
    engine.publish(json!([group_stored(2, "mamba", None, json!([104, 999]), json!(103), 3, 4)]));
    wait_answer(&router, || first(5), 0, (4, false)).await;
    let missed =
        eventually(20, || async { (daemon.metric("kvindex_group_missed_blocks_total").await == 1.0).then_some(()) }).await;
    assert!(missed.is_some(), "the unplaced Mamba block is counted");

    // The window evicts block 2: a cut after block 4 needs blocks 2-3 there.
    engine.publish(json!([group_removed(0, json!([103]))]));
    wait_answer(&router, || first(5), 0, (0, false)).await;
    assert_eq!(answer(&router, &first(6), 0).await, (6, false), "the window still covers blocks 4-5");

    // A new kvindex (its state lost) asks the bridge for a snapshot: every group comes back.
    daemon.stop().await.unwrap();
    let daemon = Daemon::start(&nats.url(), |_| {}).await;
    wait_answer(&router, || first(6), 0, (6, false)).await;
    assert_eq!(answer(&router, &first(5), 0).await, (0, false), "the window's eviction of block 2 is in the snapshot");

    // Full attention caps every group: evicting block 5 there leaves nothing reusable (the
    // Mamba state after block 3 needs the window's blocks 2-3), whatever the others hold.
    engine.publish(json!([group_removed(1, json!([106]))]));
    wait_answer(&router, || first(6), 0, (0, false)).await;
    // Cached there again, it joins what the other groups kept.
    engine.publish(json!([group_stored(1, "full_attention", None, json!([106]), json!(105), 5, 6)]));
    wait_answer(&router, || first(6), 0, (6, false)).await;
    assert_eq!(bridge.metric("kvindex_bridge_skipped_events_total{reason=\"unsupported_group\"}").await, 0.0);

    bridge.stop().await;
    daemon.stop().await.unwrap();
}

/// A sliding window longer than the request: vLLM's finder, seeing no window-long run of
/// cached blocks, reuses the run from block 0 (its `num_contiguous_blocks` when no match is
/// found). Group 0 full attention, group 1 a window of 4,096 tokens over 16-token blocks (256
/// blocks); a 5-block request cached in both; the window evicts block 2: vLLM reuses 2 blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_longer_than_the_request_reuses_the_run_from_block_0() {
    let (_nats, daemon, router) = setup().await;
    let (mut engine, port, replay) = Engine::launch("vllm", true, 10_000, 0);
    let bridge = Bridge::start(&daemon, port, replay, vec![0]).await;
    bridge.hears(&mut engine).await;
    let prompt: Vec<u32> = (0..5 * 16).collect();
    let ask = || Query::tokens(&prompt, 16);
    let store = |group: u32, kind: &str, window: Option<u32>| {
        let spec = json!({"group_idx": group, "kv_cache_spec_kind": kind, "kv_cache_spec_sliding_window": window});
        let mut e = json!({
            "type": "BlockStored",
            "block_hashes": [201, 202, 203, 204, 205],
            "parent_block_hash": null,
            "token_ids": prompt.clone(),
            "block_size": 16,
            "medium": "GPU",
        });
        if let (Some(e), Some(spec)) = (e.as_object_mut(), spec.as_object()) {
            e.extend(spec.clone());
        }
        e
    };
    engine.publish(json!([store(0, "full_attention", None), store(1, "sliding_window", Some(4096))]));
    wait_answer(&router, ask, 0, (5, false)).await;
    engine.publish(json!([group_removed(1, json!([203]))]));
    wait_answer(&router, ask, 0, (2, false)).await;
    // The window's block 2 cached again: the whole request is reusable again.
    let mut again = store(1, "sliding_window", Some(4096));
    again["block_hashes"] = json!([203]);
    again["parent_block_hash"] = json!(202);
    again["token_ids"] = json!((32..48).collect::<Vec<u32>>());
    engine.publish(json!([again]));
    wait_answer(&router, ask, 0, (5, false)).await;
    bridge.stop().await;
    daemon.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_that_cannot_replay_what_it_missed_is_stale_until_the_engine_clears() {
    let (_nats, daemon, router) = setup().await;
    // No replay socket: what the engine sent before the bridge came is lost to it.
    let (mut engine, port, _) = Engine::launch("vllm", false, 10_000, 0);
    let prompt: Vec<u32> = tokens(0, 16);
    let plain = || Query::tokens(&prompt[..32], 4);
    engine.publish(json!([stored(json!([1, 2]), Value::Null, 0, 2, json!({}))]));
    let bridge = Bridge::start(&daemon, port, None, vec![0]).await;
    bridge.hears(&mut engine).await;
    assert_eq!(bridge.metric("kvindex_bridge_replays_total{result=\"unavailable\"}").await, 1.0);
    assert_eq!(bridge.metric("kvindex_bridge_incomplete{rank=\"0\"}").await, 1.0);
    // What follows is indexed, and the worker is answered as stale: it may hold more.
    engine.publish(json!([stored(json!([3, 4]), Value::Null, 0, 2, json!({"medium": "GPU"}))]));
    wait_answer(&router, plain, 0, (2, true)).await;
    // The engine clears its cache: from here on the bridge sees all of it.
    engine.publish(json!([{"type": "AllBlocksCleared"}, stored(json!([5]), Value::Null, 0, 1, json!({}))]));
    wait_answer(&router, plain, 0, (1, false)).await;
    assert_eq!(bridge.metric("kvindex_bridge_incomplete{rank=\"0\"}").await, 0.0);
    bridge.stop().await;
    daemon.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_buffer_that_moved_on_leaves_the_rank_stale() {
    let (_nats, daemon, router) = setup().await;
    let (mut engine, port, replay) = Engine::launch("vllm", true, 2, 0);
    // A replay buffer of 2 batches: seq 0 is gone from it by the time the bridge asks.
    for i in 0..4u64 {
        engine.publish(json!([stored(json!([10 + i]), Value::Null, i as u32, i as u32 + 1, json!({}))]));
    }
    let bridge = Bridge::start(&daemon, port, replay, vec![0]).await;
    bridge.hears(&mut engine).await;
    assert_eq!(bridge.metric("kvindex_bridge_replays_total{result=\"failed\"}").await, 1.0);
    engine.publish(json!([stored(json!([20]), Value::Null, 0, 1, json!({}))]));
    wait_answer(&router, || Query::tokens(&tokens(0, 1), 4), 0, (1, true)).await;
    bridge.stop().await;
    daemon.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_through_its_own_publisher() {
    let (_nats, daemon, router) = setup().await;
    // Rank 1 binds the base ports + 1, as SGLang's attention-DP ranks do.
    let (mut engine, port, replay) = Engine::launch("sglang", true, 10_000, 1);
    let prompt: Vec<u32> = tokens(0, 16);
    let plain = || Query::tokens(&prompt[..32], 4);

    // Before the bridge: i64 hashes (SGLang's are signed), CPU_PINNED host copies.
    engine.publish(json!([stored(json!([-1, -2]), Value::Null, 0, 2, json!({}))]));
    let bridge = Bridge::start(&daemon, port, replay, vec![1]).await;
    bridge.hears(&mut engine).await;
    wait_answer(&router, plain, 1, (2, false)).await;
    engine.publish(json!([stored(json!([-1]), Value::Null, 0, 1, json!({"medium": "CPU_PINNED"}))]));
    let host = eventually(20, || async {
        let a = router.lookup(&plain().in_tiers(&[Tier::Host])).await.ok()?;
        a.matches.iter().any(|m| m.worker_id == WORKER && m.dp_rank == 1 && m.tiers.host == Some(1)).then_some(())
    })
    .await;
    assert!(host.is_some(), "CPU_PINNED is the host tier");

    // LoRA and salt as fields of every event, the continuation's too: one identity rule.
    let id = json!({"lora_name": "sql", "cache_salt": "tenant-a"});
    engine.publish(json!([stored(json!([-11, -12]), Value::Null, 0, 2, id.clone())]));
    engine.publish(json!([stored(json!([-13]), json!(-12), 2, 3, id)]));
    wait_answer(&router, || plain().with_lora("sql").with_salt("tenant-a"), 1, (3, false)).await;
    assert_eq!(answer(&router, &plain().with_lora("sql"), 1).await.0, 0, "without the salt nothing matches");
    assert_eq!(answer(&router, &plain().with_salt("tenant-a"), 1).await.0, 0, "without the adapter nothing matches");

    engine.publish(json!([{"type": "BlockRemoved", "block_hashes": [-2]}]));
    wait_answer(&router, plain, 1, (1, false)).await;

    // The bridge restarts: its new epoch clears the rank in kvindex, and the engine's replay
    // buffer rebuilds it from seq 0, LoRA, salt and removals included.
    // A block stored while no bridge listens is found only through that replay.
    bridge.stop().await;
    let id = json!({"lora_name": "sql", "cache_salt": "tenant-a"});
    engine.publish(json!([stored(json!([-14]), json!(-13), 3, 4, id)]));
    let bridge = Bridge::start(&daemon, port, replay, vec![1]).await;
    bridge.hears(&mut engine).await;
    wait_answer(&router, || plain().with_lora("sql").with_salt("tenant-a"), 1, (4, false)).await;
    wait_answer(&router, plain, 1, (1, false)).await;
    assert_eq!(bridge.metric("kvindex_bridge_replays_total{result=\"ok\"}").await, 1.0);
    bridge.stop().await;
    daemon.stop().await.unwrap();
}
