//! The apply pool: per-worker order, backpressure, flush, worker removal, and lookups running
//! while several threads write.

use kvindex_tools as tools;

use kvindex::apply::{ApplyPool, OnApplied};
use kvindex_core::hash::{LocalHash, WorkerId};
use kvindex_core::index::positional::{PositionalConfig, PositionalIndex};
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::model::Model;
use kvindex_core::Event;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tools::stream::Op;
use tools::trace::{read_trace_file, MockConfig, MockEngine};
use tools::workload::Workload;

fn workload() -> Workload {
    let trace = read_trace_file(concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl").as_ref()).unwrap();
    Workload::from_timed(MockEngine::run(
        MockConfig { workers: 24, capacity: 1500, factor: 4, seed: 3, hole_rate: 0.0 },
        &trace[..3000],
    ))
}

/// The end state, built one event at a time on one thread.
fn sequential_reference(wl: &Workload) -> ReferenceIndex {
    let index = ReferenceIndex::new(1 << 16, 1 << 10);
    let mut writers = HashMap::new();
    for op in &wl.ops {
        if let Op::Event(w, ev) = op {
            let wr = writers.entry(*w).or_insert_with(|| index.writer(*w).unwrap());
            ev.apply_to(&index, wr);
        }
    }
    index
}

/// Two feeders (each owning half the workers, so each worker's events stay in order) and
/// two readers race; after a flush every lookup must equal the sequential reference.
fn writers_and_readers_at_once<I: KvIndex>(index: I) {
    let wl = workload();
    let reference = sequential_reference(&wl);
    let model = Arc::new(Model::new(index));
    let pool = ApplyPool::new(model.clone(), 4, 8, None, None);
    let index = model.device();
    let queries: Vec<&[LocalHash]> =
        wl.ops.iter().filter_map(|o| if let Op::Lookup(q) = o { Some(&q[..]) } else { None }).collect();
    let done = AtomicBool::new(false);
    let lookups = AtomicU64::new(0);
    std::thread::scope(|s| {
        for half in 0..2u64 {
            let (pool, wl) = (&pool, &wl);
            s.spawn(move || {
                for op in &wl.ops {
                    if let Op::Event(w, ev) = op {
                        if w.worker_id % 2 == half {
                            pool.apply(*w, vec![ev.clone()], 0);
                        }
                    }
                }
            });
        }
        for r in 0..2 {
            let (queries, done, lookups) = (&queries, &done, &lookups);
            s.spawn(move || {
                let mut i = r * 101;
                while !done.load(Ordering::Relaxed) {
                    let q = queries[i % queries.len()];
                    let answer = index.find_matches(q, &MatchOptions::default());
                    assert!(answer.windows(2).all(|p| p[0].blocks >= p[1].blocks), "sorted deepest first");
                    assert!(answer.iter().all(|m| m.blocks >= 1 && m.blocks as usize <= q.len() && m.worker.worker_id < 24));
                    lookups.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
        // Let the feeders finish, then stop the readers.
        s.spawn(|| {
            while pool.totals().stored + pool.totals().removed < wl.stored_blocks + wl.removed_blocks {
                std::thread::sleep(Duration::from_millis(5));
            }
            done.store(true, Ordering::Relaxed);
        });
    });
    pool.flush();
    assert!(lookups.load(Ordering::Relaxed) > 0);
    let totals = pool.totals();
    assert_eq!((totals.stored, totals.removed), (wl.stored_blocks, wl.removed_blocks));
    assert_eq!(totals.unplaceable + totals.unknown_removes, 0);
    assert_eq!(index.stats().placements, reference.stats().placements);
    for q in &queries {
        assert_eq!(index.find_matches(q, &MatchOptions::default()), reference.find_matches(q, &MatchOptions::default()));
    }
}

#[test]
fn positional_concurrent_writes_and_reads() {
    writers_and_readers_at_once(PositionalIndex::new(PositionalConfig::default()));
}

#[test]
fn runs_concurrent_writes_and_reads() {
    writers_and_readers_at_once(RunIndex::default());
}

#[test]
fn full_queue_pushes_back_and_loses_nothing() {
    let model = Arc::new(Model::new(PositionalIndex::new(PositionalConfig::default())));
    let index = model.device();
    // The hook blocks the apply thread until released, so its queue (2 batches) fills up.
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let (entered_tx, entered_rx) = mpsc::channel::<()>();
    let (release_rx, entered_tx) = (Mutex::new(release_rx), Mutex::new(entered_tx));
    let hook: OnApplied = Arc::new(move |_, _, tag, _| {
        if tag == 1 {
            let _ = entered_tx.lock().unwrap().send(());
            let _ = release_rx.lock().unwrap().recv();
        }
    });
    let pool = ApplyPool::new(model.clone(), 1, 2, Some(hook), None);
    let w = WorkerId::new(1, 0);
    let batch = |i: u64| vec![Event::stored((i > 0).then(|| i - 1), &[(i, 100 + i)])];
    pool.apply(w, batch(0), 1);
    entered_rx.recv().unwrap();
    pool.apply(w, batch(1), 0);
    pool.apply(w, batch(2), 0);
    let back = pool.try_apply(w, batch(3), 0, Default::default()).expect_err("queue is full");
    assert_eq!(back.worker, w);
    assert_eq!(back.events, batch(3));
    release_tx.send(()).unwrap();
    pool.apply(w, back.events, 0);
    pool.flush();
    assert_eq!(pool.totals().stored, 4);
    let q: Vec<LocalHash> = (0..4).map(|i| LocalHash(100 + i)).collect();
    assert_eq!(index.find_matches(&q, &MatchOptions::default())[0].blocks, 4);
}

#[test]
fn remove_worker_applies_after_queued_events_and_frees_the_slot() {
    let model = Arc::new(Model::new(PositionalIndex::new(PositionalConfig::default())));
    let index = model.device();
    let pool = ApplyPool::new(model.clone(), 2, 16, None, None);
    let a = WorkerId::new(1, 0);
    let b = WorkerId::new(2, 3);
    for w in [a, b] {
        pool.apply(w, vec![Event::stored(None, &[(5, 50), (6, 60)])], 0);
    }
    pool.remove_worker(a);
    pool.flush();
    let answer = index.find_matches(&[LocalHash(50), LocalHash(60)], &MatchOptions::default());
    assert_eq!(answer.len(), 1);
    assert_eq!((answer[0].worker, answer[0].blocks), (b, 2));
    assert_eq!(index.stats().workers, 1);
    assert_eq!(index.stats().placements, 2);
    pool.shutdown();
}

#[test]
fn a_full_registry_refuses_and_reports_instead_of_dropping_silently() {
    let model = Arc::new(Model::new(PositionalIndex::new(PositionalConfig { max_workers: 1, ..PositionalConfig::default() })));
    let index = model.device();
    let refused = Arc::new(Mutex::new(Vec::new()));
    let seen = refused.clone();
    let hook: OnApplied = Arc::new(move |w, out, _, _| {
        if out.refused > 0 {
            seen.lock().unwrap().push((w, out.refused));
        }
    });
    let pool = ApplyPool::new(model.clone(), 1, 16, Some(hook), None);
    let two = vec![Event::stored(None, &[(5, 50)]), Event::stored(Some(5), &[(6, 60)])];
    pool.apply(WorkerId::new(1, 0), two.clone(), 0);
    pool.apply(WorkerId::new(2, 0), two, 0);
    pool.flush();
    assert_eq!(*refused.lock().unwrap(), vec![(WorkerId::new(2, 0), 2)]);
    assert_eq!(pool.totals().refused, 2);
    assert_eq!(index.stats().workers, 1);
}

#[test]
fn a_dead_apply_thread_is_reported() {
    let model = Arc::new(Model::new(PositionalIndex::new(PositionalConfig::default())));
    let hook: OnApplied = Arc::new(|_, _, tag, _| assert_ne!(tag, 666, "the hook panics, as a bug in the index would"));
    let pool = ApplyPool::new(model.clone(), 2, 16, Some(hook), None);
    assert_eq!(pool.dead_threads(), 0);
    pool.apply(WorkerId::new(1, 0), vec![Event::stored(None, &[(5, 50)])], 666);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while pool.dead_threads() == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(pool.dead_threads(), 1);
}
