//! `kvindex bridge` against a fake engine that speaks the engines' ZMQ protocol (a PUB socket
//! per dp rank, a ROUTER for replay), into a real `kvindex serve` over a real `nats-server`:
//! every batch and event shape, every hash form, a gap healed by replay, a gap the engine can
//! no longer replay, an engine restart, multimodal extra keys, a skipped sliding-window group,
//! an event the bridge loses silently (found by its digest).
//! Lookups by tokens find the engine's blocks at the right depth.

mod support;

use bytes::Bytes;
use kvindex_bridge::fake::{arr, ints, map, s};
use kvindex_bridge::{BridgeConfig, BridgeSettings};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::{local_hashes, with_extra_keys, LocalHash};
use kvindex_tools::harness::Bridge;
use parking_lot::Mutex;
use rmpv::Value;
use std::sync::Arc;
use support::{eventually, free_port, http_get, metric_value, port_pair, Daemon, NatsServer};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

fn enc(v: &Value) -> Bytes {
    kvindex_bridge::fake::encode(v).into()
}

/// Tokens of blocks `from..to` of a request whose token i is i (4 tokens per block).
fn tokens(from: u64, to: u64) -> Value {
    ints(from * 4..to * 4)
}

/// One dp rank of the fake engine: a PUB socket, and a ROUTER that replays its buffer.
struct Rank {
    publisher: zeromq::PubSocket,
    seq: u64,
    topic: &'static str,
    /// Every batch made, by seq, as the engine's replay buffer holds them.
    buffer: Arc<Mutex<Vec<(u64, Bytes)>>>,
}

impl Rank {
    /// Binds PUB on `port` and a ROUTER on `replay_port`; `topic_in_replay`: vLLM >= 0.26 and
    /// TensorRT-LLM put the topic in replayed messages, older vLLM and SGLang do not.
    async fn start(port: u16, replay_port: u16, topic_in_replay: bool) -> Rank {
        let mut publisher = zeromq::PubSocket::new();
        publisher.bind(&format!("tcp://127.0.0.1:{port}")).await.expect("PUB binds");
        let buffer: Arc<Mutex<Vec<(u64, Bytes)>>> = Arc::default();
        let mut router = zeromq::RouterSocket::new();
        router.bind(&format!("tcp://127.0.0.1:{replay_port}")).await.expect("ROUTER binds");
        let held = buffer.clone();
        tokio::spawn(async move {
            while let Ok(ask) = router.recv().await {
                let frames = ask.into_vec();
                let (Some(id), Some(start)) = (frames.first().cloned(), frames.last()) else { continue };
                let start = u64::from_be_bytes(start.as_ref().try_into().unwrap());
                let batches: Vec<(u64, Bytes)> = held.lock().iter().filter(|(q, _)| *q >= start).cloned().collect();
                for (q, payload) in batches.into_iter().chain([(u64::MAX, Bytes::new())]) {
                    let mut reply = vec![id.clone(), Bytes::new()];
                    if topic_in_replay {
                        reply.push(Bytes::from_static(b"kv@engine"));
                    }
                    reply.extend([Bytes::copy_from_slice(&q.to_be_bytes()), payload]);
                    router.send(ZmqMessage::try_from(reply).unwrap()).await.unwrap();
                }
            }
        });
        Rank { publisher, seq: 0, topic: "kv@engine", buffer }
    }

