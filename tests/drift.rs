//! Digests: a publisher's digest of its device blocks, compared by kvindex with its own once a
//! heartbeat. An event lost without a gap in the ids (only the digest can tell) is found,
//! counted, and healed by the snapshot it asks for; engines that churn, evict and reset never
//! set one off wrongly.

mod support;

use kvindex_client::core::digest::Digest;
use kvindex_client::core::hash::{BlockHash, LocalHash, StoredBlock};
use kvindex_client::{LookupClient, MatchEntry, Publisher, PublisherConfig, Query};
use std::time::{Duration, Instant};
use support::engine::{all_queries, first_difference, ModelEngine};
use support::{eventually, Daemon, NatsServer};

/// A publisher of worker `id` that sends at once and says its digest every 100 ms.
async fn publisher(client: &async_nats::Client, id: u64) -> Publisher {
    let cfg =
        PublisherConfig { linger: Duration::ZERO, heartbeat: Duration::from_millis(100), ..PublisherConfig::new("t", id, 0) };
    Publisher::start(client.clone(), cfg).await.unwrap()
}

/// A publisher that batches: small messages that fill up while it lingers, so that a batch is
/// often sent as the next event is pushed (its digest must not count that event's blocks).
async fn batching_publisher(client: &async_nats::Client, id: u64) -> Publisher {
    let cfg = PublisherConfig {
        linger: Duration::from_millis(5),
        max_batch_bytes: 512,
        heartbeat: Duration::from_millis(100),
        ..PublisherConfig::new("t", id, 0)
    };
    Publisher::start(client.clone(), cfg).await.unwrap()
}

fn whole(worker_id: u64, blocks: u32) -> MatchEntry {
    MatchEntry { worker_id, dp_rank: 0, blocks, stale: false, tiers: Default::default(), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_lost_without_a_gap_is_found_by_the_digest_and_healed() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let p = publisher(&client, 3).await;
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(2));
    let chain: Vec<StoredBlock> = (0..3).map(|i| StoredBlock::new(30 + i, i + 1)).collect();
    p.stored(None, &chain);
    let query = Query::hashes(&[LocalHash(1), LocalHash(2), LocalHash(3), LocalHash(4)]);
    let held = eventually(10, || async { lookups.lookup(&query).await.ok().filter(|a| a.matches == [whole(3, 3)]) }).await;
    assert!(held.is_some(), "worker 3 holds three blocks");
    let checked = eventually(10, || async { (d.metric("kvindex_digest_checks_total").await > 0.0).then_some(()) }).await;
    assert!(checked.is_some(), "digests are compared while the two agree");

    // The fourth block is stored, but its event never leaves: no id is skipped.
    p.lose_next_event();
    p.stored(Some(BlockHash(32)), &[StoredBlock::new(33, 4)]);
    let lost = Instant::now();
    let found = eventually(10, || async {
        (d.metric("kvindex_digest_mismatch_total{source=\"publisher\"}").await >= 1.0).then(|| lost.elapsed())
    })
    .await;
    let healed = eventually(10, || async { lookups.lookup(&query).await.ok().filter(|a| a.matches == [whole(3, 4)]) }).await;
    assert!(found.is_some(), "the digest differs");
    assert!(healed.is_some(), "the snapshot it asked for brought the block in: {:?}", lookups.lookup(&query).await);
    assert_eq!(d.metric("kvindex_event_gaps_total").await, 0.0, "the sequence never showed it");
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
    println!("found {:?} after the loss, healed at {:?}", found.unwrap(), lost.elapsed());

    // What an operator compares between two replicas: the worker's count and digest.
    let addr = d.cfg.inspect_addr.clone();
    let out = tokio::task::spawn_blocking(move || {
        let args = ["dump", "--addr", &addr, "--worker", "3", "--digest"];
        std::process::Command::new(env!("CARGO_BIN_EXE_kvindex")).args(args).output().expect("kvindex runs")
    })
    .await
    .unwrap();
    let want = Digest::of([30, 31, 32, 33]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("worker 3 rank 0: 4 device blocks, digest {:016x}\n", want.sum));
    d.stop().await.unwrap();
}

