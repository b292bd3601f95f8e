//! The cases the design calls out, run against every backend.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::positional::{PositionalConfig, PositionalIndex};
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::{RunConfig, RunIndex};
use kvindex_core::index::{KvIndex, MatchOptions};

fn chain(hashes: impl IntoIterator<Item = u64>, locals: impl IntoIterator<Item = u64>) -> Vec<StoredBlock> {
    hashes.into_iter().zip(locals).map(|(h, l)| StoredBlock::new(h, l)).collect()
}

fn q(locals: &[u64]) -> Vec<LocalHash> {
    locals.iter().map(|&l| LocalHash(l)).collect()
}

fn depths<I: KvIndex>(index: &I, query: &[u64], opts: &MatchOptions) -> Vec<(u64, u32, u32)> {
    index.find_matches(&q(query), opts).into_iter().map(|m| (m.worker.worker_id, m.worker.dp_rank, m.blocks)).collect()
}

/// Runs the generic case `$case` on every backend, one test each.
macro_rules! for_each_backend {
    ($case:ident) => {
        mod $case {
            use super::*;
            #[test]
            fn positional() {
                super::$case(PositionalIndex::new(PositionalConfig { jump: 8, ..Default::default() }));
            }
            #[test]
            fn positional_jump_1() {
                super::$case(PositionalIndex::new(PositionalConfig { jump: 1, ..Default::default() }));
            }
            #[test]
            fn runs() {
                super::$case(RunIndex::new(RunConfig::default()));
            }
            #[test]
            fn reference() {
                super::$case(ReferenceIndex::new(1 << 16, 1 << 16));
            }
        }
    };
}

// The cross-parent trap: a worker holding [A, X] and [B, Y] matches the query [A, Y] by one block.
for_each_backend!(collision_under_another_parent_is_not_a_match);
fn collision_under_another_parent_is_not_a_match<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(1, 0)).unwrap();
    index.store(&mut w, None, &chain([10, 11], [0xA, 0x99_u64]));
    index.store(&mut w, None, &chain([20, 21], [0xB, 0xF]));
    assert_eq!(depths(&index, &[0xA, 0xF], &MatchOptions::default()), vec![(1, 0, 1)]);
    assert_eq!(depths(&index, &[0xB, 0xF], &MatchOptions::default()), vec![(1, 0, 2)]);
    assert_eq!(depths(&index, &[0xF], &MatchOptions::default()), vec![]);
}

// A block removed in the middle ends the match there, whatever is still held after it.
for_each_backend!(middle_removal_ends_the_match);
fn middle_removal_ends_the_match<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(7, 0)).unwrap();
    let hashes: Vec<u64> = (1000..1100).collect();
    let locals: Vec<u64> = (0..100).map(|i| 5000 + i).collect();
    assert_eq!(index.store(&mut w, None, &chain(hashes.clone(), locals.clone())).stored, 100);
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(7, 0, 100)]);
    assert_eq!(index.remove(&mut w, &[BlockHash(1010)]).removed, 1);
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(7, 0, 10)]);
    // Storing it back under its parent closes the hole again.
    index.store(&mut w, Some(BlockHash(1009)), &chain([1010], [5010]));
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(7, 0, 100)]);
}

// One event may name a block before its descendants (engines free in any order): the result
// is that of any order, and what the event leaves of the subtree comes back with the block.
for_each_backend!(one_event_removing_a_block_before_its_descendants);
fn one_event_removing_a_block_before_its_descendants<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(4, 0)).unwrap();
    let locals: Vec<u64> = (0..40).map(|i| 7000 + i).collect();
    index.store(&mut w, None, &chain(2000..2040, locals.clone()));
    let mut event = vec![BlockHash(2010)];
    event.extend((2011..2021).map(BlockHash));
    event.push(BlockHash(2010));
    let out = index.remove(&mut w, &event);
    assert_eq!((out.removed, out.unknown_removes), (11, 1));
    assert_eq!(index.stats().placements, 29);
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(4, 0, 10)]);
    index.store(&mut w, Some(BlockHash(2009)), &chain(2010..2021, locals[10..21].iter().copied()));
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(4, 0, 40)]);
}

