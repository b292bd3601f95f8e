//! A deployment's view of one model, composed: the device index, the host and disk tiers, a
//! hybrid model's other KV-cache groups, and the placements routers announce (predictions
//! beside the held blocks, and the blocks of routed-only workers). One [`Model::apply`] takes a
//! worker's events to every part; one [`Model::answer`] composes a lookup's answer from them.
//! The daemon's apply threads each own a [`Writers`] over a shared `Model`, and its lookups
//! read the `Model` directly; an embedder does the same and answers what the daemon answers.
//!
//! - this file: the model, its settings and each thread's writers (the writes);
//! - [`answer`]: a lookup's answer, composed (the reads);
//! - [`restate`]: a snapshot of a worker held whole, applied as a difference.

mod answer;
mod restate;

pub use answer::{Answer, Depths, Staleness};
pub use restate::Restate;

use crate::announced::{AnnounceOutcome, Announced};
use crate::digest::{Digest, WorkerDigests};
use crate::event::{Event, Tier};
use crate::groups::{GroupWriter, Groups, SavedGroups};
use crate::hash::{LocalHash, WorkerId};
use crate::index::{ApplyOutcome, KvIndex, Saved};
use crate::seeded::{SeededMap, SeededState};
use crate::tiers::{OtherTiers, SavedTiers, TierWriters};
use serde::{Deserialize, Serialize};
use std::collections::hash_map::Entry;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Which workers are routed-only (approximate mode): engines that publish no events, whose
/// blocks are what routers announce for them. Built once: asked per batch and per match.
#[derive(Clone, Debug, Default)]
pub struct RoutedOnly {
    /// Every worker is routed-only.
    pub all: bool,
    /// These worker ids are (any dp rank).
    pub workers: HashSet<u64, SeededState>,
}

impl RoutedOnly {
    /// No worker is routed-only.
    pub fn is_empty(&self) -> bool {
        !self.all && self.workers.is_empty()
    }

    /// Whether `worker_id` is routed-only.
    pub fn contains(&self, worker_id: u64) -> bool {
        self.all || (!self.workers.is_empty() && self.workers.contains(&worker_id))
    }
}

/// How announced placements are kept: predictions for workers that publish events, and the
/// only blocks of routed-only workers.
#[derive(Clone, Debug)]
pub struct AnnounceConfig {
    /// The most predicted blocks one worker holds (least recently announced go first).
    pub predicted_capacity: usize,
    /// The most predicted blocks all workers hold together; past it announcements are refused.
    pub predicted_total: u64,
    /// How long a predicted block is held after its last announcement, in ms.
    pub predicted_ttl_ms: u64,
    /// Which workers are routed-only: their announcements are their blocks in the device index.
    pub routed_only: RoutedOnly,
    /// The most blocks a routed-only worker holds (its engine's cache, in blocks).
    pub routed_only_capacity: usize,
    /// How long a routed-only worker's block is held after its last announcement, in ms.
    pub routed_only_ttl_ms: u64,
}

/// Announced placements: their settings, and the index that holds predictions apart from the
/// held blocks.
struct Announcing<I> {
    /// Settings.
    cfg: AnnounceConfig,
    /// Predictions, keyed as held blocks are, so a lookup asks it as it asks the device index.
    predicted: I,
    /// Predicted blocks held by all workers, against `cfg.predicted_total` (threads announce at
    /// once: each reserves its room here first).
    total: AtomicU64,
}

/// A deployment's view of one model (see the [module doc](self)).
pub struct Model<I: KvIndex> {
    /// GPU blocks of every worker's primary KV-cache group: what a lookup matches.
    device: I,
    /// Host and disk blocks, each tier apart; without them their events are ignored.
    tiers: Option<OtherTiers<I>>,
    /// A hybrid model's other groups; without them their blocks are counted as missed.
    groups: Option<Groups<I>>,
    /// Routers' announcements; without them announcements are ignored.
    announcing: Option<Announcing<I>>,
    /// The most engine hashes one restatement may name (a snapshot's blocks in every part):
    /// bounds what a publisher's snapshot costs beyond the blocks it stores.
    restate_max: usize,
}

/// Engine hashes a restatement may name by default: the index's default block bound, for
/// the device tier and as much again for host, disk and groups.
pub const RESTATE_MAX: usize = 2 << 23;

