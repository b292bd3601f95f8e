//! `kvindex serve` against a real NATS server: every rule of the protocol (docs/PROTOCOL.md), bad
//! input, metrics and health, shutdown.

mod support;

use kvindex_client::protocol::{encode_batch, BatchHeader, EventBatch, KvEvent, LookupRequest, LookupResponse, MatchEntry};
use kvindex_core::hash::{local_hashes, BlockHash, StoredBlock};
use kvindex_core::{Event, Tier};
use support::{eventually, Daemon, NatsServer};

fn batch(worker_id: u64, epoch: u64, events: Vec<KvEvent>) -> EventBatch {
    let ts_ns = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
    let header = BatchHeader { worker_id, epoch, ts_ns, ..BatchHeader::default() };
    EventBatch { header, worker: None, events: events.into_iter().map(Ok).collect() }
}

fn stored(id: u64, parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEvent {
    KvEvent::stored(id, parent, blocks)
}

fn chain(base: u64, locals: &[u64]) -> Vec<(u64, u64)> {
    locals.iter().enumerate().map(|(i, &l)| (base + i as u64, l)).collect()
}

async fn publish(client: &async_nats::Client, subject_worker: u64, b: &EventBatch) {
    client.publish(format!("t.events.{subject_worker}"), encode_batch(b).into()).await.unwrap();
    client.flush().await.unwrap();
}

async fn lookup(client: &async_nats::Client, req: &LookupRequest) -> LookupResponse {
    let payload = rmp_serde::to_vec_named(req).unwrap();
    let reply = client.request("t.lookup", payload.into()).await.unwrap();
    rmp_serde::from_slice(&reply.payload).unwrap()
}

fn by_hashes(locals: &[u64]) -> LookupRequest {
    LookupRequest { block_hashes: Some(locals.to_vec()), ..Default::default() }
}

/// An answer of these matches and no stale worker without a match.
fn answer(matches: Vec<MatchEntry>) -> LookupResponse {
    LookupResponse::Matches { matches, groups: vec![], shard: None, missing_shards: vec![], stale_workers: vec![], names: vec![] }
}

fn entry(worker_id: u64, blocks: u32, stale: bool) -> MatchEntry {
    MatchEntry { worker_id, dp_rank: 0, blocks, stale, tiers: Default::default(), ..Default::default() }
}

/// Waits until the lookup answers `want`.
async fn expect_matches(client: &async_nats::Client, req: &LookupRequest, want: Vec<MatchEntry>) {
    let want = answer(want);
    let got = eventually(10, || async {
        let r = lookup(client, req).await;
        (r == want).then_some(r)
    })
    .await;
    assert!(got.is_some(), "lookup {req:?} never answered {want:?}; last: {:?}", lookup(client, req).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_in_both_forms_with_filter_and_limit() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();

    let tokens: Vec<u32> = (0..100).collect();
    let locals: Vec<u64> = local_hashes(&tokens, 16, None, None).iter().map(|l| l.0).collect();
    assert_eq!(locals.len(), 6);
    publish(&c, 1, &batch(1, 1, vec![stored(0, None, &chain(100, &locals))])).await;
    publish(&c, 2, &batch(2, 1, vec![stored(0, None, &chain(200, &locals[..2]))])).await;

    expect_matches(&c, &by_hashes(&locals), vec![entry(1, 6, false), entry(2, 2, false)]).await;
    let by_tokens = LookupRequest { tokens: Some(tokens.clone()), block_size: Some(16), ..Default::default() };
    assert_eq!(lookup(&c, &by_tokens).await, answer(vec![entry(1, 6, false), entry(2, 2, false)]));
    let salted = LookupRequest { salt: Some("tenant".into()), ..by_tokens };
    assert_eq!(lookup(&c, &salted).await, answer(vec![]));
    let only_2 = LookupRequest { workers: Some(vec![2]), ..by_hashes(&locals) };
    assert_eq!(lookup(&c, &only_2).await, answer(vec![entry(2, 2, false)]));
    let first_1 = LookupRequest { max_blocks: Some(1), ..by_hashes(&locals) };
    assert_eq!(lookup(&c, &first_1).await, answer(vec![entry(1, 1, false), entry(2, 1, false)]));

    // A request that cannot be decoded gets an error reply, never silence.
    let reply = c.request("t.lookup", b"\x93garbage".to_vec().into()).await.unwrap();
    assert!(matches!(rmp_serde::from_slice(&reply.payload).unwrap(), LookupResponse::Error { .. }));
    let reply = c.request("t.lookup", rmp_serde::to_vec_named(&LookupRequest::default()).unwrap().into()).await.unwrap();
    assert!(matches!(rmp_serde::from_slice(&reply.payload).unwrap(), LookupResponse::Error { .. }));
    assert!(d.metric("kvindex_lookups_total{result=\"error\"}").await >= 2.0);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_counted_and_nothing_else_is_lost() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();

    c.publish("t.events.3", b"\x93\x01".to_vec().into()).await.unwrap();
    c.publish("t.events.3", rmp_serde::to_vec(&42u32).unwrap().into()).await.unwrap();
    c.publish("t.events.nope", encode_batch(&batch(3, 1, vec![])).into()).await.unwrap();
    // A batch for worker 4 on worker 3's subject is rejected: the subject is authoritative.
    publish(&c, 3, &batch(4, 1, vec![stored(0, None, &chain(10, &[7, 8]))])).await;
    // A bad event between good ones: its siblings still apply.
    let mut mixed = batch(3, 1, vec![stored(0, None, &chain(10, &[7, 8])), stored(2, Some(11), &chain(12, &[9]))]);
    mixed.events.insert(1, Err(kvindex_client::protocol::DecodeError::BadEvent));
    let mut raw = rmpv::decode::read_value(&mut &encode_batch(&mixed)[..]).unwrap();
    if let rmpv::Value::Map(m) = &mut raw {
        for (k, v) in m.iter_mut() {
            if k.as_str() == Some("events") {
                if let rmpv::Value::Array(a) = v {
                    a.insert(1, rmpv::Value::from("not an event"));
                }
            }
        }
    }
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &raw).unwrap();
    c.publish("t.events.3", bytes.into()).await.unwrap();
    c.flush().await.unwrap();

    // Event ids 0 and 2 with the bad one between: a gap, so the worker is stale but its blocks are in.
    expect_matches(&c, &by_hashes(&[7, 8, 9]), vec![entry(3, 3, true)]).await;
    assert!(lookup(&c, &by_hashes(&[7])).await != answer(vec![]));
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"not_msgpack\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"bad_batch\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"bad_subject\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"worker_mismatch\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"bad_event\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_index_blocks").await, 3.0);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_marks_the_worker_stale_until_a_clean_snapshot() {
    use futures::StreamExt;
    let nats = NatsServer::start();
    let c = async_nats::connect(nats.url()).await.unwrap();
    // The publisher's side: resync requests for worker 5, and broadcasts.
    let mut asks = c.subscribe("t.resync.5").await.unwrap();
    let mut broadcasts = c.subscribe("t.resync").await.unwrap();
    c.flush().await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    assert!(
        tokio::time::timeout(std::time::Duration::from_secs(5), broadcasts.next()).await.unwrap().is_some(),
        "resync broadcast on start"
    );

    publish(&c, 5, &batch(5, 1, vec![stored(0, None, &chain(50, &[1, 2]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2]), vec![entry(5, 2, false)]).await;
    // Event 1 is lost: event 2 arrives.
    publish(&c, 5, &batch(5, 1, vec![stored(2, Some(51), &chain(52, &[3]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(5, 3, true)]).await;
    let ask = tokio::time::timeout(std::time::Duration::from_secs(5), asks.next()).await.unwrap().unwrap();
    let body: rmpv::Value = rmpv::decode::read_value(&mut &ask.payload[..]).unwrap();
    assert_eq!(body["worker_id"].as_u64(), Some(5));
    assert_eq!(body["dp_rank"].as_u64(), Some(0));
    assert!(d.metric("kvindex_event_gaps_total").await >= 1.0);
    assert_eq!(d.metric("kvindex_stale_workers").await, 1.0);

    // The publisher answers with its whole block set, in two snapshot batches.
    let mut first = batch(5, 1, vec![KvEvent { event_id: 3, data: Event::Cleared }, stored(4, None, &chain(50, &[1, 2]))]);
    first.header.snapshot = true;
    let mut last = batch(5, 1, vec![stored(5, Some(51), &chain(60, &[4]))]);
    last.header.snapshot = true;
    last.header.snapshot_end = true;
    publish(&c, 5, &first).await;
    // Mid-snapshot the worker is still stale.
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(5, 2, true)]).await;
    publish(&c, 5, &last).await;
    expect_matches(&c, &by_hashes(&[1, 2, 4]), vec![entry(5, 3, false)]).await;
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_unplaceable_stores_and_new_epochs() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();

    publish(&c, 6, &batch(6, 1, vec![stored(0, None, &chain(60, &[1, 2]))])).await;
    // A repeat of event 0 (with other content) is a duplicate: ignored.
    publish(&c, 6, &batch(6, 1, vec![stored(0, None, &chain(70, &[8, 9]))])).await;
    publish(&c, 6, &batch(6, 1, vec![stored(1, Some(61), &chain(62, &[3]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(6, 3, false)]).await;
    assert_eq!(lookup(&c, &by_hashes(&[8])).await, answer(vec![]));
    assert_eq!(d.metric("kvindex_duplicate_events_total").await, 1.0);

    // A store under a parent the worker does not hold cannot be placed: counted, worker stale.
    publish(&c, 6, &batch(6, 1, vec![stored(2, Some(999), &chain(80, &[4]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(6, 3, true)]).await;
    assert_eq!(d.metric("kvindex_unplaceable_blocks_total").await, 1.0);

    // The publisher restarts (new epoch): everything it held is gone, and it starts clean.
    publish(&c, 6, &batch(6, 2, vec![stored(0, None, &chain(90, &[5]))])).await;
    expect_matches(&c, &by_hashes(&[5]), vec![entry(6, 1, false)]).await;
    assert_eq!(lookup(&c, &by_hashes(&[1])).await, answer(vec![]));
    assert_eq!(d.metric("kvindex_epoch_changes_total").await, 1.0);
    // Host-tier blocks are counted, never matched.
    let host =
        KvEvent { event_id: 1, data: Event::Stored { parent: None, blocks: vec![StoredBlock::new(95, 33)], tier: Tier::Host } };
    publish(&c, 6, &batch(6, 2, vec![host])).await;
    assert!(eventually(5, || async {
        (d.metric("kvindex_non_device_blocks_total{kind=\"stored\",tier=\"host\"}").await == 1.0).then_some(())
    })
    .await
    .is_some());
    assert_eq!(lookup(&c, &by_hashes(&[33])).await, answer(vec![]));
    // The block offloaded to host memory, then evicted there: the device copy stays.
    let host_evict = KvEvent { event_id: 2, data: Event::Removed { hashes: vec![BlockHash(90)], tier: Tier::Host } };
    publish(&c, 6, &batch(6, 2, vec![host_evict])).await;
    assert!(eventually(5, || async {
        (d.metric("kvindex_non_device_blocks_total{kind=\"removed\",tier=\"host\"}").await == 1.0).then_some(())
    })
    .await
    .is_some());
    expect_matches(&c, &by_hashes(&[5]), vec![entry(6, 1, false)]).await;
    let device_evict = KvEvent { event_id: 3, data: Event::removed(&[90]) };
    publish(&c, 6, &batch(6, 2, vec![device_evict])).await;
    expect_matches(&c, &by_hashes(&[5]), vec![]).await;
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_is_dropped_after_its_ttl() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.worker_ttl = 1).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    publish(&c, 7, &batch(7, 1, vec![stored(0, None, &chain(70, &[1, 2]))])).await;
    publish(&c, 8, &batch(8, 1, vec![stored(0, None, &chain(80, &[1]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2]), vec![entry(7, 2, false), entry(8, 1, false)]).await;
    // Worker 8 keeps sending heartbeats (empty batches); worker 7 goes silent.
    for _ in 0..12 {
        publish(&c, 8, &batch(8, 1, vec![])).await;
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    expect_matches(&c, &by_hashes(&[1, 2]), vec![entry(8, 1, false)]).await;
    assert_eq!(d.metric("kvindex_workers_expired_total").await, 1.0);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_shutdown() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    publish(&c, 9, &batch(9, 1, vec![stored(0, None, &chain(90, &[1, 2, 3]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(9, 3, false)]).await;
    // A hole: the middle block evicted, its child kept but out of every match.
    publish(&c, 9, &batch(9, 1, vec![KvEvent { event_id: 1, data: Event::removed(&[91]) }])).await;
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(9, 1, false)]).await;

    assert_eq!(d.http_get("/healthz").await.map(|r| r.0), Some(200));
    assert_eq!(d.http_get("/readyz").await.map(|r| r.0), Some(200));
    let text = d.metrics().await;
    for name in [
        "kvindex_event_lag_seconds_bucket",
        "kvindex_events_applied_total{kind=\"stored\"} 1",
        "kvindex_blocks_applied_total{kind=\"stored\"} 3",
        "kvindex_blocks_applied_total{kind=\"removed\"} 1",
        "kvindex_lookups_total{result=\"ok\"}",
        "kvindex_lookup_duration_seconds_bucket",
        "kvindex_apply_queue_depth{thread=\"0\"}",
        "kvindex_index_blocks 2",
        "kvindex_index_hidden_blocks 1",
        "kvindex_index_workers 1",
        "kvindex_nats_connected 1",
        "kvindex_resync_requests_total{scope=\"all\"} 1",
    ] {
        assert!(text.contains(name), "/metrics lacks {name}:\n{text}");
    }
    // Every sample line is `name{labels} value`, and every metric has HELP and TYPE.
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (_, value) = line.rsplit_once(' ').expect("sample has a value");
        assert!(value.parse::<f64>().is_ok(), "bad sample {line}");
    }
    assert_eq!(text.matches("# HELP kvindex_").count(), text.matches("# TYPE kvindex_").count());
    // Prometheus' own linter, where it is installed (Debian: apt-get install prometheus).
    match std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(mut child) => {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "promtool check metrics: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(_) => eprintln!("promtool not installed: /metrics checked by format only"),
    }
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_a_nats_restart_and_asks_everyone_to_resync() {
    let nats = NatsServer::start();
    let port = nats.port;
    let d = Daemon::start(&nats.url(), |_| {}).await;
    drop(nats);
    assert!(
        eventually(10, || async { (d.http_get("/readyz").await.map(|r| r.0) == Some(503)).then_some(()) }).await.is_some(),
        "/readyz turns 503 while NATS is down"
    );
    let _nats = NatsServer::start_on(port);
    let c = async_nats::connect(format!("nats://127.0.0.1:{port}")).await.unwrap();
    // The daemon reconnects by itself, says so, and asks every publisher for its state
    // (a second broadcast, after the one at start).
    assert!(
        eventually(20, || async { (d.http_get("/readyz").await.map(|r| r.0) == Some(200)).then_some(()) }).await.is_some(),
        "ready again after NATS returns"
    );
    assert!(
        eventually(10, || async { (d.metric("kvindex_resync_requests_total{scope=\"all\"}").await == 2.0).then_some(()) })
            .await
            .is_some(),
        "resync broadcast after the reconnect"
    );
    assert!(d.metric("kvindex_nats_events_total{event=\"disconnected\"}").await >= 1.0);
    assert_eq!(d.metric("kvindex_nats_connected").await, 1.0);
    publish(&c, 1, &batch(1, 1, vec![stored(0, None, &chain(10, &[1, 2]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2]), vec![entry(1, 2, false)]).await;
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_applies_what_it_has_and_exits_zero_on_sigterm() {
    let nats = NatsServer::start();
    let mut d = support::process::DaemonProcess::start(&nats.url(), &[], &[("READY_SETTLE_MS", "100")]);
    d.wait_ready(10).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    publish(&c, 1, &batch(1, 1, vec![stored(0, None, &chain(100, &[1, 2, 3]))])).await;
    expect_matches(&c, &by_hashes(&[1, 2, 3]), vec![entry(1, 3, false)]).await;
    let status = d.terminate().expect("exits within 10 s of SIGTERM");
    assert!(status.success(), "exit status {status:?}; log:\n{}", d.log_text());
    let log = d.log_text();
    assert!(log.contains("shutting down") && log.contains("kvindex stopped"), "log:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_snapshots_but_not_past_the_timeout() {
    let nats = NatsServer::start();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let mut broadcasts = c.subscribe("t.resync").await.unwrap();
    c.flush().await.unwrap();
    let env = [("READY_SETTLE_MS", "200"), ("READY_TIMEOUT", "3")];
    let mut d = support::process::DaemonProcess::start(&nats.url(), &[], &env);
    let started = std::time::Instant::now();

    // A publisher answers the start-up broadcast with a snapshot it never finishes.
    use futures::StreamExt;
    tokio::time::timeout(std::time::Duration::from_secs(10), broadcasts.next()).await.expect("a broadcast resync").unwrap();
    let mut open = batch(1, 1, vec![KvEvent { event_id: 0, data: Event::Cleared }, stored(1, None, &chain(100, &[1, 2]))]);
    open.header.snapshot = true;
    publish(&c, 1, &open).await;
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let (code, body) = support::http_get(&d.metrics_addr, "/readyz").await.unwrap();
    assert_eq!((code, body.trim()), (503, "rebuilding the index from publishers' snapshots"));
    assert_eq!(d.metric("kvindex_ready").await, 0.0);
    // Rebuilding, it is not in the lookup queue group: a router hears "no responders" at once
    // rather than an answer from a half-built index.
    let asked = c.request("t.lookup", rmp_serde::to_vec_named(&by_hashes(&[1])).unwrap().into()).await;
    assert!(matches!(asked.as_ref().map_err(|e| e.kind()), Err(async_nats::RequestErrorKind::NoResponders)), "{asked:?}");

    // Ready at ready_timeout all the same, and the log says why.
    d.wait_ready(10).await;
    assert!(started.elapsed() >= std::time::Duration::from_secs(3));
    assert!(d.log_text().contains("ready after ready_timeout"), "log:\n{}", d.log_text());
    assert_eq!(d.metric("kvindex_snapshots_total{result=\"begun\"}").await, 1.0);
    // Its state is partial while the snapshot is open: the worker is flagged stale.
    expect_matches(&c, &by_hashes(&[1, 2]), vec![entry(1, 2, true)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_resync_requests_are_counted_and_repeated() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // Worker 4 skips event ids and has no publisher to answer the resync.
    publish(&c, 4, &batch(4, 1, vec![stored(0, None, &chain(100, &[1]))])).await;
    publish(&c, 4, &batch(4, 1, vec![stored(5, Some(100), &chain(101, &[2]))])).await;
    let asked = eventually(10, || async {
        let n = d.metric("kvindex_resync_unanswered_total").await;
        (n >= 2.0).then_some(n)
    })
    .await;
    assert!(asked.is_some(), "resync requests were not repeated");
    assert!(d.metric("kvindex_resync_requests_total{scope=\"worker\"}").await >= 2.0);
    assert_eq!(d.metric("kvindex_stale_workers").await, 1.0);
    expect_matches(&c, &by_hashes(&[1, 2]), vec![entry(4, 2, true)]).await;
}
