//! `kvindex e2e`: the whole system on one machine. A NATS server (started here unless one is
//! given), `kvindex serve`, mock engines publishing a trace's events to their per-worker
//! subjects at a chosen rate, and a router issuing the trace's lookups at a fixed rate.
//! Reports sustained blocks applied per second, event lag and lookup round trips.

use crate::harness::{buckets, free_port, http_body, nats_or_own, quantile, sample, Daemon};
use crate::stream::Op;
use crate::workload::Workload;
use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use kvindex::config::{Config, Ingest};
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::WorkerId;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct E2eConfig {
    /// An existing NATS server; `None` starts `nats-server` on a free loopback port.
    pub nats_url: Option<String>,
    /// Blocks (stored + removed) published per second; 0 publishes as fast as possible.
    pub rate: f64,
    /// Lookups per second issued while events flow.
    pub lookup_rate: f64,
    /// Apply threads of the daemon.
    pub apply_threads: usize,
    /// Durable mode: the daemon reads a JetStream stream (an own server starts with JetStream
    /// on), and the restarted daemon must rebuild from the stream with the publishers gone.
    pub jetstream: bool,
    pub progress: bool,
}

/// What a run measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct E2eReport {
    pub offered_blocks_per_s: f64,
    pub sustained_blocks_per_s: f64,
    pub blocks: u64,
    pub seconds: f64,
    /// Upper bounds from the daemon's lag histogram (publish ts_ns to applied).
    pub event_lag_p50_ms: f64,
    pub event_lag_p99_ms: f64,
    pub lookups: u64,
    pub lookups_per_s: f64,
    pub lookup_rtt_p50_us: f64,
    pub lookup_rtt_p99_us: f64,
    /// Upper bound of the daemon's own time per answer, p99 (decode to reply sent), from its
    /// histogram: what of the round trip is kvindex's.
    pub answer_p99_us: f64,
    /// Round-trip p99 of the same lookups with no ingest, same run, same full index.
    pub idle_rtt_p99_us: f64,
    /// Upper bound of the daemon's own time per answer, p99, over those idle lookups: the
    /// baseline `answer_p99_us` compares to.
    pub idle_answer_p99_us: f64,
    pub lookup_errors: u64,
    /// After the replay, a fresh daemon replaced the first: time until it was ready again,
    /// rebuilt from the publishers' snapshots (durable mode: from the stream, the publishers
    /// closed), and the blocks it then held.
    pub rebuild_ms: f64,
    pub rebuilt_blocks: u64,
    /// Blocks the engines held at the end (some unreachable: evicted parents).
    pub engine_blocks: u64,
    /// Durable mode: the last snapshot of the first daemon (taken once every block was
    /// applied): its write time (save, encode, store) and size; `rebuild_ms` is then the
    /// restart from it plus the stream after it.
    pub snapshot_write_ms: f64,
    pub snapshot_bytes: u64,
    /// Durable mode: a third daemon's restart with the snapshots deleted, from the stream alone.
    pub replay_rebuild_ms: f64,
    pub replay_rebuilt_blocks: u64,
}

/// Bucket series of the daemon's event lag and answer time histograms.
const LAG: &str = "kvindex_event_lag_seconds_bucket{";
const ANSWER: &str = "kvindex_lookup_duration_seconds_bucket{result=\"ok\",";

/// Quantile `q` of a Prometheus histogram series, as the upper bound of its bucket (seconds).
fn bucket_quantile(text: &str, series: &str, q: f64) -> f64 {
    quantile(&buckets(text, series), q)
}

/// Where a run's daemons are: the NATS server (ours, unless given) and the subject prefix.
struct Site {
    /// Our own `nats-server`, stopped on drop (`None`: the run uses the one given).
    nats: Option<crate::harness::NatsProcess>,
    /// Durable mode's JetStream store of our own server, removed at the end.
    store: Option<std::path::PathBuf>,
    /// NATS's URL.
    url: String,
    /// The run's subject prefix.
    prefix: String,
}

