//! The demo's burst scenario: groups of requests that share a new long prefix arrive faster
//! than the first one's prefill ends, so no engine event about that prefix exists while they
//! are routed. Two fleets get the same bursts, each routed by kvindex: one router announces
//! each choice (predicted placements), the other does not. Without predictions every request
//! of a burst looks new and scatters, each prefilling the prefix again; with them the rest of
//! the burst finds the worker that is already computing it.
//!
//! The engines' events for a burst are published once the burst is routed (their event lag is
//! longer than the burst), and announcements are waited for, so both fleets' answers follow
//! from the requests alone: the figures do not depend on timing.

use crate::fleet::{DemoConfig, Fleet, FleetReport, Policy, PREFILL_TOKENS_PER_S};
use crate::trace::{chain_hashes, SplitMix64, TraceRequest};
use anyhow::Result;
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock};
use serde::Serialize;
use std::collections::HashMap;

/// Bursts in a run.
const GROUPS: usize = 8;
/// Requests in a burst.
const PER_GROUP: usize = 8;
/// Blocks of a burst's shared prefix, and of each request's own suffix.
const PREFIX_BLOCKS: usize = 64;
const SUFFIX_BLOCKS: usize = 4;
/// Milliseconds between a burst's requests: all of it arrives within the first prefill.
const GAP_MS: u64 = 5;
/// Bursts start this far apart (ms), so each finds the fleet mostly idle.
const GROUP_EVERY_MS: u64 = 60_000;
/// Router cost within a burst: blocks to compute + this x the worker's active blocks. Every
/// request of a burst is still in service when the next arrives, so a quarter weight lets a
/// worker take a few requests of one before an idle worker is cheaper.
const LOAD_WEIGHT: f64 = 0.25;
/// Worker ids of the two fleets (apart from the demo's other fleets).
const WITH_BASE: u64 = 2_000_000;
const WITHOUT_BASE: u64 = 3_000_000;

/// What the bursts did with and without predictions.
#[derive(Clone, Debug, Serialize)]
pub struct BurstReport {
    pub bursts: usize,
    pub requests_per_burst: usize,
    pub prefix_blocks: usize,
    /// Milliseconds the first request's prefill takes: the window the burst arrives in.
    pub prefill_ms: f64,
    /// Routed by kvindex, announcing each choice.
    pub with_predictions: FleetReport,
    /// Routed by kvindex on the engines' events alone.
    pub events_only: FleetReport,
    /// The most requests of one burst that one worker took, with predictions and without.
    pub burst_max_with: u64,
    pub burst_max_without: u64,
}

/// One fleet of the scenario: its simulated workers, their publishers, its worker ids.
struct Side {
    fleet: Fleet,
    publishers: Vec<Publisher>,
    ids: Vec<u64>,
    base: u64,
    announce: bool,
    /// The most requests of one burst that one worker took so far.
    burst_max: u64,
}

