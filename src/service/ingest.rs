//! Event batches in: decoding, the subject's authority, each worker's event sequence
//! (duplicates, gaps, epochs, snapshots), and the hand-off to the apply pool.

use super::State;
use crate::apply::{ApplyPool, Then};
use crate::config::Config;
use kvindex_client::protocol::{decode_batch, EventBatch};
use kvindex_core::hash::WorkerId;
use kvindex_core::index::KvIndex;
use kvindex_core::{Event, Tier};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

/// Where a worker's event sequence stands.
pub(super) struct Cursor {
    epoch: u64,
    /// The event id expected next; `None` until the first event of an epoch.
    next_id: Option<u64>,
    pub(super) last_seen: Instant,
    /// A snapshot opened with `cleared` and has had no gap since.
    snapshot_clean: bool,
    /// Its last batch said `incomplete`: only around such batches is its stale flag looked up.
    incomplete: bool,
}

/// Every worker's cursor, with what bounds them: each `(worker, dp rank)` costs state here and
/// a slot in the index, so one publisher must not take them all.
#[derive(Default)]
pub(super) struct Cursors {
    by_worker: HashMap<WorkerId, Cursor>,
    /// dp ranks tracked per worker id.
    ranks: HashMap<u64, u32>,
}

/// Why a new worker was not tracked; `reason()` is its metric label.
#[derive(Clone, Copy)]
enum Refusal {
    /// `max_workers` (worker, dp rank) pairs are tracked already.
    Workers,
    /// This worker id has `max_dp_ranks` ranks tracked already.
    DpRanks,
}

impl Cursors {
    /// The cursor of `w`, created if the limits allow.
    fn admit(&mut self, w: WorkerId, epoch: u64, now: Instant, cfg: &Config) -> Result<&mut Cursor, Refusal> {
        if !self.by_worker.contains_key(&w) {
            if self.by_worker.len() >= cfg.max_workers as usize {
                return Err(Refusal::Workers);
            }
            let ranks = self.ranks.entry(w.worker_id).or_default();
            if *ranks >= cfg.max_dp_ranks {
                return Err(Refusal::DpRanks);
            }
            *ranks += 1;
        }
        Ok(self.by_worker.entry(w).or_insert(Cursor {
            epoch,
            next_id: None,
            last_seen: now,
            snapshot_clean: false,
            incomplete: false,
        }))
    }

    /// Where every worker's sequence stands, for a snapshot: (worker, epoch, next event id).
    pub(super) fn positions(&self) -> Vec<(WorkerId, u64, Option<u64>)> {
        self.by_worker.iter().map(|(w, c)| (*w, c.epoch, c.next_id)).collect()
    }

    /// Every worker's sequence, as the inspect API shows it: (worker, epoch, next event id,
    /// when last heard from).
    pub(super) fn view(&self) -> Vec<(WorkerId, u64, Option<u64>, Instant)> {
        self.by_worker.iter().map(|(w, c)| (*w, c.epoch, c.next_id, c.last_seen)).collect()
    }

    /// Every worker tracked.
    pub(super) fn workers(&self) -> Vec<WorkerId> {
        self.by_worker.keys().copied().collect()
    }

    /// Forgets the workers silent for longer than `ttl`, and returns them.
    pub(super) fn expire(&mut self, now: Instant, ttl: Duration) -> Vec<WorkerId> {
        let gone: Vec<WorkerId> =
            self.by_worker.iter().filter(|(_, c)| now.duration_since(c.last_seen) > ttl).map(|(w, _)| *w).collect();
        for w in &gone {
            self.by_worker.remove(w);
            if let Some(n) = self.ranks.get_mut(&w.worker_id) {
                *n -= 1;
                if *n == 0 {
                    self.ranks.remove(&w.worker_id);
                }
            }
        }
        gone
    }
}

