//! Each worker's place in its event sequence (epoch, next event id, last heard, snapshot
//! state), with the bounds that keep one publisher from taking every slot, and the rule that
//! a worker id has one name while it lives.

use crate::config::Config;
use kvindex_core::hash::WorkerId;
use kvindex_core::names::WorkerInfo;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Each named worker id's info. Written under the cursors' lock (by ingest, only when a
/// publisher's info changes, and when its last rank expires); read by lookups and the HTTP
/// APIs without that lock. Its keys are tracked worker ids: bounded by `max_workers`.
pub(super) type Names = dashmap::DashMap<u64, Arc<WorkerInfo>>;

/// Where a worker's event sequence stands.
pub(super) struct Cursor {
    /// The publisher's epoch (a new one: the publisher restarted).
    pub(super) epoch: u64,
    /// The event id expected next; `None` until the first event of an epoch.
    pub(super) next_id: Option<u64>,
    /// When its last batch arrived (events or heartbeat), for the TTL.
    pub(super) last_seen: Instant,
    /// A snapshot opened with `cleared` and has had no gap since.
    pub(super) snapshot_clean: bool,
    /// Its last batch said `incomplete`: only around such batches is its stale flag looked up.
    pub(super) incomplete: bool,
    /// A snapshot of it, held whole when it opened, is being applied as a difference (a
    /// restatement) until the snapshot ends.
    pub(super) restating: bool,
    /// The interval of publisher time its last batch fell in ([`super::replicas`]): a batch in
    /// a new one is checkpointed.
    pub(super) bucket: u64,
}

impl Cursor {
    /// A cursor at the start of `epoch`: nothing known of its sequence.
    pub(super) fn start(epoch: u64, now: Instant) -> Cursor {
        Cursor { epoch, next_id: None, last_seen: now, snapshot_clean: false, incomplete: false, restating: false, bucket: 0 }
    }
}

/// Every worker's cursor, with what bounds them: each `(worker, dp rank)` costs state here and
/// a slot in the index, so one publisher must not take them all.
pub(super) struct Cursors {
    /// Each tracked (worker, dp rank)'s cursor.
    by_worker: HashMap<WorkerId, Cursor>,
    /// dp ranks tracked per worker id.
    ranks: HashMap<u64, u32>,
    /// The names of the tracked worker ids that gave one; an entry goes with its last rank.
    names: Arc<Names>,
}

/// Why a batch's worker was not tracked, or its batch not taken.
#[derive(Clone, Debug)]
pub(super) enum Refusal {
    /// `max_workers` (worker, dp rank) pairs are tracked already.
    Workers,
    /// This worker id has `max_dp_ranks` ranks tracked already.
    DpRanks,
    /// The worker id is another engine's, by this name, while that one lives.
    OtherName(String),
    /// A batch of a new epoch without the name of the engine that holds the worker id: a
    /// publisher that names itself does so on the first batch of every epoch.
    Unnamed,
}

impl Cursors {
    /// No worker yet; names go to `names`.
    pub(super) fn new(names: Arc<Names>) -> Cursors {
        Cursors { by_worker: HashMap::new(), ranks: HashMap::new(), names }
    }

    /// The cursor of `w`, created if the limits allow, for a batch of `epoch` that says it is
    /// `info` (or says nothing): one name per worker id while it lives.
    pub(super) fn admit(
        &mut self,
        w: WorkerId,
        epoch: u64,
        info: Option<&WorkerInfo>,
        now: Instant,
        cfg: &Config,
    ) -> Result<&mut Cursor, Refusal> {
        // Read in place (no clone per batch); the guard ends before the insert below.
        let renamed = {
            let held = self.names.get(&w.worker_id);
            match (held.as_deref(), info) {
                (Some(held), Some(info)) if held.name != info.name => return Err(Refusal::OtherName(held.name.clone())),
                (Some(_), None) if self.by_worker.get(&w).is_some_and(|c| epoch > c.epoch) => return Err(Refusal::Unnamed),
                (held, Some(info)) => held.map(|h| h.as_ref()) != Some(info),
                (_, None) => false,
            }
        };
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
        if let Some(info) = info.filter(|_| renamed) {
            self.names.insert(w.worker_id, Arc::new(info.clone()));
        }
        Ok(self.by_worker.entry(w).or_insert(Cursor::start(epoch, now)))
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
                    self.names.remove(&w.worker_id);
                }
            }
        }
        gone
    }
}
