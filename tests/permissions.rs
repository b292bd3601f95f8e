//! The shipped least-privilege NATS configuration (`config/nats/least-privilege.conf`), on a
//! real `nats-server`: an engine writes only its own worker's state and hears only its own
//! resync requests; a router can ask lookups but not write events; kvindex works as usual.

mod support;

use async_nats::{Client, ConnectOptions};
use futures::StreamExt;
use kvindex_client::core::{BlockHash, LocalHash, StoredBlock};
use kvindex_client::protocol::{encode_batch, BatchHeader, EventBatch, KvEvent};
use kvindex_client::{LookupClient, MatchEntry, Publisher, PublisherConfig, Query};
use std::time::Duration;
use support::{eventually, Daemon, NatsProcess};

const SECRETS: [(&str, &str); 4] = [
    ("KVINDEX_NATS_PASSWORD", "k-secret"),
    ("ROUTER_NATS_PASSWORD", "r-secret"),
    ("ENGINE_1_NATS_PASSWORD", "e1-secret"),
    ("ENGINE_2_NATS_PASSWORD", "e2-secret"),
];

async fn connect(url: &str, user: &str, password: &str) -> Client {
    ConnectOptions::with_user_and_password(user.into(), password.into()).connect(url).await.expect("credentials accepted")
}

fn batch(worker_id: u64, epoch: u64, event_id: u64, blocks: &[(u64, u64)]) -> Vec<u8> {
    encode_batch(&EventBatch {
        header: BatchHeader { worker_id, epoch, ..BatchHeader::default() },
        worker: None,
        events: vec![Ok(KvEvent::stored(event_id, None, blocks))],
    })
}

