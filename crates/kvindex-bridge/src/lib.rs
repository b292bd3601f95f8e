//! kvindex-bridge: the sidecar beside an engine (vLLM, SGLang, TensorRT-LLM) that feeds
//! kvindex with no change to the engine, run as `kvindex bridge`. ZMQ in (the engine's PUB
//! socket per dp rank, and its ROUTER for replay), kvindex's protocol out through
//! `kvindex_client`'s [`Publisher`](kvindex_client::Publisher), one per dp rank, so heartbeats,
//! epochs, resync answers and snapshots come from the code that has them.
//!
//! # Layout
//!
//! - this file: [`run`]: the ranks' bridges, the NATS connection, the HTTP endpoints;
//! - [`config`]: the layered configuration (the daemon's file, `KVINDEX_*`, flags);
//! - [`rank`]: one rank's loop: frames, the engine's sequence, replay, new epochs;
//! - [`engine`]: the engines' msgpack batches and events, decoded into domain events;
//! - [`groups`]: a rank's KV-cache groups (hybrid models), and each event's group in kvindex;
//! - [`metrics`]: the bridge's counters and its `/metrics`, `/healthz`, `/readyz`;
//! - [`fake`]: an engine's msgpack as vLLM and SGLang send it, for tests and benchmarks.

pub mod config;
pub mod engine;
pub mod fake;
pub mod groups;
mod metrics;
mod rank;

pub use config::{BridgeConfig, BridgeFlags, BridgeSettings};
pub use metrics::BridgeMetrics;

use anyhow::Context;
use rank::RankBridge;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Runs the bridge until `shutdown` resolves.
pub async fn run(cfg: BridgeConfig, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    let b = &cfg.bridge;
    let metrics = Arc::new(BridgeMetrics::new());
    let listener = tokio::net::TcpListener::bind(&b.metrics_addr)
        .await
        .with_context(|| format!("binding bridge metrics_addr {}", b.metrics_addr))?;
    let nats = cfg.nats.connect("kvindex-bridge").await?;
    tracing::info!(zmq = %b.zmq, replay = ?b.replay, worker = cfg.worker_id(), name = ?b.worker_name, ranks = ?b.dp_ranks, nats = %cfg.nats.nats_url, prefix = %cfg.prefix, "kvindex bridge running");
    let http = tokio::spawn(metrics::serve(listener, metrics.clone(), nats.clone(), b.dp_ranks.clone()));
    let mut ranks = Vec::new();
    for &rank in &b.dp_ranks {
        let endpoint = rank_endpoint(&b.zmq, rank).with_context(|| format!("zmq endpoint {}", b.zmq))?;
        let replay = match &b.replay {
            Some(r) => Some(rank_endpoint(r, rank).with_context(|| format!("replay endpoint {r}"))?),
            None => None,
        };
        let bridge = RankBridge::start(&cfg, rank, endpoint, replay, nats.clone(), metrics.clone()).await?;
        ranks.push(tokio::spawn(bridge.run()));
    }
    shutdown.await;
    tracing::info!("kvindex bridge stopping");
    for r in &ranks {
        r.abort();
    }
    http.abort();
    let _ = tokio::time::timeout(Duration::from_secs(2), nats.flush()).await;
    Ok(())
}

/// The endpoint of dp rank `rank`: the base endpoint's port plus the rank.
pub fn rank_endpoint(base: &str, rank: u32) -> anyhow::Result<String> {
    let (head, port) = base.rsplit_once(':').context("no port")?;
    let port: u32 = port.parse().context("bad port")?;
    let port = port.checked_add(rank).filter(|p| *p <= u16::MAX as u32).context("port past 65535")?;
    Ok(format!("{head}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_endpoints_add_the_rank_to_the_port() {
        assert_eq!(rank_endpoint("tcp://engine:5557", 0).unwrap(), "tcp://engine:5557");
        assert_eq!(rank_endpoint("tcp://engine:5557", 3).unwrap(), "tcp://engine:5560");
        assert!(rank_endpoint("tcp://engine:65535", 1).is_err());
        assert!(rank_endpoint("tcp://engine", 0).is_err());
    }
}
