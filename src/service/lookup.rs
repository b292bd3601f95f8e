//! Routers' lookups: one queue subscriber per core, each answering in turn, and only while
//! this replica is ready: NATS then sends every lookup to replicas whose index is whole.

use super::State;
use crate::apply::ApplyPool;
use async_nats::Client;
use futures::StreamExt;
use kvindex_client::protocol::{LookupRequest, LookupResponse, MatchEntry, TierDepths, WorkerRef};
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::tiers::{find_tiered, OtherTiers, TieredMatch};
use kvindex_core::Tier;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Matches in an answer unless the request says otherwise: deepest first, so a router that
/// picks among the best never misses one.
const DEFAULT_MAX_MATCHES: usize = 64;
/// Upper bound of one encoded match (with both tiers' depths) or stale worker, and of the
/// answer's envelope (bytes).
const ENTRY_BYTES: usize = 96;

/// Entries (matches and stale workers together) that fit in one NATS message of `max_payload`.
pub(super) fn entries_that_fit(max_payload: usize) -> usize {
    max_payload.saturating_sub(ENTRY_BYTES) / ENTRY_BYTES
}

/// Keeps this replica in the `kvindex` lookup queue group exactly while it is ready (connected
/// and rebuilt). Joining waits for everything received so far to be applied; leaving (NATS
/// lost, a rebuild begun) unsubscribes, so NATS routes lookups to the other replicas, or
/// routers get "no responders" at once rather than answers from a half-built index.
pub(super) async fn lookup_membership<I: KvIndex>(
    client: Client,
    state: Arc<State>,
    index: Arc<I>,
    others: Arc<OtherTiers<I>>,
    pool: Arc<ApplyPool<I>>,
    subscribers: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let subject = format!("{}.lookup", state.cfg.prefix);
    let mut ready = state.ready.subscribe();
    loop {
        tokio::select! {
            r = async { ready.wait_for(|r| *r).await.map(|_| ()) } => if r.is_err() { return },
            _ = stop.changed() => return,
        }
        let flushing = pool.clone();
        let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
        let mut subs = Vec::with_capacity(subscribers);
        for _ in 0..subscribers {
            match client.queue_subscribe(subject.clone(), "kvindex".into()).await {
                Ok(sub) => subs.push(sub),
                Err(e) => state.log.warn("lookup_subscribe", || format!("cannot subscribe to {subject}: {e}")),
            }
        }
        if subs.is_empty() {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            continue;
        }
        // The most entries an answer may hold under this server's payload limit, read once per
        // membership (a reconnect, possibly to another server, means leaving and rejoining).
        let room = entries_that_fit(match client.server_info().max_payload {
            0 => 1 << 20,
            n => n,
        });
        // The server has the subscriptions once a flush returns: only then say so.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), client.flush()).await;
        state.member.store(true, Ordering::Relaxed);
        state.metrics.lookup_member.set(1);
        tracing::info!(subscribers = subs.len(), "answering lookups: joined the kvindex queue group");
        let (leave, left) = tokio::sync::watch::channel(false);
        let tasks: Vec<_> = subs
            .into_iter()
            .map(|sub| {
                let (index, others) = (index.clone(), others.clone());
                tokio::spawn(serve_lookups(client.clone(), sub, state.clone(), index, others, room, left.clone()))
            })
            .collect();
        let stopping = tokio::select! {
            _ = async { ready.wait_for(|r| !*r).await.map(|_| ()) } => false,
            _ = stop.changed() => true,
        };
        state.member.store(false, Ordering::Relaxed);
        let _ = leave.send(true);
        for t in tasks {
            let _ = t.await;
        }
        state.metrics.lookup_member.set(0);
        if stopping {
            return;
        }
        tracing::info!("left the kvindex queue group until the index is whole again");
    }
}

/// Answers the lookups of one queue subscriber until told to stop; then takes no new ones.
/// The answer in progress is finished before the task returns.
pub(super) async fn serve_lookups<I: KvIndex>(
    client: Client,
    mut lookups: async_nats::Subscriber,
    state: Arc<State>,
    index: Arc<I>,
    others: Arc<OtherTiers<I>>,
    room: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = lookups.next() => match msg {
                Some(msg) => answer(&client, &state, &*index, &others, room, msg).await,
                None => break,
            },
        }
    }
    // Bounded: with NATS away, the unsubscription cannot reach the server (and need not).
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), lookups.unsubscribe()).await;
}

