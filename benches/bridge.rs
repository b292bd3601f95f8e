//! The bridge's decoder on one core: engine batches (vLLM's array events, 16-token blocks)
//! decoded and hashed into kvindex events, in blocks per second.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvindex::bridge::engine::{decode_batch, Hashing};
use rmpv::Value;

/// A batch of `events` BlockStored events of `blocks` blocks each, as vLLM sends it.
fn batch(events: u64, blocks: u64, block_size: u64) -> Vec<u8> {
    let evs: Vec<Value> = (0..events)
        .map(|e| {
            let base = e * blocks;
            Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array((base..base + blocks).map(|h| Value::from(h.wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect()),
                if e == 0 { Value::Nil } else { Value::from((base - 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)) },
                Value::Array((0..blocks * block_size).map(|t| Value::from((base * block_size + t) % 32000)).collect()),
                Value::from(block_size),
                Value::Nil,
                Value::from("GPU"),
            ])
        })
        .collect();
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::from(1.0), Value::Array(evs), Value::Nil])).unwrap();
    out
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("bridge");
    for (events, blocks) in [(1u64, 16u64), (16, 16), (64, 4)] {
        let payload = batch(events, blocks, 16);
        g.throughput(Throughput::Elements(events * blocks));
        g.bench_with_input(BenchmarkId::new("decode_batch", format!("{events}x{blocks}_blocks")), &payload, |b, p| {
            b.iter(|| decode_batch(p, Hashing { block_size: None }).unwrap())
        });
    }
    g.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
