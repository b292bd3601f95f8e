//! `kvindex bench --keep-up`: can an index keep up with a trace's traffic compressed in time?
//!
//! Measured the way NVIDIA Dynamo's indexer benchmark measures it: open loop. The trace's
//! events and lookups are issued at their own times, compressed by a factor, whether or not the
//! index has caught up; events go through the apply pool as the daemon runs them (each worker's
//! on one thread, bounded queues: a full queue holds the issuer back, which shows as issue lag),
//! lookups go to a pool of lookup threads. The clock stops only when every event is applied and
//! every lookup answered (the drain counts), and a run keeps up when that takes at most 1.10x
//! the offered window. A sweep over factors finds where each index stops keeping up.

use crate::answering::Answering;
use crate::indexers::{with_backend, FnOnceIndex, Indexer};
use crate::report::{histogram, progress, si, us};
use crate::stream::Op;
use crate::workload::Workload;
use hdrhistogram::Histogram;
use kvindex::apply::{ApplyPool, OnApplied, Timing};
use kvindex_core::hash::{LocalHash, WorkerId};
use kvindex_core::index::{KvIndex, MatchOptions};
use kvindex_core::model::Model;
use kvindex_core::Event;
use parking_lot::Mutex;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A run keeps up when it ends within this multiple of its offered window.
pub const KEPT_UP: f64 = 1.10;

/// Settings of a keep-up sweep.
#[derive(Clone, Debug)]
pub struct KeepUpConfig {
    pub backends: Vec<Indexer>,
    /// Timeline compression factors, one run each.
    pub speedups: Vec<f64>,
    pub apply_threads: usize,
    pub lookup_threads: usize,
    pub jump: usize,
    pub max_matches: Option<usize>,
    pub progress: bool,
}

/// One run: an index at one compression factor.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KeepUpPoint {
    pub backend: String,
    pub speedup: f64,
    /// The trace's span divided by the factor.
    pub window_s: f64,
    /// From the first issue to the last event applied and the last lookup answered.
    pub elapsed_s: f64,
    /// `elapsed_s <= 1.10 * window_s`.
    pub kept_up: bool,
    /// Block ops (event blocks and lookup blocks) over the window, and apart.
    pub offered_block_ops_per_s: f64,
    pub offered_event_blocks_per_s: f64,
    pub offered_lookup_blocks_per_s: f64,
    /// The same blocks over the elapsed time.
    pub achieved_block_ops_per_s: f64,
    pub achieved_event_blocks_per_s: f64,
    pub achieved_lookup_blocks_per_s: f64,
    /// How late ops were issued against their compressed time (a full apply queue holds the
    /// issuer back).
    pub issue_lag_p50_us: f64,
    pub issue_lag_p99_us: f64,
    /// From an event's issue to its apply thread taking it from the queue.
    pub queue_wait_p50_us: f64,
    pub queue_wait_p99_us: f64,
    /// From an event's issue to applied.
    pub update_p50_us: f64,
    pub update_p99_us: f64,
    /// From a lookup's issue to a lookup thread starting it.
    pub lookup_wait_p50_us: f64,
    pub lookup_wait_p99_us: f64,
    /// A lookup's own time on its thread.
    pub lookup_service_p50_us: f64,
    pub lookup_service_p99_us: f64,
}

/// Nanoseconds since `start`.
fn ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// Waits until `due` after `start`: sleeps while it is far, spins the last stretch.
fn wait_until(start: Instant, due: Duration) {
    loop {
        let now = start.elapsed();
        if now >= due {
            return;
        }
        let left = due - now;
        if left > Duration::from_micros(200) {
            std::thread::sleep(left - Duration::from_micros(100));
        } else {
            std::hint::spin_loop();
        }
    }
}

struct Sweep<'a> {
    wl: &'a Workload,
    ts: &'a [u64],
    cfg: &'a KeepUpConfig,
}

