//! Predicted placements and approximate mode through a real `nats-server` and `kvindex serve`:
//! routers announce where they sent a request (`{prefix}.routed`, or `route_to` on a lookup);
//! answers carry `predicted_blocks` beside `blocks`, which never counts them; the engine's own
//! events supersede them; every bound (per worker, in total, worker slots, TTL) holds and is
//! counted; routed-only workers' blocks are announcements alone, flagged `approximate`.

mod support;

use kvindex_client::core::{LocalHash, StoredBlock};
use kvindex_client::protocol::KvEvent;
use kvindex_client::{LookupClient, MatchEntry, Query};
use kvindex_core::Event;
use std::time::Duration;
use support::{eventually, publish, Daemon, NatsServer};

fn hashes(v: &[u64]) -> Query {
    Query::hashes(&v.iter().map(|&h| LocalHash(h)).collect::<Vec<_>>())
}

fn entry(worker_id: u64, blocks: u32, predicted: Option<u32>) -> MatchEntry {
    MatchEntry { worker_id, blocks, predicted_blocks: predicted, ..Default::default() }
}

fn stored(id: u64, locals: &[u64]) -> KvEvent {
    let blocks = locals.iter().map(|&l| StoredBlock::new(1000 + l, l)).collect();
    KvEvent { event_id: id, data: Event::Stored { parent: None, blocks, tier: kvindex_core::Tier::Device } }
}

async fn client(d: &Daemon, nats: &str) -> LookupClient {
    let c = async_nats::connect(nats).await.unwrap();
    LookupClient::new(c, &d.cfg.prefix).with_timeout(Duration::from_secs(5))
}

