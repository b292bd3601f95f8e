//! A lookup request answered from the model, in the wire's form: what NATS lookups and the
//! inspect API's `POST /v1/lookup` both reply. The model composes the answer; this checks the
//! request against the daemon's limits, answers again when a stale flag was cleared while it
//! answered, and cuts the answer to what one NATS message holds.

use super::State;
use kvindex_client::protocol::{LookupRequest, LookupResponse};
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
            (resp, true)
        }
        Err(error) => {
            state.log.warn("bad_lookup", || format!("lookup request rejected: {error}"));
            (LookupResponse::Error { error }, false)
        }
    }
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
