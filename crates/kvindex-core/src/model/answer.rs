//! A lookup's answer, composed from every part of the model: each matching worker's device
//! depth (lowered, for a hybrid worker, to what all its KV-cache groups serve), its host and
//! disk depths where asked, its predicted depth where announcements reach past what it holds,
//! and its flags; workers with the same answer grouped, deepest first; and the stale workers
//! that match nothing, so that a partial answer does not pass for a true one.

use super::Model;
use crate::event::Tier;
use crate::hash::{LocalHash, WorkerId};
use crate::index::{rotation, DepthGroups, KvIndex, MatchOptions, WorkerMatch};
use crate::seeded::SeededMap;
use crate::tiers::{find_tiered, TieredMatch};
use std::cmp::Reverse;

/// Which workers' states are being resynchronised (their answers may be out of date): the
/// caller's to know (the daemon follows each worker's event sequence; an embedder applying
/// every event in order has none, `()`).
pub trait Staleness {
    /// Whether any worker is stale: answers take the plain path when none is.
    fn any(&self) -> bool;
    /// Whether `worker` is stale.
    fn contains(&self, worker: WorkerId) -> bool;
    /// Calls `f` with every stale worker.
    fn for_each(&self, f: &mut dyn FnMut(WorkerId));
}

impl Staleness for () {
    fn any(&self) -> bool {
        false
    }

    fn contains(&self, _: WorkerId) -> bool {
        false
    }

    fn for_each(&self, _: &mut dyn FnMut(WorkerId)) {}
}

/// What the workers of one group of an answer share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Depths {
    /// Length of the longest contiguous prefix of the request held on the device, in blocks.
    pub blocks: u32,
    /// The same in host memory, for a lookup that asked for that tier.
    pub host: Option<u32>,
    /// The same on disk, for a lookup that asked for that tier.
    pub disk: Option<u32>,
    /// The prefix held or announced to arrive, where announcements reach past `blocks`; never
    /// counted in `blocks`.
    pub predicted: Option<u32>,
    /// The workers' states are being resynchronised.
    pub stale: bool,
    /// Routed-only workers: their `blocks` are what routers announced, not what engines told.
    pub approximate: bool,
}

impl Depths {
    /// The deepest of every depth, predictions included: what answers are ordered by.
    pub fn deepest(&self) -> u32 {
        self.blocks.max(self.host.unwrap_or(0)).max(self.disk.unwrap_or(0)).max(self.predicted.unwrap_or(0))
    }
}

/// The answer to a lookup: every matching worker (or the deepest, under a cut), grouped by
/// [`Depths`], deepest first; and the stale workers that match nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    /// Each group's depths and the end of its workers in `workers`, deepest first.
    groups: Vec<(Depths, u32)>,
    /// The workers, group after group.
    workers: Vec<WorkerId>,
    /// Stale workers (within the lookup's filter) that are in no group, by worker.
    stale_workers: Vec<WorkerId>,
}

impl Answer {
    /// Empties it, keeping its allocations.
    pub fn clear(&mut self) {
        self.groups.clear();
        self.workers.clear();
        self.stale_workers.clear();
    }

    /// Appends `worker` with `depths`: to the last group if it has the same, else a new one.
    fn push(&mut self, depths: Depths, worker: WorkerId) {
        self.workers.push(worker);
        let end = self.workers.len() as u32;
        match self.groups.last_mut() {
            Some((last, e)) if *last == depths => *e = end,
            _ => self.groups.push((depths, end)),
        }
    }

    /// Appends a group of `workers` with `depths` (shallower than the last group): for
    /// callers that compose an answer themselves (merging shards, tests).
    pub fn push_group(&mut self, depths: Depths, workers: &[WorkerId]) {
        for &w in workers {
            self.push(depths, w);
        }
    }

    /// Sets the stale workers that match nothing (sorted here).
    pub fn set_stale_workers(&mut self, mut workers: Vec<WorkerId>) {
        workers.sort_unstable();
        self.stale_workers = workers;
    }

    /// The groups, deepest first: each one's depths with its workers.
    pub fn groups(&self) -> impl Iterator<Item = (Depths, &[WorkerId])> + '_ {
        let mut from = 0;
        self.groups.iter().map(move |&(d, end)| {
            let ws = &self.workers[from as usize..end as usize];
            from = end;
            (d, ws)
        })
    }

    /// Matching workers in all.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// No worker matches.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// The stale workers that match nothing, by worker.
    pub fn stale_workers(&self) -> &[WorkerId] {
        &self.stale_workers
    }

    /// The depths of `worker`, if it matches.
    pub fn depths_of(&self, worker: WorkerId) -> Option<Depths> {
        self.groups().find(|(_, ws)| ws.contains(&worker)).map(|(d, _)| d)
    }
}

thread_local! {
    /// A lookup thread's grouped answer from the device index, reused.
    static GROUPED: std::cell::RefCell<DepthGroups> = std::cell::RefCell::new(DepthGroups::default());
}

