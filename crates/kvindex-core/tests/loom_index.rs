//! The run index model-checked on its real code: `RunIndex`'s own writes and lookups, with its
//! atomics, locks and epoch collector swapped for loom's (`RUSTFLAGS="--cfg loom --cfg
//! crossbeam_loom"`; `scripts/test` runs it). loom runs each scenario under every interleaving
//! of its writer threads and a lookup thread (within a bound on preemptions,
//! `LOOM_MAX_PREEMPTIONS`, by default 4 with one writer thread and 1 with two), and the lookup must answer each written worker at
//! its depth in one state it went through while the lookup ran, every worker that held the
//! chain throughout at its depth (unless a filter or a cut leaves it out for deeper ones), each
//! worker once, and no worker that never held a block.
//!
//! Each scenario is a way a lookup reading runs one after another could mix states: a cutoff
//! read past the hashes it covers, a block stored under a hole, a slot freed and handed to
//! another worker, a coverage list turning dense under the lookup, two writers sharing a run;
//! and each way a lookup reads: every match, a cut, a filter, the grouped answer.
#![cfg(loom)]

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::runs::RunWriter;
use kvindex_core::index::{DepthGroups, KvIndex, MatchOptions};
use kvindex_core::{RunConfig, RunIndex};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;

/// Local hash of block `i` of the chain the lookups ask for.
fn l(i: u64) -> u64 {
    100 + i
}

/// Worker `w`'s blocks of these local hashes (its engine hashes are its own).
fn blocks(w: u64, locals: &[u64]) -> Vec<StoredBlock> {
    locals.iter().map(|&x| StoredBlock::new(w << 32 | x, x)).collect()
}

fn hashes(w: u64, locals: &[u64]) -> Vec<BlockHash> {
    locals.iter().map(|&x| BlockHash(w << 32 | x)).collect()
}

fn worker(w: u64) -> WorkerId {
    WorkerId::new(w, 0)
}

/// A small index whose coverage lists turn dense at `dense_at` holders.
fn index(max_workers: u32, dense_at: u32) -> RunIndex {
    RunIndex::new(RunConfig { max_depth: 64, max_workers, dense_at, ..RunConfig::default() })
}

/// The worker most scenarios write; workers below it may hold blocks, those above it never
/// hold any and must never be named.
const WATCHED: u64 = 7;

/// How the lookup asks: the index's answer as (worker id, depth).
#[derive(Clone, Copy)]
enum Read {
    /// Every match (`find_matches`, default options).
    All,
    /// At most this many matches, the deepest.
    Cut(usize),
    /// Only these workers.
    Only(&'static [u64]),
    /// The complete answer grouped by depth (`find_grouped`).
    Grouped,
}

impl Read {
    fn answer(self, index: &RunIndex, query: &[LocalHash]) -> Vec<(u64, u32)> {
        let opts = match self {
            Read::Cut(n) => MatchOptions { max_matches: Some(n), ..MatchOptions::default() },
            Read::Only(ws) => MatchOptions { workers: Some(ws.to_vec()), ..MatchOptions::default() },
            Read::All | Read::Grouped => MatchOptions::default(),
        };
        if let Read::Grouped = self {
            let mut groups = DepthGroups::default();
            index.find_grouped(query, &opts, &mut groups);
            return groups.iter().flat_map(|(d, ws)| ws.iter().map(move |w| (w.worker_id, d))).collect();
        }
        index.find_matches(query, &opts).iter().map(|m| (m.worker.worker_id, m.blocks)).collect()
    }

