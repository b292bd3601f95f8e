//! Event batches in: the subject's authority, decoding, each worker's event sequence
//! (duplicates, gaps, epochs, snapshots), what its flags become, and the hand-off to the
//! apply pool. Each step is a function of its own; [`ingest`] runs them in order.

use super::checkpoints::Checkpoint;
use super::cursors::{Cursor, Cursors, Refusal};
use super::stale::INCOMPLETE;
use super::State;
use crate::apply::{ApplyPool, DigestThen, Then};
use kvindex_client::protocol::{decode_batch, BatchHeader, DecodeError, EventBatch, KvEvent};
use kvindex_core::digest::WorkerDigests;
use kvindex_core::hash::WorkerId;
use kvindex_core::index::KvIndex;
use kvindex_core::model::Restate;
use kvindex_core::names::WorkerInfo;
use kvindex_core::{Event, Tier};
use std::sync::Arc;
use std::time::Instant;

/// Applies one message from `{prefix}.events.{worker_id}`.
pub(super) fn ingest<I: KvIndex>(state: &Arc<State>, pool: &ApplyPool<I>, subject: &str, payload: &[u8]) {
    let received = Instant::now();
    let Some(subject_id) = subject_worker(state, pool, subject) else { return };
    let Some(EventBatch { header, worker: info, events }) = decode(state, subject_id, payload) else { return };
    let worker = WorkerId::new(header.worker_id, header.dp_rank);
    let info = info.and_then(|i| {
        i.map_err(|why| state.fail("bad_worker_info", || format!("ignored what worker {worker} says it is: {why}"))).ok()
    });
    let mut cursors = state.cursors.lock();
    let Some((cursor, new_epoch)) = admit(state, &mut cursors, worker, &header, info.as_ref(), events.len()) else { return };
    // A new epoch clears the worker: whole again once the `cleared` is applied.
    let clear_after = new_epoch.then(|| state.stale.marked_at(&worker)).flatten();
    let followed = follow(state, cursor, worker, &header, new_epoch, events);
    drop(cursors);
    let clear_after = flag(state, worker, &header, &followed, clear_after);
    let whole = clear_after.is_none() && state.stale.get(&worker).is_none();
    let check = followed.digest.filter(|_| whole);
    let point = followed.checkpoint.filter(|_| whole);
    let stamp = Stamp { ts_ns: header.ts_ns, received };
    hand_off(state, pool, worker, followed.events, followed.restate, stamp, clear_after);
    if let Some(want) = check {
        check_digest(state, pool, worker, want);
    }
    if let Some(next_event_id) = point {
        checkpoint(state, pool, worker, header.epoch, next_event_id);
    }
}

/// Calls `f` with the worker's digest on its apply thread, once the batch just handed off is
/// applied; a full queue is waited for in place, so the runtime's other tasks go on.
fn after_batch<I: KvIndex>(pool: &ApplyPool<I>, worker: WorkerId, f: DigestThen) {
    if let Err(f) = pool.try_digest_then(worker, f) {
        tokio::task::block_in_place(|| pool.digest_then(worker, f));
    }
}

/// Checkpoints the worker at `(epoch, next_event_id)` for its replicas once the batch is
/// applied, unless it went stale meanwhile.
fn checkpoint<I: KvIndex>(state: &Arc<State>, pool: &ApplyPool<I>, worker: WorkerId, epoch: u64, next_event_id: u64) {
    let st = state.clone();
    after_batch(
        pool,
        worker,
        Box::new(move |held| {
            if let Some(d) = held.filter(|_| st.stale.get(&worker).is_none()) {
                super::replicas::checkpointed(&st, Checkpoint::new(worker, epoch, next_event_id, d));
            }
        }),
    );
}

/// Compares the publisher's digest with the worker's here once the batch is applied: a
/// difference (an event lost without a gap, or applied wrong) is counted, and the worker is
/// flagged stale (`drift`) and asked for a snapshot, which heals it.
fn check_digest<I: KvIndex>(state: &Arc<State>, pool: &ApplyPool<I>, worker: WorkerId, want: WorkerDigests) {
    let st = state.clone();
    let check: DigestThen = Box::new(move |held| {
        // Marked stale meanwhile (a store it could not place): its snapshot will tell.
        if st.stale.get(&worker).is_some() {
            return;
        }
        st.metrics.ingest.digest_checks.inc();
        let held = held.unwrap_or_default();
        if let Some((tier, said, kept)) = want.differs(&held) {
            st.drifted(worker, "publisher", "drift", || {
                format!(
                    "worker {worker} drifted: its publisher holds {} {tier} blocks (digest {:016x}), this index {} ({:016x}); marked stale, asking it to resync",
                    said.blocks, said.sum, kept.blocks, kept.sum
                )
            });
        }
    });
    after_batch(pool, worker, check);
}

