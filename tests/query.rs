//! The query API for routers (`/query`, `/query_by_hash`, `/workers`, `/health`), against a
//! real daemon and `nats-server`: it answers what NATS answers, in tokens, naming each worker;
//! every bad request is refused with a 4xx, counted by reason, and changes nothing else; one
//! daemon serves two models of different block sizes, each on its own prefix, its metrics
//! labelled; a sharded deployment answers whole from any shard's API and names a shard that
//! does not answer.

mod support;

use kvindex::config::{Config, ModelTable};
use kvindex_client::core::names::{worker_id_for_name, WorkerInfo};
use kvindex_client::core::{local_hashes, LocalHash, StoredBlock, Tier};
use kvindex_client::{LookupClient, Publisher, PublisherConfig, Query};
use serde_json::{json, Value};
use std::time::Duration;
use support::{eventually, free_port, Daemon, NatsServer};

/// `POST path` with `body` (or `GET` without one) to `addr`: (status, JSON answer).
async fn call(addr: &str, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> (u16, Value) {
    let (code, text) = kvindex::cli::http::request(addr, method, path, token, body).await.expect("the query API answers");
    (code, serde_json::from_str(&text).unwrap_or(Value::String(text)))
}

async fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    call(addr, "POST", path, None, Some(&body.to_string())).await
}

/// A publisher of worker `info` (its name's id) on `prefix`.
async fn named(c: &async_nats::Client, prefix: &str, info: WorkerInfo) -> Publisher {
    let mut cfg = PublisherConfig::named(prefix, info, 0);
    cfg.linger = Duration::ZERO;
    Publisher::start(c.clone(), cfg).await.expect("the publisher starts")
}

/// Blocks of engine hashes `base..` over the local hashes `locals`.
fn chain(base: u64, locals: &[LocalHash]) -> Vec<StoredBlock> {
    locals.iter().enumerate().map(|(i, l)| StoredBlock::new(base + i as u64, l.0)).collect()
}

/// A 16-token prompt whose first block's local hash (4-token blocks) has its top bit set, so
/// that Dynamo's signed form of it is negative. The hash seed is fixed: the same prompt always.
fn prompt() -> Vec<u32> {
    (0u32..)
        .map(|s| (0..16).map(|t| s * 100 + t).collect::<Vec<u32>>())
        .find(|p| local_hashes(p, 4, None, None)[0].0 >> 63 == 1)
        .expect("a prompt")
}