/// A host-tier event lost without a gap: the device digests still agree, the host digests do
/// not; the mismatch is found, healed by the snapshot (which carries every tier), and the
/// digests agree from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_host_tier_event_is_found_by_the_tier_digests() {
    use kvindex_client::core::Tier;
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let p = publisher(&client, 4).await;
    p.stored(None, &[StoredBlock::new(50, 1), StoredBlock::new(51, 2)]);
    p.stored_in(Tier::Host, None, &[StoredBlock::new(60, 1), StoredBlock::new(61, 2)]);
    let checks = || d.metric("kvindex_digest_checks_total");
    let mismatches = || d.metric("kvindex_digest_mismatch_total{source=\"publisher\"}");
    let agreed = eventually(10, || async { (checks().await >= 2.0).then_some(()) }).await;
    assert!(agreed.is_some(), "digests compared while both tiers agree");
    assert_eq!(mismatches().await, 0.0, "a publisher's tier digests equal the index's");

    p.lose_next_event();
    p.stored_in(Tier::Host, Some(BlockHash(61)), &[StoredBlock::new(62, 3)]);
    let found = eventually(10, || async { (mismatches().await >= 1.0).then_some(()) }).await;
    assert!(found.is_some(), "the host digests differ");
    let settled = eventually(10, || async { (d.metric("kvindex_stale_workers").await == 0.0).then_some(()) }).await;
    assert!(settled.is_some(), "the snapshot healed the worker");
    let (m, c) = (mismatches().await, checks().await);
    let more = eventually(10, || async { (checks().await >= c + 3.0).then_some(()) }).await;
    assert!(more.is_some(), "digests keep being compared");
    assert_eq!(mismatches().await, m, "healed: every tier's digests agree again");
    assert_eq!(d.metric("kvindex_event_gaps_total").await, 0.0);
    d.stop().await.unwrap();
}

/// A hybrid model's group event lost without a gap: the device digests agree, the groups' do
/// not; found and healed. A group block whose primary block the index never saw is left
/// unplaced by design: the worker's group digest is then not compared, and sets nothing off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_group_event_is_found_by_the_group_digest() {
    use kvindex_client::core::GroupKind;
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let p = publisher(&client, 5).await;
    // The index follows a worker's groups from its first group event on, which a hybrid
    // engine's first batch carries; this publisher sends each event alone, so one comes first.
    p.group_removed(1, &[BlockHash(1)]);
    p.stored(None, &[StoredBlock::new(70, 1), StoredBlock::new(71, 2), StoredBlock::new(72, 3)]);
    p.group_stored(1, GroupKind::Full, &[BlockHash(70), BlockHash(71)]);
    let checks = || d.metric("kvindex_digest_checks_total");
    let mismatches = || d.metric("kvindex_digest_mismatch_total{source=\"publisher\"}");
    let agreed = eventually(10, || async { (checks().await >= 2.0).then_some(()) }).await;
    assert!(agreed.is_some(), "digests compared while the groups agree");
    assert_eq!(mismatches().await, 0.0, "a publisher's group digest equals the index's");

    p.lose_next_event();
    p.group_stored(1, GroupKind::Full, &[BlockHash(72)]);
    let found = eventually(10, || async { (mismatches().await >= 1.0).then_some(()) }).await;
    assert!(found.is_some(), "the group digests differ");
    let settled = eventually(10, || async { (d.metric("kvindex_stale_workers").await == 0.0).then_some(()) }).await;
    assert!(settled.is_some(), "the snapshot healed the worker");
    let (m, c) = (mismatches().await, checks().await);
    let more = eventually(10, || async { (checks().await >= c + 3.0).then_some(()) }).await;
    assert!(more.is_some(), "digests keep being compared");
    assert_eq!(mismatches().await, m, "healed: the group digests agree again");

    // A group block of a hash the worker's primary group never held: counted, not placed.
    let missed_before = d.metric("kvindex_group_missed_blocks_total").await;
    p.group_stored(1, GroupKind::Full, &[BlockHash(999)]);
    let missed =
        eventually(10, || async { (d.metric("kvindex_group_missed_blocks_total").await > missed_before).then_some(()) }).await;
    assert!(missed.is_some(), "the unplaced block is counted");
    let c = checks().await;
    let more = eventually(10, || async { (checks().await >= c + 3.0).then_some(()) }).await;
    assert!(more.is_some(), "digests keep being compared");
    assert_eq!(mismatches().await, m, "an unplaced group block is no drift");
    assert_eq!(d.metric("kvindex_event_gaps_total").await, 0.0);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churning_engines_never_set_a_digest_off() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let mut engines: Vec<(ModelEngine, Publisher)> = Vec::new();
    for id in 1..=4u64 {
        let p = if id % 2 == 0 { batching_publisher(&client, id).await } else { publisher(&client, id).await };
        engines.push((ModelEngine::new(id, 7, 40), p));
    }
    // Stores, evictions and now and then a reset, in bursts, for over a second of digests; two
    // publishers send each event at once, two batch them.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        for (e, p) in engines.iter_mut() {
            for _ in 0..20 {
                e.step(p);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let model: Vec<ModelEngine> = engines.iter().map(|(e, _)| e.clone()).collect();
    let queries = all_queries(3);
    let settled =
        eventually(10, || async { first_difference(&client, "t.lookup", &model, &queries).await.is_none().then_some(()) }).await;
    assert!(settled.is_some(), "{:?}", first_difference(&client, "t.lookup", &model, &queries).await);
    let checks = eventually(10, || async {
        let n = d.metric("kvindex_digest_checks_total").await;
        (n >= 40.0).then_some(n)
    })
    .await;
    assert!(checks.is_some(), "digests compared throughout");
    assert_eq!(d.metric("kvindex_digest_mismatch_total{source=\"publisher\"}").await, 0.0);
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
    d.stop().await.unwrap();
}
