//! `kvindex shard-bench`: what sharding by worker costs and saves, measured. One `kvindex
//! serve` process on a plain NATS server and S shard processes on a server that partitions the
//! workers (`config/nats/shards.conf`'s mappings) take the same events at the same time, one
//! publisher per worker on each server. Per process: CPU seconds to apply the stream and the
//! resident memory it added (from `/proc`), placements and workers held. Then the same lookups,
//! one at a time, to the one daemon and merged across the shards by `LookupClient`: round-trip
//! percentiles of each, and every merged answer compared with the one daemon's.

use crate::harness::{free_port, http_body, http_get, sample, NatsProcess};
use crate::stream::Op;
use crate::workload::Workload;
use anyhow::{bail, ensure, Context, Result};
use hdrhistogram::Histogram;
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::shards::partition;
use kvindex_client::{Answer, LookupClient, Query};
use kvindex_core::hash::WorkerId;
use serde::Serialize;
use std::collections::{BTreeSet, HashMap};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Settings of a run.
#[derive(Clone, Debug)]
pub struct ShardBenchConfig {
    /// Shards to compare with one daemon.
    pub shards: u32,
    /// Lookups timed on each side (cycling through the workload's).
    pub lookups: usize,
    /// Rounds, each with fresh servers and daemons.
    pub rounds: usize,
}

/// One daemon process's cost in a round.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ProcessCost {
    /// CPU seconds (user + system) spent from ready until every block was applied.
    pub cpu_s: f64,
    /// Resident memory once every block was applied, MiB.
    pub rss_mib: f64,
    /// Resident memory when it became ready, before any event, MiB: what the stream added is
    /// the difference.
    pub rss_ready_mib: f64,
    /// Placements held.
    pub placements: u64,
    /// Workers held.
    pub workers: u64,
}

/// One round: the one daemon, each shard, and the lookups of both.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ShardRound {
    pub single: ProcessCost,
    pub shards: Vec<ProcessCost>,
    pub single_rtt_p50_us: f64,
    pub single_rtt_p99_us: f64,
    pub merged_rtt_p50_us: f64,
    pub merged_rtt_p99_us: f64,
    /// Lookups timed on each side.
    pub lookups: u64,
    /// Merged answers that differ from the one daemon's (workers and depths): 0 when exact.
    pub differing: u64,
    /// Merged answers that named a missing shard.
    pub partial: u64,
}

/// A `kvindex serve` in a process of its own, so that its CPU time and memory are its own.
struct ServeProcess {
    child: Child,
    metrics_addr: String,
}

