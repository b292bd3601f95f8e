//! The query API for routers: JSON over HTTP on `query_addr`, in the shape of NVIDIA Dynamo's
//! standalone KV indexer and Mooncake's KV-store indexer API (RFC #1403), so that a router
//! written against either asks kvindex unchanged.
//!
//! - `POST /query` `{token_ids, model_name, lora_name?, cache_salt?}`: hashed here with the
//!   model's block size;
//! - `POST /query_by_hash` `{block_hashes, model_name}`: local hashes (XXH3-64, seed 1337);
//! - `GET /workers[?model_name=]`: every worker, with its name, URL and ranks;
//! - `GET /health`: 200 while every model answers lookups, else 503 with why.
//!
//! An answer keeps Dynamo's flat `scores` (`{worker: {dp_rank: tokens}}`) and `frequencies`,
//! and its `instances` (`{worker: {longest_matched, gpu, dp, cpu, disk}}`, in tokens), with
//! kvindex's own fields beside them: each instance's `name`, `url`, `stale`, `predicted`,
//! `approximate`; `stale_workers`, `missing_shards`; the grouped answer when asked. It is the
//! answer NATS gives, from the same path. Every refusal is a 4xx with `{"error": why}`,
//! counted in `kvindex_query_rejected_total{reason}`.

use super::answer::{deployment_answer, NoAnswer};
use super::inspect::bearer_ok;
use super::served::{Models, Served};
use super::workers::{deployment_workers, Page, PAGE_MAX};
use crate::config::{Config, DEFAULT_MODEL};
use axum::extract::{Query, Request, State as Ctx};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use kvindex_client::protocol::{any_int_hashes, LookupRequest, LookupResponse, MatchGroup, NamedWorker, WorkerRef};
use kvindex_core::index::KvIndex;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// Why a query API request was refused: the label of `kvindex_query_rejected_total`.
const REASONS: [&str; 9] = [
    "unauthorized",
    "body_too_large",
    "malformed_json",
    "too_many_tokens",
    "unknown_model",
    "no_block_size",
    "bad_request",
    "not_found",
    "unavailable",
];

/// The query API's own metrics, beside every model's.
pub(super) struct QueryMetrics {
    /// Where they are registered, for rendering with the models'.
    pub(super) registry: Registry,
    /// `kvindex_query_requests_total{endpoint,result}`: `ok`, `rejected` (4xx) or `failed` (5xx).
    requests: IntCounterVec,
    /// `kvindex_query_rejected_total{reason}`.
    rejected: IntCounterVec,
    /// `kvindex_query_duration_seconds{endpoint}`: request read to answer written.
    duration: HistogramVec,
}

impl QueryMetrics {
    pub(super) fn new() -> QueryMetrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("kvindex_query_requests_total", "Query API requests, by endpoint and result (ok, rejected, failed)."),
            &["endpoint", "result"],
        )
        .expect("valid metric");
        let rejected = IntCounterVec::new(
            Opts::new("kvindex_query_rejected_total", "Query API requests refused with a 4xx, by reason."),
            &["reason"],
        )
        .expect("valid metric");
        let buckets = vec![25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0];
        let duration = HistogramVec::new(
            HistogramOpts::new("kvindex_query_duration_seconds", "Query API answers, request read to answer written.")
                .buckets(buckets),
            &["endpoint"],
        )
        .expect("valid metric");
        for m in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(rejected.clone()),
            Box::new(duration.clone()),
        ] {
            registry.register(m).expect("unique metric");
        }
        for reason in REASONS {
            rejected.with_label_values(&[reason]);
        }
        QueryMetrics { registry, requests, rejected, duration }
    }
}

/// What the handlers read.
struct Api<I: KvIndex> {
    models: Arc<Models<I>>,
    metrics: Arc<QueryMetrics>,
    /// The bearer token every request needs, if configured.
    token: Option<String>,
    /// The largest body read.
    max_body: usize,
    /// Most token ids or hashes per request.
    max_tokens: usize,
}

/// A refusal or failure: its status, its metric reason (refusals), and what the caller reads.
struct Refused {
    status: StatusCode,
    reason: &'static str,
    why: String,
}

fn refused(status: StatusCode, reason: &'static str, why: impl Into<String>) -> Refused {
    Refused { status, reason, why: why.into() }
}

