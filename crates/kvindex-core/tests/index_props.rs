//! Every backend must answer exactly like the reference model, on random event streams
//! built to hit the hard cases: chunk-hash collisions (a tiny local-hash alphabet), removals
//! in the middle of chains, engine hashes reused for other blocks, duplicates, unknown
//! parents and removes, clears, workers removed and coming back, restarts (every worker saved
//! and restored into a new index, as a snapshot does), chains past the depth limit continued
//! in later pieces, and chains longer than a position chunk.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::positional::{PositionalConfig, PositionalIndex};
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::{RunConfig, RunIndex};
use kvindex_core::index::{ApplyOutcome, DepthGroups, KvIndex, MatchOptions, WorkerMatch};
use proptest::prelude::*;
use std::collections::HashMap;

#[derive(Clone, Debug)]
enum Op {
    Store {
        worker: usize,
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
    },
    Remove {
        worker: usize,
        hashes: Vec<u64>,
    },
    Clear {
        worker: usize,
    },
    RemoveWorker {
        worker: usize,
    },
    /// Every worker saved, then restored into a new, empty index.
    Restart,
    Lookup {
        query: Vec<u64>,
        only: Option<Vec<u64>>,
        max_blocks: Option<usize>,
        max_matches: Option<usize>,
    },
}

/// Worker identities: a few ids, two dp ranks each.
fn worker_id(w: usize, spread: u64) -> WorkerId {
    WorkerId::new((w / 2) as u64 * spread, (w % 2) as u32)
}

fn op_strategy(workers: usize, hashes: u64, locals: u64) -> impl Strategy<Value = Op> {
    op_strategy_chains(workers, hashes, locals, 6)
}

/// As [`op_strategy`], with stored chains of up to `chain - 1` blocks.
fn op_strategy_chains(workers: usize, hashes: u64, locals: u64, chain: usize) -> impl Strategy<Value = Op> {
    let w = 0..workers;
    let h = 0..hashes;
    let l = 0..locals;
    prop_oneof![
        6 => (w.clone(), proptest::option::weighted(0.7, h.clone()), proptest::collection::vec((h.clone(), l.clone()), 1..chain))
            .prop_map(|(worker, parent, blocks)| Op::Store { worker, parent, blocks }),
        3 => (w.clone(), proptest::collection::vec(h.clone(), 1..4)).prop_map(|(worker, hashes)| Op::Remove { worker, hashes }),
        1 => w.clone().prop_map(|worker| Op::Clear { worker }),
        1 => w.prop_map(|worker| Op::RemoveWorker { worker }),
        1 => Just(Op::Restart),
        5 => (
            proptest::collection::vec(l, 1..10),
            proptest::option::weighted(0.2, proptest::collection::vec(0u64..4, 1..3)),
            proptest::option::weighted(0.2, 0usize..8),
            proptest::option::weighted(0.2, 0usize..4)
        )
            .prop_map(|(query, only, max_blocks, max_matches)| Op::Lookup { query, only, max_blocks, max_matches }),
    ]
}

/// Hole-heavy streams: single blocks removed as often as chains are stored, parents picked
/// among held blocks, and two locals only, so that a hole is often filled again at the same
/// place under another engine hash, and copies of a hidden block meet there. Some removals
/// take several blocks at once, in any order, as engines evict: an ancestor is often named
/// before its descendants, and a hole made in the same event its ancestors leave.
fn hole_strategy(workers: usize, hashes: u64, chain: usize) -> impl Strategy<Value = Op> {
    let w = 0..workers;
    let h = 0..hashes;
    prop_oneof![
        5 => (w.clone(), proptest::option::weighted(0.85, h.clone()), proptest::collection::vec((h.clone(), 0u64..2), 1..chain))
            .prop_map(|(worker, parent, blocks)| Op::Store { worker, parent, blocks }),
        5 => (w.clone(), h.clone()).prop_map(|(worker, x)| Op::Remove { worker, hashes: vec![x] }),
        2 => (w.clone(), proptest::collection::vec(h, 2..8)).prop_map(|(worker, hashes)| Op::Remove { worker, hashes }),
        1 => w.prop_map(|worker| Op::Clear { worker }),
        1 => Just(Op::Restart),
        4 => (proptest::collection::vec(0u64..2, 1..chain.max(12)), proptest::option::weighted(0.2, 0usize..3))
            .prop_map(|(query, max_matches)| Op::Lookup { query, only: None, max_blocks: None, max_matches }),
    ]
}

/// One backend with its writers, driven by the ops.
struct Driver<I: KvIndex> {
    index: I,
    writers: HashMap<usize, I::Writer>,
    spread: u64,
    /// Makes the empty index a restart restores into.
    make: Box<dyn Fn() -> I>,
}

