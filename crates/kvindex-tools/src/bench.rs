//! `kvindex bench`: replays a trace (through the mock engine) or a stream file against the
//! chosen backends, side by side, and reports block ops/s, lookup latency and memory.

use crate::alloc;
use crate::answering::Answering;
use crate::indexers::{with_backend, FnOnceIndex, Indexer};
use crate::report::{histogram, progress, si, us};
use crate::stream::Op;
use crate::trace::{MockConfig, MockEngine, TraceRequest};
use crate::workload::Workload;
use hdrhistogram::Histogram;
use kvindex::apply::ApplyPool;
use kvindex_core::hash::{LocalHash, WorkerId};
use kvindex_core::index::positional::PositionalConfig;
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::{KvIndex, MatchOptions, WorkerMatch};
use kvindex_core::model::Model;
use kvindex_core::Event;
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Every op in order on one thread (block ops = lookup + stored + removed blocks).
    Sequential,
    /// Only the events, on one thread.
    Events,
    /// Only the lookups are timed; events are applied untimed in between.
    Lookups,
    /// Events through the apply pool while lookup threads query at the same time.
    Concurrent,
    /// Every lookup of the trace against the final state, one at a time.
    EndState,
}

/// Bench settings.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub backends: Vec<Indexer>,
    pub modes: Vec<Mode>,
    pub apply_threads: usize,
    pub lookup_threads: usize,
    pub jump: usize,
    /// Matches each lookup returns at most (`None`: all).
    pub max_matches: Option<usize>,
    pub progress: bool,
    /// Rounds, each running every backend once (the order reversed every other round, so that
    /// neither side always runs in the machine's same phase); each row reports its best run.
    pub repeat: usize,
    /// Compare every end-state answer with the reference model's and count those that differ.
    pub check: bool,
}

/// One row of results.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BenchResult {
    /// The stream replayed, named when a run compares several (`--stream` more than once).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    pub backend: String,
    pub mode: String,
    pub threads: String,
    pub seconds: f64,
    pub block_ops: u64,
    pub block_ops_per_s: f64,
    pub lookups: u64,
    pub lookups_per_s: f64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookup_p999_us: f64,
    /// Placements at the end (sequential mode).
    pub placements: u64,
    /// Heap bytes of the index at the end, per placement (sequential mode, counting allocator).
    pub bytes_per_placement: Option<f64>,
    /// Peak heap bytes of the index during the replay (sequential mode).
    pub peak_index_bytes: Option<u64>,
    /// End-state answers unlike the reference model's (with `check`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wrong: Option<u64>,
    /// Its block ops/s as a multiple of the first backend's (on the first stream) in the same
    /// round and mode: the median over rounds, then the lowest and highest. `None` for the
    /// first backend on the first stream.
    pub vs_first: Option<Ratio>,
}

/// A ratio measured once per round: its median and range.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq)]
pub struct Ratio {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Ratio {
    /// The median and range of `v` (`None` if empty); an even count takes the lower middle.
    pub fn of(v: &[f64]) -> Option<Ratio> {
        let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_unstable_by(f64::total_cmp);
        Some(Ratio { median: v[(v.len().checked_sub(1)?) / 2], min: *v.first()?, max: *v.last()? })
    }
}

/// One timed lookup: the `max_matches` deepest, sorted (the cut answer), or every match in the
/// index's own form.
fn ask<I: Answering>(index: &I, q: &[LocalHash], opts: &MatchOptions) -> usize {
    match opts.max_matches {
        Some(_) => index.find_matches(q, opts).len(),
        None => index.every_match(q),
    }
}

/// Whether `got` is a right answer where `want` is the reference model's complete one: the
/// same, or (with a cut) the same depths with each worker at its own depth (which of the
/// workers tied at the cut are kept is a rotation's choice).
fn agrees(got: &[WorkerMatch], want: &[WorkerMatch], cut: Option<usize>) -> bool {
    match cut.filter(|&k| k < want.len()) {
        None => got == want,
        Some(k) => {
            got.len() == k && got.iter().zip(want).all(|(g, w)| g.blocks == w.blocks) && got.iter().all(|g| want.contains(g))
        }
    }
}

/// Applies one event through a writer map owned by the caller.
fn apply_event<I: KvIndex>(index: &I, writers: &mut FxHashMap<WorkerId, I::Writer>, worker: WorkerId, ev: &Event) {
    let w = match writers.entry(worker) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => match index.writer(worker) {
            Ok(w) => v.insert(w),
            Err(_) => return,
        },
    };
    ev.apply_to(index, w);
}

