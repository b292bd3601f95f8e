//! A deployment sharded by worker, tested as it will fail: three shards of two replicas each
//! (`kvindex serve` processes) on a three-node NATS cluster whose subject mapping partitions
//! the workers, fed the Mooncake stream through the engines' real `Publisher`s. The merged
//! answers must equal the reference model's (one index holding every worker); each worker's
//! events must land on its own shard alone; with both replicas of a shard killed, answers say
//! which shard is missing instead of silently leaving its workers out, and are whole again once
//! it restarts; a NATS node lost changes nothing; and the same fleet on another partition count
//! answers the same, also while the old count's shards still run beside the new.

mod support;
use kvindex_tools as tools;

use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::shards::partition;
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::{BlockHash, StoredBlock};
use kvindex_core::index::{KvIndex, MatchOptions, WorkerMatch};
use kvindex_core::{Event, LocalHash, ReferenceIndex, WorkerId};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;
use support::cluster::NatsCluster;
use support::process::DaemonProcess;
use support::{eventually, http_get};
use tools::stream::Op;
use tools::trace::{read_trace_file, MockConfig, MockEngine};

const WORKERS: u64 = 16;

/// `kvindex serve` for shard `shard` of `shards`, on every node of the cluster.
fn shard_daemon(cluster: &NatsCluster, shards: u32, shard: u32) -> DaemonProcess {
    let (shards, shard) = (shards.to_string(), shard.to_string());
    DaemonProcess::start(
        &cluster.urls(),
        &["--shards", &shards, "--shard", &shard],
        &[("RESYNC_INTERVAL", "1"), ("READY_SETTLE_MS", "200"), ("READY_TIMEOUT", "20")],
    )
}

/// The fleet: a publisher per worker (on the cluster's nodes in turn) and the reference model
/// fed the same events.
struct Fleet {
    publishers: HashMap<u64, Publisher>,
    truth: ReferenceIndex,
    writers: HashMap<WorkerId, <ReferenceIndex as KvIndex>::Writer>,
    queries: Vec<Vec<LocalHash>>,
}

impl Fleet {
    async fn start(cluster: &NatsCluster) -> Fleet {
        let mut publishers = HashMap::new();
        for w in 0..WORKERS {
            let client = async_nats::connect(cluster.url(w as usize % 3)).await.expect("a publisher connects");
            publishers.insert(w, Publisher::start(client, PublisherConfig::new("t", w, 0)).await.expect("a publisher starts"));
        }
        Fleet { publishers, truth: ReferenceIndex::new(1 << 20, 1 << 10), writers: HashMap::new(), queries: Vec::new() }
    }

    /// Replays `ops` through the publishers and the reference model.
    async fn replay(&mut self, ops: impl IntoIterator<Item = Op>) {
        for op in ops {
            match op {
                Op::Lookup(q) => self.queries.push(q),
                Op::Event(w, ev) => {
                    let p = &self.publishers[&w.worker_id];
                    match &ev {
                        Event::Stored { parent, blocks, .. } => p.stored(*parent, blocks),
                        Event::Removed { hashes, .. } => p.removed(hashes),
                        Event::Cleared => p.cleared(),
                        _ => {}
                    }
                    let truth = &self.truth;
                    let wr = self.writers.entry(w).or_insert_with(|| truth.writer(w).expect("room"));
                    ev.apply_to(&self.truth, wr);
                }
            }
        }
        for p in self.publishers.values() {
            p.flush().await;
        }
    }

    /// Some lookups of the stream: every `every`-th.
    fn sample(&self, every: usize) -> Vec<Vec<LocalHash>> {
        self.queries.iter().step_by(every).cloned().collect()
    }

    fn want(&self, q: &[LocalHash], only: impl Fn(u64) -> bool) -> Vec<WorkerMatch> {
        self.truth.find_matches(q, &MatchOptions::default()).into_iter().filter(|m| only(m.worker.worker_id)).collect()
    }
}

/// The merged answer to `q` as (worker, depth), deepest first then by worker, and the shards
/// missing from it.
async fn ask(lookups: &LookupClient, q: &[LocalHash]) -> Option<(Vec<WorkerMatch>, Vec<u32>)> {
    let a = lookups.lookup(&Query::hashes(q)).await.ok()?;
    let mut got: Vec<WorkerMatch> =
        a.matches.iter().map(|m| WorkerMatch { worker: WorkerId::new(m.worker_id, m.dp_rank), blocks: m.blocks }).collect();
    got.sort_unstable_by(|a, b| b.blocks.cmp(&a.blocks).then(a.worker.cmp(&b.worker)));
    Some((got, a.missing_shards))
}