/// kvindex in this process under its role (user `kvindex`, prefix `kv`), tuned by `tune`.
async fn kvindex_role(url: &str, tune: impl FnOnce(&mut kvindex::config::Config)) -> Daemon {
    Daemon::start(url, |cfg| {
        cfg.prefix = "kv".into();
        cfg.nats.nats_user = Some("kvindex".into());
        cfg.nats.nats_password = Some("k-secret".into());
        tune(cfg);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_party_can_do_its_job_and_nothing_else() {
    let conf = concat!(env!("CARGO_MANIFEST_DIR"), "/config/nats/least-privilege.conf");
    let nats = NatsProcess::start_with(support::free_port(), &["-c", conf], &SECRETS).expect("nats-server takes the config");
    let url = nats.url();
    let d = kvindex_role(&url, |cfg| cfg.replica_check_interval = 1).await;
    let kvindex_peer = connect(&url, "kvindex", "k-secret").await;
    let mut replicas = kvindex_peer.subscribe("kv.replicas").await.unwrap();
    kvindex_peer.flush().await.unwrap();

    // Engine 1 publishes through the publisher library: its own subject, its own resyncs.
    let engine1 = connect(&url, "engine-1", "e1-secret").await;
    let p1 = Publisher::start(engine1.clone(), PublisherConfig::new("kv", 1, 0)).await.unwrap();
    p1.stored(None, &[StoredBlock::new(10, 1), StoredBlock::new(11, 2)]);
    p1.flush().await;
    let router = connect(&url, "router", "r-secret").await;
    let lookups = LookupClient::new(router.clone(), "kv").with_timeout(Duration::from_secs(2));
    let q = Query::hashes(&[LocalHash(1), LocalHash(2)]);
    let one =
        vec![MatchEntry { worker_id: 1, dp_rank: 0, blocks: 2, stale: false, tiers: Default::default(), ..Default::default() }];
    let seen = eventually(10, || async { lookups.lookup(&q).await.ok().filter(|a| a.matches == one) }).await;
    assert!(seen.is_some(), "kvindex, engine and router work under their roles");

    // Engine 1 writes worker 2's subject, then (a control) its own: order holds per connection,
    // so once the control is applied the forged batch would have been too.
    engine1.publish("kv.events.2", batch(2, 1, 0, &[(20, 1)]).into()).await.unwrap();
    engine1.flush().await.unwrap();
    p1.stored(None, &[StoredBlock::new(30, 7)]);
    p1.flush().await;
    let control = Query::hashes(&[LocalHash(7)]);
    assert!(eventually(10, || async { lookups.lookup(&control).await.ok().filter(|a| !a.matches.is_empty()) }).await.is_some());
    assert_eq!(lookups.lookup(&q).await.unwrap().matches, one, "worker 2 holds nothing: the forged batch was refused");

    // Engine 1 cannot listen to worker 2's resync requests (nor answer them).
    let mut theirs = engine1.subscribe("kv.resync.2").await.unwrap();
    let mut mine = engine1.subscribe("kv.resync.1").await.unwrap();
    engine1.flush().await.unwrap();
    let kvindex_role = connect(&url, "kvindex", "k-secret").await;
    kvindex_role.publish("kv.resync.2", "{}".into()).await.unwrap();
    kvindex_role.publish("kv.resync.1", "{}".into()).await.unwrap();
    kvindex_role.flush().await.unwrap();
    assert!(tokio::time::timeout(Duration::from_secs(5), mine.next()).await.is_ok(), "its own request arrives");
    let overheard = tokio::time::timeout(Duration::from_millis(500), theirs.next()).await;
    assert!(!matches!(overheard, Ok(Some(_))), "engine 1 heard worker 2's resync request");

    // The router cannot write events.
    // Worker 1's own epoch, so that the forgery would apply if it got through.
    router.publish("kv.events.1", batch(1, p1.epoch(), 1000, &[(40, 1), (41, 2), (42, 3)]).into()).await.unwrap();
    router.flush().await.unwrap();
    p1.stored(Some(BlockHash(30)), &[StoredBlock::new(31, 8)]);
    p1.flush().await;
    let control = Query::hashes(&[LocalHash(7), LocalHash(8)]);
    assert!(eventually(10, || async {
        lookups.lookup(&control).await.ok().filter(|a| a.matches.len() == 1 && a.matches[0].blocks == 2)
    })
    .await
    .is_some());
    let deeper = lookups.lookup(&Query::hashes(&[LocalHash(1), LocalHash(2), LocalHash(3)])).await.unwrap();
    assert_eq!(deeper.matches, one, "the router's forged third block is not there");
    assert_eq!(d.metric("kvindex_event_gaps_total").await, 0.0, "nothing forged reached worker 1's sequence");

    // The router may announce where it sent a request; kvindex hears it under its role.
    let sent = Query::hashes(&[LocalHash(1), LocalHash(2), LocalHash(3)]);
    lookups.announce_applied(&sent, 1, 0).await.expect("the router announces");
    let predicted = lookups.lookup(&sent).await.unwrap().matches;
    assert_eq!(predicted, vec![MatchEntry { worker_id: 1, blocks: 2, predicted_blocks: Some(3), ..Default::default() }]);

    // Replicas compare on kv.replicas under their role; nobody else writes there.
    router.publish("kv.replicas", "forged".into()).await.unwrap();
    engine1.publish("kv.replicas", "forged".into()).await.unwrap();
    let sent = tokio::time::timeout(Duration::from_secs(10), replicas.next()).await.ok().flatten();
    assert!(sent.is_some_and(|m| m.payload.as_ref() != b"forged"), "kvindex sends its checkpoints, and only kvindex");
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"bad_replica_digests\"}").await, 0.0, "no forgery reached it");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_mode_works_under_its_role_and_nobody_else_touches_the_stream() {
    let conf = concat!(env!("CARGO_MANIFEST_DIR"), "/config/nats/least-privilege.conf");
    let store = std::env::temp_dir().join(format!("kvindex-perm-js-{}-{}", std::process::id(), support::free_port()));
    let args = ["-c", conf, "-js", "-sd", store.to_str().expect("a UTF-8 temp dir")];
    let nats = NatsProcess::start_with(support::free_port(), &args, &SECRETS).expect("nats-server takes the config");
    let url = nats.url();
    let d = kvindex_role(&url, |cfg| {
        cfg.ingest = kvindex::config::Ingest::Jetstream;
        cfg.snapshot_interval = 1;
    })
    .await;
    let engine1 = connect(&url, "engine-1", "e1-secret").await;
    let p1 = Publisher::start(engine1.clone(), PublisherConfig::new("kv", 1, 0)).await.unwrap();
    p1.stored(None, &[StoredBlock::new(10, 1), StoredBlock::new(11, 2)]);
    p1.flush().await;
    let router = connect(&url, "router", "r-secret").await;
    let lookups = LookupClient::new(router.clone(), "kv").with_timeout(Duration::from_secs(2));
    let q = Query::hashes(&[LocalHash(1), LocalHash(2)]);
    let one =
        vec![MatchEntry { worker_id: 1, dp_rank: 0, blocks: 2, stale: false, tiers: Default::default(), ..Default::default() }];
    let seen = eventually(10, || async { lookups.lookup(&q).await.ok().filter(|a| a.matches == one) }).await;
    assert!(seen.is_some(), "kvindex reads its stream under its role");
    // A refused request times out (10 s), so every attempt runs at once.
    let mut attempts = Vec::new();
    for (who, client) in [("engine", &engine1), ("router", &router)] {
        for stream in ["KV_EVENTS", "KV_KV_EVENTS_LEASE", "OBJ_KV_EVENTS_SNAPSHOTS"] {
            let js = async_nats::jetstream::new(client.clone());
            attempts.push(async move { (who, stream, js.delete_stream(stream).await.is_err()) });
        }
    }
    for (who, stream, refused) in futures::future::join_all(attempts).await {
        assert!(refused, "the {who} deleted {stream}");
    }
    assert_eq!(d.metric("kvindex_stream_pending").await, 0.0);
    // It takes the snapshot lease and writes a snapshot under its role...
    let written =
        eventually(20, || async { (d.metric("kvindex_snapshot_writes_total{result=\"ok\"}").await >= 1.0).then_some(()) });
    assert!(written.await.is_some(), "kvindex writes snapshots under its role");
    d.stop().await.unwrap();
    // ...and a restarted kvindex loads it under the same role.
    let d = kvindex_role(&url, |cfg| cfg.ingest = kvindex::config::Ingest::Jetstream).await;
    assert!(d.metric("kvindex_snapshot_restore_seconds").await > 0.0, "kvindex loads its snapshot under its role");
    let seen = eventually(10, || async { lookups.lookup(&q).await.ok().filter(|a| a.matches == one) }).await;
    assert!(seen.is_some(), "whole again from the snapshot");
    d.stop().await.unwrap();
    drop(nats);
    let _ = std::fs::remove_dir_all(&store);
}