/// One worker's write state in every part of the model.
struct WorkerWriters<W> {
    /// Its device blocks (its slot in the device index).
    device: W,
    /// Its host and disk blocks, each made on its first event there.
    tiers: TierWriters<W>,
    /// Its other groups, from its first batch with a group event (a hybrid model).
    groups: Option<GroupWriter<W>>,
    /// A routed-only worker's announced blocks (its device blocks are these, and only these).
    routed: Option<Announced>,
    /// What an open restatement has named (see [`restate`]); `None` when none is open.
    restating: Option<Box<restate::Named>>,
}

/// The write state of the workers one thread owns (in the daemon, an apply thread): every
/// event of a worker must go through the same `Writers`, in order.
pub struct Writers<I: KvIndex> {
    /// Each worker's writers, made on its first event or announcement.
    workers: SeededMap<WorkerId, WorkerWriters<I::Writer>>,
    /// Predictions of the workers, each with its writer in the predicted index.
    predicted: SeededMap<WorkerId, (Announced, I::Writer)>,
    /// The clock of announcements: their times are ms since this.
    started: Instant,
}

impl<I: KvIndex> Default for Writers<I> {
    fn default() -> Self {
        Writers { workers: SeededMap::default(), predicted: SeededMap::default(), started: Instant::now() }
    }
}

impl<I: KvIndex> Writers<I> {
    /// Ms since these writers were made: the clock announcements are aged by.
    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }
}

/// One worker as a snapshot keeps it: its blocks in every tier and group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// What one worker holds in each part of the model (engine hashes), as its thread counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
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
    /// Its digests (GPU blocks, other tiers, groups): two replicas holding the worker alike
    /// show the same.
    pub digests: WorkerDigests,
    /// Batches waiting for its thread (the caller's to fill in: the model has no queue).
    pub queued: usize,
}

/// What one announcement did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Announcement {
    /// The worker is routed-only: the blocks went to the device index, not to predictions.
    pub routed_only: bool,
    /// What changed.
    pub outcome: AnnounceOutcome,
    /// Refused: no slot was left for the worker (every one taken).
    pub no_slot: bool,
}

fn is_group_event(ev: &Event) -> bool {
    matches!(ev, Event::GroupStored { .. } | Event::GroupRemoved { .. })
}

impl<I: KvIndex> Model<I> {
    /// A model of `device` alone: other tiers' events are ignored, groups' blocks counted as
    /// missed, announcements ignored.
    pub fn new(device: I) -> Self {
        Model { device, tiers: None, groups: None, announcing: None, restate_max: RESTATE_MAX }
    }

    /// With restatements naming at most `max` engine hashes each (past it one is given up).
    pub fn with_restate_max(mut self, max: usize) -> Self {
        self.restate_max = max;
        self
    }

    /// Every part, each index made by `make`, announcements kept as `cfg` says.
    pub fn complete(make: impl Fn() -> I, cfg: AnnounceConfig) -> Self {
        Model::new(make()).with_tiers(OtherTiers::new(&make)).with_groups(Groups::new(make())).with_announcing(make(), cfg)
    }

    /// With the host and disk tiers.
    pub fn with_tiers(mut self, tiers: OtherTiers<I>) -> Self {
        self.tiers = Some(tiers);
        self
    }

    /// With a hybrid model's other groups.
    pub fn with_groups(mut self, groups: Groups<I>) -> Self {
        self.groups = Some(groups);
        self
    }

    /// With announcements kept as `cfg` says, predictions in `predicted`.
    pub fn with_announcing(mut self, predicted: I, cfg: AnnounceConfig) -> Self {
        self.announcing = Some(Announcing { cfg, predicted, total: AtomicU64::new(0) });
        self
    }

    /// The device index.
    pub fn device(&self) -> &I {
        &self.device
    }

    /// The host and disk tiers' indexes, when kept.
    pub fn tiers(&self) -> Option<&OtherTiers<I>> {
        self.tiers.as_ref()
    }

    /// The index of predictions, when announcements are kept.
    pub fn predicted(&self) -> Option<&I> {
        self.announcing.as_ref().map(|a| &a.predicted)
    }

    /// Predicted blocks held by all workers.
    pub fn predicted_blocks(&self) -> u64 {
        self.announcing.as_ref().map_or(0, |a| a.total.load(Ordering::Relaxed))
    }