    /// Whether the answer may leave out a worker that was at one of `depths`: a filter
    /// without it, or a cut that is full of workers at least as deep.
    fn may_omit(self, w: u64, depths: &[u32], answer: &[(u64, u32)]) -> bool {
        match self {
            Read::Only(ws) => !ws.contains(&w),
            Read::Cut(n) => {
                let shallowest = depths.iter().copied().min().unwrap_or(0);
                answer.len() == n && answer.iter().all(|&(_, d)| d >= shallowest)
            }
            Read::All | Read::Grouped => false,
        }
    }
}

/// A writer thread: it writes worker `worker` through `write`, bumping its step after each
/// event, and `states[step]` is the worker's depth at each step.
struct Writes {
    worker: u64,
    states: &'static [u32],
    write: Box<dyn Fn(&RunIndex, Vec<RunWriter>, &AtomicUsize) + Send + Sync>,
}

/// Sets up an index and each writer thread's writers, then runs the writer threads beside
/// one lookup of `query` read as `read`, and checks the answer: each written worker at one of
/// its states in the steps the lookup spanned (the event in flight after it included), each
/// of `steady` (worker, depth) at its depth, nobody twice, nobody above [`WATCHED`] at all.
fn check(
    setup: impl Fn() -> (RunIndex, Vec<Vec<RunWriter>>) + Send + Sync + 'static,
    writes: Vec<Writes>,
    steady: &'static [(u64, u32)],
    read: Read,
    query: &[u64],
) {
    let (setup, writes) = (std::sync::Arc::new(setup), std::sync::Arc::new(writes));
    let query: Vec<LocalHash> = query.iter().map(|&x| LocalHash(x)).collect();
    let mut model = loom::model::Builder::new();
    // Three threads under four preemptions take hours: one, for them.
    let bound = if writes.len() > 1 { 1 } else { 4 };
    model.preemption_bound = Some(std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(bound));
    model.check(move || {
        let (index, writers) = setup();
        let index = Arc::new(index);
        let steps: Vec<Arc<AtomicUsize>> = writes.iter().map(|_| Arc::new(AtomicUsize::new(0))).collect();
        let threads: Vec<_> = writers
            .into_iter()
            .enumerate()
            .map(|(i, ws)| {
                let (index, step, writes) = (index.clone(), steps[i].clone(), writes.clone());
                loom::thread::spawn(move || (writes[i].write)(&index, ws, &step))
            })
            .collect();
        let before: Vec<usize> = steps.iter().map(|s| s.load(Ordering::SeqCst)).collect();
        let answer = read.answer(&index, &query);
        let after: Vec<usize> = steps.iter().map(|s| s.load(Ordering::SeqCst) + 1).collect();
        let depth = |w: u64| answer.iter().find(|&&(x, _)| x == w).map(|&(_, d)| d);
        for (i, &(w, _)) in answer.iter().enumerate() {
            assert!(w <= WATCHED, "{answer:?} names worker {w}, which never held a block");
            assert!(!answer[..i].iter().any(|&(x, _)| x == w), "{answer:?} names worker {w} twice");
        }
        match read {
            Read::Cut(n) => assert!(answer.len() <= n, "{answer:?} is longer than the cut at {n}"),
            Read::Only(ws) => {
                assert!(answer.iter().all(|(w, _)| ws.contains(w)), "{answer:?} names a worker the filter leaves out")
            }
            Read::All | Read::Grouped => {}
        }
        for (i, wr) in writes.iter().enumerate() {
            let seen = &wr.states[before[i]..=after[i].min(wr.states.len() - 1)];
            let got = depth(wr.worker);
            let ok = match got {
                Some(d) => seen.contains(&d),
                None => seen.contains(&0) || read.may_omit(wr.worker, seen, &answer),
            };
            assert!(ok, "worker {} answered at {got:?} in {answer:?}; while the lookup ran it was at {seen:?}", wr.worker);
        }
        for &(w, d) in steady {
            let ok = depth(w) == Some(d) || (depth(w).is_none() && read.may_omit(w, &[d], &answer));
            assert!(ok, "worker {w} held {d} blocks throughout, answered {answer:?}");
        }
        for t in threads {
            t.join().expect("writer");
        }
    });
}

/// Worker 1 holding block 0, and the watched worker's writer, empty.
fn one_and_watched() -> (RunIndex, Vec<Vec<RunWriter>>) {
    let index = index(4, 32);
    let mut x = index.writer(worker(1)).expect("room");
    index.store(&mut x, None, &blocks(1, &[l(0)]));
    let w = index.writer(worker(WATCHED)).expect("room");
    (index, vec![vec![x, w]])
}

/// The watched worker stores blocks 0 and 1 (step 1), then drops block 1 (step 2).
fn store_two_then_drop_one() -> Writes {
    Writes {
        worker: WATCHED,
        states: &[0, 2, 1],
        write: Box::new(|index, mut ws, step| {
            index.store(&mut ws[1], None, &blocks(WATCHED, &[l(0), l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.remove(&mut ws[1], &hashes(WATCHED, &[l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        }),
    }
}

/// A store that joins a run and appends to it: a lookup that read the run's hashes before the
/// append and the cutoff after it would answer the run's old length, a depth the worker never
/// had.
#[test]
fn a_cutoff_is_never_read_past_the_hashes_it_covers() {
    let write = Writes {
        worker: WATCHED,
        states: &[0, 2],
        write: Box::new(|index, mut ws, step| {
            index.store(&mut ws[1], None, &blocks(WATCHED, &[l(0), l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        }),
    };
    check(one_and_watched, vec![write], &[(1, 1)], Read::All, &[l(0), l(1)]);
}

/// Worker 1 holding `0..3` and another block, and the watched worker holding `0..4`, its last
/// block in a run of its own.
fn beside_a_hole() -> (RunIndex, Vec<Vec<RunWriter>>) {
    let index = index(4, 32);
    let mut x = index.writer(worker(1)).expect("room");
    index.store(&mut x, None, &blocks(1, &[l(0), l(1), l(2), 999]));
    let mut w = index.writer(worker(WATCHED)).expect("room");
    index.store(&mut w, None, &blocks(WATCHED, &[l(0), l(1), l(2), l(3)]));
    (index, vec![vec![x, w]])
}

/// The watched worker removes block 1 (depth 1), then stores block 4 under block 3 (still
/// depth 1: the hole hides it), then fills the hole (depth 5).
fn make_and_fill_a_hole() -> Writes {
    Writes {
        worker: WATCHED,
        states: &[4, 1, 1, 5],
        write: Box::new(|index, mut ws, step| {
            let w = &mut ws[1];
            index.remove(w, &hashes(WATCHED, &[l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.store(w, Some(hashes(WATCHED, &[l(3)])[0]), &blocks(WATCHED, &[l(4)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.store(w, Some(hashes(WATCHED, &[l(0)])[0]), &blocks(WATCHED, &[l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        }),
    }
}

/// A hole and a store under the block it hides: a lookup reading the first run before the
/// hole and the second after the store would answer 5 while the worker was at 1.
#[test]
fn a_store_under_a_hole_stays_hidden_until_the_hole_is_filled() {
    check(beside_a_hole, vec![make_and_fill_a_hole()], &[(1, 3)], Read::All, &[l(0), l(1), l(2), l(3), l(4)]);
}

/// The same hole read as the grouped answer, which walks the runs its own way.
#[test]
fn a_grouped_answer_shows_one_state_across_a_hole() {
    check(beside_a_hole, vec![make_and_fill_a_hole()], &[(1, 3)], Read::Grouped, &[l(0), l(1), l(2), l(3), l(4)]);
}

/// A worker removed while a lookup reads it, its slot taken by a worker that holds nothing
/// (the registry has room for two: the newcomer must wait for the freed slot). The lookup
/// names the removed worker at one of its depths or not at all, never the newcomer.
#[test]
fn a_freed_slot_is_never_read_as_its_next_owner() {
    let setup = || {
        let index = index(2, 32);
        let mut x = index.writer(worker(1)).expect("room");
        index.store(&mut x, None, &blocks(1, &[l(0)]));
        let mut a = index.writer(worker(WATCHED)).expect("room");
        index.store(&mut a, None, &blocks(WATCHED, &[l(0), l(1)]));
        (index, vec![vec![x, a]])
    };
    let write = Writes {
        worker: WATCHED,
        states: &[2, 0, 0],
        write: Box::new(|index, mut ws, step| {
            let a = ws.pop().expect("the watched worker");
            index.remove_worker(a);
            step.fetch_add(1, Ordering::SeqCst);
            let b = index.writer(worker(WATCHED + 1)).expect("its slot comes back");
            step.fetch_add(1, Ordering::SeqCst);
            drop((b, ws));
        }),
    };
    check(setup, vec![write], &[(1, 1)], Read::All, &[l(0), l(1)]);
}

/// A worker joining a run makes its coverage dense, then leaves part of it: the lookup reads
/// the list, the dense copy or both, and sees one of the worker's states.
#[test]
fn a_coverage_turning_dense_shows_one_state() {
    let setup = || {
        let index = index(4, 2);
        let mut x = index.writer(worker(1)).expect("room");
        index.store(&mut x, None, &blocks(1, &[l(0), l(1), l(2)]));
        let w = index.writer(worker(WATCHED)).expect("room");
        (index, vec![vec![x, w]])
    };
    let write = Writes {
        worker: WATCHED,
        states: &[0, 3, 1],
        write: Box::new(|index, mut ws, step| {
            let w = &mut ws[1];
            index.store(w, None, &blocks(WATCHED, &[l(0), l(1), l(2)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.remove(w, &hashes(WATCHED, &[l(2), l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        }),
    };
    check(setup, vec![write], &[(1, 3)], Read::All, &[l(0), l(1), l(2)]);
}

/// A cut at one while the watched worker passes worker 1 and falls back level with it: the
/// one match kept is the deepest of a state the two went through, never nobody.
#[test]
fn a_cut_keeps_the_deepest_of_one_state() {
    check(one_and_watched, vec![store_two_then_drop_one()], &[(1, 1)], Read::Cut(1), &[l(0), l(1)]);
}

/// A filter on the watched worker: worker 1, who holds the chain throughout, is never named,
/// and the watched worker shows one of its states.
#[test]
fn a_filter_names_only_the_workers_it_keeps() {
    check(one_and_watched, vec![store_two_then_drop_one()], &[(1, 1)], Read::Only(&[WATCHED]), &[l(0), l(1)]);
}

/// Two writers in one run at once: worker 1 extends the chain it shares with the watched
/// worker while the watched worker stores the chain. Each shows one of its own states.
#[test]
fn two_writers_sharing_a_run_each_show_one_state() {
    let setup = || {
        let index = index(4, 32);
        let mut x = index.writer(worker(1)).expect("room");
        index.store(&mut x, None, &blocks(1, &[l(0)]));
        let w = index.writer(worker(WATCHED)).expect("room");
        (index, vec![vec![w], vec![x]])
    };
    let watched = Writes {
        worker: WATCHED,
        states: &[0, 2],
        write: Box::new(|index, mut ws, step| {
            index.store(&mut ws[0], None, &blocks(WATCHED, &[l(0), l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        }),
    };
    let second = Writes {
        worker: 1,
        states: &[1, 2],
        write: Box::new(|index, mut ws, step| {
            index.store(&mut ws[0], Some(hashes(1, &[l(0)])[0]), &blocks(1, &[l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        }),
    };
    check(setup, vec![watched, second], &[], Read::All, &[l(0), l(1)]);
}