/// The worker id the subject names, if it may publish here: canonical decimal, not
/// routed-only, and this shard's (sharded, the NATS mapping appends the shard's number).
fn subject_worker<I: KvIndex>(state: &State, pool: &ApplyPool<I>, subject: &str) -> Option<u64> {
    let names = &state.subjects;
    let token = subject.strip_prefix(names.events_prefix.as_str()).and_then(|t| t.strip_suffix(names.shard_suffix.as_str()));
    let Some(id) = token.and_then(canonical_id) else {
        state.fail("bad_subject", || format!("events subject {subject:?} does not end in a worker id in canonical decimal"));
        return None;
    };
    // A routed-only worker's blocks are what routers announce: events would fight them.
    if pool.model().routed_only().is_some_and(|r| r.contains(id)) {
        state.fail("routed_only", || format!("dropped events of worker {id}: it is routed-only (routed_only_workers)"));
        return None;
    }
    // Another shard's worker under this daemon's count: the server's mapping partitions by
    // another count than `shards` (or not at all). Held, it would answer for a worker every
    // merge ignores, and miss the events its own shard should get.
    if let Some(of) = state.cfg.shard_of() {
        let owner = kvindex_client::shards::partition(id, of.shards);
        if owner != of.shard {
            state.fail("other_shard", || {
                format!(
                    "dropped events of worker {id}: it is shard {owner} of {}'s, this is shard {}: does the NATS mapping partition by {}?",
                    of.shards, of.shard, of.shards
                )
            });
            if state.health.supersede() {
                tracing::error!(
                    shard = of.shard,
                    shards = of.shards,
                    "the NATS mapping no longer partitions workers by {}: this shard leaves lookups for good (kvindex_shard_superseded); stop it, or restart it with the deployment's --shards",
                    of.shards
                );
            }
            return None;
        }
    }
    Some(id)
}

/// The batch, if it decodes and names the worker of its subject (the subject is authoritative).
fn decode(state: &State, subject_id: u64, payload: &[u8]) -> Option<EventBatch> {
    let batch = match decode_batch(payload) {
        Ok(b) => b,
        Err(e) => {
            state.fail(e.reason(), || format!("dropped a message from worker {subject_id}: {e}"));
            return None;
        }
    };
    state.metrics.ingest.batches_received.inc();
    if batch.header.worker_id != subject_id {
        state.fail("worker_mismatch", || {
            format!("dropped a batch for worker {} sent on the subject of worker {subject_id}", batch.header.worker_id)
        });
        return None;
    }
    Some(batch)
}

/// The worker's cursor, if the batch may be followed: the worker can be tracked and the batch
/// is not of an epoch its publisher left. Whether the epoch is new (the publisher restarted:
/// whatever it held before is gone).
fn admit<'c>(
    state: &State,
    cursors: &'c mut Cursors,
    worker: WorkerId,
    header: &BatchHeader,
    info: Option<&WorkerInfo>,
    events: usize,
) -> Option<(&'c mut Cursor, bool)> {
    let now = Instant::now();
    let cursor = match cursors.admit(worker, header.epoch, info, now, &state.cfg) {
        Ok(cursor) => cursor,
        Err(refusal) => {
            refuse(state, worker, refusal, events);
            return None;
        }
    };
    if header.epoch < cursor.epoch {
        // A batch of the process this publisher replaced, delivered late: its events describe
        // a cache that no longer exists.
        let current = cursor.epoch;
        state.fail("old_epoch", || format!("dropped a batch of worker {worker} from epoch {} (now {current})", header.epoch));
        return None;
    }
    cursor.last_seen = now;
    let new_epoch = cursor.epoch != header.epoch;
    if new_epoch {
        state.metrics.ingest.epochs_changed.inc();
        tracing::info!(worker = %worker, old = cursor.epoch, new = header.epoch, "publisher restarted with a new epoch; clearing the worker");
        *cursor = Cursor::start(header.epoch, now);
    }
    Some((cursor, new_epoch))
}