impl Site {
    /// NATS as `cfg` says (with JetStream when durable and ours), and a prefix of this run's.
    fn open(cfg: &E2eConfig) -> Result<Site> {
        let prefix = format!("e2e{}", std::process::id());
        if let (None, true) = (&cfg.nats_url, cfg.jetstream) {
            let store = std::env::temp_dir().join(format!("kvindex-e2e-js-{}", std::process::id()));
            let dir = store.to_str().context("temp dir is not UTF-8")?;
            let server = crate::harness::NatsProcess::start_with(free_port()?, &["-js", "-sd", dir], &[])?;
            let url = server.url();
            return Ok(Site { nats: Some(server), store: Some(store), url, prefix });
        }
        let (nats, url) = nats_or_own(cfg.nats_url.as_deref())?;
        Ok(Site { nats, store: None, url, prefix })
    }

    /// A daemon's configuration on this site, on fresh ports.
    fn daemon_cfg(&self, cfg: &E2eConfig) -> Result<Config> {
        Ok(Config {
            prefix: self.prefix.clone(),
            metrics_addr: format!("127.0.0.1:{}", free_port()?),
            inspect_addr: format!("127.0.0.1:{}", free_port()?),
            apply_threads: cfg.apply_threads,
            worker_ttl: 0,
            ingest: if cfg.jetstream { Ingest::Jetstream } else { Ingest::Core },
            snapshot_interval: 1,
            ..Config::with_nats_url(self.url.clone())
        })
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        if let Some(store) = &self.store {
            self.nats = None;
            let _ = std::fs::remove_dir_all(store);
        }
    }
}

/// One publisher per worker of the workload, as beside each engine; and the blocks its events
/// name in all.
async fn start_publishers(
    wl: &Workload,
    client: &async_nats::Client,
    prefix: &str,
) -> Result<(HashMap<WorkerId, Publisher>, u64)> {
    let mut publishers: HashMap<WorkerId, Publisher> = HashMap::new();
    let mut total_blocks = 0u64;
    for op in &wl.ops {
        let Op::Event(w, ev) = op else { continue };
        total_blocks += ev.blocks() as u64;
        if let std::collections::hash_map::Entry::Vacant(slot) = publishers.entry(*w) {
            slot.insert(Publisher::start(client.clone(), PublisherConfig::new(prefix, w.worker_id, w.dp_rank)).await?);
        }
    }
    Ok((publishers, total_blocks))
}

/// The router: lookups at a fixed rate while events flow, on a connection and runtime of its
/// own as a router process would have, so its round trips measure kvindex.
struct Router {
    /// Its runtime.
    rt: tokio::runtime::Runtime,
    /// The pacing thread (tokio's timer ticks in milliseconds, which would send lookups in
    /// bursts); each request runs as a task on the runtime.
    pacer: std::thread::JoinHandle<()>,
    /// Tells the pacer to stop.
    done: Arc<AtomicBool>,
    /// Round trips, ns.
    rtt: Arc<parking_lot::Mutex<Histogram<u64>>>,
    /// Lookups that failed or could not be sent (512 in flight at most).
    errors: Arc<AtomicU64>,
}

impl Router {
    async fn start(site: &Site, queries: Arc<Vec<Query>>, rate: f64) -> Result<Router> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).thread_name("e2e-router").enable_all().build()?;
        let connecting = site.url.clone();
        let client =
            rt.spawn(async move { async_nats::connect(connecting).await }).await?.context("router connecting to NATS")?;
        // A generous timeout: this measures round trips, it does not route.
        let lookups = LookupClient::new(client, &site.prefix).with_timeout(Duration::from_secs(10));
        let done = Arc::new(AtomicBool::new(false));
        let rtt = Arc::new(parking_lot::Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?));
        let errors = Arc::new(AtomicU64::new(0));
        let (stop, times, failed, handle) = (done.clone(), rtt.clone(), errors.clone(), rt.handle().clone());
        let every = Duration::from_secs_f64(1.0 / rate.max(1.0));
        let pacer = std::thread::spawn(move || {
            let limit = Arc::new(tokio::sync::Semaphore::new(512));
            let start = Instant::now();
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) && !queries.is_empty() {
                if let Some(wait) = (start + every * i).checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                let n = i as usize % queries.len();
                i += 1;
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    failed.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let (lookups, times, failed, queries) = (lookups.clone(), times.clone(), failed.clone(), queries.clone());
                handle.spawn(async move {
                    let t = Instant::now();
                    match lookups.lookup(&queries[n]).await {
                        Ok(_) => drop(times.lock().record(t.elapsed().as_nanos() as u64)),
                        Err(_) => drop(failed.fetch_add(1, Ordering::Relaxed)),
                    }
                    drop(permit);
                });
            }
        });
        Ok(Router { rt, pacer, done, rtt, errors })
    }

    /// Stops issuing lookups, and then asks again one at a time with no ingest (the baseline).
    async fn stop(self, site: &Site, queries: Arc<Vec<Query>>, rate: f64) -> Result<(Histogram<u64>, Histogram<u64>, u64)> {
        self.done.store(true, Ordering::Relaxed);
        let pacer = self.pacer;
        let _ = tokio::task::spawn_blocking(move || pacer.join()).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let idle = {
            let (url, prefix) = (site.url.clone(), site.prefix.clone());
            self.rt.spawn(async move { idle_round_trips(&url, &prefix, &queries, rate).await }).await??
        };
        self.rt.shutdown_background();
        let rtt = self.rtt.lock().clone();
        Ok((rtt, idle, self.errors.load(Ordering::Relaxed)))
    }
}