struct RunAll<'a> {
    wl: &'a Workload,
    cfg: &'a BenchConfig,
    /// The reference model's end-state answers, with `check`.
    truth: Option<&'a [Vec<WorkerMatch>]>,
}

impl FnOnceIndex<Vec<BenchResult>> for RunAll<'_> {
    fn call<I: Answering>(self, make: impl Fn(usize) -> I) -> Vec<BenchResult> {
        let cfg = self.cfg;
        let name = make(1).name().to_string();
        let row =
            |mode: &str, threads: String| BenchResult { backend: name.clone(), mode: mode.into(), threads, ..Default::default() };
        let mut rows = Vec::new();
        if cfg.modes.contains(&Mode::Sequential) || cfg.modes.contains(&Mode::EndState) {
            let (index, _writers, sequential) = self.sequential(make(1), row("sequential", "1".into()));
            if cfg.modes.contains(&Mode::Sequential) {
                rows.push(sequential.clone());
            }
            if cfg.modes.contains(&Mode::EndState) {
                rows.push(
                    self.end_state(&index, BenchResult { placements: sequential.placements, ..row("end-state", "1".into()) }),
                );
            }
        }
        if cfg.modes.contains(&Mode::Events) {
            rows.push(self.events(make(1), row("events", "1".into())));
        }
        if cfg.modes.contains(&Mode::Lookups) {
            rows.push(self.lookups(make(1), row("lookups", "1".into())));
        }
        if cfg.modes.contains(&Mode::Concurrent) {
            let threads = format!("{}a+{}l", cfg.apply_threads, cfg.lookup_threads);
            rows.push(concurrent(make(cfg.apply_threads), self.wl, cfg, row("concurrent", threads)));
        }
        rows
    }
}

