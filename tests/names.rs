//! Workers with names, against a real daemon and `nats-server`: a named publisher is listed
//! with its name and URL and named in answers that ask; a second engine claiming a named
//! worker id is refused and counted while the first lives, and takes the id once it is gone;
//! a malformed `worker` map is counted and its batch's events still apply.

mod support;

use kvindex::cli::inspect::Api;
use kvindex_client::core::names::{worker_id_for_name, WorkerInfo};
use kvindex_client::core::StoredBlock;
use kvindex_client::{LookupClient, Publisher, PublisherConfig, Query};
use kvindex_core::LocalHash;
use serde_json::Value;
use std::time::Duration;
use support::{eventually, Daemon, NatsServer};

fn chain(base: u64, locals: &[u64]) -> Vec<StoredBlock> {
    locals.iter().enumerate().map(|(i, &l)| StoredBlock::new(base + i as u64, l)).collect()
}

fn hashes(locals: &[u64]) -> Vec<LocalHash> {
    locals.iter().map(|&l| LocalHash(l)).collect()
}

/// A publisher of `info` on prefix `t`, as worker `worker_id` (the name's id when `None`).
async fn named(c: &async_nats::Client, info: WorkerInfo, worker_id: Option<u64>) -> Publisher {
    let mut cfg = PublisherConfig::named("t", info, 0);
    cfg.worker_id = worker_id.unwrap_or(cfg.worker_id);
    cfg.linger = Duration::ZERO;
    cfg.heartbeat = Duration::from_millis(200);
    Publisher::start(c.clone(), cfg).await.expect("the publisher starts")
}

/// The depth worker `id` answers for `locals`, and whether it is stale; `None` when absent.
async fn depth(lookups: &LookupClient, locals: &[u64], id: u64) -> Option<(u32, bool)> {
    let a = lookups.lookup(&Query::hashes(&hashes(locals))).await.ok()?;
    a.matches.iter().find(|m| m.worker_id == id).map(|m| (m.blocks, m.stale))
}

/// Waits up to `secs` for worker `id` to answer `want` blocks of `locals`, not stale.
async fn holds(lookups: &LookupClient, locals: &[u64], id: u64, want: u32, secs: u64) -> Option<()> {
    eventually(secs, || async { (depth(lookups, locals, id).await == Some((want, false))).then_some(()) }).await
}

fn api(d: &Daemon) -> Api {
    Api { addr: d.cfg.inspect_addr.clone(), token: None }
}

/// The name `/v1/workers` lists for worker `id`.
async fn listed_name(d: &Daemon, id: u64) -> Option<String> {
    let all = api(d).workers().await.ok()?;
    let w = all.iter().find(|w| w["worker_id"] == id)?;
    w["name"].as_str().map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_engine_is_listed_and_named_in_the_answers_that_ask() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let info = WorkerInfo {
        name: "vllm-a".into(),
        url: Some("http://10.0.0.1:8000".into()),
        model: Some("llama".into()),
        block_size: Some(16),
    };
    let p = named(&c, info.clone(), None).await;
    p.stored(None, &chain(100, &[1, 2, 3]));
    let id = worker_id_for_name("vllm-a");
    assert_eq!(p.worker().worker_id, id);

    let lookups = LookupClient::new(c.clone(), "t").with_timeout(Duration::from_secs(2));
    holds(&lookups, &[1, 2, 3], id, 3, 10).await.expect("the named worker holds its three blocks");
    let answer = lookups.lookup(&Query::hashes(&hashes(&[1, 2, 3])).with_names()).await.unwrap();
    assert_eq!(answer.name_of(id), Some(&info), "an answer that asks names the worker as its publisher said");
    let plain = lookups.lookup(&Query::hashes(&hashes(&[1, 2, 3]))).await.unwrap();
    assert!(plain.names.is_empty(), "names only where asked: {:?}", plain.names);

    let all = api(&d).workers().await.unwrap();
    let w = all.iter().find(|w| w["worker_id"] == id).expect("listed");
    assert_eq!(
        (&w["name"], &w["url"], &w["model"], &w["block_size"]),
        (&Value::from("vllm-a"), &Value::from("http://10.0.0.1:8000"), &Value::from("llama"), &Value::from(16))
    );
    drop(p);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_engine_claiming_a_named_id_is_refused_until_the_first_is_gone() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.worker_ttl = 2).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let lookups = LookupClient::new(c.clone(), "t").with_timeout(Duration::from_secs(2));
    let first = named(&c, WorkerInfo::named("engine-a"), Some(42)).await;
    first.stored(None, &chain(100, &[1, 2, 3]));
    holds(&lookups, &[1, 2, 3], 42, 3, 10).await.expect("the first engine's blocks");

    // A misconfigured second engine on the same id: its named batches and those of its epoch
    // are refused; the first engine's state stays exact.
    let second = named(&c, WorkerInfo::named("engine-b"), Some(42)).await;
    second.stored(None, &chain(700, &[7, 8]));
    second.stored(Some(kvindex_core::BlockHash(701)), &chain(702, &[9]));
    eventually(10, || async { (d.metric("kvindex_refused_events_total{reason=\"name_conflict\"}").await >= 2.0).then_some(()) })
        .await
        .expect("the second engine's batches refused and counted");
    first.stored(Some(kvindex_core::BlockHash(102)), &chain(103, &[4]));
    holds(&lookups, &[1, 2, 3, 4], 42, 4, 10).await.expect("the first engine goes on, whole");
    assert_eq!(depth(&lookups, &[7, 8, 9], 42).await, None, "nothing of the second engine is held");
    assert_eq!(listed_name(&d, 42).await.as_deref(), Some("engine-a"));

    // The first engine dies: once it is dropped for silence, the id is free and the second
    // engine (heartbeating all along) takes it, resynced whole.
    drop(first);
    holds(&lookups, &[7, 8, 9], 42, 3, 20).await.expect("the second engine holds the id, its blocks whole");
    assert_eq!(depth(&lookups, &[1, 2, 3], 42).await, None, "the first engine's blocks went with it");
    assert_eq!(listed_name(&d, 42).await.as_deref(), Some("engine-b"));
    drop(second);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_worker_map_is_counted_and_its_events_still_apply() {
    use rmpv::Value as V;
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let stored = V::Map(vec![(
        V::from("stored"),
        V::Map(vec![
            (V::from("parent_hash"), V::Nil),
            (V::from("blocks"), V::Array(vec![V::Array(vec![V::from(500u64), V::from(5u64)])])),
        ]),
    )]);
    let batch = V::Map(vec![
        (V::from("worker_id"), V::from(9u64)),
        (V::from("epoch"), V::from(1u64)),
        (V::from("worker"), V::Map(vec![(V::from("name"), V::from(5u64))])),
        (V::from("events"), V::Array(vec![V::Map(vec![(V::from("event_id"), V::from(0u64)), (V::from("data"), stored)])])),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    c.publish("t.events.9", bytes.into()).await.unwrap();
    c.flush().await.unwrap();
    let lookups = LookupClient::new(c.clone(), "t").with_timeout(Duration::from_secs(2));
    holds(&lookups, &[5], 9, 1, 10).await.expect("the event applied");
    assert_eq!(d.metric("kvindex_decode_failures_total{reason=\"bad_worker_info\"}").await, 1.0);
    assert_eq!(listed_name(&d, 9).await, None, "nothing is taken from a malformed map");
    d.stop().await.unwrap();
}
