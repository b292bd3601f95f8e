//! Several `kvindex serve` replicas behind the `kvindex` queue group: a replica answers
//! lookups only while its index is whole, so a restarted one never answers from a
//! half-built index.

mod support;

use futures::StreamExt;
use kvindex_client::protocol::{encode_batch, BatchHeader, EventBatch, KvEvent, ResyncAck};
use kvindex_client::{LookupClient, MatchEntry, Query};
use kvindex_core::{Event, LocalHash};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{eventually, Daemon, NatsServer};

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