// One event with every kind of removal: a block named before its child, a run named deepest
// first above a child that stays, a branch point keeping one child, a hidden block. Holes are
// left only where children stay, and refilling them brings everything back.
for_each_backend!(one_event_mixing_real_holes_and_blocks_that_go_with_their_children);
fn one_event_mixing_real_holes_and_blocks_that_go_with_their_children<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(5, 0)).unwrap();
    let all = MatchOptions::default();
    let locals: Vec<u64> = (100..140).collect();
    index.store(&mut w, None, &chain(1000..1040, locals.clone()));
    index.store(&mut w, Some(BlockHash(1012)), &chain(3000..3005, 900..905));
    let branch: Vec<u64> = locals[..13].iter().copied().chain(900..905).collect();
    let mut event = vec![BlockHash(1005), BlockHash(1006)];
    event.extend((1012..=1020).rev().map(BlockHash));
    event.push(BlockHash(3002));
    let out = index.remove(&mut w, &event);
    assert_eq!((out.removed, out.unknown_removes), (12, 0));
    assert_eq!(index.stats().placements, 33);
    assert_eq!(depths(&index, &locals, &all), vec![(5, 0, 5)]);
    assert_eq!(depths(&index, &branch, &all), vec![(5, 0, 5)]);
    index.store(&mut w, Some(BlockHash(1004)), &chain(1005..1007, locals[5..7].iter().copied()));
    assert_eq!(depths(&index, &locals, &all), vec![(5, 0, 12)]);
    index.store(&mut w, Some(BlockHash(1011)), &chain(1012..1021, locals[12..21].iter().copied()));
    assert_eq!(depths(&index, &locals, &all), vec![(5, 0, 40)]);
    assert_eq!(depths(&index, &branch, &all), vec![(5, 0, 15)]);
}

// Engines hash content the same way everywhere: two workers share every engine hash.
for_each_backend!(workers_sharing_engine_hashes_do_not_disturb_each_other);
fn workers_sharing_engine_hashes_do_not_disturb_each_other<I: KvIndex>(index: I) {
    let mut a = index.writer(WorkerId::new(1, 0)).unwrap();
    let mut b = index.writer(WorkerId::new(2, 0)).unwrap();
    let locals = [1u64, 2, 3, 4];
    index.store(&mut a, None, &chain([11, 12, 13, 14], locals));
    index.store(&mut b, None, &chain([11, 12, 13, 14], locals));
    index.remove(&mut a, &[BlockHash(13)]);
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(2, 0, 4), (1, 0, 2)]);
    index.clear(&mut b);
    assert_eq!(depths(&index, &locals, &MatchOptions::default()), vec![(1, 0, 2)]);
}

// Bad input is reported, never a panic, and changes nothing else.
for_each_backend!(duplicates_unknowns_and_unplaceable_are_counted);
fn duplicates_unknowns_and_unplaceable_are_counted<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(3, 1)).unwrap();
    let out = index.store(&mut w, None, &chain([1, 2], [10, 20]));
    assert_eq!((out.stored, out.duplicates), (2, 0));
    let out = index.store(&mut w, None, &chain([1, 2], [10, 20]));
    assert_eq!((out.stored, out.duplicates), (0, 2));
    let out = index.store(&mut w, Some(BlockHash(99)), &chain([3], [30]));
    assert_eq!((out.stored, out.unplaceable), (0, 1));
    let out = index.remove(&mut w, &[BlockHash(98), BlockHash(2)]);
    assert_eq!((out.removed, out.unknown_removes), (1, 1));
    assert_eq!(index.stats().placements, 1);
    assert_eq!(depths(&index, &[10, 20], &MatchOptions::default()), vec![(3, 1, 1)]);
}

// Worker filter and max_blocks; sorted deepest first, then by worker.
for_each_backend!(filter_and_max_blocks);
fn filter_and_max_blocks<I: KvIndex>(index: I) {
    for (id, len) in [(5u64, 3usize), (6, 5), (4, 5)] {
        let mut w = index.writer(WorkerId::new(id, 0)).unwrap();
        index.store(&mut w, None, &chain((0..len as u64).map(|i| id * 100 + i), (0..len as u64).map(|i| 40 + i)));
    }
    let query = [40, 41, 42, 43, 44, 45];
    assert_eq!(depths(&index, &query, &MatchOptions::default()), vec![(4, 0, 5), (6, 0, 5), (5, 0, 3)]);
    let only = MatchOptions { workers: Some(vec![5, 6]), ..Default::default() };
    assert_eq!(depths(&index, &query, &only), vec![(6, 0, 5), (5, 0, 3)]);
    let short = MatchOptions { max_blocks: Some(2), ..Default::default() };
    assert_eq!(depths(&index, &query, &short), vec![(4, 0, 2), (5, 0, 2), (6, 0, 2)]);
}

