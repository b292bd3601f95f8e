//! The apply pool (DESIGN §2): a fixed set of threads that apply KV events to the index.
//! Every event of a worker goes to the same thread (by hash of its identity), so a worker's
//! events apply in order and its writer (reverse map) is owned by that thread alone. Queues
//! are bounded: a full queue blocks the sender (backpressure), nothing is dropped.

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use kvindex_core::hash::WorkerId;
use kvindex_core::index::{ApplyOutcome, KvIndex, Saved};
use kvindex_core::seeded::{SeededMap, SeededState};
use kvindex_core::tiers::{OtherTiers, SavedTiers, TierWriters};
use kvindex_core::{Event, Tier};
use parking_lot::Mutex;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Called on the apply thread after each batch: the worker, what the batch did, its tag, and
/// when the thread took it from its queue.
pub type OnApplied = Arc<dyn Fn(WorkerId, &ApplyOutcome, u64, std::time::Instant) + Send + Sync>;

/// Work to run on a worker's apply thread once its queued events are applied.
pub type Then = Box<dyn FnOnce() + Send>;

enum Command {
    Apply {
        worker: WorkerId,
        events: Vec<Event>,
        tag: u64,
    },
    Then(Then),
    RemoveWorker(WorkerId),
    /// Sends every worker of the thread, saved, then drops the sender.
    Save(Sender<SavedWorker>),
    /// Sends what each worker of the thread holds, then drops the sender.
    Held(Sender<WorkerHeld>),
    /// Sends one worker, saved (`None` if the thread has no such worker).
    SaveOne(WorkerId, Sender<Option<SavedWorker>>),
    /// Rebuilds a worker from a snapshot.
    Restore(Box<SavedWorker>),
    Flush(Sender<()>),
}

/// The queue of a thread was full; the batch is handed back.
/// One worker as a snapshot keeps it: its blocks in every tier.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedWorker {
    /// The worker and dp rank.
    pub worker: WorkerId,
    /// Its GPU blocks.
    pub device: Saved,
    /// Its host and disk blocks.
    pub tiers: SavedTiers,
}

/// What one worker holds in each tier (engine hashes), as its apply thread counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerHeld {
    /// The worker and dp rank.
    pub worker: WorkerId,
    /// Its GPU blocks.
    pub device: u64,
    /// Its host-memory blocks.
    pub host: u64,
    /// Its disk blocks.
    pub disk: u64,
    /// Batches waiting in its apply thread's queue.
    pub queued: usize,
}

#[derive(Debug)]
pub struct QueueFull {
    pub worker: WorkerId,
    pub events: Vec<Event>,
}

/// Counters of the pool, for metrics.
#[derive(Default)]
pub struct PoolStats {
    /// Batches applied (a batch refused for want of a worker slot is reported to the hook and
    /// in [`ApplyPool::totals`] as [`ApplyOutcome::refused`] instead).
    pub batches: AtomicU64,
}

/// A fixed pool of apply threads over one index.
pub struct ApplyPool<I: KvIndex> {
    index: Arc<I>,
    /// The host and disk tiers' indexes, when kept; without them their events are ignored.
    others: Option<Arc<OtherTiers<I>>>,
    senders: Vec<Sender<Command>>,
    handles: Vec<JoinHandle<()>>,
    totals: Arc<Vec<Mutex<ApplyOutcome>>>,
    stats: Arc<PoolStats>,
    /// Picks a worker's thread; seeded, so that chosen worker ids cannot pile onto one thread.
    spread: SeededState,
}

impl<I: KvIndex> ApplyPool<I> {
    /// Starts `threads` apply threads, each with a queue of `queue_capacity` batches. Events
    /// of the host and disk tiers are ignored.
    pub fn new(index: Arc<I>, threads: usize, queue_capacity: usize, on_applied: Option<OnApplied>) -> Self {
        Self::with_tiers(index, None, threads, queue_capacity, on_applied)
    }

    /// As [`ApplyPool::new`], applying host and disk events to `others`.
    pub fn with_tiers(
        index: Arc<I>,
        others: Option<Arc<OtherTiers<I>>>,
        threads: usize,
        queue_capacity: usize,
        on_applied: Option<OnApplied>,
    ) -> Self {
        let threads = threads.max(1);
        let totals: Arc<Vec<Mutex<ApplyOutcome>>> = Arc::new((0..threads).map(|_| Mutex::default()).collect());
        let stats = Arc::new(PoolStats::default());
        let mut senders = Vec::with_capacity(threads);
        let mut handles = Vec::with_capacity(threads);
        for t in 0..threads {
            let (tx, rx) = bounded(queue_capacity.max(1));
            senders.push(tx);
            let (index, others, totals, stats, hook) =
                (index.clone(), others.clone(), totals.clone(), stats.clone(), on_applied.clone());
            let handle = std::thread::Builder::new()
                .name(format!("kvindex-apply-{t}"))
                .spawn(move || apply_loop(&*index, others.as_deref(), rx, &totals[t], &stats, hook))
                .expect("spawning an apply thread");
            handles.push(handle);
        }
        ApplyPool { index, others, senders, handles, totals, stats, spread: SeededState::default() }
    }

