//! A deployment sharded by worker: which shard owns a worker, and how the shards' answers to
//! one lookup become the answer one index holding every worker would give.
//!
//! The shard of a worker is decided by the NATS server itself: a subject mapping
//! `"{prefix}.events.*": "{prefix}.events.{{wildcard(1)}}.{{partition(S,1)}}"` delivers each
//! worker's events to `{prefix}.events.{worker}.{k}`, and shard `k` subscribes to
//! `{prefix}.events.*.{k}`. The server's partition is FNV-1a (32 bits) of the token's bytes,
//! modulo `S`: [`partition`] computes the same, so that a publisher can tell whether a resync
//! broadcast is its shard's, and a client which shard's answer about a worker is the owner's.

use crate::protocol::{MatchGroup, ShardOf, WorkerPair, WorkerRef};
use kvindex_core::index::rotation;
use serde::{Deserialize, Serialize};

/// The shard (of `shards`) that owns `worker_id`: what the NATS server's `partition(S, 1)`
/// gives for the worker's subject token (its id in decimal).
pub fn partition(worker_id: u64, shards: u32) -> u32 {
    if shards <= 1 {
        return 0;
    }
    // The decimal digits, on the stack: this runs per event batch and per merged worker.
    let (mut digits, mut at, mut n) = ([0u8; 20], 20, worker_id);
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut h: u32 = 0x811c_9dc5;
    for &b in &digits[at..] {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % shards
}

/// The subject mappings a NATS server needs for `shards` shards under `prefix`: events and
/// announcements to the worker's shard. In a server configuration's `mappings` block (or an
/// account's), one `"from": "to"` line each.
pub fn mappings(prefix: &str, shards: u32) -> [(String, String); 2] {
    let map =
        |what: &str| (format!("{prefix}.{what}.*"), format!("{prefix}.{what}.{{{{wildcard(1)}}}}.{{{{partition({shards},1)}}}}"));
    [map("events"), map("routed")]
}

/// A resync broadcast's payload in a sharded deployment: only the publishers of that shard's
/// workers answer (a publisher that cannot read it answers anyway).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncShard {
    /// The shard asking.
    pub shard: u32,
    /// How many shards the deployment has.
    pub shards: u32,
}

impl ResyncShard {
    /// The msgpack bytes of the broadcast.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Whether the publisher of `worker_id` should answer a broadcast with this payload: yes
    /// unless it names a shard that does not own the worker.
    pub fn answers(payload: &[u8], worker_id: u64) -> bool {
        match rmp_serde::from_slice::<ResyncShard>(payload) {
            Ok(s) if s.shards > 1 => partition(worker_id, s.shards) == s.shard,
            _ => true,
        }
    }
}

/// One shard's answer, as the merge takes it: its groups and stale workers.
#[derive(Clone, Debug, Default)]
pub struct ShardAnswer {
    /// The shard that answered.
    pub shard: u32,
    /// Its groups, deepest first.
    pub groups: Vec<MatchGroup>,
    /// Its stale workers that match nothing.
    pub stale_workers: Vec<WorkerRef>,
}

/// How many of shards `0..count` answered under `count`, in answers each tagged with the shard
/// that gave it and the count it runs under (a shard answering twice counts once).
pub fn answered<T>(answers: &[(ShardOf, T)], count: u32) -> u32 {
    (0..count).filter(|k| answers.iter().any(|(of, _)| of.shards == count && of.shard == *k)).count() as u32
}

/// Of answers gathered under different shard counts (while the count changes, old and new
/// shards both answer), the count most completely answered (the larger on a tie) and its
/// answers alone, one per shard: answers of two counts are never merged. `None` when there
/// are none.
pub fn one_count<T>(answers: Vec<(ShardOf, T)>) -> Option<(u32, Vec<(u32, T)>)> {
    let count = answers.iter().map(|(of, _)| of.shards).max_by(|&a, &b| {
        let (fa, fb) = (u64::from(answered(&answers, a)) * u64::from(b), u64::from(answered(&answers, b)) * u64::from(a));
        fa.cmp(&fb).then(a.cmp(&b))
    })?;
    let mut kept: Vec<(u32, T)> = Vec::new();
    for (of, a) in answers {
        if of.shards == count && !kept.iter().any(|(k, _)| *k == of.shard) {
            kept.push((of.shard, a));
        }
    }
    Some((count, kept))
}