impl RunAll<'_> {
    /// The cut the lookups ask for (none: every match).
    fn opts(&self) -> MatchOptions {
        MatchOptions { max_matches: self.cfg.max_matches, ..Default::default() }
    }

    /// Every op in order on one thread, memory counted; the index and its writers as the replay
    /// left them.
    fn sequential<I: Answering>(&self, index: I, row: BenchResult) -> (I, FxHashMap<WorkerId, I::Writer>, BenchResult) {
        let (wl, opts) = (self.wl, self.opts());
        let base = alloc::live_bytes();
        alloc::reset_peak();
        let mut writers = FxHashMap::default();
        let mut lat = histogram();
        let pb = progress(self.cfg.progress, wl.ops.len() as u64, format!("{} sequential", row.backend));
        let start = Instant::now();
        for (i, op) in wl.ops.iter().enumerate() {
            match op {
                Op::Lookup(q) => {
                    let t = Instant::now();
                    std::hint::black_box(ask(&index, q, &opts));
                    let _ = lat.record(t.elapsed().as_nanos() as u64);
                }
                Op::Event(w, ev) => apply_event(&index, &mut writers, *w, ev),
            }
            if i % 1024 == 0 {
                pb.set_position(i as u64);
            }
        }
        // Writes' deferred work (a peer's queued events, the run index's retired memory) is
        // part of the replay.
        index.settle();
        let secs = start.elapsed().as_secs_f64();
        pb.finish_and_clear();
        let placements = index.stats().placements;
        let counting = alloc::is_counting();
        let held = (alloc::live_bytes() - base).max(0) as usize;
        let peak = (alloc::peak_bytes() - base).max(0) as usize;
        let row = BenchResult {
            seconds: secs,
            block_ops: wl.block_ops(),
            block_ops_per_s: wl.block_ops() as f64 / secs,
            lookups: wl.lookups,
            lookups_per_s: wl.lookups as f64 / secs,
            lookup_p50_us: us(&lat, 0.5),
            lookup_p99_us: us(&lat, 0.99),
            lookup_p999_us: us(&lat, 0.999),
            placements,
            bytes_per_placement: (counting && placements > 0).then(|| held as f64 / placements as f64),
            peak_index_bytes: counting.then_some(peak as u64),
            ..row
        };
        (index, writers, row)
    }

    /// Every lookup of the workload against the end state, one at a time (after a warm-up
    /// pass), answers checked against the reference model's with `check`.
    fn end_state<I: Answering>(&self, index: &I, row: BenchResult) -> BenchResult {
        let (cfg, opts) = (self.cfg, self.opts());
        let queries = self.wl.lookup_queries();
        for q in &queries {
            std::hint::black_box(ask(index, q, &opts));
        }
        let mut lat = histogram();
        let mut blocks = 0u64;
        let start = Instant::now();
        for q in &queries {
            let t = Instant::now();
            std::hint::black_box(ask(index, q, &opts));
            let _ = lat.record(t.elapsed().as_nanos() as u64);
            blocks += q.len() as u64;
        }
        let secs = start.elapsed().as_secs_f64();
        let all = MatchOptions::default();
        let wrong = self.truth.map(|truth| {
            let right = |q: &[LocalHash], want: &[WorkerMatch]| {
                agrees(&index.find_matches(q, &opts), want, cfg.max_matches) && index.find_matches(q, &all) == want
            };
            queries.iter().zip(truth).filter(|(q, want)| !right(q, want)).count() as u64
        });
        BenchResult {
            seconds: secs,
            block_ops: blocks,
            block_ops_per_s: blocks as f64 / secs,
            lookups: queries.len() as u64,
            lookups_per_s: queries.len() as f64 / secs,
            lookup_p50_us: us(&lat, 0.5),
            lookup_p99_us: us(&lat, 0.99),
            lookup_p999_us: us(&lat, 0.999),
            wrong,
            ..row
        }
    }

    /// Only the events, on one thread.
    fn events<I: Answering>(&self, index: I, row: BenchResult) -> BenchResult {
        let wl = self.wl;
        let mut writers = FxHashMap::default();
        let pb = progress(self.cfg.progress, wl.ops.len() as u64, format!("{} events", row.backend));
        let start = Instant::now();
        for (i, op) in wl.ops.iter().enumerate() {
            if let Op::Event(w, ev) = op {
                apply_event(&index, &mut writers, *w, ev);
            }
            if i % 1024 == 0 {
                pb.set_position(i as u64);
            }
        }
        index.settle();
        let secs = start.elapsed().as_secs_f64();
        pb.finish_and_clear();
        let blocks = wl.stored_blocks + wl.removed_blocks;
        BenchResult { seconds: secs, block_ops: blocks, block_ops_per_s: blocks as f64 / secs, ..row }
    }

    /// Only the lookups timed, the events applied untimed in between.
    fn lookups<I: Answering>(&self, index: I, row: BenchResult) -> BenchResult {
        let (wl, opts) = (self.wl, self.opts());
        let mut writers = FxHashMap::default();
        let mut lat = histogram();
        let mut busy = Duration::ZERO;
        let pb = progress(self.cfg.progress, wl.ops.len() as u64, format!("{} lookups", row.backend));
        for (i, op) in wl.ops.iter().enumerate() {
            match op {
                Op::Lookup(q) => {
                    let t = Instant::now();
                    std::hint::black_box(ask(&index, q, &opts));
                    let d = t.elapsed();
                    busy += d;
                    let _ = lat.record(d.as_nanos() as u64);
                }
                Op::Event(w, ev) => apply_event(&index, &mut writers, *w, ev),
            }
            if i % 1024 == 0 {
                pb.set_position(i as u64);
            }
        }
        pb.finish_and_clear();
        let secs = busy.as_secs_f64();
        BenchResult {
            seconds: secs,
            block_ops: wl.lookup_blocks,
            block_ops_per_s: wl.lookup_blocks as f64 / secs,
            lookups: wl.lookups,
            lookups_per_s: wl.lookups as f64 / secs,
            lookup_p50_us: us(&lat, 0.5),
            lookup_p99_us: us(&lat, 0.99),
            lookup_p999_us: us(&lat, 0.999),
            ..row
        }
    }
}

