//! Criterion micro-benchmarks of the hot paths: store a chain, remove one, look up a prefix,
//! for the positional and radix backends; and decoding an event batch off the wire.
//! `kvindex bench` measures whole replays.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvindex::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex::index::positional::{PositionalConfig, PositionalIndex};
use kvindex::index::radix::RadixIndex;
use kvindex::index::{KvIndex, MatchOptions};
use kvindex::trace::{mock_block_hash, mock_local_hash};
use std::time::{Duration, Instant};

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
                    let l = mock_local_hash(id);
                    prev = if i == 0 { l } else { mock_block_hash(prev, l) };
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

/// A publisher's full batch: 256 events, three stores of 16-block chains to one removal.
fn bench_decode(c: &mut Criterion) {
    use kvindex::protocol::{decode_batch, encode_batch, BatchHeader, EventBatch, EventData, KvEvent};
    let chains = chains(64);
    let events: Vec<_> = (0..256u64)
        .map(|i| {
            let c = &chains[i as usize % 64];
            let data = if i % 4 == 3 {
                EventData::Removed { hashes: c[..16].iter().map(|b| b.block_hash).collect() }
            } else {
                let k = (i as usize % 14) * 16;
                EventData::Stored { parent: Some(c[k].block_hash), blocks: c[k + 1..k + 17].to_vec(), tier: Default::default() }
            };
            Ok(KvEvent { event_id: i, data })
        })
        .collect();
    let header = BatchHeader { worker_id: 3, epoch: 1, ts_ns: 1, next_event_id: Some(256), ..BatchHeader::default() };
    let batch = EventBatch { header, events };
    let bytes = encode_batch(&batch);
    let mut g = c.benchmark_group("protocol");
    g.throughput(Throughput::Elements(256 * 16));
    g.bench_function("decode_batch_4096_blocks", |b| b.iter(|| decode_batch(black_box(&bytes))));
    g.finish();
}

fn benches(c: &mut Criterion) {
    bench_backend(c, || PositionalIndex::new(PositionalConfig::default()));
    bench_backend(c, || RadixIndex::new(1 << 16, 1 << 16));
    bench_decode(c);
}

criterion_group! {
    name = index;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(index);
