//! The inspect API: JSON over HTTP on `inspect_addr` (loopback unless configured), for
//! operators and the `kvindex workers`, `lookup` and `dump` commands.
//!
//! - `GET /v1/workers`: every worker the daemon tracks, with its blocks per tier, epoch, next
//!   event id, when it was last heard from, whether it is stale and why, and its apply
//!   thread's queue; then the workers dropped lately for silence. Paged (`offset`, `limit`).
//! - `GET /v1/workers/{worker_id}/{dp_rank}/blocks`: that worker's blocks as a replay stream
//!   (docs/STREAM.md), parents first, then the blocks it holds past a hole. Paged.
//! - `POST /v1/lookup`: a lookup request as JSON (the fields of `LookupRequest`), answered as
//!   over NATS.
//!
//! In a sharded deployment, `/v1/workers` and `/v1/lookup` answer for the whole deployment:
//! they ask every shard over NATS (`{prefix}.inspect.workers`, `{prefix}.lookup`) and merge,
//! naming the shards that did not answer (`missing_shards`); `?local=true` shows this shard's
//! workers alone.
//!
//! With `inspect_token` set, every request needs `Authorization: Bearer <token>`.

use super::answer::{deployment_answer, NoAnswer};
use super::served::{Models, Served};
use super::workers::{deployment_workers, Page};
use axum::extract::{Path, Query, Request, State as Ctx};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use kvindex_client::protocol::{LookupRequest, LookupResponse};
use kvindex_core::hash::WorkerId;
use kvindex_core::index::{KvIndex, SavedBlock, SavedParent};
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What the handlers read: every model served (each with its NATS connection, over which a
/// sharded model's other shards are asked).
struct Inspect<I: KvIndex> {
    models: Arc<Models<I>>,
}

impl<I: KvIndex> Inspect<I> {
    /// The model a request names (`?model=`), or the only one; else a 404 that lists them.
    #[allow(clippy::result_large_err)] // The error is the response itself.
    fn model(&self, name: Option<&str>) -> Result<&Served<I>, Response> {
        self.models.pick(name).map_err(|why| error(StatusCode::NOT_FOUND, &why))
    }
}

/// `?model=`: which model a request is about (needed when the daemon serves several). Read
/// beside [`Page`], not flattened into it: a flattened query string reads numbers as strings.
#[derive(Deserialize)]
struct Which {
    model: Option<String>,
}

async fn workers<I: KvIndex>(Ctx(cx): Ctx<Arc<Inspect<I>>>, Query(page): Query<Page>, Query(which): Query<Which>) -> Response {
    let m = match cx.model(which.model.as_deref()) {
        Ok(m) => m,
        Err(resp) => return resp,
    };
    match deployment_workers(&m.state, &m.pool, &m.client, page).await {
        Ok(w) => Json(w).into_response(),
        Err((status, why)) => error(status, &why),
    }
}

/// One line of a worker's dump: a `stored` op of the replay stream, or a block held past a
/// hole (`hidden`), which no `stored` op can place: its parent is not held.
#[derive(Serialize)]
struct Line {
    op: &'static str,
    worker: u64,
    /// The worker's dp rank (the replay stream's `worker` carries only the id).
    dp_rank: u32,
    /// Consecutive from 0 over the dump, as the replay stream wants.
    event_id: u64,
    /// The parent's engine hash (`stored`; null: a root block).
    parent: Option<u64>,
    /// `[[local hash, engine hash]]`: one block.
    blocks: [[u64; 2]; 1],
    /// `host` or `disk`; absent for the device tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    tier: Option<&'static str>,
    /// `hidden`: the block's position.
    #[serde(skip_serializing_if = "Option::is_none")]
    pos: Option<u32>,
    /// `hidden`: the local hashes of the path to it, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<Vec<u64>>,
}

#[derive(Serialize)]
struct Dump {
    worker_id: u64,
    dp_rank: u32,
    /// The backend's key of each block: the local hash (runs) or the prefix hash (positional).
    backend: &'static str,
    total: usize,
    offset: usize,
    next: Option<usize>,
    ops: Vec<Line>,
}

/// A saved block as a dump line, `event_id` left for the caller.
fn line(w: WorkerId, tier: Option<&'static str>, b: &SavedBlock) -> Line {
    let (op, parent, pos, path) = match &b.parent {
        SavedParent::Root => ("stored", None, None, None),
        SavedParent::Block(p) => ("stored", Some(*p), None, None),
        SavedParent::Place(path) => ("hidden", None, Some(b.pos), Some(path.clone())),
        SavedParent::Loose => ("hidden", None, Some(b.pos), None),
    };
    Line { op, worker: w.worker_id, dp_rank: w.dp_rank, event_id: 0, parent, blocks: [[b.key, b.hash]], tier, pos, path }
}

async fn blocks<I: KvIndex>(
    Ctx(cx): Ctx<Arc<Inspect<I>>>,
    Path((worker_id, dp_rank)): Path<(u64, u32)>,
    Query(page): Query<Page>,
    Query(which): Query<Which>,
) -> Response {
    let m = match cx.model(which.model.as_deref()) {
        Ok(m) => m,
        Err(resp) => return resp,
    };
    let w = WorkerId::new(worker_id, dp_rank);
    let pool = m.pool.clone();
    let Ok(saved) = tokio::task::spawn_blocking(move || pool.save_worker(w)).await else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "the apply threads did not answer");
    };
    let Some(saved) = saved else {
        return error(StatusCode::NOT_FOUND, &format!("no worker {worker_id} rank {dp_rank}"));
    };
    // Parents first: saved blocks come by position; what cannot be stored (hidden) comes last.
    let tiers =
        [(None, Some(&saved.device)), (Some("host"), saved.tiers.host.as_ref()), (Some("disk"), saved.tiers.disk.as_ref())];
    let (mut placed, mut hidden) = (Vec::new(), Vec::new());
    for (tier, s) in tiers.into_iter().filter_map(|(t, s)| Some((t, s?))) {
        for b in &s.blocks {
            let l = line(w, tier, b);
            if l.op == "stored" {
                placed.push(l)
            } else {
                hidden.push(l)
            }
        }
    }
    placed.extend(hidden);
    let total = placed.len();
    let (range, next) = page.window(total);
    let offset = range.start;
    let ops: Vec<Line> = placed
        .into_iter()
        .enumerate()
        .skip(range.start)
        .take(range.len())
        .map(|(i, l)| Line { event_id: i as u64, ..l })
        .collect();
    Json(Dump { worker_id, dp_rank, backend: m.pool.model().device().name(), total, offset, next, ops }).into_response()
}

