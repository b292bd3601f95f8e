//! `kvindex shards`: would a partitioned index work on this trace? Each request goes to the
//! shard named by a hash of its first `key` blocks (so every lookup goes to one shard only),
//! and the simulation reports how evenly blocks, requests and distinct blocks spread over the
//! shards, and how much prefix reuse stays visible: a request can only match what earlier
//! requests left in its own shard, where one index would have matched across all of them.
//!
//! Caches are unbounded here (no eviction): reuse is the trace's upper bound, the same for one
//! index and for shards, so the ratio is what partitioning alone costs.

use super::trace::TraceRequest;
use rustc_hash::FxHashSet;
use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64;

/// One (shards, key blocks) point of the simulation.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ShardPoint {
    pub shards: usize,
    /// Blocks of a request's prefix its shard is chosen by.
    pub key_blocks: usize,
    /// Busiest shard's blocks stored (requests' lengths) over the mean: ingest balance.
    pub blocks_max_over_mean: f64,
    /// Busiest shard's requests over the mean: lookup balance.
    pub requests_max_over_mean: f64,
    /// Biggest shard's distinct blocks over the mean: memory balance.
    pub distinct_max_over_mean: f64,
    /// Distinct blocks summed over shards, over the trace's distinct blocks: memory overhead
    /// of a prefix held in several shards.
    pub replication: f64,
    /// Prefix blocks matched within the shard over those one index would match.
    pub reuse_kept: f64,
}

/// The shard of a request: a hash of its first `key` block ids.
fn shard_of(r: &TraceRequest, key: usize, shards: usize) -> usize {
    let mut bytes = Vec::with_capacity(8 * key);
    for id in r.hash_ids.iter().take(key) {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    (xxh3_64(&bytes) % shards as u64) as usize
}

/// Blocks of `r` from the start that `seen` holds.
fn reused(r: &TraceRequest, seen: &FxHashSet<u64>) -> u64 {
    r.hash_ids.iter().take_while(|id| seen.contains(id)).count() as u64
}

fn max_over_mean(v: &[u64]) -> f64 {
    let mean = v.iter().sum::<u64>() as f64 / v.len().max(1) as f64;
    if mean == 0.0 {
        return 1.0;
    }
    v.iter().copied().max().unwrap_or(0) as f64 / mean
}

/// Simulates `trace` split over `shards` shards by its first `key` blocks.
pub fn simulate(trace: &[TraceRequest], shards: usize, key: usize) -> ShardPoint {
    let shards = shards.max(1);
    let key = key.max(1);
    let mut blocks = vec![0u64; shards];
    let mut requests = vec![0u64; shards];
    let mut seen_in: Vec<FxHashSet<u64>> = vec![FxHashSet::default(); shards];
    let mut seen_all = FxHashSet::default();
    let (mut reuse_one, mut reuse_sharded) = (0u64, 0u64);
    for r in trace {
        let s = shard_of(r, key, shards);
        blocks[s] += r.hash_ids.len() as u64;
        requests[s] += 1;
        reuse_one += reused(r, &seen_all);
        reuse_sharded += reused(r, &seen_in[s]);
        seen_all.extend(r.hash_ids.iter().copied());
        seen_in[s].extend(r.hash_ids.iter().copied());
    }
    let distinct: Vec<u64> = seen_in.iter().map(|s| s.len() as u64).collect();
    ShardPoint {
        shards,
        key_blocks: key,
        blocks_max_over_mean: max_over_mean(&blocks),
        requests_max_over_mean: max_over_mean(&requests),
        distinct_max_over_mean: max_over_mean(&distinct),
        replication: distinct.iter().sum::<u64>() as f64 / seen_all.len().max(1) as f64,
        reuse_kept: if reuse_one == 0 { 1.0 } else { reuse_sharded as f64 / reuse_one as f64 },
    }
}

/// The points as a table.
pub fn table(name: &str, points: &[ShardPoint]) -> String {
    let mut out = format!(
        "{name}\n{:>6} {:>4} {:>12} {:>14} {:>14} {:>11} {:>10}\n",
        "shards", "key", "blocks max/", "requests max/", "distinct max/", "replication", "reuse kept"
    );
    for p in points {
        out.push_str(&format!(
            "{:>6} {:>4} {:>12.2} {:>14.2} {:>14.2} {:>11.3} {:>9.1}%\n",
            p.shards,
            p.key_blocks,
            p.blocks_max_over_mean,
            p.requests_max_over_mean,
            p.distinct_max_over_mean,
            p.replication,
            100.0 * p.reuse_kept
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(ids: &[u64]) -> TraceRequest {
        TraceRequest { timestamp: 0, input_length: 0, output_length: 0, hash_ids: ids.to_vec() }
    }

    #[test]
    fn one_shard_keeps_everything_and_balances_trivially() {
        let trace = [req(&[1, 2, 3]), req(&[1, 2, 4]), req(&[1, 5])];
        let p = simulate(&trace, 1, 1);
        assert_eq!((p.blocks_max_over_mean, p.requests_max_over_mean, p.replication, p.reuse_kept), (1.0, 1.0, 1.0, 1.0));
    }

    #[test]
    fn a_longer_key_spreads_a_shared_first_block_but_loses_the_reuse_of_it() {
        // Every request shares block 1; 64 distinct continuations.
        let trace: Vec<TraceRequest> = (0..64).map(|i| req(&[1, 100 + i, 1000 + i])).collect();
        let by_first = simulate(&trace, 8, 1);
        assert_eq!(by_first.requests_max_over_mean, 8.0, "one shard takes every request");
        assert_eq!(by_first.reuse_kept, 1.0);
        assert_eq!(by_first.replication, 1.0);
        let by_two = simulate(&trace, 8, 2);
        assert!(by_two.requests_max_over_mean < 3.0, "{by_two:?}");
        // Block 1 is now held by every shard that got a request, and only the first request
        // of each shard misses it.
        assert!(by_two.replication > 1.0 && by_two.reuse_kept < 1.0, "{by_two:?}");
        let shards_used = trace.iter().map(|r| shard_of(r, 2, 8)).collect::<FxHashSet<_>>().len();
        assert_eq!(by_two.reuse_kept, (63 - (shards_used - 1)) as f64 / 63.0);
    }
}