/// The answer one index holding every worker would give, from the shards' answers: groups
/// deepest first (a worker only from the shard that owns it under `shards`, so that a shard
/// still holding a worker that moved away is not believed), at most `limit` workers, those tied
/// at the cut kept in rotation.
pub fn merge(answers: &[ShardAnswer], shards: u32, limit: Option<usize>) -> (Vec<MatchGroup>, Vec<WorkerRef>) {
    let mut groups: Vec<MatchGroup> = Vec::new();
    for a in answers {
        for g in &a.groups {
            let workers: Vec<WorkerPair> = g.workers.iter().copied().filter(|w| partition(w.0, shards) == a.shard).collect();
            if !workers.is_empty() {
                groups.push(MatchGroup { workers, ..g.clone() });
            }
        }
    }
    // Deepest first; groups with the same answer become one.
    groups.sort_by(|a, b| rank(b).cmp(&rank(a)).then_with(|| key(a).cmp(&key(b))));
    let mut merged: Vec<MatchGroup> = Vec::with_capacity(groups.len());
    for g in groups {
        match merged.last_mut() {
            Some(last) if key(last) == key(&g) => last.workers.extend(g.workers),
            _ => merged.push(g),
        }
    }
    if let Some(mut room) = limit {
        let mut keep = 0;
        while keep < merged.len() && room > 0 {
            let g = &mut merged[keep];
            if g.workers.len() > room {
                g.workers.sort_unstable();
                let start = rotation(g.workers.len(), room);
                g.workers.rotate_left(start);
                g.workers.truncate(room);
            }
            room -= g.workers.len();
            keep += 1;
        }
        merged.truncate(keep);
    }
    let stale = answers
        .iter()
        .flat_map(|a| a.stale_workers.iter().filter(|w| partition(w.worker_id, shards) == a.shard).copied())
        .collect();
    (merged, stale)
}

/// How deep a group's answer reaches, for the order: its deepest tier or prediction.
fn rank(g: &MatchGroup) -> u32 {
    g.blocks.max(g.tiers.host.unwrap_or(0)).max(g.tiers.disk.unwrap_or(0)).max(g.predicted_blocks.unwrap_or(0))
}