// Hundreds of workers (sets spill past one inline window), removed and re-added.
for_each_backend!(many_workers_and_slot_reuse);
fn many_workers_and_slot_reuse<I: KvIndex>(index: I) {
    let locals: Vec<u64> = (0..40).collect();
    let mut writers: Vec<_> = (0..300u64).map(|id| index.writer(WorkerId::new(id * 977, (id % 3) as u32)).unwrap()).collect();
    for (i, w) in writers.iter_mut().enumerate() {
        let len = 1 + i % 40;
        index.store(w, None, &chain((0..len as u64).map(|b| 1_000_000 + b), locals[..len].iter().copied()));
    }
    let all = depths(&index, &locals, &MatchOptions::default());
    assert_eq!(all.len(), 300);
    for (id, dp, d) in &all {
        let i = (id / 977) as usize;
        assert_eq!((*dp, *d as usize), ((i % 3) as u32, 1 + i % 40));
    }
    for w in writers.drain(100..) {
        index.remove_worker(w);
    }
    assert_eq!(index.stats().workers, 100);
    assert_eq!(depths(&index, &locals, &MatchOptions::default()).len(), 100);
    let mut again = index.writer(WorkerId::new(12345, 0)).unwrap();
    index.store(&mut again, None, &chain([1], [0]));
    let now = depths(&index, &locals[..1], &MatchOptions::default());
    assert_eq!(now.len(), 101);
    assert!(now.contains(&(12345, 0, 1)));
}

// A hole hides what hangs under it from the positional index's lookups until it is filled
// again; a second copy of a hidden block (another engine hash at the same place) must keep
// the first one's children reachable once that copy is removed.
for_each_backend!(removing_one_of_two_hidden_copies_keeps_the_children_reachable);
fn removing_one_of_two_hidden_copies_keeps_the_children_reachable<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(3, 0)).unwrap();
    let all = MatchOptions::default();
    index.store(&mut w, None, &chain([1, 2, 3], [11, 12, 13]));
    index.remove(&mut w, &[BlockHash(1)]);
    assert_eq!(depths(&index, &[11, 12, 13, 14], &all), vec![]);
    // Under the hole: another copy of block 3, then a child of the first copy.
    index.store(&mut w, Some(BlockHash(2)), &chain([4], [13]));
    index.store(&mut w, Some(BlockHash(3)), &chain([5], [14]));
    index.remove(&mut w, &[BlockHash(3)]);
    index.store(&mut w, None, &chain([1], [11]));
    assert_eq!(depths(&index, &[11, 12, 13, 14, 15], &all), vec![(3, 0, 4)]);
}

// Filling a hole shows everything under it again, across jump windows and branches.
for_each_backend!(filling_a_hole_shows_the_subtree_again);
fn filling_a_hole_shows_the_subtree_again<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(4, 0)).unwrap();
    let all = MatchOptions::default();
    let locals: Vec<u64> = (100..140).collect();
    index.store(&mut w, None, &chain(1000..1040, locals.clone()));
    // A branch off block 20, and a hole at block 5.
    index.store(&mut w, Some(BlockHash(1020)), &chain(2000..2010, 900..910));
    index.remove(&mut w, &[BlockHash(1005)]);
    assert_eq!(depths(&index, &locals, &all), vec![(4, 0, 5)]);
    let branch: Vec<u64> = locals[..21].iter().copied().chain(900..910).collect();
    assert_eq!(depths(&index, &branch, &all), vec![(4, 0, 5)]);
    // Another engine hash for the missing block fills the hole just as well.
    index.store(&mut w, Some(BlockHash(1004)), &chain([7777], [105]));
    assert_eq!(depths(&index, &locals, &all), vec![(4, 0, 40)]);
    assert_eq!(depths(&index, &branch, &all), vec![(4, 0, 31)]);
    // The orphaned subtree's own blocks can go while it is hidden.
    index.remove(&mut w, &[BlockHash(7777), BlockHash(2005), BlockHash(1030)]);
    index.store(&mut w, Some(BlockHash(1004)), &chain([1005], [105]));
    assert_eq!(depths(&index, &locals, &all), vec![(4, 0, 30)]);
    assert_eq!(depths(&index, &branch, &all), vec![(4, 0, 26)]);
}