/// The body of `/query` and `/query_by_hash`: Dynamo's fields, and kvindex's own.
#[derive(Deserialize)]
struct Body {
    /// `/query`: the request's token ids.
    token_ids: Option<Vec<u32>>,
    /// `/query_by_hash`: its blocks' local hashes (signed, as Dynamo sends them, or unsigned).
    #[serde(default, deserialize_with = "any_int_hashes")]
    block_hashes: Option<Vec<u64>>,
    /// The model asked about (any, for a daemon serving one model without a model table).
    model_name: Option<String>,
    /// `/query`: the LoRA adapter the request runs under.
    lora_name: Option<String>,
    /// `/query`: the request's cache salt.
    cache_salt: Option<String>,
    /// `/query`: tokens per block, over the model's.
    block_size: Option<u32>,
    /// Only these worker ids.
    workers: Option<Vec<u64>>,
    /// At most this many matches, the deepest.
    max_matches: Option<u32>,
    /// Also answer in `groups`, the workers with one answer together.
    #[serde(default)]
    grouped: bool,
}

/// One worker's match, as Mooncake's RFC and Dynamo count it (tokens), with kvindex's flags.
#[derive(Default, Serialize, Deserialize, PartialEq, Debug)]
struct Instance {
    longest_matched: u64,
    /// The deepest device match of its ranks.
    gpu: u64,
    /// Each rank's device match.
    dp: BTreeMap<String, u64>,
    /// The deepest match on device or host.
    cpu: u64,
    /// The deepest match on device, host or disk.
    disk: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    /// One of its ranks is being resynchronised: its match may be out of date.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    stale: bool,
    /// The prefix routers announced for it, where that reaches past what it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    predicted: Option<u64>,
    /// A routed-only worker: its match is what routers announced.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    approximate: bool,
}

/// The answer of `/query` and `/query_by_hash`.
#[derive(Serialize)]
struct Scores {
    /// `{worker_id: {dp_rank: tokens}}`, device matches only (Dynamo's flat form).
    scores: BTreeMap<String, BTreeMap<String, u64>>,
    /// How many (worker, rank) pairs match each block of the request, from the first.
    frequencies: Vec<usize>,
    /// Per worker: its match per tier and rank, in tokens, and kvindex's flags.
    instances: BTreeMap<String, Instance>,
    /// The model that answered, and the block size its tokens are counted in.
    model_name: String,
    block_size: u32,
    /// Stale workers that match nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    stale_workers: Vec<WorkerRef>,
    /// Shards that did not answer: their workers are missing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    missing_shards: Vec<u32>,
    /// The grouped answer, when asked (`grouped`).
    #[serde(skip_serializing_if = "Option::is_none")]
    groups: Option<Vec<MatchGroup>>,
}

impl Scores {
    /// The answer's groups in Dynamo's and Mooncake's shapes, in tokens of `block_size`.
    fn of(groups: Vec<MatchGroup>, names: &[NamedWorker], model_name: String, block_size: u32, keep_groups: bool) -> Scores {
        let bs = block_size as u64;
        let mut scores: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        let mut instances: BTreeMap<String, Instance> = BTreeMap::new();
        let deepest = groups.iter().map(|g| g.blocks).max().unwrap_or(0) as usize;
        let mut frequencies = vec![0usize; deepest];
        for g in &groups {
            let device = g.blocks as u64 * bs;
            let host = g.tiers.host.map_or(0, |h| h as u64 * bs).max(device);
            let disk = g.tiers.disk.map_or(0, |d| d as u64 * bs).max(host);
            for f in &mut frequencies[..g.blocks as usize] {
                *f += g.workers.len();
            }
            for w in &g.workers {
                let key = w.0.to_string();
                if g.blocks > 0 {
                    scores.entry(key.clone()).or_default().insert(w.1.to_string(), device);
                }
                let i = instances.entry(key).or_default();
                i.dp.insert(w.1.to_string(), device);
                i.gpu = i.gpu.max(device);
                i.cpu = i.cpu.max(host);
                i.disk = i.disk.max(disk);
                i.longest_matched = i.disk;
                i.stale |= g.stale;
                i.approximate |= g.approximate;
                if let Some(p) = g.predicted_blocks {
                    i.predicted = Some(i.predicted.unwrap_or(0).max(p as u64 * bs));
                }
            }
        }
        for n in names {
            if let Some(i) = instances.get_mut(&n.worker_id.to_string()) {
                i.name = Some(n.info.name.clone());
                i.url = n.info.url.clone();
            }
        }
        Scores {
            scores,
            frequencies,
            instances,
            model_name,
            block_size,
            stale_workers: Vec::new(),
            missing_shards: Vec::new(),
            groups: keep_groups.then_some(groups),
        }
    }
}

