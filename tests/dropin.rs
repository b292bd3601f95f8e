//! The drop-in harness on kvindex alone: vLLM's own publishers (two engines), the bridge,
//! `kvindex serve`, `POST /query`; every answer, after tail eviction, eviction with holes and
//! an engine restart, must be what the engines hold. `scripts/dropin` runs the same phases
//! beside Dynamo's standalone indexer.

use kvindex_tools::dropin::{run, DropinSettings};
use std::path::PathBuf;
use std::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_query_answer_is_what_the_engines_hold_through_holes_and_a_restart() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new(root.join("scripts/fetch-engines")).output().expect("scripts/fetch-engines runs");
    assert!(out.status.success(), "fetching the engines failed: {}", String::from_utf8_lossy(&out.stderr));
    let trace = kvindex_tools::trace::read_trace_file(&root.join("data/traces/conversation_trace.jsonl")).expect("the trace");
    let s = DropinSettings {
        engines: 2,
        requests: 300,
        // Small caches: every phase evicts.
        capacity: 512,
        factor: 2,
        block_size: 16,
        hole_rate: 0.3,
        queries: 60,
        settle_s: 60,
        trace,
        engines_dir: PathBuf::from(String::from_utf8(out.stdout).expect("a path").trim()),
        engine_script: root.join("tests/engines/engine.py"),
        dynamo: None,
    };
    let reports = run(&s).await.expect("the harness runs");
    let phases: Vec<&str> = reports.iter().map(|r| r.phase).collect();
    assert_eq!(phases, ["tail eviction", "eviction with holes", "an engine restarts"]);
    for r in &reports {
        assert!(r.held_blocks > 0, "{}: the engines held nothing of the queries", r.phase);
        assert_eq!((r.kvindex_wrong, r.kvindex_stale), (0, 0), "{}: {:?}", r.phase, r.kvindex_example);
    }
}
