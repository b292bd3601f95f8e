//! The mock engine against the figures BENCHMARKS.md gives for the reference stream, and
//! every backend against the reference model on a replay of the real trace.

use kvindex_tools as tools;

use kvindex_core::hash::WorkerId;
use kvindex_core::index::positional::{PositionalConfig, PositionalIndex};
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{KvIndex, MatchOptions, WorkerMatch};
use kvindex_core::Event;
use std::collections::HashMap;
use tools::stream::Op;
use tools::stream::{read_stream, write_stream, StreamOp};
use tools::trace::{read_trace_file, MockConfig, MockEngine, TraceRequest};
use tools::workload::Workload;

fn trace() -> Vec<TraceRequest> {
    read_trace_file(concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl").as_ref()).expect("shipped trace")
}

#[test]
fn mock_engine_gives_the_reference_counts() {
    let trace = trace();
    let mut engine = MockEngine::new(MockConfig::default());
    let mut ops = Vec::new();
    for r in &trace {
        engine.request(r, &mut ops);
    }
    let wl = Workload::from_timed(ops.clone());
    assert_eq!(wl.ops.len(), 35_467);
    assert_eq!(wl.lookup_blocks, 4_616_000);
    assert_eq!(wl.stored_blocks, 4_354_496);
    assert_eq!(wl.removed_blocks, 4_092_352);
    assert_eq!(engine.cached_blocks(), 262_144);
    // Event ids are consecutive per worker.
    let mut next: HashMap<u64, u64> = HashMap::new();
    for o in &ops {
        if let StreamOp::Stored { worker, event_id, .. } | StreamOp::Removed { worker, event_id, .. } = &o.op {
            let n = next.entry(*worker).or_default();
            assert_eq!(event_id, n);
            *n += 1;
        }
    }
    // The same configuration gives the same stream, and it survives the JSONL format.
    let again = MockEngine::run(MockConfig::default(), &trace[..500]);
    assert_eq!(&again[..], &ops[..again.len()]);
    let plain: Vec<StreamOp> = again.iter().map(|o| o.op.clone()).collect();
    let mut buf = Vec::new();
    write_stream(&mut buf, &plain).unwrap();
    assert_eq!(read_stream(&buf[..]).unwrap(), plain);
}

fn replay<I: KvIndex>(index: &I, wl: &Workload) -> Vec<Vec<WorkerMatch>> {
    let mut writers: HashMap<WorkerId, I::Writer> = HashMap::new();
    let mut answers = Vec::new();
    for op in &wl.ops {
        match op {
            Op::Lookup(q) => answers.push(index.find_matches(q, &MatchOptions::default())),
            Op::Event(w, ev) => {
                let wr = writers.entry(*w).or_insert_with(|| index.writer(*w).unwrap());
                match ev {
                    Event::Stored { parent, blocks, .. } => {
                        // Re-storing a block a hole left cached is a duplicate, not a new placement.
                        let out = index.store(wr, *parent, blocks);
                        assert_eq!(out.stored + out.duplicates, blocks.len() as u64)
                    }
                    Event::Removed { hashes, .. } => assert_eq!(index.remove(wr, hashes).removed, hashes.len() as u64),
                    Event::Cleared => {
                        index.clear(wr);
                    }
                    Event::GroupStored { .. } | Event::GroupRemoved { .. } => panic!("the traces have no hybrid groups"),
                }
            }
        }
    }
    answers
}

#[test]
fn backends_answer_every_trace_lookup_like_the_reference() {
    let trace = trace();
    let cfg = MockConfig { workers: 6, capacity: 600, factor: 2, seed: 9, hole_rate: 0.0 };
    let wl = Workload::from_timed(MockEngine::run(cfg, &trace[..2500]));
    let want = replay(&ReferenceIndex::new(1 << 16, 64), &wl);
    assert!(want.iter().filter(|a| a.len() > 1).count() > 100, "the replay exercises multi-worker answers");
    for jump in [1, 4, 32] {
        let got = replay(&PositionalIndex::new(PositionalConfig { jump, ..Default::default() }), &wl);
        assert!(got == want, "positional (jump {jump}) differs from the reference");
    }
    assert!(replay(&RunIndex::default(), &wl) == want, "runs differs from the reference");
}

#[test]
fn backends_stay_exact_when_evictions_leave_holes() {
    let trace = trace();
    for hole_rate in [0.1, 0.5] {
        let cfg = MockConfig { workers: 6, capacity: 600, factor: 2, seed: 9, hole_rate };
        let timed = MockEngine::run(cfg, &trace[..2000]);
        // Holes are there: some eviction removes a block whose child the worker still holds.
        let mut held: Vec<HashMap<u64, Option<u64>>> = vec![HashMap::new(); 6];
        let mut orphaned = 0;
        for op in &timed {
            match &op.op {
                StreamOp::Stored { worker, parent, blocks, .. } => {
                    let mut p = *parent;
                    for &(_, b) in blocks {
                        held[*worker as usize].insert(b, p);
                        p = Some(b);
                    }
                }
                StreamOp::Removed { worker, seq, .. } => {
                    let h = &mut held[*worker as usize];
                    for b in seq {
                        h.remove(b);
                    }
                    orphaned += h.values().flatten().filter(|p| !h.contains_key(p)).count();
                }
                _ => {}
            }
        }
        assert!(orphaned > 0, "hole rate {hole_rate} left no orphan");
        let wl = Workload::from_timed(timed);
        let want = replay(&ReferenceIndex::new(1 << 16, 64), &wl);
        assert!(
            replay(&PositionalIndex::default(), &wl) == want,
            "positional differs from the reference at hole rate {hole_rate}"
        );
        assert!(replay(&RunIndex::default(), &wl) == want, "runs differs from the reference at hole rate {hole_rate}");
    }
}

#[test]
fn bench_rounds_give_each_backend_its_ratio_to_the_first() {
    use kvindex_core::index::Backend;
    use tools::bench::{run, BenchConfig, Mode};
    use tools::indexers::Indexer;
    let cfg = MockConfig { workers: 4, capacity: 400, factor: 2, seed: 3, hole_rate: 0.0 };
    let wl = Workload::from_timed(MockEngine::run(cfg, &trace()[..300]));
    let backends = [Backend::Runs, Backend::Positional, Backend::Reference];
    let cfg = BenchConfig {
        backends: backends.iter().map(|&b| Indexer::Kvindex(b)).collect(),
        modes: vec![Mode::Sequential, Mode::Events],
        apply_threads: 1,
        lookup_threads: 1,
        jump: 64,
        max_matches: None,
        progress: false,
        repeat: 3,
        check: false,
    };
    let rows = run(&[("", &wl)], &cfg);
    let got: Vec<(&str, &str)> = rows.iter().map(|r| (r.backend.as_str(), r.mode.as_str())).collect();
    let want: Vec<(&str, &str)> =
        ["runs", "positional", "reference"].iter().flat_map(|&b| [(b, "sequential"), (b, "events")]).collect();
    assert_eq!(got, want, "one row per backend and mode, in the order asked");
    for r in &rows {
        assert!(r.block_ops_per_s > 0.0 && r.block_ops > 0, "{} {} measured nothing", r.backend, r.mode);
        match (r.backend.as_str(), r.vs_first) {
            ("runs", None) => {}
            ("runs", Some(x)) => panic!("the first backend has no ratio to itself: {x:?}"),
            (_, None) => panic!("{} {} has no ratio to the first backend", r.backend, r.mode),
            (_, Some(x)) => assert!(0.0 < x.min && x.min <= x.median && x.median <= x.max, "{} {}: {x:?}", r.backend, r.mode),
        }
    }
    let one = run(&[("", &wl)], &BenchConfig { repeat: 1, ..cfg });
    assert!(one.iter().filter(|r| r.backend != "runs").all(|r| r.vs_first.is_some_and(|x| x.min == x.max)));
}

#[test]
fn bench_compares_streams_in_one_run() {
    use kvindex_core::index::Backend;
    use tools::bench::{run, table, BenchConfig, Mode};
    use tools::indexers::Indexer;
    let mock = |hole_rate| MockConfig { workers: 4, capacity: 400, factor: 2, seed: 3, hole_rate };
    let plain = Workload::from_timed(MockEngine::run(mock(0.0), &trace()[..300]));
    let holes = Workload::from_timed(MockEngine::run(mock(0.5), &trace()[..300]));
    let cfg = BenchConfig {
        backends: [Backend::Runs, Backend::Positional].iter().map(|&b| Indexer::Kvindex(b)).collect(),
        modes: vec![Mode::Events],
        apply_threads: 1,
        lookup_threads: 1,
        jump: 64,
        max_matches: None,
        progress: false,
        repeat: 2,
        check: false,
    };
    let rows = run(&[("p0.jsonl", &plain), ("p05.jsonl", &holes)], &cfg);
    let got: Vec<(Option<&str>, &str)> = rows.iter().map(|r| (r.stream.as_deref(), r.backend.as_str())).collect();
    let want = [("p0.jsonl", "runs"), ("p0.jsonl", "positional"), ("p05.jsonl", "runs"), ("p05.jsonl", "positional")];
    assert_eq!(got, want.map(|(s, b)| (Some(s), b)), "one row per stream and backend, streams in the order given");
    let blocks = |wl: &Workload| wl.stored_blocks + wl.removed_blocks;
    assert_ne!(blocks(&plain), blocks(&holes), "the streams must differ for this test to tell them apart");
    assert_eq!(rows[2].block_ops, blocks(&holes), "each stream is replayed, not the first twice");
    assert_eq!(rows[0].block_ops, blocks(&plain));
    assert!(rows[0].vs_first.is_none(), "the first backend on the first stream is the reference");
    assert!(rows[1..].iter().all(|r| r.vs_first.is_some()), "every other row has its ratio to the first");
    let text = table(&rows);
    assert!(text.starts_with("stream ") && text.lines().nth(3).is_some_and(|l| l.starts_with("p05.jsonl ")), "{text}");
    let lone = run(&[("", &plain)], &BenchConfig { backends: cfg.backends[..1].to_vec(), ..cfg });
    assert!(lone[0].stream.is_none() && !table(&lone).starts_with("stream"), "a lone stream is not named");
}

#[test]
fn a_ratio_is_the_median_and_range_of_its_rounds() {
    use tools::bench::Ratio;
    assert_eq!(Ratio::of(&[3.0, 1.0, 2.0]), Some(Ratio { median: 2.0, min: 1.0, max: 3.0 }));
    assert_eq!(Ratio::of(&[4.0, 1.0]), Some(Ratio { median: 1.0, min: 1.0, max: 4.0 }));
    assert_eq!(Ratio::of(&[f64::NAN, 2.0, f64::INFINITY]), Some(Ratio { median: 2.0, min: 2.0, max: 2.0 }));
    assert_eq!(Ratio::of(&[]), None);
}

#[test]
fn keep_up_reports_every_run_and_where_each_index_stops() {
    use kvindex_core::index::Backend;
    use tools::indexers::Indexer;
    use tools::keepup::{plot, sweep, thresholds, KeepUpConfig, KeepUpPoint};
    let cfg = MockConfig { workers: 4, capacity: 400, factor: 2, seed: 3, hole_rate: 0.0 };
    let wl = Workload::from_timed(MockEngine::run(cfg, &trace()[..200]));
    let kc = KeepUpConfig {
        backends: vec![Indexer::Kvindex(Backend::Runs), Indexer::Kvindex(Backend::Positional)],
        speedups: vec![1e5, 2e5],
        apply_threads: 2,
        lookup_threads: 1,
        jump: 64,
        max_matches: Some(64),
        progress: false,
    };
    let points = sweep(&wl, &kc).expect("a trace has arrival times");
    let got: Vec<(&str, f64)> = points.iter().map(|p| (p.backend.as_str(), p.speedup)).collect();
    assert_eq!(got, [("runs", 1e5), ("runs", 2e5), ("positional", 1e5), ("positional", 2e5)]);
    for p in &points {
        let offered = (wl.block_ops()) as f64 / p.window_s;
        assert!((p.offered_block_ops_per_s - offered).abs() < 1e-6 * offered, "{p:?}");
        assert!(p.achieved_block_ops_per_s > 0.0 && p.elapsed_s > 0.0, "{p:?}");
        assert_eq!(p.kept_up, p.elapsed_s <= 1.10 * p.window_s);
    }
    assert!((points[1].offered_block_ops_per_s / points[0].offered_block_ops_per_s - 2.0).abs() < 1e-9);
    // Thresholds: the highest offered rate kept up, the lowest not.
    let at = |backend: &str, offered: f64, kept_up: bool| KeepUpPoint {
        backend: backend.into(),
        offered_block_ops_per_s: offered,
        achieved_block_ops_per_s: offered,
        kept_up,
        ..Default::default()
    };
    let synthetic = [at("a", 1.0, true), at("a", 2.0, true), at("a", 4.0, false), at("a", 8.0, false), at("b", 1.0, false)];
    assert_eq!(thresholds(&synthetic), [("a".to_string(), Some(2.0), Some(4.0)), ("b".to_string(), None, Some(1.0))]);
    let path = std::env::temp_dir().join(format!("kvindex-keep-up-{}.svg", std::process::id()));
    plot(&points, &path).expect("plot");
    let svg = std::fs::read_to_string(&path).expect("plot written");
    let _ = std::fs::remove_file(&path);
    assert!(svg.contains("<svg") && svg.contains("runs") && svg.contains("positional"));
    // A stream file has no arrival times: refused, with the reason.
    let mut timeless = Workload::from_timed(MockEngine::run(cfg, &trace()[..10]));
    timeless.ts_ms = None;
    assert!(sweep(&timeless, &kc).is_err_and(|e| e.to_string().contains("arrival times")));
}
