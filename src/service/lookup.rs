//! Routers' lookups: one queue subscriber per core, each answering in turn, and only while
//! this replica is ready: NATS then sends every lookup to replicas whose index is whole.

use super::State;
use crate::apply::ApplyPool;
use async_nats::Client;
use futures::StreamExt;
use kvindex_client::protocol::{
    group_entries, LookupRequest, LookupResponse, MatchEntry, MatchGroup, TierDepths, WorkerPair, WorkerRef,
};
use kvindex_core::groups::Groups;
use kvindex_core::index::{rotation, DepthGroups, KvIndex, MatchOptions, WorkerMatch};
use kvindex_core::seeded::SeededMap;
use kvindex_core::tiers::{find_tiered, TieredMatch};
use kvindex_core::{LocalHash, Tier, WorkerId};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Upper bound of one encoded match (with both tiers' depths, a prediction and the
/// approximate flag) or stale worker, and of the answer's envelope (bytes). A group of a
/// grouped answer costs one entry and each of its workers an eighth of one (16 bytes).
const ENTRY_BYTES: usize = 128;

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
            // One queue group per shard: a lookup reaches one replica of every shard.
            let group = match state.cfg.shard_of() {
                Some(s) => format!("kvindex-shard-{}", s.shard),
                None => "kvindex".to_string(),
            };
            match client.queue_subscribe(subject.clone(), group).await {
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
            .map(|sub| tokio::spawn(serve_lookups(client.clone(), sub, state.clone(), pool.clone(), room, left.clone())))
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
    pool: Arc<ApplyPool<I>>,
    room: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = lookups.next() => match msg {
                Some(msg) => answer(&client, &state, &pool, room, msg).await,
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
async fn answer<I: KvIndex>(client: &Client, state: &State, pool: &ApplyPool<I>, room: usize, msg: async_nats::Message) {
    let start = Instant::now();
    let req = LookupRequest::decode(&msg.payload);
    let routed = req.as_ref().ok().and_then(|r| r.routed(state.cfg.max_depth as usize));
    let (resp, ok) = respond(state, pool, room, req);
    if let Some(reply) = msg.reply {
        if let Err(e) = client.publish(reply, resp.encode().into()).await {
            state.metrics.lookup_reply_failures.inc();
            state.log.warn("reply_failed", || format!("could not send a lookup reply: {e}"));
        }
    }
    // Every replica keeps the announcement, this one included: it goes out as a router's would.
    if let (Some(routed), true) = (routed, ok) {
        // To the worker's subject: sharded, the NATS mapping takes it to the worker's shard.
        let subject = format!("{}.routed.{}", state.cfg.prefix, routed.worker_id);
        let _ = client.publish(subject, routed.encode().into()).await;
    }
    let hot = &state.metrics.hot;
    let (count, duration) =
        if ok { (&hot.lookups_ok, &hot.lookup_duration_ok) } else { (&hot.lookups_error, &hot.lookup_duration_error) };
    count.inc();
    duration.observe(start.elapsed().as_secs_f64());
}

/// The answer to a request (or the reason it could not be read), with whether it is one:
/// what NATS lookups and the inspect API's `POST /v1/lookup` both reply. Every match unless
/// the request asks for fewer (`max_matches`), deepest first, and with the stale workers never
/// more than one NATS message holds (`room` entries).
pub(super) fn respond<I: KvIndex>(
    state: &State,
    pool: &ApplyPool<I>,
    room: usize,
    req: Result<LookupRequest, String>,
) -> (LookupResponse, bool) {
    match req.and_then(|req| check(state, req)) {
        Ok((req, tiers)) => {
            // A worker's snapshot cleared between reading its blocks and reading its flag
            // would answer its partial state unflagged: a clear moves the generation, so
            // answer again (each clear is one snapshot's end, so this ends at once).
            let query = req.local_hashes(state.cfg.max_depth as usize);
            let opts = MatchOptions { workers: req.workers, max_blocks: req.max_blocks.map(|m| m as usize), max_matches: None };
            let limit = req.max_matches.map(|m| m as usize);
            let ask = Ask { query: &query, opts: &opts, tiers: &tiers, limit, room, grouped: req.grouped };
            let mut generation = state.stale_generation.load(Ordering::SeqCst);
            for _ in 0..RACED_CLEARS {
                let answer = matches(state, pool, &ask);
                let now = state.stale_generation.load(Ordering::SeqCst);
                if now == generation {
                    return (answer, true);
                }
                generation = now;
            }
            (matches(state, pool, &ask), true)
        }
        Err(error) => {
            state.log.warn("bad_lookup", || format!("lookup request rejected: {error}"));
            (LookupResponse::Error { error }, false)
        }
    }
}

/// How many times a lookup answers again when stale flags were cleared while it answered.
const RACED_CLEARS: usize = 3;

/// One lookup, read from its request once however often it is answered.
struct Ask<'a> {
    /// The request's hashes, within `max_depth`.
    query: &'a [LocalHash],
    /// Its worker filter and limits, as the index takes them (every match).
    opts: &'a MatchOptions,
    /// The tiers it asked for.
    tiers: &'a [Tier],
    /// The most matches it asked for (`None`: every match).
    limit: Option<usize>,
    /// Entries that fit in the reply (matches and stale workers together).
    room: usize,
    /// Whether it asked for the grouped form.
    grouped: bool,
}

thread_local! {
    /// A lookup thread's grouped answer from the index, reused.
    static GROUPED: std::cell::RefCell<DepthGroups> = std::cell::RefCell::new(DepthGroups::default());
}

/// The matches for a lookup and the stale workers beside them.
fn matches<I: KvIndex>(state: &State, pool: &ApplyPool<I>, ask: &Ask) -> LookupResponse {
    let Ask { query, opts, tiers, limit, room, grouped } = *ask;
    let index = &**pool.index();
    let hybrid = pool.groups().filter(|g| g.any());
    let predicting = pool.predicted().is_some() && pool.predicted_blocks() > 0;
    let plain =
        tiers == [Tier::Device] && hybrid.is_none() && !predicting && state.stale.is_empty() && state.routed_only.is_empty();
    let (groups, found) = if plain {
        // The common answer: the index's own groups, cut by the index (ties in rotation).
        let cut = MatchOptions { max_matches: limit, ..opts.clone() };
        let groups = GROUPED.with(|g| {
            let mut g = g.borrow_mut();
            index.find_grouped(query, &cut, &mut g);
            g.iter()
                .map(|(blocks, ws)| MatchGroup {
                    workers: ws.iter().map(|w| WorkerPair(w.worker_id, w.dp_rank)).collect(),
                    blocks,
                    ..MatchGroup::default()
                })
                .collect::<Vec<_>>()
        });
        (groups, Vec::new())
    } else {
        let found = every_match(pool, ask, hybrid.map(|g| &**g));
        let entries = entries(state, pool, query, opts, tiers, found, limit);
        (group_entries(entries.iter().cloned()), entries)
    };
    let (groups, used) = fit(groups, room);
    let matches = if grouped { Vec::new() } else { flat(&groups) };
    let listed: HashSet<WorkerId> = if state.stale.is_empty() {
        HashSet::new()
    } else {
        found.iter().map(|e| WorkerId::new(e.worker_id, e.dp_rank)).collect()
    };
    let stale_workers = stale_without_match(state, &listed, opts.workers.as_deref(), room.saturating_sub(used));
    LookupResponse::Matches {
        matches,
        groups: if grouped { groups } else { Vec::new() },
        shard: state.cfg.shard_of(),
        missing_shards: Vec::new(),
        stale_workers,
    }
}

/// Every match in every asked tier, hybrid workers lowered to what all their groups serve,
/// deepest first.
fn every_match<I: KvIndex>(pool: &ApplyPool<I>, ask: &Ask, hybrid: Option<&Groups<I>>) -> Vec<TieredMatch> {
    let Ask { query, opts, tiers, .. } = *ask;
    let index = &**pool.index();
    let mut found: Vec<TieredMatch> = if tiers == [Tier::Device] {
        let device = index.find_matches(query, opts);
        device.into_iter().map(|m| TieredMatch { worker: m.worker, device: m.blocks, ..TieredMatch::default() }).collect()
    } else {
        match pool.others() {
            Some(others) => find_tiered(index, others, tiers, query, opts),
            None => Vec::new(),
        }
    };
    if let Some(groups) = hybrid {
        limit_to_groups(groups, query, &mut found);
    }
    found
}

/// The answer's entries, deepest first: predictions beside held depths, flags, and the cut to
/// `limit` (workers tied at the cut kept in rotation). Entries with the same answer are next
/// to each other, so that they group.
fn entries<I: KvIndex>(
    state: &State,
    pool: &ApplyPool<I>,
    query: &[LocalHash],
    opts: &MatchOptions,
    tiers: &[Tier],
    mut found: Vec<TieredMatch>,
    limit: Option<usize>,
) -> Vec<MatchEntry> {
    let predicted = predictions(pool, query, opts, &mut found);
    if let Some(k) = limit.filter(|&k| k < found.len()) {
        let key = |m: &TieredMatch| (m.deepest(), m.device);
        let at = key(&found[k]);
        let from = found.partition_point(|m| key(m) > at);
        if from < k {
            let to = found.partition_point(|m| key(m) >= at);
            let start = rotation(to - from, k - from);
            found[from..to].rotate_left(start);
        }
        found.truncate(k);
    }
    let asked = |t: Tier, depth: u32| tiers.contains(&t).then_some(depth);
    let mut out: Vec<MatchEntry> = found
        .iter()
        .map(|m| MatchEntry {
            worker_id: m.worker.worker_id,
            dp_rank: m.worker.dp_rank,
            blocks: m.device,
            stale: state.stale.contains_key(&m.worker),
            tiers: TierDepths { host: asked(Tier::Host, m.host), disk: asked(Tier::Disk, m.disk) },
            predicted_blocks: predicted.get(&m.worker).map(|&p| p.max(m.device)),
            approximate: state.routed_only.contains(m.worker.worker_id),
        })
        .collect();
    // Deepest first stays; within one depth, the same answers side by side.
    out.sort_by_key(|e| {
        let deepest = e.blocks.max(e.tiers.host.unwrap_or(0)).max(e.tiers.disk.unwrap_or(0));
        let deepest = deepest.max(e.predicted_blocks.unwrap_or(0));
        (std::cmp::Reverse(deepest), e.stale, e.approximate, std::cmp::Reverse(e.blocks), e.tiers.host, e.tiers.disk)
    });
    out
}

/// One entry per worker, deepest first, ties by worker (the order a v1 answer promises).
fn flat(groups: &[MatchGroup]) -> Vec<MatchEntry> {
    let mut out = Vec::with_capacity(groups.iter().map(|g| g.workers.len()).sum());
    for g in groups {
        let from = out.len();
        out.extend(g.entries());
        out[from..].sort_unstable_by_key(|e: &MatchEntry| (e.worker_id, e.dp_rank));
    }
    out
}

/// The groups that fit in `room` entries (a group one entry, each of its workers an eighth),
/// deepest first, the last one cut if need be; and the entries they take.
fn fit(mut groups: Vec<MatchGroup>, room: usize) -> (Vec<MatchGroup>, usize) {
    let mut used = 0;
    for (i, g) in groups.iter_mut().enumerate() {
        let cost = 1 + g.workers.len().div_ceil(8);
        if used + cost > room {
            let left = room.saturating_sub(used + 1) * 8;
            g.workers.truncate(left);
            let keep = i + usize::from(!g.workers.is_empty());
            used += usize::from(!g.workers.is_empty()) + g.workers.len().div_ceil(8);
            groups.truncate(keep);
            return (groups, used);
        }
        used += cost;
    }
    (groups, used)
}

/// Lowers each hybrid worker's device depth to what all its KV-cache groups can serve, drops
/// the workers left with nothing in any tier, and sorts again, deepest first.
fn limit_to_groups<I: KvIndex>(groups: &Groups<I>, query: &[LocalHash], found: &mut Vec<TieredMatch>) {
    let mut device: Vec<WorkerMatch> =
        found.iter().filter(|m| m.device > 0).map(|m| WorkerMatch { worker: m.worker, blocks: m.device }).collect();
    groups.limit(query, &mut device);
    let depth: SeededMap<WorkerId, u32> = device.into_iter().map(|m| (m.worker, m.blocks)).collect();
    for m in found.iter_mut() {
        m.device = depth.get(&m.worker).copied().unwrap_or(0);
    }
    found.retain(|m| m.deepest() > 0);
    found.sort_unstable_by(|a, b| b.deepest().cmp(&a.deepest()).then(b.device.cmp(&a.device)).then(a.worker.cmp(&b.worker)));
}

/// Each worker's predicted depth where it reaches past its held one (held and announced
/// blocks are both prefixes of the request, so their union is the deeper of the two); workers
/// known only by their predictions join `found` after the rest, deepest prediction first.
fn predictions<I: KvIndex>(
    pool: &ApplyPool<I>,
    query: &[LocalHash],
    opts: &MatchOptions,
    found: &mut Vec<TieredMatch>,
) -> SeededMap<WorkerId, u32> {
    let mut deeper = SeededMap::default();
    let Some(predicted) = pool.predicted().filter(|_| pool.predicted_blocks() > 0) else { return deeper };
    let all = MatchOptions { max_matches: None, ..opts.clone() };
    deeper.extend(predicted.find_matches(query, &all).into_iter().map(|m| (m.worker, m.blocks)));
    let listed: SeededMap<WorkerId, u32> = found.iter().map(|m| (m.worker, m.device)).collect();
    deeper.retain(|w, p| listed.get(w).is_none_or(|&held| *p > held));
    let mut only: Vec<(WorkerId, u32)> = deeper.iter().filter(|(w, _)| !listed.contains_key(w)).map(|(&w, &p)| (w, p)).collect();
    only.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    found.extend(only.into_iter().map(|(worker, _)| TieredMatch { worker, ..TieredMatch::default() }));
    deeper
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
fn stale_without_match(state: &State, matched: &HashSet<WorkerId>, filter: Option<&[u64]>, room: usize) -> Vec<WorkerRef> {
    if state.stale.is_empty() || room == 0 {
        return Vec::new();
    }
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
            let widest = MatchEntry {
                worker_id: u64::MAX,
                dp_rank: u32::MAX,
                blocks: u32::MAX,
                stale: true,
                tiers,
                predicted_blocks: Some(u32::MAX),
                approximate: true,
            };
            let stale = WorkerRef { worker_id: u64::MAX, dp_rank: u32::MAX };
            for split in [0, n / 2, n] {
                let answer = LookupResponse::Matches {
                    matches: vec![widest.clone(); split],
                    groups: vec![],
                    shard: None,
                    missing_shards: vec![],
                    stale_workers: vec![stale; n - split],
                };
                assert!(answer.encode().len() <= max_payload, "{split} of {n} entries overflow {max_payload}");
            }
        }
    }
}
