//! The apply pool (docs/ARCHITECTURE.md): a fixed set of threads that apply KV events to the
//! model (`kvindex_core::model`). Every event of a worker goes to the same thread (by hash of
//! its identity), so a worker's events apply in order and its writers are owned by that thread
//! alone. Queues are bounded: a full queue blocks the sender (backpressure), nothing is dropped.
//!
//! Routers' announced placements go through the same threads: a worker's predictions and its
//! routed-only blocks are written by its own thread, like its events.

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use kvindex_core::announced::AnnounceOutcome;
use kvindex_core::digest::WorkerDigests;
use kvindex_core::hash::{LocalHash, WorkerId};
use kvindex_core::index::{ApplyOutcome, KvIndex};
use kvindex_core::model::{Model, Restate, SavedWorker, WorkerHeld, Writers};
use kvindex_core::seeded::SeededState;
use kvindex_core::Event;
use parking_lot::Mutex;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Called on the apply thread after each batch: the worker, what the batch did, its tag, and
/// when it was queued and taken.
pub type OnApplied = Arc<dyn Fn(WorkerId, &ApplyOutcome, u64, Timing) + Send + Sync>;

/// When a batch was queued and when its thread took it: the stages the hook can time.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// When it was first offered to its thread's queue (a full queue's wait counts as queued).
    pub queued: Instant,
    /// When its thread took it from the queue, and applying began.
    pub taken: Instant,
}

/// Work to run on a worker's apply thread once its queued events are applied.
pub type Then = Box<dyn FnOnce() + Send>;

/// Told a worker's digests (every tier kept) on its apply thread (`None`: the thread does not know it).
pub type DigestThen = Box<dyn FnOnce(Option<WorkerDigests>) + Send>;

/// Called on the apply thread after each announcement or expiry of a worker's announced
/// blocks: the worker, whether it is routed-only (else the blocks are predictions), what
/// changed, and whether its slot was refused (every slot taken).
pub type OnAnnounced = Arc<dyn Fn(WorkerId, bool, &AnnounceOutcome, bool) + Send + Sync>;

/// What the threads are told, through their queues.
enum Command {
    /// Applies a worker's batch; `tag` goes to the hook (the daemon's publish time);
    /// `restate` says where it stands in a restatement of the worker; `queued`: when it was
    /// offered to the queue.
    Apply { worker: WorkerId, events: Vec<Event>, tag: u64, restate: Restate, queued: Instant },
    /// Runs a closure after what is queued before it.
    Then(Then),
    /// A router sent a request with these blocks to the worker.
    Announce { worker: WorkerId, locals: Vec<LocalHash> },
    /// Drops announced blocks past their TTL.
    Expire,
    /// Drops a worker (silent past its TTL).
    RemoveWorker(WorkerId),
    /// Sends every worker of the thread, saved, then drops the sender.
    Save(Sender<SavedWorker>),
    /// Sends what each worker of the thread holds, then drops the sender.
    Held(Sender<WorkerHeld>),
    /// Sends one worker, saved (`None` if the thread has no such worker).
    SaveOne(WorkerId, Sender<Option<SavedWorker>>),
    /// Rebuilds a worker from a snapshot.
    Restore(Box<SavedWorker>),
    /// Answers once what is queued before it is applied.
    Flush(Sender<()>),
    /// Tells the worker's digest (`None`: not known) once its queued events are applied.
    Digest(WorkerId, DigestThen),
}

/// The queue of a thread was full; the batch is handed back.
#[derive(Debug)]
pub struct QueueFull {
    /// The batch's worker.
    pub worker: WorkerId,
    /// Its events, not queued.
    pub events: Vec<Event>,
    /// Where it stands in a restatement.
    pub restate: Restate,
    /// When it was offered: [`ApplyPool::apply_full`] keeps it, so the wait counts as queued.
    pub queued: Instant,
}

/// Counters of the pool, for metrics.
#[derive(Default)]
pub struct PoolStats {
    /// Batches applied (a batch refused for want of a worker slot is reported to the hook and
    /// in [`ApplyPool::totals`] as [`ApplyOutcome::refused`] instead).
    pub batches: AtomicU64,
}

