//! One engine rank's KV-cache groups (vLLM's hybrid models): which group is kvindex's
//! primary group, what the others are, and each event's place in kvindex's protocol.
//!
//! The primary group is the engine's lowest-numbered full-attention group: its chains go out
//! as plain `stored` / `removed` events. Every other group `g` goes out as kvindex group
//! `g + 1`, by engine hash, after the primary group's events of the same batch so that its
//! blocks find their place (engines cache a block in all groups in the same step).

use crate::engine::{EngineEvent, EngineKind, Skip};
use kvindex_core::groups::MAX_GROUP;
use kvindex_core::{Event, GroupKind, Tier};
use std::collections::BTreeMap;

/// What a rank's events have said of its groups.
#[derive(Debug, Default)]
pub struct RankGroups {
    /// Each group's kind, from its stores; at most [`MAX_GROUP`] groups are kept (the engine
    /// picks the indexes, so the map is bounded by what kvindex can number).
    kinds: BTreeMap<u32, EngineKind>,
    /// The engine's group that is kvindex's primary group, once one is known to be full attention.
    primary: Option<u32>,
}

impl RankGroups {
    /// Learns the kinds a batch's stores say, then routes its events: the other groups' events
    /// go after the primary group's (up to each `cleared`, which keeps its place).
    pub fn route(&mut self, batch: Vec<Result<EngineEvent, Skip>>) -> Vec<Result<Event, Skip>> {
        for ev in batch.iter().flatten() {
            if let Some(g) = ev.group {
                if let Some(kind) = g.kind {
                    if self.kinds.len() < usize::from(MAX_GROUP) || self.kinds.contains_key(&g.idx) {
                        self.kinds.insert(g.idx, kind);
                    }
                }
            }
        }
        if self.primary.is_none() {
            self.primary = self.kinds.iter().find(|(_, k)| **k == EngineKind::Known(GroupKind::Full)).map(|(i, _)| *i);
        }
        let mut out = Vec::with_capacity(batch.len());
        let mut later = Vec::new();
        for ev in batch {
            match ev.map(|e| self.one(e)) {
                Ok((Ok(Event::Cleared), _)) => {
                    out.append(&mut later);
                    out.push(Ok(Event::Cleared));
                }
                Ok((ev, true)) => later.push(ev),
                Ok((ev, false)) => out.push(ev),
                Err(skip) => out.push(Err(skip)),
            }
        }
        out.append(&mut later);
        out
    }

    /// One event in kvindex's terms, and whether it is another group's (sent after the rest).
    fn one(&self, e: EngineEvent) -> (Result<Event, Skip>, bool) {
        let Some(g) = e.group else { return (Ok(e.event), false) };
        let kind = self.kinds.get(&g.idx).copied();
        if kind == Some(EngineKind::Unsupported) {
            return (Err(Skip::Filtered("unsupported_group")), false);
        }
        let primary = match self.primary {
            Some(p) => p == g.idx,
            // No full-attention group known: a group 0 of no stated kind is the only one (older engines).
            None if g.idx == 0 && kind.is_none() => true,
            None => return (Err(Skip::Filtered("no_full_attention_group")), false),
        };
        if primary {
            return (Ok(e.event), false);
        }
        let Some(group) = u8::try_from(g.idx + 1).ok().filter(|n| *n <= MAX_GROUP) else {
            return (Err(Skip::Filtered("too_many_groups")), false);
        };
        let ev = match e.event {
            Event::Stored { blocks, tier: Tier::Device, .. } => {
                Event::GroupStored { group, kind: GroupKind::Full, hashes: blocks.iter().map(|b| b.block_hash).collect() }
            }
            Event::GroupStored { kind, hashes, .. } => Event::GroupStored { group, kind, hashes },
            Event::Removed { hashes, tier: Tier::Device } => Event::GroupRemoved { group, hashes },
            Event::Stored { .. } | Event::Removed { .. } => return (Err(Skip::Filtered("group_off_device")), false),
            other => other,
        };
        (Ok(ev), true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineGroup;
    use kvindex_core::hash::{BlockHash, StoredBlock};

    fn grouped(idx: u32, kind: Option<EngineKind>, event: Event) -> Result<EngineEvent, Skip> {
        Ok(EngineEvent { event, group: Some(EngineGroup { idx, kind }) })
    }

    fn chain(hashes: &[u64]) -> Event {
        Event::Stored { parent: None, blocks: hashes.iter().map(|&h| StoredBlock::new(h, h)).collect(), tier: Tier::Device }
    }

    fn group_store(kind: GroupKind, hashes: &[u64]) -> Event {
        Event::GroupStored { group: 0, kind, hashes: hashes.iter().map(|&h| BlockHash(h)).collect() }
    }

    #[test]
    fn the_lowest_full_attention_group_is_primary_and_the_others_follow_it() {
        let window = GroupKind::Window { blocks: 2 };
        let full = Some(EngineKind::Known(GroupKind::Full));
        let mut groups = RankGroups::default();
        // Group 0 is a sliding window, group 1 and 3 full attention, group 2 Mamba.
        let out = groups.route(vec![
            grouped(0, Some(EngineKind::Known(window)), group_store(window, &[2])),
            grouped(1, full, chain(&[1, 2])),
            grouped(2, Some(EngineKind::Known(GroupKind::State)), group_store(GroupKind::State, &[2])),
            grouped(3, full, chain(&[1, 2])),
            Ok(EngineEvent { event: Event::Cleared, group: None }),
            grouped(0, None, Event::removed(&[2])),
            grouped(9, Some(EngineKind::Unsupported), chain(&[1])),
        ]);
        let hashes = |h: &[u64]| h.iter().map(|&h| BlockHash(h)).collect::<Vec<_>>();
        assert_eq!(
            out,
            vec![
                Ok(chain(&[1, 2])),
                Ok(Event::GroupStored { group: 1, kind: window, hashes: hashes(&[2]) }),
                Ok(Event::GroupStored { group: 3, kind: GroupKind::State, hashes: hashes(&[2]) }),
                Ok(Event::GroupStored { group: 4, kind: GroupKind::Full, hashes: hashes(&[1, 2]) }),
                Ok(Event::Cleared),
                Err(Skip::Filtered("unsupported_group")),
                Ok(Event::GroupRemoved { group: 1, hashes: hashes(&[2]) }),
            ]
        );
        // Removals of a group it has not seen a kind for still go out; past group 62, none.
        let out = groups.route(vec![grouped(7, None, Event::removed(&[5])), grouped(70, None, Event::removed(&[5]))]);
        assert_eq!(out, vec![Err(Skip::Filtered("too_many_groups")), Ok(Event::GroupRemoved { group: 8, hashes: hashes(&[5]) })]);
    }

    #[test]
    fn without_a_full_attention_group_only_an_unnamed_group_0_is_primary() {
        let mut groups = RankGroups::default();
        assert_eq!(groups.route(vec![grouped(0, None, Event::removed(&[1]))]), vec![Ok(Event::removed(&[1]))]);
        let state = GroupKind::State;
        let out = groups.route(vec![grouped(0, Some(EngineKind::Known(state)), group_store(state, &[1]))]);
        assert_eq!(out, vec![Err(Skip::Filtered("no_full_attention_group"))]);
    }
}