    /// The index the pool writes to.
    pub fn index(&self) -> &Arc<I> {
        &self.index
    }

    /// The host and disk tiers' indexes, if kept.
    pub fn others(&self) -> Option<&Arc<OtherTiers<I>>> {
        self.others.as_ref()
    }

    fn thread_of(&self, worker: WorkerId) -> usize {
        (self.spread.hash_one(worker) % self.senders.len() as u64) as usize
    }

    /// Queues a worker's batch, waiting while its thread's queue is full.
    pub fn apply(&self, worker: WorkerId, events: Vec<Event>, tag: u64) {
        let t = self.thread_of(worker);
        // Send fails only once the thread has exited, which happens only on shutdown.
        let _ = self.senders[t].send(Command::Apply { worker, events, tag });
    }

    /// Queues a worker's batch, or hands it back if its thread's queue is full.
    pub fn try_apply(&self, worker: WorkerId, events: Vec<Event>, tag: u64) -> Result<(), QueueFull> {
        let t = self.thread_of(worker);
        match self.senders[t].try_send(Command::Apply { worker, events, tag }) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(Command::Apply { worker, events, .. })) => Err(QueueFull { worker, events }),
            Err(_) => Ok(()),
        }
    }

    /// Runs `f` on `worker`'s apply thread after the events queued for it so far, waiting
    /// while the queue is full.
    pub fn then(&self, worker: WorkerId, f: Then) {
        let _ = self.senders[self.thread_of(worker)].send(Command::Then(f));
    }

    /// As [`ApplyPool::then`], or hands `f` back if the queue is full.
    pub fn try_then(&self, worker: WorkerId, f: Then) -> Result<(), Then> {
        match self.senders[self.thread_of(worker)].try_send(Command::Then(f)) {
            Err(TrySendError::Full(Command::Then(f))) => Err(f),
            _ => Ok(()),
        }
    }

    /// Drops every block of `worker` and frees its slot, after its queued events.
    /// Every worker, saved by its own thread once the events queued before this call are
    /// applied (and none queued after): the state those events leave, at no pause of ingest.
    pub fn save(&self) -> Receiver<SavedWorker> {
        let (tx, rx) = crossbeam_channel::unbounded();
        for s in &self.senders {
            let _ = s.send(Command::Save(tx.clone()));
        }
        rx
    }

    /// What every worker holds, counted by its own thread after the events queued before
    /// this call.
    pub fn held(&self) -> Vec<WorkerHeld> {
        let (tx, rx) = crossbeam_channel::unbounded();
        for s in &self.senders {
            let _ = s.send(Command::Held(tx.clone()));
        }
        drop(tx);
        let depths = self.queue_depths();
        let mut out: Vec<WorkerHeld> = rx.iter().map(|h| WorkerHeld { queued: depths[self.thread_of(h.worker)], ..h }).collect();
        out.sort_unstable_by_key(|h| h.worker);
        out
    }

    /// One worker, saved by its thread after the events queued before this call (`None`
    /// if the pool does not know it).
    pub fn save_worker(&self, worker: WorkerId) -> Option<SavedWorker> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _ = self.senders[self.thread_of(worker)].send(Command::SaveOne(worker, tx));
        rx.recv().ok().flatten()
    }

    /// Rebuilds `saved`'s worker (which must hold nothing yet) after the events queued
    /// before it; its outcome goes to the hook like an event's.
    pub fn restore(&self, saved: SavedWorker) {
        let _ = self.senders[self.thread_of(saved.worker)].send(Command::Restore(Box::new(saved)));
    }

    pub fn remove_worker(&self, worker: WorkerId) {
        let _ = self.senders[self.thread_of(worker)].send(Command::RemoveWorker(worker));
    }

    /// Returns once everything queued before the call has been applied.
    pub fn flush(&self) {
        let (tx, rx) = bounded(self.senders.len());
        for s in &self.senders {
            let _ = s.send(Command::Flush(tx.clone()));
        }
        drop(tx);
        while rx.recv().is_ok() {}
    }

    /// Batches waiting in each thread's queue.
    pub fn queue_depths(&self) -> Vec<usize> {
        self.senders.iter().map(|s| s.len()).collect()
    }

    /// Everything the pool's batches did so far.
    pub fn totals(&self) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        for t in self.totals.iter() {
            out.add(&t.lock());
        }
        out
    }

    /// Apply threads that have exited (a panic in the index or the hook): their workers'
    /// events can no longer be applied, so the daemon must stop and be restarted.
    pub fn dead_threads(&self) -> usize {
        self.handles.iter().filter(|h| h.is_finished()).count()
    }

    /// The pool's counters.
    pub fn stats(&self) -> &PoolStats {
        &self.stats
    }

    /// Applies what is queued, then stops the threads.
    pub fn shutdown(mut self) {
        self.senders.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// A worker's write state: its device writer, and its host and disk writers when it has some.
struct Writers<W> {
    device: W,
    others: TierWriters<W>,
}

/// The writers of `worker`, created on its first command. `None` when the registry is full:
/// then `refused` is reported to the hook, not logged here (the hook counts it and logs at a
/// bounded rate, so a flood of new workers does not flood the log).
fn writers_of<'a, I: KvIndex>(
    writers: &'a mut SeededMap<WorkerId, Writers<I::Writer>>,
    index: &I,
    worker: WorkerId,
    refused: u64,
    total: &Mutex<ApplyOutcome>,
    hook: &Option<OnApplied>,
) -> Option<&'a mut Writers<I::Writer>> {
    match writers.entry(worker) {
        std::collections::hash_map::Entry::Occupied(o) => Some(o.into_mut()),
        std::collections::hash_map::Entry::Vacant(v) => match index.writer(worker) {
            Ok(w) => Some(v.insert(Writers { device: w, others: TierWriters::default() })),
            Err(_) => {
                let out = ApplyOutcome { refused, ..ApplyOutcome::default() };
                total.lock().add(&out);
                if let Some(h) = hook {
                    h(worker, &out, 0, std::time::Instant::now());
                }
                None
            }
        },
    }
}