/// What every apply thread shares.
struct Shared<I: KvIndex> {
    /// The model the threads write.
    model: Arc<Model<I>>,
    /// Each thread's running totals (a thread adds to its own; `totals` sums them).
    totals: Vec<Mutex<ApplyOutcome>>,
    /// Counters.
    stats: PoolStats,
    /// Told what each batch did.
    on_applied: Option<OnApplied>,
    /// Told what each announcement and expiry did.
    on_announced: Option<OnAnnounced>,
}

/// A fixed pool of apply threads over one model.
pub struct ApplyPool<I: KvIndex> {
    /// What the threads share.
    shared: Arc<Shared<I>>,
    /// Each thread's queue.
    senders: Vec<Sender<Command>>,
    /// The threads, joined on shutdown.
    handles: Vec<JoinHandle<()>>,
    /// Picks a worker's thread; seeded, so that chosen worker ids cannot pile onto one thread.
    spread: SeededState,
}

impl<I: KvIndex> ApplyPool<I> {
    /// Starts `threads` apply threads over `model`, each with a queue of `queue_capacity`
    /// batches; the hooks are told what each batch and announcement did.
    pub fn new(
        model: Arc<Model<I>>,
        threads: usize,
        queue_capacity: usize,
        on_applied: Option<OnApplied>,
        on_announced: Option<OnAnnounced>,
    ) -> Self {
        let threads = threads.max(1);
        let totals = (0..threads).map(|_| Mutex::default()).collect();
        let shared = Arc::new(Shared { model, totals, stats: PoolStats::default(), on_applied, on_announced });
        let mut senders = Vec::with_capacity(threads);
        let mut handles = Vec::with_capacity(threads);
        for t in 0..threads {
            let (tx, rx) = bounded(queue_capacity.max(1));
            senders.push(tx);
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kvindex-apply-{t}"))
                .spawn(move || ApplyThread { shared: &shared, index: t, writers: Writers::default() }.run(rx))
                .expect("spawning an apply thread");
            handles.push(handle);
        }
        ApplyPool { shared, senders, handles, spread: SeededState::default() }
    }

    /// The model the pool writes to.
    pub fn model(&self) -> &Arc<Model<I>> {
        &self.shared.model
    }

    fn thread_of(&self, worker: WorkerId) -> usize {
        (self.spread.hash_one(worker) % self.senders.len() as u64) as usize
    }

    /// Queues a worker's batch, waiting while its thread's queue is full.
    pub fn apply(&self, worker: WorkerId, events: Vec<Event>, tag: u64) {
        self.apply_restating(worker, events, tag, Restate::default());
    }

    /// [`ApplyPool::apply`] for a batch that may open or end a restatement of the worker
    /// ([`Model::apply_restating`]).
    pub fn apply_restating(&self, worker: WorkerId, events: Vec<Event>, tag: u64, restate: Restate) {
        self.apply_full(QueueFull { worker, events, restate, queued: Instant::now() }, tag);
    }

    /// Queues a batch [`ApplyPool::try_apply`] handed back, waiting while the queue is full.
    pub fn apply_full(&self, full: QueueFull, tag: u64) {
        let QueueFull { worker, events, restate, queued } = full;
        // Send fails only once the thread has exited, which happens only on shutdown.
        let _ = self.senders[self.thread_of(worker)].send(Command::Apply { worker, events, tag, restate, queued });
    }