// A hole over a family too big to hide block by block (5,000 children of one block) makes
// the positional index check that worker position by position instead: still exact.
for_each_backend!(a_hole_over_a_huge_family_stays_exact);
fn a_hole_over_a_huge_family_stays_exact<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(5, 0)).unwrap();
    let all = MatchOptions::default();
    index.store(&mut w, None, &chain([1, 2], [10, 20]));
    for i in 0..5000u64 {
        index.store(&mut w, Some(BlockHash(2)), &chain([100 + i], [1000 + i]));
    }
    index.remove(&mut w, &[BlockHash(2)]);
    assert_eq!(depths(&index, &[10, 20, 1007], &all), vec![(5, 0, 1)]);
    index.store(&mut w, Some(BlockHash(1)), &chain([2], [20]));
    assert_eq!(depths(&index, &[10, 20, 1007], &all), vec![(5, 0, 3)]);
    index.remove(&mut w, &[BlockHash(1)]);
    assert_eq!(depths(&index, &[10, 20, 1007], &all), vec![]);
    index.store(&mut w, None, &chain([1], [10]));
    assert_eq!(depths(&index, &[10, 20, 4999 + 1000], &all), vec![(5, 0, 3)]);
}

// The same for a deep family: 700 chains of 6 blocks under one block (all within a jump
// window of 8), hidden by a hole above it (too many to hide), and again with the family grown
// while hidden (too many to show again).
for_each_backend!(a_hole_over_a_huge_subtree_stays_exact);
fn a_hole_over_a_huge_subtree_stays_exact<I: KvIndex>(index: I) {
    let all = MatchOptions::default();
    let branch = |j: u64| -> Vec<StoredBlock> { chain((0..6).map(|i| 10_000 * (j + 1) + i), (0..6).map(|i| 100 * j + i)) };
    let query = |j: u64| -> Vec<u64> { [10, 20, 30].into_iter().chain((0..6).map(|i| 100 * j + i)).collect() };
    let mut w = index.writer(WorkerId::new(6, 0)).unwrap();
    for grow_while_hidden in [false, true] {
        index.clear(&mut w);
        index.store(&mut w, None, &chain([1, 2, 3], [10, 20, 30]));
        let before = if grow_while_hidden { 500 } else { 700 };
        for j in 0..before {
            index.store(&mut w, Some(BlockHash(3)), &branch(j));
        }
        index.remove(&mut w, &[BlockHash(2)]);
        for j in before..700 {
            index.store(&mut w, Some(BlockHash(3)), &branch(j));
        }
        for j in [0, 350, 699] {
            assert_eq!(depths(&index, &query(j), &all), vec![(6, 0, 1)]);
        }
        index.store(&mut w, Some(BlockHash(1)), &chain([2], [20]));
        for j in [0, 350, 699] {
            assert_eq!(depths(&index, &query(j), &all), vec![(6, 0, 9)]);
        }
        index.remove(&mut w, &[BlockHash(10_000 * 351 + 3)]);
        assert_eq!(depths(&index, &query(350), &all), vec![(6, 0, 6)]);
    }
}

// Hidden copies of one place under hidden copies of its parent's place (an engine hash reused
// down a chain under a hole): found by the hole property test; the copies are not siblings, so
// only the places of all hidden blocks tell them apart.
for_each_backend!(hidden_copies_under_hidden_copies_stay_exact);
fn hidden_copies_under_hidden_copies_stay_exact<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(0, 0)).unwrap();
    index.store(&mut w, None, &chain([7, 9, 8], [0, 0, 0]));
    index.store(&mut w, Some(BlockHash(7)), &chain([7, 6, 6, 7], [0, 0, 1, 0]));
    index.store(&mut w, None, &chain([0], [0]));
    assert_eq!(depths(&index, &[0, 0, 0, 1], &MatchOptions::default()), vec![(0, 0, 4)]);
}

