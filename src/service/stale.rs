//! Stale workers: those whose state here may be out of date (a gap in their events, a snapshot
//! in progress, a block that could not be placed, ...), each with why, since when and the
//! resync requests sent to it. Lookups flag them; the resync loop asks them for snapshots.
//!
//! Invariant: the generation moves before a flag is cleared and whenever one is set, so a
//! lookup that read the flags and then sees the generation unchanged answered from one state
//! of the flags, and a clear queued behind a snapshot does not undo a later mark.

use crate::metrics::Metrics;
use dashmap::DashMap;
use kvindex_core::hash::WorkerId;
use kvindex_core::model::Staleness;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// Resync requests to one stale worker: when the last went out and how many have.
#[derive(Clone, Copy)]
pub(super) struct Resync {
    /// When the last request went out (none yet: its snapshot is awaited without one).
    pub(super) asked: Option<Instant>,
    /// Requests sent since it went stale.
    pub(super) attempts: u32,
    /// When it was last marked stale (see [`Stale::generation`]).
    pub(super) generation: u64,
    /// Why it was last marked stale, as the inspect API names it.
    pub(super) reason: &'static str,
    /// Since when it is stale.
    pub(super) since: Instant,
}

/// The stale reason of a worker whose publisher says it misses blocks: asking it to resync
/// cannot help, so it is not asked.
pub(super) const INCOMPLETE: &str = "incomplete";

/// The stale workers.
pub(super) struct Stale {
    /// Each stale worker and the resync requests sent to it.
    workers: DashMap<WorkerId, Resync>,
    /// Bumped whenever a worker is marked stale or cleared (the module's invariant).
    generation: AtomicU64,
    /// Workers to ask for a resync at once (the resync loop takes them).
    asks: mpsc::UnboundedSender<WorkerId>,
    /// `kvindex_stale_workers` follows the count.
    metrics: Arc<Metrics>,
}

impl Stale {
    /// None stale; workers to ask at once go to `asks`.
    pub(super) fn new(asks: mpsc::UnboundedSender<WorkerId>, metrics: Arc<Metrics>) -> Self {
        Stale { workers: DashMap::new(), generation: AtomicU64::new(0), asks, metrics }
    }

    /// The generation now (see the module's invariant).
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Marks `w` stale and asks it to resync at once, unless it is stale already: then its
    /// backoff stands (whatever marks it stale again, requests keep doubling their interval
    /// until a snapshot completes), so a publisher that keeps sending what cannot be placed
    /// is not asked again on every batch.
    pub(super) fn mark(&self, w: WorkerId, reason: &'static str) {
        if self.mark_as(w, false, reason) {
            let _ = self.asks.send(w);
        }
    }

    /// Marks `w` stale as already asked (its snapshot is open, or a broadcast went out): a
    /// per-worker request follows only if the snapshot does not end within the backoff.
    pub(super) fn mark_asked(&self, w: WorkerId, reason: &'static str) {
        self.mark_as(w, true, reason);
    }

    /// Marks `w` stale for `reason` under a new generation (so a clear pending from an
    /// earlier snapshot does not undo it); whether it was not stale before.
    fn mark_as(&self, w: WorkerId, asked: bool, reason: &'static str) -> bool {
        let generation = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        match self.workers.entry(w) {
            dashmap::mapref::entry::Entry::Vacant(v) => {
                let asked = asked.then(Instant::now);
                v.insert(Resync { asked, attempts: asked.is_some() as u32, generation, reason, since: Instant::now() });
                self.metrics.workers.stale_workers.inc();
                true
            }
            dashmap::mapref::entry::Entry::Occupied(mut o) => {
                o.get_mut().generation = generation;
                o.get_mut().reason = reason;
                false
            }
        }
    }

    /// Clears `w`'s flag if nothing marked it stale again since `generation` was read. The
    /// generation moves first, so a lookup that saw the flag gone sees it moved too.
    pub(super) fn clear_if(&self, w: WorkerId, generation: u64) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.workers.remove_if(&w, |_, r| r.generation == generation).is_some() {
            self.metrics.workers.stale_workers.dec();
        }
    }

    /// Clears `w`'s flag whatever marked it.
    pub(super) fn clear(&self, w: WorkerId) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.workers.remove(&w).is_some() {
            self.metrics.workers.stale_workers.dec();
        }
    }

    /// `w`'s resync state, if it is stale.
    pub(super) fn get(&self, w: &WorkerId) -> Option<Resync> {
        self.workers.get(w).map(|r| *r)
    }

    /// The generation `w` was last marked stale under, if it is.
    pub(super) fn marked_at(&self, w: &WorkerId) -> Option<u64> {
        self.workers.get(w).map(|r| r.generation)
    }

    /// Changes `w`'s resync state in place, if it is stale; `f`'s answer.
    pub(super) fn update<T>(&self, w: &WorkerId, f: impl FnOnce(&mut Resync) -> T) -> Option<T> {
        self.workers.get_mut(w).map(|mut r| f(&mut r))
    }

    /// Every stale worker.
    pub(super) fn list(&self) -> Vec<WorkerId> {
        self.workers.iter().map(|e| *e.key()).collect()
    }
}

impl Staleness for Stale {
    fn any(&self) -> bool {
        !self.workers.is_empty()
    }

    fn contains(&self, worker: WorkerId) -> bool {
        self.workers.contains_key(&worker)
    }

    fn for_each(&self, f: &mut dyn FnMut(WorkerId)) {
        for e in self.workers.iter() {
            f(*e.key());
        }
    }
}
