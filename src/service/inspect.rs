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
use super::State;
use crate::apply::ApplyPool;
use axum::extract::{Path, Query, Request, State as Ctx};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use kvindex_client::protocol::{LookupRequest, LookupResponse, ShardOf};
use kvindex_client::shards;
use kvindex_core::hash::WorkerId;
use kvindex_core::index::{KvIndex, SavedBlock, SavedParent};
use kvindex_core::names::WorkerInfo;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Entries a page holds unless the request asks for fewer, and at most.
const PAGE: usize = 1000;
const PAGE_MAX: usize = 10_000;

/// What the handlers read.
struct Inspect<I: KvIndex> {
    state: Arc<State>,
    pool: Arc<ApplyPool<I>>,
    /// The daemon's NATS connection: a sharded deployment's other shards are asked over it.
    client: async_nats::Client,
}

/// How long the inspect API waits for the other shards.
const SHARDS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// `offset` and `limit` of a paged request; `local`: this shard alone.
#[derive(Clone, Copy, Deserialize, Serialize)]
struct Page {
    #[serde(default)]
    offset: usize,
    limit: Option<usize>,
    #[serde(default)]
    local: bool,
}

impl Page {
    /// The slice of `total` entries this page holds, and the offset of the next page.
    fn window(&self, total: usize) -> (std::ops::Range<usize>, Option<usize>) {
        let limit = self.limit.unwrap_or(PAGE).clamp(1, PAGE_MAX);
        let start = self.offset.min(total);
        let end = start.saturating_add(limit).min(total);
        (start..end, (end < total).then_some(end))
    }
}

/// A worker's blocks per tier, in a hybrid model's other groups, and those routers announced
/// for it that its events have not shown yet.
#[derive(Serialize, Deserialize)]
struct Blocks {
    device: u64,
    host: u64,
    disk: u64,
    /// Blocks held in a hybrid model's KV-cache groups other than the primary one (one per
    /// group holding it); 0 for other models.
    groups: u64,
    predicted: u64,
}

/// Why a worker is stale.
#[derive(Serialize, Deserialize)]
struct Stale {
    /// `event_gap`, `midstream`, `snapshot_in_progress`, `unplaceable`, `over_limit`,
    /// `slow_consumer`, `stale_in_snapshot` or `incomplete` (OPERATIONS.md, "Looking inside",
    /// says what each means; TROUBLESHOOTING.md what to do).
    reason: std::borrow::Cow<'static, str>,
    /// Milliseconds since it went stale.
    since_ms: u64,
    /// Resync requests sent to it since.
    resync_requests: u32,
}

/// One worker, as `GET /v1/workers` shows it.
#[derive(Serialize, Deserialize)]
struct Worker {
    worker_id: u64,
    dp_rank: u32,
    /// What its publisher says it is (name, URL, model, block size), if it said.
    #[serde(flatten)]
    info: Option<WorkerInfo>,
    blocks: Blocks,
    epoch: u64,
    /// The event id expected next (none until its first event of the epoch).
    next_event_id: Option<u64>,
    /// Milliseconds since its last batch (events or heartbeat).
    last_heard_ms: u64,
    /// Present while its answers may be out of date.
    stale: Option<Stale>,
    /// Batches waiting in its apply thread's queue.
    queued: usize,
}

/// A worker dropped for silence past `worker_ttl`.
#[derive(Serialize, Deserialize)]
struct Expired {
    worker_id: u64,
    dp_rank: u32,
    /// Milliseconds since it was dropped.
    ago_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct Workers {
    total: usize,
    offset: usize,
    next: Option<usize>,
    workers: Vec<Worker>,
    /// The workers dropped lately for silence, the newest first.
    expired: Vec<Expired>,
    /// In a sharded deployment: the shards whose workers are missing (they did not answer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    missing_shards: Vec<u32>,
}

fn ms(since: Instant, now: Instant) -> u64 {
    now.saturating_duration_since(since).as_millis() as u64
}

async fn workers<I: KvIndex>(Ctx(cx): Ctx<Arc<Inspect<I>>>, Query(page): Query<Page>) -> Response {
    if cx.state.cfg.shard_of().is_some() && !page.local {
        return match gather_workers(&cx.client, &cx.state.cfg.prefix, page).await {
            Ok(w) => Json(w).into_response(),
            Err(why) => error(StatusCode::BAD_GATEWAY, &why),
        };
    }
    match local_workers(&cx.state, &cx.pool, page).await {
        Some(w) => Json(w).into_response(),
        None => error(StatusCode::INTERNAL_SERVER_ERROR, "the apply threads did not answer"),
    }
}

/// This daemon's workers, a page of them.
async fn local_workers<I: KvIndex>(state: &Arc<State>, pool: &Arc<ApplyPool<I>>, page: Page) -> Option<Workers> {
    let cx = LocalView { state, pool };
    cx.workers(page).await
}

/// What a shard's own view of its workers reads.
struct LocalView<'a, I: KvIndex> {
    state: &'a Arc<State>,
    pool: &'a Arc<ApplyPool<I>>,
}