/// Applies one message from `{prefix}.events.{worker_id}`.
pub(super) fn ingest<I: KvIndex>(state: &Arc<State>, pool: &ApplyPool<I>, subject: &str, payload: &[u8]) {
    let m = &state.metrics;
    // Sharded, the NATS mapping appends this shard's number to the worker's subject.
    let token = subject.strip_prefix(state.events_prefix.as_str()).and_then(|t| t.strip_suffix(state.shard_suffix.as_str()));
    let Some(subject_id) = token.and_then(canonical_id) else {
        state.fail("bad_subject", || format!("events subject {subject:?} does not end in a worker id in canonical decimal"));
        return;
    };
    // A routed-only worker's blocks are what routers announce: events would fight them.
    if state.routed_only.contains(subject_id) {
        state.fail("routed_only", || format!("dropped events of worker {subject_id}: it is routed-only (routed_only_workers)"));
        return;
    }
    // Another shard's worker under this daemon's count: the server's mapping partitions by
    // another count than `shards` (or not at all). Held, it would answer for a worker every
    // merge ignores, and miss the events its own shard should get.
    if let Some(of) = state.cfg.shard_of() {
        if kvindex_client::shards::partition(subject_id, of.shards) != of.shard {
            state.fail("other_shard", || {
                format!(
                    "dropped events of worker {subject_id}: it is shard {} of {}'s, this is shard {}: does the NATS mapping partition by {}?",
                    kvindex_client::shards::partition(subject_id, of.shards),
                    of.shards,
                    of.shard,
                    of.shards
                )
            });
            return;
        }
    }
    let EventBatch { header: h, events } = match decode_batch(payload) {
        Ok(b) => b,
        Err(e) => {
            state.fail(e.reason(), || format!("dropped a message from worker {subject_id}: {e}"));
            return;
        }
    };
    m.batches_received.inc();
    if h.worker_id != subject_id {
        state.fail("worker_mismatch", || {
            format!("dropped a batch for worker {} sent on the subject of worker {subject_id}", h.worker_id)
        });
        return;
    }
    let w = WorkerId::new(h.worker_id, h.dp_rank);
    // A stale flag to clear once this batch is applied, with the generation it had here.
    let mut clear_after = None;
    let mut out = Vec::with_capacity(events.len() + 1);
    let mut cursors = state.cursors.lock();
    let now = Instant::now();
    let c = match cursors.admit(w, h.epoch, now, &state.cfg) {
        Ok(c) => c,
        Err(refusal) => {
            drop(cursors);
            refuse(state, w, refusal, events.len());
            return;
        }
    };
    if h.epoch < c.epoch {
        // A batch of the process this publisher replaced, delivered late: its events describe
        // a cache that no longer exists.
        let current = c.epoch;
        drop(cursors);
        state.fail("old_epoch", || format!("dropped a batch of worker {w} from epoch {} (now {current})", h.epoch));
        return;
    }
    c.last_seen = now;
    if c.epoch != h.epoch {
        // The publisher restarted: whatever it held before is gone.
        m.epochs_changed.inc();
        tracing::info!(worker = %w, old = c.epoch, new = h.epoch, "publisher restarted with a new epoch; clearing the worker");
        *c = Cursor { epoch: h.epoch, next_id: None, last_seen: now, snapshot_clean: false, incomplete: false };
        out.push(Event::Cleared);
        // Whole again once the `cleared` is applied (see `clear_after` below).
        clear_after = state.stale.get(&w).map(|r| r.generation);
    }
    let mut midstream = false;
    let mut gap = false;
    let mut opened = false;
    for ev in events {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                state.fail(e.reason(), || format!("skipped an event of worker {w}: {e}"));
                continue;
            }
        };
        let opens_snapshot = h.snapshot && ev.data == Event::Cleared;
        match c.next_id {
            // Nothing is known of this worker's sequence (first heard from, new epoch,
            // expired): unless it starts at event 0 or with a snapshot, events came before
            // that this index never saw.
            None => midstream = ev.event_id != 0 && !opens_snapshot,
            Some(n) if ev.event_id < n => {
                m.duplicate_events.inc();
                continue;
            }
            // A snapshot starts afresh, so events missed before it do not matter.
            Some(n) if ev.event_id > n && !opens_snapshot => {
                tracing::debug!(worker = %w, expected = n, got = ev.event_id, "event gap");
                m.event_gaps.inc();
                gap = true;
                c.snapshot_clean = false;
            }
            _ => {}
        }
        c.next_id = Some(ev.event_id + 1);
        if opens_snapshot {
            c.snapshot_clean = true;
            opened = true;
        }
        match &ev.data {
            // Host and disk copies go to their tier's own index (the apply pool routes them):
            // a removal there must not drop the device copy, and a store there is no GPU hit.
            Event::Stored { tier, blocks, .. } if *tier != Tier::Device => {
                m.non_device_blocks.with_label_values(&[tier.as_str(), "stored"]).inc_by(blocks.len() as u64);
            }
            Event::Removed { tier, hashes } if *tier != Tier::Device => {
                m.non_device_blocks.with_label_values(&[tier.as_str(), "removed"]).inc_by(hashes.len() as u64);
            }
            Event::Stored { .. } | Event::GroupStored { .. } => m.hot.events_stored.inc(),
            Event::Removed { .. } | Event::GroupRemoved { .. } => m.hot.events_removed.inc(),
            Event::Cleared => m.hot.events_cleared.inc(),
        }
        out.push(ev.data);
    }
    // The publisher's next event id shows events lost at the tail (a heartbeat after them).
    match (h.next_event_id, c.next_id) {
        (Some(n), Some(x)) if n > x => {
            tracing::debug!(worker = %w, expected = x, next = n, "events lost at the tail");
            m.event_gaps.inc();
            gap = true;
            c.snapshot_clean = false;
            c.next_id = Some(n);
        }
        (Some(n), None) => {
            midstream |= n > 0;
            c.next_id = Some(n);
        }
        // A heartbeat without it tells nothing of the sequence.
        (None, None) => midstream = true,
        _ => {}
    }
    let snapshot_done = h.snapshot && h.snapshot_end && c.snapshot_clean && !gap;
    if h.snapshot_end {
        c.snapshot_clean = false;
    }
    let was_incomplete = std::mem::replace(&mut c.incomplete, h.incomplete);
    drop(cursors);
    if h.snapshot && (opened || h.snapshot_end) {
        state.snapshot_progress(w, opened, h.snapshot_end);
        m.snapshots
            .with_label_values(&[if snapshot_done {
                "complete"
            } else if h.snapshot_end {
                "gap"
            } else {
                "begun"
            }])
            .inc();
    }
    if gap {
        state.log.warn("event_gap", || format!("worker {w} skipped event ids; marked stale, asking it to resync"));
        state.mark_stale(w, "event_gap");
    } else if midstream {
        m.midstream_workers.inc();
        state.log.warn("midstream", || format!("worker {w} first heard mid-sequence; stale until its snapshot"));
        state.mark_stale(w, "midstream");
    } else if snapshot_done {
        // Whole again once the snapshot is *applied*: cleared from the worker's apply thread,
        // after this batch, unless something marks it stale again meanwhile.
        // A snapshot opened and ended in this one batch is flagged too while it is applied:
        // between its `cleared` and its stores the worker's state is partial.
        if opened {
            state.mark_stale_asked(w, "snapshot_in_progress");
        }
        clear_after = state.stale.get(&w).map(|r| r.generation);
    } else if opened {
        // Its state is partial until the snapshot ends: flag it, but ask for nothing unless
        // the snapshot stalls.
        state.mark_stale_asked(w, "snapshot_in_progress");
    }
    // The publisher's own word that its block set misses blocks (a bridge started after its
    // engine): stale while it says so, whatever a snapshot from it says; whole once it stops.
    if h.incomplete || was_incomplete {
        let flagged = state.stale.get(&w).filter(|r| r.reason == INCOMPLETE).map(|r| r.generation);
        if h.incomplete {
            clear_after = None;
            if flagged.is_none() && !gap && !midstream {
                state
                    .log
                    .warn("incomplete", || format!("worker {w} says it misses blocks its engine holds; stale while it does"));
                state.mark_stale_asked(w, INCOMPLETE);
            }
        } else if flagged.is_some() && !gap && !midstream {
            clear_after = flagged;
        }
    }
    if !out.is_empty() {
        if let Err(full) = pool.try_apply(w, out, h.ts_ns) {
            // Backpressure: wait for the worker's apply thread rather than drop anything.
            tokio::task::block_in_place(|| pool.apply(full.worker, full.events, h.ts_ns));
        }
    }
    if let Some(generation) = clear_after {
        let st = state.clone();
        let clear: Then = Box::new(move || st.clear_stale_if(w, generation));
        if let Err(clear) = pool.try_then(w, clear) {
            tokio::task::block_in_place(|| pool.then(w, clear));
        }
    }
}

/// The stale reason of a worker whose publisher says it misses blocks: asking it to resync
/// cannot help, so it is not asked.
pub(super) const INCOMPLETE: &str = "incomplete";

/// Takes up a saved worker's sequence (a snapshot being restored), within the same limits as
/// a new worker; false (counted and logged) if it cannot be tracked.
pub(super) fn resume(state: &State, w: WorkerId, epoch: u64, next_id: Option<u64>) -> bool {
    let mut cursors = state.cursors.lock();
    match cursors.admit(w, epoch, Instant::now(), &state.cfg) {
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
    };
    state.metrics.refused_events.with_label_values(&[reason]).inc_by(events.max(1) as u64);
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
