//! The router side: ask kvindex which workers hold the longest prefix of a request.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvindex_client::ClientError> {
//! use kvindex_client::{LookupClient, Query};
//! use std::time::Duration;
//!
//! let nats = async_nats::connect("nats://127.0.0.1:4222").await.map_err(|e| kvindex_client::ClientError::Nats(e.to_string()))?;
//! let lookups = LookupClient::new(nats, "kv").with_timeout(Duration::from_millis(50));
//! let tokens: Vec<u32> = (0..1024).collect();
//! let answer = lookups.lookup(&Query::tokens(&tokens, 16)).await?;
//! for m in &answer.matches {
//!     println!("worker {} rank {}: {} blocks{}", m.worker_id, m.dp_rank, m.blocks, if m.stale { " (stale)" } else { "" });
//! }
//! # Ok(()) }
//! ```

use crate::error::ClientError;
use crate::protocol::{now_ns, LookupRequest, LookupResponse, MatchEntry, MatchGroup, NamedWorker, Routed, ShardOf, WorkerRef};
use crate::shards::{answered, merge, one_count, partition, ShardAnswer};
use async_nats::{Client, RequestErrorKind, Subject};
use futures::StreamExt;
use kvindex_core::names::WorkerInfo;
use kvindex_core::LocalHash;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One reply's matches, before it becomes an [`Answer`].
struct Reply {
    matches: Vec<MatchEntry>,
    groups: Vec<MatchGroup>,
    stale_workers: Vec<WorkerRef>,
    names: Vec<NamedWorker>,
}

impl Reply {
    fn into_answer(self, shards: u32, missing_shards: Vec<u32>) -> Answer {
        let matches =
            if self.matches.is_empty() { self.groups.iter().flat_map(MatchGroup::entries).collect() } else { self.matches };
        Answer { matches, groups: self.groups, stale_workers: self.stale_workers, missing_shards, shards, names: self.names }
    }
}

/// A reply's matches and, from a shard, which shard of how many it is.
fn decode(payload: &[u8]) -> Result<(Reply, Option<ShardOf>), ClientError> {
    match rmp_serde::from_slice::<LookupResponse>(payload) {
        Ok(LookupResponse::Matches { matches, groups, stale_workers, shard, names, .. }) => {
            Ok((Reply { matches, groups, stale_workers, names }, shard.filter(|s| s.shards > 1)))
        }
        Ok(LookupResponse::Error { error }) => Err(ClientError::Rejected(error)),
        Err(e) => Err(ClientError::BadAnswer(e.to_string())),
    }
}

/// What to look up: a request's tokens (kvindex hashes them) or its local hashes.
#[derive(Clone, Debug, Default)]
pub struct Query {
    /// The wire request; built by the constructors, refined by the `with_*` methods.
    pub request: LookupRequest,
}

impl Query {
    /// A request's token ids, cut into blocks of `block_size` (a partial last block is not
    /// matched), hashed by kvindex with the same function the publishers use.
    pub fn tokens(tokens: &[u32], block_size: u32) -> Query {
        let request =
            LookupRequest { tokens: Some(tokens.to_vec()), block_size: Some(block_size), grouped: true, ..Default::default() };
        Query { request }
    }

    /// Local hashes computed by the router ([`kvindex_core::local_hashes`]): smaller on the
    /// wire than tokens.
    pub fn hashes(hashes: &[LocalHash]) -> Query {
        let request =
            LookupRequest { block_hashes: Some(hashes.iter().map(|h| h.0).collect()), grouped: true, ..Default::default() };
        Query { request }
    }

    /// Tokens of a LoRA adapter's request: they match only blocks cached for that adapter.
    pub fn with_lora(mut self, lora_name: &str) -> Query {
        self.request.lora_name = Some(lora_name.to_string());
        self
    }

    /// Tokens under a cache salt (a tenant's isolation key).
    pub fn with_salt(mut self, salt: &str) -> Query {
        self.request.salt = Some(salt.to_string());
        self
    }

