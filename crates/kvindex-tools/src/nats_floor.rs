//! `kvindex-tools nats-floor`: what NATS itself costs on this machine, beside what kvindex
//! adds to it. A bare request-reply (a responder that echoes) and a bare publish to a
//! subscriber, then a kvindex lookup and an event batch to applied (read from the daemon's
//! stage timings), each paced at the same rate on one local `nats-server`: the gap between
//! a pair is kvindex's own cost, the bare figure the floor no NATS client goes below.

use crate::harness::{free_port, http_body, sample, Daemon, Latency, NatsProcess};
use anyhow::{bail, Context, Result};
use futures::StreamExt;
use hdrhistogram::Histogram;
use kvindex::config::Config;
use kvindex_client::protocol::now_ns;
use kvindex_client::{LookupClient, Publisher, PublisherConfig, Query};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock};
use serde::Serialize;
use std::time::{Duration, Instant};

/// What a run measured: each path, `n` times at `rate` a second.
#[derive(Debug, Serialize)]
pub struct FloorReport {
    pub n: u64,
    pub rate: f64,
    pub paths: Vec<Latency>,
}

/// Waits until the `i`-th of a series paced at `rate` a second from `start` is due.
async fn pace(start: Instant, i: u64, rate: f64) {
    let due = start + Duration::from_secs_f64(i as f64 / rate);
    if let Some(wait) = due.checked_duration_since(Instant::now()) {
        tokio::time::sleep(wait).await;
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

/// Runs every path `n` times at `rate` a second.
pub async fn run(n: u64, rate: f64) -> Result<FloorReport> {
    let nats = NatsProcess::start()?;
    let (a, b) = (async_nats::connect(nats.url()).await?, async_nats::connect(nats.url()).await?);
    let mut paths = vec![bare_request_reply(&a, &b, n, rate).await?, bare_publish(&a, &b, n, rate).await?];
    paths.extend(kvindex_paths(&nats, &a, &b, n, rate).await?);
    Ok(FloorReport { n, rate, paths })
}

/// A bare request-reply from `a`: a responder on `b` echoes each request.
async fn bare_request_reply(a: &async_nats::Client, b: &async_nats::Client, n: u64, rate: f64) -> Result<Latency> {
    let mut asked = b.subscribe("floor.req").await?;
    let echo = b.clone();
    let responder = tokio::spawn(async move {
        while let Some(m) = asked.next().await {
            if let Some(reply) = m.reply {
                let _ = echo.publish(reply, m.payload).await;
            }
        }
    });
    b.flush().await?;
    let mut h = histogram();
    let start = Instant::now();
    for i in 0..n {
        pace(start, i, rate).await;
        let sent = Instant::now();
        a.request("floor.req", bytes::Bytes::from_static(b"0123456789abcdef")).await.context("bare request")?;
        let _ = h.record(sent.elapsed().as_nanos().max(1) as u64);
    }
    responder.abort();
    Ok(Latency::of_histogram("bare NATS request-reply", &h))
}

/// A bare publish from `a`: the subscriber on `b` reads the send time from the payload.
async fn bare_publish(a: &async_nats::Client, b: &async_nats::Client, n: u64, rate: f64) -> Result<Latency> {
    let mut heard = b.subscribe("floor.pub").await?;
    b.flush().await?;
    let listener = tokio::spawn(async move {
        let mut h = histogram();
        for _ in 0..n {
            let Some(m) = heard.next().await else { break };
            let sent = m.payload.get(..8).and_then(|s| s.try_into().ok()).map_or(0, u64::from_le_bytes);
            let _ = h.record(now_ns().saturating_sub(sent).max(1));
        }
        h
    });
    let start = Instant::now();
    for i in 0..n {
        pace(start, i, rate).await;
        a.publish("floor.pub", now_ns().to_le_bytes().to_vec().into()).await?;
    }
    a.flush().await?;
    let h = tokio::time::timeout(Duration::from_secs(30), listener).await.context("every publish heard")??;
    Ok(Latency::of_histogram("bare NATS publish to subscriber", &h))
}

/// kvindex on the same server: a lookup from `a`, and an event batch from `b` to applied.
async fn kvindex_paths(
    nats: &NatsProcess,
    a: &async_nats::Client,
    b: &async_nats::Client,
    n: u64,
    rate: f64,
) -> Result<[Latency; 2]> {
    let daemon = Daemon::start(Config {
        prefix: "floor".into(),
        metrics_addr: format!("127.0.0.1:{}", free_port()?),
        inspect_addr: format!("127.0.0.1:{}", free_port()?),
        worker_ttl: 0,
        ..Config::with_nats_url(nats.url())
    })
    .await?;
    let cfg = PublisherConfig { linger: Duration::ZERO, ..PublisherConfig::new("floor", 1, 0) };
    let publisher = Publisher::start(b.clone(), cfg).await?;
    let lookups = LookupClient::new(a.clone(), "floor");
    let query = Query::hashes(&[LocalHash(1), LocalHash(2)]);
    let mut h = histogram();
    let start = Instant::now();
    for i in 0..n {
        pace(start, i, rate).await;
        // A store and a removal of one block each time, so that lookups meet a live index.
        let block = StoredBlock::new(1_000 + i, 1);
        publisher.stored(None, &[block]);
        publisher.removed(&[BlockHash(1_000 + i)]);
        let sent = Instant::now();
        lookups.lookup(&query).await.context("kvindex lookup")?;
        let _ = h.record(sent.elapsed().as_nanos().max(1) as u64);
    }
    let lookup = Latency::of_histogram("kvindex lookup (LookupClient over NATS)", &h);
    let applied = 2 * n;
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        let text = http_body(&daemon.cfg.metrics_addr, "/metrics").await;
        let done = sample(&text, "kvindex_blocks_applied_total{kind=\"stored\"}")
            + sample(&text, "kvindex_blocks_applied_total{kind=\"removed\"}");
        if done >= applied as f64 {
            break text;
        }
        if Instant::now() > deadline {
            bail!("kvindex applied {done} of {applied} blocks in 30 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let event = Latency::of_metric("kvindex event: published to applied (bucket bounds)", &text, "kvindex_event_lag_seconds", "");
    publisher.close().await;
    daemon.stop().await?;
    Ok([lookup, event])
}
