//! Restatements: a snapshot of a worker the model already holds whole, applied as the
//! difference from what it holds. Its stores go on top of the worker's blocks (a block held
//! already is a duplicate, nothing changes), what it and the events after it name is noted,
//! and when it ends every block it did not name is removed. A snapshot that restates the
//! worker's state therefore changes no answer; while one runs, an answer counts a block that
//! both the old and the new state hold, and may count one of either alone.

use super::SavedWorker;
use crate::event::{Event, Tier};
use crate::hash::BlockHash;
use crate::index::Saved;
use crate::seeded::SeededState;
use std::collections::HashSet;

/// Where a batch stands in its worker's restatement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Restate {
    /// The batch opens one (its snapshot's `cleared` is left out: nothing is dropped).
    pub opens: bool,
    /// The batch ends it: `Some(true)` removes what it did not name; `Some(false)` gives it up
    /// (the snapshot had a gap: the worker keeps what it holds, stale until the next one).
    pub ends: Option<bool>,
}

/// The part of the model a named hash belongs to: the device tier, host, disk, or a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Part {
    /// A tier's chains (the device tier's are the primary group's).
    Tier(Tier),
    /// A hybrid model's other group (1..=[`crate::hybrid::MAX_GROUP`]).
    Group(u8),
}

/// What an open restatement has named so far, bounded.
pub(super) struct Named {
    /// Engine hashes stored since it opened and not removed since, by part. Keyed by values a
    /// publisher picks, so seeded.
    held: HashSet<(Part, u64), SeededState>,
    /// The most hashes it may name; past it the restatement is given up.
    max: usize,
}

/// A restatement named more hashes than its bound: it is given up.
pub(super) struct TooLarge;

impl Named {
    /// Nothing named yet; at most `max` hashes.
    pub(super) fn new(max: usize) -> Named {
        Named { held: HashSet::default(), max }
    }

    /// Notes what `ev` names (a `cleared` is not noted: it ends the restatement).
    pub(super) fn note(&mut self, ev: &Event) -> Result<(), TooLarge> {
        match ev {
            Event::Stored { blocks, tier, .. } => self.held.extend(blocks.iter().map(|b| (Part::Tier(*tier), b.block_hash.0))),
            Event::GroupStored { group, hashes, .. } => self.held.extend(hashes.iter().map(|h| (Part::Group(*group), h.0))),
            Event::Removed { hashes, tier } => hashes.iter().for_each(|h| {
                self.held.remove(&(Part::Tier(*tier), h.0));
            }),
            Event::GroupRemoved { group, hashes } => hashes.iter().for_each(|h| {
                self.held.remove(&(Part::Group(*group), h.0));
            }),
            Event::Cleared => {}
        }
        if self.held.len() > self.max {
            return Err(TooLarge);
        }
        Ok(())
    }

    /// The removals that leave `saved` (the worker as it stands) with only what was named:
    /// the other groups' first (they hang on the primary group's blocks), then host, disk and
    /// device.
    pub(super) fn removals(&self, saved: &SavedWorker) -> Vec<Event> {
        let mut out = Vec::new();
        if let Some(groups) = &saved.groups {
            for &(group, _) in &groups.kinds {
                let hashes: Vec<BlockHash> = groups
                    .blocks
                    .iter()
                    .filter(|b| group >= 1 && (b.3 >> group) & 1 == 1 && !self.held.contains(&(Part::Group(group), b.0)))
                    .map(|b| BlockHash(b.0))
                    .collect();
                if !hashes.is_empty() {
                    out.push(Event::GroupRemoved { group, hashes });
                }
            }
        }
        let tiers = [(Tier::Host, saved.tiers.host.as_ref()), (Tier::Disk, saved.tiers.disk.as_ref())];
        for (tier, blocks) in tiers.into_iter().chain([(Tier::Device, Some(&saved.device))]) {
            let hashes = self.gone(Part::Tier(tier), blocks);
            if !hashes.is_empty() {
                out.push(Event::Removed { hashes, tier });
            }
        }
        out
    }

    /// The hashes of `saved` (placed or past the depth limit) not named in `part`.
    fn gone(&self, part: Part, saved: Option<&Saved>) -> Vec<BlockHash> {
        let Some(saved) = saved else { return Vec::new() };
        let all = saved.blocks.iter().map(|b| b.hash).chain(saved.beyond.iter().copied());
        all.filter(|&h| !self.held.contains(&(part, h))).map(BlockHash).collect()
    }
}