/// Answers one lookup request; an undecodable request gets an `error` reply. The answer is
/// bounded: at most `max_matches` matches and, with the stale workers, never more than one
/// NATS message holds (`room` entries).
async fn answer<I: KvIndex>(
    client: &Client,
    state: &State,
    index: &I,
    others: &OtherTiers<I>,
    room: usize,
    msg: async_nats::Message,
) {
    let start = Instant::now();
    let (resp, ok) = respond(state, index, others, room, LookupRequest::decode(&msg.payload));
    if let Some(reply) = msg.reply {
        if let Err(e) = client.publish(reply, resp.encode().into()).await {
            state.metrics.lookup_reply_failures.inc();
            state.log.warn("reply_failed", || format!("could not send a lookup reply: {e}"));
        }
    }
    let hot = &state.metrics.hot;
    let (count, duration) =
        if ok { (&hot.lookups_ok, &hot.lookup_duration_ok) } else { (&hot.lookups_error, &hot.lookup_duration_error) };
    count.inc();
    duration.observe(start.elapsed().as_secs_f64());
}

/// The answer to a request (or the reason it could not be read), with whether it is one:
/// what NATS lookups and the inspect API's `POST /v1/lookup` both reply. At most
/// `max_matches` matches and, with the stale workers, `room` entries.
pub(super) fn respond<I: KvIndex>(
    state: &State,
    index: &I,
    others: &OtherTiers<I>,
    room: usize,
    req: Result<LookupRequest, String>,
) -> (LookupResponse, bool) {
    match req.and_then(|req| check(state, req)) {
        Ok((req, tiers)) => {
            let limit = req.max_matches.map_or(DEFAULT_MAX_MATCHES, |m| m as usize).min(room);
            let query = req.local_hashes(state.cfg.max_depth as usize);
            let mut opts =
                MatchOptions { workers: req.workers, max_blocks: req.max_blocks.map(|m| m as usize), max_matches: None };
            let found: Vec<TieredMatch> = if tiers == [Tier::Device] {
                opts.max_matches = Some(limit);
                let device = index.find_matches(&query, &opts);
                device.into_iter().map(|m| TieredMatch { worker: m.worker, device: m.blocks, ..TieredMatch::default() }).collect()
            } else {
                let mut all = find_tiered(index, others, &tiers, &query, &opts);
                all.truncate(limit);
                all
            };
            let asked = |t: Tier, depth: u32| tiers.contains(&t).then_some(depth);
            let matches: Vec<MatchEntry> = found
                .iter()
                .map(|m| MatchEntry {
                    worker_id: m.worker.worker_id,
                    dp_rank: m.worker.dp_rank,
                    blocks: m.device,
                    stale: state.stale.contains_key(&m.worker),
                    tiers: TierDepths { host: asked(Tier::Host, m.host), disk: asked(Tier::Disk, m.disk) },
                })
                .collect();
            let stale_workers = stale_without_match(state, &found, opts.workers.as_deref(), room - matches.len());
            (LookupResponse::Matches { matches, stale_workers }, true)
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

/// Stale workers (within the request's worker filter) that are not among the matches, at
/// most `room`.
fn stale_without_match(state: &State, found: &[TieredMatch], filter: Option<&[u64]>, room: usize) -> Vec<WorkerRef> {
    if state.stale.is_empty() || room == 0 {
        return Vec::new();
    }
    let matched: HashSet<_> = found.iter().map(|m| m.worker).collect();
    let allowed: Option<HashSet<u64>> = filter.map(|f| f.iter().copied().collect());
    let mut out: Vec<WorkerRef> = state
        .stale
        .iter()
        .map(|e| *e.key())
        .filter(|w| !matched.contains(w) && allowed.as_ref().is_none_or(|a| a.contains(&w.worker_id)))
        .take(room)
        .map(|w| WorkerRef { worker_id: w.worker_id, dp_rank: w.dp_rank })
        .collect();
    out.sort_unstable_by_key(|w| (w.worker_id, w.dp_rank));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvindex_client::protocol::LookupResponse;

    #[test]
    fn a_full_answer_fits_in_one_message() {
        for max_payload in [4096usize, 1 << 20, 8 << 20] {
            let n = entries_that_fit(max_payload);
            let tiers = TierDepths { host: Some(u32::MAX), disk: Some(u32::MAX) };
            let widest = MatchEntry { worker_id: u64::MAX, dp_rank: u32::MAX, blocks: u32::MAX, stale: true, tiers };
            let stale = WorkerRef { worker_id: u64::MAX, dp_rank: u32::MAX };
            for split in [0, n / 2, n] {
                let answer =
                    LookupResponse::Matches { matches: vec![widest.clone(); split], stale_workers: vec![stale; n - split] };
                assert!(answer.encode().len() <= max_payload, "{split} of {n} entries overflow {max_payload}");
            }
        }
    }
}
