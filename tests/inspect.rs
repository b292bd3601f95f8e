//! The inspect API against a real daemon and `nats-server`: each worker's state and why it is
//! stale, a worker's blocks as a replay stream, lookups answered as over NATS, paging, the
//! bearer token, workers dropped for silence, and the `kvindex workers`, `lookup` and `dump`
//! commands over it.

mod support;

use kvindex::cli::http::request;
use kvindex::cli::inspect::{self, Api};
use kvindex_client::protocol::{KvEvent, LookupRequest, LookupResponse, MatchEntry};
use kvindex_core::hash::{BlockHash, StoredBlock};
use kvindex_core::{Event, Tier};
use serde_json::Value;
use support::{eventually, publish, Daemon, NatsServer};

/// A chain of device blocks with engine hashes from `base` and local hashes `locals`.
fn stored(id: u64, parent: Option<u64>, base: u64, locals: &[u64]) -> KvEvent {
    let blocks = locals.iter().enumerate().map(|(i, &l)| StoredBlock::new(base + i as u64, l)).collect();
    KvEvent { event_id: id, data: Event::Stored { parent: parent.map(BlockHash), blocks, tier: Tier::Device } }
}

/// Runs a blocking call (a child process) off the runtime's threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("the call returns")
}

fn api(d: &Daemon) -> Api {
    Api { addr: d.cfg.inspect_addr.clone(), token: d.cfg.inspect_token.clone() }
}