fn apply_loop<I: KvIndex>(
    index: &I,
    others: Option<&OtherTiers<I>>,
    rx: Receiver<Command>,
    total: &Mutex<ApplyOutcome>,
    stats: &PoolStats,
    hook: Option<OnApplied>,
) {
    let mut writers: SeededMap<WorkerId, Writers<I::Writer>> = SeededMap::default();
    for cmd in rx {
        match cmd {
            Command::Apply { worker, events, tag } => {
                let taken = std::time::Instant::now();
                let Some(w) = writers_of(&mut writers, index, worker, events.len() as u64, total, &hook) else { continue };
                let mut out = ApplyOutcome::default();
                for ev in &events {
                    out.add(&ev.apply_to(index, &mut w.device));
                    if let Some(others) = others {
                        let tier = match ev {
                            Event::Cleared => others.clear(&mut w.others),
                            Event::Stored { tier: Tier::Device, .. } | Event::Removed { tier: Tier::Device, .. } => continue,
                            _ => others.apply(worker, &mut w.others, ev),
                        };
                        // Another tier's counts are its own: only refusals and orphans are told.
                        out.refused += tier.refused;
                        out.tier_unplaceable += tier.unplaceable;
                    }
                }
                total.lock().add(&out);
                stats.batches.fetch_add(1, Ordering::Relaxed);
                if let Some(h) = &hook {
                    h(worker, &out, tag, taken);
                }
            }
            Command::RemoveWorker(worker) => {
                if let Some(w) = writers.remove(&worker) {
                    let out = index.remove_worker(w.device);
                    if let Some(others) = others {
                        others.remove_worker(w.others);
                    }
                    total.lock().add(&out);
                }
            }
            Command::Save(tx) => {
                for (&worker, w) in writers.iter() {
                    let tiers = others.map(|o| o.save(&w.others)).unwrap_or_default();
                    let _ = tx.send(SavedWorker { worker, device: index.save(&w.device), tiers });
                }
            }
            Command::Held(tx) => {
                for (&worker, w) in writers.iter() {
                    let (host, disk) = others.map_or((0, 0), |o| o.held(&w.others));
                    let _ = tx.send(WorkerHeld { worker, device: index.held(&w.device), host, disk, queued: 0 });
                }
            }
            Command::SaveOne(worker, tx) => {
                let saved = writers.get(&worker).map(|w| SavedWorker {
                    worker,
                    device: index.save(&w.device),
                    tiers: others.map(|o| o.save(&w.others)).unwrap_or_default(),
                });
                let _ = tx.send(saved);
            }
            Command::Restore(saved) => {
                let taken = std::time::Instant::now();
                let Some(w) = writers_of(&mut writers, index, saved.worker, 1, total, &hook) else { continue };
                let mut out = index.restore(&mut w.device, &saved.device);
                if let Some(others) = others {
                    let tier = others.restore(saved.worker, &mut w.others, &saved.tiers);
                    out.refused += tier.refused;
                    out.tier_unplaceable += tier.unplaceable;
                }
                total.lock().add(&out);
                if let Some(h) = &hook {
                    h(saved.worker, &out, 0, taken);
                }
            }
            Command::Then(f) => f(),
            Command::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

impl<I: KvIndex> Drop for ApplyPool<I> {
    fn drop(&mut self) {
        self.senders.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