impl<I: KvIndex> Api<I> {
    /// The model a request names. A daemon without a model table answers any name with its
    /// one model; with a table, the name must be one of it.
    fn model(&self, name: Option<&str>) -> Result<&Served<I>, Refused> {
        match &self.models.0[..] {
            [only] if only.name == DEFAULT_MODEL => Ok(only),
            _ => self.models.pick(name).map_err(|why| refused(StatusCode::NOT_FOUND, "unknown_model", why)),
        }
    }

    /// Reads and parses a body, within the bounds.
    async fn body(&self, req: Request) -> Result<Body, Refused> {
        let bytes = axum::body::to_bytes(req.into_body(), self.max_body).await.map_err(|_| {
            refused(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("the body is over {} bytes (query_max_body)", self.max_body),
            )
        })?;
        let body: Body = serde_json::from_slice(&bytes)
            .map_err(|e| refused(StatusCode::BAD_REQUEST, "malformed_json", format!("not a query: {e}")))?;
        let n = body.token_ids.as_ref().map_or(0, Vec::len).max(body.block_hashes.as_ref().map_or(0, Vec::len));
        if n > self.max_tokens {
            let why = format!("{n} tokens or hashes, over {} (query_max_tokens)", self.max_tokens);
            return Err(refused(StatusCode::PAYLOAD_TOO_LARGE, "too_many_tokens", why));
        }
        Ok(body)
    }

    /// The answer to `/query` (`by_hash` false) or `/query_by_hash`.
    async fn query(&self, req: Request, by_hash: bool) -> Result<Scores, Refused> {
        let body = self.body(req).await?;
        let m = self.model(body.model_name.as_deref())?;
        let bad = |why: &str| refused(StatusCode::BAD_REQUEST, "bad_request", why);
        let mut lookup = LookupRequest {
            workers: body.workers,
            max_matches: body.max_matches,
            grouped: true,
            names: true,
            tiers: m.pool.model().tiers().is_some().then(|| ["device", "host", "disk"].map(String::from).to_vec()),
            ..LookupRequest::default()
        };
        if by_hash {
            if body.cache_salt.is_some() || body.lora_name.is_some() {
                return Err(bad(
                    "/query_by_hash takes hashes made with the salt and adapter already: drop cache_salt and lora_name",
                ));
            }
            lookup.block_hashes = Some(body.block_hashes.ok_or_else(|| bad("/query_by_hash needs block_hashes"))?);
        } else {
            lookup.tokens = Some(body.token_ids.ok_or_else(|| bad("/query needs token_ids"))?);
            lookup.lora_name = body.lora_name.filter(|l| !l.is_empty());
            lookup.salt = body.cache_salt;
        }
        // Both count the answer in tokens; `/query` hashes with it too.
        let block_size = block_size(m, body.block_size)?;
        if !by_hash {
            lookup.block_size = Some(block_size);
        }
        match deployment_answer(&m.state, m.pool.model(), &m.client, lookup).await {
            Ok(LookupResponse::Matches { groups, stale_workers, missing_shards, names, .. }) => {
                let mut scores = Scores::of(groups, &names, m.name.clone(), block_size, body.grouped);
                scores.stale_workers = stale_workers;
                scores.missing_shards = missing_shards;
                Ok(scores)
            }
            Ok(LookupResponse::Error { error }) | Err(NoAnswer::Rejected(error)) => Err(bad(&error)),
            Err(NoAnswer::Unreachable(why)) => Err(refused(StatusCode::BAD_GATEWAY, "", why)),
        }
    }
}

