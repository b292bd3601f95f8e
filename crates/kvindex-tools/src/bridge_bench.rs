//! `kvindex bridge-bench`: blocks per second from an engine's ZMQ socket to applied in kvindex,
//! through `kvindex bridge`. A fake engine publishes vLLM-shaped batches (array events, 16-token
//! blocks) on a PUB socket; the bridge, `kvindex serve` and `nats-server` run on this machine.

use crate::harness::{buckets, free_port, http_body, quantile, sample, Bridge, Daemon, Latency, NatsProcess};
use anyhow::{bail, Result};
use bytes::Bytes;
use kvindex::config::Config;
use kvindex_bridge::fake::stored_batch;
use kvindex_bridge::BridgeConfig;
use serde::Serialize;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// What a run measured.
#[derive(Debug, Serialize)]
pub struct BridgeReport {
    pub batches: u64,
    pub blocks: u64,
    pub seconds: f64,
    pub blocks_per_s: f64,
    pub events_per_s: f64,
    /// Upper bound of kvindex's event lag p99 (from the bridge's publish to applied), ms.
    pub lag_p99_ms: f64,
    /// Upper bound of the bridge's own lag p99 (engine batch timestamp to handed to its
    /// publisher: the ZMQ hop and the bridge), ms.
    pub bridge_lag_p99_ms: f64,
    /// Offered blocks per second (0: as fast as the bridge takes them).
    pub offered_blocks_per_s: f64,
    /// Each hop of an event's way, engine to visible, from the metrics: the bridge's, then
    /// kvindex's stages.
    pub stages: Vec<Latency>,
}

/// Pushes `batches` batches of `events` events of `blocks` blocks through the bridge, at
/// `rate` blocks per second (0: as fast as it takes them).
pub async fn run(batches: u64, events: u64, blocks: u64, rate: f64) -> Result<BridgeReport> {
    let nats = NatsProcess::start()?;
    let daemon = Daemon::start(Config {
        prefix: "bb".into(),
        metrics_addr: format!("127.0.0.1:{}", free_port()?),
        inspect_addr: format!("127.0.0.1:{}", free_port()?),
        worker_ttl: 0,
        ..Config::with_nats_url(nats.url())
    })
    .await?;
    let port = free_port()?;
    let mut engine = zeromq::PubSocket::new();
    engine.bind(&format!("tcp://127.0.0.1:{port}")).await?;
    let bridge_addr = format!("127.0.0.1:{}", free_port()?);
    let mut cfg = BridgeConfig { prefix: "bb".into(), ..BridgeConfig::default() };
    cfg.nats.nats_url = nats.url();
    cfg.bridge.zmq = format!("tcp://127.0.0.1:{port}");
    cfg.bridge.metrics_addr = bridge_addr.clone();
    let bridge = Bridge::start(cfg).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let total = batches * events * blocks;
    let start = Instant::now();
    for seq in 0..batches as usize {
        if rate > 0.0 {
            let due = start + Duration::from_secs_f64((seq as u64 * events * blocks) as f64 / rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                tokio::time::sleep(wait).await;
            }
        }
        // Made when sent, so that its timestamp is the engine's.
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let p = Bytes::from(stored_batch(ts, seq as u64 * events * blocks, events, blocks, 16));
        // A PUB socket drops what a slow subscriber cannot take: keep at most 256 batches ahead.
        if seq % 64 == 0 {
            while (seq as f64) - sample(&http_body(&bridge_addr, "/metrics").await, "kvindex_bridge_batches_total") > 256.0 {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
        let frames = vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&(seq as u64).to_be_bytes()), p];
        engine.send(ZmqMessage::try_from(frames).map_err(anyhow::Error::msg)?).await?;
    }
    let text = loop {
        let text = http_body(&daemon.cfg.metrics_addr, "/metrics").await;
        if sample(&text, "kvindex_blocks_applied_total{kind=\"stored\"}") >= total as f64 {
            break text;
        }
        if start.elapsed() > Duration::from_secs(300) {
            bail!("kvindex did not apply every block within 5 minutes");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let seconds = start.elapsed().as_secs_f64();
    let lag = quantile(&buckets(&text, "kvindex_event_lag_seconds_bucket{"), 0.99);
    let bridge_text = http_body(&bridge_addr, "/metrics").await;
    let bridge_lag = quantile(&buckets(&bridge_text, "kvindex_bridge_engine_lag_seconds_bucket{"), 0.99);
    let mut stages = vec![Latency::of_metric("engine to sent (bridge)", &bridge_text, "kvindex_bridge_engine_lag_seconds", "")];
    for s in ["transit", "decode", "queued", "apply"] {
        stages.push(Latency::of_metric(s, &text, "kvindex_event_stage_seconds", &format!("stage=\"{s}\"")));
    }
    let _ = bridge.stop().await;
    daemon.stop().await?;
    Ok(BridgeReport {
        batches,
        blocks: total,
        seconds,
        blocks_per_s: total as f64 / seconds,
        events_per_s: (batches * events) as f64 / seconds,
        lag_p99_ms: lag * 1e3,
        bridge_lag_p99_ms: bridge_lag * 1e3,
        offered_blocks_per_s: rate,
        stages,
    })
}