/// Waits until NATS lookups of `locals` on `prefix` answer worker `id` at `blocks` deep.
async fn holds(c: &async_nats::Client, prefix: &str, locals: &[LocalHash], id: u64, blocks: u32) {
    let lookups = LookupClient::new(c.clone(), prefix).with_timeout(Duration::from_secs(2));
    let got = eventually(20, || async {
        let a = lookups.lookup(&Query::hashes(locals)).await.ok()?;
        a.matches.iter().any(|m| m.worker_id == id && m.blocks == blocks).then_some(())
    })
    .await;
    assert!(got.is_some(), "worker {id} never held {blocks} blocks on {prefix}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_asks_over_http_and_hears_what_nats_answers_in_tokens() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.query_addr = format!("127.0.0.1:{}", free_port());
        cfg.block_size = Some(4);
    })
    .await;
    let q = d.cfg.query_addr.clone();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let prompt = prompt();
    let locals = local_hashes(&prompt, 4, None, None);
    let a_info = WorkerInfo { url: Some("http://10.0.0.1:8000".into()), ..WorkerInfo::named("vllm-a") };
    let (a, b) = (worker_id_for_name("vllm-a"), worker_id_for_name("vllm-b"));
    // A holds all 4 blocks on device; B offloaded all 4 to host memory and keeps the first 2
    // on device.
    let pa = named(&c, "t", a_info).await;
    pa.stored(None, &chain(100, &locals));
    let pb = named(&c, "t", WorkerInfo::named("vllm-b")).await;
    pb.stored_in(Tier::Host, None, &chain(200, &locals));
    pb.stored(None, &chain(200, &locals[..2]));
    holds(&c, "t", &locals, a, 4).await;
    holds(&c, "t", &locals, b, 2).await;

    let (code, by_tokens) = post(&q, "/query", &json!({"token_ids": prompt, "model_name": "any"})).await;
    assert_eq!(code, 200, "{by_tokens}");
    let (sa, sb) = (a.to_string(), b.to_string());
    assert_eq!(by_tokens["scores"], json!({&sa: {"0": 16}, &sb: {"0": 8}}), "device matches, in tokens");
    assert_eq!(by_tokens["frequencies"], json!([2, 2, 1, 1]));
    assert_eq!(
        by_tokens["instances"][&sa],
        json!({"longest_matched": 16, "gpu": 16, "dp": {"0": 16}, "cpu": 16, "disk": 16, "name": "vllm-a", "url": "http://10.0.0.1:8000"})
    );
    assert_eq!(
        by_tokens["instances"][&sb],
        json!({"longest_matched": 16, "gpu": 8, "dp": {"0": 8}, "cpu": 16, "disk": 16, "name": "vllm-b"}),
        "B's host memory holds the whole prefix"
    );
    assert_eq!((&by_tokens["model_name"], &by_tokens["block_size"]), (&json!("default"), &json!(4)));

    // NATS answers the same, from the same path.
    let lookups = LookupClient::new(c.clone(), "t");
    let nats_answer = lookups.lookup(&Query::tokens(&prompt, 4).in_tiers(&[Tier::Device, Tier::Host])).await.unwrap();
    for m in &nats_answer.matches {
        assert_eq!(by_tokens["scores"][m.worker_id.to_string()]["0"], json!(m.blocks * 4), "worker {}", m.worker_id);
    }
    assert_eq!(nats_answer.matches.len(), 2);

    // By hash, in Dynamo's signed form (the first one negative): the same answer.
    let signed: Vec<i64> = locals.iter().map(|h| h.0 as i64).collect();
    assert!(signed[0] < 0);
    let (code, by_hash) = post(&q, "/query_by_hash", &json!({"block_hashes": signed, "model_name": "any"})).await;
    assert_eq!(code, 200, "{by_hash}");
    assert_eq!((&by_hash["scores"], &by_hash["instances"]), (&by_tokens["scores"], &by_tokens["instances"]));
    // Another adapter's request matches nothing; a worker list keeps the others out.
    let (_, lora) = post(&q, "/query", &json!({"token_ids": prompt, "model_name": "any", "lora_name": "sql"})).await;
    assert_eq!(lora["scores"], json!({}), "{lora}");
    let (_, only_b) = post(&q, "/query", &json!({"token_ids": prompt, "workers": [b]})).await;
    assert_eq!(only_b["scores"], json!({&sb: {"0": 8}}), "{only_b}");

    let (code, workers) = call(&q, "GET", "/workers", None, None).await;
    assert_eq!(code, 200);
    let mut listed: Vec<(String, Value, Value)> = workers
        .as_array()
        .expect("a list")
        .iter()
        .map(|w| (w["name"].as_str().unwrap_or("").to_string(), w["url"].clone(), w["dp_ranks"].clone()))
        .collect();
    listed.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        listed,
        [("vllm-a".to_string(), json!("http://10.0.0.1:8000"), json!([0])), ("vllm-b".to_string(), Value::Null, json!([0]))]
    );
    assert_eq!(call(&q, "GET", "/health", None, None).await, (200, json!({"status": "ok"})));
    assert_eq!(d.metric("kvindex_query_requests_total{endpoint=\"query\",result=\"ok\"}").await, 3.0);
    assert_eq!(d.metric("kvindex_query_requests_total{endpoint=\"query_by_hash\",result=\"ok\"}").await, 1.0);
    drop((pa, pb));
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_is_refused_counted_and_changes_nothing_else() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.query_addr = format!("127.0.0.1:{}", free_port());
        cfg.query_token = Some("s3cret".into());
        cfg.query_max_body = 4096;
        cfg.query_max_tokens = 64;
    })
    .await;
    let q = d.cfg.query_addr.clone();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let prompt: Vec<u32> = (1..=8).collect();
    let locals = local_hashes(&prompt, 4, None, None);
    let p = Publisher::start(c.clone(), PublisherConfig::new("t", 7, 0)).await.unwrap();
    p.stored(None, &chain(700, &locals));
    holds(&c, "t", &locals, 7, 2).await;

    let ask = |path: &'static str, token: Option<&'static str>, body: String| {
        let q = q.clone();
        async move { call(&q, "POST", path, token, Some(&body)).await }
    };
    let tok = Some("s3cret");
    let refusals: Vec<(&str, u16, (u16, Value))> = vec![
        ("unauthorized", 401, ask("/query", None, json!({"token_ids": prompt}).to_string()).await),
        ("unauthorized", 401, ask("/query", Some("guess"), json!({"token_ids": prompt}).to_string()).await),
        ("body_too_large", 413, ask("/query", tok, format!("{{\"token_ids\": [{}1]}}", "1,".repeat(3000))).await),
        ("malformed_json", 400, ask("/query", tok, "{\"token_ids\": [1, 2".into()).await),
        ("malformed_json", 400, ask("/query", tok, json!({"token_ids": [-1]}).to_string()).await),
        ("too_many_tokens", 413, ask("/query", tok, json!({"token_ids": vec![1; 65]}).to_string()).await),
        ("no_block_size", 400, ask("/query", tok, json!({"token_ids": prompt}).to_string()).await),
        ("bad_request", 400, ask("/query", tok, json!({"block_size": 4}).to_string()).await),
        ("bad_request", 400, ask("/query_by_hash", tok, json!({"block_hashes": [1], "cache_salt": "s"}).to_string()).await),
        ("not_found", 404, ask("/v1/query", tok, "{}".into()).await),
    ];
    for (reason, status, (code, body)) in &refusals {
        assert_eq!(code, status, "{reason}: {body}");
        assert!(body["error"].as_str().is_some_and(|e| !e.is_empty()), "{reason}: a reason to read: {body}");
    }
    for reason in
        ["unauthorized", "body_too_large", "malformed_json", "too_many_tokens", "no_block_size", "bad_request", "not_found"]
    {
        let want = refusals.iter().filter(|r| r.0 == reason).count() as f64;
        assert_eq!(d.metric(&format!("kvindex_query_rejected_total{{reason=\"{reason}\"}}")).await, want, "{reason}");
    }
    assert_eq!(d.metric("kvindex_query_rejected_total{reason=\"unknown_model\"}").await, 0.0);

    // Nothing else changed: the worker is whole, over HTTP and NATS.
    let (code, ok) = ask("/query", tok, json!({"token_ids": prompt, "block_size": 4}).to_string()).await;
    assert_eq!((code, &ok["scores"]), (200, &json!({"7": {"0": 8}})), "{ok}");
    holds(&c, "t", &locals, 7, 2).await;
    assert_eq!(call(&q, "GET", "/workers", None, None).await.0, 401, "the worker list needs the token too");
    assert_eq!(call(&q, "GET", "/workers", tok, None).await.0, 200);
    drop(p);
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_daemon_serves_two_models_each_with_its_own_prefix_and_block_size() {
    let nats = NatsServer::start();
    let table = |name: &str, block_size: u32| ModelTable {
        name: name.into(),
        keys: json!({"prefix": name, "block_size": block_size}).as_object().cloned().expect("a table"),
    };
    let d = Daemon::start(&nats.url(), |cfg: &mut Config| {
        cfg.query_addr = format!("127.0.0.1:{}", free_port());
        cfg.models = vec![table("llama", 4), table("qwen", 8)];
    })
    .await;
    let q = d.cfg.query_addr.clone();
    let c = async_nats::connect(nats.url()).await.unwrap();
    let prompt: Vec<u32> = (1..=16).collect();
    let (l4, l8) = (local_hashes(&prompt, 4, None, None), local_hashes(&prompt, 8, None, None));
    let llama = named(&c, "llama", WorkerInfo { block_size: Some(4), ..WorkerInfo::named("llama-0") }).await;
    llama.stored(None, &chain(100, &l4));
    let qwen = named(&c, "qwen", WorkerInfo { block_size: Some(8), ..WorkerInfo::named("qwen-0") }).await;
    qwen.stored(None, &chain(200, &l8[..1]));
    let (li, qi) = (worker_id_for_name("llama-0"), worker_id_for_name("qwen-0"));
    holds(&c, "llama", &l4, li, 4).await;
    holds(&c, "qwen", &l8, qi, 1).await;

    // Each model hashes the tokens with its own block size and answers its own workers.
    let (code, a) = post(&q, "/query", &json!({"token_ids": prompt, "model_name": "llama"})).await;
    assert_eq!((code, &a["scores"], &a["block_size"]), (200, &json!({li.to_string(): {"0": 16}}), &json!(4)), "{a}");
    let (code, a) = post(&q, "/query", &json!({"token_ids": prompt, "model_name": "qwen"})).await;
    assert_eq!((code, &a["scores"], &a["block_size"]), (200, &json!({qi.to_string(): {"0": 8}}), &json!(8)), "{a}");
    // A model it does not serve, or none named: refused, counted.
    let (code, a) = post(&q, "/query", &json!({"token_ids": prompt, "model_name": "mistral"})).await;
    assert_eq!(code, 404, "{a}");
    assert!(a["error"].as_str().is_some_and(|e| e.contains("\"llama\", \"qwen\"")), "names what it serves: {a}");
    assert_eq!(post(&q, "/query", &json!({"token_ids": prompt})).await.0, 404);
    assert_eq!(d.metric("kvindex_query_rejected_total{reason=\"unknown_model\"}").await, 2.0);

    let (_, listed) = call(&q, "GET", "/workers?model_name=qwen", None, None).await;
    assert_eq!(listed.as_array().map(|l| l.iter().map(|w| w["name"].clone()).collect::<Vec<_>>()), Some(vec![json!("qwen-0")]));
    let (_, all) = call(&q, "GET", "/workers", None, None).await;
    assert_eq!(all.as_array().map(Vec::len), Some(2), "{all}");
    // Each model's metrics carry its name; the inspect API takes ?model=.
    assert_eq!(d.metric("kvindex_ready{model=\"llama\"}").await, 1.0);
    assert_eq!(d.metric("kvindex_ready{model=\"qwen\"}").await, 1.0);
    let (code, page) = call(&d.cfg.inspect_addr, "GET", "/v1/workers?model=qwen", None, None).await;
    assert_eq!((code, page["workers"][0]["name"].clone(), page["total"].clone()), (200, json!("qwen-0"), json!(1)));
    assert_eq!(call(&d.cfg.inspect_addr, "GET", "/v1/workers", None, None).await.0, 404, "two models: name one");
    drop((llama, qwen));
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_deployment_answers_whole_from_any_shard_and_names_one_that_is_gone() {
    let nats = support::NatsProcess::start_sharded("t", 2).expect("nats-server with the mappings");
    let shard = |k: u32| {
        move |cfg: &mut Config| {
            cfg.shards = 2;
            cfg.shard = k;
            cfg.block_size = Some(4);
            cfg.query_addr = format!("127.0.0.1:{}", free_port());
        }
    };
    let zero = Daemon::start(&nats.url(), shard(0)).await;
    let one = Daemon::start(&nats.url(), shard(1)).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let prompt: Vec<u32> = (1..=32).collect();
    let locals = local_hashes(&prompt, 4, None, None);
    // Worker w holds the first w+1 blocks.
    let mut publishers = Vec::new();
    for w in 0..6u64 {
        let p = Publisher::start(c.clone(), PublisherConfig::new("t", w, 0)).await.unwrap();
        p.stored(None, &chain(1000 * (w + 1), &locals[..=w as usize]));
        publishers.push(p);
    }
    let want = |shards: &[u32]| -> Value {
        (0..6u64)
            .filter(|&w| shards.contains(&kvindex_client::shards::partition(w, 2)))
            .map(|w| (w.to_string(), json!({"0": (w + 1) * 4})))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let body = json!({"token_ids": prompt});
    let scores = |addr: String| {
        let body = &body;
        async move {
            let (code, a) = post(&addr, "/query", body).await;
            (code == 200).then(|| (a["scores"].clone(), a["missing_shards"].clone()))
        }
    };
    for d in [&zero, &one] {
        let whole = eventually(20, || async { scores(d.cfg.query_addr.clone()).await.filter(|s| s.0 == want(&[0, 1])) }).await;
        assert_eq!(whole.map(|s| s.1), Some(Value::Null), "shard {}'s API answers every worker, no shard missing", d.cfg.shard);
    }

    let addr = zero.cfg.query_addr.clone();
    one.stop().await.unwrap();
    let partial = eventually(20, || async { scores(addr.clone()).await.filter(|s| s.1 == json!([1])) }).await;
    assert_eq!(partial.map(|s| s.0), Some(want(&[0])), "shard 1 named missing, shard 0's workers kept");
    drop(publishers);
    zero.stop().await.unwrap();
}