/// The block size `/query` hashes with: the request's, the model's, or the one its named
/// workers announce (when they agree).
fn block_size<I: KvIndex>(m: &Served<I>, asked: Option<u32>) -> Result<u32, Refused> {
    if let Some(bs) = asked.filter(|&b| b > 0).or(m.state.cfg.block_size) {
        return Ok(bs);
    }
    let mut announced: Vec<u32> = m.state.names.iter().filter_map(|n| n.value().block_size).collect();
    announced.sort_unstable();
    announced.dedup();
    match announced[..] {
        [one] => Ok(one),
        [] => Err(refused(
            StatusCode::BAD_REQUEST,
            "no_block_size",
            format!("model {:?} has no block size: set block_size, or name its workers with theirs (--block-size)", m.name),
        )),
        _ => Err(refused(
            StatusCode::BAD_REQUEST,
            "no_block_size",
            format!("model {:?}'s workers announce block sizes {announced:?}: set block_size", m.name),
        )),
    }
}

/// One worker as `/workers` lists it.
#[derive(Serialize)]
struct Listed {
    instance_id: u64,
    model_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<String>,
    /// The model its engine says it serves.
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    block_size: Option<u32>,
    dp_ranks: Vec<u32>,
    /// Its ranks being resynchronised.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    stale_ranks: Vec<u32>,
}

/// `?model_name=` of `/workers`.
#[derive(Deserialize)]
struct WorkersOf {
    model_name: Option<String>,
}

impl<I: KvIndex> Api<I> {
    /// Every worker of the models asked about (all of them without a name), each once with
    /// its ranks.
    async fn workers(&self, model_name: Option<&str>) -> Result<Vec<Listed>, Refused> {
        let models: Vec<&Served<I>> = match model_name {
            Some(name) => vec![self.model(Some(name))?],
            None => self.models.0.iter().collect(),
        };
        let mut out: Vec<Listed> = Vec::new();
        for m in models {
            let mut page = Page { offset: 0, limit: Some(PAGE_MAX), local: false };
            loop {
                let got = deployment_workers(&m.state, &m.pool, &m.client, page)
                    .await
                    .map_err(|(status, why)| refused(status, "", why))?;
                // Pages come by (worker, rank): a worker's ranks are consecutive.
                for w in got.workers {
                    let stale = w.stale.is_some();
                    match out.last_mut().filter(|l| l.instance_id == w.worker_id && l.model_name == m.name) {
                        Some(l) => {
                            l.dp_ranks.push(w.dp_rank);
                            if stale {
                                l.stale_ranks.push(w.dp_rank);
                            }
                        }
                        None => {
                            let info = w.info.unwrap_or_default();
                            out.push(Listed {
                                instance_id: w.worker_id,
                                model_name: m.name.clone(),
                                name: Some(info.name).filter(|n| !n.is_empty()),
                                url: info.url,
                                engine_model: info.model,
                                block_size: info.block_size,
                                dp_ranks: vec![w.dp_rank],
                                stale_ranks: if stale { vec![w.dp_rank] } else { Vec::new() },
                            });
                        }
                    }
                }
                match got.next {
                    Some(next) if next > page.offset => page.offset = next,
                    _ => break,
                }
            }
        }
        Ok(out)
    }
}

/// Counts a request's outcome and turns it into a response.
fn answered<T: Serialize>(api: &QueryMetrics, endpoint: &str, started: Instant, outcome: Result<T, Refused>) -> Response {
    api.duration.with_label_values(&[endpoint]).observe(started.elapsed().as_secs_f64());
    match outcome {
        Ok(body) => {
            api.requests.with_label_values(&[endpoint, "ok"]).inc();
            (StatusCode::OK, Json(body)).into_response()
        }
        Err(r) => {
            let result = if r.status.is_client_error() { "rejected" } else { "failed" };
            api.requests.with_label_values(&[endpoint, result]).inc();
            if r.status.is_client_error() {
                api.rejected.with_label_values(&[r.reason]).inc();
            }
            (r.status, Json(serde_json::json!({ "error": r.why }))).into_response()
        }
    }
}

impl<I: KvIndex> Api<I> {
    /// The request, if its bearer token is the one configured (or none is).
    fn authorized(&self, req: &Request) -> Result<(), Refused> {
        match bearer_ok(req, self.token.as_deref()) {
            true => Ok(()),
            false => {
                Err(refused(StatusCode::UNAUTHORIZED, "unauthorized", "this query API needs its bearer token (query_token)"))
            }
        }
    }
}

async fn query<I: KvIndex>(Ctx(api): Ctx<Arc<Api<I>>>, req: Request) -> Response {
    let started = Instant::now();
    let outcome = match api.authorized(&req) {
        Ok(()) => api.query(req, false).await,
        Err(r) => Err(r),
    };
    answered(&api.metrics, "query", started, outcome)
}

