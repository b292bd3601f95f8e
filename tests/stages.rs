//! Where the time goes: every applied batch that says when it was published is timed in four
//! stages (`kvindex_event_stage_seconds{stage}`: transit, decode, queued, apply), and every
//! lookup that says when it was sent in its transit (`kvindex_lookup_transit_seconds`), so that
//! each hop's cost is read from the metrics. A publish time five seconds old shows in transit
//! alone.

mod support;

use kvindex_client::protocol::{now_ns, BatchHeader, KvEvent, LookupRequest};
use kvindex_client::{LookupClient, Query};
use kvindex_core::LocalHash;
use support::{eventually, Daemon, NatsServer};

const STAGES: [&str; 4] = ["transit", "decode", "queued", "apply"];
const FIVE_S: u64 = 5_000_000_000;

fn stage(name: &str, part: &str) -> String {
    format!("kvindex_event_stage_seconds_{part}{{stage=\"{name}\"}}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_applied_batch_with_a_publish_time_is_timed_in_each_stage() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let header = |next: u64, ts_ns: u64| BatchHeader {
        worker_id: 1,
        epoch: 1,
        next_event_id: Some(next),
        ts_ns,
        ..BatchHeader::default()
    };
    // Published five seconds ago by its publisher's clock; then a heartbeat (nothing to apply)
    // and a batch without a publish time, neither timed; then one published now.
    support::publish_with(&client, header(1, now_ns() - FIVE_S), vec![KvEvent::stored(0, None, &[(10, 1)])]).await;
    support::publish_with(&client, header(1, now_ns()), vec![]).await;
    support::publish_with(&client, header(2, 0), vec![KvEvent::stored(1, Some(10), &[(11, 2)])]).await;
    support::publish_with(&client, header(3, now_ns()), vec![KvEvent::stored(2, Some(11), &[(12, 3)])]).await;

    // One apply thread takes the worker's batches in order: the last one timed ends it.
    let timed = eventually(20, || async { (d.metric(&stage("apply", "count")).await >= 2.0).then_some(()) }).await;
    assert!(timed.is_some(), "the batches were applied: {}", d.metrics().await);
    assert_eq!(d.metric("kvindex_blocks_applied_total{kind=\"stored\"}").await, 3.0);
    for s in STAGES {
        assert_eq!(d.metric(&stage(s, "count")).await, 2.0, "stage {s}: the two batches that say when they were published");
    }
    assert_eq!(d.metric("kvindex_event_lag_seconds_count").await, 2.0, "the stages split the lag of the same batches");
    assert!(d.metric(&stage("transit", "sum")).await >= 5.0, "the old publish time is the transit's");
    let quick = d.metric("kvindex_event_stage_seconds_bucket{stage=\"transit\",le=\"1\"}").await;
    assert!(quick <= 1.0, "the five-second-old batch is not under a second: {quick}");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_that_says_when_it_was_sent_is_timed_in_transit() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let lookups = LookupClient::new(client.clone(), "t");
    let query = Query::hashes(&[LocalHash(1)]);
    let answered = eventually(20, || async { lookups.lookup(&query).await.ok() }).await;
    assert!(answered.is_some(), "the daemon answers");
    let count = || d.metric("kvindex_lookup_transit_seconds_count");
    let stamped = count().await;
    assert!(stamped >= 1.0, "the client stamps its requests");

    // A request sent five seconds ago by its router's clock, and one that does not say.
    let ask = |req: LookupRequest| {
        let client = client.clone();
        async move { client.request("t.lookup", rmp_serde::to_vec_named(&req).unwrap().into()).await.unwrap() }
    };
    ask(LookupRequest { block_hashes: Some(vec![1]), sent_ns: Some(now_ns() - FIVE_S), ..LookupRequest::default() }).await;
    ask(LookupRequest { block_hashes: Some(vec![1]), ..LookupRequest::default() }).await;
    // Timed before the answer is sent: counted once its reply is here.
    assert_eq!(count().await, stamped + 1.0, "only the request that says when it was sent");
    assert!(d.metric("kvindex_lookup_transit_seconds_sum").await >= 5.0);
    d.stop().await.unwrap();
}
