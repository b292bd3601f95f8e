//! The workers a model tracks, as the inspect API and the query API list them: a page of this
//! shard's (each worker's blocks per tier, epoch, cursor, staleness, queue), or of the whole
//! sharded deployment, every shard asked on `{prefix}.inspect.workers` and the pages merged.

use super::answer::SHARDS_WAIT;
use super::State;
use crate::apply::ApplyPool;
use axum::http::StatusCode;
use kvindex_client::protocol::ShardOf;
use kvindex_client::shards;
use kvindex_core::hash::WorkerId;
use kvindex_core::index::KvIndex;
use kvindex_core::names::WorkerInfo;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// Entries a page holds unless the request asks for fewer, and at most.
const PAGE: usize = 1000;
pub(super) const PAGE_MAX: usize = 10_000;

/// `offset` and `limit` of a paged request; `local`: this shard alone.
#[derive(Clone, Copy, Deserialize, Serialize)]
pub(super) struct Page {
    #[serde(default)]
    pub(super) offset: usize,
    pub(super) limit: Option<usize>,
    #[serde(default)]
    pub(super) local: bool,
}

impl Page {
    /// The slice of `total` entries this page holds, and the offset of the next page.
    pub(super) fn window(&self, total: usize) -> (std::ops::Range<usize>, Option<usize>) {
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
    /// The digest of its device blocks, `[blocks, sum]` as publishers send it: two replicas
    /// that hold the worker alike show the same.
    digest: [u64; 2],
    /// The digests of its host and disk blocks, where this replica keeps those tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tier_digests: Option<[[u64; 2]; 2]>,
    /// The digest of a hybrid model's other groups' blocks, where every one is placed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    group_digest: Option<[u64; 2]>,
}

/// Why a worker is stale.
#[derive(Serialize, Deserialize)]
pub(super) struct Stale {
    /// `event_gap`, `midstream`, `snapshot_in_progress`, `unplaceable`, `over_limit`,
    /// `snapshot_too_large`, `drift`, `slow_consumer`, `stale_in_snapshot` or `incomplete`
    /// (OPERATIONS.md, "Looking inside", says what each means; TROUBLESHOOTING.md what to do).
    pub(super) reason: std::borrow::Cow<'static, str>,
    /// Milliseconds since it went stale.
    since_ms: u64,
    /// Resync requests sent to it since.
    resync_requests: u32,
}

/// One worker, as `GET /v1/workers` shows it.
#[derive(Serialize, Deserialize)]
pub(super) struct Worker {
    pub(super) worker_id: u64,
    pub(super) dp_rank: u32,
    /// What its publisher says it is (name, URL, model, block size), if it said.
    #[serde(flatten)]
    pub(super) info: Option<WorkerInfo>,
    blocks: Blocks,
    epoch: u64,
    /// The event id expected next (none until its first event of the epoch).
    next_event_id: Option<u64>,
    /// Milliseconds since its last batch (events or heartbeat).
    last_heard_ms: u64,
    /// Present while its answers may be out of date.
    pub(super) stale: Option<Stale>,
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

/// A page of workers, as `GET /v1/workers` shows it.
#[derive(Serialize, Deserialize)]
pub(super) struct Workers {
    total: usize,
    offset: usize,
    pub(super) next: Option<usize>,
    pub(super) workers: Vec<Worker>,
    /// The workers dropped lately for silence, the newest first.
    expired: Vec<Expired>,
    /// In a sharded deployment: the shards whose workers are missing (they did not answer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) missing_shards: Vec<u32>,
}

fn ms(since: Instant, now: Instant) -> u64 {
    now.saturating_duration_since(since).as_millis() as u64
}

/// A page of a model's workers: every shard's, merged (asked over `client`), unless it is not
/// sharded or the page asks for this shard's alone.
pub(super) async fn deployment_workers<I: KvIndex>(
    state: &Arc<State>,
    pool: &Arc<ApplyPool<I>>,
    client: &async_nats::Client,
    page: Page,
) -> Result<Workers, (StatusCode, String)> {
    if state.cfg.shard_of().is_some() && !page.local {
        return gather_workers(client, &state.cfg.prefix, page).await.map_err(|why| (StatusCode::BAD_GATEWAY, why));
    }
    local_workers(state, pool, page)
        .await
        .ok_or((StatusCode::INTERNAL_SERVER_ERROR, "the apply threads did not answer".to_string()))
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
                        digest: h.map_or([0, 0], |h| pair(h.digests.device)),
                        tier_digests: h.and_then(|h| h.digests.tiers).map(|t| t.map(pair)),
                        group_digest: h.and_then(|h| h.digests.groups).map(pair),
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
    let mut sub = match client.queue_subscribe(subject.clone(), state.cfg.lookup_group()).await {
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

/// A digest as `[blocks, sum]`, as publishers send it.
fn pair(d: kvindex_core::digest::Digest) -> [u64; 2] {
    [d.blocks, d.sum]
}
