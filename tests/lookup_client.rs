//! `LookupClient` (kvindex-client) against a real `nats-server` and `kvindex serve`: ranked
//! answers by tokens (with a LoRA adapter) and by hashes, filters, and each error a router
//! must tell apart: no kvindex, a refused request, no answer in time; and a publisher that
//! says it misses blocks, answered as stale while it does.

mod support;

use kvindex_client::core::{local_hashes, BlockHash, StoredBlock};
use kvindex_client::{ClientError, LookupClient, MatchEntry, Publisher, PublisherConfig, Query};
use std::time::Duration;
use support::{eventually, Daemon, NatsServer};

const BLOCK: u32 = 16;

/// A publisher for `worker`/`rank` that stored the first `n` blocks of `tokens` for `lora`.
async fn engine(client: &async_nats::Client, worker: u64, rank: u32, tokens: &[u32], n: usize, lora: Option<&str>) -> Publisher {
    let p = Publisher::start(client.clone(), PublisherConfig::new("t", worker, rank)).await.unwrap();
    let blocks: Vec<StoredBlock> = local_hashes(tokens, BLOCK as usize, lora, None)
        .into_iter()
        .take(n)
        .enumerate()
        .map(|(i, l)| StoredBlock { block_hash: BlockHash(worker * 1000 + i as u64), tokens_hash: l })
        .collect();
    p.stored(None, &blocks);
    p.flush().await;
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranked_answers_by_tokens_and_hashes() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let tokens: Vec<u32> = (0..8 * BLOCK).collect();
    let _a = engine(&client, 1, 0, &tokens, 3, None).await;
    let _b = engine(&client, 2, 1, &tokens, 6, None).await;
    let _lora = engine(&client, 3, 0, &tokens, 8, Some("sql-adapter")).await;
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(5));
    let m = |worker_id, dp_rank, blocks| MatchEntry {
        worker_id,
        dp_rank,
        blocks,
        stale: false,
        tiers: Default::default(),
        ..Default::default()
    };

    let base = Query::tokens(&tokens, BLOCK);
    let got = eventually(10, || async { lookups.lookup(&base).await.ok().map(|a| a.matches).filter(|v| v.len() == 2) }).await;
    assert_eq!(got, Some(vec![m(2, 1, 6), m(1, 0, 3)]), "deepest first; the LoRA worker is not a match");

    let adapter = Query::tokens(&tokens, BLOCK).with_lora("sql-adapter");
    let lora = eventually(10, || async {
        lookups.lookup(&adapter).await.ok().filter(|a| a.matches.len() == 1 && a.matches[0].blocks == 8)
    })
    .await;
    let lora = lora.expect("the adapter's worker is applied");
    assert_eq!(lora.matches, vec![m(3, 0, 8)], "only the adapter's blocks match its requests");
    assert!(lora.stale_workers.is_empty());

    let hashes = local_hashes(&tokens, BLOCK as usize, None, None);
    let ask = |q: Query| {
        let lookups = lookups.clone();
        async move { lookups.lookup(&q).await.unwrap().matches }
    };
    assert_eq!(ask(Query::hashes(&hashes)).await, vec![m(2, 1, 6), m(1, 0, 3)]);
    assert_eq!(ask(Query::hashes(&hashes).only_workers(&[1])).await, vec![m(1, 0, 3)]);
    let mut capped = ask(Query::hashes(&hashes).max_blocks(2)).await;
    capped.sort_by_key(|e| e.worker_id);
    assert_eq!(capped, vec![m(1, 0, 2), m(2, 1, 2)], "both are tied at the cap; ties come in no set order");
    assert_eq!(ask(Query::hashes(&hashes).max_matches(1)).await, vec![m(2, 1, 6)], "the deepest is kept");

    let refused = lookups.lookup(&Query::tokens(&tokens, 0)).await;
    assert!(matches!(&refused, Err(ClientError::Rejected(why)) if why.contains("block_size")), "{refused:?}");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_kvindex_and_no_answer_are_told_apart() {
    let nats = NatsServer::start();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_millis(300));
    let q = Query::hashes(&local_hashes(&[1; 32], 16, None, None));
    let none = lookups.lookup(&q).await;
    assert!(matches!(&none, Err(ClientError::NoKvindex { subject }) if subject == "t.lookup"), "{none:?}");
    assert!(none.unwrap_err().to_string().contains("no kvindex answers on t.lookup"));

    // Something subscribes but never answers (a kvindex stuck, or not kvindex at all).
    let _mute = client.subscribe("t.lookup").await.unwrap();
    client.flush().await.unwrap();
    let slow = lookups.lookup(&q).await;
    assert!(matches!(slow, Err(ClientError::Timeout { timeout_ms: 300, .. })), "{slow:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_says_it_misses_blocks_is_answered_stale_until_it_does_not() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let tokens: Vec<u32> = (0..4 * BLOCK).collect();
    let p = engine(&client, 4, 0, &tokens, 3, None).await;
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(5));
    let query = Query::tokens(&tokens, BLOCK);
    let answer = |stale: bool| {
        let (lookups, query) = (&lookups, &query);
        async move { lookups.lookup(query).await.ok().filter(|a| a.matches.len() == 1 && a.matches[0].stale == stale) }
    };
    assert!(eventually(10, || answer(false)).await.is_some(), "whole at first");
    p.set_incomplete(true);
    let stale = eventually(10, || answer(true)).await.expect("answered as stale while incomplete");
    assert_eq!(stale.matches[0].blocks, 3, "what it sent is still matched");
    // More blocks while incomplete are applied; the flag stays.
    let more: Vec<StoredBlock> = local_hashes(&tokens, BLOCK as usize, None, None)[3..]
        .iter()
        .map(|&l| StoredBlock { block_hash: BlockHash(4003), tokens_hash: l })
        .collect();
    p.stored(Some(BlockHash(4002)), &more);
    p.flush().await;
    let deeper = eventually(10, || async { answer(true).await.filter(|a| a.matches[0].blocks == 4) }).await;
    assert!(deeper.is_some(), "applied and still stale");
    // Past the daemon's resync interval (1 s here), a stale worker would have been asked again;
    // this one is not, as a snapshot cannot help. (Only a request sent can fail this.)
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(d.metric("kvindex_resync_requests_total{scope=\"worker\"}").await, 0.0, "never asked to resync");
    p.set_incomplete(false);
    assert!(eventually(10, || answer(false)).await.is_some(), "whole once it says so");
    d.stop().await.unwrap();
}