impl<I: KvIndex> Driver<I> {
    fn new(make: impl Fn() -> I + 'static, spread: u64) -> Self {
        Driver { index: make(), writers: HashMap::new(), spread, make: Box::new(make) }
    }

    /// Saves every worker, then restores them all into a new index; the restores' outcome.
    fn restart(&mut self) -> ApplyOutcome {
        let mut saved: Vec<(usize, _)> = self.writers.iter().map(|(&w, writer)| (w, self.index.save(writer))).collect();
        saved.sort_by_key(|(w, _)| *w);
        self.index = (self.make)();
        self.writers.clear();
        let mut out = ApplyOutcome::default();
        for (w, s) in saved {
            let mut writer = self.index.writer(worker_id(w, self.spread)).expect("registry has room");
            out.add(&self.index.restore(&mut writer, &s));
            self.writers.insert(w, writer);
        }
        out
    }

    /// Applies `op`; lookups return their answer, writes their outcome.
    fn apply(&mut self, op: &Op) -> (Option<ApplyOutcome>, Option<Vec<WorkerMatch>>) {
        if let Op::Restart = op {
            return (Some(self.restart()), None);
        }
        let Driver { index, writers, spread, .. } = self;
        let spread = *spread;
        fn writer<'a, I: KvIndex>(
            index: &I,
            writers: &'a mut HashMap<usize, I::Writer>,
            w: usize,
            spread: u64,
        ) -> &'a mut I::Writer {
            writers.entry(w).or_insert_with(|| index.writer(worker_id(w, spread)).expect("registry has room"))
        }
        match op {
            Op::Store { worker, parent, blocks } => {
                let blocks: Vec<StoredBlock> = blocks.iter().map(|&(b, l)| StoredBlock::new(b, l)).collect();
                (Some(index.store(writer(index, writers, *worker, spread), parent.map(BlockHash), &blocks)), None)
            }
            Op::Remove { worker, hashes } => {
                let hashes: Vec<BlockHash> = hashes.iter().map(|&h| BlockHash(h)).collect();
                (Some(index.remove(writer(index, writers, *worker, spread), &hashes)), None)
            }
            Op::Clear { worker } => (Some(index.clear(writer(index, writers, *worker, spread))), None),
            Op::RemoveWorker { worker } => match writers.remove(worker) {
                Some(w) => (Some(index.remove_worker(w)), None),
                None => (None, None),
            },
            Op::Restart => (None, None),
            Op::Lookup { query, only, max_blocks, max_matches } => {
                let q: Vec<LocalHash> = query.iter().map(|&l| LocalHash(l)).collect();
                let all = MatchOptions {
                    workers: only.as_ref().map(|o| o.iter().map(|x| x * spread).collect()),
                    max_blocks: *max_blocks,
                    max_matches: None,
                };
                let complete = index.find_matches(&q, &all);
                let mut grouped = DepthGroups::default();
                index.find_grouped(&q, &all, &mut grouped);
                assert_eq!(grouped.normalized(), DepthGroups::from_matches(&complete), "{}: grouped answer", index.name());
                if let Some(k) = *max_matches {
                    let cut = index.find_matches(&q, &MatchOptions { max_matches: Some(k), ..all.clone() });
                    assert_cut(&complete, &cut, k);
                    index.find_grouped(&q, &MatchOptions { max_matches: Some(k), ..all }, &mut grouped);
                    assert_cut(&complete, &grouped.to_matches(), k);
                }
                (None, Some(complete))
            }
        }
    }
}

/// A cut answer keeps `k` of the complete one's deepest: the same depths, each worker at its
/// depth (which of the workers tied at the cut is the rotation's choice).
fn assert_cut(complete: &[WorkerMatch], cut: &[WorkerMatch], k: usize) {
    let want: Vec<u32> = complete.iter().take(k).map(|m| m.blocks).collect();
    let got: Vec<u32> = cut.iter().map(|m| m.blocks).collect();
    assert_eq!(got, want, "a cut keeps the deepest {k}, deepest first");
    for m in cut {
        assert!(complete.contains(m), "{m:?} is not in the complete answer {complete:?}");
    }
    let mut ids: Vec<_> = cut.iter().map(|m| m.worker).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), cut.len(), "no worker twice");
}

fn check(ops: &[Op], jump: usize, spread: u64) -> Result<(), TestCaseError> {
    check_depth(ops, jump, spread, 64)
}