    /// Makes the next batch; `lost` keeps it in the replay buffer without publishing it.
    async fn batch(&mut self, payload: Bytes, lost: bool) {
        let seq = self.seq;
        self.seq += 1;
        self.buffer.lock().push((seq, payload.clone()));
        if !lost {
            let frames = vec![Bytes::from(self.topic), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
            self.publisher.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
        }
    }

    /// The engine restarts: a new process, sequence from 0, an empty replay buffer.
    fn restart(&mut self) {
        self.seq = 0;
        self.topic = "kv@engine-restarted";
        self.buffer.lock().clear();
    }
}

/// A positional `BlockStored` (older vLLM, SGLang): hashes, parent, tokens, block size.
fn stored_array(hashes: Value, parent: Value, toks: Value) -> Value {
    arr(vec![s("BlockStored"), hashes, parent, toks, Value::from(4)])
}

async fn depth(router: &LookupClient, query: Query, rank: u32) -> u32 {
    let answer = router.lookup(&query).await.expect("lookup answered");
    answer.matches.iter().find(|m| m.worker_id == 5 && m.dp_rank == rank).map_or(0, |m| m.blocks)
}

async fn wait_depth(router: &LookupClient, query: impl Fn() -> Query, rank: u32, want: u32) {
    let got = eventually(10, || async { (depth(router, query(), rank).await == want).then_some(()) }).await;
    assert!(got.is_some(), "rank {rank}: depth {} instead of {want}", depth(router, query(), rank).await);
}

/// The bridge of worker 5 ("engine-5"), rank 0, for the engine on `pub_port` and `replay_port`.
fn bridge_config(daemon: &Daemon, pub_port: u16, replay_port: u16) -> BridgeConfig {
    let mut cfg = BridgeConfig { prefix: daemon.cfg.prefix.clone(), ..BridgeConfig::default() };
    cfg.nats = daemon.cfg.nats.clone();
    cfg.bridge = BridgeSettings {
        zmq: format!("tcp://127.0.0.1:{pub_port}"),
        replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
        worker_id: Some(5),
        worker_name: Some("engine-5".into()),
        engine_url: Some("http://10.0.0.5:8000".into()),
        block_size: Some(4),
        metrics_addr: format!("127.0.0.1:{}", free_port()),
        replay_timeout_ms: 2000,
        ..BridgeSettings::default()
    };
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_engine_feeds_kvindex_through_the_bridge() {
    let nats = NatsServer::start();
    let daemon = Daemon::start(&nats.url(), |_| {}).await;
    let (pub_port, replay_port) = (port_pair(), port_pair());
    let mut rank0 = Rank::start(pub_port, replay_port, true).await;
    let mut rank1 = Rank::start(pub_port + 1, replay_port + 1, false).await;

    let mut cfg = bridge_config(&daemon, pub_port, replay_port);
    cfg.bridge.dp_ranks = vec![0, 1];
    let bridge = Bridge::start(cfg).await.expect("the bridge is ready once subscribed to both ranks and connected to NATS");
    let metrics_addr = bridge.cfg.bridge.metrics_addr.clone();
    // A SUB socket hears a PUB only once its subscription has arrived there.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let metric = |name: &'static str| {
        let addr = metrics_addr.clone();
        async move { metric_value(&http_get(&addr, "/metrics").await.map(|r| r.1).unwrap_or_default(), name) }
    };

    let client = async_nats::connect(nats.url()).await.unwrap();
    let router = LookupClient::new(client, &daemon.cfg.prefix);
    let prompt: Vec<u32> = (0..64).collect();
    let by_tokens = |blocks: usize| Query::tokens(&prompt[..blocks * 4], 4);

    // Rank 0, array batch, array events, u64 hashes: blocks 0-3.
    let ev = stored_array(ints([1, 2, 3, 4]), Value::Nil, tokens(0, 4));
    rank0.batch(enc(&arr(vec![Value::from(1.0), arr(vec![ev]), Value::Nil])), false).await;
    wait_depth(&router, || by_tokens(8), 0, 4).await;
    // Named by the bridge: answers that ask say where worker 5 lives.
    let named = router.lookup(&by_tokens(8).with_names()).await.expect("an answer");
    let info = named.name_of(5).expect("worker 5 named");
    assert_eq!((info.name.as_str(), info.url.as_deref(), info.block_size), ("engine-5", Some("http://10.0.0.5:8000"), Some(4)));

    // Rank 1, map batch (SGLang's attn_dp_rank), map events, i64 and 32-byte digest hashes.
    let digest = |n: u8| Value::Binary([vec![0u8; 31], vec![n]].concat());
    let ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", arr(vec![Value::from(-7i64), digest(9)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens(0, 2)),
        ("block_size", Value::from(4)),
        ("medium", s("GPU")),
    ]);
    rank1
        .batch(enc(&map(vec![("ts", Value::from(1.0)), ("events", arr(vec![ev])), ("attn_dp_rank", Value::from(1))])), false)
        .await;
    wait_depth(&router, || by_tokens(8), 1, 2).await;
    // Removed by digest: the same folding finds the block.
    let ev = map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![digest(9)]))]);
    rank1.batch(enc(&arr(vec![Value::from(1.0), arr(vec![ev])])), false).await;
    wait_depth(&router, || by_tokens(8), 1, 1).await;

    // A sliding-window group that does not say its window (a kind kvindex cannot follow) is
    // skipped, its batch kept.
    let window = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints([5])),
        ("parent_block_hash", Value::from(4)),
        ("token_ids", tokens(4, 5)),
        ("block_size", Value::from(4)),
        ("group_idx", Value::from(1)),
        ("kv_cache_spec_kind", s("sliding_window")),
    ]);
    let next = stored_array(ints([5]), Value::from(4), tokens(4, 5));
    rank0.batch(enc(&arr(vec![Value::from(1.0), arr(vec![window, next])])), false).await;
    wait_depth(&router, || by_tokens(8), 0, 5).await;
    assert_eq!(metric("kvindex_bridge_skipped_events_total{reason=\"unsupported_group\"}").await, 1.0);

    // A batch lost on the way (seq 3), then seq 4: the bridge replays 3 from the ROUTER.
    rank0.batch(enc(&arr(vec![Value::from(1.0), arr(vec![stored_array(ints([6]), Value::from(5), tokens(5, 6))])])), true).await;
    rank0.batch(enc(&arr(vec![Value::from(1.0), arr(vec![stored_array(ints([7]), Value::from(6), tokens(6, 7))])])), false).await;
    wait_depth(&router, || by_tokens(8), 0, 7).await;
    assert_eq!(metric("kvindex_bridge_seq_gaps_total").await, 1.0);
    assert_eq!(metric("kvindex_bridge_replays_total{result=\"ok\"}").await, 1.0);

    // Multimodal: block 7's tokens are image placeholders; its extra keys name the image.
    let image = |name: &str| arr(vec![Value::Nil, arr(vec![s(name)])]);
    let ev = arr(vec![
        s("BlockStored"),
        ints([8, 9]),
        Value::from(7),
        tokens(7, 9),
        Value::from(4),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        image("img-a"),
    ]);
    rank0.batch(enc(&arr(vec![Value::from(1.0), arr(vec![ev])])), false).await;
    let locals = |img: &str| -> Vec<LocalHash> {
        let mut l = local_hashes(&prompt[..36], 4, None, None);
        let mut keys = Vec::new();
        rmpv::encode::write_value(&mut keys, &arr(vec![s(img)])).unwrap();
        l[8] = with_extra_keys(l[8], &keys);
        l
    };
    wait_depth(&router, || Query::hashes(&locals("img-a")), 0, 9).await;
    assert_eq!(depth(&router, Query::hashes(&locals("img-b")), 0).await, 8, "another image does not match");

    // Rank 1 loses a batch its engine no longer holds: the bridge cannot know what it held, so
    // it starts a new epoch (kvindex clears the rank) and rebuilds from what follows.
    rank1.buffer.lock().clear();
    rank1.batch(enc(&arr(vec![Value::from(1.0), arr(vec![])])), true).await;
    rank1.buffer.lock().clear();
    let ev = stored_array(arr(vec![Value::from(-20i64), Value::from(-21i64), Value::from(-22i64)]), Value::Nil, tokens(0, 3));
    rank1.batch(enc(&arr(vec![Value::from(1.0), arr(vec![ev])])), false).await;
    wait_depth(&router, || by_tokens(8), 1, 3).await;
    assert_eq!(metric("kvindex_bridge_replays_total{result=\"failed\"}").await, 1.0);
    // The old epoch's block is gone: removing it changes nothing, the new chain stands.
    assert_eq!(depth(&router, by_tokens(8), 1).await, 3);

    // Rank 0's engine restarts: its sequence starts over under a new topic; what it held is gone.
    rank0.restart();
    rank0
        .batch(enc(&arr(vec![Value::from(2.0), arr(vec![stored_array(ints([100, 101]), Value::Nil, tokens(0, 2))])])), false)
        .await;
    wait_depth(&router, || by_tokens(8), 0, 2).await;
    assert_eq!(metric("kvindex_bridge_engine_restarts_total").await, 1.0);
    assert!(metric("kvindex_bridge_epochs_total").await >= 2.0);
    assert_eq!(metric("kvindex_bridge_decode_failures_total{reason=\"bad_frames\"}").await, 0.0);

    bridge.stop().await.unwrap();
    daemon.stop().await.unwrap();
}