/// Everything a group's workers share.
fn key(g: &MatchGroup) -> (u32, bool, Option<u32>, Option<u32>, Option<u32>, bool) {
    (g.blocks, g.stale, g.tiers.host, g.tiers.disk, g.predicted_blocks, g.approximate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_fnv1a_of_the_decimal_id() {
        let fnv = |s: &str| s.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
        assert_eq!(fnv(""), 0x811c_9dc5);
        assert_eq!(fnv("a"), 0xe40c_292c, "FNV-1a's published vector");
        // FNV-1a 32 of "7": the offset basis xor 0x37, times the prime.
        assert_eq!(fnv("7"), 0x320c_a3f6);
        assert_eq!(partition(7, 0x320c_a3f6 + 1), 0x320c_a3f6);
        for w in [0u64, 7, 42, 1000, u64::MAX] {
            assert_eq!(partition(w, 3), fnv(&w.to_string()) % 3);
        }
        assert_eq!(partition(12345, 1), 0);
    }

    #[test]
    fn a_merge_answers_as_one_index_would() {
        let pair = |w: u64| WorkerPair(w, 0);
        let shards = 3;
        let owned = |k: u32| (0..60u64).filter(move |&w| partition(w, shards) == k);
        // Each shard answers its own workers: two at depth 9, the rest at depth 4.
        let answers: Vec<ShardAnswer> = (0..shards)
            .map(|k| {
                let mine: Vec<u64> = owned(k).collect();
                ShardAnswer {
                    shard: k,
                    groups: vec![
                        MatchGroup { blocks: 9, workers: mine[..2].iter().map(|&w| pair(w)).collect(), ..Default::default() },
                        MatchGroup { blocks: 4, workers: mine[2..].iter().map(|&w| pair(w)).collect(), ..Default::default() },
                    ],
                    stale_workers: vec![],
                }
            })
            .collect();
        let (all, _) = merge(&answers, shards, None);
        assert_eq!(all.iter().map(|g| (g.blocks, g.workers.len())).collect::<Vec<_>>(), vec![(9, 6), (4, 54)]);
        let (cut, _) = merge(&answers, shards, Some(10));
        assert_eq!(cut.iter().map(|g| (g.blocks, g.workers.len())).collect::<Vec<_>>(), vec![(9, 6), (4, 4)]);
        // Which of the 54 workers tied at the cut are kept goes round: over 27 cuts of 4 each,
        // every one of them twice, and never a worker twice in one answer.
        let tied: std::collections::BTreeSet<u64> = all[1].workers.iter().map(|w| w.0).collect();
        let mut kept = std::collections::BTreeMap::<u64, u32>::new();
        for _ in 0..27 {
            let (cut, _) = merge(&answers, shards, Some(10));
            let at_4: std::collections::BTreeSet<u64> = cut[1].workers.iter().map(|w| w.0).collect();
            assert_eq!(at_4.len(), 4, "four distinct workers");
            for w in at_4 {
                assert!(tied.contains(&w));
                *kept.entry(w).or_default() += 1;
            }
        }
        assert!(kept.len() == 54 && kept.values().all(|&n| n == 2), "each tied worker kept twice: {kept:?}");
        // A worker answered by a shard that does not own it (it moved away) is not believed.
        let mut stray = answers.clone();
        let elsewhere = owned(1).next().unwrap_or(0);
        stray[0].groups[0].workers.push(pair(elsewhere));
        let (all, _) = merge(&stray, shards, None);
        assert_eq!(all.iter().filter(|g| g.blocks == 9).map(|g| g.workers.len()).sum::<usize>(), 6);

        // Stale workers stay apart from whole ones at the same depth, and a stale worker that
        // matches nothing is believed only from the shard that owns it.
        let (a, b) = (owned(0).next().unwrap_or(0), owned(1).next().unwrap_or(0));
        let flagged = vec![
            ShardAnswer {
                shard: 0,
                groups: vec![MatchGroup { blocks: 9, stale: true, workers: vec![pair(a)], ..Default::default() }],
                stale_workers: vec![WorkerRef { worker_id: b, dp_rank: 0 }],
            },
            ShardAnswer {
                shard: 1,
                groups: vec![MatchGroup { blocks: 9, workers: vec![pair(b)], ..Default::default() }],
                stale_workers: vec![WorkerRef { worker_id: b, dp_rank: 0 }],
            },
        ];
        let (groups, stale) = merge(&flagged, shards, None);
        let seen: Vec<(u32, bool, Vec<u64>)> =
            groups.iter().map(|g| (g.blocks, g.stale, g.workers.iter().map(|w| w.0).collect())).collect();
        assert_eq!(seen, vec![(9, false, vec![b]), (9, true, vec![a])]);
        assert_eq!(stale, vec![WorkerRef { worker_id: b, dp_rank: 0 }], "from shard 1 alone");
    }

    #[test]
    fn answers_of_two_shard_counts_are_never_merged() {
        let from = |shard: u32, w: u64| ShardAnswer {
            shard,
            groups: vec![MatchGroup { blocks: 5, workers: vec![WorkerPair(w, 0)], ..Default::default() }],
            stale_workers: vec![],
        };
        let at = |shards: u32, shard: u32, w: u64| (ShardOf { shard, shards }, from(shard, w));
        let workers = |kept: &[(u32, ShardAnswer)]| kept.iter().map(|(_, a)| a.groups[0].workers[0].0).collect::<Vec<_>>();
        // While three shards become two: the new shards 0 and 1 of 2 both answered, the old
        // shard 0 of 3 too (it shares shard 0's queue group). The count of 2 is whole.
        let (count, kept) = one_count(vec![at(2, 0, 10), at(3, 0, 11), at(2, 1, 12)]).expect("answers");
        assert_eq!((count, workers(&kept)), (2, vec![10, 12]));
        // The old shard took shard 0's request: one of two new shards (a half) beats one of
        // three old ones (a third); the answer is partial, never a mix of both counts.
        let (count, kept) = one_count(vec![at(3, 0, 11), at(2, 1, 12), at(3, 2, 13)]).expect("answers");
        assert_eq!((count, workers(&kept)), (3, vec![11, 13]), "two of three old shards beat one of two new ones");
        let (count, kept) = one_count(vec![at(3, 0, 11), at(2, 1, 12)]).expect("answers");
        assert_eq!((count, workers(&kept)), (2, vec![12]));
        assert_eq!(answered(&[at(2, 1, 12), at(2, 1, 12)], 2), 1, "a shard answering twice counts once");
        let (_, kept) = one_count(vec![at(2, 1, 12), at(2, 1, 14)]).expect("answers");
        assert_eq!(workers(&kept), vec![12], "one answer per shard, the first");
        assert!(one_count::<ShardAnswer>(vec![]).is_none());
        // As complete (a half each): the larger count wins.
        let (count, kept) = one_count(vec![at(2, 0, 10), at(4, 0, 20), at(4, 3, 23)]).expect("answers");
        assert_eq!((count, workers(&kept)), (4, vec![20, 23]), "two of four beat one of two on a tie");
    }
}
