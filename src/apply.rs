//! The apply pool (docs/ARCHITECTURE.md): a fixed set of threads that apply KV events to the
//! index. Every event of a worker goes to the same thread (by hash of its identity), so a worker's
//! events apply in order and its writer (reverse map) is owned by that thread alone. Queues
//! are bounded: a full queue blocks the sender (backpressure), nothing is dropped.
//!
//! Routers' announced placements go through the same threads (see [`Announcing`]): a
//! worker's predictions and its routed-only blocks are written by its own thread, like its
//! events.

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use kvindex_core::announced::{AnnounceOutcome, Announced};
use kvindex_core::groups::{GroupWriter, Groups, SavedGroups};
use kvindex_core::hash::{LocalHash, WorkerId};
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

/// Called on the apply thread after each announcement or expiry of a worker's announced
/// blocks: the worker, whether it is routed-only (else the blocks are predictions), what
/// changed, and whether its slot was refused (every slot taken).
pub type OnAnnounced = Arc<dyn Fn(WorkerId, bool, &AnnounceOutcome, bool) + Send + Sync>;

/// Where and how long announced placements are kept (predictions for workers that publish
/// events, the only state of routed-only workers).
pub struct Announcing<I> {
    /// The index that holds predictions, apart from the held blocks.
    pub predicted: Arc<I>,
    /// The most predicted blocks one worker holds.
    pub predicted_capacity: usize,
    /// The most predicted blocks all workers hold together; past it announcements are refused.
    pub predicted_total: u64,
    /// How long a predicted block is held after its last announcement, in ms.
    pub predicted_ttl_ms: u64,
    /// Which workers are routed-only: their announcements are their blocks in the main index.
    pub routed_only: Arc<dyn Fn(u64) -> bool + Send + Sync>,
    /// The most blocks a routed-only worker holds (its engine's cache, in blocks).
    pub routed_only_capacity: usize,
    /// How long a routed-only worker's block is held after its last announcement, in ms.
    pub routed_only_ttl_ms: u64,
    /// Told what each announcement and expiry did.
    pub on_announced: Option<OnAnnounced>,
}