impl FnOnceIndex<Vec<KeepUpPoint>> for Sweep<'_> {
    fn call<I: Answering>(self, make: impl Fn(usize) -> I) -> Vec<KeepUpPoint> {
        self.cfg.speedups.iter().map(|&s| once(make(self.cfg.apply_threads), self.wl, self.ts, s, self.cfg)).collect()
    }
}

/// One open-loop run of `wl` on `index` with its timeline compressed `speedup` times.
fn once<I: KvIndex>(index: I, wl: &Workload, ts: &[u64], speedup: f64, cfg: &KeepUpConfig) -> KeepUpPoint {
    let name = index.name().to_string();
    let model = Arc::new(Model::new(index));
    let index = model.device();
    let (mut batches, queries) = prepare(wl);
    let start = Instant::now();
    let (hook, applied) = applied_latencies(start);
    let pool = ApplyPool::new(model.clone(), cfg.apply_threads, 1024, Some(hook), None);
    let (lookups, inbox) = crossbeam_channel::unbounded::<(usize, u64)>();
    let pb = progress(cfg.progress, wl.ops.len() as u64, format!("{name} keep-up x{speedup}"));
    let mut lag = histogram();
    let (served, elapsed) = std::thread::scope(|s| {
        let readers: Vec<_> = (0..cfg.lookup_threads.max(1))
            .map(|_| {
                let (inbox, queries) = (inbox.clone(), &queries);
                let opts = MatchOptions { max_matches: cfg.max_matches, ..Default::default() };
                s.spawn(move || {
                    let (mut wait, mut service) = (histogram(), histogram());
                    for (qi, issued) in inbox {
                        let t0 = ns(start);
                        std::hint::black_box(index.find_matches(&queries[qi], &opts));
                        let _ = wait.record(t0.saturating_sub(issued).max(1));
                        let _ = service.record(ns(start).saturating_sub(t0).max(1));
                    }
                    (wait, service)
                })
            })
            .collect();
        let mut qi = 0;
        for (i, batch) in batches.iter_mut().enumerate() {
            let due = Duration::from_secs_f64(ts[i] as f64 / 1000.0 / speedup);
            wait_until(start, due);
            let now = start.elapsed();
            let _ = lag.record(now.saturating_sub(due).as_nanos().max(1) as u64);
            let issued = now.as_nanos() as u64;
            match batch.take() {
                Some((w, events)) => pool.apply(w, events, issued),
                None => {
                    let _ = lookups.send((qi, issued));
                    qi += 1;
                }
            }
            if i % 1024 == 0 {
                pb.set_position(i as u64);
            }
        }
        drop(lookups);
        pool.flush();
        index.settle();
        let served: Vec<(Histogram<u64>, Histogram<u64>)> = readers.into_iter().filter_map(|r| r.join().ok()).collect();
        (served, start.elapsed().as_secs_f64())
    });
    pb.finish_and_clear();
    drop(pool);
    let (mut wait, mut service) = (histogram(), histogram());
    for (w, sv) in &served {
        let _ = wait.add(w);
        let _ = service.add(sv);
    }
    let applied = applied.lock();
    let window_s = ts.last().copied().unwrap_or(0).max(1) as f64 / 1000.0 / speedup;
    let run = Run {
        name,
        speedup,
        window_s,
        elapsed,
        lag: &lag,
        queue: &applied.0,
        update: &applied.1,
        wait: &wait,
        service: &service,
    };
    run.point(wl)
}

/// What one run measured, for its point.
struct Run<'a> {
    /// The index's name.
    name: String,
    /// The timeline's compression.
    speedup: f64,
    /// The compressed timeline's length, s.
    window_s: f64,
    /// How long the run took, s.
    elapsed: f64,
    /// How late each op was issued, ns.
    lag: &'a Histogram<u64>,
    /// Batches' waits in their queues, ns.
    queue: &'a Histogram<u64>,
    /// Batches' issue to applied, ns.
    update: &'a Histogram<u64>,
    /// Lookups' waits for a thread, ns.
    wait: &'a Histogram<u64>,
    /// Lookups' own times, ns.
    service: &'a Histogram<u64>,
}