impl<I: KvIndex> Model<I> {
    /// The answer to a lookup of `query` (local hashes) with `opts` (a worker filter, a depth
    /// limit, `max_matches` the deepest kept, ties at the cut in rotation) in `tiers` (device
    /// unless others are named), into `out` (cleared first). `stale` flags workers.
    pub fn answer(&self, query: &[LocalHash], opts: &MatchOptions, tiers: &[Tier], stale: &dyn Staleness, out: &mut Answer) {
        out.clear();
        let device_only = tiers.is_empty() || tiers == [Tier::Device];
        let hybrid = self.groups.as_ref().is_some_and(|g| g.any());
        let predicting = self.predicted_blocks() > 0;
        if device_only && !hybrid && !predicting && !stale.any() && self.routed_only().is_none() {
            self.plain_answer(query, opts, out);
            return;
        }
        let every = MatchOptions { max_matches: None, ..opts.clone() };
        let mut found = self.every_match(query, &every, tiers);
        let predicted = self.predictions(query, &every, &mut found);
        cut(&mut found, opts.max_matches);
        let asked = |tier: Tier, depth: u32| tiers.contains(&tier).then_some(depth);
        let routed_only = self.routed_only();
        let mut entries: Vec<(Depths, WorkerId)> = found
            .iter()
            .map(|m| {
                let depths = Depths {
                    blocks: m.device,
                    host: asked(Tier::Host, m.host),
                    disk: asked(Tier::Disk, m.disk),
                    predicted: predicted.get(&m.worker).map(|&p| p.max(m.device)),
                    stale: stale.contains(m.worker),
                    approximate: routed_only.is_some_and(|r| r.contains(m.worker.worker_id)),
                };
                (depths, m.worker)
            })
            .collect();
        // Deepest first stays; within one depth, the same answers side by side.
        entries.sort_by_key(|(d, _)| (Reverse(d.deepest()), d.stale, d.approximate, Reverse(d.blocks), d.host, d.disk));
        for (depths, worker) in entries {
            out.push(depths, worker);
        }
        if stale.any() {
            self.stale_without_match(&found, opts.workers.as_deref(), stale, out);
        }
    }

    /// The common answer: the device index's own groups, cut by the index.
    fn plain_answer(&self, query: &[LocalHash], opts: &MatchOptions, out: &mut Answer) {
        GROUPED.with_borrow_mut(|g| {
            self.device.find_grouped(query, opts, g);
            out.workers.reserve(g.len());
            for (blocks, ws) in g.iter() {
                out.workers.extend_from_slice(ws);
                out.groups.push((Depths { blocks, ..Depths::default() }, out.workers.len() as u32));
            }
        });
    }

    /// Every match in every asked tier, hybrid workers lowered to what all their groups serve,
    /// deepest first.
    fn every_match(&self, query: &[LocalHash], opts: &MatchOptions, tiers: &[Tier]) -> Vec<TieredMatch> {
        let mut found: Vec<TieredMatch> = match &self.tiers {
            Some(others) if !(tiers.is_empty() || tiers == [Tier::Device]) => {
                find_tiered(&self.device, others, tiers, query, opts)
            }
            None if !(tiers.is_empty() || tiers == [Tier::Device]) => Vec::new(),
            _ => self
                .device
                .find_matches(query, opts)
                .into_iter()
                .map(|m| TieredMatch { worker: m.worker, device: m.blocks, ..TieredMatch::default() })
                .collect(),
        };
        if let Some(groups) = self.groups.as_ref().filter(|g| g.any()) {
            let mut device: Vec<WorkerMatch> =
                found.iter().filter(|m| m.device > 0).map(|m| WorkerMatch { worker: m.worker, blocks: m.device }).collect();
            groups.limit(query, &mut device);
            let depth: SeededMap<WorkerId, u32> = device.into_iter().map(|m| (m.worker, m.blocks)).collect();
            for m in found.iter_mut() {
                m.device = depth.get(&m.worker).copied().unwrap_or(0);
            }
            found.retain(|m| m.deepest() > 0);
            found.sort_unstable_by(|a, b| {
                b.deepest().cmp(&a.deepest()).then(b.device.cmp(&a.device)).then(a.worker.cmp(&b.worker))
            });
        }
        found
    }

    /// Each worker's predicted depth where it reaches past its held one (held and announced
    /// blocks are both prefixes of the request, so their union is the deeper of the two);
    /// workers known only by their predictions join `found` after the rest, deepest first.
    fn predictions(&self, query: &[LocalHash], opts: &MatchOptions, found: &mut Vec<TieredMatch>) -> SeededMap<WorkerId, u32> {
        let mut deeper = SeededMap::default();
        let Some(predicted) = self.predicted().filter(|_| self.predicted_blocks() > 0) else { return deeper };
        deeper.extend(predicted.find_matches(query, opts).into_iter().map(|m| (m.worker, m.blocks)));
        let listed: SeededMap<WorkerId, u32> = found.iter().map(|m| (m.worker, m.device)).collect();
        deeper.retain(|w, p| listed.get(w).is_none_or(|&held| *p > held));
        let mut only: Vec<(WorkerId, u32)> =
            deeper.iter().filter(|(w, _)| !listed.contains_key(w)).map(|(&w, &p)| (w, p)).collect();
        only.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        found.extend(only.into_iter().map(|(worker, _)| TieredMatch { worker, ..TieredMatch::default() }));
        deeper
    }

    /// The stale workers (within `filter`) that are not among `found`, by worker.
    fn stale_without_match(&self, found: &[TieredMatch], filter: Option<&[u64]>, stale: &dyn Staleness, out: &mut Answer) {
        let listed: SeededMap<WorkerId, ()> = found.iter().map(|m| (m.worker, ())).collect();
        let allowed: Option<std::collections::HashSet<u64>> = filter.map(|f| f.iter().copied().collect());
        stale.for_each(&mut |w| {
            if !listed.contains_key(&w) && allowed.as_ref().is_none_or(|a| a.contains(&w.worker_id)) {
                out.stale_workers.push(w);
            }
        });
        out.stale_workers.sort_unstable();
    }
}

/// Keeps the `limit` deepest of `found` (deepest first), the workers tied at the cut kept in
/// rotation rather than the lowest ids every time.
fn cut(found: &mut Vec<TieredMatch>, limit: Option<usize>) {
    let Some(k) = limit.filter(|&k| k < found.len()) else { return };
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