enum Command {
    Apply {
        worker: WorkerId,
        events: Vec<Event>,
        tag: u64,
    },
    Then(Then),
    /// A router sent a request with these blocks to the worker.
    Announce {
        worker: WorkerId,
        locals: Vec<LocalHash>,
    },
    /// Drops announced blocks past their TTL.
    Expire,
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
    /// A hybrid model's other groups (absent for other workers, and in older snapshots).
    #[serde(default)]
    pub groups: Option<SavedGroups>,
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
    /// Blocks it holds in a hybrid model's other groups (one per group holding it).
    pub grouped: u64,
    /// Blocks routers announced for it that its events have not shown (predictions).
    pub predicted: u64,
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
    /// Hybrid models' other groups; without them their events are counted as missed.
    groups: Option<Arc<Groups<I>>>,
    senders: Vec<Sender<Command>>,
    handles: Vec<JoinHandle<()>>,
    totals: Arc<Vec<Mutex<ApplyOutcome>>>,
    stats: Arc<PoolStats>,
    /// Picks a worker's thread; seeded, so that chosen worker ids cannot pile onto one thread.
    spread: SeededState,
    /// Predicted blocks held by all workers, against [`Announcing::predicted_total`].
    predicted_total: Arc<AtomicU64>,
    /// The index of predictions, when announcements are kept.
    predicted: Option<Arc<I>>,
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
        Self::start(index, others, None, None, threads, queue_capacity, on_applied)
    }

    /// As [`ApplyPool::new`], applying host and disk events to `others`, hybrid models' other
    /// groups to `groups` and, with `announcing`, keeping routers' announced placements.
    pub fn start(
        index: Arc<I>,
        others: Option<Arc<OtherTiers<I>>>,
        groups: Option<Arc<Groups<I>>>,
        announcing: Option<Announcing<I>>,
        threads: usize,
        queue_capacity: usize,
        on_applied: Option<OnApplied>,
    ) -> Self {
        let threads = threads.max(1);
        let predicted_total = Arc::new(AtomicU64::new(0));
        let announcing = announcing.map(Arc::new);
        let predicted = announcing.as_ref().map(|a| a.predicted.clone());
        let totals: Arc<Vec<Mutex<ApplyOutcome>>> = Arc::new((0..threads).map(|_| Mutex::default()).collect());
        let stats = Arc::new(PoolStats::default());
        let mut senders = Vec::with_capacity(threads);
        let mut handles = Vec::with_capacity(threads);
        for t in 0..threads {
            let (tx, rx) = bounded(queue_capacity.max(1));
            senders.push(tx);
            let (index, others, groups, totals, stats, hook) =
                (index.clone(), others.clone(), groups.clone(), totals.clone(), stats.clone(), on_applied.clone());
            let announce = announcing.clone().map(|a| (a, predicted_total.clone()));
            let handle = std::thread::Builder::new()
                .name(format!("kvindex-apply-{t}"))
                .spawn(move || {
                    let parts = Parts { index: &*index, others: others.as_deref(), groups: groups.as_deref() };
                    apply_loop(parts, announce, rx, &totals[t], &stats, hook)
                })
                .expect("spawning an apply thread");
            handles.push(handle);
        }
        ApplyPool {
            index,
            others,
            groups,
            senders,
            handles,
            totals,
            stats,
            spread: SeededState::default(),
            predicted_total,
            predicted,
        }
    }

    /// The index the pool writes to.
    pub fn index(&self) -> &Arc<I> {
        &self.index
    }

    /// Hybrid models' other groups, if kept.
    pub fn groups(&self) -> Option<&Arc<Groups<I>>> {
        self.groups.as_ref()
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

    /// Holds `locals` as announced for `worker` (a router sent it that request), after its
    /// queued events, waiting while the queue is full. Ignored by a pool without announcing.
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

    /// Predicted blocks held by all workers.
    pub fn predicted_blocks(&self) -> u64 {
        self.predicted_total.load(Ordering::Relaxed)
    }

    /// The index of predictions, when announcements are kept.
    pub fn predicted(&self) -> Option<&Arc<I>> {
        self.predicted.as_ref()
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
    /// Its other groups, from its first batch with a group event (a hybrid model).
    groups: Option<GroupWriter<W>>,
    /// A routed-only worker's announced blocks (its device blocks are these, and only these).
    routed: Option<Announced>,
}

/// An apply thread's share of announced placements.
struct AnnounceState<I: KvIndex> {
    /// Settings, shared by the threads.
    cfg: Arc<Announcing<I>>,
    /// Predicted blocks of all threads, against the total bound.
    total: Arc<AtomicU64>,
    /// Predictions of this thread's workers, each with its writer in the predicted index.
    predicted: SeededMap<WorkerId, (Announced, I::Writer)>,
    /// The thread's clock: announcement times are ms since it started.
    started: std::time::Instant,
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
            Ok(w) => Some(v.insert(Writers { device: w, others: TierWriters::default(), groups: None, routed: None })),
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

/// The indexes an apply thread writes to.
struct Parts<'a, I: KvIndex> {
    /// The main (device) index.
    index: &'a I,
    /// Host and disk tiers, if kept.
    others: Option<&'a OtherTiers<I>>,
    /// Hybrid models' other groups, if kept.
    groups: Option<&'a Groups<I>>,
}

impl<I: KvIndex> Clone for Parts<'_, I> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<I: KvIndex> Copy for Parts<'_, I> {}

fn is_group_event(ev: &Event) -> bool {
    matches!(ev, Event::GroupStored { .. } | Event::GroupRemoved { .. })
}

fn apply_loop<I: KvIndex>(
    parts: Parts<'_, I>,
    announcing: Option<(Arc<Announcing<I>>, Arc<AtomicU64>)>,
    rx: Receiver<Command>,
    total: &Mutex<ApplyOutcome>,
    stats: &PoolStats,
    hook: Option<OnApplied>,
) {
    let Parts { index, others, groups } = parts;
    let mut writers: SeededMap<WorkerId, Writers<I::Writer>> = SeededMap::default();
    let mut announced = announcing.map(|(cfg, total)| AnnounceState {
        cfg,
        total,
        predicted: SeededMap::default(),
        started: std::time::Instant::now(),
    });
    for cmd in rx {
        match cmd {
            Command::Apply { worker, events, tag } => {
                let taken = std::time::Instant::now();
                let Some(w) = writers_of(&mut writers, index, worker, events.len() as u64, total, &hook) else { continue };
                let mut out = ApplyOutcome::default();
                if let (Some(g), None) = (groups, &w.groups) {
                    if events.iter().any(is_group_event) {
                        w.groups = Some(g.writer(worker));
                    }
                }
                for ev in &events {
                    out.add(&ev.apply_to(index, &mut w.device));
                    match (groups, w.groups.as_mut()) {
                        (Some(g), Some(gw)) => out.add(&g.apply(gw, ev)),
                        _ if is_group_event(ev) => out.group_missed += ev.blocks() as u64,
                        _ => {}
                    }
                    if let Some(others) = others {
                        let tier = match ev {
                            Event::Cleared => others.clear(&mut w.others),
                            Event::Stored { tier: Tier::Device, .. }
                            | Event::Removed { tier: Tier::Device, .. }
                            | Event::GroupStored { .. }
                            | Event::GroupRemoved { .. } => continue,
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
            Command::Announce { worker, locals } => {
                if let Some(a) = announced.as_mut() {
                    announce(index, a, &mut writers, worker, &locals, total, &hook);
                }
            }
            Command::Expire => {
                if let Some(a) = announced.as_mut() {
                    expire(index, others, a, &mut writers, total);
                }
            }
            Command::RemoveWorker(worker) => {
                if let Some(a) = announced.as_mut() {
                    if let Some((p, w)) = a.predicted.remove(&worker) {
                        drop_predictions(a, worker, p, w);
                    }
                }
                if let Some(w) = writers.remove(&worker) {
                    let out = index.remove_worker(w.device);
                    if let Some(others) = others {
                        others.remove_worker(w.others);
                    }
                    if let (Some(g), Some(gw)) = (groups, w.groups) {
                        g.remove_worker(gw);
                    }
                    total.lock().add(&out);
                }
            }
            Command::Save(tx) => {
                // Routed-only workers are soft state, rebuilt by the next announcements: a
                // snapshot would bring back blocks without their ages.
                for (&worker, w) in writers.iter().filter(|(_, w)| w.routed.is_none()) {
                    let _ = tx.send(save_worker(parts, worker, w));
                }
            }
            Command::Held(tx) => {
                for (&worker, w) in writers.iter() {
                    let (host, disk) = others.map_or((0, 0), |o| o.held(&w.others));
                    let grouped = groups.zip(w.groups.as_ref()).map_or(0, |(g, gw)| g.held(gw));
                    let predicted = announced.as_ref().and_then(|a| a.predicted.get(&worker)).map_or(0, |p| p.0.len() as u64);
                    let _ =
                        tx.send(WorkerHeld { worker, device: index.held(&w.device), host, disk, grouped, predicted, queued: 0 });
                }
            }
            Command::SaveOne(worker, tx) => {
                let saved = writers.get(&worker).map(|w| save_worker(parts, worker, w));
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
                if let (Some(g), Some(sg)) = (groups, &saved.groups) {
                    let gw = w.groups.get_or_insert_with(|| g.writer(saved.worker));
                    out.add(&g.restore(gw, sg));
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

/// One worker as a snapshot keeps it.
fn save_worker<I: KvIndex>(parts: Parts<'_, I>, worker: WorkerId, w: &Writers<I::Writer>) -> SavedWorker {
    SavedWorker {
        worker,
        device: parts.index.save(&w.device),
        tiers: parts.others.map(|o| o.save(&w.others)).unwrap_or_default(),
        groups: parts.groups.zip(w.groups.as_ref()).map(|(g, gw)| g.save(gw)),
    }
}

/// Holds an announcement for `worker`: in the main index if it is routed-only, else as a
/// prediction, within the total bound.
fn announce<I: KvIndex>(
    index: &I,
    a: &mut AnnounceState<I>,
    writers: &mut SeededMap<WorkerId, Writers<I::Writer>>,
    worker: WorkerId,
    locals: &[LocalHash],
    total: &Mutex<ApplyOutcome>,
    hook: &Option<OnApplied>,
) {
    let now = a.started.elapsed().as_millis() as u64;
    let cfg = &a.cfg;
    let tell = |routed: bool, out: &AnnounceOutcome, refused: bool| {
        if let Some(h) = &cfg.on_announced {
            h(worker, routed, out, refused);
        }
    };
    if (cfg.routed_only)(worker.worker_id) {
        let Some(w) = writers_of(writers, index, worker, 0, total, hook) else {
            tell(true, &AnnounceOutcome { refused: locals.len() as u64, ..AnnounceOutcome::default() }, true);
            return;
        };
        let routed = w.routed.get_or_insert_with(|| Announced::new(cfg.routed_only_capacity));
        let out = routed.announce(index, &mut w.device, locals, now, usize::MAX);
        tell(true, &out, false);
        return;
    }
    let slot = match a.predicted.entry(worker) {
        std::collections::hash_map::Entry::Occupied(o) => Some(o.into_mut()),
        std::collections::hash_map::Entry::Vacant(v) => match cfg.predicted.writer(worker) {
            Ok(w) => Some(v.insert((Announced::new(cfg.predicted_capacity), w))),
            Err(_) => None,
        },
    };
    let Some((p, w)) = slot else {
        tell(false, &AnnounceOutcome { refused: locals.len() as u64, ..AnnounceOutcome::default() }, true);
        return;
    };
    // Threads announce at once: reserve room under the total bound first, give back the unused.
    let (want, max) = (locals.len() as u64, cfg.predicted_total);
    let before = a.total.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t + want.min(max.saturating_sub(t))));
    let room = want.min(max.saturating_sub(before.unwrap_or(max)));
    let out = p.announce(&*cfg.predicted, w, locals, now, room as usize);
    a.total.fetch_sub(room - out.added + out.evicted, Ordering::Relaxed);
    if p.is_empty() {
        if let Some((p, w)) = a.predicted.remove(&worker) {
            drop_predictions(a, worker, p, w);
        }
    }
    tell(false, &out, false);
}

/// Drops what outlived its TTL: predictions, and routed-only workers' blocks; a worker left
/// with none gives its slot back.
fn expire<I: KvIndex>(
    index: &I,
    others: Option<&OtherTiers<I>>,
    a: &mut AnnounceState<I>,
    writers: &mut SeededMap<WorkerId, Writers<I::Writer>>,
    total: &Mutex<ApplyOutcome>,
) {
    let now = a.started.elapsed().as_millis() as u64;
    let cfg = a.cfg.clone();
    let tell = |worker: WorkerId, routed: bool, out: &AnnounceOutcome| {
        if let (Some(h), true) = (&cfg.on_announced, out.expired > 0) {
            h(worker, routed, out, false);
        }
    };
    let mut empty = Vec::new();
    for (&worker, (p, w)) in a.predicted.iter_mut() {
        let out = p.expire(&*cfg.predicted, w, now.saturating_sub(cfg.predicted_ttl_ms));
        a.total.fetch_sub(out.expired, Ordering::Relaxed);
        tell(worker, false, &out);
        if p.is_empty() {
            empty.push(worker);
        }
    }
    for worker in empty.drain(..) {
        if let Some((_, w)) = a.predicted.remove(&worker) {
            cfg.predicted.remove_worker(w);
        }
    }
    for (&worker, w) in writers.iter_mut() {
        let Some(routed) = w.routed.as_mut() else { continue };
        let out = routed.expire(index, &mut w.device, now.saturating_sub(cfg.routed_only_ttl_ms));
        tell(worker, true, &out);
        if routed.is_empty() {
            empty.push(worker);
        }
    }
    for worker in empty {
        if let Some(w) = writers.remove(&worker) {
            let out = index.remove_worker(w.device);
            if let Some(others) = others {
                others.remove_worker(w.others);
            }
            total.lock().add(&out);
        }
    }
}

/// Drops a worker's predictions and frees its slot in the predicted index.
fn drop_predictions<I: KvIndex>(a: &AnnounceState<I>, worker: WorkerId, p: Announced, w: I::Writer) {
    let held = p.len() as u64;
    a.total.fetch_sub(held, Ordering::Relaxed);
    a.cfg.predicted.remove_worker(w);
    if let (Some(h), true) = (&a.cfg.on_announced, held > 0) {
        h(worker, false, &AnnounceOutcome { expired: held, ..AnnounceOutcome::default() }, false);
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