/// Publishes every event on its worker's publisher, paced to `rate` blocks per second (0: as
/// fast as NATS takes them), on this thread as engines would in their own processes, so their
/// bursts do not hold up the runtime that serves lookups.
fn replay_events(wl: &Workload, publishers: &HashMap<WorkerId, Publisher>, rate: f64, pb: &indicatif::ProgressBar) {
    let handle = tokio::runtime::Handle::current();
    let start = Instant::now();
    tokio::task::block_in_place(|| {
        let mut sent = 0u64;
        for op in &wl.ops {
            let Op::Event(w, ev) = op else { continue };
            if rate > 0.0 {
                let due = start + Duration::from_secs_f64(sent as f64 / rate);
                if let Some(wait) = due.checked_duration_since(Instant::now()).filter(|w| *w > Duration::from_micros(200)) {
                    std::thread::sleep(wait);
                }
            }
            let Some(p) = publishers.get(w) else { continue };
            // Wait for NATS rather than drop: this measures throughput, not loss.
            handle.block_on(p.wait_for_room());
            p.publish(ev);
            sent += ev.blocks() as u64;
            if sent % 4096 < 64 {
                pb.set_position(sent);
            }
        }
    });
}

/// The daemon's metrics once it has applied `blocks` blocks (at most 10 minutes after `start`).
async fn applied(metrics_addr: &str, blocks: u64, start: Instant) -> Result<String> {
    let names = ("kvindex_blocks_applied_total{kind=\"stored\"}", "kvindex_blocks_applied_total{kind=\"removed\"}");
    loop {
        let text = http_body(metrics_addr, "/metrics").await;
        if sample(&text, names.0) + sample(&text, names.1) >= blocks as f64 {
            return Ok(text);
        }
        if start.elapsed() > Duration::from_secs(600) {
            bail!("the daemon did not apply every block within 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Durable mode: the next snapshot written after every block was applied: its write time (ms)
/// and size.
async fn full_snapshot(metrics_addr: &str) -> Result<(f64, u64)> {
    let ok = "kvindex_snapshot_writes_total{result=\"ok\"}";
    let before = sample(&http_body(metrics_addr, "/metrics").await, ok);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = http_body(metrics_addr, "/metrics").await;
        if sample(&text, ok) > before {
            return Ok((sample(&text, "kvindex_snapshot_write_seconds") * 1e3, sample(&text, "kvindex_snapshot_bytes") as u64));
        }
        if Instant::now() > deadline {
            bail!("the daemon wrote no snapshot within a minute");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A new daemon started with `cfg`: how long until ready (ms), and the blocks it then holds.
async fn restart(cfg: Config) -> Result<(f64, u64)> {
    let restarted = Instant::now();
    let daemon = Daemon::start(cfg).await?;
    let ms = restarted.elapsed().as_secs_f64() * 1e3;
    let blocks = sample(&http_body(&daemon.cfg.metrics_addr, "/metrics").await, "kvindex_index_blocks") as u64;
    daemon.stop().await?;
    Ok((ms, blocks))
}

/// Runs the whole system once and reports.
pub async fn run(wl: &Workload, cfg: &E2eConfig) -> Result<E2eReport> {
    let site = Site::open(cfg)?;
    let daemon = Daemon::start(site.daemon_cfg(cfg)?).await?;
    let metrics_addr = daemon.cfg.metrics_addr.clone();
    let client = async_nats::connect(&site.url).await.context("publisher connecting to NATS")?;
    let (mut publishers, total_blocks) = start_publishers(wl, &client, &site.prefix).await?;
    let queries: Arc<Vec<Query>> =
        Arc::new(wl.ops.iter().filter_map(|o| if let Op::Lookup(q) = o { Some(Query::hashes(q)) } else { None }).collect());
    let router = Router::start(&site, queries.clone(), cfg.lookup_rate).await?;
    let pb = if cfg.progress { indicatif::ProgressBar::new(total_blocks) } else { indicatif::ProgressBar::hidden() };
    let start = Instant::now();
    replay_events(wl, &publishers, cfg.rate, &pb);
    for p in publishers.values() {
        p.flush().await;
    }
    let text = applied(&metrics_addr, total_blocks, start).await?;
    let seconds = start.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let (rtt, idle, lookup_errors) = router.stop(&site, queries, cfg.lookup_rate).await?;
    // The daemon's answer times over the idle lookups alone: its histogram since ingest ended.
    let idle_answers = {
        let (was, now) = (buckets(&text, ANSWER), buckets(&http_body(&metrics_addr, "/metrics").await, ANSWER));
        let delta: Vec<(f64, f64)> = now.iter().zip(&was).map(|(&(le, n), &(_, m))| (le, n - m)).collect();
        quantile(&delta, 0.99)
    };
    let (snapshot_write_ms, snapshot_bytes) = if cfg.jetstream { full_snapshot(&metrics_addr).await? } else { (0.0, 0) };
    daemon.stop().await?;
    // A new, empty daemon: how long until it has rebuilt the index from the publishers (in
    // durable mode: from the stream alone, the publishers closed)?
    let engine_blocks = publishers.values().map(|p| p.len() as u64).sum();
    if cfg.jetstream {
        for (_, p) in publishers.drain() {
            p.close().await;
        }
    }
    let (rebuild_ms, rebuilt_blocks) = restart(site.daemon_cfg(cfg)?).await?;
    let (mut replay_rebuild_ms, mut replay_rebuilt_blocks) = (0.0, 0);
    if cfg.jetstream {
        // The same restart without snapshots: the whole stream is replayed.
        let js = async_nats::jetstream::new(client.clone());
        let bucket = format!("{}_SNAPSHOTS", site.daemon_cfg(cfg)?.stream_name());
        js.delete_object_store(&bucket).await.map_err(|e| anyhow::anyhow!("deleting {bucket}: {e}"))?;
        (replay_rebuild_ms, replay_rebuilt_blocks) = restart(Config { snapshot_interval: 0, ..site.daemon_cfg(cfg)? }).await?;
    }
    Ok(E2eReport {
        offered_blocks_per_s: cfg.rate,
        sustained_blocks_per_s: total_blocks as f64 / seconds,
        blocks: total_blocks,
        seconds,
        event_lag_p50_ms: bucket_quantile(&text, LAG, 0.5) * 1e3,
        event_lag_p99_ms: bucket_quantile(&text, LAG, 0.99) * 1e3,
        lookups: rtt.len(),
        lookups_per_s: rtt.len() as f64 / seconds,
        lookup_rtt_p50_us: rtt.value_at_quantile(0.5) as f64 / 1e3,
        lookup_rtt_p99_us: rtt.value_at_quantile(0.99) as f64 / 1e3,
        answer_p99_us: bucket_quantile(&text, ANSWER, 0.99) * 1e6,
        idle_rtt_p99_us: idle.value_at_quantile(0.99) as f64 / 1e3,
        idle_answer_p99_us: idle_answers * 1e6,
        lookup_errors,
        rebuild_ms,
        rebuilt_blocks,
        engine_blocks,
        snapshot_write_ms,
        snapshot_bytes,
        replay_rebuild_ms,
        replay_rebuilt_blocks,
    })
}

/// Lookup round trips with no ingest, in the same run and on the same full index: the baseline
/// the round trips under load compare to. One at a time, paced at `rate`, about a second's worth.
async fn idle_round_trips(url: &str, prefix: &str, queries: &[Query], rate: f64) -> Result<Histogram<u64>> {
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    if queries.is_empty() {
        return Ok(h);
    }
    let client = async_nats::connect(url).await.context("router connecting to NATS")?;
    let lookups = LookupClient::new(client, prefix).with_timeout(Duration::from_secs(10));
    let every = Duration::from_secs_f64(1.0 / rate.max(1.0));
    for i in 0..(rate as usize).clamp(100, 2000) {
        let t = Instant::now();
        if lookups.lookup(&queries[i % queries.len()]).await.is_ok() {
            let _ = h.record(t.elapsed().as_nanos() as u64);
        }
        if let Some(wait) = every.checked_sub(t.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    Ok(h)
}

/// Durable mode's restart figures, a line per report.
pub fn durable_lines(rows: &[E2eReport]) -> String {
    let mut s = String::new();
    for r in rows {
        let per = if r.rebuilt_blocks > 0 { r.snapshot_bytes as f64 / r.rebuilt_blocks as f64 } else { 0.0 };
        s += &format!(
            "durable: snapshot written in {:.0} ms, {:.2} MiB ({per:.1} B per placement); restart from snapshot + stream ready in {:.0} ms with {}/{} blocks, from the stream alone in {:.0} ms with {}/{}\n",
            r.snapshot_write_ms,
            r.snapshot_bytes as f64 / (1 << 20) as f64,
            r.rebuild_ms,
            r.rebuilt_blocks,
            r.engine_blocks,
            r.replay_rebuild_ms,
            r.replay_rebuilt_blocks,
            r.engine_blocks
        );
    }
    s
}

/// The reports as an aligned table.
pub fn table(rows: &[E2eReport]) -> String {
    let mut s = format!(
        "{:>14} {:>14} {:>9} {:>12} {:>12} {:>10} {:>12} {:>12} {:>13} {:>13} {:>13} {:>11} {:>15}\n",
        "offered blk/s",
        "applied blk/s",
        "seconds",
        "lag p50 ms",
        "lag p99 ms",
        "lookups/s",
        "rtt p50 us",
        "rtt p99 us",
        "answer p99 us",
        "idle answer",
        "idle rtt p99",
        "rebuild ms",
        "rebuilt blocks"
    );
    for r in rows {
        let offered = if r.offered_blocks_per_s > 0.0 { format!("{:.0}", r.offered_blocks_per_s) } else { "max".into() };
        s += &format!(
            "{:>14} {:>14.0} {:>9.2} {:>12} {:>12} {:>10.0} {:>12.1} {:>12.1} {:>13} {:>13} {:>13.1} {:>11.0} {:>15}\n",
            offered,
            r.sustained_blocks_per_s,
            r.seconds,
            format!("<= {}", r.event_lag_p50_ms),
            format!("<= {}", r.event_lag_p99_ms),
            r.lookups_per_s,
            r.lookup_rtt_p50_us,
            r.lookup_rtt_p99_us,
            format!("<= {}", r.answer_p99_us),
            format!("<= {}", r.idle_answer_p99_us),
            r.idle_rtt_p99_us,
            r.rebuild_ms,
            format!("{}/{}", r.rebuilt_blocks, r.engine_blocks)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_quantiles_read_prometheus_text() {
        let text = "x_bucket{le=\"0.001\"} 50\nx_bucket{le=\"0.01\"} 99\nx_bucket{le=\"0.1\"} 100\nx_bucket{le=\"+Inf\"} 100\n";
        assert_eq!(bucket_quantile(text, "x_bucket{", 0.5), 0.001);
        assert_eq!(bucket_quantile(text, "x_bucket{", 0.99), 0.01);
        assert_eq!(bucket_quantile(text, "x_bucket{", 1.0), 0.1);
        let labelled = "y_bucket{result=\"ok\",le=\"0.5\"} 10\ny_bucket{result=\"ok\",le=\"+Inf\"} 10\n";
        assert_eq!(bucket_quantile(labelled, "y_bucket{result=\"ok\",", 0.99), 0.5);
        assert_eq!(sample("a{k=\"v\"} 3\nb 4\n", "b"), 4.0);
    }
}
