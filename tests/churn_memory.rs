//! Memory under churn (issue 4): replaying a trace again and again through the same engines
//! (stores and evictions in equal measure) keeps every backend's memory flat, and clearing
//! or expiring every worker gives it back. Heap bytes are read from the counting allocator,
//! which this test binary installs; allocation sizes do not depend on timing, so the figures
//! are the same on every run.

// The CLI's tooling (mock engine, replay stream, bench), included by path: it is part of the
// binary, not library API.
#[allow(dead_code)]
#[path = "../src/tools/mod.rs"]
mod tools;

use kvindex_core::index::Backend;
use tools::alloc::CountingAlloc;
use tools::bench::churn;
use tools::trace::{read_trace_file, MockConfig};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn churn_keeps_memory_flat_and_emptying_gives_it_back() {
    tools::alloc::enable();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl");
    let mut trace = read_trace_file(std::path::Path::new(path)).unwrap();
    trace.truncate(4000);
    let mock = MockConfig { workers: 8, capacity: 8192, factor: 4, seed: 7, hole_rate: 0.0 };
    let points = churn(&trace, mock, &[Backend::Positional, Backend::Radix], 64, 5, false);
    for backend in ["positional", "radix"] {
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
