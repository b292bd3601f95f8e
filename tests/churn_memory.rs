//! Memory under churn: replaying a trace again and again through the same engines
//! (stores and evictions in equal measure) keeps every backend's memory flat, and clearing
//! or expiring every worker gives it back. Heap bytes are read from the counting allocator,
//! which this test binary installs; allocation sizes do not depend on timing, so the figures
//! are the same on every run.

use kvindex_tools as tools;

use kvindex_core::hash::{BlockHash, StoredBlock, WorkerId};
use kvindex_core::index::positional::PositionalIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{Backend, KvIndex};
use std::sync::Mutex;
use tools::alloc::CountingAlloc;
use tools::bench::churn;
use tools::indexers::Indexer;
use tools::trace::{read_trace_file, MockConfig};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The allocator counts every thread's bytes: the tests here take turns.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn churn_keeps_memory_flat_and_emptying_gives_it_back() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tools::alloc::enable();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl");
    let mut trace = read_trace_file(std::path::Path::new(path)).unwrap();
    trace.truncate(4000);
    let mock = MockConfig { workers: 8, capacity: 8192, factor: 4, seed: 7, hole_rate: 0.0 };
    let points = churn(&trace, mock, &[Indexer::Kvindex(Backend::Runs), Indexer::Kvindex(Backend::Positional)], 64, 5, false);
    for backend in ["runs", "positional"] {
        let at = |phase: &str| {
            points.iter().find(|p| p.backend == backend && p.phase == phase).unwrap_or_else(|| panic!("{backend} {phase}"))
        };
        // The first pass fills the caches; from the second on, every store evicts.
        let (first, steady, last) = (at("pass 1"), at("pass 2"), at("pass 5"));
        assert_eq!(first.placements, 8 * 8192, "{backend}: the engines' caches are full");
        assert!(last.removed_blocks > 4 * first.stored_blocks, "{backend}: the passes churned");
        assert!(
            (last.index_bytes as f64) < 1.02 * steady.index_bytes as f64,
            "{backend}: memory grew under churn from {} to {} bytes",
            steady.index_bytes,
            last.index_bytes
        );
        for phase in ["cleared", "removed"] {
            let p = at(phase);
            assert_eq!(p.placements, 0);
            assert!(
                p.index_bytes < at("empty").index_bytes + first.index_bytes / 20,
                "{backend}: {} bytes held after {phase}, {} when empty, {} when full",
                p.index_bytes,
                at("empty").index_bytes,
                first.index_bytes
            );
        }
    }
}

/// Heap bytes that 64 workers keep after each stored, then removed, a 2,048-block chain,
/// once the position chunks and the thread's scratch exist (a first worker did the same).
/// Removed leaf first, as engines evict, or root first: a hole at every step.
fn kept_after_long_chains<I: KvIndex>(index: I, leaf_first: bool) -> isize {
    let chain = |w: u64| (0..2048).map(|i| StoredBlock::new(w << 32 | (i + 1), i)).collect::<Vec<_>>();
    let hashes = |blocks: &[StoredBlock]| {
        let mut hashes: Vec<BlockHash> = blocks.iter().map(|b| b.block_hash).collect();
        if leaf_first {
            hashes.reverse();
        }
        hashes
    };
    let mut writers = Vec::with_capacity(65);
    let mut run = |w: u64| {
        let blocks = chain(w);
        let mut writer = index.writer(WorkerId::new(w, 0)).expect("room for 65 workers");
        assert_eq!(index.store(&mut writer, None, &blocks).stored, 2048);
        assert_eq!(index.remove(&mut writer, &hashes(&blocks)).removed, 2048);
        writers.push(writer);
    };
    run(1);
    index.settle();
    let before = tools::alloc::live_bytes();
    (2..=65).for_each(&mut run);
    index.settle();
    let kept = tools::alloc::live_bytes() - before;
    assert_eq!(index.stats().placements, 0);
    drop(writers);
    kept
}

/// A worker's state is what it holds, not the longest chain it ever stored nor the most
/// holes it ever had: write scratch belongs to the applying thread (at a thousand workers, a
/// chain's worth each was 11 bytes per placement), and hole bookkeeping is given back.
#[test]
fn workers_keep_nothing_of_the_chains_they_stored() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    tools::alloc::enable();
    // Other tests of this binary (the tools' own) may allocate meanwhile: the least of three
    // runs is this test's alone.
    let least = |run: &dyn Fn() -> isize| (0..3).map(|_| run()).min().unwrap_or(isize::MAX);
    for leaf_first in [true, false] {
        for (name, kept) in [
            ("positional", least(&|| kept_after_long_chains(PositionalIndex::default(), leaf_first))),
            ("runs", least(&|| kept_after_long_chains(RunIndex::default(), leaf_first))),
        ] {
            // The registry's names for 64 more workers and the small tables kept for a next
            // hole: a few hundred bytes a worker, nothing per block.
            assert!(kept < 64 * 512, "{name}, leaf first {leaf_first}: 64 emptied workers keep {kept} bytes");
        }
    }
}