/// Events through the apply pool, lookups from other threads at the same time.
fn concurrent<I: Answering>(index: I, wl: &Workload, cfg: &BenchConfig, mut row: BenchResult) -> BenchResult {
    let model = Arc::new(Model::new(index));
    let pool = ApplyPool::new(model.clone(), cfg.apply_threads, 1024, None, None);
    let index = model.device();
    let queries = wl.lookup_queries();
    let done = AtomicBool::new(false);
    let looked = AtomicU64::new(0);
    let looked_blocks = AtomicU64::new(0);
    let pb = progress(cfg.progress, wl.ops.len() as u64, format!("{} concurrent", row.backend));
    let (secs, hists) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..cfg.lookup_threads)
            .map(|t| {
                let (queries, done, looked, looked_blocks) = (&queries, &done, &looked, &looked_blocks);
                s.spawn(move || {
                    let mut lat = histogram();
                    let opts = MatchOptions { max_matches: cfg.max_matches, ..Default::default() };
                    let mut i = t * 7919;
                    while !done.load(Ordering::Relaxed) && !queries.is_empty() {
                        let q = queries[i % queries.len()];
                        let t0 = Instant::now();
                        std::hint::black_box(ask(index, q, &opts));
                        let _ = lat.record(t0.elapsed().as_nanos() as u64);
                        looked.fetch_add(1, Ordering::Relaxed);
                        looked_blocks.fetch_add(q.len() as u64, Ordering::Relaxed);
                        i += 1;
                    }
                    lat
                })
            })
            .collect();
        let start = Instant::now();
        for (i, op) in wl.ops.iter().enumerate() {
            if let Op::Event(w, ev) = op {
                pool.apply(*w, vec![ev.clone()], 0);
            }
            if i % 1024 == 0 {
                pb.set_position(i as u64);
            }
        }
        pool.flush();
        index.settle();
        let secs = start.elapsed().as_secs_f64();
        done.store(true, Ordering::Relaxed);
        let hists: Vec<Histogram<u64>> = readers.into_iter().filter_map(|r| r.join().ok()).collect();
        (secs, hists)
    });
    pb.finish_and_clear();
    let mut lat = histogram();
    for h in &hists {
        let _ = lat.add(h);
    }
    let blocks = wl.stored_blocks + wl.removed_blocks;
    let n = looked.load(Ordering::Relaxed);
    row.seconds = secs;
    row.block_ops = blocks;
    row.block_ops_per_s = blocks as f64 / secs;
    row.lookups = n;
    row.lookups_per_s = n as f64 / secs;
    row.lookup_p50_us = us(&lat, 0.5);
    row.lookup_p99_us = us(&lat, 0.99);
    row.lookup_p999_us = us(&lat, 0.999);
    row.placements = index.stats().placements;
    let _ = looked_blocks.load(Ordering::Relaxed);
    row
}

/// Runs every configured mode on every configured backend and every stream (named; a lone
/// stream's name is not shown), `repeat` rounds, the order reversed every other round, so that
/// a ratio between two streams (a hole rate against none, say) is taken within one round of
/// one process, not across runs whose machine may have drifted. Rows come stream by stream, in
/// the order of the backends, each with its ratio to the first (see `BenchResult::vs_first`).
pub fn run(streams: &[(&str, &Workload)], cfg: &BenchConfig) -> Vec<BenchResult> {
    let cases: Vec<(usize, Indexer)> = (0..streams.len()).flat_map(|s| cfg.backends.iter().map(move |&b| (s, b))).collect();
    let truths: Vec<Option<Vec<Vec<WorkerMatch>>>> = streams
        .iter()
        .map(|(_, wl)| (cfg.check && cfg.modes.contains(&Mode::EndState)).then(|| reference_answers(wl, cfg)))
        .collect();
    let n = cases.len();
    let mut best: Vec<Vec<BenchResult>> = vec![Vec::new(); n];
    // Block ops/s by round, case and mode.
    let mut seen: Vec<Vec<FxHashMap<String, f64>>> = Vec::new();
    for round in 0..cfg.repeat.max(1) {
        let mut this = vec![FxHashMap::default(); n];
        let order: Vec<usize> = if round % 2 == 0 { (0..n).collect() } else { (0..n).rev().collect() };
        for i in order {
            let (s, backend) = cases[i];
            let (name, wl) = streams[s];
            let truth = truths[s].as_deref();
            for mut r in with_backend(backend, cfg.jump, RunAll { wl, cfg, truth }) {
                r.stream = (streams.len() > 1).then(|| name.to_string());
                this[i].insert(r.mode.clone(), r.block_ops_per_s);
                match best[i].iter_mut().find(|x| x.mode == r.mode) {
                    Some(b) if b.block_ops_per_s >= r.block_ops_per_s => {}
                    Some(b) => *b = r,
                    None => best[i].push(r),
                }
            }
        }
        seen.push(this);
    }
    for (i, rows) in best.iter_mut().enumerate().skip(1) {
        for r in rows {
            let ratios: Vec<f64> =
                seen.iter().filter_map(|round| Some(round[i].get(&r.mode)? / round[0].get(&r.mode)?)).collect();
            r.vs_first = Ratio::of(&ratios);
        }
    }
    best.into_iter().flatten().collect()
}