/// A bridge that loses one engine event without a trace (a fault a test build can make: no
/// gap in the engine's sequence or in the event ids) is caught by the digest its publisher
/// keeps from the engine's events, on the first heartbeat after the loss, and healed by the
/// snapshot kvindex asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_the_bridge_loses_silently_is_found_by_its_digest_and_healed() {
    let nats = NatsServer::start();
    let daemon = Daemon::start(&nats.url(), |_| {}).await;
    let (pub_port, replay_port) = (port_pair(), port_pair());
    let mut engine = Rank::start(pub_port, replay_port, true).await;
    let mut cfg = bridge_config(&daemon, pub_port, replay_port);
    cfg.fault.lose_event_storing = Some(3);
    let bridge = Bridge::start(cfg).await.expect("the bridge is ready");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let router = LookupClient::new(async_nats::connect(nats.url()).await.unwrap(), &daemon.cfg.prefix);
    let prompt: Vec<u32> = (0..64).collect();
    let by_tokens = || Query::tokens(&prompt[..32], 4);

    let stored = |hashes: &[u64], parent: Option<u64>, from: u64| {
        let ev = stored_array(
            ints(hashes.iter().copied()),
            parent.map_or(Value::Nil, Value::from),
            tokens(from, from + hashes.len() as u64),
        );
        enc(&arr(vec![Value::from(1.0), arr(vec![ev])]))
    };
    engine.batch(stored(&[1, 2], None, 0), false).await;
    wait_depth(&router, by_tokens, 0, 2).await;
    let agreed = eventually(10, || async { (daemon.metric("kvindex_digest_checks_total").await > 0.0).then_some(()) }).await;
    assert!(agreed.is_some(), "the bridge's digests are compared while the two agree");
    assert_eq!(daemon.metric("kvindex_digest_mismatch_total{source=\"publisher\"}").await, 0.0);

    // Block 3's event reaches the bridge and never leaves it. (Were a chain to follow it,
    // kvindex would find its parent unknown before any digest came.)
    engine.batch(stored(&[3], Some(2), 2), false).await;
    let lost = std::time::Instant::now();
    let found = eventually(10, || async {
        (daemon.metric("kvindex_digest_mismatch_total{source=\"publisher\"}").await >= 1.0).then(|| lost.elapsed())
    })
    .await;
    assert!(found.is_some(), "the digest differs once the bridge's next digest comes");
    wait_depth(&router, by_tokens, 0, 3).await;
    assert_eq!(daemon.metric("kvindex_event_gaps_total").await, 0.0, "the sequence never showed it");
    assert_eq!(bridge.metric("kvindex_bridge_seq_gaps_total").await, 0.0);
    let settled = eventually(10, || async { (daemon.metric("kvindex_stale_workers").await == 0.0).then_some(()) }).await;
    assert!(settled.is_some(), "the worker is whole again");
    println!("found {:?} after the loss (heartbeat 1 s), healed at {:?}", found.unwrap(), lost.elapsed());

    bridge.stop().await.unwrap();
    daemon.stop().await.unwrap();
}
