//! Whether this replica may answer: connected to NATS, rebuilt since the last broadcast resync
//! (its publishers' snapshots in, or restored from a snapshot of the index), caught up with
//! its JetStream stream, and in the lookup queue group. What `/readyz` says and lookups follow.

use super::catch_up::CatchUp;
use crate::metrics::Metrics;
use kvindex_core::hash::WorkerId;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether the index has been rebuilt since the last broadcast resync.
pub(super) struct Readiness {
    /// When the last broadcast resync went out.
    pub(super) broadcast_at: Instant,
    /// Snapshots begun (opening `cleared`) and not yet ended.
    open: HashSet<WorkerId>,
    /// Snapshots ended since the broadcast.
    completed: u64,
    /// When a snapshot last began or ended.
    last_activity: Instant,
    /// Rebuilt since the broadcast.
    ready: bool,
}

impl Readiness {
    /// Not ready, as if a broadcast went out now.
    fn new() -> Self {
        let now = Instant::now();
        Readiness { broadcast_at: now, open: HashSet::new(), completed: 0, last_activity: now, ready: false }
    }
}

/// When a rebuild counts as done: no snapshot open for `settle`, or `timeout` after the broadcast.
pub(super) struct RebuildWait {
    /// Quiet this long after the last snapshot began or ended.
    pub(super) settle: Duration,
    /// At most this long after the broadcast.
    pub(super) timeout: Duration,
}

/// The replica's health.
pub(super) struct Health {
    /// Connected to NATS.
    pub(super) connected: AtomicBool,
    /// Rebuilt since the last broadcast.
    readiness: Mutex<Readiness>,
    /// Connected, rebuilt and caught up: what `/readyz` says, and when this replica joins the
    /// lookup queue group.
    pub(super) ready: tokio::sync::watch::Sender<bool>,
    /// In the lookup queue group, the server acknowledging the subscriptions.
    pub(super) member: AtomicBool,
    /// Sharded: the NATS mapping brought this shard an event of a worker another shard owns
    /// under its count, so the deployment's count has changed (or the mapping is wrong) and
    /// this shard no longer hears all its workers. Out of lookups for good: never ready again.
    superseded: AtomicBool,
    /// JetStream: whether the replica has caught up with the stream (always in core mode).
    pub(super) caught_up: CatchUp,
    /// When a rebuild counts as done.
    wait: RebuildWait,
    /// `kvindex_ready` and `kvindex_rebuild_seconds`.
    metrics: Arc<Metrics>,
}

impl Health {
    /// Not connected, not ready; `durable`: there is a stream to catch up with first.
    pub(super) fn new(durable: bool, wait: RebuildWait, metrics: Arc<Metrics>) -> Self {
        Health {
            connected: AtomicBool::new(false),
            readiness: Mutex::new(Readiness::new()),
            ready: tokio::sync::watch::Sender::new(false),
            member: AtomicBool::new(false),
            superseded: AtomicBool::new(false),
            caught_up: CatchUp::new(!durable),
            wait,
            metrics,
        }
    }

    /// When the last broadcast resync went out.
    pub(super) fn broadcast_at(&self) -> Instant {
        self.readiness.lock().broadcast_at
    }

    /// A broadcast resync went out: not ready until the publishers' snapshots are in.
    pub(super) fn begin_rebuild(&self) {
        *self.readiness.lock() = Readiness::new();
        self.ready.send_replace(false);
        self.metrics.workers.ready.set(0);
    }

    /// This shard's count is not the mapping's any more: it leaves lookups for good. True
    /// the first time, so the caller says it once.
    pub(super) fn supersede(&self) -> bool {
        let first = !self.superseded.swap(true, Ordering::Relaxed);
        self.metrics.workers.superseded.set(1);
        first
    }

    /// Rebuilt without a broadcast (from a snapshot of the index and the stream after it).
    pub(super) fn rebuilt(&self) {
        self.readiness.lock().ready = true;
    }

    /// A worker's snapshot `opened` (its `cleared`) or `ended`.
    pub(super) fn snapshot_progress(&self, w: WorkerId, opened: bool, ended: bool) {
        let mut r = self.readiness.lock();
        r.last_activity = Instant::now();
        if opened {
            r.open.insert(w);
        }
        if ended {
            r.open.remove(&w);
            r.completed += 1;
        }
    }

    /// Re-evaluates readiness; logs and records the rebuild when it completes.
    pub(super) fn check_ready(&self) {
        let connected = self.connected.load(Ordering::Relaxed);
        let mut r = self.readiness.lock();
        if !r.ready {
            let now = Instant::now();
            let quiet = r.open.is_empty() && now.duration_since(r.last_activity.max(r.broadcast_at)) >= self.wait.settle;
            let timed_out = now.duration_since(r.broadcast_at) >= self.wait.timeout;
            if connected && (quiet || timed_out) {
                r.ready = true;
                let took = now.duration_since(r.broadcast_at).as_secs_f64();
                self.metrics.workers.rebuild_seconds.set(took);
                if quiet {
                    tracing::info!(
                        snapshots = r.completed,
                        seconds = took,
                        "ready: index rebuilt from the publishers' snapshots"
                    );
                } else {
                    tracing::warn!(
                        snapshots = r.completed,
                        still_open = r.open.len(),
                        seconds = took,
                        "ready after ready_timeout with snapshots still open; those workers stay stale until they finish"
                    );
                }
            }
        }
        let ready = connected && r.ready && self.caught_up.is_done() && !self.superseded.load(Ordering::Relaxed);
        self.ready.send_if_modified(|now| std::mem::replace(now, ready) != ready);
        self.metrics.workers.ready.set(ready as i64);
    }

    /// What `/readyz` answers: ready, or why not.
    pub(super) fn readyz(&self) -> (bool, &'static str) {
        let ready = *self.ready.borrow();
        if self.superseded.load(Ordering::Relaxed) {
            return (false, "superseded: the NATS mapping partitions workers by another shard count; restart this shard with the deployment's --shards\n");
        }
        match (ready, self.connected.load(Ordering::Relaxed), self.member.load(Ordering::Relaxed)) {
            (true, _, true) => (true, "ready: answering lookups\n"),
            (true, _, false) => (false, "rebuilt; joining the lookup queue group\n"),
            (false, false, _) => (false, "not connected to NATS\n"),
            (false, true, _) if !self.caught_up.is_done() => (false, "catching up with the JetStream stream\n"),
            (false, true, _) => (false, "rebuilding the index from publishers' snapshots\n"),
        }
    }
}
