//! The HTTP side: Prometheus text on `/metrics`, `/healthz`, `/readyz`.

use super::state::now_ns;
use super::State;
use crate::apply::ApplyPool;
use axum::http::StatusCode;
use axum::routing::get;
use kvindex_core::index::KvIndex;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Every metric, the gauges read from the model and the pool brought up to date first.
fn metrics_text<I: KvIndex>(state: &State, pool: &ApplyPool<I>) -> String {
    let metrics = &state.metrics;
    let model = pool.model();
    let stats = model.device().stats();
    metrics.index.placements.set(stats.placements as i64);
    metrics.index.entries.set(stats.entries as i64);
    metrics.index.hidden.set(stats.hidden as i64);
    metrics.index.workers.set(stats.workers as i64);
    if let Some(tiers) = model.tiers() {
        for (tier, index) in tiers.each() {
            metrics.index.tier_blocks.with_label_values(&[tier.as_str()]).set(index.stats().placements as i64);
        }
    }
    metrics.durable.stream_sequence.set(state.durable.stream_seq.load(Ordering::Relaxed) as i64);
    let written = state.durable.snapshot_written.load(Ordering::Relaxed);
    if written > 0 {
        metrics.durable.snapshot_age.set(now_ns().saturating_sub(written) as f64 / 1e9);
    }
    for (t, depth) in pool.queue_depths().into_iter().enumerate() {
        metrics.index.apply_queue_depth.with_label_values(&[&t.to_string()]).set(depth as i64);
    }
    metrics.render()
}

/// Serves `/metrics`, `/healthz` (alive: every apply thread runs) and `/readyz` (ready to
/// answer lookups, or why not) until aborted.
pub(super) async fn http_server<I: KvIndex>(listener: tokio::net::TcpListener, state: Arc<State>, pool: Arc<ApplyPool<I>>) {
    let (metrics_state, metrics_pool) = (state.clone(), pool.clone());
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let text = metrics_text(&metrics_state, &metrics_pool);
                async move { ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text) }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let dead = pool.dead_threads();
                async move {
                    if dead == 0 {
                        (StatusCode::OK, "ok\n".to_string())
                    } else {
                        (StatusCode::INTERNAL_SERVER_ERROR, format!("{dead} apply thread(s) died\n"))
                    }
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let (ready, why) = state.health.readyz();
                async move { (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, why) }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("metrics server stopped: {e}");
    }
}
