//! Several `kvindex serve` replicas behind the `kvindex` queue group: a replica answers
//! lookups only while its index is whole, so a restarted one never answers from a
//! half-built index.

mod support;

use futures::StreamExt;
use kvindex_client::protocol::{encode_batch, BatchHeader, EventBatch, KvEvent, ResyncAck};
use kvindex_client::{LookupClient, MatchEntry, Publisher, PublisherConfig, Query};
use kvindex_core::digest::Digest;
use kvindex_core::{Event, LocalHash, StoredBlock, Tier};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::process::DaemonProcess;
use support::{eventually, free_port, Daemon, NatsServer};

const CHAIN: [(u64, u64); 3] = [(10, 1), (11, 2), (12, 3)];

/// Worker 1's publisher, written out by hand so that it can be slow: it holds `CHAIN` and
/// answers every resync request one second late with a one-batch snapshot.
async fn slow_publisher(client: async_nats::Client) {
    let next_id = Arc::new(AtomicU64::new(1));
    let first = EventBatch {
        header: BatchHeader { worker_id: 1, epoch: 1, next_event_id: Some(1), ..BatchHeader::default() },
        worker: None,
        events: vec![Ok(KvEvent::stored(0, None, &CHAIN))],
    };
    client.publish("t.events.1", encode_batch(&first).into()).await.unwrap();
    let mut asks =
        futures::stream::select(client.subscribe("t.resync").await.unwrap(), client.subscribe("t.resync.1").await.unwrap());
    client.flush().await.unwrap();
    tokio::spawn(async move {
        while let Some(ask) = asks.next().await {
            let (client, next_id) = (client.clone(), next_id.clone());
            tokio::spawn(async move {
                if let Some(reply) = ask.reply {
                    let ack = ResyncAck { worker_id: 1, dp_rank: 0, epoch: 1, blocks: 3 };
                    let _ = client.publish(reply, ack.encode().into()).await;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                let id = next_id.fetch_add(2, Ordering::SeqCst);
                let snapshot = EventBatch {
                    header: BatchHeader {
                        worker_id: 1,
                        epoch: 1,
                        snapshot: true,
                        snapshot_end: true,
                        next_event_id: Some(id + 2),
                        ..BatchHeader::default()
                    },
                    worker: None,
                    events: vec![Ok(KvEvent { event_id: id, data: Event::Cleared }), Ok(KvEvent::stored(id + 1, None, &CHAIN))],
                };
                let _ = client.publish("t.events.1", encode_batch(&snapshot).into()).await;
                let _ = client.flush().await;
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_answers_only_once_rebuilt() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let a = Daemon::start(&nats.url(), |_| {}).await;
    slow_publisher(client.clone()).await;
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(2));
    let query = Query::hashes(&CHAIN.map(|(_, l)| LocalHash(l)));
    let truth =
        vec![MatchEntry { worker_id: 1, dp_rank: 0, blocks: 3, stale: false, tiers: Default::default(), ..Default::default() }];
    let settled = eventually(10, || async { lookups.lookup(&query).await.ok().filter(|a| a.matches == truth) }).await;
    assert!(settled.is_some(), "replica A knows worker 1");

    // Replica B starts: its broadcast is answered a second late, and it waits 3 s for stragglers.
    let url = nats.url();
    let b = tokio::spawn(async move { Daemon::start(&url, |cfg| cfg.ready_settle_ms = 3000).await });
    let (mut answered, start) = (0, Instant::now());
    while !b.is_finished() && start.elapsed() < Duration::from_secs(20) {
        let answer = lookups.lookup(&query).await.expect("a replica answers");
        let flagged = (!answer.matches.is_empty() && answer.matches.iter().all(|m| m.stale)) || !answer.stale_workers.is_empty();
        let right = answer.matches == truth || flagged;
        assert!(right, "answer {answer:?} after {:?}: shallower than the truth and not flagged", start.elapsed());
        answered += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = b.await.unwrap();
    assert!(answered > 50, "lookups flowed while B rebuilt ({answered})");

    // Whole now, B takes its share of the queue group.
    assert_eq!(b.metric("kvindex_lookup_member").await, 1.0);
    let shared = eventually(10, || async {
        assert_eq!(lookups.lookup(&query).await.unwrap().matches, truth);
        (b.metric("kvindex_lookups_total{result=\"ok\"}").await > 0.0).then_some(())
    })
    .await;
    assert!(shared.is_some(), "B answers lookups once rebuilt");
    b.stop().await.unwrap();
    a.stop().await.unwrap();
}

/// Publishes `events` as one batch of worker `id` (epoch 1), a snapshot's when `snapshot` says
/// so (`Some(end)`), and flushes.
async fn send(client: &async_nats::Client, id: u64, snapshot: Option<bool>, events: Vec<KvEvent>) {
    let header = BatchHeader {
        worker_id: id,
        epoch: 1,
        snapshot: snapshot.is_some(),
        snapshot_end: snapshot == Some(true),
        ..BatchHeader::default()
    };
    support::publish_with(client, header, events).await;
}

fn whole(worker_id: u64, blocks: u32) -> MatchEntry {
    MatchEntry { worker_id, dp_rank: 0, blocks, stale: false, tiers: Default::default(), ..Default::default() }
}

/// A snapshot of a worker this replica holds whole (what a sibling's restart asks every
/// publisher for) is applied as a difference: while it is half in, the worker is still
/// answered whole and unflagged; once it ends, the worker holds exactly what it named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restating_a_whole_worker_changes_no_answer() {
    let nats = NatsServer::start();
    restating_changes_no_answer(&nats.url(), kvindex::config::Ingest::Core).await;
}

/// The same in durable mode: the snapshot comes through the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restating_a_whole_worker_changes_no_answer_in_durable_mode() {
    let js = support::JetStreamNats::start();
    restating_changes_no_answer(&js.nats.url(), kvindex::config::Ingest::Jetstream).await;
}

async fn restating_changes_no_answer(url: &str, ingest: kvindex::config::Ingest) {
    let client = async_nats::connect(url).await.unwrap();
    let d = Daemon::start(url, |cfg| cfg.ingest = ingest).await;
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(2));
    let query = Query::hashes(&CHAIN.map(|(_, l)| LocalHash(l)));
    send(&client, 1, None, vec![KvEvent::stored(0, None, &CHAIN)]).await;
    let held = eventually(10, || async { lookups.lookup(&query).await.ok().filter(|a| a.matches == [whole(1, 3)]) }).await;
    assert!(held.is_some(), "worker 1 holds the chain");

    // The snapshot's first half: its `cleared` and the first two blocks.
    let first = vec![KvEvent { event_id: 1, data: Event::Cleared }, KvEvent::stored(2, None, &CHAIN[..2])];
    send(&client, 1, Some(false), first).await;
    // Worker 2's batch, sent after it on the same connection, is ingested after it: once
    // worker 2 is answered, worker 1's half snapshot has been taken in.
    send(&client, 2, None, vec![KvEvent::stored(0, None, &[(20, 9)])]).await;
    let other = Query::hashes(&[LocalHash(9)]);
    let seen = eventually(10, || async { lookups.lookup(&other).await.ok().filter(|a| a.matches == [whole(2, 1)]) }).await;
    assert!(seen.is_some(), "worker 2 is in");
    let mid = lookups.lookup(&query).await.unwrap();
    assert_eq!((mid.matches, mid.stale_workers), (vec![whole(1, 3)], vec![]), "mid-snapshot, worker 1 is as it was");

    // The rest names block 13 under block 11, not block 12: the worker ends as the snapshot.
    send(&client, 1, Some(true), vec![KvEvent::stored(3, Some(11), &[(13, 4)])]).await;
    let now = Query::hashes(&[LocalHash(1), LocalHash(2), LocalHash(4)]);
    let done = eventually(10, || async { lookups.lookup(&now).await.ok().filter(|a| a.matches == [whole(1, 3)]) }).await;
    assert!(done.is_some(), "the snapshot's new block is in");
    assert_eq!(lookups.lookup(&query).await.unwrap().matches, [whole(1, 2)], "block 12, not in the snapshot, is gone");
    assert_eq!(d.metric("kvindex_index_blocks").await, 4.0, "10, 11, 13 and worker 2's");
    assert_eq!(d.metric("kvindex_snapshots_total{result=\"restated\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
    d.stop().await.unwrap();
}

/// A replica's answers while its sibling is killed (SIGKILL) and restarted twenty times: each
/// restart asks every publisher for a snapshot, and the healthy replica restates them, so no
/// answer of it ever leaves out or flags a worker that holds the whole query.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_s_restarts_never_drop_a_worker_from_a_replica_s_answers() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let a = Daemon::start(&nats.url(), |cfg| {
        cfg.query_addr = format!("127.0.0.1:{}", free_port());
        cfg.block_size = Some(4);
    })
    .await;
    // Four engines holding one six-block prefix and a tail of their own.
    let mut publishers = Vec::new();
    for id in 1..=4u64 {
        let mut cfg = PublisherConfig::new("t", id, 0);
        cfg.linger = Duration::ZERO;
        let p = Publisher::start(client.clone(), cfg).await.unwrap();
        let blocks: Vec<StoredBlock> =
            (0..8u64).map(|i| StoredBlock::new(id * 100 + i, if i < 6 { i + 1 } else { id * 10 + i })).collect();
        p.stored(None, &blocks);
        publishers.push(p);
    }
    let (addr, hashes) = (a.cfg.query_addr.clone(), json!([1, 2, 3, 4, 5, 6]));
    let ask = move || {
        let (addr, body) = (addr.clone(), json!({"block_hashes": hashes.clone()}).to_string());
        async move {
            let (code, text) = kvindex::cli::http::request(&addr, "POST", "/query_by_hash", None, Some(&body)).await?;
            (code == 200).then(|| serde_json::from_str::<Value>(&text).ok()).flatten()
        }
    };
    // Each engine at the prefix's six blocks, 24 tokens, unflagged.
    fn whole(a: &Value) -> bool {
        let flagged = |i: &Value| i["stale"] == json!(true);
        a["scores"] == json!({"1": {"0": 24}, "2": {"0": 24}, "3": {"0": 24}, "4": {"0": 24}})
            && a["stale_workers"].as_array().is_none_or(|s| s.is_empty())
            && a["instances"].as_object().is_some_and(|i| !i.values().any(flagged))
    }
    let ready = eventually(10, || async { ask().await.filter(whole) }).await;
    assert!(ready.is_some(), "replica A holds every engine's prefix: {:?}", ask().await);

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (stop, ask) = (stop.clone(), ask.clone());
        async move {
            let (mut answered, mut wrong) = (0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let answer = ask().await.expect("replica A answers");
                if !whole(&answer) {
                    wrong.push(answer);
                }
                answered += 1;
            }
            (answered, wrong)
        }
    });
    let mut b = DaemonProcess::start(&nats.url(), &[], &[("READY_SETTLE_MS", "100")]);
    b.wait_ready(30).await;
    for _ in 0..20 {
        b.kill9();
        b.restart();
        b.wait_ready(30).await;
    }
    // Every engine answered every restart's broadcast; A restated each snapshot.
    let restated =
        eventually(20, || async { (a.metric("kvindex_snapshots_total{result=\"restated\"}").await >= 21.0).then_some(()) }).await;
    stop.store(true, Ordering::Relaxed);
    let (answered, wrong) = watcher.await.unwrap();
    assert_eq!(wrong.len(), 0, "answers that left out or flagged an engine, of {answered}: {wrong:?}");
    assert!(restated.is_some(), "A restated the snapshots of 21 broadcasts");
    assert!(answered >= 100, "lookups flowed throughout ({answered})");
    println!("20 sibling restarts: {answered} answers, none left out or flagged an engine");
    assert_eq!(a.metric("kvindex_snapshots_total{result=\"complete\"}").await, 0.0, "A never rebuilt a worker");
    assert_eq!(a.metric("kvindex_digest_mismatch_total{source=\"replica\"}").await, 0.0, "A never saw B differ");
    b.terminate();
    drop(publishers);
    a.stop().await.unwrap();
}

