//! A lookup request answered from the model, in the wire's form: what NATS lookups, the
//! inspect API's `POST /v1/lookup` and the query API all reply. The model composes the answer;
//! this checks the request against the daemon's limits, answers again when a stale flag was
//! cleared while it answered, cuts the answer to what one NATS message holds, and, for the
//! HTTP APIs, answers for the whole of a sharded deployment.

use super::State;
use kvindex_client::protocol::{LookupRequest, LookupResponse, NamedWorker};
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::model::{Answer, Model};
use kvindex_core::Tier;

/// How many times a lookup answers again when stale flags were cleared while it answered.
const RACED_CLEARS: usize = 3;

thread_local! {
    /// A lookup thread's answer from the model, reused.
    static ANSWER: std::cell::RefCell<Answer> = std::cell::RefCell::new(Answer::default());
}

/// The answer to a request (or the reason it could not be read), with whether it is one.
/// Every match unless the request asks for fewer (`max_matches`), deepest first, and with the
/// stale workers never more than `room` entries (what one NATS message holds).
pub(super) fn respond<I: KvIndex>(
    state: &State,
    model: &Model<I>,
    room: usize,
    req: Result<LookupRequest, String>,
) -> (LookupResponse, bool) {
    match req.and_then(|req| check(state, req)) {
        Ok((req, tiers)) => {
            let query = req.local_hashes(state.cfg.max_depth as usize);
            let opts = MatchOptions {
                workers: req.workers.clone(),
                max_blocks: req.max_blocks.map(|m| m as usize),
                max_matches: req.max_matches.map(|m| m as usize),
            };
            let resp = ANSWER.with_borrow_mut(|answer| {
                // A worker's snapshot cleared between reading its blocks and reading its flag
                // would answer its partial state unflagged: a clear moves the generation, so
                // answer again (each clear is one snapshot's end, so this ends at once).
                let mut generation = state.stale.generation();
                for _ in 0..RACED_CLEARS {
                    model.answer(&query, &opts, &tiers, &state.stale, answer);
                    let now = state.stale.generation();
                    if now == generation {
                        break;
                    }
                    generation = now;
                }
                LookupResponse::from_answer(answer, req.grouped, room, state.cfg.shard_of())
            });
            (if req.names { named(state, resp) } else { resp }, true)
        }
        Err(error) => {
            state.log.warn("bad_lookup", || format!("lookup request rejected: {error}"));
            (LookupResponse::Error { error }, false)
        }
    }
}

/// How long the HTTP APIs wait for the other shards of a sharded deployment.
pub(super) const SHARDS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Why the deployment gave no answer.
pub(super) enum NoAnswer {
    /// The request is wrong; the reason goes back to the asker.
    Rejected(String),
    /// No shard answered, or NATS failed.
    Unreachable(String),
}

/// A request answered for the whole deployment, every match (HTTP has no message limit): this
/// daemon's model when it is not sharded, else every shard over NATS, merged as a router's
/// [`LookupClient`](kvindex_client::LookupClient) merges them, the shards that did not answer
/// named in `missing_shards`.
pub(super) async fn deployment_answer<I: KvIndex>(
    state: &State,
    model: &Model<I>,
    client: &async_nats::Client,
    req: LookupRequest,
) -> Result<LookupResponse, NoAnswer> {
    if state.cfg.shard_of().is_none() {
        return match respond(state, model, usize::MAX, Ok(req)) {
            (resp, true) => Ok(resp),
            (LookupResponse::Error { error }, false) => Err(NoAnswer::Rejected(error)),
            (_, false) => Err(NoAnswer::Rejected("refused".into())),
        };
    }
    let lookups = kvindex_client::LookupClient::new(client.clone(), &state.cfg.prefix).with_timeout(SHARDS_WAIT);
    let grouped = req.grouped;
    let query = kvindex_client::Query { request: LookupRequest { grouped: true, ..req } };
    match lookups.lookup(&query).await {
        Ok(a) => Ok(LookupResponse::Matches {
            matches: if grouped { Vec::new() } else { a.matches },
            groups: if grouped { a.groups } else { Vec::new() },
            shard: None,
            missing_shards: a.missing_shards,
            stale_workers: a.stale_workers,
            names: a.names,
        }),
        Err(kvindex_client::ClientError::Rejected(error)) => Err(NoAnswer::Rejected(error)),
        Err(e) => Err(NoAnswer::Unreachable(e.to_string())),
    }
}

/// The answer with what each of its named workers said it is.
fn named(state: &State, mut resp: LookupResponse) -> LookupResponse {
    if let LookupResponse::Matches { matches, groups, stale_workers, names, .. } = &mut resp {
        let mut ids: Vec<u64> = matches.iter().map(|m| m.worker_id).collect();
        ids.extend(groups.iter().flat_map(|g| g.workers.iter().map(|w| w.0)));
        ids.extend(stale_workers.iter().map(|w| w.worker_id));
        ids.sort_unstable();
        ids.dedup();
        names.extend(ids.into_iter().filter_map(|id| {
            state.names.get(&id).map(|info| NamedWorker { worker_id: id, info: info.value().as_ref().clone() })
        }));
    }
    resp
}

/// The limits a request must keep, and its tiers: a `workers` filter longer than the workers
/// this daemon can track is refused (its cost would be the router's choice).
fn check(state: &State, req: LookupRequest) -> Result<(LookupRequest, Vec<Tier>), String> {
    let max = state.cfg.max_workers as usize;
    if req.workers.as_ref().is_some_and(|w| w.len() > max) {
        return Err(format!("workers filter longer than {max} (max_workers)"));
    }
    let tiers = req.tier_list()?;
    Ok((req, tiers))
}