/// The reference model's answer to every lookup of `wl` in its final state.
fn reference_answers(wl: &Workload, cfg: &BenchConfig) -> Vec<Vec<WorkerMatch>> {
    let limits = PositionalConfig::default();
    let index = ReferenceIndex::new(limits.max_depth, limits.max_workers);
    let mut writers = FxHashMap::default();
    for op in &wl.ops {
        if let Op::Event(w, ev) = op {
            apply_event(&index, &mut writers, *w, ev);
        }
    }
    let frozen = index.freeze();
    let _ = cfg;
    wl.lookup_queries().iter().map(|q| frozen.find_matches(q, &MatchOptions::default())).collect()
}

/// The results as an aligned text table; with two or more backends, a last column gives each
/// backend's same-round ratio to the first (median, then range).
pub fn table(rows: &[BenchResult]) -> String {
    let ratios = rows.iter().any(|r| r.vs_first.is_some());
    let width = rows.iter().filter_map(|r| r.stream.as_ref()).map(|n| n.len()).max();
    let bw = rows.iter().map(|r| r.backend.len()).max().unwrap_or(0).max(14);
    let mut s = width.map_or(String::new(), |w| format!("{:<w$} ", "stream"));
    let check = rows.iter().any(|r| r.wrong.is_some());
    s += &format!(
        "{:<bw$} {:<11} {:>7} {:>9} {:>12} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "backend", "mode", "threads", "seconds", "block ops/s", "lookups/s", "p50 us", "p99 us", "p999 us", "B/place", "peak MiB"
    );
    if check {
        s += &format!(" {:>6}", "wrong");
    }
    if ratios {
        s += "  x first (range)";
    }
    s += "\n";
    for r in rows {
        if let Some(w) = width {
            s += &format!("{:<w$} ", r.stream.as_deref().unwrap_or(""));
        }
        let bpp = r.bytes_per_placement.map_or("-".into(), |b| format!("{b:.1}"));
        let peak = r.peak_index_bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / (1 << 20) as f64));
        let lat = |v: f64| if r.lookups == 0 { "-".to_string() } else { format!("{v:.2}") };
        s += &format!(
            "{:<bw$} {:<11} {:>7} {:>9.3} {:>12} {:>10} {:>9} {:>9} {:>9} {:>10} {:>10}",
            r.backend,
            r.mode,
            r.threads,
            r.seconds,
            si(r.block_ops_per_s),
            if r.lookups == 0 { "-".into() } else { si(r.lookups_per_s) },
            lat(r.lookup_p50_us),
            lat(r.lookup_p99_us),
            lat(r.lookup_p999_us),
            bpp,
            peak
        );
        if check {
            s += &format!(" {:>6}", r.wrong.map_or("-".into(), |w| w.to_string()));
        }
        match r.vs_first {
            Some(x) => s += &format!("  {:.2}x ({:.2}-{:.2})", x.median, x.min, x.max),
            None if ratios => s += "  -",
            None => {}
        }
        s += "\n";
    }
    s
}