impl<I: KvIndex> LocalView<'_, I> {
    async fn workers(&self, page: Page) -> Option<Workers> {
        let cx = self;
        let pool = cx.pool.clone();
        let held = tokio::task::spawn_blocking(move || pool.held()).await.ok()?;
        let held: std::collections::HashMap<WorkerId, _> = held.into_iter().map(|h| (h.worker, h)).collect();
        let mut tracked = cx.state.cursors.lock().view();
        tracked.sort_unstable_by_key(|t| t.0);
        let now = Instant::now();
        let (range, next) = page.window(tracked.len());
        let workers = tracked[range]
            .iter()
            .map(|&(w, epoch, next_id, last)| {
                let h = held.get(&w);
                Worker {
                    worker_id: w.worker_id,
                    dp_rank: w.dp_rank,
                    info: cx.state.names.get(&w.worker_id).map(|i| i.value().as_ref().clone()),
                    blocks: Blocks {
                        device: h.map_or(0, |h| h.device),
                        host: h.map_or(0, |h| h.host),
                        disk: h.map_or(0, |h| h.disk),
                        groups: h.map_or(0, |h| h.grouped),
                        predicted: h.map_or(0, |h| h.predicted),
                    },
                    epoch,
                    next_event_id: next_id,
                    last_heard_ms: ms(last, now),
                    stale: cx.state.stale.get(&w).map(|r| Stale {
                        reason: r.reason.into(),
                        since_ms: ms(r.since, now),
                        resync_requests: r.attempts,
                    }),
                    queued: h.map_or(0, |h| h.queued),
                }
            })
            .collect();
        let expired = cx
            .state
            .expired
            .lock()
            .iter()
            .rev()
            .map(|&(w, at)| Expired { worker_id: w.worker_id, dp_rank: w.dp_rank, ago_ms: ms(at, now) })
            .collect();
        Some(Workers {
            total: tracked.len(),
            offset: page.offset.min(tracked.len()),
            next,
            workers,
            expired,
            missing_shards: Vec::new(),
        })
    }
}

/// Workers a gathered page may ask each shard for: its first `offset + limit`.
const GATHER_MAX: usize = 2000;

/// Every shard's workers, merged by worker: each shard is asked for its first `offset + limit`
/// (sorted by worker), so the merged page is exact.
async fn gather_workers(client: &async_nats::Client, prefix: &str, page: Page) -> Result<Workers, String> {
    let limit = page.limit.unwrap_or(PAGE).clamp(1, GATHER_MAX);
    let upto = Page { offset: 0, limit: Some(page.offset.saturating_add(limit).min(GATHER_MAX)), local: true };
    let body = serde_json::to_vec(&upto).map_err(|e| e.to_string())?;
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.map_err(|e| e.to_string())?;
    client.publish_with_reply(format!("{prefix}.inspect.workers"), inbox, body.into()).await.map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + SHARDS_WAIT;
    // Each list with the shard count its shard runs under: lists of two counts (while the
    // count changes) are never joined.
    let mut lists: Vec<(ShardOf, Workers)> = Vec::new();
    while lists.last().is_none_or(|(of, _)| shards::answered(&lists, of.shards) < of.shards) {
        use futures::StreamExt;
        let Ok(Some(msg)) = tokio::time::timeout_at(deadline, replies.next()).await else { break };
        if let Ok(r) = serde_json::from_slice::<ShardWorkers>(&msg.payload) {
            lists.push((ShardOf { shard: r.shard, shards: r.shards.max(1) }, r.workers));
        }
    }
    let _ = replies.unsubscribe().await;
    let Some((shards, got)) = shards::one_count(lists) else {
        return Err("no shard answered on {prefix}.inspect.workers".into());
    };
    let missing_shards = (0..shards).filter(|k| !got.iter().any(|(s, _)| s == k)).collect();
    let total = got.iter().map(|(_, w)| w.total).sum();
    let mut all: Vec<Worker> = Vec::new();
    let mut expired: Vec<Expired> = Vec::new();
    for (_, w) in got {
        all.extend(w.workers);
        expired.extend(w.expired);
    }
    all.sort_unstable_by_key(|w| (w.worker_id, w.dp_rank));
    let start = page.offset.min(all.len());
    let workers: Vec<Worker> = all.drain(start..).take(limit).collect();
    let next = (start + workers.len() < total).then_some(start + workers.len());
    expired.sort_unstable_by_key(|e| e.ago_ms);
    Ok(Workers { total, offset: start, next, workers, expired, missing_shards })
}

