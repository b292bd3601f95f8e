//! Criterion micro-benchmarks of the index's hot paths: store a chain, remove one, look up a
//! prefix, for the positional and radix backends. `kvindex bench` measures whole replays;
//! kvindex-client's `decode` bench measures the wire decoder.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvindex_core::{BlockHash, KvIndex, LocalHash, MatchOptions, PositionalIndex, RadixIndex, StoredBlock, WorkerId};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const WORKERS: u64 = 16;
const CHAIN: usize = 256;

/// `n` chains of `CHAIN` blocks: each shares its first half with chain 0 (a system prompt).
fn chains(n: u64) -> Vec<Vec<StoredBlock>> {
    (0..n)
        .map(|c| {
            let mut prev = 0;
            (0..CHAIN as u64)
                .map(|i| {
                    let id = if i < CHAIN as u64 / 2 { i } else { c * 1_000_000 + i };
                    let l = xxh3_64_with_seed(&id.to_le_bytes(), 1337);
                    prev = if i == 0 { l } else { xxh3_64_with_seed(&[prev.to_le_bytes(), l.to_le_bytes()].concat(), 1337) };
                    StoredBlock::new(prev, l)
                })
                .collect()
        })
        .collect()
}

/// An index where each worker holds 64 of the chains.
fn populated<I: KvIndex>(index: I, chains: &[Vec<StoredBlock>]) -> (I, Vec<I::Writer>) {
    let mut writers = Vec::new();
    for w in 0..WORKERS {
        let mut wr = index.writer(WorkerId::new(w, 0)).unwrap();
        for c in chains.iter().skip(w as usize % 4).step_by(4).take(64) {
            index.store(&mut wr, None, c);
        }
        writers.push(wr);
    }
    (index, writers)
}

fn bench_backend<I: KvIndex>(c: &mut Criterion, make: impl Fn() -> I) {
    let name = make().name();
    let all = chains(257);
    let (index, mut writers) = populated(make(), &all[..256]);
    let fresh = &all[256];
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(CHAIN as u64));
    let hashes: Vec<BlockHash> = fresh.iter().rev().map(|s| s.block_hash).collect();
    // Each store is undone (untimed) before the next, and each remove redone, so every
    // iteration sees the same index.
    g.bench_function(BenchmarkId::new("store_chain", CHAIN), |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                black_box(index.store(&mut writers[0], None, fresh));
                spent += t.elapsed();
                index.remove(&mut writers[0], &hashes);
            }
            spent
        })
    });
    g.bench_function(BenchmarkId::new("remove_chain", CHAIN), |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                index.store(&mut writers[0], None, fresh);
                let t = Instant::now();
                black_box(index.remove(&mut writers[0], &hashes));
                spent += t.elapsed();
            }
            spent
        })
    });
    for (label, q) in [("lookup_shared_prefix", &all[1]), ("lookup_full_match", &all[0])] {
        let query: Vec<LocalHash> = q.iter().map(|s| s.tokens_hash).collect();
        g.bench_function(BenchmarkId::new(label, CHAIN), |b| b.iter(|| index.find_matches(&query, &MatchOptions::default())));
    }
    g.throughput(Throughput::Elements(4));
    let short: Vec<LocalHash> = all[3][..4].iter().map(|s| s.tokens_hash).collect();
    g.bench_function("lookup_short_4", |b| b.iter(|| index.find_matches(&short, &MatchOptions::default())));
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_backend(c, PositionalIndex::default);
    bench_backend(c, || RadixIndex::new(1 << 16, 1 << 16));
}

criterion_group! {
    name = index;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(index);