    /// The routed-only workers (none unless announcements are kept).
    pub fn routed_only(&self) -> Option<&RoutedOnly> {
        self.announcing.as_ref().map(|a| &a.cfg.routed_only).filter(|r| !r.is_empty())
    }

    /// The writers of `worker`, made on its first use; `None` when every slot is taken.
    fn writers_of<'w>(&self, w: &'w mut Writers<I>, worker: WorkerId) -> Option<&'w mut WorkerWriters<I::Writer>> {
        match w.workers.entry(worker) {
            Entry::Occupied(o) => Some(o.into_mut()),
            Entry::Vacant(v) => {
                let device = self.device.writer(worker).ok()?;
                Some(v.insert(WorkerWriters {
                    device,
                    tiers: TierWriters::default(),
                    groups: None,
                    routed: None,
                    restating: None,
                }))
            }
        }
    }

    /// Applies a batch of `worker`'s events, in order, to every part. `Err` (its `refused`
    /// counting the events) when the worker cannot be given a slot: every one is taken.
    pub fn apply(&self, w: &mut Writers<I>, worker: WorkerId, events: &[Event]) -> Result<ApplyOutcome, ApplyOutcome> {
        self.apply_restating(w, worker, events, Restate::default())
    }

    /// [`Model::apply`] for a batch that may open or end a restatement of `worker` (see
    /// [`restate`]): a `cleared` ends an open one, as does naming more than its bound (given
    /// up, counted in [`ApplyOutcome::restatements_given_up`]).
    pub fn apply_restating(
        &self,
        w: &mut Writers<I>,
        worker: WorkerId,
        events: &[Event],
        r: Restate,
    ) -> Result<ApplyOutcome, ApplyOutcome> {
        #[cfg(feature = "fault-injection")]
        let lost = crate::fault::lose_once(events);
        #[cfg(feature = "fault-injection")]
        let events = lost.as_deref().unwrap_or(events);
        let Some(ws) = self.writers_of(w, worker) else {
            return Err(ApplyOutcome { refused: events.len() as u64, ..ApplyOutcome::default() });
        };
        if let (Some(groups), None) = (&self.groups, &ws.groups) {
            if events.iter().any(is_group_event) {
                ws.groups = Some(groups.writer(worker));
            }
        }
        if r.opens {
            ws.restating = Some(Box::new(restate::Named::new(self.restate_max)));
        }
        let mut out = ApplyOutcome::default();
        for ev in events {
            out.add(&self.apply_event(worker, ws, ev));
            if let Some(named) = ws.restating.as_mut() {
                if *ev == Event::Cleared {
                    ws.restating = None;
                } else if named.note(ev).is_err() {
                    ws.restating = None;
                    out.restatements_given_up += 1;
                }
            }
        }
        match r.ends {
            Some(true) => {
                if let Some(named) = ws.restating.take() {
                    for ev in named.removals(&self.save_writers(worker, ws)) {
                        out.add(&self.apply_event(worker, ws, &ev));
                    }
                }
            }
            Some(false) => ws.restating = None,
            None => {}
        }
        Ok(out)
    }

    /// Applies one event of `worker` to every part.
    fn apply_event(&self, worker: WorkerId, ws: &mut WorkerWriters<I::Writer>, ev: &Event) -> ApplyOutcome {
        let mut out = ev.apply_to(&self.device, &mut ws.device);
        match (&self.groups, ws.groups.as_mut()) {
            (Some(groups), Some(gw)) => out.add(&groups.apply(gw, ev)),
            _ if is_group_event(ev) => out.group_missed += ev.blocks() as u64,
            _ => {}
        }
        if let Some(tiers) = &self.tiers {
            let tier = match ev {
                Event::Cleared => tiers.clear(&mut ws.tiers),
                Event::Stored { tier: Tier::Device, .. }
                | Event::Removed { tier: Tier::Device, .. }
                | Event::GroupStored { .. }
                | Event::GroupRemoved { .. } => return out,
                _ => tiers.apply(worker, &mut ws.tiers, ev),
            };
            // Another tier's counts are its own: only refusals and orphans are told.
            out.refused += tier.refused;
            out.tier_unplaceable += tier.unplaceable;
        }
        out
    }

    /// Holds `locals` (a chain from position 0) as announced for `worker`: as its blocks if it
    /// is routed-only, else as a prediction, within the total bound. Ignored without
    /// announcements.
    pub fn announce(&self, w: &mut Writers<I>, worker: WorkerId, locals: &[LocalHash]) -> Announcement {
        let Some(a) = &self.announcing else { return Announcement::default() };
        let now = w.now_ms();
        let refused = |routed_only| Announcement {
            routed_only,
            outcome: AnnounceOutcome { refused: locals.len() as u64, ..AnnounceOutcome::default() },
            no_slot: true,
        };
        if a.cfg.routed_only.contains(worker.worker_id) {
            let capacity = a.cfg.routed_only_capacity;
            let Some(ws) = self.writers_of(w, worker) else { return refused(true) };
            let routed = ws.routed.get_or_insert_with(|| Announced::new(capacity));
            let outcome = routed.announce(&self.device, &mut ws.device, locals, now, usize::MAX);
            return Announcement { routed_only: true, outcome, no_slot: false };
        }
        let slot = match w.predicted.entry(worker) {
            Entry::Occupied(o) => Some(o.into_mut()),
            Entry::Vacant(v) => {
                a.predicted.writer(worker).ok().map(|pw| v.insert((Announced::new(a.cfg.predicted_capacity), pw)))
            }
        };
        let Some((held, pw)) = slot else { return refused(false) };
        // Reserve room under the total bound first, give back what is not used.
        let (want, max) = (locals.len() as u64, a.cfg.predicted_total);
        let before = a.total.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| Some(t + want.min(max.saturating_sub(t))));
        let room = want.min(max.saturating_sub(before.unwrap_or(max)));
        let outcome = held.announce(&a.predicted, pw, locals, now, room as usize);
        a.total.fetch_sub(room - outcome.added + outcome.evicted, Ordering::Relaxed);
        if held.is_empty() {
            if let Some((held, pw)) = w.predicted.remove(&worker) {
                self.drop_predictions(held, pw);
            }
        }
        Announcement { routed_only: false, outcome, no_slot: false }
    }

    /// Drops what outlived its TTL (predictions, and routed-only workers' blocks), telling
    /// `tell(worker, routed_only, outcome)` of each worker that lost blocks; a worker left with
    /// none gives its slot back. What the removed routed-only workers' blocks did, returned.
    pub fn expire(&self, w: &mut Writers<I>, mut tell: impl FnMut(WorkerId, bool, &AnnounceOutcome)) -> ApplyOutcome {
        let Some(a) = &self.announcing else { return ApplyOutcome::default() };
        let now = w.now_ms();
        let mut empty = Vec::new();
        for (&worker, (held, pw)) in w.predicted.iter_mut() {
            let out = held.expire(&a.predicted, pw, now.saturating_sub(a.cfg.predicted_ttl_ms));
            a.total.fetch_sub(out.expired, Ordering::Relaxed);
            if out.expired > 0 {
                tell(worker, false, &out);
            }
            if held.is_empty() {
                empty.push(worker);
            }
        }
        for worker in empty.drain(..) {
            if let Some((_, pw)) = w.predicted.remove(&worker) {
                a.predicted.remove_worker(pw);
            }
        }
        for (&worker, ws) in w.workers.iter_mut() {
            let Some(routed) = ws.routed.as_mut() else { continue };
            let out = routed.expire(&self.device, &mut ws.device, now.saturating_sub(a.cfg.routed_only_ttl_ms));
            if out.expired > 0 {
                tell(worker, true, &out);
            }
            if routed.is_empty() {
                empty.push(worker);
            }
        }
        let mut out = ApplyOutcome::default();
        for worker in empty {
            if let Some(ws) = w.workers.remove(&worker) {
                out.add(&self.remove_writers(ws));
            }
        }
        out
    }

    /// Drops a worker's predictions and frees its slot in the predicted index.
    fn drop_predictions(&self, held: Announced, pw: I::Writer) -> u64 {
        let Some(a) = &self.announcing else { return 0 };
        let n = held.len() as u64;
        a.total.fetch_sub(n, Ordering::Relaxed);
        a.predicted.remove_worker(pw);
        n
    }

    /// Drops a worker's blocks from every part and frees its slots.
    fn remove_writers(&self, ws: WorkerWriters<I::Writer>) -> ApplyOutcome {
        let out = self.device.remove_worker(ws.device);
        if let Some(tiers) = &self.tiers {
            tiers.remove_worker(ws.tiers);
        }
        if let (Some(groups), Some(gw)) = (&self.groups, ws.groups) {
            groups.remove_worker(gw);
        }
        out
    }

    /// Drops `worker` (silent past its TTL) from every part: its blocks, predictions and slots.
    /// What its device blocks did, and the predictions dropped.
    pub fn remove_worker(&self, w: &mut Writers<I>, worker: WorkerId) -> (ApplyOutcome, u64) {
        let predictions = w.predicted.remove(&worker).map_or(0, |(held, pw)| self.drop_predictions(held, pw));
        let out = w.workers.remove(&worker).map_or_else(ApplyOutcome::default, |ws| self.remove_writers(ws));
        (out, predictions)
    }

    /// One worker as a snapshot keeps it.
    fn save_writers(&self, worker: WorkerId, ws: &WorkerWriters<I::Writer>) -> SavedWorker {
        SavedWorker {
            worker,
            device: self.device.save(&ws.device),
            tiers: self.tiers.as_ref().map(|t| t.save(&ws.tiers)).unwrap_or_default(),
            groups: self.groups.as_ref().zip(ws.groups.as_ref()).map(|(g, gw)| g.save(gw)),
        }
    }

    /// The digests of `worker`'s blocks in every tier this model keeps (`None` if these
    /// writers do not know it): what its publisher's must equal while the two agree.
    pub fn digests(&self, w: &Writers<I>, worker: WorkerId) -> Option<WorkerDigests> {
        w.workers.get(&worker).map(|ws| self.digests_of(ws))
    }

    /// A worker's digests from its writers: its groups' is empty where it never showed a
    /// group (a lost first group event then shows), unknown where the model keeps no groups.
    fn digests_of(&self, ws: &WorkerWriters<I::Writer>) -> WorkerDigests {
        WorkerDigests {
            device: self.device.digest(&ws.device),
            tiers: self.tiers.as_ref().map(|t| t.digests(&ws.tiers)),
            groups: self.groups.as_ref().and_then(|g| ws.groups.as_ref().map_or(Some(Digest::default()), |gw| g.digest(gw))),
        }
    }

    /// `worker`, saved (`None` if these writers do not know it).
    pub fn save(&self, w: &Writers<I>, worker: WorkerId) -> Option<SavedWorker> {
        w.workers.get(&worker).map(|ws| self.save_writers(worker, ws))
    }

    /// Every worker of these writers, saved, but the routed-only ones: they are soft state,
    /// rebuilt by the next announcements (a snapshot would bring back blocks without their ages).
    pub fn save_all(&self, w: &Writers<I>, mut f: impl FnMut(SavedWorker)) {
        for (&worker, ws) in w.workers.iter().filter(|(_, ws)| ws.routed.is_none()) {
            f(self.save_writers(worker, ws));
        }
    }

    /// What each worker of these writers holds.
    pub fn held(&self, w: &Writers<I>, mut f: impl FnMut(WorkerHeld)) {
        for (&worker, ws) in w.workers.iter() {
            let (host, disk) = self.tiers.as_ref().map_or((0, 0), |t| t.held(&ws.tiers));
            let grouped = self.groups.as_ref().zip(ws.groups.as_ref()).map_or(0, |(g, gw)| g.held(gw));
            let predicted = w.predicted.get(&worker).map_or(0, |p| p.0.len() as u64);
            let (device, digests) = (self.device.held(&ws.device), self.digests_of(ws));
            f(WorkerHeld { worker, device, host, disk, grouped, predicted, digests, queued: 0 });
        }
    }

    /// Rebuilds a worker (which must hold nothing yet) from a snapshot. `Err` as for
    /// [`Model::apply`] when it cannot be given a slot.
    pub fn restore(&self, w: &mut Writers<I>, saved: &SavedWorker) -> Result<ApplyOutcome, ApplyOutcome> {
        let Some(ws) = self.writers_of(w, saved.worker) else {
            return Err(ApplyOutcome { refused: 1, ..ApplyOutcome::default() });
        };
        let mut out = self.device.restore(&mut ws.device, &saved.device);
        if let Some(tiers) = &self.tiers {
            let tier = tiers.restore(saved.worker, &mut ws.tiers, &saved.tiers);
            out.refused += tier.refused;
            out.tier_unplaceable += tier.unplaceable;
        }
        if let (Some(groups), Some(sg)) = (&self.groups, &saved.groups) {
            let gw = ws.groups.get_or_insert_with(|| groups.writer(saved.worker));
            out.add(&groups.restore(gw, sg));
        }
        Ok(out)
    }
}
