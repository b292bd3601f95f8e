//! Safe to expose: what an attacker or an operator tried, against a real
//! `nats-server` and `kvindex serve`, and the behaviour each now gets.

mod support;

use kvindex_client::protocol::{encode_batch, BatchHeader, EventBatch, KvEvent, LookupRequest, LookupResponse, MatchEntry};
use support::{eventually, Daemon, NatsServer};

fn batch(worker_id: u64, epoch: u64, events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        header: BatchHeader { worker_id, epoch, ..BatchHeader::default() },
        worker: None,
        events: events.into_iter().map(Ok).collect(),
    }
}

async fn lookup(c: &async_nats::Client, req: &LookupRequest) -> LookupResponse {
    let reply = c.request("t.lookup", rmp_serde::to_vec_named(req).unwrap().into()).await.unwrap();
    rmp_serde::from_slice(&reply.payload).unwrap()
}

async fn matches(c: &async_nats::Client, hashes: &[u64]) -> Vec<MatchEntry> {
    match lookup(c, &LookupRequest { block_hashes: Some(hashes.to_vec()), ..Default::default() }).await {
        LookupResponse::Matches { matches, .. } => matches,
        LookupResponse::Error { error } => panic!("lookup refused: {error}"),
    }
}

/// Waits until a lookup of `hashes` answers `depths` as (worker, blocks).
async fn expect(c: &async_nats::Client, hashes: &[u64], depths: &[(u64, u32)]) {
    let got = eventually(10, || async {
        let m: Vec<(u64, u32)> = matches(c, hashes).await.iter().map(|m| (m.worker_id, m.blocks)).collect();
        (m == depths).then_some(())
    })
    .await;
    assert!(got.is_some(), "lookup {hashes:?} never answered {depths:?}; last {:?}", matches(c, hashes).await);
}

