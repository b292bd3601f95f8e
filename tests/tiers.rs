//! Host and disk tiers through the real daemon: each kept in an index of its own, asked for by
//! name, never mixed into the device answer; evictions in one tier leave the others alone;
//! a tier chain whose parent is elsewhere is counted, not a reason to resync; bad requests get
//! error replies.

mod support;

use kvindex_client::protocol::{KvEvent, LookupRequest, LookupResponse, MatchEntry, TierDepths};
use kvindex_core::hash::{BlockHash, StoredBlock};
use kvindex_core::{Event, Tier};
use support::{eventually, publish, Daemon, NatsServer};

/// A chain of blocks with engine hashes from `base`, local hashes `locals`, in `tier`.
fn stored(id: u64, parent: Option<u64>, base: u64, locals: &[u64], tier: Tier) -> KvEvent {
    let blocks = locals.iter().enumerate().map(|(i, &l)| StoredBlock::new(base + i as u64, l)).collect();
    KvEvent { event_id: id, data: Event::Stored { parent: parent.map(BlockHash), blocks, tier } }
}

fn removed(id: u64, hashes: &[u64], tier: Tier) -> KvEvent {
    KvEvent { event_id: id, data: Event::Removed { hashes: hashes.iter().map(|&h| BlockHash(h)).collect(), tier } }
}

async fn lookup(c: &async_nats::Client, req: &LookupRequest) -> LookupResponse {
    let reply = c.request("t.lookup", rmp_serde::to_vec_named(req).unwrap().into()).await.unwrap();
    rmp_serde::from_slice(&reply.payload).unwrap()
}

fn ask(locals: &[u64], tiers: &[&str]) -> LookupRequest {
    LookupRequest {
        block_hashes: Some(locals.to_vec()),
        tiers: (!tiers.is_empty()).then(|| tiers.iter().map(|t| t.to_string()).collect()),
        ..Default::default()
    }
}

fn entry(worker_id: u64, blocks: u32, host: Option<u32>, disk: Option<u32>) -> MatchEntry {
    MatchEntry { worker_id, dp_rank: 0, blocks, stale: false, tiers: TierDepths { host, disk }, ..Default::default() }
}

async fn expect(c: &async_nats::Client, req: &LookupRequest, want: Vec<MatchEntry>) {
    let want = LookupResponse::Matches {
        matches: want,
        groups: vec![],
        shard: None,
        missing_shards: vec![],
        stale_workers: vec![],
        names: vec![],
    };
    let got = eventually(10, || async { (lookup(c, req).await == want).then_some(()) }).await;
    assert!(got.is_some(), "{req:?}: wanted {want:?}, got {:?}", lookup(c, req).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tier_is_indexed_apart_and_asked_for_by_name() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let prompt = [1, 2, 3, 4, 5, 6];

    // Worker 1: three blocks on the GPU, five offloaded to host memory (the same prefix: the
    // same engine hashes). Worker 2: two blocks, on disk only.
    publish(&c, 1, vec![stored(0, None, 100, &prompt[..3], Tier::Device), stored(1, None, 100, &prompt[..5], Tier::Host)]).await;
    publish(&c, 2, vec![stored(0, None, 200, &prompt[..2], Tier::Disk)]).await;

    // Device is the default answer, unchanged by the other tiers.
    expect(&c, &ask(&prompt, &[]), vec![entry(1, 3, None, None)]).await;
    // Asked for, the other tiers' depths come beside it, deepest first across what was asked.
    expect(&c, &ask(&prompt, &["device", "host"]), vec![entry(1, 3, Some(5), None)]).await;
    expect(&c, &ask(&prompt, &["device", "host", "disk"]), vec![entry(1, 3, Some(5), Some(0)), entry(2, 0, Some(0), Some(2))])
        .await;
    expect(&c, &ask(&prompt, &["disk"]), vec![entry(2, 0, None, Some(2))]).await;

    // An eviction from host memory leaves the GPU copy; one from the GPU leaves the host copy.
    publish(&c, 1, vec![removed(2, &[102], Tier::Host)]).await;
    expect(&c, &ask(&prompt, &["device", "host"]), vec![entry(1, 3, Some(2), None)]).await;
    publish(&c, 1, vec![removed(3, &[101], Tier::Device)]).await;
    expect(&c, &ask(&prompt, &["device", "host"]), vec![entry(1, 1, Some(2), None)]).await;

    // A host chain under a parent worker 1 holds on no tier cannot be placed: counted, and the
    // worker stays whole (it says nothing of its GPU state).
    publish(&c, 1, vec![stored(4, Some(999), 300, &[9], Tier::Host)]).await;
    assert!(eventually(5, || async { (d.metric("kvindex_tier_unplaceable_blocks_total").await == 1.0).then_some(()) })
        .await
        .is_some());
    expect(&c, &ask(&prompt, &["device", "host"]), vec![entry(1, 1, Some(2), None)]).await;
    assert_eq!(d.metric("kvindex_stale_workers").await, 0.0);
    // Host holds 100, 101 and, past the evicted 102, its orphaned children 103 and 104.
    assert_eq!(d.metric("kvindex_tier_blocks{tier=\"host\"}").await, 4.0);
    assert_eq!(d.metric("kvindex_tier_blocks{tier=\"disk\"}").await, 2.0);

    // The engine lost its cache: every tier of it is gone.
    publish(&c, 1, vec![KvEvent { event_id: 5, data: Event::Cleared }]).await;
    expect(&c, &ask(&prompt, &["device", "host", "disk"]), vec![entry(2, 0, Some(0), Some(2))]).await;
    assert_eq!(d.metric("kvindex_tier_blocks{tier=\"host\"}").await, 0.0);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tiers_and_oversized_filters_get_error_replies() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.max_workers = 8).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let error = |r: LookupResponse| match r {
        LookupResponse::Error { error } => error,
        other => panic!("wanted an error reply, got {other:?}"),
    };
    assert!(error(lookup(&c, &ask(&[1], &["gpu"])).await).contains("unknown tier"));
    let empty = LookupRequest { block_hashes: Some(vec![1]), tiers: Some(vec![]), ..Default::default() };
    assert!(error(lookup(&c, &empty).await).contains("tiers is empty"));
    let wide = LookupRequest { block_hashes: Some(vec![1]), workers: Some((0..9).collect()), ..Default::default() };
    assert!(error(lookup(&c, &wide).await).contains("max_workers"));
    let fits = LookupRequest { block_hashes: Some(vec![1]), workers: Some((0..8).collect()), ..Default::default() };
    assert_eq!(
        lookup(&c, &fits).await,
        LookupResponse::Matches {
            matches: vec![],
            groups: vec![],
            shard: None,
            missing_shards: vec![],
            stale_workers: vec![],
            names: vec![]
        }
    );
    assert_eq!(d.metric("kvindex_lookups_total{result=\"error\"}").await, 3.0);
    d.stop().await.unwrap();
}