/// What a batch did to its worker's sequence.
struct Followed {
    /// The events to apply, in order.
    events: Vec<Event>,
    /// Event ids were skipped (within the batch or at its tail).
    gap: bool,
    /// First heard from mid-sequence: events came before that this index never saw.
    midstream: bool,
    /// The batch opened a snapshot (its `cleared`).
    opened: bool,
    /// The batch ended a snapshot that had no gap since it opened.
    snapshot_done: bool,
    /// The batch before this one said `incomplete`.
    was_incomplete: bool,
    /// Where the batch stands in a restatement of the worker.
    restate: Restate,
    /// The publisher's digests, to compare once the batch is applied: the batch kept the
    /// worker in sequence and no restatement is open.
    digest: Option<WorkerDigests>,
    /// The event id to checkpoint the worker at for its replicas, if this batch is its first
    /// in an interval of publisher time, in sequence and with no restatement open.
    checkpoint: Option<u64>,
}

/// Follows the batch's events through the worker's sequence: duplicates dropped, gaps and a
/// snapshot's bounds noted, each event counted; what is left to apply, in order (after a
/// `cleared` when the epoch is new).
fn follow(
    state: &State,
    cursor: &mut Cursor,
    worker: WorkerId,
    header: &BatchHeader,
    new_epoch: bool,
    events: Vec<Result<KvEvent, DecodeError>>,
) -> Followed {
    let metrics = &state.metrics;
    let mut applied = Vec::with_capacity(events.len() + 1);
    if new_epoch {
        applied.push(Event::Cleared);
    }
    let mut seen = Followed {
        events: applied,
        gap: false,
        midstream: false,
        opened: false,
        snapshot_done: false,
        was_incomplete: false,
        restate: Restate::default(),
        digest: None,
        checkpoint: None,
    };
    for ev in events {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                state.fail(e.reason(), || format!("skipped an event of worker {worker}: {e}"));
                continue;
            }
        };
        let opens_snapshot = header.snapshot && ev.data == Event::Cleared;
        match cursor.next_id {
            // Nothing is known of this worker's sequence (first heard from, new epoch,
            // expired): unless it starts at event 0 or with a snapshot, events came before
            // that this index never saw.
            None => seen.midstream = ev.event_id != 0 && !opens_snapshot,
            Some(n) if ev.event_id < n => {
                metrics.ingest.duplicate_events.inc();
                continue;
            }
            // A snapshot starts afresh, so events missed before it do not matter.
            Some(n) if ev.event_id > n && !opens_snapshot => {
                tracing::debug!(worker = %worker, expected = n, got = ev.event_id, "event gap");
                metrics.ingest.event_gaps.inc();
                seen.gap = true;
                cursor.snapshot_clean = false;
            }
            _ => {}
        }
        // A snapshot of a worker held whole (in sequence, not stale) restates it: applied as
        // the difference from what it holds, without its `cleared`, so no answer changes.
        let restates = opens_snapshot
            && !new_epoch
            && cursor.next_id == Some(ev.event_id)
            && !seen.gap
            && !seen.midstream
            && state.stale.get(&worker).is_none();
        cursor.next_id = Some(ev.event_id + 1);
        if opens_snapshot {
            cursor.snapshot_clean = true;
            cursor.restating = restates;
            seen.opened = true;
            seen.restate.opens = restates;
            if restates {
                continue;
            }
        }
        count_event(state, &ev.data);
        seen.events.push(ev.data);
    }
    follow_tail(state, cursor, worker, header, &mut seen);
    seen.snapshot_done = header.snapshot && header.snapshot_end && cursor.snapshot_clean && !seen.gap;
    if header.snapshot_end {
        cursor.snapshot_clean = false;
        if std::mem::take(&mut cursor.restating) {
            seen.restate.ends = Some(seen.snapshot_done);
        }
    }
    seen.was_incomplete = std::mem::replace(&mut cursor.incomplete, header.incomplete);
    // Every event placed, and nothing open that a digest would not count yet.
    let settled = !seen.gap && !seen.midstream && !cursor.restating && !header.incomplete;
    let in_sequence = header.next_event_id.is_some() && cursor.next_id == header.next_event_id;
    seen.digest = header.digest.filter(|_| settled && in_sequence).map(|device| WorkerDigests {
        device,
        tiers: header.tier_digests,
        groups: header.group_digest,
    });
    let bucket = state.replicas.bucket(header.ts_ns);
    let new_bucket = std::mem::replace(&mut cursor.bucket, bucket) != bucket && bucket > 0;
    seen.checkpoint = cursor.next_id.filter(|_| settled && new_bucket);
    seen
}