/// A thousand workers resync at once (two rounds of snapshots, each in two batches) while the
/// replica answers: every answer names all thousand at their whole depth, unflagged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_workers_resyncing_never_leave_an_answer() {
    const WORKERS: u64 = 1000;
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    // Worker `id` holds the prefix 1, 2, 3, 4 as blocks id*10 .. id*10+3.
    let blocks = |id: u64| -> Vec<(u64, u64)> { (0..4).map(|i| (id * 10 + i, i + 1)).collect() };
    for id in 1..=WORKERS {
        send(&client, id, None, vec![KvEvent::stored(0, None, &blocks(id))]).await;
    }
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(5));
    let query = Query::hashes(&[LocalHash(1), LocalHash(2), LocalHash(3), LocalHash(4)]);
    // Every worker at its whole depth, unflagged.
    fn whole_answer(a: &kvindex_client::Answer) -> bool {
        let mut ids: Vec<u64> = a.matches.iter().filter(|m| **m == whole(m.worker_id, 4)).map(|m| m.worker_id).collect();
        ids.sort_unstable();
        a.matches.len() == WORKERS as usize && ids == (1..=WORKERS).collect::<Vec<_>>() && a.stale_workers.is_empty()
    }
    let ready = eventually(20, || async { lookups.lookup(&query).await.ok().filter(whole_answer) }).await;
    assert!(
        ready.is_some(),
        "every worker is in: {:?}",
        lookups.lookup(&query).await.map(|a| (a.matches.len(), a.matches.first().cloned(), a.stale_workers.len()))
    );

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (stop, lookups, query) = (stop.clone(), lookups.clone(), query.clone());
        async move {
            let (mut answered, mut wrong) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let answer = lookups.lookup(&query).await.expect("the replica answers");
                wrong += u64::from(!whole_answer(&answer));
                answered += 1;
            }
            (answered, wrong)
        }
    });
    for round in 0..2u64 {
        let id0 = 1 + round * 3;
        for id in 1..=WORKERS {
            let b = blocks(id);
            let first = vec![KvEvent { event_id: id0, data: Event::Cleared }, KvEvent::stored(id0 + 1, None, &b[..2])];
            send(&client, id, Some(false), first).await;
            send(&client, id, Some(true), vec![KvEvent::stored(id0 + 2, Some(b[1].0), &b[2..])]).await;
        }
    }
    let restated = eventually(30, || async {
        (d.metric("kvindex_snapshots_total{result=\"restated\"}").await == 2.0 * WORKERS as f64).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    let (answered, wrong) = watcher.await.unwrap();
    assert_eq!(wrong, 0, "answers that left out or flagged a worker, of {answered}");
    assert!(restated.is_some(), "every snapshot was restated");
    assert!(answered > 0);
    println!("2,000 snapshots restated: {answered} answers, none left out or flagged a worker");
    assert_eq!(d.metric("kvindex_index_blocks").await, 4.0 * WORKERS as f64);
    d.stop().await.unwrap();
}

/// Worker 1's publisher without digests (so only the replicas' comparison can find a drift):
/// it stores `CHAIN` (and `host` in the host tier, if any), heartbeats every 200 ms, and
/// answers each resync request with a snapshot of both; one task numbers and sends
/// everything, so its ids never go back.
fn heartbeating_publisher(client: async_nats::Client, host: &'static [(u64, u64)]) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut asks =
            futures::stream::select(client.subscribe("t.resync").await.unwrap(), client.subscribe("t.resync.1").await.unwrap());
        client.flush().await.unwrap();
        let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        let header = |next: u64, snapshot: bool| BatchHeader {
            worker_id: 1,
            epoch: 1,
            next_event_id: Some(next),
            ts_ns: now(),
            snapshot,
            snapshot_end: snapshot,
            ..BatchHeader::default()
        };
        let host_event = |id: u64| KvEvent {
            event_id: id,
            data: Event::Stored {
                parent: None,
                blocks: host.iter().map(|&(h, t)| StoredBlock::new(h, t)).collect(),
                tier: Tier::Host,
            },
        };
        let mut first = vec![KvEvent::stored(0, None, &CHAIN)];
        first.extend((!host.is_empty()).then(|| host_event(1)));
        let mut next = first.len() as u64;
        support::publish_with(&client, header(next, false), first).await;
        let mut beat = tokio::time::interval(Duration::from_millis(200));
        loop {
            tokio::select! {
                _ = beat.tick() => support::publish_with(&client, header(next, false), vec![]).await,
                ask = asks.next() => {
                    let Some(ask) = ask else { return };
                    if let Some(reply) = ask.reply {
                        let ack = ResyncAck { worker_id: 1, dp_rank: 0, epoch: 1, blocks: 3 };
                        let _ = client.publish(reply, ack.encode().into()).await;
                    }
                    let mut events = vec![KvEvent { event_id: next, data: Event::Cleared }, KvEvent::stored(next + 1, None, &CHAIN)];
                    events.extend((!host.is_empty()).then(|| host_event(next + 2)));
                    next += events.len() as u64;
                    support::publish_with(&client, header(next, true), events).await;
                }
            }
        }
    })
}

