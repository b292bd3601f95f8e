//! Host and disk tiers beside the device index. Each tier has an index of its own, so a block
//! offloaded to host memory never counts as a GPU hit, an eviction from one tier never drops
//! another tier's copy, and a lookup can ask each tier for its own depth.
//!
//! A tier's chains are placed within that tier: a stored chain whose parent the worker does
//! not hold in the same tier cannot be placed there (engines offload whole prefixes, so this
//! is rare), and is counted apart: it says nothing about the worker's device state, so it
//! never makes the worker stale.

use crate::digest::Digest;
use crate::event::{Event, Tier};
use crate::hash::WorkerId;
use crate::index::{ApplyOutcome, KvIndex, Saved};
use serde::{Deserialize, Serialize};

/// The indexes of the tiers other than device, built alike.
pub struct OtherTiers<I> {
    /// CPU memory of the workers' hosts.
    pub host: I,
    /// Local disk or a remote store.
    pub disk: I,
}

impl<I: KvIndex> OtherTiers<I> {
    /// Both tiers' indexes, each made by `make`.
    pub fn new(make: impl Fn() -> I) -> Self {
        OtherTiers { host: make(), disk: make() }
    }

    /// The index of `tier`; `None` for device (the caller's main index).
    pub fn get(&self, tier: Tier) -> Option<&I> {
        match tier {
            Tier::Device => None,
            Tier::Host => Some(&self.host),
            Tier::Disk => Some(&self.disk),
        }
    }

    /// `(tier, index)` for host and disk.
    pub fn each(&self) -> [(Tier, &I); 2] {
        [(Tier::Host, &self.host), (Tier::Disk, &self.disk)]
    }
}

/// A worker's write state in the other tiers, each created on the worker's first event there.
pub struct TierWriters<W> {
    host: Option<W>,
    disk: Option<W>,
}

impl<W> Default for TierWriters<W> {
    fn default() -> Self {
        TierWriters { host: None, disk: None }
    }
}

impl<W> TierWriters<W> {
    fn slot(&mut self, tier: Tier) -> Option<&mut Option<W>> {
        match tier {
            Tier::Device => None,
            Tier::Host => Some(&mut self.host),
            Tier::Disk => Some(&mut self.disk),
        }
    }
}

impl<I: KvIndex> OtherTiers<I> {
    /// Engine hashes the worker holds in the host and disk tiers.
    pub fn held(&self, ws: &TierWriters<I::Writer>) -> (u64, u64) {
        let count = |index: &I, w: &Option<I::Writer>| w.as_ref().map_or(0, |w| index.held(w));
        (count(&self.host, &ws.host), count(&self.disk, &ws.disk))
    }

    /// The digests of the worker's host and disk blocks.
    pub fn digests(&self, ws: &TierWriters<I::Writer>) -> [Digest; 2] {
        let digest = |index: &I, w: &Option<I::Writer>| w.as_ref().map_or_else(Digest::default, |w| index.digest(w));
        [digest(&self.host, &ws.host), digest(&self.disk, &ws.disk)]
    }

    /// Applies a host or disk event of `worker` to that tier (a device event or a `cleared`
    /// does nothing here: see [`OtherTiers::clear`]). A worker that cannot get a slot in the
    /// tier has its event refused.
    pub fn apply(&self, worker: WorkerId, ws: &mut TierWriters<I::Writer>, ev: &Event) -> ApplyOutcome {
        let tier = match ev {
            Event::Stored { tier, .. } | Event::Removed { tier, .. } => *tier,
            Event::Cleared | Event::GroupStored { .. } | Event::GroupRemoved { .. } => return ApplyOutcome::default(),
        };
        let (Some(index), Some(slot)) = (self.get(tier), ws.slot(tier)) else { return ApplyOutcome::default() };
        let w = match slot {
            Some(w) => w,
            None => match index.writer(worker) {
                Ok(w) => slot.insert(w),
                Err(_) => return ApplyOutcome { refused: 1, ..ApplyOutcome::default() },
            },
        };
        match ev {
            Event::Stored { parent, blocks, .. } => index.store(w, *parent, blocks),
            Event::Removed { hashes, .. } => index.remove(w, hashes),
            Event::Cleared | Event::GroupStored { .. } | Event::GroupRemoved { .. } => ApplyOutcome::default(),
        }
    }

    /// Drops every block of the worker in both tiers (a `cleared`: the engine lost its cache).
    pub fn clear(&self, ws: &mut TierWriters<I::Writer>) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        if let Some(w) = ws.host.as_mut() {
            out.add(&self.host.clear(w));
        }
        if let Some(w) = ws.disk.as_mut() {
            out.add(&self.disk.clear(w));
        }
        out
    }

    /// The worker's host and disk blocks, for a snapshot.
    pub fn save(&self, ws: &TierWriters<I::Writer>) -> SavedTiers {
        SavedTiers { host: ws.host.as_ref().map(|w| self.host.save(w)), disk: ws.disk.as_ref().map(|w| self.disk.save(w)) }
    }

    /// Rebuilds the worker's host and disk blocks from [`OtherTiers::save`]; a tier the
    /// worker cannot get a slot in is refused.
    pub fn restore(&self, worker: WorkerId, ws: &mut TierWriters<I::Writer>, saved: &SavedTiers) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        for (tier, saved) in [(Tier::Host, &saved.host), (Tier::Disk, &saved.disk)] {
            let (Some(saved), Some(index), Some(slot)) = (saved, self.get(tier), ws.slot(tier)) else { continue };
            let w = match slot {
                Some(w) => w,
                None => match index.writer(worker) {
                    Ok(w) => slot.insert(w),
                    Err(_) => {
                        out.refused += 1;
                        continue;
                    }
                },
            };
            out.add(&index.restore(w, saved));
        }
        out
    }

    /// Drops the worker from both tiers, freeing its slots.
    pub fn remove_worker(&self, ws: TierWriters<I::Writer>) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        if let Some(w) = ws.host {
            out.add(&self.host.remove_worker(w));
        }
        if let Some(w) = ws.disk {
            out.add(&self.disk.remove_worker(w));
        }
        out
    }
}