/// Waits until every sampled lookup answers exactly the reference model's (restricted to the
/// workers `only` keeps), with exactly `missing` shards missing.
async fn agree(fleet: &Fleet, lookups: &LookupClient, missing: &[u32], only: impl Fn(u64) -> bool + Copy, what: &str) {
    let sample = fleet.sample(25);
    assert!(sample.len() >= 20, "a sample of lookups");
    let last = std::cell::RefCell::new(String::new());
    let ok = eventually(60, || {
        let (sample, last) = (&sample, &last);
        async move {
            for q in sample {
                let want = fleet.want(q, only);
                match ask(lookups, q).await {
                    Some((got, gone)) if got == want && gone == missing => {}
                    other => {
                        *last.borrow_mut() = format!("{other:?}\nwanted {want:?} with {missing:?} missing");
                        return None;
                    }
                }
            }
            Some(())
        }
    })
    .await;
    assert!(ok.is_some(), "{what}: the merged answers never matched the reference model; last: {}", last.borrow());
}

/// Which (shard, count) pairs answer one lookup of `q`, every reply heard for a second: what
/// a router gathering the shards' answers could hear.
async fn answering(client: &async_nats::Client, q: &[LocalHash]) -> BTreeSet<(u32, u32)> {
    use futures::StreamExt;
    use kvindex_client::protocol::{LookupRequest, LookupResponse};
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.expect("subscribes");
    let req = LookupRequest { block_hashes: Some(q.iter().map(|h| h.0).collect()), ..Default::default() };
    let body = rmp_serde::to_vec_named(&req).expect("encodes");
    client.publish_with_reply("t.lookup", inbox, body.into()).await.expect("publishes");
    let mut heard = BTreeSet::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(1);
    while let Ok(Some(m)) = tokio::time::timeout_at(until, replies.next()).await {
        if let Ok(LookupResponse::Matches { shard: Some(of), .. }) = rmp_serde::from_slice(&m.payload) {
            heard.insert((of.shard, of.shards));
        }
    }
    heard
}

