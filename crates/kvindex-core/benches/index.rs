//! Criterion micro-benchmarks of the index's hot paths: store a chain, remove one, look up a
//! prefix, for the run and positional backends, with 16 workers and with fleets of up to
//! 4096 workers sharing a prefix, or holding each prefix two or three at a time. `kvindex bench` measures whole replays;
//! kvindex-client's `decode` bench measures the wire decoder.

use criterion::measurement::WallTime;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use kvindex_core::{BlockHash, KvIndex, LocalHash, MatchOptions, PositionalIndex, RunIndex, StoredBlock, WorkerId};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64_with_seed;

const WORKERS: u64 = 16;
const CHAIN: usize = 256;

/// `n` chains of `CHAIN` blocks: each shares its first half with chain 0 (a system prompt).
fn chains(n: u64) -> Vec<Vec<StoredBlock>> {
    chains_sharing(n, CHAIN as u64 / 2)
}

/// `n` chains of `CHAIN` blocks, the first `shared` of them the same in every chain.
fn chains_sharing(n: u64, shared: u64) -> Vec<Vec<StoredBlock>> {
    (0..n)
        .map(|c| {
            let mut prev = 0;
            (0..CHAIN as u64)
                .map(|i| {
                    let id = if i < shared { i } else { c * 1_000_000 + i };
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

/// `store_chain` and `remove_chain` of `fresh` by writer `w`, labelled `param`. Each store is
/// undone (untimed) before the next, and each remove redone, so every iteration sees the same
/// index.
fn bench_writes<I: KvIndex>(
    g: &mut BenchmarkGroup<'_, WallTime>,
    param: u64,
    index: &I,
    w: &mut I::Writer,
    fresh: &[StoredBlock],
) {
    let hashes: Vec<BlockHash> = fresh.iter().rev().map(|s| s.block_hash).collect();
    g.bench_function(BenchmarkId::new("store_chain", param), |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                black_box(index.store(w, None, fresh));
                spent += t.elapsed();
                index.remove(w, &hashes);
            }
            spent
        })
    });
    g.bench_function(BenchmarkId::new("remove_chain", param), |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                index.store(w, None, fresh);
                let t = Instant::now();
                black_box(index.remove(w, &hashes));
                spent += t.elapsed();
            }
            spent
        })
    });
}

fn bench_backend<I: KvIndex>(c: &mut Criterion, make: impl Fn() -> I) {
    let name = make().name();
    let all = chains(257);
    let (index, mut writers) = populated(make(), &all[..256]);
    let fresh = &all[256];
    let mut g = c.benchmark_group(name);
    g.throughput(Throughput::Elements(CHAIN as u64));
    bench_writes(&mut g, CHAIN as u64, &index, &mut writers[0], fresh);
    for (label, q) in [("lookup_shared_prefix", &all[1]), ("lookup_full_match", &all[0])] {
        let query: Vec<LocalHash> = q.iter().map(|s| s.tokens_hash).collect();
        g.bench_function(BenchmarkId::new(label, CHAIN), |b| b.iter(|| index.find_matches(&query, &MatchOptions::default())));
    }
    g.throughput(Throughput::Elements(4));
    let short: Vec<LocalHash> = all[3][..4].iter().map(|s| s.tokens_hash).collect();
    g.bench_function("lookup_short_4", |b| b.iter(|| index.find_matches(&short, &MatchOptions::default())));
    g.finish();
}

/// Fleet sizes of the `*_workers` groups.
const FLEETS: [u64; 4] = [16, 256, 1024, 4096];

/// Many workers sharing a prefix: worker `w` holds chain `w`, so every worker holds the
/// shared first half (worker sets of the whole fleet) and a tail of its own. The parameter is
/// the number of workers: a new worker stores and removes a chain, and a lookup that every
/// worker matches halfway answers the daemon's default 64 best.
fn bench_workers<I: KvIndex>(c: &mut Criterion, make: impl Fn() -> I) {
    let mut g = c.benchmark_group(format!("{}_workers", make().name()));
    let all = chains(FLEETS[FLEETS.len() - 1] + 1);
    let fresh = &all[all.len() - 1];
    let query: Vec<LocalHash> = all[1].iter().map(|s| s.tokens_hash).collect();
    let daemon = MatchOptions { max_matches: Some(64), ..Default::default() };
    for &n in &FLEETS {
        let index = make();
        for (w, chain) in all.iter().take(n as usize).enumerate() {
            let mut wr = index.writer(WorkerId::new(w as u64, 0)).unwrap();
            index.store(&mut wr, None, chain);
        }
        let mut newcomer = index.writer(WorkerId::new(n, 0)).unwrap();
        g.throughput(Throughput::Elements(CHAIN as u64));
        bench_writes(&mut g, n, &index, &mut newcomer, fresh);
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("lookup_top64", n), |b| b.iter(|| index.find_matches(&query, &daemon)));
    }
    g.finish();
}

/// The shape of a big fleet's entries (at 1,024 workers, 92% of the Mooncake replay's stores
/// leave an entry with one to three holders): worker `w` holds chain `w % (n / 2)`, so each
/// chain is held by two workers `n / 2` slots apart, in different windows from 256 workers on.
/// A new worker stores and removes chain 0 (three holders while it does), and a lookup of
/// chain 0 answers its two holders.
fn bench_pairs<I: KvIndex>(c: &mut Criterion, make: impl Fn() -> I) {
    let mut g = c.benchmark_group(format!("{}_pairs", make().name()));
    let all = chains_sharing(FLEETS[FLEETS.len() - 1] / 2, 0);
    let query: Vec<LocalHash> = all[0].iter().map(|s| s.tokens_hash).collect();
    for &n in &FLEETS {
        let index = make();
        for w in 0..n {
            let mut wr = index.writer(WorkerId::new(w, 0)).unwrap();
            index.store(&mut wr, None, &all[(w % (n / 2)) as usize]);
        }
        let mut newcomer = index.writer(WorkerId::new(n, 0)).unwrap();
        g.throughput(Throughput::Elements(CHAIN as u64));
        bench_writes(&mut g, n, &index, &mut newcomer, &all[0]);
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("lookup", n), |b| b.iter(|| index.find_matches(&query, &MatchOptions::default())));
    }
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_backend(c, RunIndex::default);
    bench_backend(c, PositionalIndex::default);
    bench_workers(c, RunIndex::default);
    bench_workers(c, PositionalIndex::default);
    bench_pairs(c, RunIndex::default);
    bench_pairs(c, PositionalIndex::default);
}

criterion_group! {
    name = index;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(index);