/// A worker's saved blocks in the tiers other than device (`None`: it has none there).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedTiers {
    /// Its host-memory blocks.
    pub host: Option<Saved>,
    /// Its disk blocks.
    pub disk: Option<Saved>,
}

/// One worker's match depth in each tier a lookup asked for (0 where not asked or not held).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TieredMatch {
    /// The worker and dp rank.
    pub worker: WorkerId,
    /// Contiguous prefix held in GPU memory, in blocks.
    pub device: u32,
    /// Contiguous prefix held in host memory.
    pub host: u32,
    /// Contiguous prefix held on disk.
    pub disk: u32,
}

impl TieredMatch {
    /// The deepest of its tiers.
    pub fn deepest(&self) -> u32 {
        self.device.max(self.host).max(self.disk)
    }
}

/// Workers holding at least the first block of `query` in one of `tiers`, with each tier's
/// depth, deepest first (then deeper on device, then by worker).
pub fn find_tiered<I: KvIndex>(
    device: &I,
    others: &OtherTiers<I>,
    tiers: &[Tier],
    query: &[crate::hash::LocalHash],
    opts: &crate::index::MatchOptions,
) -> Vec<TieredMatch> {
    let mut by_worker: crate::seeded::SeededMap<WorkerId, TieredMatch> = Default::default();
    let mut asked = [false; 3];
    for &tier in tiers {
        let i = tier as usize;
        if std::mem::replace(&mut asked[i], true) {
            continue;
        }
        let found = match others.get(tier) {
            Some(index) => index.find_matches(query, opts),
            None => device.find_matches(query, opts),
        };
        for m in found {
            let e = by_worker.entry(m.worker).or_insert(TieredMatch { worker: m.worker, ..Default::default() });
            match tier {
                Tier::Device => e.device = m.blocks,
                Tier::Host => e.host = m.blocks,
                Tier::Disk => e.disk = m.blocks,
            }
        }
    }
    let mut out: Vec<TieredMatch> = by_worker.into_values().collect();
    out.sort_unstable_by(|a, b| b.deepest().cmp(&a.deepest()).then(b.device.cmp(&a.device)).then(a.worker.cmp(&b.worker)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::LocalHash;
    use crate::index::positional::PositionalIndex;
    use crate::index::MatchOptions;

    #[test]
    fn tiers_are_apart_and_merged_deepest_first() {
        let device = PositionalIndex::default();
        let others = OtherTiers::new(PositionalIndex::default);
        let (a, b) = (WorkerId::new(1, 0), WorkerId::new(2, 0));
        let chain = |n: u64| Event::stored(None, &(0..n).map(|i| (10 + i, i)).collect::<Vec<_>>());
        let in_tier = |ev: Event, tier: Tier| match ev {
            Event::Stored { parent, blocks, .. } => Event::Stored { parent, blocks, tier },
            other => other,
        };
        let mut wa = device.writer(a).unwrap();
        chain(2).apply_to(&device, &mut wa);
        let (mut ta, mut tb) = (TierWriters::default(), TierWriters::default());
        others.apply(a, &mut ta, &in_tier(chain(4), Tier::Host));
        others.apply(b, &mut tb, &in_tier(chain(3), Tier::Disk));
        // A device event is not the other tiers' business.
        assert_eq!(others.apply(a, &mut ta, &chain(4)), ApplyOutcome::default());

        let q: Vec<LocalHash> = (0..5).map(LocalHash).collect();
        let all =
            find_tiered(&device, &others, &[Tier::Device, Tier::Host, Tier::Disk, Tier::Host], &q, &MatchOptions::default());
        assert_eq!(
            all,
            vec![TieredMatch { worker: a, device: 2, host: 4, disk: 0 }, TieredMatch { worker: b, device: 0, host: 0, disk: 3 }]
        );
        let device_only = find_tiered(&device, &others, &[Tier::Device], &q, &MatchOptions::default());
        assert_eq!(device_only, vec![TieredMatch { worker: a, device: 2, host: 0, disk: 0 }]);

        // A removal in host memory leaves the device copy; a clear drops every tier.
        others.apply(a, &mut ta, &Event::Removed { hashes: vec![crate::hash::BlockHash(10)], tier: Tier::Host });
        let after = find_tiered(&device, &others, &[Tier::Device, Tier::Host], &q, &MatchOptions::default());
        assert_eq!(after, vec![TieredMatch { worker: a, device: 2, host: 0, disk: 0 }]);
        others.clear(&mut tb);
        assert!(find_tiered(&device, &others, &[Tier::Disk], &q, &MatchOptions::default()).is_empty());
    }
}