async fn send(c: &async_nats::Client, subject: &str, b: &EventBatch) {
    c.publish(subject.to_string(), encode_batch(b).into()).await.unwrap();
    c.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subject_aliases_and_late_batches_of_a_replaced_process_are_refused() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // `kv.events.7` may be the only subject worker 7's credentials allow: `007` and `+7` are
    // other subjects that must not reach worker 7's state.
    for alias in ["t.events.007", "t.events.+7"] {
        send(&c, alias, &batch(7, 1, vec![KvEvent::stored(0, None, &[(70, 1)])])).await;
    }
    assert!(
        eventually(10, || async {
            (d.metric("kvindex_decode_failures_total{reason=\"bad_subject\"}").await == 2.0).then_some(())
        })
        .await
        .is_some(),
        "both aliases counted as bad subjects"
    );
    assert_eq!(matches(&c, &[1]).await, vec![], "nothing applied through an alias");

    // Worker 7 restarts (epoch 1 -> 2); a batch the old process sent before dying arrives late.
    send(&c, "t.events.7", &batch(7, 1, vec![KvEvent::stored(0, None, &[(70, 1)])])).await;
    send(&c, "t.events.7", &batch(7, 2, vec![KvEvent::stored(0, None, &[(80, 2), (81, 3)])])).await;
    expect(&c, &[2, 3], &[(7, 2)]).await;
    send(&c, "t.events.7", &batch(7, 1, vec![KvEvent::stored(1, Some(70), &[(71, 4)])])).await;
    assert!(
        eventually(10, || async { (d.metric("kvindex_decode_failures_total{reason=\"old_epoch\"}").await == 1.0).then_some(()) })
            .await
            .is_some(),
        "the leftover is counted"
    );
    expect(&c, &[2, 3], &[(7, 2)]).await;
    assert_eq!(d.metric("kvindex_epoch_changes_total").await, 1.0, "the leftover did not flip the epoch back");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_registry_is_counted_and_lookups_take_signed_hashes() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.max_workers = 2).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // Hash u64::MAX, as an int64-only router writes it: -1.
    for w in 1..=3u64 {
        send(&c, &format!("t.events.{w}"), &batch(w, 1, vec![KvEvent::stored(0, None, &[(w, u64::MAX)])])).await;
    }
    assert!(
        eventually(10, || async {
            (d.metric("kvindex_refused_events_total{reason=\"max_workers\"}").await == 1.0).then_some(())
        })
        .await
        .is_some(),
        "the third worker's event is refused and counted"
    );
    let signed = rmpv::Value::Map(vec![("block_hashes".into(), rmpv::Value::Array(vec![(-1i64).into()]))]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(&mut payload, &signed).unwrap();
    let ask = || async {
        let reply = c.request("t.lookup", payload.clone().into()).await.unwrap();
        let answer: LookupResponse = rmp_serde::from_slice(&reply.payload).unwrap();
        let LookupResponse::Matches { matches, .. } = answer else { panic!("signed hashes refused: {answer:?}") };
        matches
    };
    // The refusal is counted at ingest, possibly before the two accepted batches are applied.
    let matches = eventually(10, || async { Some(ask().await).filter(|m| m.len() == 2) }).await.unwrap_or(ask().await);
    // Which two of the three got the slots depends on the apply threads' timing.
    assert_eq!(matches.len(), 2, "{matches:?}");
    assert!(matches.iter().all(|m| m.blocks == 1 && (1..=3).contains(&m.worker_id)), "{matches:?}");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_service_variables_do_not_stop_the_binary() {
    let nats = NatsServer::start();
    let env = [("READY_SETTLE_MS", "100"), ("PORT", "tcp://10.0.0.1:9464"), ("SERVICE_HOST", "10.0.0.1")];
    let mut d = support::process::DaemonProcess::start(&nats.url(), &[], &env);
    d.wait_ready(10).await;
    assert!(d.running());
    let status = d.terminate().expect("exits after SIGTERM");
    assert!(status.success(), "{status:?}; log:\n{}", d.log_text());
    let log = d.log_text();
    assert!(log.contains("KVINDEX_PORT") && log.contains("ignoring"), "the ignored variables are logged once:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_nats_is_unreachable_exits_within_the_grace_period() {
    let nats = NatsServer::start();
    let mut d = support::process::DaemonProcess::start(&nats.url(), &[], &[("READY_SETTLE_MS", "100"), ("SHUTDOWN_GRACE", "1")]);
    d.wait_ready(10).await;
    drop(nats);
    // Let the daemon notice that NATS is gone.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let status = d.terminate().expect("exits within 10 s of SIGTERM although NATS is unreachable");
    assert!(status.success(), "{status:?}; log:\n{}", d.log_text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_past_max_depth_is_ignored_without_a_resync_storm() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.max_depth = 4).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // Six blocks in one piece, two more under the last: only the first four have a place.
    let first: Vec<(u64, u64)> = (0..6).map(|i| (500 + i, 1 + i)).collect();
    send(&c, "t.events.5", &batch(5, 1, vec![KvEvent::stored(0, None, &first)])).await;
    send(&c, "t.events.5", &batch(5, 1, vec![KvEvent::stored(1, Some(505), &[(506, 7), (507, 8)])])).await;
    assert!(
        eventually(10, || async { (d.metric("kvindex_too_deep_blocks_total").await == 4.0).then_some(()) }).await.is_some(),
        "the two blocks past the limit and the two under them are counted as too deep"
    );
    let m = matches(&c, &[1, 2, 3, 4, 5, 6, 7, 8]).await;
    assert_eq!(
        m,
        vec![MatchEntry { worker_id: 5, dp_rank: 0, blocks: 4, stale: false, tiers: Default::default(), ..Default::default() }],
        "whole, not stale"
    );
    assert_eq!(d.metric("kvindex_unplaceable_blocks_total").await, 0.0);
    assert_eq!(d.metric("kvindex_resync_requests_total{scope=\"worker\"}").await, 0.0, "nothing to resync");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resync_backoff_holds_while_a_publisher_keeps_sending_what_cannot_be_placed() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // Worker 6 has no publisher to answer resyncs, and sends a store under an unknown parent
    // ten times a second for three seconds.
    send(&c, "t.events.6", &batch(6, 1, vec![KvEvent::stored(0, None, &[(600, 1)])])).await;
    for id in 1..=30u64 {
        send(&c, "t.events.6", &batch(6, 1, vec![KvEvent::stored(id, Some(999), &[(600 + id, 2)])])).await;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let asked = d.metric("kvindex_resync_requests_total{scope=\"worker\"}").await;
    // Backoff from 1 s, doubling: about three requests in three seconds (one per batch before).
    assert!((1.0..=5.0).contains(&asked), "{asked} resync requests for 30 unplaceable batches");
    assert_eq!(d.metric("kvindex_unplaceable_blocks_total").await, 30.0);
    assert_eq!(
        matches(&c, &[1]).await,
        vec![MatchEntry { worker_id: 6, dp_rank: 0, blocks: 1, stale: true, tiers: Default::default(), ..Default::default() }]
    );
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_bounded_deepest_first_and_name_stale_workers_without_a_match() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // 70 workers hold block 1; worker 100 also holds block 2 under it.
    for w in 1..=70u64 {
        send(&c, &format!("t.events.{w}"), &batch(w, 1, vec![KvEvent::stored(0, None, &[(w * 10, 1)])])).await;
    }
    send(&c, "t.events.100", &batch(100, 1, vec![KvEvent::stored(0, None, &[(1000, 1), (1001, 2)])])).await;
    // Worker 200 skipped event ids: stale, and it holds nothing of the query.
    send(&c, "t.events.200", &batch(200, 1, vec![KvEvent::stored(0, None, &[(2000, 9)])])).await;
    send(&c, "t.events.200", &batch(200, 1, vec![KvEvent::stored(5, None, &[(2001, 8)])])).await;
    let req = LookupRequest { block_hashes: Some(vec![1, 2]), ..Default::default() };
    let full = eventually(10, || async {
        match lookup(&c, &req).await {
            LookupResponse::Matches { matches, stale_workers, .. }
                if !stale_workers.is_empty() && matches.len() == 71 && matches.iter().any(|m| m.blocks == 2) =>
            {
                Some((matches, stale_workers))
            }
            _ => None,
        }
    })
    .await;
    let (matches, stale) = full.expect("every match (the default) and the stale worker");
    assert_eq!((matches[0].worker_id, matches[0].blocks), (100, 2), "the deepest is never cut");
    assert_eq!(stale, vec![kvindex_client::WorkerRef { worker_id: 200, dp_rank: 0 }]);
    let three = LookupRequest { max_matches: Some(3), ..req.clone() };
    let LookupResponse::Matches { matches, .. } = lookup(&c, &three).await else { panic!("refused") };
    assert_eq!(matches.len(), 3);
    assert_eq!(matches[0].worker_id, 100);
    // Filtered to other workers, the stale one is not named.
    let filtered = LookupRequest { workers: Some(vec![1, 2]), ..req };
    let LookupResponse::Matches { matches, stale_workers, .. } = lookup(&c, &filtered).await else { panic!("refused") };
    assert_eq!((matches.len(), stale_workers.len()), (2, 0));
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_publisher_cannot_take_every_worker_slot_with_dp_ranks() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.max_dp_ranks = 4).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // Worker 9 sends batches for 200 dp ranks on its own subject.
    for rank in 0..200u32 {
        let mut b = batch(9, 1, vec![KvEvent::stored(0, None, &[(90, 1)])]);
        b.header.dp_rank = rank;
        c.publish("t.events.9", encode_batch(&b).into()).await.unwrap();
    }
    c.flush().await.unwrap();
    // An honest worker arriving afterwards is indexed.
    send(&c, "t.events.10", &batch(10, 1, vec![KvEvent::stored(0, None, &[(100, 1)])])).await;
    assert!(
        eventually(10, || async {
            (d.metric("kvindex_refused_events_total{reason=\"max_dp_ranks\"}").await == 196.0).then_some(())
        })
        .await
        .is_some(),
        "ranks past the limit are refused and counted"
    );
    let got = eventually(10, || async { Some(matches(&c, &[1]).await).filter(|m| m.len() == 5) }).await;
    let ids: Vec<(u64, u32)> = got.expect("4 ranks of worker 9 and worker 10").iter().map(|m| (m.worker_id, m.dp_rank)).collect();
    assert_eq!(ids, vec![(9, 0), (9, 1), (9, 2), (9, 3), (10, 0)]);
    d.stop().await.unwrap();
}

/// One publisher storing without end: past `max_blocks_per_worker` its blocks are refused,
/// counted and logged, and it is answered as stale (its state is incomplete), while the
/// blocks it was allowed stay matched and other workers are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cannot_grow_the_index_past_its_block_bound() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.max_blocks_per_worker = 100).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let chain = |from: u64, n: u64| (from..from + n).map(|i| (5_000 + i, 1 + i)).collect::<Vec<_>>();
    send(&c, "t.events.5", &batch(5, 1, vec![KvEvent::stored(0, None, &chain(0, 60))])).await;
    send(&c, "t.events.5", &batch(5, 1, vec![KvEvent::stored(1, Some(5_059), &chain(60, 90))])).await;
    send(&c, "t.events.6", &batch(6, 1, vec![KvEvent::stored(0, None, &[(60, 1), (61, 2)])])).await;
    let refused = eventually(10, || async { (d.metric("kvindex_over_limit_blocks_total").await == 50.0).then_some(()) }).await;
    assert!(refused.is_some(), "the 50 blocks past the bound are refused and counted");
    let hashes: Vec<u64> = (1..=150).collect();
    let got = eventually(10, || async {
        let m = matches(&c, &hashes).await;
        (m.len() == 2 && m[0].stale).then_some(m)
    })
    .await
    .expect("the worker over its bound is answered stale");
    assert_eq!((got[0].worker_id, got[0].blocks), (5, 100), "what it was allowed stays matched");
    assert_eq!((got[1].worker_id, got[1].blocks, got[1].stale), (6, 2, false), "another worker is untouched");
    d.stop().await.unwrap();
}

/// A shard whose NATS mapping partitions by another count (here: none, a batch sent straight to
/// shard 0's subject) refuses the workers its own count gives another shard, counted and logged,
/// and keeps its own: it never answers for a worker the merge would not believe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_refuses_the_workers_its_count_gives_another_shard() {
    use kvindex_client::shards::partition;
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |c| {
        c.shards = 3;
        c.shard = 0;
    })
    .await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let mine = (1..).find(|&w| partition(w, 3) == 0).unwrap();
    let theirs = (1..).find(|&w| partition(w, 3) != 0).unwrap();
    for w in [theirs, mine] {
        send(&c, &format!("t.events.{w}.0"), &batch(w, 1, vec![KvEvent::stored(0, None, &[(90, 9)])])).await;
    }
    expect(&c, &[9], &[(mine, 1)]).await;
    assert_eq!(
        d.metric("kvindex_decode_failures_total{reason=\"other_shard\"}").await,
        1.0,
        "the other shard's worker is counted"
    );
    d.stop().await.unwrap();
}
