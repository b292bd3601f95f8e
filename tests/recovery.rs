//! Fault tests: real `nats-server` and `kvindex` processes, model engines reporting
//! through the publisher library. After each fault, every lookup must equal the engines' true
//! state within a stated time, with no worker left stale, and the daemon must still run.
//! Recovery times are printed (`cargo test --test recovery -- --nocapture`).

mod support;

use async_nats::{Client, ConnectOptions};
use futures::StreamExt;
use kvindex_client::publisher::{Publisher, PublisherConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::engine::{all_queries, ask, first_difference, ModelEngine};
use support::process::DaemonProcess;
use support::NatsServer;

/// Settings every test daemon gets: fast resync and readiness.
const FAST: &[(&str, &str)] = &[("RESYNC_INTERVAL", "1"), ("RESYNC_MAX_INTERVAL", "4"), ("READY_SETTLE_MS", "200")];
/// How long a fleet may take to converge after a fault.
const CONVERGE_S: u64 = 20;

/// A connection to `url`, which may list several servers (comma-separated), as engines and
/// routers would have.
async fn connect(url: &str) -> Client {
    let servers: Vec<&str> = url.split(',').collect();
    ConnectOptions::new().retry_on_initial_connect().max_reconnects(None).connect(servers).await.expect("connects to NATS")
}

/// Model engines, each with its publisher on its own connection, as separate engine
/// processes would have.
struct Fleet {
    engines: Vec<ModelEngine>,
    publishers: Vec<Option<Publisher>>,
    url: String,
    prefix: String,
    /// The publishers wait for JetStream's acknowledgements (durable mode).
    acks: bool,
}

impl Fleet {
    async fn start(url: &str, prefix: &str, workers: u64, seed: u64) -> Fleet {
        Self::start_with(url, prefix, workers, seed, false).await
    }

    async fn start_with(url: &str, prefix: &str, workers: u64, seed: u64, acks: bool) -> Fleet {
        let mut f = Fleet { engines: Vec::new(), publishers: Vec::new(), url: url.into(), prefix: prefix.into(), acks };
        for w in 1..=workers {
            f.engines.push(ModelEngine::new(w, seed, 60));
            f.publishers.push(Some(f.publisher(w).await));
        }
        f
    }

    async fn publisher(&self, worker: u64) -> Publisher {
        let cfg = PublisherConfig {
            heartbeat: Duration::from_millis(200),
            jetstream_acks: self.acks,
            ..PublisherConfig::new(&self.prefix, worker, 0)
        };
        Publisher::start(connect(&self.url).await, cfg).await.expect("publisher starts")
    }

    /// `rounds` steps of every running engine, `pause` apart.
    async fn run(&mut self, rounds: usize, pause: Duration) {
        for _ in 0..rounds {
            for (e, p) in self.engines.iter_mut().zip(&self.publishers) {
                if let Some(p) = p {
                    e.step(p);
                }
            }
            tokio::time::sleep(pause).await;
        }
        for p in self.publishers.iter().flatten() {
            p.flush().await;
        }
    }

    /// The engines whose publishers run: what the index must hold.
    fn live(&self) -> Vec<&ModelEngine> {
        self.engines.iter().zip(&self.publishers).filter(|(_, p)| p.is_some()).map(|(e, _)| e).collect()
    }
}

/// Waits until every lookup of up to 5 blocks answers the truth; returns how long it took.
async fn converge(router: &Client, fleet: &Fleet, d: &mut DaemonProcess, what: &str) -> Duration {
    let queries = all_queries(5);
    let live: Vec<ModelEngine> = fleet.live().into_iter().cloned().collect();
    let start = Instant::now();
    loop {
        let diff = first_difference(router, "t.lookup", &live, &queries).await;
        let Some((q, want, got)) = diff else { break };
        if start.elapsed() > Duration::from_secs(CONVERGE_S) {
            panic!("{what}: not converged in {CONVERGE_S} s: lookup {q:?} wants {want:?}, got {got:?}\nlog:\n{}", d.log_text());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(d.running(), "{what}: the daemon exited; log:\n{}", d.log_text());
    let took = start.elapsed();
    eprintln!("{what}: converged {} ms after the fault ended", took.as_millis());
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_killed_mid_stream_rebuilds_from_the_publishers() {
    let nats = NatsServer::start();
    // The default settle time: a restarted daemon is ready once the snapshots are in.
    let mut d = DaemonProcess::start(&nats.url(), &[], &[("RESYNC_INTERVAL", "1")]);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&nats.url(), "t", 4, 1).await;
    let router = connect(&nats.url()).await;
    fleet.run(100, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "baseline").await;

    // kill -9 while events flow; they keep flowing to nobody; then a new, empty daemon.
    fleet.run(20, Duration::from_millis(2)).await;
    d.kill9();
    fleet.run(50, Duration::from_millis(2)).await;
    d.restart();
    let ready = d.wait_ready(15).await;
    eprintln!("restart: ready {} ms after the process started", ready.as_millis());
    // Ready means rebuilt: every answer is right already.
    let live: Vec<ModelEngine> = fleet.live().into_iter().cloned().collect();
    let diff = first_difference(&router, "t.lookup", &live, &all_queries(5)).await;
    assert!(diff.is_none(), "ready but not rebuilt: {diff:?}\nlog:\n{}", d.log_text());
    fleet.run(20, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "kill -9 and restart").await;
    assert!(d.metric("kvindex_snapshots_total{result=\"complete\"}").await >= 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restarted_while_publishers_keep_working() {
    let port = support::free_port();
    let nats = NatsServer::start_on(port);
    let url = nats.url();
    let mut d = DaemonProcess::start(&url, &[], FAST);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&url, "t", 4, 2).await;
    let router = connect(&url).await;
    fleet.run(100, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "baseline").await;

    drop(nats);
    // The engines keep caching and evicting; their events cannot reach anyone.
    for _ in 0..60 {
        for (e, p) in fleet.engines.iter_mut().zip(&fleet.publishers) {
            e.step(p.as_ref().expect("running"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _nats = NatsServer::start_on(port);
    fleet.run(10, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "NATS restart").await;
    assert!(d.metric("kvindex_nats_events_total{event=\"disconnected\"}").await >= 1.0);
}

/// Closes every publisher: nobody is left to answer a resync.
async fn close_publishers(fleet: &mut Fleet) {
    for p in fleet.publishers.iter_mut() {
        if let Some(p) = p.take() {
            p.close().await;
        }
    }
}

/// Every publisher goes, then the daemon (`kill -9`): nobody is left to answer a resync. The
/// restarted daemon must be whole the moment it is ready: every block in, every lookup right.
async fn restart_alone(fleet: &mut Fleet, d: &mut DaemonProcess, router: &Client, what: &str) {
    let engines = fleet.engines.clone();
    close_publishers(fleet).await;
    d.kill9();
    d.restart();
    let ready = d.wait_ready(15).await;
    let held: usize = engines.iter().map(|e| e.len()).sum();
    assert_eq!(d.metric("kvindex_index_blocks").await, held as f64, "{what}: ready before everything was applied");
    eprintln!("{what}: ready {} ms after the process started", ready.as_millis());
    let diff = first_difference(router, "t.lookup", &engines, &all_queries(5)).await;
    assert!(diff.is_none(), "{what}: ready but not whole: {diff:?}\nlog:\n{}", d.log_text());
}

/// Polls until the daemon has written `n` snapshots.
async fn wait_snapshots(d: &mut DaemonProcess, n: f64) {
    let written =
        support::eventually(30, || async { (d.metric("kvindex_snapshot_writes_total{result=\"ok\"}").await >= n).then_some(()) })
            .await;
    assert!(written.is_some(), "no snapshot written in 30 s; log:\n{}", d.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_restarts_from_a_snapshot_when_the_stream_kept_only_what_came_after() {
    let js = support::JetStreamNats::start();
    let url = js.nats.url();
    // The stream keeps 3 s of events: a restart a few seconds on can be whole only from a
    // snapshot (written every second) and the stream after it.
    let durable = [
        ("RESYNC_INTERVAL", "1"),
        ("READY_SETTLE_MS", "0"),
        ("INGEST", "jetstream"),
        ("STREAM_MAX_AGE", "3"),
        ("SNAPSHOT_INTERVAL", "1"),
        ("SNAPSHOT_EVENTS", "0"),
    ];
    let mut d = DaemonProcess::start(&url, &[], &durable);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&url, "t", 4, 11).await;
    let router = connect(&url).await;
    fleet.run(3000, Duration::from_micros(100)).await;
    converge(&router, &fleet, &mut d, "snapshots, baseline").await;
    wait_snapshots(&mut d, 1.0).await;
    // Past the stream's max age: the events before now are gone from it, heartbeats go on.
    tokio::time::sleep(Duration::from_secs(4)).await;
    fleet.run(300, Duration::from_micros(100)).await;
    converge(&router, &fleet, &mut d, "snapshots, after the stream aged").await;
    let written = d.metric("kvindex_snapshot_writes_total{result=\"ok\"}").await;
    wait_snapshots(&mut d, written + 1.0).await;
    assert!(d.metric("kvindex_snapshot_bytes").await > 0.0);
    assert_eq!(d.metric("kvindex_snapshot_lease").await, 1.0, "the only replica holds the lease");

    restart_alone(&mut fleet, &mut d, &router, "snapshot restart").await;
    assert!(d.metric("kvindex_snapshot_restore_seconds").await > 0.0, "restored from the snapshot");
    assert_eq!(d.metric("kvindex_resync_requests_total{scope=\"all\"}").await, 0.0, "no broadcast when restored");
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_the_stream_moved_past_is_not_used_and_the_publishers_rebuild_the_rest() {
    let js = support::JetStreamNats::start();
    let url = js.nats.url();
    let durable = [("RESYNC_INTERVAL", "1"), ("READY_SETTLE_MS", "200"), ("INGEST", "jetstream"), ("SNAPSHOT_INTERVAL", "1")];
    let mut d = DaemonProcess::start(&url, &[], &durable);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&url, "t", 3, 12).await;
    let router = connect(&url).await;
    fleet.run(1000, Duration::from_micros(100)).await;
    wait_snapshots(&mut d, 1.0).await;
    d.kill9();
    // Events come after the snapshot; then the stream loses everything up to now (as if it
    // aged out while no replica ran), so what follows the snapshot is no longer there.
    fleet.run(200, Duration::from_micros(100)).await;
    let client = connect(&url).await;
    let js_ctx = async_nats::jetstream::new(client);
    let mut stream = js_ctx.get_stream("T_EVENTS").await.expect("the stream exists");
    stream.purge().await.expect("purges");
    assert!(stream.info().await.expect("info").state.messages == 0);
    fleet.run(500, Duration::from_micros(100)).await;
    d.restart();
    d.wait_ready(15).await;
    converge(&router, &fleet, &mut d, "stale snapshot").await;
    assert_eq!(d.metric("kvindex_snapshot_restore_seconds").await, 0.0, "a snapshot with a gap after it was loaded");
    assert!(d.metric("kvindex_resync_requests_total{scope=\"all\"}").await >= 1.0, "the publishers were asked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_restarts_whole_from_the_stream_with_every_publisher_gone() {
    let js = support::JetStreamNats::start();
    let url = js.nats.url();
    // No settle time: with no publisher to wait for, only the replay may hold readiness back.
    let durable = [("RESYNC_INTERVAL", "1"), ("READY_SETTLE_MS", "0"), ("INGEST", "jetstream")];
    let mut d = DaemonProcess::start(&url, &[], &durable);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&url, "t", 4, 6).await;
    let router = connect(&url).await;
    fleet.run(4000, Duration::from_micros(100)).await;
    converge(&router, &fleet, &mut d, "durable, baseline").await;

    restart_alone(&mut fleet, &mut d, &router, "durable restart").await;
    assert_eq!(d.metric("kvindex_snapshots_total{result=\"complete\"}").await, 0.0, "no publisher was there to help");
    assert_eq!(d.metric("kvindex_stream_pending").await, 0.0);
}

/// `n` free loopback ports, all different.
fn distinct_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    while ports.len() < n {
        let p = support::free_port();
        if !ports.contains(&p) {
            ports.push(p);
        }
    }
    ports
}

/// A member of a two-node NATS cluster: clients on `port`, routes on `cluster`, peer at `peer`.
fn cluster_node(port: u16, cluster: u16, peer: u16) -> support::NatsProcess {
    let (listen, route) = (format!("nats://127.0.0.1:{cluster}"), format!("nats://127.0.0.1:{peer}"));
    let args = ["--cluster_name", "kvindex", "--cluster", &listen, "--routes", &route];
    support::NatsProcess::start_with(port, &args, &[]).expect("cluster node starts")
}

/// Waits until a message published on one node reaches a subscriber on the other.
async fn routed(a: u16, b: u16) {
    let (sub_side, pub_side) = (connect(&format!("nats://127.0.0.1:{a}")).await, connect(&format!("nats://127.0.0.1:{b}")).await);
    let mut probe = sub_side.subscribe("probe").await.unwrap();
    sub_side.flush().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        pub_side.publish("probe", "x".into()).await.unwrap();
        pub_side.flush().await.unwrap();
        if tokio::time::timeout(Duration::from_millis(200), probe.next()).await.is_ok() {
            return;
        }
        assert!(Instant::now() < deadline, "the NATS cluster did not form");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_node_of_a_nats_cluster_dies_in_turn_under_daemon_publishers_and_router() {
    let ports = distinct_ports(4);
    let (pa, pb, ca, cb) = (ports[0], ports[1], ports[2], ports[3]);
    let mut nodes = [Some(cluster_node(pa, ca, cb)), Some(cluster_node(pb, cb, ca))];
    routed(pa, pb).await;
    let url = format!("nats://127.0.0.1:{pa},nats://127.0.0.1:{pb}");
    let mut d = DaemonProcess::start(&url, &[], FAST);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&url, "t", 4, 5).await;
    let router = connect(&url).await;
    fleet.run(100, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "two-node cluster").await;

    // Whichever node each client picked, one of the two deaths takes it away.
    for (victim, (port, cluster, peer)) in [(pa, ca, cb), (pb, cb, ca)].into_iter().enumerate() {
        nodes[victim] = None;
        fleet.run(30, Duration::from_millis(10)).await;
        converge(&router, &fleet, &mut d, &format!("cluster node {victim} killed")).await;
        nodes[victim] = Some(cluster_node(port, cluster, peer));
        let other = if victim == 0 { pb } else { pa };
        routed(port, other).await;
    }
    assert!(d.metric("kvindex_nats_events_total{event=\"disconnected\"}").await >= 1.0);
}

/// Forwards `src.events.*` to `t.events.*`, dropping and repeating batches; passes resync
/// requests and broadcasts the other way.
async fn lossy_relay(client: Client, drop_pct: Arc<AtomicU64>, dup_pct: u64) -> tokio::task::JoinHandle<()> {
    let mut events = client.subscribe("src.events.*").await.unwrap();
    let mut broadcasts = client.subscribe("t.resync").await.unwrap();
    let mut requests = client.subscribe("t.resync.*").await.unwrap();
    client.flush().await.unwrap();
    tokio::spawn(async move {
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut roll = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % 100
        };
        loop {
            tokio::select! {
                Some(m) = events.next() => {
                    if roll() < drop_pct.load(Ordering::Relaxed) {
                        continue;
                    }
                    let subject = m.subject.replacen("src.", "t.", 1);
                    let copies = if roll() < dup_pct { 2 } else { 1 };
                    for _ in 0..copies {
                        let _ = client.publish(subject.clone(), m.payload.clone()).await;
                    }
                }
                Some(_) = broadcasts.next() => {
                    let _ = client.publish("src.resync", bytes::Bytes::new()).await;
                }
                Some(m) = requests.next() => {
                    let (client, subject) = (client.clone(), m.subject.replacen("t.", "src.", 1));
                    tokio::spawn(async move {
                        if let (Ok(answer), Some(reply)) = (client.request(subject, m.payload).await, m.reply) {
                            let _ = client.publish(reply, answer.payload).await;
                        }
                    });
                }
                else => return,
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_and_duplicated_batches_heal() {
    let nats = NatsServer::start();
    let mut d = DaemonProcess::start(&nats.url(), &[], FAST);
    d.wait_ready(10).await;
    let drop_pct = Arc::new(AtomicU64::new(10));
    let relay = lossy_relay(connect(&nats.url()).await, drop_pct.clone(), 10).await;
    let mut fleet = Fleet::start(&nats.url(), "src", 4, 3).await;
    let router = connect(&nats.url()).await;
    fleet.run(150, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "10% of batches dropped, 10% repeated").await;

    // Every worker's last batch is lost; only heartbeats follow, and they must reveal it.
    drop_pct.store(100, Ordering::Relaxed);
    fleet.run(1, Duration::ZERO).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop_pct.store(0, Ordering::Relaxed);
    converge(&router, &fleet, &mut d, "the last batch of every worker lost").await;
    assert!(d.metric("kvindex_event_gaps_total").await > 0.0);
    assert!(d.metric("kvindex_duplicate_events_total").await > 0.0);
    relay.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_and_silence_past_the_ttl() {
    let nats = NatsServer::start();
    let mut d = DaemonProcess::start(&nats.url(), &["--worker-ttl", "2"], FAST);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&nats.url(), "t", 4, 4).await;
    let router = connect(&nats.url()).await;
    fleet.run(100, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "baseline").await;

    // Worker 2's engine restarts: a new process, a new epoch, an empty cache.
    fleet.publishers[1] = None;
    fleet.engines[1] = ModelEngine::new(2, 99, 60);
    fleet.publishers[1] = Some(fleet.publisher(2).await);
    fleet.run(50, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "publisher restart (new epoch)").await;
    assert!(d.metric("kvindex_epoch_changes_total").await >= 1.0);

    // Worker 3's engine dies without a word: after the TTL no lookup may name it.
    fleet.publishers[2] = None;
    let took = converge(&router, &fleet, &mut d, "publisher silent past the 2 s TTL").await;
    assert!(took < Duration::from_secs(4), "expired {took:?} after going silent");
    assert_eq!(d.metric("kvindex_workers_expired_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_malformed_messages_beside_good_traffic() {
    let nats = NatsServer::start();
    let mut d = DaemonProcess::start(&nats.url(), &[], FAST);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&nats.url(), "t", 4, 5).await;
    let router = connect(&nats.url()).await;

    let flooder = connect(&nats.url()).await;
    let flood = tokio::spawn(async move {
        let good = kvindex_client::protocol::encode_batch(&kvindex_client::protocol::EventBatch {
            header: kvindex_client::protocol::BatchHeader { worker_id: 1, epoch: 1, ..Default::default() },
            worker: None,
            events: vec![Ok(kvindex_client::protocol::KvEvent::stored(0, None, &[(1, 2), (3, 4)]))],
        });
        let mismatched = {
            let mut b = kvindex_client::protocol::decode_batch(&good).unwrap();
            b.header.worker_id = 2;
            kvindex_client::protocol::encode_batch(&b)
        };
        let mut sent = 0u64;
        loop {
            let garbage: Vec<(&str, Vec<u8>)> = vec![
                ("t.events.1", vec![0xc1, 0xff, 0x00]),
                ("t.events.1", good[..good.len() / 2].to_vec()),
                ("t.events.1", mismatched.clone()),
                ("t.events.3", b"{\"json\": true}".to_vec()),
                ("t.events.x", good.clone()),
                ("t.events.4", rmp_serde::to_vec(&("worker", 4, [1, 2, 3])).unwrap()),
                ("t.lookup", vec![0x92, 0x01]),
            ];
            for (subject, payload) in garbage {
                if flooder.publish(subject, payload.into()).await.is_err() {
                    return sent;
                }
                sent += 1;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    fleet.run(150, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "malformed flood beside good traffic").await;
    flood.abort();
    for reason in ["not_msgpack", "worker_mismatch", "bad_subject", "bad_batch"] {
        let n = d.metric(&format!("kvindex_decode_failures_total{{reason=\"{reason}\"}}")).await;
        assert!(n > 0.0, "no {reason} counted");
    }
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_subscription_capacity_is_detected_and_healed() {
    let nats = NatsServer::start();
    // A small client buffer and one apply thread with a one-batch queue: a burst overflows.
    let env = [FAST, &[("SUBSCRIPTION_CAPACITY", "32"), ("QUEUE_CAPACITY", "1"), ("APPLY_THREADS", "1")]].concat();
    let mut d = DaemonProcess::start(&nats.url(), &[], &env);
    d.wait_ready(10).await;
    let mut fleet = Fleet::start(&nats.url(), "t", 4, 9).await;
    let router = connect(&nats.url()).await;
    fleet.run(50, Duration::from_millis(2)).await;
    converge(&router, &fleet, &mut d, "baseline").await;

    // 5,000 batches at once from a fifth worker, while the engines go on.
    let flood = connect(&nats.url()).await;
    let heartbeat = kvindex_client::protocol::encode_batch(&kvindex_client::protocol::EventBatch {
        header: kvindex_client::protocol::BatchHeader { worker_id: 99, epoch: 1, next_event_id: Some(0), ..Default::default() },
        worker: None,
        events: vec![],
    });
    for _ in 0..5000 {
        flood.publish("t.events.99", heartbeat.clone().into()).await.unwrap();
    }
    flood.flush().await.unwrap();
    fleet.run(30, Duration::from_millis(2)).await;
    let dropped = support::eventually(10, || async {
        (d.metric("kvindex_nats_events_total{event=\"slow_consumer\"}").await >= 1.0).then_some(())
    })
    .await;
    assert!(dropped.is_some(), "the burst overflowed the client buffer (or this test lost its teeth); log:\n{}", d.log_text());
    assert!(d.metric("kvindex_resync_requests_total{scope=\"all\"}").await >= 2.0, "a broadcast after the loss");
    converge(&router, &fleet, &mut d, "slow consumer").await;
    assert!(d.log_text().contains("slow consumer"), "the loss is logged");
}

/// A member of a three-node JetStream cluster: clients on `ports[i]`, routes on `routes[i]`
/// to the two others, its store in `dir`.
fn js_cluster_node(i: usize, ports: &[u16], routes: &[u16], dir: &std::path::Path) -> support::NatsProcess {
    let store = dir.join(format!("n{i}"));
    let listen = format!("nats://127.0.0.1:{}", routes[i]);
    let peers: Vec<String> = (0..3).filter(|&j| j != i).map(|j| format!("nats://127.0.0.1:{}", routes[j])).collect();
    let peers = peers.join(",");
    let name = format!("n{i}");
    let args = [
        "-js",
        "-sd",
        store.to_str().expect("UTF-8 temp dir"),
        "--server_name",
        &name,
        "--cluster_name",
        "kvjs",
        "--cluster",
        &listen,
        "--routes",
        &peers,
    ];
    support::NatsProcess::start_with(ports[i], &args, &[]).expect("cluster node starts")
}

/// For a wrong answer: worker `worker`'s batches as the stream holds them, in order, with the
/// answers several more askings of `q` get (each may come from another replica).
async fn diagnose(router: &Client, worker: u64, q: &[u64]) -> String {
    use async_nats::jetstream::consumer::pull::OrderedConfig;
    use std::fmt::Write;
    let mut out = String::new();
    let mut parent = None;
    for &l in q {
        let h = support::engine::block_hash(parent, l);
        let _ = writeln!(out, "block of local {l}: {h:?}");
        parent = Some(h);
    }
    for _ in 0..9 {
        let _ = writeln!(out, "ask {q:?}: {:?}", ask(router, "t.lookup", q).await);
    }
    let js = async_nats::jetstream::new(router.clone());
    let Ok(stream) = js.get_stream("T_EVENTS").await else { return out };
    let cfg = OrderedConfig { filter_subject: format!("t.events.{worker}"), ..Default::default() };
    let Ok(consumer) = stream.create_consumer(cfg).await else { return out };
    let Ok(mut msgs) = consumer.messages().await else { return out };
    while let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(3), msgs.next()).await {
        let (seq, pending) = m.info().map(|i| (i.stream_sequence, i.pending)).unwrap_or((0, 0));
        match kvindex_client::protocol::decode_batch(&m.payload) {
            Ok(b) => {
                let h = &b.header;
                let evs: Vec<String> = b
                    .events
                    .iter()
                    .map(|e| match e {
                        Ok(e) => format!("{}:{:?}", e.event_id, e.data),
                        Err(e) => format!("bad {e}"),
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    "seq {seq} epoch {} snap {} end {} next {:?}: {}",
                    h.epoch,
                    h.snapshot,
                    h.snapshot_end,
                    h.next_event_id,
                    evs.join(" | ")
                );
            }
            Err(e) => {
                let _ = writeln!(out, "seq {seq}: undecodable {e}");
            }
        }
        if pending == 0 {
            break;
        }
    }
    out
}

/// Every lookup of up to 5 blocks, once: how many were answered, and the first answer that is
/// wrong (a match deeper than the truth, or of a worker holding nothing of it, not flagged stale).
async fn answers_never_wrong(router: &Client, engines: &[ModelEngine]) -> (usize, usize, Option<String>) {
    let (answered, asked, wrong) = first_wrong(router, engines).await;
    let wrong = match wrong {
        Some((w, q, what)) => Some(format!("{what}\n{}", diagnose(router, w, &q).await)),
        None => None,
    };
    (answered, asked, wrong)
}

async fn first_wrong(router: &Client, engines: &[ModelEngine]) -> (usize, usize, Option<(u64, Vec<u64>, String)>) {
    let queries = all_queries(5);
    let mut answered = 0;
    for q in &queries {
        let Some(got) = ask(router, "t.lookup", q).await else { continue };
        answered += 1;
        for m in got {
            let truth = engines.iter().find(|e| e.worker_id == m.worker_id).map_or(0, |e| e.prefix_len(q));
            if m.blocks > truth && !m.stale {
                let what = format!("lookup {q:?}: worker {} at {} blocks, truth {truth}", m.worker_id, m.blocks);
                return (answered, queries.len(), Some((m.worker_id, q.clone(), what)));
            }
        }
    }
    (answered, queries.len(), None)
}

/// Waits until a replica is in the lookup queue group, then until every ready replica has
/// ingested the stream up to its last message as read here, applied all of it (no apply
/// queue holds anything, twice 100 ms apart) and holds `blocks` blocks; how long the wait for
/// a ready replica took. It first waits out what a replica takes to see that its stream
/// consumer died with a NATS node (two seconds without progress replace the consumer).
async fn caught_up(
    js: &async_nats::jetstream::Context,
    replicas: &mut [Option<DaemonProcess>],
    blocks: usize,
    what: &str,
) -> Duration {
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let serving = answering_again(replicas, what).await;
    let last = support::eventually(CONVERGE_S, || async {
        let info = async { js.get_stream("T_EVENTS").await.ok()?.info().await.ok().map(|i| i.state.last_sequence) };
        tokio::time::timeout(Duration::from_secs(2), info).await.ok().flatten()
    })
    .await;
    let last = last.unwrap_or_else(|| panic!("{what}: the stream's state cannot be read")) as f64;
    for d in replicas.iter_mut().flatten() {
        // A replica out of the queue group answers nothing: it need not have caught up.
        if support::http_get(&d.metrics_addr, "/readyz").await.map(|r| r.0) != Some(200) {
            eprintln!("{what}: a replica is not ready (out of the lookup queue group)");
            continue;
        }
        let addr = d.metrics_addr.clone();
        let idle = || async {
            let text = support::http_get(&addr, "/metrics").await.map(|r| r.1).unwrap_or_default();
            let queued: f64 = text
                .lines()
                .filter(|l| l.starts_with("kvindex_apply_queue_depth{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            support::metric_value(&text, "kvindex_stream_sequence") >= last
                && queued == 0.0
                && support::metric_value(&text, "kvindex_index_blocks") == blocks as f64
        };
        let done = support::eventually(CONVERGE_S, || async {
            if !idle().await {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            idle().await.then_some(())
        })
        .await;
        assert!(done.is_some(), "{what}: a replica did not catch up; log:\n{}", d.log_text());
    }
    serving
}

/// Lookups asked one after another in the background, as a router would keep asking through
/// a fault: how many were asked and answered since the last `take`.
struct Prober {
    counts: Arc<(AtomicU64, AtomicU64)>,
    task: tokio::task::JoinHandle<()>,
}

impl Prober {
    fn start(router: Client) -> Prober {
        let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let c = counts.clone();
        let task = tokio::spawn(async move {
            for q in all_queries(3).iter().cycle() {
                let answered = ask(&router, "t.lookup", q).await.is_some();
                c.0.fetch_add(1, Ordering::Relaxed);
                c.1.fetch_add(answered as u64, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Prober { counts, task }
    }

    /// (asked, answered) since the last call.
    fn take(&self) -> (u64, u64) {
        (self.counts.0.swap(0, Ordering::Relaxed), self.counts.1.swap(0, Ordering::Relaxed))
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// "answered of asked (share)" for a fault's report.
fn share((asked, answered): (u64, u64)) -> String {
    format!("{answered} of {asked} ({:.0}%)", 100.0 * answered as f64 / asked.max(1) as f64)
}

/// Waits until a replica is in the lookup queue group again (all may have left to catch up
/// with the stream after a NATS node died); how long that took.
async fn answering_again(replicas: &mut [Option<DaemonProcess>], what: &str) -> Duration {
    let start = Instant::now();
    let ready = support::eventually(CONVERGE_S, || async {
        for d in replicas.iter().flatten() {
            if support::http_get(&d.metrics_addr, "/readyz").await.map(|r| r.0) == Some(200) {
                return Some(());
            }
        }
        None
    })
    .await;
    if ready.is_none() {
        let logs: Vec<String> = replicas.iter().flatten().map(|d| d.log_text()).collect();
        panic!("{what}: no replica back in the lookup queue group in {CONVERGE_S} s; logs:\n{}", logs.join("\n===\n"));
    }
    start.elapsed()
}

/// Issue 12's fault test: a three-node NATS cluster with JetStream (the stream in 3 copies),
/// three kvindex replicas in durable mode, model engines and a router. One NATS node is killed
/// and restarted, then one replica; then every replica is killed with the publishers gone and
/// one is restarted. No lookup may be wrong (deeper than the truth, unflagged) at any point;
/// the share answered during each fault and the times to ready are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_cluster_loses_a_node_then_a_replica_then_every_replica() {
    let ports = distinct_ports(6);
    let (client_ports, route_ports) = ports.split_at(3);
    let dir = std::env::temp_dir().join(format!("kvindex-jsc-{}-{}", std::process::id(), ports[0]));
    let mut nodes: Vec<Option<support::NatsProcess>> =
        (0..3).map(|i| Some(js_cluster_node(i, client_ports, route_ports, &dir))).collect();
    let url = client_ports.iter().map(|p| format!("nats://127.0.0.1:{p}")).collect::<Vec<_>>().join(",");
    // The stream in three copies, once the cluster has elected its JetStream leader.
    let admin = connect(&url).await;
    let js = async_nats::jetstream::new(admin.clone());
    let made = support::eventually(60, || async {
        let cfg = async_nats::jetstream::stream::Config {
            name: "T_EVENTS".into(),
            subjects: vec!["t.events.>".into()],
            max_age: Duration::from_secs(3600),
            max_bytes: 1 << 30,
            storage: async_nats::jetstream::stream::StorageType::File,
            num_replicas: 3,
            ..Default::default()
        };
        js.get_or_create_stream(cfg).await.ok().map(|_| ())
    })
    .await;
    assert!(made.is_some(), "the JetStream cluster did not form");
    let env = [
        ("RESYNC_INTERVAL", "1"),
        ("READY_SETTLE_MS", "200"),
        ("INGEST", "jetstream"),
        ("STREAM_REPLICAS", "3"),
        ("SNAPSHOT_INTERVAL", "1"),
    ];
    let mut replicas: Vec<Option<DaemonProcess>> = (0..3).map(|_| Some(DaemonProcess::start(&url, &[], &env))).collect();
    for d in replicas.iter_mut().flatten() {
        d.wait_ready(30).await;
    }
    // Publishers confirm every batch with the stream: one lost with a dying node is sent again.
    let mut fleet = Fleet::start_with(&url, "t", 4, 21, true).await;
    let router = connect(&url).await;
    let held = |f: &Fleet| f.engines.iter().map(|e| e.len()).sum::<usize>();
    fleet.run(200, Duration::from_millis(2)).await;
    caught_up(&js, &mut replicas, held(&fleet), "baseline").await;
    let (_, _, wrong) = answers_never_wrong(&router, &fleet.engines).await;
    assert!(wrong.is_none(), "baseline: {wrong:?}");
    // A second router keeps asking through every fault: the share it gets answered.
    let probe = Prober::start(connect(&url).await);

    // 1. A NATS node dies under events; the two others keep the stream's quorum.
    nodes[0] = None;
    fleet.run(100, Duration::from_millis(5)).await;
    let serving = caught_up(&js, &mut replicas, held(&fleet), "a NATS node down").await;
    let during = probe.take();
    let (answered, asked, wrong) = answers_never_wrong(&router, &fleet.engines).await;
    if wrong.is_some() {
        for p in fleet.publishers.iter().flatten() {
            eprintln!("publisher {:?}", p.stats());
        }
        for d in replicas.iter().flatten() {
            let text = support::http_get(&d.metrics_addr, "/metrics").await.map(|r| r.1).unwrap_or_default();
            let wanted = [
                "kvindex_stale",
                "kvindex_event_gaps",
                "kvindex_stream",
                "kvindex_ready",
                "kvindex_resync",
                "kvindex_snapshots_total",
                "kvindex_duplicate",
                "kvindex_lookup_member",
                "kvindex_nats",
            ];
            let lines: Vec<&str> = text.lines().filter(|l| wanted.iter().any(|w| l.starts_with(w))).collect();
            eprintln!("=== replica {}\n{}\n{}", d.metrics_addr, lines.join("\n"), d.log_text());
        }
    }
    assert!(wrong.is_none(), "a NATS node down: {wrong:?}");
    let mut restarts = 0.0;
    for d in replicas.iter().flatten() {
        restarts += d.metric("kvindex_stream_consumer_restarts_total").await;
    }
    eprintln!(
        "NATS node killed: {} of the lookups asked meanwhile answered; a replica ready {} ms after the checks began; {answered}/{asked} lookups answered then; {restarts} stalled consumers replaced",
        share(during),
        serving.as_millis()
    );

    nodes[0] = Some(js_cluster_node(0, client_ports, route_ports, &dir));
    fleet.run(100, Duration::from_millis(5)).await;
    caught_up(&js, &mut replicas, held(&fleet), "the NATS node back").await;
    for d in replicas.iter_mut().flatten() {
        let back = d.wait_ready(CONVERGE_S).await;
        eprintln!("the NATS node back: replica {} in the lookup queue group after {} ms more", d.metrics_addr, back.as_millis());
    }
    probe.take();

    // 2. A replica dies; lookups go to the two others; it comes back from snapshot and stream.
    if let Some(d) = replicas[1].as_mut() {
        d.kill9();
    }
    let down = replicas[1].take();
    fleet.run(100, Duration::from_millis(5)).await;
    caught_up(&js, &mut replicas, held(&fleet), "a replica down").await;
    let (answered, asked, wrong) = answers_never_wrong(&router, &fleet.engines).await;
    assert!(wrong.is_none(), "a replica down: {wrong:?}");
    eprintln!("replica killed: {} of the lookups asked meanwhile answered; {answered}/{asked} then", share(probe.take()));
    let mut d = down.expect("the replica");
    d.restart();
    let ready = d.wait_ready(30).await;
    eprintln!("replica restarted: ready in {} ms", ready.as_millis());
    replicas[1] = Some(d);
    caught_up(&js, &mut replicas, held(&fleet), "the replica back").await;
    converge(&router, &fleet, replicas[1].as_mut().expect("replica"), "replica back").await;

    // 3. The engines' publishers go, then every replica; one comes back, whole.
    let engines = fleet.engines.clone();
    close_publishers(&mut fleet).await;
    // A snapshot after the last events (the lease holder writes one a second while the
    // stream moves; the closes moved it), though any older one with the stream after it
    // would do as well.
    tokio::time::sleep(Duration::from_secs(2)).await;
    for d in replicas.iter_mut().flatten() {
        d.kill9();
    }
    drop(probe);
    let mut d = replicas[2].take().expect("replica");
    d.restart();
    let ready = d.wait_ready(30).await;
    eprintln!("every replica killed, one restarted: ready in {} ms", ready.as_millis());
    assert_eq!(d.metric("kvindex_index_blocks").await, engines.iter().map(|e| e.len()).sum::<usize>() as f64);
    let diff = first_difference(&router, "t.lookup", &engines, &all_queries(5)).await;
    assert!(diff.is_none(), "not whole after the restart: {diff:?}\nlog:\n{}", d.log_text());
    assert!(d.metric("kvindex_snapshot_restore_seconds").await > 0.0, "restored from a snapshot");
    drop(nodes);
    let _ = std::fs::remove_dir_all(&dir);
}