// One event frees a branch point and then some of what hung under it, parents first: what it
// names leaves, what it does not stays reachable once the holes above it are filled again.
for_each_backend!(children_freed_after_their_parent_in_one_event);
fn children_freed_after_their_parent_in_one_event<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(4, 0)).unwrap();
    let all = MatchOptions::default();
    index.store(&mut w, None, &chain([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]));
    index.store(&mut w, Some(BlockHash(2)), &chain([6, 7], [6, 7]));
    index.store(&mut w, Some(BlockHash(2)), &chain([8], [8]));
    index.remove(&mut w, &[BlockHash(2), BlockHash(3), BlockHash(7), BlockHash(8)]);
    assert_eq!(depths(&index, &[1, 2, 3, 4, 5], &all), vec![(4, 0, 1)]);
    assert_eq!(depths(&index, &[1, 2, 6], &all), vec![(4, 0, 1)]);
    index.store(&mut w, Some(BlockHash(1)), &chain([2], [2]));
    assert_eq!(depths(&index, &[1, 2, 6, 7], &all), vec![(4, 0, 3)]);
    assert_eq!(depths(&index, &[1, 2, 8], &all), vec![(4, 0, 2)]);
    assert_eq!(depths(&index, &[1, 2, 3, 4, 5], &all), vec![(4, 0, 2)]);
    index.store(&mut w, Some(BlockHash(2)), &chain([3], [3]));
    assert_eq!(depths(&index, &[1, 2, 3, 4, 5], &all), vec![(4, 0, 5)]);
    index.remove(&mut w, &[BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4), BlockHash(5), BlockHash(6)]);
    assert_eq!(depths(&index, &[1, 2, 3, 4, 5], &all), vec![]);
    assert_eq!(index.stats().placements, 0);
}

// Hundreds of holes opened, some of their orphans removed, more opened, then every hole filled:
// each store finds the orphans waiting for its place however many came and went before (the
// positional index keeps a filter of the waiting places, rebuilt as they go stale).
for_each_backend!(many_holes_filled_after_many_came_and_went);
fn many_holes_filled_after_many_came_and_went<I: KvIndex>(index: I) {
    let mut w = index.writer(WorkerId::new(3, 0)).unwrap();
    let all = MatchOptions::default();
    let three = |i: u64| [1_000 + i, 5_000 + i, 9_000 + i];
    for i in 0..600 {
        index.store(&mut w, None, &chain(three(i), three(i)));
        index.remove(&mut w, &[BlockHash(1_000 + i)]);
    }
    for i in 0..500 {
        index.remove(&mut w, &[BlockHash(9_000 + i), BlockHash(5_000 + i)]);
    }
    for i in 600..800 {
        index.store(&mut w, None, &chain(three(i), three(i)));
        index.remove(&mut w, &[BlockHash(1_000 + i)]);
    }
    for i in 0..800 {
        assert_eq!(depths(&index, &three(i), &all), vec![], "hole {i} open");
        index.store(&mut w, None, &chain([1_000 + i], [1_000 + i]));
    }
    for i in 0..800 {
        let held = if i < 500 { 1 } else { 3 };
        assert_eq!(depths(&index, &three(i), &all), vec![(3, 0, held)], "hole {i} filled");
    }
}

// Orphans of one removed branch point wait at one place; removing them in any order keeps
// the positional index's hole bookkeeping exact without giving up on the worker: the other
// hole stays hidden (a worker it gives up on shows every hidden block: `hidden` drops to 0).
#[test]
fn orphans_of_one_branch_point_leave_in_any_order() {
    let index = PositionalIndex::new(PositionalConfig { jump: 8, ..Default::default() });
    let mut w = index.writer(WorkerId::new(6, 0)).unwrap();
    let all = MatchOptions::default();
    // Block 2 has four children, each with a child of its own; a second chain has a hole.
    index.store(&mut w, None, &chain([1, 2], [10, 20]));
    for k in 0..4 {
        index.store(&mut w, Some(BlockHash(2)), &chain([30 + k, 40 + k], [30 + k, 40 + k]));
    }
    index.store(&mut w, None, &chain([50, 51, 52], [50, 51, 52]));
    index.remove(&mut w, &[BlockHash(51)]);
    index.remove(&mut w, &[BlockHash(2)]);
    assert_eq!(index.stats().hidden, 9);
    // The first orphan goes (the last one takes its turn), then that one, then a middle one.
    index.remove(&mut w, &[BlockHash(30)]);
    index.remove(&mut w, &[BlockHash(33)]);
    index.remove(&mut w, &[BlockHash(31)]);
    assert_eq!(index.stats().hidden, 6);
    assert_eq!(depths(&index, &[10, 20, 32, 42], &all), vec![(6, 0, 1)]);
    // Filling the hole shows the one orphan left and its child; the children of the removed
    // orphans (40, 41, 43) and the other hole (52) stay hidden.
    index.store(&mut w, Some(BlockHash(1)), &chain([2], [20]));
    assert_eq!(depths(&index, &[10, 20, 32, 42], &all), vec![(6, 0, 4)]);
    assert_eq!(depths(&index, &[10, 20, 30, 40], &all), vec![(6, 0, 2)]);
    assert_eq!(index.stats().hidden, 4);
    assert_eq!(depths(&index, &[50, 51, 52], &all), vec![(6, 0, 1)]);
}

