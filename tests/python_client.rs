//! The Python client (clients/python), installed by pip as a user installs it, against a real
//! daemon and `nats-server`: lookups with every option, kvindex's hashing rules, names, an
//! announcement and a resync healed by its publisher's snapshot on one daemon; the merge of a
//! sharded deployment and a shard that stops answering on two. The checks are in
//! clients/python/tests/live.py; this starts what it talks to.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use support::{Daemon, NatsServer};

/// The client's virtual environment's python (scripts/python-client builds it, cached, once
/// for the tests of this binary: they run side by side).
fn python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            let out = Command::new(root.join("scripts/python-client")).output().expect("scripts/python-client runs");
            assert!(out.status.success(), "installing the Python client failed: {}", String::from_utf8_lossy(&out.stderr));
            PathBuf::from(String::from_utf8(out.stdout).expect("a path").trim())
        })
        .clone()
}

/// `live.py url prefix shards partitions`, its stdin and stdout piped.
fn live(url: &str, shards: u32) -> std::process::Child {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/python/tests/live.py");
    let partitions: Vec<String> = (0..6).map(|w| kvindex_client::shards::partition(w, 3).to_string()).collect();
    Command::new(python())
        .arg(script)
        .args([url, "t", &shards.to_string(), &partitions.join(",")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the Python client's checks start")
}

/// Waits for the script's output line `want` (reading in a blocking thread).
async fn said(out: &mut Option<BufReader<std::process::ChildStdout>>, want: &str) {
    let mut reader = out.take().expect("stdout");
    let (reader, line) = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        (reader, line)
    })
    .await
    .expect("reads");
    *out = Some(reader);
    assert_eq!(line.trim(), want, "the Python client's checks said");
}

async fn finished(mut child: std::process::Child) {
    let status = tokio::task::spawn_blocking(move || child.wait()).await.expect("waits").expect("exits");
    assert!(status.success(), "the Python client's checks failed (their traceback is above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_asks_announces_and_publishes_against_one_daemon() {
    let nats = NatsServer::start();
    let d = Daemon::start(&nats.url(), |cfg| cfg.worker_ttl = 0).await;
    let mut child = live(&nats.url(), 1);
    let mut out = child.stdout.take().map(BufReader::new);
    said(&mut out, "ok").await;
    finished(child).await;
    // Its heartbeats' digests agreed with the index's every time but once: the host-tier
    // block the script held without sending.
    assert_eq!(d.metric("kvindex_digest_mismatch_total{source=\"publisher\"}").await, 1.0);
    assert!(d.metric("kvindex_lookup_transit_seconds_count").await > 0.0, "its lookups say when they were sent");
    d.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_merges_a_sharded_deployment_and_names_a_missing_shard() {
    let nats = support::NatsProcess::start_sharded("t", 2).expect("nats-server with the mappings");
    let zero = Daemon::start(&nats.url(), |cfg| (cfg.shards, cfg.shard) = (2, 0)).await;
    let one = Daemon::start(&nats.url(), |cfg| (cfg.shards, cfg.shard) = (2, 1)).await;
    let mut child = live(&nats.url(), 2);
    let mut out = child.stdout.take().map(BufReader::new);
    said(&mut out, "whole").await;
    one.stop().await.unwrap();
    let mut stdin = child.stdin.take().expect("stdin");
    writeln!(stdin, "shard 1 stopped").expect("tells the script");
    said(&mut out, "ok").await;
    finished(child).await;
    zero.stop().await.unwrap();
}