/// A shard's answer on `{prefix}.inspect.workers`.
#[derive(Serialize, Deserialize)]
struct ShardWorkers {
    shard: u32,
    shards: u32,
    workers: Workers,
}

/// Answers `{prefix}.inspect.workers` for this shard (one replica of each shard answers each
/// request), so that any replica's inspect API can show the whole deployment.
pub(super) async fn workers_responder<I: KvIndex>(client: async_nats::Client, state: Arc<State>, pool: Arc<ApplyPool<I>>) {
    use futures::StreamExt;
    let Some(of) = state.cfg.shard_of() else { return };
    let subject = format!("{}.inspect.workers", state.cfg.prefix);
    let mut sub = match client.queue_subscribe(subject.clone(), format!("kvindex-shard-{}", of.shard)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot subscribe to {subject}: {e}; other replicas cannot list this shard's workers");
            return;
        }
    };
    while let Some(msg) = sub.next().await {
        let Some(reply) = msg.reply else { continue };
        let page = serde_json::from_slice::<Page>(&msg.payload).unwrap_or(Page { offset: 0, limit: None, local: true });
        let Some(workers) = local_workers(&state, &pool, page).await else { continue };
        let answer = ShardWorkers { shard: of.shard, shards: of.shards, workers };
        if let Ok(body) = serde_json::to_vec(&answer) {
            let _ = client.publish(reply, body.into()).await;
        }
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
) -> Response {
    let w = WorkerId::new(worker_id, dp_rank);
    let pool = cx.pool.clone();
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
    Json(Dump { worker_id, dp_rank, backend: cx.pool.model().device().name(), total, offset, next, ops }).into_response()
}

async fn lookup<I: KvIndex>(Ctx(cx): Ctx<Arc<Inspect<I>>>, body: axum::body::Bytes) -> Response {
    let req = match serde_json::from_slice::<LookupRequest>(&body) {
        Ok(req) => req,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, Json(LookupResponse::Error { error: format!("not a lookup request: {e}") }))
                .into_response()
        }
    };
    match deployment_answer(&cx.state, cx.pool.model(), &cx.client, req).await {
        Ok(resp) => (StatusCode::OK, Json(resp)).into_response(),
        Err(NoAnswer::Rejected(error)) => (StatusCode::BAD_REQUEST, Json(LookupResponse::Error { error })).into_response(),
        Err(NoAnswer::Unreachable(why)) => error(StatusCode::BAD_GATEWAY, &why),
    }
}

/// `{"error": why}` with `status`.
fn error(status: StatusCode, why: &str) -> Response {
    (status, Json(serde_json::json!({ "error": why }))).into_response()
}

/// Requires the bearer token, when one is configured.
async fn authorize(Ctx(token): Ctx<Option<Arc<str>>>, req: Request, next: Next) -> Response {
    if let Some(token) = token {
        let given =
            req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(&*token) {
            return error(StatusCode::UNAUTHORIZED, "this inspect API needs its bearer token (inspect_token)");
        }
    }
    next.run(req).await
}

/// Serves the inspect API on `listener` until the process ends.
pub(super) async fn inspect_server<I: KvIndex>(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    pool: Arc<ApplyPool<I>>,
    client: async_nats::Client,
) {
    let token: Option<Arc<str>> = state.cfg.inspect_token.as_deref().map(Arc::from);
    let cx = Arc::new(Inspect { state, pool, client });
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