async fn lookup<I: KvIndex>(Ctx(cx): Ctx<Arc<Inspect<I>>>, Query(which): Query<Which>, body: axum::body::Bytes) -> Response {
    let m = match cx.model(which.model.as_deref()) {
        Ok(m) => m,
        Err(resp) => return resp,
    };
    let req = match serde_json::from_slice::<LookupRequest>(&body) {
        Ok(req) => req,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, Json(LookupResponse::Error { error: format!("not a lookup request: {e}") }))
                .into_response()
        }
    };
    match deployment_answer(&m.state, m.pool.model(), &m.client, req).await {
        Ok(resp) => (StatusCode::OK, Json(resp)).into_response(),
        Err(NoAnswer::Rejected(error)) => (StatusCode::BAD_REQUEST, Json(LookupResponse::Error { error })).into_response(),
        Err(NoAnswer::Unreachable(why)) => error(StatusCode::BAD_GATEWAY, &why),
    }
}

/// `{"error": why}` with `status`.
fn error(status: StatusCode, why: &str) -> Response {
    (status, Json(serde_json::json!({ "error": why }))).into_response()
}

/// Whether `req` carries `Authorization: Bearer <token>`, or no token is configured: the
/// inspect and query APIs' one check.
pub(super) fn bearer_ok(req: &Request, token: Option<&str>) -> bool {
    let given = || req.headers().get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ");
    token.is_none_or(|t| given() == Some(t))
}

/// Requires the bearer token, when one is configured.
async fn authorize(Ctx(token): Ctx<Option<Arc<str>>>, req: Request, next: Next) -> Response {
    if !bearer_ok(&req, token.as_deref()) {
        return error(StatusCode::UNAUTHORIZED, "this inspect API needs its bearer token (inspect_token)");
    }
    next.run(req).await
}

/// Serves the inspect API on `listener` until the process ends.
pub(super) async fn inspect_server<I: KvIndex>(listener: tokio::net::TcpListener, models: Arc<Models<I>>, token: Option<String>) {
    let token: Option<Arc<str>> = token.as_deref().map(Arc::from);
    let cx = Arc::new(Inspect { models });
    let app = axum::Router::new()
        .route("/v1/workers", get(workers::<I>))
        .route("/v1/workers/{worker_id}/{dp_rank}/blocks", get(blocks::<I>))
        .route("/v1/lookup", post(lookup::<I>))
        .with_state(cx)
        .layer(axum::middleware::from_fn_with_state(token, authorize));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("inspect server stopped: {e}");
    }
}