/// `kvindex dump --digest` of worker 1 on the replica whose inspection API is at `addr`.
async fn dump_digest(addr: &str) -> String {
    let addr = addr.to_string();
    let out = tokio::task::spawn_blocking(move || {
        let args = ["dump", "--addr", &addr, "--worker", "1", "--digest"];
        std::process::Command::new(env!("CARGO_BIN_EXE_kvindex")).args(args).output().expect("kvindex runs")
    })
    .await
    .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two replicas made to diverge (one loses a block silently on applying it, a fault built into
/// the test build; the publisher sends no digest, its sequence has no gap) find it by comparing
/// their checkpoints, both resync the worker, and converge on the engine's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_made_to_diverge_find_it_and_converge() {
    let want = format!("worker 1 rank 0: 3 device blocks, digest {:016x}\n", Digest::of(CHAIN.map(|(h, _)| h)).sum);
    diverge_and_converge(&[], CHAIN[2].0, want).await;
}

/// The same where the replicas differ only in the host tier: their device digests agree, so
/// only a checkpoint that carries every tier's digest finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_differ_only_in_the_host_tier_find_it_and_converge() {
    const HOST: [(u64, u64); 3] = [(20, 1), (21, 2), (22, 3)];
    let want = format!(
        "worker 1 rank 0: 3 device blocks, digest {:016x}; 3 host blocks, digest {:016x}\n",
        Digest::of(CHAIN.map(|(h, _)| h)).sum,
        Digest::of(HOST.map(|(h, _)| h)).sum
    );
    diverge_and_converge(&HOST, HOST[2].0, want).await;
}