/// The workers the API lists, by (worker id, dp rank).
fn by_worker(all: &[Value], id: u64) -> Option<&Value> {
    all.iter().find(|w| w["worker_id"] == id && w["dp_rank"] == 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_blocks_and_lookups_as_the_daemon_knows_them() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    let prompt = [11, 12, 13];
    publish(&c, 1, vec![stored(0, None, 100, &prompt)]).await;
    // Worker 2 holds the first block, then skips event ids: stale, asked to resync.
    publish(&c, 2, vec![stored(0, None, 200, &prompt[..1])]).await;
    publish(&c, 2, vec![stored(5, Some(200), 201, &[99])]).await;

    let a = api(&d);
    let all = eventually(10, || {
        let a = Api { addr: a.addr.clone(), token: None };
        async move {
            let all = a.workers().await.ok()?;
            let two = by_worker(&all, 2)?;
            let asked = two["stale"]["resync_requests"].as_u64().is_some_and(|n| n >= 1);
            (by_worker(&all, 1)?["blocks"]["device"] == 3 && two["stale"]["reason"] == "event_gap" && asked).then_some(all)
        }
    })
    .await
    .expect("both workers listed, worker 2 stale for its gap and asked to resync");
    let one = by_worker(&all, 1).unwrap();
    assert_eq!(one["stale"], Value::Null, "{one}");
    assert_eq!((one["epoch"].as_u64(), one["next_event_id"].as_u64()), (Some(1), Some(1)));
    assert!(one["last_heard_ms"].as_u64().is_some_and(|ms| ms < 60_000));
    let two = by_worker(&all, 2).unwrap();
    assert_eq!(two["blocks"]["device"], 2, "the block past the gap was placed under its parent: {two}");
    let table = inspect::workers_table(&all);
    assert!(table.contains("event_gap"));
    assert!(table.lines().any(|l| l.starts_with(&format!("{:>20} {:>5} ", 1, 0))), "rows line up under the header:\n{table}");

    // Worker 1's blocks, parents first, as a replay stream; in pages when asked.
    let mut dump = Vec::new();
    let a1 = Api { addr: a.addr.clone(), token: None };
    let n = a1.dump(1, 0, &mut dump).await.expect("dump");
    assert_eq!(n, 3);
    let lines: Vec<Value> = String::from_utf8(dump).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let parents: Vec<Value> = lines.iter().map(|l| l["parent"].clone()).collect();
    assert_eq!(parents, [Value::Null, Value::from(100), Value::from(101)]);
    assert_eq!(lines[2]["blocks"], serde_json::json!([[13, 102]]));
    assert!(lines.iter().enumerate().all(|(i, l)| l["op"] == "stored" && l["event_id"] == i && l["worker"] == 1));
    let page = support::http_get(&d.cfg.inspect_addr, "/v1/workers/1/0/blocks?offset=1&limit=1").await.unwrap();
    assert_eq!(page.0, 200);
    let page: Value = serde_json::from_str(&page.1).unwrap();
    assert_eq!((page["total"].as_u64(), page["offset"].as_u64(), page["next"].as_u64()), (Some(3), Some(1), Some(2)));
    assert_eq!(page["ops"][0]["parent"], 100);
    let missing = support::http_get(&d.cfg.inspect_addr, "/v1/workers/9/0/blocks").await.unwrap();
    assert_eq!(missing.0, 404, "{}", missing.1);

    // A lookup over HTTP answers as one over NATS.
    let req = LookupRequest { block_hashes: Some(prompt.to_vec()), ..Default::default() };
    let over_nats: LookupResponse = {
        let reply = c.request("t.lookup", rmp_serde::to_vec_named(&req).unwrap().into()).await.unwrap();
        rmp_serde::from_slice(&reply.payload).unwrap()
    };
    let a2 = Api { addr: a.addr.clone(), token: None };
    let r = req.clone();
    let over_http = a2.lookup(&r).await.unwrap();
    assert_eq!(over_http, over_nats);
    let entry = |worker_id, blocks, stale| MatchEntry {
        worker_id,
        dp_rank: 0,
        blocks,
        stale,
        tiers: Default::default(),
        ..Default::default()
    };
    assert_eq!(
        over_http,
        LookupResponse::Matches {
            matches: vec![entry(1, 3, false), entry(2, 1, true)],
            groups: vec![],
            shard: None,
            missing_shards: vec![],
            stale_workers: vec![],
            names: vec![],
        }
    );
    // A request kvindex refuses, and a body that is no request, get error answers with the reason.
    let a3 = Api { addr: a.addr.clone(), token: None };
    let gpu = LookupRequest { block_hashes: Some(vec![11]), tiers: Some(vec!["gpu".into()]), ..Default::default() };
    let bad = a3.lookup(&gpu).await;
    assert!(bad.is_err_and(|e| e.to_string().contains("400") && e.to_string().contains("unknown tier")));
    let garbled = request(&a.addr, "POST", "/v1/lookup", None, Some("{\"block_hashes\": [")).await.expect("answered");
    assert!(garbled.0 == 400 && garbled.1.contains("not a lookup request"), "{garbled:?}");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_guards_the_api_and_silent_workers_are_listed_as_dropped() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| {
        cfg.inspect_token = Some("s3cret".into());
        cfg.worker_ttl = 1;
    })
    .await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    publish(&c, 4, vec![stored(0, None, 400, &[1, 2])]).await;
    let denied = support::http_get(&d.cfg.inspect_addr, "/v1/workers").await.unwrap();
    assert_eq!(denied.0, 401, "{}", denied.1);
    let wrong = Api { addr: d.cfg.inspect_addr.clone(), token: Some("guess".into()) };
    assert!(wrong.workers().await.is_err_and(|e| e.to_string().contains("401")));
    // Silent past its TTL, worker 4 is dropped, and listed as dropped.
    let a = api(&d);
    let gone = eventually(15, || {
        let a = Api { addr: a.addr.clone(), token: a.token.clone() };
        async move {
            let all = a.workers().await.ok()?;
            let expired = all.last()?["expired"].as_array()?.clone();
            (by_worker(&all, 4).is_none() && expired.iter().any(|e| e["worker_id"] == 4)).then_some(())
        }
    })
    .await;
    assert!(gone.is_some(), "worker 4 dropped for silence and listed as such");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_print_what_the_api_says() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    // Worker 7 caches the blocks of the text "abcdefgh" cut in blocks of 4 bytes as tokens.
    let locals = kvindex_core::local_hashes(&b"abcdefgh".map(u32::from), 4, None, None);
    let chain: Vec<u64> = locals.iter().map(|l| l.0).collect();
    publish(&c, 7, vec![stored(0, None, 700, &chain)]).await;
    let addr = d.cfg.inspect_addr.clone();
    let run = |args: Vec<String>| async move {
        blocking(move || {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvindex")).args(&args).output().expect("kvindex runs");
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        })
        .await
    };
    let listed = eventually(10, || {
        let args = vec!["workers".to_string(), "--addr".into(), addr.clone()];
        async move {
            let (ok, out, _) = run(args).await;
            (ok && out.lines().any(|l| l.split_whitespace().take(4).eq(["7", "0", "-", "2"]))).then_some(out)
        }
    })
    .await;
    assert!(listed.is_some(), "`kvindex workers` lists worker 7 with its 2 blocks");
    let (ok, out, err) = run(vec![
        "lookup".into(),
        "--addr".into(),
        addr.clone(),
        "--text".into(),
        "abcdefghij".into(),
        "--block-size".into(),
        "4".into(),
    ])
    .await;
    assert!(ok, "{err}");
    assert!(out.lines().any(|l| l.split_whitespace().take(3).eq(["7", "0", "2"])), "{out}");
    let (ok, out, err) = run(vec!["dump".into(), "--addr".into(), addr.clone(), "--worker".into(), "7".into()]).await;
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(err.contains("2 blocks of worker 7"), "{err}");
    let (ok, _, err) = run(vec!["workers".into(), "--addr".into(), format!("127.0.0.1:{}", support::free_port())]).await;
    assert!(!ok && err.contains("cannot reach the inspect API"), "{err}");
    d.stop().await.unwrap();
}

