//! The HTTP side: Prometheus text on `/metrics` (every model's, and the query API's), `/healthz`
//! and `/readyz`.

use super::query::QueryMetrics;
use super::served::{Models, Served};
use super::state::now_ns;
use axum::http::StatusCode;
use axum::routing::get;
use kvindex_core::index::KvIndex;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Brings one model's gauges up to date from its model and its pool.
fn update_gauges<I: KvIndex>(m: &Served<I>) {
    let metrics = &m.state.metrics;
    let model = m.pool.model();
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
    metrics.durable.stream_sequence.set(m.state.durable.stream_seq.load(Ordering::Relaxed) as i64);
    let written = m.state.durable.snapshot_written.load(Ordering::Relaxed);
    if written > 0 {
        metrics.durable.snapshot_age.set(now_ns().saturating_sub(written) as f64 / 1e9);
    }
    for (t, depth) in m.pool.queue_depths().into_iter().enumerate() {
        metrics.index.apply_queue_depth.with_label_values(&[&t.to_string()]).set(depth as i64);
    }
}

/// Every metric, the gauges brought up to date first.
fn metrics_text<I: KvIndex>(models: &Models<I>, query: &QueryMetrics) -> String {
    models.0.iter().for_each(update_gauges);
    let mut registries: Vec<&prometheus::Registry> = models.0.iter().map(|m| &m.state.metrics.registry).collect();
    registries.push(&query.registry);
    crate::metrics::render(&registries)
}

/// Serves `/metrics`, `/healthz` (alive: every apply thread runs) and `/readyz` (ready to
/// answer lookups, or why not) until aborted.
pub(super) async fn http_server<I: KvIndex>(listener: tokio::net::TcpListener, models: Arc<Models<I>>, query: Arc<QueryMetrics>) {
    let (for_metrics, for_health) = (models.clone(), models.clone());
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let text = metrics_text(&for_metrics, &query);
                async move { ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text) }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let alive = for_health.alive();
                async move {
                    match alive {
                        Ok(()) => (StatusCode::OK, "ok\n".to_string()),
                        Err(why) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{why}\n")),
                    }
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let ready = models.ready();
                async move {
                    match ready {
                        Ok(said) => (StatusCode::OK, said.to_string()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("metrics server stopped: {e}");
    }
}