/// The publisher's next event id shows events lost at the tail (a heartbeat after them).
fn follow_tail(state: &State, cursor: &mut Cursor, worker: WorkerId, header: &BatchHeader, seen: &mut Followed) {
    match (header.next_event_id, cursor.next_id) {
        (Some(n), Some(x)) if n > x => {
            tracing::debug!(worker = %worker, expected = x, next = n, "events lost at the tail");
            state.metrics.ingest.event_gaps.inc();
            seen.gap = true;
            cursor.snapshot_clean = false;
            cursor.next_id = Some(n);
        }
        (Some(n), None) => {
            seen.midstream |= n > 0;
            cursor.next_id = Some(n);
        }
        // A heartbeat without it tells nothing of the sequence.
        (None, None) => seen.midstream = true,
        _ => {}
    }
}

/// Counts one event by kind (host and disk copies apart: they go to their tier's own index).
fn count_event(state: &State, ev: &Event) {
    let metrics = &state.metrics;
    match ev {
        Event::Stored { tier, blocks, .. } if *tier != Tier::Device => {
            metrics.ingest.non_device_blocks.with_label_values(&[tier.as_str(), "stored"]).inc_by(blocks.len() as u64);
        }
        Event::Removed { tier, hashes } if *tier != Tier::Device => {
            metrics.ingest.non_device_blocks.with_label_values(&[tier.as_str(), "removed"]).inc_by(hashes.len() as u64);
        }
        Event::Stored { .. } | Event::GroupStored { .. } => metrics.hot.events_stored.inc(),
        Event::Removed { .. } | Event::GroupRemoved { .. } => metrics.hot.events_removed.inc(),
        Event::Cleared => metrics.hot.events_cleared.inc(),
    }
}

/// What the batch makes of the worker's stale flag: marked (a gap, mid-sequence, a snapshot
/// open, the publisher's own word that it misses blocks), or to be cleared once the batch is
/// applied (its snapshot is done, or a new epoch began): the generation to clear it at.
fn flag(state: &State, worker: WorkerId, header: &BatchHeader, seen: &Followed, mut clear_after: Option<u64>) -> Option<u64> {
    if header.snapshot && (seen.opened || header.snapshot_end) {
        state.health.snapshot_progress(worker, seen.opened, header.snapshot_end);
        let result = if seen.snapshot_done && seen.restate.ends.is_some() {
            "restated"
        } else if seen.snapshot_done {
            "complete"
        } else if header.snapshot_end {
            "gap"
        } else {
            "begun"
        };
        state.metrics.ingest.snapshots.with_label_values(&[result]).inc();
    }
    if seen.gap {
        state.log.warn("event_gap", || format!("worker {worker} skipped event ids; marked stale, asking it to resync"));
        state.stale.mark(worker, "event_gap");
    } else if seen.midstream {
        state.metrics.ingest.midstream_workers.inc();
        state.log.warn("midstream", || format!("worker {worker} first heard mid-sequence; stale until its snapshot"));
        state.stale.mark(worker, "midstream");
    } else if seen.snapshot_done {
        // Whole again once the snapshot is *applied*: cleared from the worker's apply thread,
        // after this batch, unless something marks it stale again meanwhile. A snapshot opened
        // and ended in this one batch is flagged too while it is applied: between its
        // `cleared` and its stores the worker's state is partial (not so in a restatement).
        if seen.opened && !seen.restate.opens {
            state.stale.mark_asked(worker, "snapshot_in_progress");
        }
        clear_after = state.stale.marked_at(&worker);
    } else if seen.opened && !seen.restate.opens {
        // Its state is partial until the snapshot ends: flag it, but ask for nothing unless
        // the snapshot stalls.
        state.stale.mark_asked(worker, "snapshot_in_progress");
    }
    // The publisher's own word that its block set misses blocks (a bridge started after its
    // engine): stale while it says so, whatever a snapshot from it says; whole once it stops.
    if header.incomplete || seen.was_incomplete {
        let flagged = state.stale.get(&worker).filter(|r| r.reason == INCOMPLETE).map(|r| r.generation);
        if header.incomplete {
            clear_after = None;
            if flagged.is_none() && !seen.gap && !seen.midstream {
                state.log.warn("incomplete", || {
                    format!("worker {worker} says it misses blocks its engine holds; stale while it does")
                });
                state.stale.mark_asked(worker, INCOMPLETE);
            }
        } else if flagged.is_some() && !seen.gap && !seen.midstream {
            clear_after = flagged;
        }
    }
    clear_after
}