    /// Tokens of an engine that hashes `n` tokens past each block (vLLM's lookahead hashing):
    /// a block matches only with the same tokens after it, as the engine reuses it.
    pub fn with_lookahead(mut self, n: u32) -> Query {
        self.request.lookahead = Some(n);
        self
    }

    /// Only these worker ids (any dp rank) are considered.
    pub fn only_workers(mut self, workers: &[u64]) -> Query {
        self.request.workers = Some(workers.to_vec());
        self
    }

    /// Only the first `n` blocks are matched.
    pub fn max_blocks(mut self, n: u64) -> Query {
        self.request.max_blocks = Some(n);
        self
    }

    /// Match in these tiers too (device alone by default): each match then carries its host
    /// and disk depths in [`MatchEntry::tiers`], and a worker holding the prefix only off the
    /// GPU is listed with `blocks` 0.
    pub fn in_tiers(mut self, tiers: &[kvindex_core::Tier]) -> Query {
        self.request.tiers = Some(tiers.iter().map(|t| t.as_str().to_string()).collect());
        self
    }

    /// Ask what each worker of the answer is (name, URL, model), as its publisher said:
    /// [`Answer::names`].
    pub fn with_names(mut self) -> Query {
        self.request.names = true;
        self
    }

    /// At most `n` matches, the deepest (by default every match): workers tied where the cut
    /// falls are kept in rotation from one lookup to the next.
    pub fn max_matches(mut self, n: u32) -> Query {
        self.request.max_matches = Some(n);
        self
    }

    /// Says, with the lookup, that the request goes to this worker: kvindex announces it as
    /// [`LookupClient::announce`] would, once it has answered.
    pub fn route_to(mut self, worker_id: u64, dp_rank: u32) -> Query {
        self.request.route_to = Some(WorkerRef { worker_id, dp_rank });
        self
    }

    /// The announcement that this query's request went to `worker_id`, rank `dp_rank`.
    fn routed(&self, worker_id: u64, dp_rank: u32) -> Routed {
        let r = &self.request;
        Routed {
            worker_id,
            dp_rank,
            block_hashes: r.block_hashes.clone(),
            tokens: r.tokens.clone(),
            block_size: r.block_size,
            lora_name: r.lora_name.clone(),
            salt: r.salt.clone(),
            lookahead: r.lookahead,
        }
    }
}

/// kvindex's answer to one lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// Workers holding at least the request's first block, deepest first, each with its depth
    /// in blocks and whether its state is being resynchronised (`stale`: its depth may be out
    /// of date).
    pub matches: Vec<MatchEntry>,
    /// The same workers grouped by answer (as they came over the wire): a thousand workers at
    /// one depth are one group.
    pub groups: Vec<MatchGroup>,
    /// Stale workers that match nothing: they may hold the prefix without kvindex knowing yet.
    pub stale_workers: Vec<WorkerRef>,
    /// Shards of a sharded deployment that did not answer in time: the workers they own are
    /// missing from this answer (empty when it is whole). A router can wait and ask again, or
    /// route on what it has.
    pub missing_shards: Vec<u32>,
    /// How many shards answered for the deployment (1 when it is not sharded).
    pub shards: u32,
    /// For a query that asked ([`Query::with_names`]): what each named worker is.
    pub names: Vec<NamedWorker>,
}

impl Answer {
    /// Whether some shard did not answer (see [`Answer::missing_shards`]).
    pub fn is_partial(&self) -> bool {
        !self.missing_shards.is_empty()
    }

    /// The deepest match that is not stale, if any.
    pub fn best(&self) -> Option<&MatchEntry> {
        self.matches.iter().find(|m| !m.stale)
    }

    /// What worker `worker_id` said it is, if the answer names it.
    pub fn name_of(&self, worker_id: u64) -> Option<&WorkerInfo> {
        self.names.iter().find(|n| n.worker_id == worker_id).map(|n| &n.info)
    }
}

