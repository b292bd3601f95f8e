//! The HTTP side: Prometheus text on `/metrics`, `/healthz`, `/readyz`.

use super::State;
use crate::apply::ApplyPool;
use kvindex_core::index::KvIndex;
use std::sync::atomic::Ordering;
use std::sync::Arc;

fn metrics_text<I: KvIndex>(state: &State, index: &I, pool: &ApplyPool<I>) -> String {
    let m = &state.metrics;
    let stats = index.stats();
    m.index_placements.set(stats.placements as i64);
    m.index_entries.set(stats.entries as i64);
    m.index_hidden.set(stats.hidden as i64);
    m.index_workers.set(stats.workers as i64);
    if let Some(others) = pool.others() {
        for (tier, index) in others.each() {
            m.tier_blocks.with_label_values(&[tier.as_str()]).set(index.stats().placements as i64);
        }
    }
    m.stream_sequence.set(state.stream_seq.load(Ordering::Relaxed) as i64);
    let written = state.snapshot_written.load(Ordering::Relaxed);
    if written > 0 {
        m.snapshot_age.set(super::now_ns().saturating_sub(written) as f64 / 1e9);
    }
    for (t, depth) in pool.queue_depths().into_iter().enumerate() {
        m.apply_queue_depth.with_label_values(&[&t.to_string()]).set(depth as i64);
    }
    m.render()
}

pub(super) async fn http_server<I: KvIndex>(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    index: Arc<I>,
    pool: Arc<ApplyPool<I>>,
) {
    use axum::http::StatusCode;
    use axum::routing::get;
    let metrics_state = state.clone();
    let health_pool = pool.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let (state, index, pool) = (metrics_state.clone(), index.clone(), pool.clone());
                async move {
                    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics_text(&state, &*index, &pool))
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let dead = health_pool.dead_threads();
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
                let ready = *state.ready.borrow();
                let connected = state.connected.load(Ordering::Relaxed);
                let member = state.member.load(Ordering::Relaxed);
                let replayed = state.caught_up.is_done();
                async move {
                    match (ready, connected, member) {
                        (true, _, true) => (StatusCode::OK, "ready: answering lookups\n"),
                        (true, _, false) => (StatusCode::SERVICE_UNAVAILABLE, "rebuilt; joining the lookup queue group\n"),
                        (false, false, _) => (StatusCode::SERVICE_UNAVAILABLE, "not connected to NATS\n"),
                        (false, true, _) if !replayed => {
                            (StatusCode::SERVICE_UNAVAILABLE, "catching up with the JetStream stream\n")
                        }
                        (false, true, _) => {
                            (StatusCode::SERVICE_UNAVAILABLE, "rebuilding the index from publishers' snapshots\n")
                        }
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("metrics server stopped: {e}");
    }
}