fn check_depth(ops: &[Op], jump: usize, spread: u64, max_depth: u32) -> Result<(), TestCaseError> {
    let cfg = PositionalConfig { jump, max_depth, max_workers: 1 << 12, ..PositionalConfig::default() };
    let mut reference = Driver::new(move || ReferenceIndex::new(max_depth, 1 << 12), spread);
    let mut positional = Driver::new(move || PositionalIndex::new(cfg), spread);
    let mut runs =
        Driver::new(move || RunIndex::new(RunConfig { max_depth, max_workers: 1 << 12, ..RunConfig::default() }), spread);
    for (i, op) in ops.iter().enumerate() {
        let want = reference.apply(op);
        let got_p = positional.apply(op);
        let got_u = runs.apply(op);
        prop_assert_eq!(&got_u, &want, "runs differs at op {} {:?}", i, op);
        prop_assert_eq!(&got_p, &want, "positional differs at op {} {:?}", i, op);
        // Each worker's digest (the run index keeps its own as blocks come and go) is the
        // digest of what the reference holds for it.
        for (w, writer) in &reference.writers {
            let want = reference.index.digest(writer);
            prop_assert_eq!(runs.writers.get(w).map(|x| runs.index.digest(x)), Some(want), "runs digest at op {}", i);
            prop_assert_eq!(
                positional.writers.get(w).map(|x| positional.index.digest(x)),
                Some(want),
                "positional digest at op {}",
                i
            );
        }
    }
    // After the stream, every prefix of every chain any worker could hold must agree too.
    let p = positional.index.stats();
    let r = reference.index.stats();
    prop_assert_eq!(p.placements, r.placements);
    let u = runs.index.stats();
    prop_assert_eq!(u.placements, r.placements);
    prop_assert!(u.hidden <= u.placements);
    // Positional entries are the distinct (position, prefix) places lookups can see: all of
    // them unless blocks are hidden under a missing ancestor.
    prop_assert!(p.hidden <= p.placements);
    if p.hidden == 0 {
        prop_assert_eq!(p.entries, r.entries, "positional entries = distinct (position, prefix)");
    } else {
        prop_assert!(p.entries <= r.entries);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// Few hashes and locals: collisions, reuse and duplicates on nearly every op.
    #[test]
    fn backends_match_reference_dense(ops in proptest::collection::vec(op_strategy(6, 12, 4), 1..120), jump in 1usize..6) {
        check(&ops, jump, 1)?;
    }

    /// More room: longer chains survive, so jumps and binary search inside them matter.
    #[test]
    fn backends_match_reference_sparse(ops in proptest::collection::vec(op_strategy(4, 40, 12), 1..200), jump in 1usize..9) {
        check(&ops, jump, 1)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// Worker ids far apart so slots land in many windows: worker sets spill and fold back.
    #[test]
    fn backends_match_reference_with_many_workers(ops in proptest::collection::vec(op_strategy(120, 16, 4), 1..300), jump in 1usize..5) {
        check(&ops, jump, 1_000_003)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

    /// A registry wider than 512 slots: 600 other workers first, sharing root blocks with the
    /// stream's, which get the slots past them. Their spilled sets are then slot lists (a few
    /// workers far apart) as well as bitsets (the shared roots), converting both ways.
    #[test]
    fn backends_match_reference_with_a_wide_registry(ops in proptest::collection::vec(op_strategy(120, 16, 4), 1..200), jump in 1usize..5) {
        let fillers = (0..600).map(|i| Op::Store { worker: 1000 + i, parent: None, blocks: vec![((i % 16) as u64, (i % 4) as u64)] });
        let all: Vec<Op> = fillers.chain(ops).collect();
        check(&all, jump, 1_000_003)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    /// A depth limit of a few blocks: chains cross it all the time, and later pieces hang off
    /// blocks past it (too deep, not unplaceable), are removed, re-stored and cleared.
    #[test]
    fn backends_match_reference_at_the_depth_limit(
        ops in proptest::collection::vec(op_strategy(4, 16, 4), 1..150), jump in 1usize..4, max_depth in 2u32..8
    ) {
        check_depth(&ops, jump, 1, max_depth)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    /// Chains of up to 300 blocks in one event: across position chunks (128) and the most a
    /// writer applies under one chunk lock (32), with removals in the middle leaving holes.
    #[test]
    fn backends_match_reference_with_chains_longer_than_a_chunk(
        ops in proptest::collection::vec(op_strategy_chains(3, 900, 5, 300), 1..40), jump in 1usize..80
    ) {
        check_depth(&ops, jump, 1, 400)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20000, ..ProptestConfig::default() })]

    /// Holes made and filled all the time, in short chains and small jump windows.
    #[test]
    fn backends_match_reference_with_holes(ops in proptest::collection::vec(hole_strategy(2, 10, 5), 1..300), jump in 2usize..6) {
        check(&ops, jump, 1)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Holes in many workers (worker sets over several windows) with chains deeper than a
    /// position chunk, so hidden subtrees span jump windows and chunks.
    #[test]
    fn backends_match_reference_with_holes_many_workers_and_deep_chains(
        ops in proptest::collection::vec(hole_strategy(90, 400, 200), 1..60), jump in 2usize..70
    ) {
        check_depth(&ops, jump, 1_000_003, 400)?;
    }
}