/// The workers a daemon's own shard holds (its inspect API, `local`).
async fn local_workers(d: &DaemonProcess) -> BTreeSet<u64> {
    let body = http_get(&d.inspect_addr, "/v1/workers?local=true&limit=10000").await.map(|r| r.1).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["workers"].as_array().map_or_else(BTreeSet::new, |ws| ws.iter().filter_map(|w| w["worker_id"].as_u64()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_deployment_answers_as_one_index_through_its_faults() {
    let mut cluster = NatsCluster::start(3);
    cluster.formed().await;
    let mut daemons: Vec<Vec<DaemonProcess>> = (0..3).map(|k| (0..2).map(|_| shard_daemon(&cluster, 3, k)).collect()).collect();
    for d in daemons.iter_mut().flatten() {
        d.wait_ready(30).await;
    }
    let mut fleet = Fleet::start(&cluster).await;
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl");
    let mut trace = read_trace_file(path.as_ref()).expect("shipped trace");
    trace.truncate(1600);
    let cfg = MockConfig { workers: WORKERS, capacity: 2048, ..Default::default() };
    let ops: Vec<Op> = MockEngine::run(cfg, &trace).into_iter().map(|o| Op::from(o.op)).collect();
    let (first, rest) = ops.split_at(ops.len() * 3 / 4);
    let (mid, last) = rest.split_at(rest.len() / 2);
    fleet.replay(first.iter().cloned()).await;

    let router = async_nats::connect(cluster.url(0)).await.expect("the router connects");
    let lookups = LookupClient::new(router, "t").with_timeout(Duration::from_secs(2));
    agree(&fleet, &lookups, &[], |_| true, "three shards").await;

    // Every worker's events landed on its own shard alone, on both of its replicas.
    let mut all = BTreeSet::new();
    for (k, replicas) in daemons.iter().enumerate() {
        let want: BTreeSet<u64> = (0..WORKERS).filter(|&w| partition(w, 3) == k as u32).collect();
        for d in replicas {
            assert_eq!(local_workers(d).await, want, "shard {k} holds exactly its workers");
        }
        all.extend(want);
    }
    assert_eq!(all.len(), WORKERS as usize);
    // Any replica's inspect API lists the whole deployment.
    let body = http_get(&daemons[2][1].inspect_addr, "/v1/workers").await.expect("inspect answers").1;
    let listed: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(listed["total"], WORKERS, "{body}");

    // Both replicas of shard 1 killed: answers name it missing and keep the other shards' workers.
    for d in daemons[1].iter_mut() {
        d.kill9();
    }
    agree(&fleet, &lookups, &[1], |w| partition(w, 3) != 1, "shard 1 down").await;
    for d in daemons[1].iter_mut() {
        d.restart();
        d.wait_ready(30).await;
    }
    agree(&fleet, &lookups, &[], |_| true, "shard 1 back").await;

    // A NATS node lost: its clients move to the others; the rest of the stream is applied.
    cluster.kill(1);
    fleet.replay(mid.iter().cloned()).await;
    agree(&fleet, &lookups, &[], |_| true, "a NATS node down").await;
    cluster.restart(1);
    cluster.formed().await;

    // Another partition count while the old shards still run: the mapping changes, the new
    // shards start beside the old and rebuild from the engines' snapshots, and the stream goes
    // on. The old shards the mapping now brings other shards' workers step out of lookups;
    // answers come from the new count alone, never a mix of the two.
    cluster.remap(2);
    cluster.formed().await;
    let mut two: Vec<DaemonProcess> = (0..2).map(|k| shard_daemon(&cluster, 2, k)).collect();
    for d in two.iter_mut() {
        d.wait_ready(30).await;
    }
    fleet.replay(last.iter().cloned()).await;
    agree(&fleet, &lookups, &[], |_| true, "two shards beside the old three").await;
    for (k, replicas) in daemons.iter().enumerate().take(2) {
        for d in replicas {
            let superseded = eventually(30, || async { (d.metric("kvindex_shard_superseded").await == 1.0).then_some(()) }).await;
            assert!(superseded.is_some(), "old shard {k} of 3 heard another shard's worker and left lookups");
            assert_eq!(d.metric("kvindex_lookup_member").await, 0.0, "old shard {k} of 3 answers no lookup");
        }
    }
    for (k, d) in two.iter().enumerate() {
        let want: BTreeSet<u64> = (0..WORKERS).filter(|&w| partition(w, 2) == k as u32).collect();
        assert_eq!(local_workers(d).await, want, "shard {k} of 2 holds exactly its workers");
        assert_eq!(d.metric("kvindex_shard_superseded").await, 0.0);
    }
    // Old shard 2 of 3 hears nothing now and answers again once its rebuild times out; its
    // count stays incomplete, so answers still come from the new count alone.
    let old = &daemons[2][0];
    let back = eventually(60, || async { (old.metric("kvindex_lookup_member").await == 1.0).then_some(()) }).await;
    assert!(back.is_some(), "old shard 2 of 3 answers lookups again");
    let router = async_nats::connect(cluster.url(0)).await.expect("connects");
    assert_eq!(answering(&router, &fleet.queries[0]).await, BTreeSet::from([(0, 2), (1, 2), (2, 3)]), "who answers a lookup");
    agree(&fleet, &lookups, &[], |_| true, "two shards beside an old one answering").await;
    // The old count stopped, as an operator finishes the change: nothing changes.
    for d in daemons.iter_mut().flatten() {
        d.kill9();
    }
    agree(&fleet, &lookups, &[], |_| true, "two shards").await;
}

/// Polls until `d` has written more than `n` snapshots.
async fn snapshots_past(d: &DaemonProcess, n: f64) {
    let written =
        eventually(30, || async { (d.metric("kvindex_snapshot_writes_total{result=\"ok\"}").await > n).then_some(()) }).await;
    assert!(written.is_some(), "no snapshot written in 30 s; log:\n{}", d.log_text());
}

/// Durable mode per shard: one JetStream stream holds every shard's events under their mapped
/// subjects, each shard reads its own workers' through a filtered consumer and keeps snapshots
/// of its own. With every publisher gone and both shards killed, each restarts whole from its
/// snapshot and the stream after it, holding its own workers alone: a removal published while
/// its shard was down is in no snapshot, and must be replayed from the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_shards_restart_whole_from_their_own_snapshots_and_the_stream() {
    let store = std::env::temp_dir().join(format!("kvindex-shards-js-{}-{}", std::process::id(), support::free_port()));
    let conf = store.with_extension("conf");
    let lines: Vec<String> =
        kvindex_client::shards::mappings("t", 2).iter().map(|(f, t)| format!("  \"{f}\": \"{t}\"")).collect();
    std::fs::write(&conf, format!("mappings = {{\n{}\n}}\n", lines.join("\n"))).expect("writes the mappings");
    let nats = support::NatsProcess::start_with(
        support::free_port(),
        &["-js", "-sd", store.to_str().expect("UTF-8"), "-c", conf.to_str().expect("UTF-8")],
        &[],
    )
    .expect("nats-server with JetStream and the mappings");
    let url = nats.url();
    let durable = [
        ("RESYNC_INTERVAL", "1"),
        ("READY_SETTLE_MS", "0"),
        ("INGEST", "jetstream"),
        ("SNAPSHOT_INTERVAL", "1"),
        ("SNAPSHOT_EVENTS", "0"),
    ];
    let mut shards: Vec<DaemonProcess> =
        (0..2).map(|k| DaemonProcess::start(&url, &["--shards", "2", "--shard", &k.to_string()], &durable)).collect();
    for d in shards.iter_mut() {
        d.wait_ready(15).await;
    }

    // Worker w holds the first 3(w+1) blocks of one 24-block request.
    let query: Vec<LocalHash> = (1..=24).map(LocalHash).collect();
    let mut publishers = Vec::new();
    for w in 0..8u64 {
        let p = Publisher::start(async_nats::connect(&url).await.expect("connects"), PublisherConfig::new("t", w, 0))
            .await
            .expect("a publisher starts");
        let blocks: Vec<StoredBlock> = (1..=3 * (w + 1)).map(|i| StoredBlock::new(1000 * (w + 1) + i, i)).collect();
        p.stored(None, &blocks);
        p.flush().await;
        publishers.push(p);
    }
    let want = |first: u32| -> Vec<WorkerMatch> {
        let mut m: Vec<WorkerMatch> = (0..8u64)
            .map(|w| WorkerMatch { worker: WorkerId::new(w, 0), blocks: if w == 0 { first } else { 3 * (w as u32 + 1) } })
            .collect();
        m.sort_unstable_by(|a, b| b.blocks.cmp(&a.blocks).then(a.worker.cmp(&b.worker)));
        m
    };
    let lookups = LookupClient::new(async_nats::connect(&url).await.expect("connects"), "t").with_timeout(Duration::from_secs(2));
    let answers = |first: u32| {
        let (lookups, query, want) = (&lookups, &query, want(first));
        async move {
            eventually(30, || async { ask(lookups, query).await.filter(|(got, gone)| *got == want && gone.is_empty()) }).await
        }
    };
    assert!(answers(3).await.is_some(), "the two durable shards answer as one index");
    let written: Vec<f64> =
        futures::future::join_all(shards.iter().map(|d| d.metric("kvindex_snapshot_writes_total{result=\"ok\"}"))).await;
    for (d, n) in shards.iter().zip(&written) {
        snapshots_past(d, *n).await;
    }
    // Worker 0's shard killed before worker 0 drops its last block: no snapshot of that shard
    // can hold the removal, only the stream.
    let owner = partition(0, 2) as usize;
    shards[owner].kill9();
    publishers[0].removed(&[BlockHash(1003)]);
    publishers[0].flush().await;
    for p in publishers {
        p.close().await;
    }

    for d in shards.iter_mut() {
        d.kill9();
    }
    for d in shards.iter_mut() {
        d.restart();
        d.wait_ready(15).await;
    }
    assert!(answers(2).await.is_some(), "both shards whole again from their snapshots and the stream, no publisher left");
    for (k, d) in shards.iter().enumerate() {
        let mine: BTreeSet<u64> = (0..8).filter(|&w| partition(w, 2) == k as u32).collect();
        assert_eq!(local_workers(d).await, mine, "shard {k} holds its own workers alone");
        assert!(d.metric("kvindex_snapshot_restore_seconds").await > 0.0, "shard {k} restored from its own snapshot");
        assert_eq!(d.metric("kvindex_resync_requests_total{scope=\"all\"}").await, 0.0, "shard {k} needed no publisher");
    }
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.expect("connects"));
    for k in 0..2 {
        js.get_object_store(&format!("T_EVENTS_SNAPSHOTS_S{k}OF2")).await.expect("each shard's own snapshot bucket");
    }
    drop(nats);
    let _ = std::fs::remove_dir_all(&store);
    let _ = std::fs::remove_file(&conf);
}