/// Replica A and replica B (which loses block `lose` once) of worker 1's `CHAIN` and `host`:
/// they find their difference and both come to dump `want`.
async fn diverge_and_converge(host: &'static [(u64, u64)], lose: u64, want: String) {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let a = Daemon::start(&nats.url(), |cfg| cfg.replica_check_interval = 1).await;
    let lose = lose.to_string();
    let mut b = DaemonProcess::start(&nats.url(), &[], &[("REPLICA_CHECK_INTERVAL", "1"), ("FAULT_LOSE_BLOCK", &lose)]);
    b.wait_ready(30).await;
    let published = std::time::Instant::now();
    let _engine = heartbeating_publisher(client.clone(), host);

    let drifted = || async {
        a.metric("kvindex_digest_mismatch_total{source=\"replica\"}").await
            + b.metric("kvindex_digest_mismatch_total{source=\"replica\"}").await
    };
    let found = eventually(20, || async { (drifted().await >= 1.0).then(|| published.elapsed()) }).await;
    assert!(found.is_some(), "the replicas' checkpoints differ: {}", b.log_text());
    let (ia, ib) = (a.cfg.inspect_addr.clone(), b.inspect_addr.clone());
    let converged = eventually(20, || async {
        let (da, db) = (dump_digest(&ia).await, dump_digest(&ib).await);
        (da == want && db == want).then_some(())
    })
    .await;
    assert!(converged.is_some(), "both hold the chain: {:?} / {:?}", dump_digest(&ia).await, dump_digest(&ib).await);
    println!(
        "diverged replicas: found {:?} after the chain was published, converged at {:?}",
        found.unwrap(),
        published.elapsed()
    );
    // Each replica asked: the publisher answers each, and the second snapshot may restate.
    assert!(b.metric("kvindex_snapshots_total{result=\"complete\"}").await >= 1.0, "B rebuilt the worker from a snapshot");

    // Once whole, they compare alike: more checkpoints, no new difference.
    let compared = || async { a.metric("kvindex_replica_checkpoints_compared_total").await };
    let after = |n: f64| eventually(20, move || async move { (compared().await >= n).then_some(()) });
    let c0 = compared().await;
    assert!(after(c0 + 3.0).await.is_some(), "A keeps comparing");
    let settled = drifted().await;
    let c1 = compared().await;
    assert!(after(c1 + 3.0).await.is_some(), "A keeps comparing");
    assert_eq!(drifted().await, settled, "agreeing replicas see no drift");
    assert_eq!(a.metric("kvindex_replica_siblings").await, 1.0);
    assert_eq!(a.metric("kvindex_stale_workers").await + b.metric("kvindex_stale_workers").await, 0.0);
    b.terminate();
    a.stop().await.unwrap();
}