/// Asks kvindex over NATS request-reply on `{prefix}.lookup`. Cheap to clone; share one.
#[derive(Clone, Debug)]
pub struct LookupClient {
    /// The NATS connection; lookups share it with whatever else the router does.
    client: Client,
    /// `{prefix}.lookup`, built once.
    subject: Subject,
    /// `{prefix}.routed`, where announcements go.
    routed: Subject,
    /// How long one lookup may take before [`ClientError::Timeout`].
    timeout: Duration,
    /// What the answers said of the deployment: 0 not known yet, 1 one index (a lookup is
    /// one request), more: the shards a lookup gathers.
    shards: Arc<AtomicU32>,
}

impl LookupClient {
    /// A client for the kvindex serving `prefix` (one prefix per model or deployment), with a
    /// 100 ms timeout: a router should fall back to load-only routing rather than wait.
    pub fn new(client: Client, prefix: &str) -> LookupClient {
        LookupClient {
            client,
            subject: format!("{prefix}.lookup").into(),
            routed: format!("{prefix}.routed").into(),
            timeout: Duration::from_millis(100),
            shards: Arc::new(AtomicU32::new(0)),
        }
    }

    /// Sets the per-lookup timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> LookupClient {
        self.timeout = timeout;
        self
    }

    /// Which workers hold the longest prefix of the query: see [`Answer`]. In a sharded
    /// deployment, every shard is asked at once and their answers are merged into the answer
    /// one index would give ([`crate::shards::merge`]); a shard that does not answer within the
    /// timeout is named in [`Answer::missing_shards`] rather than silently left out.
    pub async fn lookup(&self, query: &Query) -> Result<Answer, ClientError> {
        // Stamped as it leaves, so that kvindex times the hop to it.
        let sent = LookupRequest { sent_ns: Some(now_ns()), ..query.request.clone() };
        let payload: bytes::Bytes = rmp_serde::to_vec_named(&sent).map_err(|e| ClientError::BadAnswer(e.to_string()))?.into();
        let limit = query.request.max_matches.map(|m| m as usize);
        if self.shards.load(Ordering::Relaxed) == 1 {
            // One index (as far as the last answer said): one request, one answer.
            let asked = self.client.request(self.subject.clone(), payload.clone());
            let reply = match tokio::time::timeout(self.timeout, asked).await {
                Err(_) => return Err(self.timed_out()),
                Ok(Err(e)) => {
                    return Err(match e.kind() {
                        RequestErrorKind::NoResponders => ClientError::NoKvindex { subject: self.subject.to_string() },
                        RequestErrorKind::TimedOut => self.timed_out(),
                        RequestErrorKind::Other => ClientError::Nats(e.to_string()),
                    })
                }
                Ok(Ok(m)) => m,
            };
            match decode(&reply.payload)? {
                (answer, None) => return Ok(answer.into_answer(1, Vec::new())),
                // The deployment is sharded now: gather every shard.
                (_, Some(of)) => self.shards.store(of.shards.max(1), Ordering::Relaxed),
            }
        }
        self.gather(payload, limit).await
    }

    /// Asks every shard at once and merges what comes back before the timeout.
    async fn gather(&self, payload: bytes::Bytes, limit: Option<usize>) -> Result<Answer, ClientError> {
        let nats = |e: &dyn std::fmt::Display| ClientError::Nats(e.to_string());
        let inbox = self.client.new_inbox();
        let mut replies = self.client.subscribe(inbox.clone()).await.map_err(|e| nats(&e))?;
        self.client.publish_with_reply(self.subject.clone(), inbox, payload).await.map_err(|e| nats(&e))?;
        let deadline = tokio::time::Instant::now() + self.timeout;
        // Each answer with the shard count its shard runs under: while the count changes, old
        // and new shards may both answer, and only answers of one count are merged.
        let mut answers: Vec<(ShardOf, ShardAnswer)> = Vec::new();
        let mut names: Vec<(ShardOf, Vec<NamedWorker>)> = Vec::new();
        let mut whole = None;
        while answers.last().is_none_or(|(of, _)| answered(&answers, of.shards) < of.shards) {
            let msg = match tokio::time::timeout_at(deadline, replies.next()).await {
                Ok(Some(m)) => m,
                Ok(None) | Err(_) => break,
            };
            if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                let _ = replies.unsubscribe().await;
                return Err(ClientError::NoKvindex { subject: self.subject.to_string() });
            }
            match decode(&msg.payload)? {
                (answer, None) => {
                    whole = Some(answer);
                    break;
                }
                (answer, Some(of)) => {
                    let of = ShardOf { shards: of.shards.max(1), ..of };
                    names.push((of, answer.names));
                    answers
                        .push((of, ShardAnswer { shard: of.shard, groups: answer.groups, stale_workers: answer.stale_workers }));
                }
            }
        }
        let _ = replies.unsubscribe().await;
        if let Some(answer) = whole {
            self.shards.store(1, Ordering::Relaxed);
            return Ok(answer.into_answer(1, Vec::new()));
        }
        let Some((shards, kept)) = one_count(answers) else {
            return Err(self.timed_out());
        };
        let answers: Vec<ShardAnswer> = kept.into_iter().map(|(_, a)| a).collect();
        self.shards.store(shards, Ordering::Relaxed);
        let (groups, stale_workers) = merge(&answers, shards, limit);
        let missing = (0..shards).filter(|k| !answers.iter().any(|a| a.shard == *k)).collect();
        // Each worker named by the shard that owns it, under the count merged.
        let mut named: Vec<NamedWorker> = names
            .into_iter()
            .filter(|(of, _)| of.shards == shards)
            .flat_map(|(of, n)| n.into_iter().filter(move |n| partition(n.worker_id, shards) == of.shard))
            .collect();
        named.sort_unstable_by_key(|n| n.worker_id);
        named.dedup_by_key(|n| n.worker_id);
        let listed = |id: u64| {
            groups.iter().any(|g| g.workers.iter().any(|w| w.0 == id)) || stale_workers.iter().any(|w| w.worker_id == id)
        };
        named.retain(|n| listed(n.worker_id));
        Ok(Reply { groups, stale_workers, matches: Vec::new(), names: named }.into_answer(shards, missing))
    }

    /// Announces that the query's request was sent to worker `worker_id`, rank `dp_rank`
    /// (fire and forget): until that engine's events show the blocks, or `predicted_ttl`
    /// passes, kvindex answers them as the worker's `predicted_blocks`, so requests sharing the
    /// new prefix find it. For a routed-only worker (approximate mode) they are its blocks.
    pub async fn announce(&self, query: &Query, worker_id: u64, dp_rank: u32) -> Result<(), ClientError> {
        let payload = query.routed(worker_id, dp_rank).encode();
        let subject = self.routed_to(worker_id);
        self.client.publish(subject, payload.into()).await.map_err(|e| ClientError::Nats(e.to_string()))
    }

    /// `{prefix}.routed.{worker_id}`: in a sharded deployment the NATS server maps it to the
    /// shard that owns the worker, as it maps the worker's events.
    fn routed_to(&self, worker_id: u64) -> String {
        format!("{}.{worker_id}", self.routed)
    }

    /// As [`LookupClient::announce`], returning once a kvindex replica has applied it: that
    /// replica's next answers include it (other replicas apply it on their own time).
    pub async fn announce_applied(&self, query: &Query, worker_id: u64, dp_rank: u32) -> Result<(), ClientError> {
        let payload = query.routed(worker_id, dp_rank).encode();
        let asked = self.client.request(self.routed_to(worker_id), payload.into());
        match tokio::time::timeout(self.timeout, asked).await {
            Err(_) => Err(ClientError::Timeout { subject: self.routed.to_string(), timeout_ms: self.timeout.as_millis() as u64 }),
            Ok(Err(e)) if e.kind() == RequestErrorKind::NoResponders => {
                Err(ClientError::NoKvindex { subject: self.routed.to_string() })
            }
            Ok(Err(e)) => Err(ClientError::Nats(e.to_string())),
            Ok(Ok(_)) => Ok(()),
        }
    }

    fn timed_out(&self) -> ClientError {
        ClientError::Timeout { subject: self.subject.to_string(), timeout_ms: self.timeout.as_millis() as u64 }
    }
}