impl ServeProcess {
    async fn start(url: &str, prefix: &str, shards: u32, shard: u32) -> Result<ServeProcess> {
        let metrics_addr = format!("127.0.0.1:{}", free_port()?);
        let child = Command::new(std::env::current_exe().context("this executable")?)
            .args(["serve", "--nats-url", url, "--prefix", prefix, "--metrics-addr", &metrics_addr])
            .args(["--inspect-addr", &format!("127.0.0.1:{}", free_port()?), "--worker-ttl", "0", "--apply-threads", "1"])
            .args(["--shards", &shards.to_string(), "--shard", &shard.to_string()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting kvindex serve")?;
        let mut p = ServeProcess { child, metrics_addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(&p.metrics_addr, "/readyz").await.map(|r| r.0) != Some(200) {
            if Instant::now() > deadline || p.child.try_wait()?.is_some() {
                bail!("kvindex serve (shard {shard} of {shards}) did not become ready");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(p)
    }

    /// CPU seconds the process has used (user + system), from `/proc/PID/stat`.
    fn cpu_s(&self, ticks_per_s: f64) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name (which may hold spaces) end with `)`.
        let rest = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).context("/proc/PID/stat fields");
        // utime and stime: fields 14 and 15 of the line, 12 and 13 after the name.
        Ok((ticks(11)? + ticks(12)?) / ticks_per_s)
    }

    /// Resident memory in MiB, from `/proc/PID/status`.
    fn rss_mib(&self) -> Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .context("VmRSS in /proc/PID/status")?;
        Ok(kib / 1024.0)
    }

    async fn metrics(&self) -> String {
        http_body(&self.metrics_addr, "/metrics").await
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Clock ticks per second of `/proc`'s CPU times.
fn ticks_per_s() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// Blocks applied (stored and removed) by a daemon's metrics text.
fn applied(text: &str) -> f64 {
    sample(text, "kvindex_blocks_applied_total{kind=\"stored\"}") + sample(text, "kvindex_blocks_applied_total{kind=\"removed\"}")
}

/// An answer's workers and depths, in one order.
fn placements(a: &Answer) -> BTreeSet<(u64, u32, u32)> {
    a.groups.iter().flat_map(|g| g.workers.iter().map(move |w| (w.0, w.1, g.blocks))).collect()
}

/// Runs the rounds.
pub async fn run(wl: &Workload, cfg: &ShardBenchConfig) -> Result<Vec<ShardRound>> {
    ensure!(cfg.shards >= 2, "shards: at least 2");
    ensure!(cfg.rounds >= 1 && cfg.lookups >= 1, "rounds and lookups: at least 1");
    let mut rounds = Vec::new();
    for _ in 0..cfg.rounds {
        rounds.push(round(wl, cfg).await?);
    }
    Ok(rounds)
}

/// One publisher per worker of the workload on each of two servers, as one engine would have
/// beside each; and the blocks its events name in all.
async fn publishers_on(wl: &Workload, prefix: &str, servers: [&str; 2]) -> Result<(HashMap<WorkerId, [Publisher; 2]>, u64)> {
    let (a, b) = (async_nats::connect(servers[0]).await?, async_nats::connect(servers[1]).await?);
    let mut publishers: HashMap<WorkerId, [Publisher; 2]> = HashMap::new();
    let mut total = 0u64;
    for op in &wl.ops {
        let Op::Event(w, ev) = op else { continue };
        total += ev.blocks() as u64;
        if let std::collections::hash_map::Entry::Vacant(slot) = publishers.entry(*w) {
            let one = Publisher::start(a.clone(), PublisherConfig::new(prefix, w.worker_id, w.dp_rank)).await?;
            let other = Publisher::start(b.clone(), PublisherConfig::new(prefix, w.worker_id, w.dp_rank)).await?;
            slot.insert([one, other]);
        }
    }
    Ok((publishers, total))
}

/// Every event, published to both sides; returns once each side has applied `total` blocks.
async fn replay(
    wl: &Workload,
    publishers: &HashMap<WorkerId, [Publisher; 2]>,
    single: &ServeProcess,
    shards: &[ServeProcess],
    total: u64,
) -> Result<()> {
    for op in &wl.ops {
        let Op::Event(w, ev) = op else { continue };
        let Some(pair) = publishers.get(w) else { continue };
        for p in pair {
            p.wait_for_room().await;
            p.publish(ev);
        }
    }
    for p in publishers.values().flatten() {
        p.flush().await;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let mut shards_applied = 0.0;
        for p in shards {
            shards_applied += applied(&p.metrics().await);
        }
        if applied(&single.metrics().await) >= total as f64 && shards_applied >= total as f64 {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "the daemons did not apply the {total} blocks within 10 minutes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The same lookups to the one daemon and to the shards (merged), one at a time, alternating.
struct Compared {
    /// The one daemon's round trips, ns.
    one_rtt: Histogram<u64>,
    /// The merged answers' round trips, ns.
    merged_rtt: Histogram<u64>,
    /// Merged answers unlike the one daemon's.
    differing: u64,
    /// Merged answers missing a shard.
    partial: u64,
}

async fn compare(wl: &Workload, prefix: &str, urls: [&str; 2], lookups: usize) -> Result<Compared> {
    let queries: Vec<Query> =
        wl.ops.iter().filter_map(|o| if let Op::Lookup(q) = o { Some(Query::hashes(q)) } else { None }).collect();
    ensure!(!queries.is_empty(), "the workload has no lookups");
    let timeout = Duration::from_secs(5);
    let one = LookupClient::new(async_nats::connect(urls[0]).await?, prefix).with_timeout(timeout);
    let merged = LookupClient::new(async_nats::connect(urls[1]).await?, prefix).with_timeout(timeout);
    let histogram = || Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3);
    let mut out = Compared { one_rtt: histogram()?, merged_rtt: histogram()?, differing: 0, partial: 0 };
    // The first merged lookup learns the shard count: not timed.
    merged.lookup(&queries[0]).await?;
    for i in 0..lookups {
        let q = &queries[i % queries.len()];
        let t = Instant::now();
        let a = one.lookup(q).await?;
        out.one_rtt.record(t.elapsed().as_nanos() as u64)?;
        let t = Instant::now();
        let b = merged.lookup(q).await?;
        out.merged_rtt.record(t.elapsed().as_nanos() as u64)?;
        out.partial += u64::from(b.is_partial());
        out.differing += u64::from(placements(&a) != placements(&b));
    }
    Ok(out)
}

async fn round(wl: &Workload, cfg: &ShardBenchConfig) -> Result<ShardRound> {
    let ticks = ticks_per_s();
    let prefix = format!("shb{}", std::process::id());
    let plain = NatsProcess::start()?;
    let sharded = NatsProcess::start_sharded(&prefix, cfg.shards)?;
    let single = ServeProcess::start(&plain.url(), &prefix, 1, 0).await?;
    let mut shards = Vec::new();
    for k in 0..cfg.shards {
        shards.push(ServeProcess::start(&sharded.url(), &prefix, cfg.shards, k).await?);
    }
    let (publishers, total) = publishers_on(wl, &prefix, [&plain.url(), &sharded.url()]).await?;
    let cpu_before: Vec<f64> = std::iter::once(&single).chain(&shards).map(|p| p.cpu_s(ticks)).collect::<Result<_>>()?;
    let rss_ready: Vec<f64> = std::iter::once(&single).chain(&shards).map(|p| p.rss_mib()).collect::<Result<_>>()?;
    replay(wl, &publishers, &single, &shards, total).await?;
    let mut costs = Vec::new();
    for ((p, before), ready) in std::iter::once(&single).chain(&shards).zip(&cpu_before).zip(&rss_ready) {
        let text = p.metrics().await;
        costs.push(ProcessCost {
            cpu_s: p.cpu_s(ticks)? - before,
            rss_mib: p.rss_mib()?,
            rss_ready_mib: *ready,
            placements: sample(&text, "kvindex_index_blocks") as u64,
            workers: sample(&text, "kvindex_index_workers") as u64,
        });
    }
    // Each shard holds exactly the workers NATS maps to it.
    for (k, cost) in costs[1..].iter().enumerate() {
        let owned = publishers.keys().filter(|w| partition(w.worker_id, cfg.shards) == k as u32).count() as u64;
        ensure!(cost.workers == owned, "shard {k} holds {} workers, {owned} are mapped to it", cost.workers);
    }
    let c = compare(wl, &prefix, [&plain.url(), &sharded.url()], cfg.lookups).await?;
    let us = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1e3;
    Ok(ShardRound {
        single: costs[0].clone(),
        shards: costs[1..].to_vec(),
        single_rtt_p50_us: us(&c.one_rtt, 0.5),
        single_rtt_p99_us: us(&c.one_rtt, 0.99),
        merged_rtt_p50_us: us(&c.merged_rtt, 0.5),
        merged_rtt_p99_us: us(&c.merged_rtt, 0.99),
        lookups: cfg.lookups as u64,
        differing: c.differing,
        partial: c.partial,
    })
}

/// Median and range of `values` as `m (lo-hi)`.
fn spread(mut values: Vec<f64>, digits: usize) -> String {
    values.sort_by(f64::total_cmp);
    let (lo, hi, mid) = (values[0], values[values.len() - 1], values[values.len() / 2]);
    if values.len() == 1 {
        format!("{mid:.digits$}")
    } else {
        format!("{mid:.digits$} ({lo:.digits$}-{hi:.digits$})")
    }
}

/// The rounds as a table: the one daemon and each shard (medians, ranges over rounds), and
/// the lookups.
pub fn table(rounds: &[ShardRound]) -> String {
    let shards = rounds.first().map_or(0, |r| r.shards.len());
    let mut out = format!(
        "{:<14} {:>22} {:>20} {:>20} {:>20} {:>12} {:>8}\n",
        "", "apply CPU s", "of one daemon", "RSS added MiB", "of one daemon", "placements", "workers"
    );
    let row = |label: String, pick: &dyn Fn(&ShardRound) -> &ProcessCost| {
        let cpu = spread(rounds.iter().map(|r| pick(r).cpu_s).collect(), 2);
        let cpu_of = spread(rounds.iter().map(|r| pick(r).cpu_s / r.single.cpu_s.max(1e-9)).collect(), 2);
        let added = |c: &ProcessCost| c.rss_mib - c.rss_ready_mib;
        let rss = spread(rounds.iter().map(|r| added(pick(r))).collect(), 1);
        let rss_of = spread(rounds.iter().map(|r| added(pick(r)) / added(&r.single).max(1e-9)).collect(), 2);
        let last = pick(&rounds[rounds.len() - 1]);
        format!("{label:<14} {cpu:>22} {cpu_of:>20} {rss:>20} {rss_of:>20} {:>12} {:>8}\n", last.placements, last.workers)
    };
    out += &row("one daemon".into(), &|r| &r.single);
    for k in 0..shards {
        out += &row(format!("shard {k} of {shards}"), &|r| &r.shards[k]);
    }
    let lookups = rounds.iter().map(|r| r.lookups).sum::<u64>();
    let differing = rounds.iter().map(|r| r.differing).sum::<u64>();
    let partial = rounds.iter().map(|r| r.partial).sum::<u64>();
    out += &format!(
        "\nlookup round trip, one at a time: one daemon p50 {} us, p99 {} us; merged over {shards} shards p50 {} us, p99 {} us\n",
        spread(rounds.iter().map(|r| r.single_rtt_p50_us).collect(), 0),
        spread(rounds.iter().map(|r| r.single_rtt_p99_us).collect(), 0),
        spread(rounds.iter().map(|r| r.merged_rtt_p50_us).collect(), 0),
        spread(rounds.iter().map(|r| r.merged_rtt_p99_us).collect(), 0),
    );
    out += &format!("{lookups} lookups each side: {differing} merged answers differ from one daemon's, {partial} partial\n");
    out
}