    /// Queues a worker's batch, or hands it back if its thread's queue is full.
    pub fn try_apply(&self, worker: WorkerId, events: Vec<Event>, tag: u64, restate: Restate) -> Result<(), QueueFull> {
        let queued = Instant::now();
        match self.senders[self.thread_of(worker)].try_send(Command::Apply { worker, events, tag, restate, queued }) {
            Err(TrySendError::Full(Command::Apply { worker, events, restate, queued, .. })) => {
                Err(QueueFull { worker, events, restate, queued })
            }
            _ => Ok(()),
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

    /// Holds `locals` as announced for `worker` (a router sent it that request), after its
    /// queued events, waiting while the queue is full. Ignored by a model without announcements.
    pub fn announce(&self, worker: WorkerId, locals: Vec<LocalHash>) {
        let _ = self.senders[self.thread_of(worker)].send(Command::Announce { worker, locals });
    }

    /// Drops announced blocks past their TTL, on every thread; a thread whose queue is full
    /// skips this round.
    pub fn expire_announced(&self) {
        for s in &self.senders {
            let _ = s.try_send(Command::Expire);
        }
    }

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

    /// Calls `f` with `worker`'s digests on its thread, once the events queued for it
    /// so far are applied, waiting while the queue is full.
    pub fn digest_then(&self, worker: WorkerId, f: DigestThen) {
        let _ = self.senders[self.thread_of(worker)].send(Command::Digest(worker, f));
    }

    /// As [`ApplyPool::digest_then`], or hands `f` back if the queue is full.
    pub fn try_digest_then(&self, worker: WorkerId, f: DigestThen) -> Result<(), DigestThen> {
        match self.senders[self.thread_of(worker)].try_send(Command::Digest(worker, f)) {
            Err(TrySendError::Full(Command::Digest(_, f))) => Err(f),
            _ => Ok(()),
        }
    }

    /// Drops a worker from every part of the model, after its queued events.
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
        for t in &self.shared.totals {
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
        &self.shared.stats
    }

    /// Applies what is queued, then stops the threads.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.senders.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl<I: KvIndex> Drop for ApplyPool<I> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One apply thread: its share of the workers' writers, and what it reports to.
struct ApplyThread<'a, I: KvIndex> {
    /// What every thread shares.
    shared: &'a Shared<I>,
    /// This thread's number: its totals are `shared.totals[index]`.
    index: usize,
    /// The writers of this thread's workers.
    writers: Writers<I>,
}

impl<I: KvIndex> ApplyThread<'_, I> {
    /// Runs the commands until every sender is gone.
    fn run(mut self, rx: Receiver<Command>) {
        for cmd in rx {
            self.command(cmd);
        }
    }

    fn command(&mut self, cmd: Command) {
        let model = &*self.shared.model;
        match cmd {
            Command::Apply { worker, events, tag, restate, queued } => {
                let taken = Instant::now();
                let result = model.apply_restating(&mut self.writers, worker, &events, restate);
                if result.is_ok() {
                    self.shared.stats.batches.fetch_add(1, Ordering::Relaxed);
                }
                self.report(worker, result, tag, Timing { queued, taken });
            }
            Command::Announce { worker, locals } => {
                let a = model.announce(&mut self.writers, worker, &locals);
                self.announced(worker, a.routed_only, &a.outcome, a.no_slot);
            }
            Command::Expire => {
                let hook = self.shared.on_announced.clone();
                let out = model.expire(&mut self.writers, |worker, routed_only, out| {
                    if let Some(h) = &hook {
                        h(worker, routed_only, out, false);
                    }
                });
                self.count(&out);
            }
            Command::RemoveWorker(worker) => {
                let (out, predictions) = model.remove_worker(&mut self.writers, worker);
                if predictions > 0 {
                    self.announced(worker, false, &AnnounceOutcome { expired: predictions, ..AnnounceOutcome::default() }, false);
                }
                self.count(&out);
            }
            Command::Save(tx) => model.save_all(&self.writers, |saved| {
                let _ = tx.send(saved);
            }),
            Command::Held(tx) => model.held(&self.writers, |held| {
                let _ = tx.send(held);
            }),
            Command::SaveOne(worker, tx) => {
                let _ = tx.send(model.save(&self.writers, worker));
            }
            Command::Restore(saved) => {
                let taken = Instant::now();
                let result = model.restore(&mut self.writers, &saved);
                self.report(saved.worker, result, 0, Timing { queued: taken, taken });
            }
            Command::Then(f) => f(),
            Command::Digest(worker, f) => f(model.digests(&self.writers, worker)),
            Command::Flush(done) => {
                let _ = done.send(());
            }
        }
    }

    /// Adds what a write did to this thread's totals.
    fn count(&self, out: &ApplyOutcome) {
        self.shared.totals[self.index].lock().add(out);
    }

    /// Counts what a batch (or a restored worker) did and tells the hook; a batch refused for
    /// want of a slot is told without its tag (it was not applied, so it has no lag).
    fn report(&self, worker: WorkerId, result: Result<ApplyOutcome, ApplyOutcome>, tag: u64, timing: Timing) {
        let (out, tag) = match result {
            Ok(out) => (out, tag),
            Err(refused) => (refused, 0),
        };
        self.count(&out);
        if let Some(h) = &self.shared.on_applied {
            h(worker, &out, tag, timing);
        }
    }

    fn announced(&self, worker: WorkerId, routed_only: bool, out: &AnnounceOutcome, no_slot: bool) {
        if let Some(h) = &self.shared.on_announced {
            h(worker, routed_only, out, no_slot);
        }
    }
}
