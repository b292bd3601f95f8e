//! Lookups racing writes: every answer must lie between the states of each worker before and
//! after the writes in flight while it was computed, whatever the interleaving.
//!
//! Writer threads own disjoint workers and move each along a fixed schedule of depths: a worker
//! at depth `d` holds the first `d` blocks of its chain, and each event takes it to the next
//! depth at once (one `stored` chain, or one `removed` tail). Chains share a prefix across all
//! workers (so its runs turn dense), a middle within groups, and a tail of their own, so runs
//! are shared, split by divergence, emptied, killed and rebuilt while lookups read them. A
//! reader notes every worker's progress before and after its lookup; each worker's depth in the
//! answer must be its depth for that query in one of the states it went through meanwhile.
//! Nothing here depends on timing: the schedules are fixed, the readers stop when the writers
//! are done, and the check holds for any interleaving of a correct index.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::{PositionalIndex, RunIndex};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const WORKERS: usize = 48;
const WRITERS: usize = 2;
const SHARED: usize = 20;
const GROUP: usize = 30;
const TAIL: usize = 46;
const LEN: usize = SHARED + GROUP + TAIL;
/// Events per worker.
const STEPS: usize = 1500;

/// Worker `w`'s chain of local hashes: the shared prefix, its group's middle, its own tail.
fn chain(w: usize) -> Vec<u64> {
    let shared = (0..SHARED).map(|i| 1_000 + i as u64);
    let group = (0..GROUP).map(move |i| 100_000 * (1 + (w / 4) as u64) + i as u64);
    let tail = (0..TAIL).map(move |i| 10_000_000 * (1 + w as u64) + i as u64);
    shared.chain(group).chain(tail).collect()
}

/// Worker `w`'s engine hash for the block at `i` (its own, as engines' are).
fn engine(w: usize, i: usize) -> u64 {
    (w as u64 + 1) << 32 | i as u64
}

/// Worker `w`'s depths, one per step from 0: random walks that often go back to 0 (so every
/// run it holds dies and is built again) and often to the full chain.
fn schedule(w: usize) -> Vec<usize> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (w as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut d = vec![0];
    for _ in 0..STEPS {
        let cur = *d.last().unwrap_or(&0);
        let r = next();
        let to = match r % 8 {
            0 => 0,
            1 => LEN,
            _ if cur == 0 || r % 2 == 0 => (cur + 1 + (r >> 8) as usize % 30).min(LEN),
            _ => cur - 1 - (r >> 8) as usize % cur.min(30),
        };
        d.push(to);
    }
    d
}

/// How deep worker `v` at depth `d` matches worker `w`'s chain.
fn depth_for(v: usize, d: usize, w: usize) -> usize {
    let common = if v == w {
        LEN
    } else if v / 4 == w / 4 {
        SHARED + GROUP
    } else {
        SHARED
    };
    d.min(common)
}

fn race<I: KvIndex>(index: I) {
    let chains: Vec<Vec<u64>> = (0..WORKERS).map(chain).collect();
    let schedules: Vec<Vec<usize>> = (0..WORKERS).map(schedule).collect();
    let done: Vec<AtomicUsize> = (0..WORKERS).map(|_| AtomicUsize::new(0)).collect();
    let writing = AtomicUsize::new(WRITERS);
    let checked = AtomicBool::new(false);
    let mut writers: Vec<Vec<(usize, I::Writer)>> = (0..WRITERS).map(|_| Vec::new()).collect();
    for w in 0..WORKERS {
        writers[w % WRITERS].push((w, index.writer(WorkerId::new(w as u64, 0)).expect("room")));
    }
    std::thread::scope(|s| {
        for mine in writers {
            let (index, chains, schedules, done, writing) = (&index, &chains, &schedules, &done, &writing);
            s.spawn(move || {
                let mut mine = mine;
                for step in 1..=STEPS {
                    for (w, writer) in mine.iter_mut() {
                        let (from, to) = (schedules[*w][step - 1], schedules[*w][step]);
                        let c = &chains[*w];
                        if to > from {
                            let parent = (from > 0).then(|| BlockHash(engine(*w, from - 1)));
                            let blocks: Vec<StoredBlock> = (from..to).map(|i| StoredBlock::new(engine(*w, i), c[i])).collect();
                            let out = index.store(writer, parent, &blocks);
                            assert_eq!(out.stored, (to - from) as u64, "worker {w} step {step}: {out:?}");
                        } else if to < from {
                            let gone: Vec<BlockHash> = (to..from).rev().map(|i| BlockHash(engine(*w, i))).collect();
                            let out = index.remove(writer, &gone);
                            assert_eq!(out.removed, (from - to) as u64, "worker {w} step {step}: {out:?}");
                        }
                        done[*w].store(step, Ordering::SeqCst);
                    }
                }
                writing.fetch_sub(1, Ordering::SeqCst);
            });
        }
        for r in 0..2 {
            let (index, chains, schedules, done, writing, checked) = (&index, &chains, &schedules, &done, &writing, &checked);
            s.spawn(move || {
                let mut i = r;
                let opts = MatchOptions::default();
                // At least one full pass of lookups, then on until the writers are done.
                while i < WORKERS * 4 || writing.load(Ordering::SeqCst) > 0 {
                    let w = i % WORKERS;
                    i += 1;
                    let q: Vec<LocalHash> = chains[w].iter().map(|&l| LocalHash(l)).collect();
                    let before: Vec<usize> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
                    let answer = index.find_matches(&q, &opts);
                    let after: Vec<usize> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
                    for v in 0..WORKERS {
                        let got = answer.iter().find(|m| m.worker.worker_id == v as u64).map_or(0, |m| m.blocks as usize);
                        // The states from before the lookup to the end of the write in flight after it.
                        let states = &schedules[v][before[v]..=(after[v] + 1).min(STEPS)];
                        let lo = states.iter().map(|&d| depth_for(v, d, w)).min().unwrap_or(0);
                        let hi = states.iter().map(|&d| depth_for(v, d, w)).max().unwrap_or(0);
                        assert!(
                            lo <= got && got <= hi,
                            "worker {v} matched {got} blocks of worker {w}'s chain; between steps {} and {} it matched {lo} to {hi}",
                            before[v],
                            after[v]
                        );
                    }
                }
                checked.store(true, Ordering::SeqCst);
            });
        }
    });
    assert!(checked.load(Ordering::SeqCst));
    // Quiet again: every worker at its last depth, exactly.
    for (w, c) in chains.iter().enumerate() {
        let q: Vec<LocalHash> = c.iter().map(|&l| LocalHash(l)).collect();
        let answer = index.find_matches(&q, &MatchOptions::default());
        for (v, sched) in schedules.iter().enumerate() {
            let got = answer.iter().find(|m| m.worker.worker_id == v as u64).map_or(0, |m| m.blocks as usize);
            assert_eq!(got, depth_for(v, sched[STEPS], w), "at rest: worker {v} on worker {w}'s chain");
        }
    }
}

#[test]
fn run_index_answers_lie_between_the_states_of_each_worker() {
    race(RunIndex::default());
}

#[test]
fn positional_index_answers_lie_between_the_states_of_each_worker() {
    race(PositionalIndex::default());
}