async fn query_by_hash<I: KvIndex>(Ctx(api): Ctx<Arc<Api<I>>>, req: Request) -> Response {
    let started = Instant::now();
    let outcome = match api.authorized(&req) {
        Ok(()) => api.query(req, true).await,
        Err(r) => Err(r),
    };
    answered(&api.metrics, "query_by_hash", started, outcome)
}

async fn workers<I: KvIndex>(Ctx(api): Ctx<Arc<Api<I>>>, Query(of): Query<WorkersOf>, req: Request) -> Response {
    let started = Instant::now();
    let outcome = match api.authorized(&req) {
        Ok(()) => api.workers(of.model_name.as_deref()).await,
        Err(r) => Err(r),
    };
    answered(&api.metrics, "workers", started, outcome)
}

async fn health<I: KvIndex>(Ctx(api): Ctx<Arc<Api<I>>>) -> Response {
    match api.models.ready().and_then(|_| api.models.alive()) {
        Ok(()) => (StatusCode::OK, Json(serde_json::json!({ "status": "ok" }))).into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({ "status": "unavailable", "reason": why.trim() })))
            .into_response(),
    }
}

async fn not_found<I: KvIndex>(Ctx(api): Ctx<Arc<Api<I>>>, req: Request) -> Response {
    let why = format!(
        "no {} {} here: the query API serves POST /query, POST /query_by_hash, GET /workers, GET /health",
        req.method(),
        req.uri().path()
    );
    answered::<()>(&api.metrics, "other", Instant::now(), Err(refused(StatusCode::NOT_FOUND, "not_found", why)))
}

/// Serves the query API on `listener` until the process ends.
pub(super) async fn query_server<I: KvIndex>(
    listener: tokio::net::TcpListener,
    models: Arc<Models<I>>,
    cfg: Config,
    metrics: Arc<QueryMetrics>,
) {
    let api = Arc::new(Api {
        models,
        metrics,
        token: cfg.query_token.clone(),
        max_body: cfg.query_max_body,
        max_tokens: cfg.query_max_tokens,
    });
    let app = axum::Router::new()
        .route("/query", post(query::<I>))
        .route("/query_by_hash", post(query_by_hash::<I>))
        .route("/workers", get(workers::<I>))
        .route("/health", get(health::<I>))
        .fallback(not_found::<I>)
        .with_state(api);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("query server stopped: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvindex_client::protocol::{TierDepths, WorkerPair};
    use kvindex_core::names::WorkerInfo;

    #[test]
    fn an_answer_is_counted_in_tokens_as_dynamo_counts_it() {
        let groups = vec![
            MatchGroup { workers: vec![WorkerPair(1, 0), WorkerPair(2, 1)], blocks: 3, ..MatchGroup::default() },
            MatchGroup {
                workers: vec![WorkerPair(2, 0)],
                blocks: 1,
                stale: true,
                tiers: TierDepths { host: Some(4), disk: None },
                ..MatchGroup::default()
            },
            MatchGroup { workers: vec![WorkerPair(3, 0)], blocks: 0, predicted_blocks: Some(2), ..MatchGroup::default() },
        ];
        let names = [NamedWorker { worker_id: 2, info: WorkerInfo { url: Some("http://b".into()), ..WorkerInfo::named("b") } }];
        let s = Scores::of(groups, &names, "m".into(), 16, false);
        assert_eq!(s.frequencies, [3, 2, 2], "(worker, rank) pairs matching each block");
        assert_eq!(s.scores["1"]["0"], 48);
        assert_eq!((s.scores["2"]["0"], s.scores["2"]["1"]), (16, 48));
        assert!(!s.scores.contains_key("3"), "a worker with only a prediction has no device score");
        let two = &s.instances["2"];
        assert_eq!((two.gpu, two.cpu, two.disk, two.longest_matched), (48, 64, 64, 64), "host reaches past device on rank 0");
        assert_eq!(two.dp, BTreeMap::from([("0".to_string(), 16), ("1".to_string(), 48)]));
        assert_eq!((two.name.as_deref(), two.url.as_deref(), two.stale), (Some("b"), Some("http://b"), true));
        assert_eq!(s.instances["3"].predicted, Some(32));
        assert_eq!(s.instances["1"].name, None);
    }
}
