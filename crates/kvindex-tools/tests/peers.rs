//! The peers' indexes behind the bench's adapters (`--features peers`: smg's three and NVIDIA
//! Dynamo's two), checked against the reference model on a replay of the real trace: the adapters
//! convert faithfully, and each peer is as exact as it claims (or as its design allows). In a file of their own, so that their replays never run
//! beside the memory measurements of the other tests that include the tooling.
#![cfg(feature = "peers")]

use kvindex_tools as tools;

use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::ReferenceIndex;
use kvindex_core::RunIndex;
use rustc_hash::FxHashMap;
use tools::peers::{DynamoCrtc, DynamoPositional, SmgChain, SmgPositional, SmgRadix};
use tools::stream::Op;
use tools::trace::{read_trace_file, MockConfig, MockEngine};

/// The shipped trace's first requests through small caches (evictions from the start), with
/// `hole_rate` of them leaving holes: `(lookups, answers unlike the reference's)`.
fn disagreements<I: KvIndex>(index: I, hole_rate: f64) -> (usize, usize) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/conversation_trace.jsonl");
    let mut trace = read_trace_file(path.as_ref()).expect("shipped trace");
    trace.truncate(3000);
    let cfg = MockConfig { workers: 16, capacity: 2048, hole_rate, ..Default::default() };
    let truth = ReferenceIndex::new(1 << 20, 64);
    let (mut writers, mut truths) = (FxHashMap::default(), FxHashMap::default());
    let (mut lookups, mut differ) = (0, 0);
    for op in MockEngine::run(cfg, &trace).into_iter().map(|o| Op::from(o.op)) {
        match op {
            Op::Event(worker, ev) => {
                let w = writers.entry(worker).or_insert_with(|| index.writer(worker).expect("room"));
                ev.apply_to(&index, w);
                let t = truths.entry(worker).or_insert_with(|| truth.writer(worker).expect("room"));
                ev.apply_to(&truth, t);
            }
            Op::Lookup(q) => {
                let opts = MatchOptions::default();
                lookups += 1;
                differ += usize::from(index.find_matches(&q, &opts) != truth.find_matches(&q, &opts));
            }
        }
    }
    (lookups, differ)
}

#[test]
fn both_peers_answer_exactly_on_prefix_closed_caches() {
    let (lookups, differ) = disagreements(SmgPositional::new(64), 0.0);
    assert!(lookups > 2000);
    assert_eq!(differ, 0);
    assert_eq!(disagreements(SmgChain::new(64), 0.0), (lookups, 0));
}

#[test]
fn smg_chain_stays_exact_with_holes() {
    let (lookups, differ) = disagreements(SmgChain::new(64), 0.5);
    assert!(lookups > 2000);
    assert_eq!(differ, 0);
}

#[test]
fn smg_positional_overcounts_with_holes() {
    let (lookups, differ) = disagreements(SmgPositional::new(64), 0.5);
    eprintln!("smg-positional with holes: {differ} of {lookups} answers differ from the reference");
    assert!(differ > 0);
}

#[test]
fn dynamo_peers_answer_exactly_on_prefix_closed_caches() {
    let (lookups, differ) = disagreements(DynamoCrtc::new(1, 64), 0.0);
    assert!(lookups > 2000);
    assert_eq!(differ, 0);
    assert_eq!(disagreements(DynamoPositional::new(64, 64), 0.0), (lookups, 0));
}

#[test]
fn dynamo_positional_overcounts_with_holes_and_the_run_index_does_not() {
    let (lookups, differ) = disagreements(DynamoPositional::new(64, 64), 0.5);
    eprintln!("dynamo-positional with holes: {differ} of {lookups} answers differ from the reference");
    assert!(differ > 0);
    assert_eq!(disagreements(RunIndex::default(), 0.5), (lookups, 0));
}

#[test]
fn smg_radix_answers_exactly_with_and_without_holes() {
    let (lookups, differ) = disagreements(SmgRadix::new(64), 0.0);
    assert!(lookups > 2000);
    assert_eq!(differ, 0);
    assert_eq!(disagreements(SmgRadix::new(64), 0.5), (lookups, 0));
}