/// Runs the kvindex binary with `args` and the environment `env`; (success, stdout, stderr).
fn kvindex(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvindex"));
    cmd.args(args).env_remove("KVINDEX_INSPECT_ADDR").env_remove("KVINDEX_METRICS_ADDR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("kvindex runs");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_find_the_daemon_by_the_variables_serve_reads() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |_| {}).await;
    let c = async_nats::connect(nats.url()).await.unwrap();
    publish(&c, 9, vec![stored(0, None, 900, &[1, 2, 3])]).await;
    let (inspect, metrics) = (d.cfg.inspect_addr.clone(), d.cfg.metrics_addr.clone());
    let nowhere = format!("127.0.0.1:{}", support::free_port());
    let listed = eventually(10, || {
        let inspect = inspect.clone();
        async move {
            let (ok, out, _) = blocking(move || kvindex(&["workers"], &[("KVINDEX_INSPECT_ADDR", &inspect)])).await;
            (ok && out.lines().any(|l| l.split_whitespace().take(4).eq(["9", "0", "-", "3"]))).then_some(())
        }
    })
    .await;
    assert!(listed.is_some(), "`kvindex workers` reads KVINDEX_INSPECT_ADDR");
    let (n, m) = (nowhere.clone(), metrics.clone());
    let results = blocking(move || {
        [
            kvindex(&["health"], &[("KVINDEX_METRICS_ADDR", &m)]),
            kvindex(&["health", "--path", "/healthz"], &[("KVINDEX_METRICS_ADDR", &m)]),
            kvindex(&["health"], &[("KVINDEX_METRICS_ADDR", &n)]),
            // A flag wins over the variable.
            kvindex(&["health", "--addr", &m], &[("KVINDEX_METRICS_ADDR", &n)]),
            kvindex(&["workers", "--addr", &n], &[("KVINDEX_INSPECT_ADDR", &m)]),
        ]
    })
    .await;
    assert!(results[0].0, "health reads KVINDEX_METRICS_ADDR: {}", results[0].2);
    assert!(results[1].0, "{}", results[1].2);
    assert!(!results[2].0 && results[2].2.contains(&nowhere), "health asks the variable's address: {}", results[2].2);
    assert!(results[3].0, "--addr wins over KVINDEX_METRICS_ADDR: {}", results[3].2);
    assert!(!results[4].0, "--addr wins over KVINDEX_INSPECT_ADDR");
    d.stop().await.unwrap();
}

#[test]
fn config_prints_each_value_with_its_layer() {
    let dir = std::env::temp_dir().join(format!("kvindex-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("k.toml");
    std::fs::write(&file, "worker_ttl = 7\n").unwrap();
    let (ok, out, err) = kvindex(
        &["config", "--config", file.to_str().unwrap(), "--prefix", "flagged"],
        &[("KVINDEX_APPLY_THREADS", "3"), ("KVINDEX_NATS_TOKEN", "s3cret")],
    );
    assert!(ok, "{err}");
    let line = |key: &str| {
        out.lines().find(|l| l.starts_with(&format!("{key} = "))).unwrap_or_else(|| panic!("no {key} in\n{out}")).to_string()
    };
    assert!(line("prefix").contains("\"flagged\"") && line("prefix").ends_with("# flag --prefix"), "{out}");
    assert!(line("apply_threads").ends_with("# env KVINDEX_APPLY_THREADS"), "{out}");
    assert!(line("worker_ttl").contains("= 7") && line("worker_ttl").ends_with(&format!("# file {}", file.display())), "{out}");
    assert!(line("nats_url").ends_with("# default"), "{out}");
    assert!(line("nats_token").contains("<hidden>") && !out.contains("s3cret"), "{out}");
    // A bad value fails as `serve` would, naming the key.
    let (ok, _, err) = kvindex(&["config", "--config", file.to_str().unwrap()], &[("KVINDEX_METRICS_ADDR", "nowhere")]);
    assert!(!ok && err.contains("metrics_addr"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