/// A fleet sharing a system prompt: every worker's depth comes back, one group per distinct
/// depth on the wire (`grouped`, what `LookupClient` asks for), and the same answer to a v1
/// request one entry per worker; a cut answer keeps the deepest and rotates among those tied at
/// the cut instead of always keeping the lowest ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_depth_comes_back_grouped_and_a_cut_rotates_among_the_tied() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.lookup_threads = 1).await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let tokens: Vec<u32> = (0..8 * BLOCK).collect();
    let mut engines = Vec::new();
    for w in 1..=40 {
        engines.push(engine(&client, w, 0, &tokens, 2, None).await);
    }
    engines.push(engine(&client, 99, 0, &tokens, 7, None).await);
    let lookups = LookupClient::new(client.clone(), "t").with_timeout(Duration::from_secs(5));
    let q = Query::tokens(&tokens, BLOCK);
    let all = eventually(10, || async { lookups.lookup(&q).await.ok().filter(|a| a.matches.len() == 41) }).await;
    let all = all.expect("every worker's depth, not the 64 or fewer deepest");
    let shape: Vec<(u32, usize)> = all.groups.iter().map(|g| (g.blocks, g.workers.len())).collect();
    assert_eq!(shape, vec![(7, 1), (2, 40)], "one group per depth");
    assert_eq!((all.matches[0].worker_id, all.matches[0].blocks), (99, 7));

    let mut v1 = q.clone();
    v1.request.grouped = false;
    let flat = lookups.lookup(&v1).await.unwrap();
    assert!(flat.groups.is_empty(), "a v1 request gets one entry per worker");
    let mut want = all.matches.clone();
    want[1..].sort_by_key(|m| m.worker_id);
    assert_eq!(flat.matches, want, "deepest first, ties by worker id");

    // Three kept per lookup, the deepest first; on one lookup thread, twenty lookups go round
    // the forty tied workers.
    let mut kept = std::collections::BTreeSet::new();
    for _ in 0..20 {
        let cut = lookups.lookup(&q.clone().max_matches(3)).await.unwrap().matches;
        assert_eq!(cut.len(), 3);
        assert_eq!(cut[0].worker_id, 99, "the deepest is never cut");
        kept.extend(cut[1..].iter().map(|m| m.worker_id));
    }
    assert_eq!(kept.len(), 40, "the tied workers are kept in turn, not the lowest ids every time: {kept:?}");
    d.stop().await.unwrap();
}