impl Run<'_> {
    fn point(self, wl: &Workload) -> KeepUpPoint {
        let (name, speedup, window_s, elapsed) = (self.name, self.speedup, self.window_s, self.elapsed);
        let (lag, wait, service) = (self.lag, self.wait, self.service);
        let events = (wl.stored_blocks + wl.removed_blocks) as f64;
        let looked = wl.lookup_blocks as f64;
        KeepUpPoint {
            backend: name,
            speedup,
            window_s,
            elapsed_s: elapsed,
            kept_up: elapsed <= KEPT_UP * window_s,
            offered_block_ops_per_s: (events + looked) / window_s,
            offered_event_blocks_per_s: events / window_s,
            offered_lookup_blocks_per_s: looked / window_s,
            achieved_block_ops_per_s: (events + looked) / elapsed,
            achieved_event_blocks_per_s: events / elapsed,
            achieved_lookup_blocks_per_s: looked / elapsed,
            issue_lag_p50_us: us(lag, 0.5),
            issue_lag_p99_us: us(lag, 0.99),
            queue_wait_p50_us: us(self.queue, 0.5),
            queue_wait_p99_us: us(self.queue, 0.99),
            update_p50_us: us(self.update, 0.5),
            update_p99_us: us(self.update, 0.99),
            lookup_wait_p50_us: us(wait, 0.5),
            lookup_wait_p99_us: us(wait, 0.99),
            lookup_service_p50_us: us(service, 0.5),
            lookup_service_p99_us: us(service, 0.99),
        }
    }
}

/// The workload's batches (one event each, by op; `None` where a lookup is) and lookups, made
/// up front so that issuing costs no copy.
#[allow(clippy::type_complexity)]
fn prepare(wl: &Workload) -> (Vec<Option<(WorkerId, Vec<Event>)>>, Vec<Vec<LocalHash>>) {
    let queries = wl.ops.iter().filter_map(|op| if let Op::Lookup(q) = op { Some(q.clone()) } else { None }).collect();
    let batches = wl
        .ops
        .iter()
        .map(|op| match op {
            Op::Event(w, ev) => Some((*w, vec![ev.clone()])),
            Op::Lookup(_) => None,
        })
        .collect();
    (batches, queries)
}

/// The hook that records each batch's queue wait and update latency (issue to applied) as its
/// apply thread finishes it (a batch's tag is its issue time, ns since `start`).
#[allow(clippy::type_complexity)]
fn applied_latencies(start: Instant) -> (OnApplied, Arc<Mutex<(Histogram<u64>, Histogram<u64>)>>) {
    let applied = Arc::new(Mutex::new((histogram(), histogram())));
    let recorded = applied.clone();
    let hook: OnApplied = Arc::new(move |_worker, _out, issued, timing: Timing| {
        let done = ns(start);
        let taken = timing.taken.saturating_duration_since(start).as_nanos() as u64;
        let mut h = recorded.lock();
        let _ = h.0.record(taken.saturating_sub(issued).max(1));
        let _ = h.1.record(done.saturating_sub(issued).max(1));
    });
    (hook, applied)
}

/// Runs every backend at every factor (backends one after another, each over all factors).
pub fn sweep(wl: &Workload, cfg: &KeepUpConfig) -> anyhow::Result<Vec<KeepUpPoint>> {
    let ts =
        wl.ts_ms.as_deref().ok_or_else(|| anyhow::anyhow!("--keep-up needs a trace (a stream file has no arrival times)"))?;
    let mut out = Vec::new();
    for &b in &cfg.backends {
        out.extend(with_backend(b, cfg.jump, Sweep { wl, ts, cfg }));
    }
    Ok(out)
}

