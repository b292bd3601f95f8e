//! The bridge's Prometheus metrics, and its HTTP server: `/metrics`, `/healthz` (alive),
//! `/readyz` (connected to NATS and subscribed to every rank's engine socket).

use prometheus::{
    register_histogram_with_registry, register_int_counter_vec_with_registry, register_int_counter_with_registry,
    register_int_gauge_vec_with_registry, register_int_gauge_with_registry, Encoder, Histogram, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Registry, TextEncoder,
};
use std::sync::Arc;

/// Every metric the bridge exports.
pub struct BridgeMetrics {
    registry: Registry,
    /// Engine batches decoded and forwarded.
    pub batches: IntCounter,
    /// Events forwarded, by kind.
    pub events: IntCounterVec,
    /// Blocks in the forwarded stored and removed events.
    pub blocks: IntCounter,
    /// Frames, batches or events that could not be decoded, by reason.
    pub decode_failures: IntCounterVec,
    /// Valid events not forwarded, by reason (another attention group, remote, ...).
    pub skipped: IntCounterVec,
    /// Jumps in an engine's sequence numbers.
    pub seq_gaps: IntCounter,
    /// Replays asked of the engine, by result (ok, failed, unavailable).
    pub replays: IntCounterVec,
    /// Engine restarts seen (sequence back to an earlier number, or a new topic).
    pub engine_restarts: IntCounter,
    /// New epochs started (after a restart or an unhealed gap): kvindex cleared the worker.
    pub epochs: IntCounter,
    /// 1 while subscribed to a rank's engine socket.
    pub zmq_connected: IntGaugeVec,
    /// 1 while a rank's block set misses blocks its engine holds (started beside a running
    /// engine, or a gap the engine could not replay): kvindex answers for it as stale.
    pub incomplete: IntGaugeVec,
    /// 1 while connected to NATS (set when scraped).
    pub nats_connected: IntGauge,
    /// From the engine's batch timestamp to its events handed to the publisher and sent (at
    /// once, without a linger): what the ZMQ hop and the bridge add.
    pub engine_lag: Histogram,
}

impl BridgeMetrics {
    /// Every metric, registered in a registry of the bridge's own.
    pub fn new() -> Self {
        let r = Registry::new();
        let lag_buckets = vec![0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];
        let m = BridgeMetrics {
            engine_lag: register_histogram_with_registry!(
                "kvindex_bridge_engine_lag_seconds",
                "Time from an engine batch's timestamp to its events handed to the publisher.",
                lag_buckets,
                r
            )
            .expect("valid metric"),
            batches: register_int_counter_with_registry!("kvindex_bridge_batches_total", "Engine batches decoded and forwarded.", r)
                .expect("valid metric"),
            events: register_int_counter_vec_with_registry!(
                "kvindex_bridge_events_total",
                "Events forwarded to kvindex, by kind.",
                &["kind"],
                r
            )
            .expect("valid metric"),
            blocks: register_int_counter_with_registry!(
                "kvindex_bridge_blocks_total",
                "Blocks in the forwarded stored and removed events.",
                r
            )
            .expect("valid metric"),
            decode_failures: register_int_counter_vec_with_registry!(
                "kvindex_bridge_decode_failures_total",
                "Frames, batches or events that could not be decoded, by reason.",
                &["reason"],
                r
            )
            .expect("valid metric"),
            skipped: register_int_counter_vec_with_registry!(
                "kvindex_bridge_skipped_events_total",
                "Valid events not forwarded, by reason (unsupported_group, no_full_attention_group, too_many_groups, group_off_device, remote, unknown_medium).",
                &["reason"],
                r
            )
            .expect("valid metric"),
            seq_gaps: register_int_counter_with_registry!(
                "kvindex_bridge_seq_gaps_total",
                "Jumps in an engine's sequence numbers (batches lost on ZMQ).",
                r
            )
            .expect("valid metric"),
            replays: register_int_counter_vec_with_registry!(
                "kvindex_bridge_replays_total",
                "Replays asked of the engine, by result.",
                &["result"],
                r
            )
            .expect("valid metric"),
            engine_restarts: register_int_counter_with_registry!(
                "kvindex_bridge_engine_restarts_total",
                "Engine restarts seen (sequence back, or a new topic).",
                r
            )
            .expect("valid metric"),
            epochs: register_int_counter_with_registry!(
                "kvindex_bridge_epochs_total",
                "New epochs started: kvindex cleared the worker and rebuilds from what follows.",
                r
            )
            .expect("valid metric"),
            zmq_connected: register_int_gauge_vec_with_registry!(
                "kvindex_bridge_zmq_connected",
                "1 while subscribed to the rank's engine socket.",
                &["rank"],
                r
            )
            .expect("valid metric"),
            incomplete: register_int_gauge_vec_with_registry!(
                "kvindex_bridge_incomplete",
                "1 while the rank misses blocks its engine cached before the bridge could see them (until the engine clears or restarts).",
                &["rank"],
                r
            )
            .expect("valid metric"),
            nats_connected: register_int_gauge_with_registry!("kvindex_bridge_nats_connected", "1 while connected to NATS.", r)
                .expect("valid metric"),
            registry: r,
        };
        for kind in ["stored", "removed", "cleared"] {
            m.events.with_label_values(&[kind]);
        }
        for result in ["ok", "failed", "unavailable"] {
            m.replays.with_label_values(&[result]);
        }
        m
    }

    fn render(&self) -> String {
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for BridgeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Serves the bridge's HTTP endpoints until aborted.
pub(crate) async fn serve(listener: tokio::net::TcpListener, m: Arc<BridgeMetrics>, nats: async_nats::Client, ranks: Vec<u32>) {
    use axum::http::StatusCode;
    use axum::routing::get;
    let connected = move |nats: &async_nats::Client| nats.connection_state() == async_nats::connection::State::Connected;
    let (m2, n2) = (m.clone(), nats.clone());
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let (m, nats) = (m2.clone(), n2.clone());
                async move {
                    m.nats_connected.set(connected(&nats) as i64);
                    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], m.render())
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let (m, nats, ranks) = (m.clone(), nats.clone(), ranks.clone());
                async move {
                    let zmq_up = ranks.iter().all(|r| m.zmq_connected.with_label_values(&[&r.to_string()]).get() == 1);
                    match (connected(&nats), zmq_up) {
                        (true, true) => (StatusCode::OK, "ready"),
                        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "not connected to NATS"),
                        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "not subscribed to every engine socket"),
                    }
                }
            }),
        );
    let _ = axum::serve(listener, app).await;
}
