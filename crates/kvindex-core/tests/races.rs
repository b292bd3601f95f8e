//! The two races that once let a run index lookup answer what no worker held, replayed as
//! they were found: lookups hammering the index while one thread writes, every answer checked
//! against the only states the writes pass through. A correct index never fails these, however
//! the threads interleave; they run for `KVINDEX_RACE_SECS` seconds each (default 2: a few
//! million lookups; 600 reproduces the ten-minute runs), which only decides how many
//! interleavings are tried.
//!
//! 1. **A freed slot read as its next owner**: X holds a 2,048-block chain for good; A stores
//!    the same chain and leaves, B joins (into A's freed slot) and leaves, again and again. B
//!    never holds a block, so no answer may name it, even through a filter naming B alone; and
//!    every answer names X.
//! 2. **Two runs read at different instants**: X holds `b0..b2047, x`; W holds `b0..b2048`, its
//!    last block in a child run, and cycles "remove b2; store 8 blocks under b2048 (hidden by
//!    the hole); remove them; store b2 again", so its depth for `b0..b2048` and the 8 is 2 or
//!    2,049, never more; both are in every answer.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::{RunConfig, RunIndex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CHAIN: u64 = 2048;

/// How long each race runs.
fn race_time() -> Duration {
    let secs = std::env::var("KVINDEX_RACE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(2);
    Duration::from_secs(secs)
}

/// The chain's block `i` as worker `w` stores it (engine hashes are per worker).
fn block(w: u64, i: u64) -> StoredBlock {
    StoredBlock::new(w << 40 | i, 1 + i)
}

fn chain(w: u64, range: std::ops::Range<u64>) -> Vec<StoredBlock> {
    range.map(|i| block(w, i)).collect()
}

/// Runs `write` on one thread until the race time is up while two threads run `look`, which
/// returns how many lookups it checked; the lookups checked in all.
fn race(write: impl FnOnce(&AtomicBool) + Send, look: impl Fn() + Sync) -> u64 {
    let stop = AtomicBool::new(false);
    let checked = AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| write(&stop));
        for _ in 0..2 {
            s.spawn(|| {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    look();
                    n += 1;
                }
                checked.fetch_add(n, Ordering::Relaxed);
            });
        }
        let end = Instant::now() + race_time();
        while Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Relaxed);
    });
    checked.into_inner()
}

#[test]
fn a_worker_that_takes_a_freed_slot_is_never_answered_for_its_predecessor() {
    for dense_at in [2, u32::MAX] {
        let index = RunIndex::new(RunConfig { dense_at, ..RunConfig::default() });
        let (x, a, b) = (WorkerId::new(1, 0), WorkerId::new(2, 0), WorkerId::new(3, 0));
        let mut wx = index.writer(x).expect("room");
        index.store(&mut wx, None, &chain(1, 0..CHAIN));
        let query: Vec<LocalHash> = (0..CHAIN).map(|i| LocalHash(1 + i)).collect();
        let only_b = MatchOptions { workers: Some(vec![3]), ..Default::default() };
        let lookups = race(
            |stop| {
                while !stop.load(Ordering::Relaxed) {
                    let mut wa = index.writer(a).expect("room");
                    index.store(&mut wa, None, &chain(2, 0..CHAIN));
                    index.remove_worker(wa);
                    let wb = index.writer(b).expect("room");
                    // B stays a moment, so that lookups that read A's coverage may name B.
                    std::thread::yield_now();
                    index.remove_worker(wb);
                }
            },
            || {
                let answer = index.find_matches(&query, &MatchOptions::default());
                for m in &answer {
                    assert_ne!(m.worker, b, "B never held a block, yet was answered at {}", m.blocks);
                    assert_eq!(m.blocks, CHAIN as u32, "{:?} answered at a depth it never held", m.worker);
                }
                assert!(answer.iter().any(|m| m.worker == x), "X holds the chain throughout, yet was left out: {answer:?}");
                assert_eq!(index.find_matches(&query, &only_b), vec![], "a filter naming B alone answered it");
            },
        );
        assert!(lookups > 0);
        eprintln!("dense_at {dense_at}: {lookups} lookups, none named B or a depth A never held");
    }
}

#[test]
fn a_worker_is_answered_at_a_depth_it_held_across_runs_read_at_different_instants() {
    for dense_at in [2, u32::MAX] {
        let index = RunIndex::new(RunConfig { dense_at, ..RunConfig::default() });
        let (x, w) = (WorkerId::new(1, 0), WorkerId::new(2, 0));
        // X: b0..b2047 then its own x, so that W's b2048 lives in a child run.
        let mut wx = index.writer(x).expect("room");
        index.store(&mut wx, None, &chain(1, 0..CHAIN));
        index.store(&mut wx, Some(block(1, CHAIN - 1).block_hash), &[StoredBlock::new(1 << 40 | 9_999, 99_999)]);
        let mut ww = index.writer(w).expect("room");
        index.store(&mut ww, None, &chain(2, 0..CHAIN + 1));
        let under: Vec<StoredBlock> = (0..8).map(|i| StoredBlock::new(2 << 40 | (10_000 + i), 50_000 + i)).collect();
        let query: Vec<LocalHash> = (0..=CHAIN).map(|i| LocalHash(1 + i)).chain(under.iter().map(|b| b.tokens_hash)).collect();
        let lookups = race(
            |stop| {
                let hole = block(2, 2);
                let under_hashes: Vec<BlockHash> = under.iter().map(|b| b.block_hash).collect();
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(index.remove(&mut ww, &[hole.block_hash]).removed, 1);
                    assert_eq!(index.store(&mut ww, Some(block(2, CHAIN).block_hash), &under).stored, 8);
                    assert_eq!(index.remove(&mut ww, &under_hashes).removed, 8);
                    assert_eq!(index.store(&mut ww, Some(block(2, 1).block_hash), &[hole]).stored, 1);
                }
            },
            || {
                let answer = index.find_matches(&query, &MatchOptions::default());
                let mut named: Vec<WorkerId> = answer.iter().map(|m| m.worker).collect();
                named.sort_unstable();
                assert_eq!(named, [x, w], "both hold b0 and b1 throughout, yet one was left out");
                for m in answer {
                    if m.worker == x {
                        assert_eq!(m.blocks, CHAIN as u32, "X holds b0..b2047 throughout");
                    } else {
                        assert_eq!(m.worker, w);
                        assert!(m.blocks == 2 || m.blocks == CHAIN as u32 + 1, "W answered at {}: it held 2 or 2,049", m.blocks);
                    }
                }
            },
        );
        assert!(lookups > 0);
        eprintln!("dense_at {dense_at}: {lookups} lookups, W always at 2 or 2,049");
    }
}