/// One reading of a churn run: the index's heap after a phase.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChurnPoint {
    pub backend: String,
    /// `empty`, `pass N` (the trace replayed N times through the same engines), `cleared`
    /// (every worker sent `cleared`) or `removed` (every worker expired).
    pub phase: String,
    /// Blocks stored and removed so far.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub placements: u64,
    pub index_bytes: i64,
}

struct Churn<'a> {
    trace: &'a [TraceRequest],
    mock: MockConfig,
    passes: usize,
    progress: bool,
}

impl FnOnceIndex<Vec<ChurnPoint>> for Churn<'_> {
    fn call<I: KvIndex>(self, make: impl Fn(usize) -> I) -> Vec<ChurnPoint> {
        let mut engine = MockEngine::new(self.mock);
        let base = alloc::live_bytes();
        let index = make(1);
        let mut writers = FxHashMap::default();
        let name = index.name().to_string();
        // Only the bytes allocated while applying count: the engine and the ops are outside.
        let mut held = alloc::live_bytes() - base;
        let (mut stored, mut removed) = (0, 0);
        let mut points = Vec::new();
        let mut point = |phase: String, index: &I, held: isize, stored: u64, removed: u64| {
            let placements = index.stats().placements;
            points.push(ChurnPoint {
                backend: name.clone(),
                phase,
                stored_blocks: stored,
                removed_blocks: removed,
                placements,
                index_bytes: held as i64,
            });
        };
        point("empty".into(), &index, held, 0, 0);
        let pb = progress(self.progress, self.passes as u64 * self.trace.len() as u64, format!("{} churn", index.name()));
        for pass in 1..=self.passes {
            let mut out = Vec::new();
            for r in self.trace {
                engine.request(r, &mut out);
            }
            let wl = Workload::from_timed(out);
            stored += wl.stored_blocks;
            removed += wl.removed_blocks;
            let before = alloc::live_bytes();
            for op in &wl.ops {
                if let Op::Event(w, ev) = op {
                    apply_event(&index, &mut writers, *w, ev);
                }
            }
            index.settle();
            held += alloc::live_bytes() - before;
            drop(wl);
            pb.set_position(pass as u64 * self.trace.len() as u64);
            point(format!("pass {pass}"), &index, held, stored, removed);
        }
        pb.finish_and_clear();
        let before = alloc::live_bytes();
        for w in writers.values_mut() {
            index.clear(w);
        }
        index.settle();
        held += alloc::live_bytes() - before;
        point("cleared".into(), &index, held, stored, removed);
        let before = alloc::live_bytes();
        for (_, w) in writers.drain() {
            index.remove_worker(w);
        }
        index.settle();
        held += alloc::live_bytes() - before;
        point("removed".into(), &index, held, stored, removed);
        points
    }
}

/// Replays `trace` `passes` times through the same mock engines (constant store/remove
/// churn once their caches are full), then clears and removes every worker, reading the
/// index's heap after each phase. Needs the counting allocator (`alloc::enable`).
pub fn churn(
    trace: &[TraceRequest],
    mock: MockConfig,
    backends: &[Indexer],
    jump: usize,
    passes: usize,
    progress: bool,
) -> Vec<ChurnPoint> {
    backends.iter().flat_map(|&b| with_backend(b, jump, Churn { trace, mock, passes, progress })).collect()
}

/// The churn readings as an aligned text table.
pub fn churn_table(points: &[ChurnPoint]) -> String {
    let mut s = format!(
        "{:<11} {:<8} {:>14} {:>14} {:>11} {:>11} {:>9}\n",
        "backend", "phase", "stored blocks", "removed blocks", "placements", "index MiB", "B/place"
    );
    for p in points {
        let per = if p.placements > 0 { format!("{:.1}", p.index_bytes as f64 / p.placements as f64) } else { "-".into() };
        s += &format!(
            "{:<11} {:<8} {:>14} {:>14} {:>11} {:>11.2} {:>9}\n",
            p.backend,
            p.phase,
            p.stored_blocks,
            p.removed_blocks,
            p.placements,
            p.index_bytes as f64 / (1 << 20) as f64,
            per
        );
    }
    s
}