/// Each backend's keep-up threshold: the highest offered rate it kept up with, and the lowest
/// it did not (`None` when every run kept up, or none did).
pub fn thresholds(points: &[KeepUpPoint]) -> Vec<(String, Option<f64>, Option<f64>)> {
    let mut names: Vec<&str> = points.iter().map(|p| p.backend.as_str()).collect();
    names.dedup();
    names
        .into_iter()
        .map(|b| {
            let of = || points.iter().filter(move |p| p.backend == b);
            let kept = of()
                .filter(|p| p.kept_up)
                .map(|p| p.offered_block_ops_per_s)
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
            let lost = of()
                .filter(|p| !p.kept_up)
                .map(|p| p.offered_block_ops_per_s)
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.min(x))));
            (b.to_string(), kept, lost)
        })
        .collect()
}

/// The runs as an aligned table, then each backend's threshold.
pub fn table(points: &[KeepUpPoint]) -> String {
    let bw = points.iter().map(|p| p.backend.len()).max().unwrap_or(0).max(10);
    let mut s = format!(
        "{:<bw$} {:>8} {:>11} {:>11} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        "backend",
        "speedup",
        "offered/s",
        "achieved/s",
        "kept up",
        "lag p99 us",
        "queue p99",
        "update p50",
        "update p99",
        "lookup p50",
        "lookup p99",
        "l.wait p99"
    );
    for p in points {
        s += &format!(
            "{:<bw$} {:>8} {:>11} {:>11} {:>8} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>11.2} {:>11.2} {:>11.1}\n",
            p.backend,
            p.speedup,
            si(p.offered_block_ops_per_s),
            si(p.achieved_block_ops_per_s),
            if p.kept_up { "yes" } else { "no" },
            p.issue_lag_p99_us,
            p.queue_wait_p99_us,
            p.update_p50_us,
            p.update_p99_us,
            p.lookup_service_p50_us,
            p.lookup_service_p99_us,
            p.lookup_wait_p99_us
        );
    }
    s += "\nkeep-up threshold (block ops/s offered): the highest kept up, the lowest not\n";
    for (b, kept, lost) in thresholds(points) {
        s += &format!("{b:<bw$} {:>11} {:>11}\n", kept.map_or("-".into(), si), lost.map_or("-".into(), si));
    }
    s
}

/// Achieved against offered block ops/s, one line per index, log-log, as an SVG image.
pub fn plot(points: &[KeepUpPoint], path: &std::path::Path) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let lo = points.iter().map(|p| p.offered_block_ops_per_s.min(p.achieved_block_ops_per_s)).fold(f64::INFINITY, f64::min);
    let hi = points.iter().map(|p| p.offered_block_ops_per_s.max(p.achieved_block_ops_per_s)).fold(0.0, f64::max);
    if points.is_empty() || !(lo.is_finite() && hi > 0.0) {
        anyhow::bail!("nothing to plot");
    }
    let (lo, hi) = (lo * 0.8, hi * 1.25);
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Keep-up: achieved against offered block ops/s (drain counted)", ("sans-serif", 20))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("offered block ops/s")
        .y_desc("achieved block ops/s")
        .x_label_formatter(&|v| si(*v))
        .y_label_formatter(&|v| si(*v))
        .draw()?;
    chart
        .draw_series(LineSeries::new([(lo, lo), (hi, hi)], BLACK.mix(0.3)))?
        .label("offered = achieved")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK.mix(0.3)));
    let mut names: Vec<&str> = points.iter().map(|p| p.backend.as_str()).collect();
    names.dedup();
    for (i, b) in names.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut line: Vec<(f64, f64)> =
            points.iter().filter(|p| p.backend == *b).map(|p| (p.offered_block_ops_per_s, p.achieved_block_ops_per_s)).collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(*b)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(line.into_iter().map(|xy| Circle::new(xy, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