// Workers tied where a cut falls are kept in rotation: over as many lookups as it takes to go
// round, each tied worker is kept equally often, never the lowest ids every time; the deeper
// worker is always kept, and the grouped answer cuts the same way.
for_each_backend!(a_cut_among_tied_workers_rotates);
fn a_cut_among_tied_workers_rotates<I: KvIndex>(index: I) {
    let mut deep = index.writer(WorkerId::new(100, 0)).unwrap();
    index.store(&mut deep, None, &chain([1000, 1001], [1, 2]));
    for w in 0..10u64 {
        let mut wr = index.writer(WorkerId::new(w, 0)).unwrap();
        index.store(&mut wr, None, &chain([w * 10], [1]));
    }
    let cut = MatchOptions { max_matches: Some(4), ..Default::default() };
    let mut kept = std::collections::BTreeMap::new();
    let mut grouped = kvindex_core::DepthGroups::default();
    // Ten tied workers, three kept per lookup: thirty lookups go round three times.
    for i in 0..30 {
        let answer = if i % 2 == 0 {
            index.find_matches(&q(&[1, 2]), &cut)
        } else {
            index.find_grouped(&q(&[1, 2]), &cut, &mut grouped);
            grouped.to_matches()
        };
        assert_eq!(answer.len(), 4);
        assert_eq!((answer[0].worker.worker_id, answer[0].blocks), (100, 2), "the deepest is never cut");
        for m in &answer[1..] {
            assert_eq!(m.blocks, 1);
            *kept.entry(m.worker.worker_id).or_insert(0) += 1;
        }
    }
    assert_eq!(kept.len(), 10, "every tied worker is kept in turn: {kept:?}");
    assert!(kept.values().all(|&n| n == 9), "each as often as the others: {kept:?}");
}

/// A worker stores at most `max_blocks_per_worker` blocks: a store past it is cut short, the
/// rest counted as over the limit, and what was stored stays matched.
#[test]
fn a_worker_holds_at_most_its_block_bound() {
    fn check<I: KvIndex>(index: I) {
        let mut w = index.writer(WorkerId::new(1, 0)).unwrap();
        let out = index.store(&mut w, None, &chain(100..106, 1..7));
        assert_eq!((out.stored, out.over_limit), (4, 2), "{}", index.name());
        let out = index.store(&mut w, Some(BlockHash(103)), &chain([200], [5]));
        assert_eq!((out.stored, out.over_limit), (0, 1), "{}", index.name());
        index.remove(&mut w, &[BlockHash(103)]);
        let out = index.store(&mut w, Some(BlockHash(102)), &chain([103, 104], [4, 5]));
        assert_eq!((out.stored, out.over_limit), (1, 1), "{}: room for one again", index.name());
        assert_eq!(depths(&index, &[1, 2, 3, 4, 5], &MatchOptions::default()), vec![(1, 0, 4)]);
        // At the bound, blocks held already take no room: the chain restated is not over it,
        // and only the new block past it is.
        let out = index.store(&mut w, None, &chain(100..104, 1..5));
        assert_eq!((out.duplicates, out.over_limit), (4, 0), "{}: a restated chain", index.name());
        let out = index.store(&mut w, None, &chain(100..105, 1..6));
        assert_eq!((out.duplicates, out.stored, out.over_limit), (4, 0, 1), "{}", index.name());
    }
    check(RunIndex::new(RunConfig { max_blocks_per_worker: 4, ..RunConfig::default() }));
    check(PositionalIndex::new(PositionalConfig { max_blocks_per_worker: 4, ..Default::default() }));
}