/// Queues the events on the worker's apply thread (waiting for room: backpressure, never a
/// drop), then the clear of its stale flag at `clear_after`'s generation, if any.
fn hand_off<I: KvIndex>(
    state: &Arc<State>,
    pool: &ApplyPool<I>,
    worker: WorkerId,
    events: Vec<Event>,
    restate: Restate,
    stamp: Stamp,
    clear_after: Option<u64>,
) {
    if !events.is_empty() || restate != Restate::default() {
        stamp.observe(state);
        if let Err(full) = pool.try_apply(worker, events, stamp.ts_ns, restate) {
            tokio::task::block_in_place(|| pool.apply_full(full, stamp.ts_ns));
        }
    }
    if let Some(generation) = clear_after {
        let st = state.clone();
        let clear: Then = Box::new(move || st.stale.clear_if(worker, generation));
        if let Err(clear) = pool.try_then(worker, clear) {
            tokio::task::block_in_place(|| pool.then(worker, clear));
        }
    }
}

/// When a batch was published (its `ts_ns`, the publisher's clock) and received here.
#[derive(Clone, Copy)]
struct Stamp {
    /// Its publish time, ns since the Unix epoch (0: not said, so not timed).
    ts_ns: u64,
    /// When this replica received it.
    received: Instant,
}

impl Stamp {
    /// The stages before the apply thread (`transit`, `decode`) of a batch that says when it
    /// was published; the apply thread times the rest.
    fn observe(&self, state: &State) {
        if self.ts_ns == 0 {
            return;
        }
        let decoded = self.received.elapsed();
        let received_ns = super::state::now_ns().saturating_sub(decoded.as_nanos() as u64);
        let hot = &state.metrics.hot;
        if received_ns >= self.ts_ns {
            hot.stage_transit.observe((received_ns - self.ts_ns) as f64 / 1e9);
        }
        hot.stage_decode.observe(decoded.as_secs_f64());
    }
}

/// Takes up a saved worker's sequence (a snapshot being restored), within the same limits as
/// a new worker; false (counted and logged) if it cannot be tracked.
pub(super) fn resume(state: &State, w: WorkerId, epoch: u64, next_id: Option<u64>) -> bool {
    let mut cursors = state.cursors.lock();
    match cursors.admit(w, epoch, None, Instant::now(), &state.cfg) {
        Ok(c) => {
            c.epoch = epoch;
            c.next_id = next_id;
            true
        }
        Err(refusal) => {
            drop(cursors);
            refuse(state, w, refusal, 1);
            false
        }
    }
}

/// Counts and logs (at a bounded rate) a batch of a worker that cannot be tracked. Lookups
/// cannot name it (it holds nothing here); the metric and the log say who was refused.
fn refuse(state: &State, w: WorkerId, refusal: Refusal, events: usize) {
    let (reason, why) = match refusal {
        Refusal::Workers => ("max_workers", format!("all {} worker slots are taken (max_workers)", state.cfg.max_workers)),
        Refusal::DpRanks => {
            ("max_dp_ranks", format!("worker id {} already has {} dp ranks (max_dp_ranks)", w.worker_id, state.cfg.max_dp_ranks))
        }
        Refusal::OtherName(held) => (
            "name_conflict",
            format!("worker id {} is the engine named {held:?}'s while it lives; is a publisher misconfigured?", w.worker_id),
        ),
        Refusal::Unnamed => (
            "name_conflict",
            format!(
                "a batch of a new epoch does not name the engine that holds worker id {}; is a second publisher using it?",
                w.worker_id
            ),
        ),
    };
    state.metrics.ingest.refused_events.with_label_values(&[reason]).inc_by(events.max(1) as u64);
    state.log.warn(reason, || format!("refused the batches of worker {w}: {why}"));
}

/// The worker id of an events subject: canonical decimal only (no sign, no leading zero), so
/// `7`, `07` and `+7` cannot be three subjects for one worker, around subject permissions.
fn canonical_id(s: &str) -> Option<u64> {
    let canonical = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    canonical.then(|| s.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::canonical_id;

    #[test]
    fn only_canonical_decimal_names_a_worker() {
        assert_eq!(canonical_id("7"), Some(7));
        assert_eq!(canonical_id("0"), Some(0));
        assert_eq!(canonical_id("18446744073709551615"), Some(u64::MAX));
        for alias in ["007", "+7", "-7", " 7", "7 ", "", "0x7", "18446744073709551616", "7.0"] {
            assert_eq!(canonical_id(alias), None, "{alias:?}");
        }
    }
}