/// Runs the bursts against the kvindex that `router` asks, on the NATS of `nats`.
pub async fn run(nats: &async_nats::Client, router: &LookupClient, cfg: &DemoConfig) -> Result<BurstReport> {
    let workers = cfg.workers as usize;
    let mut sides = Vec::with_capacity(2);
    for (base, announce) in [(WITH_BASE, true), (WITHOUT_BASE, false)] {
        let mut publishers = Vec::with_capacity(workers);
        for w in 0..cfg.workers {
            publishers.push(Publisher::start(nats.clone(), PublisherConfig::new(&cfg.prefix, base + w, 0)).await?);
        }
        let ids = (base..base + cfg.workers).collect();
        sides.push(Side { fleet: Fleet::new(Policy::KvAware, workers, cfg.seed), publishers, ids, base, announce, burst_max: 0 });
    }
    let mut rng = SplitMix64::new(cfg.seed ^ 0xb0b5);
    let tokens_per_block = 512 / cfg.factor.max(1);
    for g in 0..GROUPS {
        let prefix: Vec<u64> = (0..PREFIX_BLOCKS).map(|_| rng.next_u64()).collect();
        let requests: Vec<Vec<u64>> =
            (0..PER_GROUP).map(|_| prefix.iter().copied().chain((0..SUFFIX_BLOCKS).map(|_| rng.next_u64())).collect()).collect();
        for side in sides.iter_mut() {
            // Each worker's events for this burst, sent once it is routed (the event lag).
            let mut pending: Vec<(usize, Vec<u64>, usize, Vec<u64>)> = Vec::new();
            let before = side.fleet.requests.clone();
            for (i, locals) in requests.iter().enumerate() {
                let now_ms = g as u64 * GROUP_EVERY_MS + i as u64 * GAP_MS;
                let engine = chain_hashes(locals);
                let hashes: Vec<LocalHash> = locals.iter().map(|&l| LocalHash(l)).collect();
                let query = Query::hashes(&hashes).only_workers(&side.ids);
                let depths: HashMap<usize, u64> = match router.lookup(&query).await {
                    Ok(a) => a
                        .matches
                        .iter()
                        .filter(|m| m.worker_id >= side.base && !m.stale)
                        .map(|m| {
                            let depth = if side.announce { m.predicted_blocks.unwrap_or(0).max(m.blocks) } else { m.blocks };
                            ((m.worker_id - side.base) as usize, depth as u64)
                        })
                        .collect(),
                    Err(e) => anyhow::bail!("burst lookup failed: {e}"),
                };
                side.fleet.expire(now_ms);
                let w = side.fleet.choose(&engine, &depths, LOAD_WEIGHT);
                let req = TraceRequest {
                    timestamp: now_ms,
                    input_length: locals.len() as u64 * tokens_per_block,
                    output_length: 200,
                    hash_ids: Vec::new(),
                };
                let served = side.fleet.serve(w, &req, &engine, cfg, now_ms);
                if side.announce {
                    router.announce_applied(&Query::hashes(&hashes), side.base + w as u64, 0).await?;
                }
                pending.push((w, locals.clone(), served.hit, served.evicted));
            }
            let took = side.fleet.requests.iter().zip(&before).map(|(after, before)| after - before).max().unwrap_or(0);
            side.burst_max = side.burst_max.max(took);
            for (w, locals, hit, evicted) in pending {
                let p = &side.publishers[w];
                p.wait_for_room().await;
                if !evicted.is_empty() {
                    p.removed(&evicted.iter().map(|&b| BlockHash(b)).collect::<Vec<_>>());
                }
                let engine = chain_hashes(&locals);
                if hit < engine.len() {
                    let parent = hit.checked_sub(1).map(|i| BlockHash(engine[i]));
                    let blocks: Vec<StoredBlock> = (hit..engine.len()).map(|i| StoredBlock::new(engine[i], locals[i])).collect();
                    p.stored(parent, &blocks);
                }
            }
            for p in &side.publishers {
                p.flush().await;
            }
        }
    }
    let prefill_ms = (PREFIX_BLOCKS + SUFFIX_BLOCKS) as f64 * tokens_per_block as f64 / PREFILL_TOKENS_PER_S * 1e3;
    Ok(BurstReport {
        bursts: GROUPS,
        requests_per_burst: PER_GROUP,
        prefix_blocks: PREFIX_BLOCKS,
        prefill_ms,
        with_predictions: sides[0].fleet.report(),
        events_only: sides[1].fleet.report(),
        burst_max_with: sides[0].burst_max,
        burst_max_without: sides[1].burst_max,
    })
}

/// The bursts' table, for the demo's summary.
pub fn table(b: &BurstReport) -> String {
    let mut s = format!(
        "\nbursts: {} x {} requests sharing a new {}-block prefix, {} ms apart; the first prefill takes {:.0} ms\n",
        b.bursts, b.requests_per_burst, b.prefix_blocks, GAP_MS, b.prefill_ms
    );
    s += &format!("{:<24} {:>9} {:>22} {:>26}\n", "routing", "hit rate", "prefill tokens saved", "most on a worker per burst");
    let sides = [
        ("kvindex + predictions", &b.with_predictions, b.burst_max_with),
        ("kvindex, events only", &b.events_only, b.burst_max_without),
    ];
    for (name, f, most) in sides {
        s += &format!("{:<24} {:>7.1} % {:>22} {:>26}\n", name, f.hit_rate * 100.0, f.prefill_tokens_saved, most);
    }
    s
}