/// Polls until `metric` reads `want` (a generous deadline: nothing here depends on timing).
async fn metric_reaches(d: &Daemon, metric: &str, want: f64) {
    let got = eventually(20, || async { (d.metric(metric).await == want).then_some(()) }).await;
    assert!(got.is_some(), "{metric}: wanted {want}, got {}", d.metric(metric).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn announced_blocks_are_predicted_beside_the_held_ones() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.predicted_ttl = 600.0).await;
    let lookups = client(&d, &nats.url()).await;
    let raw = async_nats::connect(nats.url()).await.unwrap();
    publish(&raw, 1, vec![stored(0, &[1, 2])]).await;
    let prompt = hashes(&[1, 2, 3, 4, 5]);
    let held = eventually(10, || async { lookups.lookup(&prompt).await.ok().filter(|a| a.matches.len() == 1) }).await;
    assert_eq!(held.unwrap().matches, vec![entry(1, 2, None)]);

    // Worker 1 is sent the whole prompt, worker 2 its first three blocks: predictions, not holdings.
    lookups.announce_applied(&prompt, 1, 0).await.unwrap();
    lookups.announce_applied(&hashes(&[1, 2, 3]), 2, 0).await.unwrap();
    let answer = lookups.lookup(&prompt).await.unwrap();
    assert_eq!(answer.matches, vec![entry(1, 2, Some(5)), entry(2, 0, Some(3))], "held depth first, predictions beside");
    // A worker filter applies to predictions too.
    let only2 = lookups.lookup(&hashes(&[1, 2, 3, 4, 5]).only_workers(&[2])).await.unwrap();
    assert_eq!(only2.matches, vec![entry(2, 0, Some(3))]);

    // The engine's own events catch up: held blocks need no prediction beside them.
    publish(&raw, 1, vec![stored(1, &[1, 2, 3, 4, 5])]).await;
    let confirmed = eventually(10, || async { lookups.lookup(&prompt).await.ok().filter(|a| a.matches[0].blocks == 5) }).await;
    assert_eq!(confirmed.unwrap().matches, vec![entry(1, 5, None), entry(2, 0, Some(3))]);

    // `route_to` on a lookup announces it as well, once answered.
    let asked = hashes(&[1, 2, 3, 4]).route_to(7, 0);
    lookups.lookup(&asked).await.unwrap();
    let routed = eventually(10, || async {
        let a = lookups.lookup(&hashes(&[1, 2, 3, 4])).await.ok()?;
        a.matches.iter().find(|m| m.worker_id == 7).cloned()
    })
    .await;
    assert_eq!(routed, Some(entry(7, 0, Some(4))));
    metric_reaches(&d, "kvindex_predicted_blocks", 5.0 + 3.0 + 4.0).await;
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predictions_are_bounded_per_worker_in_total_and_by_worker_slots() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.predicted_ttl = 600.0;
        cfg.predicted_max_blocks = 4;
        cfg.predicted_max_total = 6;
        cfg.max_workers = 2;
    })
    .await;
    let lookups = client(&d, &nats.url()).await;
    let long: Vec<u64> = (1..=10).collect();
    lookups.announce_applied(&hashes(&long), 1, 0).await.unwrap();
    lookups.announce_applied(&hashes(&long), 2, 0).await.unwrap();
    let answer = lookups.lookup(&hashes(&long)).await.unwrap();
    // Four for the first (its cap), the two the total leaves for the second.
    assert_eq!(answer.matches, vec![entry(1, 0, Some(4)), entry(2, 0, Some(2))]);
    metric_reaches(&d, "kvindex_announced_blocks_total{change=\"refused\",mode=\"predicted\"}", 6.0 + 8.0).await;
    metric_reaches(&d, "kvindex_predicted_blocks", 6.0).await;

    // Past max_workers, a new worker's announcement finds no slot: refused and counted.
    lookups.announce_applied(&hashes(&[1]), 3, 0).await.unwrap();
    metric_reaches(&d, "kvindex_announced_blocks_total{change=\"refused\",mode=\"predicted\"}", 6.0 + 8.0 + 1.0).await;
    let ids: Vec<u64> = lookups.lookup(&hashes(&[1])).await.unwrap().matches.iter().map(|m| m.worker_id).collect();
    assert_eq!(ids, vec![1, 2], "worker 3 got no slot");

    // Bad announcements are counted and harm nothing.
    let raw = async_nats::connect(nats.url()).await.unwrap();
    raw.publish("t.routed", bytes::Bytes::from_static(b"\xc1 not msgpack")).await.unwrap();
    raw.publish("t.routed", kvindex_client::Routed { worker_id: 1, ..Default::default() }.encode().into()).await.unwrap();
    raw.flush().await.unwrap();
    metric_reaches(&d, "kvindex_announcements_total{result=\"bad\"}", 2.0).await;
    metric_reaches(&d, "kvindex_decode_failures_total{reason=\"bad_announcement\"}", 2.0).await;
    assert_eq!(lookups.lookup(&hashes(&long)).await.unwrap().matches[0], entry(1, 0, Some(4)));
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predictions_age_out_and_free_their_slots() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.predicted_ttl = 0.2).await;
    let lookups = client(&d, &nats.url()).await;
    lookups.announce_applied(&hashes(&[1, 2, 3]), 1, 0).await.unwrap();
    lookups.announce_applied(&hashes(&[1, 9]), 2, 0).await.unwrap();
    // Every block added is dropped again once its TTL passes, and the workers with it.
    metric_reaches(&d, "kvindex_announced_blocks_total{change=\"added\",mode=\"predicted\"}", 5.0).await;
    metric_reaches(&d, "kvindex_announced_blocks_total{change=\"expired\",mode=\"predicted\"}", 5.0).await;
    metric_reaches(&d, "kvindex_predicted_blocks", 0.0).await;
    assert_eq!(lookups.lookup(&hashes(&[1, 2, 3])).await.unwrap().matches, vec![]);
    d.stop().await.unwrap();

    // With predictions off, announcements for event-fed workers are ignored and counted.
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.prefix = "off".into();
        cfg.predicted_ttl = 0.0;
    })
    .await;
    let lookups = client(&d, &nats.url()).await;
    lookups.announce(&hashes(&[1, 2]), 1, 0).await.unwrap();
    metric_reaches(&d, "kvindex_announcements_total{result=\"ignored\"}", 1.0).await;
    // A router waiting for the ack is answered at once: there is nothing to apply.
    lookups.announce_applied(&hashes(&[1, 2]), 1, 0).await.expect("acked");
    assert_eq!(lookups.lookup(&hashes(&[1, 2])).await.unwrap().matches, vec![]);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_only_workers_hold_what_routers_announce() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.routed_only_workers = vec![10, 11];
        cfg.routed_only_capacity = 3;
        cfg.routed_only_ttl = 600.0;
    })
    .await;
    let lookups = client(&d, &nats.url()).await;
    let approx = |worker_id, blocks| MatchEntry { worker_id, blocks, approximate: true, ..Default::default() };
    lookups.announce_applied(&hashes(&[1, 2, 3, 4]), 10, 0).await.unwrap();
    lookups.announce_applied(&hashes(&[1, 2]), 11, 0).await.unwrap();
    // Held as blocks, never as predictions; the cache size bounds them (the first three kept).
    let answer = lookups.lookup(&hashes(&[1, 2, 3, 4])).await.unwrap();
    assert_eq!(answer.matches, vec![approx(10, 3), approx(11, 2)]);

    // The cache is an LRU: a new branch evicts the old chain's deepest blocks first.
    lookups.announce_applied(&hashes(&[5, 6]), 10, 0).await.unwrap();
    assert_eq!(lookups.lookup(&hashes(&[1, 2, 3])).await.unwrap().matches, vec![approx(11, 2), approx(10, 1)]);
    assert_eq!(lookups.lookup(&hashes(&[5, 6])).await.unwrap().matches, vec![approx(10, 2)]);
    metric_reaches(&d, "kvindex_announced_blocks_total{change=\"evicted\",mode=\"routed_only\"}", 2.0).await;

    // Its events, if any come, are refused: announcements alone are its state.
    let raw = async_nats::connect(nats.url()).await.unwrap();
    publish(&raw, 10, vec![stored(0, &[7, 8])]).await;
    metric_reaches(&d, "kvindex_decode_failures_total{reason=\"routed_only\"}", 1.0).await;
    assert_eq!(lookups.lookup(&hashes(&[7, 8])).await.unwrap().matches, vec![]);
    d.stop().await.unwrap();

    // Past routed_only_ttl its blocks go, and the worker with them.
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.prefix = "ttl".into();
        cfg.routed_only_all = true;
        cfg.routed_only_ttl = 0.2;
    })
    .await;
    let lookups = client(&d, &nats.url()).await;
    lookups.announce_applied(&hashes(&[1, 2, 3]), 5, 0).await.unwrap();
    metric_reaches(&d, "kvindex_announced_blocks_total{change=\"expired\",mode=\"routed_only\"}", 3.0).await;
    metric_reaches(&d, "kvindex_index_workers", 0.0).await;
    assert_eq!(lookups.lookup(&hashes(&[1, 2, 3])).await.unwrap().matches, vec![]);
    d.stop().await.unwrap();
}
