//! The publisher library against a real NATS server: batching, heartbeats, and snapshots that
//! rebuild exactly the engine's state.

mod support;

use futures::StreamExt;
use kvindex_client::protocol::{decode_batch, EventBatch, KvEvent, ResyncAck, ResyncRequest};
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::{Event, Tier};
use std::time::Duration;
use support::engine::{all_queries, ModelEngine};
use support::{NatsProcess, NatsServer};

/// The next batch on `sub` (panics after 5 s), with its size in bytes.
async fn next_batch(sub: &mut async_nats::Subscriber) -> (EventBatch, usize) {
    let msg = tokio::time::timeout(Duration::from_secs(5), sub.next()).await.expect("a batch in time").expect("subscribed");
    (decode_batch(&msg.payload).expect("a valid batch"), msg.payload.len())
}

fn events_of(b: &EventBatch) -> Vec<KvEvent> {
    b.events.iter().map(|e| e.clone().expect("valid event")).collect()
}

fn apply(index: &ReferenceIndex, w: &mut <ReferenceIndex as KvIndex>::Writer, e: &KvEvent) -> u64 {
    e.data.apply_to(index, w).unplaceable
}

/// A NATS server, a client, a subscription to worker 7's events, and a publisher with `cfg`.
async fn start(cfg: PublisherConfig) -> (NatsProcess, async_nats::Client, async_nats::Subscriber, Publisher) {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let sub = client.subscribe("t.events.7").await.unwrap();
    let p = Publisher::start(client.clone(), cfg).await.unwrap();
    (nats, client, sub, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_by_count_and_linger_then_heartbeats() {
    let (_nats, _client, mut sub, p) = start(PublisherConfig {
        max_batch_events: 4,
        linger: Duration::from_millis(50),
        heartbeat: Duration::from_millis(200),
        epoch: 42,
        ..PublisherConfig::new("t", 7, 0)
    })
    .await;
    for i in 0..10u64 {
        p.stored(if i == 0 { None } else { Some(BlockHash(i - 1)) }, &[StoredBlock::new(i, i)]);
    }
    let mut sizes = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (b, _) = next_batch(&mut sub).await;
        assert_eq!((b.header.worker_id, b.header.dp_rank, b.header.epoch, b.header.snapshot), (7, 0, 42, false));
        sizes.push(b.events.len());
        ids.extend(events_of(&b).iter().map(|e| e.event_id));
    }
    // Two full batches at once, the rest after the linger.
    assert_eq!(sizes, vec![4, 4, 2]);
    assert_eq!(ids, (0..10).collect::<Vec<_>>());
    // Then, idle: heartbeats, empty batches.
    let (hb, _) = next_batch(&mut sub).await;
    assert!(hb.events.is_empty());
    assert_eq!(p.stats().events, 10);
    assert!(p.stats().heartbeats >= 1);
    assert_eq!(p.len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_rebuild_the_engine_state_in_chunks_parents_first() {
    let (_nats, client, mut sub, p) =
        start(PublisherConfig { max_batch_bytes: 1024, linger: Duration::ZERO, ..PublisherConfig::new("t", 7, 0) }).await;
    let mut engine = ModelEngine::new(7, 1, 400).without_resets();
    for _ in 0..2000 {
        engine.step(&p);
    }
    p.flush().await;
    // The live stream, applied to a reference index, is the engine's state...
    let live = ReferenceIndex::new(1 << 16, 16);
    let mut lw = live.writer(WorkerId::new(7, 0)).unwrap();
    let mut next_id = 0;
    while next_id < p.stats().events {
        let (b, _) = next_batch(&mut sub).await;
        for e in events_of(&b) {
            assert_eq!(e.event_id, next_id);
            next_id += 1;
            apply(&live, &mut lw, &e);
        }
        // A digest is of the blocks the events up to it leave.
        if let Some(d) = b.header.digest {
            assert_eq!(d, live.digest(&lw), "the digest after event {next_id}");
        }
    }

    // ...and so is a snapshot applied to an empty one.
    let ack = client
        .request("t.resync.7", ResyncRequest { worker_id: 7, dp_rank: 0 }.encode().into())
        .await
        .expect("the publisher answers");
    let ack: ResyncAck = rmp_serde::from_slice(&ack.payload).unwrap();
    assert_eq!((ack.worker_id, ack.blocks), (7, engine.len() as u64));
    let snap = ReferenceIndex::new(1 << 16, 16);
    let mut sw = snap.writer(WorkerId::new(7, 0)).unwrap();
    let mut chunks = 0;
    loop {
        let (b, bytes) = next_batch(&mut sub).await;
        assert!(b.header.snapshot, "only snapshot batches follow");
        assert!(bytes <= 1024, "a chunk of {bytes} bytes is over max_batch_bytes");
        for (i, e) in events_of(&b).iter().enumerate() {
            assert_eq!(e.event_id, next_id, "snapshot ids continue the sequence");
            next_id += 1;
            assert_eq!(chunks == 0 && i == 0, e.data == Event::Cleared, "the first event, and only it, clears");
            assert_eq!(apply(&snap, &mut sw, e), 0, "every block's parent came before it");
        }
        chunks += 1;
        if b.header.snapshot_end {
            assert_eq!(b.header.digest, Some(snap.digest(&sw)), "a snapshot ends with the digest of what it sent");
            break;
        }
    }
    assert!(chunks > 3, "{} blocks fit in {chunks} chunks of 1 KiB?", engine.len());
    assert_eq!(snap.stats().placements, engine.len() as u64);
    for q in all_queries(6) {
        let q: Vec<LocalHash> = q.into_iter().map(LocalHash).collect();
        assert_eq!(snap.find_matches(&q, &MatchOptions::default()), live.find_matches(&q, &MatchOptions::default()));
    }
    assert_eq!(p.stats().snapshots, 1);
    assert_eq!(p.stats().orphans_skipped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_now_skips_the_linger_and_snapshots_keep_every_tier() {
    let cfg = PublisherConfig { linger: Duration::from_secs(30), ..PublisherConfig::new("t", 7, 0) };
    let (_nats, client, mut sub, p) = start(cfg).await;
    p.stored(None, &[StoredBlock::new(1, 10), StoredBlock::new(2, 20)]);
    p.stored_in(Tier::Host, None, &[StoredBlock::new(1, 10), StoredBlock::new(2, 20), StoredBlock::new(3, 30)]);
    p.removed_in(Tier::Host, &[BlockHash(3)]);
    p.send_now();
    // Within the 5 s of next_batch, far inside the 30 s linger.
    let (b, _) = next_batch(&mut sub).await;
    assert_eq!(b.events.len(), 3);
    assert_eq!(p.len(), 2, "device blocks");

    // A resync: the snapshot resends each tier's chains under that tier.
    client.publish("t.resync", bytes::Bytes::new()).await.unwrap();
    let (b, _) = next_batch(&mut sub).await;
    assert!(b.header.snapshot && b.header.snapshot_end);
    let tiers: Vec<(Tier, usize)> = events_of(&b)
        .iter()
        .filter_map(|e| match &e.data {
            Event::Stored { blocks, tier, .. } => Some((*tier, blocks.len())),
            _ => None,
        })
        .collect();
    assert_eq!(tiers, vec![(Tier::Device, 2), (Tier::Host, 2)]);
    // A clear drops every tier.
    p.cleared();
    client.publish("t.resync", bytes::Bytes::new()).await.unwrap();
    p.send_now();
    let snapshot = loop {
        let (b, _) = next_batch(&mut sub).await;
        if b.header.snapshot {
            break b;
        }
    };
    assert_eq!(events_of(&snapshot).len(), 1, "only the snapshot's own clear");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_its_own_rank_and_broadcasts_and_skips_orphans() {
    let (_nats, client, mut sub, p) = start(PublisherConfig { linger: Duration::ZERO, ..PublisherConfig::new("t", 7, 1) }).await;
    p.stored(None, &[StoredBlock::new(1, 10), StoredBlock::new(2, 20), StoredBlock::new(3, 30)]);
    p.stored(None, &[StoredBlock::new(4, 40)]);
    p.removed(&[BlockHash(1)]);
    for _ in 0..3 {
        next_batch(&mut sub).await;
    }

    // A request for rank 0 of this worker is not ours to answer.
    let other = client.request("t.resync.7", ResyncRequest { worker_id: 7, dp_rank: 0 }.encode().into());
    assert!(tokio::time::timeout(Duration::from_millis(300), other).await.is_err());

    // A broadcast is: blocks 2 and 3 lost their parent and no lookup can reach them.
    client.publish("t.resync", bytes::Bytes::new()).await.unwrap();
    let (b, _) = next_batch(&mut sub).await;
    assert!(b.header.snapshot && b.header.snapshot_end);
    let ev = events_of(&b);
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0].data, Event::Cleared);
    assert_eq!(ev[1], KvEvent::stored(4, None, &[(4, 40)]));
    assert_eq!(p.stats().orphans_skipped, 2);
    // Forgotten, so that the publisher's digest stays the digest of what kvindex holds.
    assert_eq!(p.len(), 1);
    assert_eq!(b.header.digest, Some(kvindex_client::core::digest::Digest::of([4])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_longer_than_a_message_is_split_into_chained_events() {
    let (_nats, _client, mut sub, p) =
        start(PublisherConfig { max_batch_bytes: 1024, linger: Duration::ZERO, ..PublisherConfig::new("t", 7, 0) }).await;
    let chain: Vec<StoredBlock> = (0..500u64).map(|i| StoredBlock::new(1000 + i, i)).collect();
    p.stored(None, &chain);
    p.removed(&chain[250..].iter().map(|b| b.block_hash).collect::<Vec<_>>());
    p.flush().await;

    let index = ReferenceIndex::new(1 << 16, 16);
    let mut w = index.writer(WorkerId::new(7, 0)).unwrap();
    let mut events = 0;
    while events < p.stats().events {
        let (b, bytes) = next_batch(&mut sub).await;
        assert!(bytes <= 1024, "a batch of {bytes} bytes");
        for e in events_of(&b) {
            assert_eq!(apply(&index, &mut w, &e), 0);
            events += 1;
        }
    }
    assert!(events > 10, "500 blocks and 250 removals in {events} events");
    let q: Vec<LocalHash> = (0..500).map(LocalHash).collect();
    let m = index.find_matches(&q, &MatchOptions::default());
    assert_eq!(m[0].blocks, 250);
    assert_eq!(index.stats().placements, 250);
}

/// With `jetstream_acks`, every batch of events lands in kvindex's stream once, under the
/// message id (worker, dp rank, epoch, first event id), and is acknowledged: the same batch
/// sent again under that id is recognised as a duplicate and not stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_acks_land_each_batch_once_under_its_message_id() {
    let js_nats = support::JetStreamNats::start();
    let url = js_nats.nats.url();
    let d = support::Daemon::start(&url, |cfg| cfg.ingest = kvindex::config::Ingest::Jetstream).await;
    let client = async_nats::connect(&url).await.unwrap();
    let cfg = PublisherConfig { jetstream_acks: true, max_batch_events: 10, ..PublisherConfig::new("t", 7, 1) };
    let epoch = cfg.epoch;
    let p = Publisher::start(client.clone(), cfg).await.unwrap();
    for i in 0..100u64 {
        p.stored(None, &[StoredBlock::new(1000 + i, i)]);
    }
    p.flush().await;
    let stats = p.stats();
    assert_eq!((stats.acked, stats.unacked), (10, 0), "ten batches of ten events, each acknowledged");
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = js.get_stream("T_EVENTS").await.expect("kvindex made the stream");
    let held = stream.info().await.unwrap().state.messages;
    // A batch sent again under the first batch's id (the stream de-duplicates by id alone).
    let first = stream.get_last_raw_message_by_subject("t.events.7").await.expect("a message");
    assert!(held >= 10);
    let id = format!("7-1-{epoch}-0");
    let again = js
        .send_publish(
            "t.events.7",
            async_nats::jetstream::context::Publish::build().message_id(id.as_str()).payload(first.payload),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(again.duplicate, "the stream knew the id {id}");
    assert_eq!(stream.info().await.unwrap().state.messages, held, "a duplicate is not stored");
    let q = kvindex_client::lookup::Query::hashes(&[LocalHash(0)]);
    let lookups = kvindex_client::lookup::LookupClient::new(client, "t");
    let seen = support::eventually(10, || async { lookups.lookup(&q).await.ok().filter(|a| a.matches.len() == 1) }).await;
    assert!(seen.is_some(), "kvindex applied the acknowledged batches");
    p.close().await;
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_publisher_says_what_its_engine_is_on_its_first_batch_and_every_snapshot() {
    use kvindex_core::names::WorkerInfo;
    let info = WorkerInfo { name: "engine-7".into(), url: Some("http://10.0.0.7:8000".into()), ..WorkerInfo::default() };
    let cfg = PublisherConfig {
        worker_id: 7,
        linger: Duration::ZERO,
        heartbeat: Duration::from_secs(3600),
        ..PublisherConfig::named("t", info.clone(), 0)
    };
    let (_nats, client, mut sub, p) = start(cfg).await;
    p.stored(None, &[StoredBlock::new(1, 10)]);
    p.stored(Some(BlockHash(1)), &[StoredBlock::new(2, 20)]);
    let (first, _) = next_batch(&mut sub).await;
    let (second, _) = next_batch(&mut sub).await;
    assert_eq!(first.worker, Some(Ok(info.clone())), "the first batch names the engine");
    assert_eq!(second.worker, None, "a busy publisher names it once a heartbeat interval, not on every batch");
    client.publish("t.resync", bytes::Bytes::new()).await.unwrap();
    let (snapshot, _) = next_batch(&mut sub).await;
    assert!(snapshot.header.snapshot);
    assert_eq!(snapshot.worker, Some(Ok(info)), "a snapshot names it: a restarted kvindex learns it from the resync");
    assert_eq!(
        PublisherConfig::named("t", WorkerInfo::named("engine-7"), 0).worker_id,
        kvindex_core::names::worker_id_for_name("engine-7")
    );
}
