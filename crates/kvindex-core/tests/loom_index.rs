//! The run index model-checked on its real code: `RunIndex`'s own writes and lookups, with its
//! atomics, locks and epoch collector swapped for loom's (`RUSTFLAGS="--cfg loom --cfg
//! crossbeam_loom"`; `scripts/test` runs it). loom runs each scenario under every interleaving
//! of a writer thread and a lookup thread (within a bound on preemptions, `LOOM_MAX_PREEMPTIONS`,
//! 4 by default), and the lookup must answer the watched worker at its depth in one state it
//! went through while the lookup ran, and name no worker that never held a block.
//!
//! Each scenario is a way a lookup reading runs one after another could mix states: a cutoff
//! read past the hashes it covers, a block stored under a hole, a slot freed and handed to
//! another worker, a coverage list turning dense under the lookup.
#![cfg(loom)]

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::runs::RunWriter;
use kvindex_core::index::{KvIndex, MatchOptions};
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

/// The worker each scenario watches; workers below it hold blocks all along, those above it
/// never hold any and must never be named.
const WATCHED: u64 = 7;

/// Sets up an index and writers, then runs `write` (which bumps the step after each event) in
/// a thread beside one lookup of `query`, and checks the watched worker's answer against
/// `states[step]` for the steps the lookup spanned, the event in flight after it included.
fn check(
    setup: impl Fn() -> (RunIndex, Vec<RunWriter>) + Send + Sync + 'static,
    write: impl Fn(&RunIndex, Vec<RunWriter>, &AtomicUsize) + Send + Sync + 'static,
    query: &[u64],
    states: &'static [u32],
) {
    let (setup, write) = (std::sync::Arc::new(setup), std::sync::Arc::new(write));
    let query: Vec<LocalHash> = query.iter().map(|&x| LocalHash(x)).collect();
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(4));
    model.check(move || {
        let (index, writers) = setup();
        let index = Arc::new(index);
        let step = Arc::new(AtomicUsize::new(0));
        let t = {
            let (index, step, write) = (index.clone(), step.clone(), write.clone());
            loom::thread::spawn(move || write(&index, writers, &step))
        };
        let before = step.load(Ordering::SeqCst);
        let answer = index.find_matches(&query, &MatchOptions::default());
        let after = (step.load(Ordering::SeqCst) + 1).min(states.len() - 1);
        for m in &answer {
            assert!(m.worker.worker_id <= WATCHED, "{m:?} names a worker that never held a block");
        }
        let got = answer.iter().find(|m| m.worker == worker(WATCHED)).map_or(0, |m| m.blocks);
        assert!(
            states[before..=after].contains(&got),
            "the watched worker answered at {got}; between steps {before} and {after} it was at {:?}",
            &states[before..=after]
        );
        t.join().expect("writer");
    });
}

/// A store that joins a run and appends to it: a lookup that read the run's hashes before the
/// append and the cutoff after it would answer the run's old length, a depth the worker never
/// had.
#[test]
fn a_cutoff_is_never_read_past_the_hashes_it_covers() {
    check(
        || {
            let index = index(4, 32);
            let mut x = index.writer(worker(1)).expect("room");
            index.store(&mut x, None, &blocks(1, &[l(0)]));
            let w = index.writer(worker(WATCHED)).expect("room");
            (index, vec![x, w])
        },
        |index, mut ws, step| {
            index.store(&mut ws[1], None, &blocks(WATCHED, &[l(0), l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        },
        &[l(0), l(1)],
        &[0, 2],
    );
}

/// A hole and a store under the block it hides: the watched worker holds `0..4`, its last
/// block in a run of its own; it removes block 1 (depth 1), then stores block 4 under block 3
/// (still depth 1: the hole hides it), then fills the hole (depth 5). A lookup reading the
/// first run before the hole and the second after the store would answer 5 while the worker
/// was at 1.
#[test]
fn a_store_under_a_hole_stays_hidden_until_the_hole_is_filled() {
    check(
        || {
            let index = index(4, 32);
            let mut x = index.writer(worker(1)).expect("room");
            index.store(&mut x, None, &blocks(1, &[l(0), l(1), l(2), 999]));
            let mut w = index.writer(worker(WATCHED)).expect("room");
            index.store(&mut w, None, &blocks(WATCHED, &[l(0), l(1), l(2), l(3)]));
            (index, vec![x, w])
        },
        |index, mut ws, step| {
            let w = &mut ws[1];
            index.remove(w, &hashes(WATCHED, &[l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.store(w, Some(hashes(WATCHED, &[l(3)])[0]), &blocks(WATCHED, &[l(4)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.store(w, Some(hashes(WATCHED, &[l(0)])[0]), &blocks(WATCHED, &[l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        },
        &[l(0), l(1), l(2), l(3), l(4)],
        &[4, 1, 1, 5],
    );
}

/// A worker removed while a lookup reads it, its slot taken by a worker that holds nothing
/// (the registry has room for two: the newcomer must wait for the freed slot). The lookup
/// names the removed worker at one of its depths or not at all, never the newcomer.
#[test]
fn a_freed_slot_is_never_read_as_its_next_owner() {
    check(
        || {
            let index = index(2, 32);
            let mut x = index.writer(worker(1)).expect("room");
            index.store(&mut x, None, &blocks(1, &[l(0)]));
            let mut a = index.writer(worker(WATCHED)).expect("room");
            index.store(&mut a, None, &blocks(WATCHED, &[l(0), l(1)]));
            (index, vec![x, a])
        },
        |index, mut ws, step| {
            let a = ws.pop().expect("the watched worker");
            index.remove_worker(a);
            step.fetch_add(1, Ordering::SeqCst);
            let b = index.writer(worker(WATCHED + 1)).expect("its slot comes back");
            step.fetch_add(1, Ordering::SeqCst);
            drop((b, ws));
        },
        &[l(0), l(1)],
        &[2, 0, 0],
    );
}

/// A worker joining a run makes its coverage dense, then leaves part of it: the lookup reads
/// the list, the dense copy or both, and sees one of the worker's states.
#[test]
fn a_coverage_turning_dense_shows_one_state() {
    check(
        || {
            let index = index(4, 2);
            let mut x = index.writer(worker(1)).expect("room");
            index.store(&mut x, None, &blocks(1, &[l(0), l(1), l(2)]));
            let w = index.writer(worker(WATCHED)).expect("room");
            (index, vec![x, w])
        },
        |index, mut ws, step| {
            let w = &mut ws[1];
            index.store(w, None, &blocks(WATCHED, &[l(0), l(1), l(2)]));
            step.fetch_add(1, Ordering::SeqCst);
            index.remove(w, &hashes(WATCHED, &[l(2), l(1)]));
            step.fetch_add(1, Ordering::SeqCst);
        },
        &[l(0), l(1), l(2)],
        &[0, 3, 1],
    );
}
