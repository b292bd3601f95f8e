//! The bridge's decoder on one core: engine batches (vLLM's array events, 16-token blocks)
//! decoded and hashed into kvindex events, in blocks per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvindex_bridge::engine::{decode_batch, Hashing};
use kvindex_bridge::fake::stored_batch;

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("bridge");
    for (events, blocks) in [(1u64, 16u64), (16, 16), (64, 4)] {
        let payload = stored_batch(1.0, 1, events, blocks, 16);
        g.throughput(Throughput::Elements(events * blocks));
        g.bench_with_input(BenchmarkId::new("decode_batch", format!("{events}x{blocks}_blocks")), &payload, |b, p| {
            b.iter(|| decode_batch(p, Hashing { block_size: None }).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
