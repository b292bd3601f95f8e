//! Criterion micro-benchmarks of the hot paths' first step: decoding an event batch, and a
//! lookup request, off the wire.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvindex_client::core::{Event, StoredBlock, Tier};
use kvindex_client::protocol::{decode_batch, encode_batch, BatchHeader, EventBatch, KvEvent, LookupRequest};

/// 64 chains of 256 blocks with well-spread hashes.
fn chains() -> Vec<Vec<StoredBlock>> {
    let mix = |x: u64| x.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (x >> 29);
    (0..64u64).map(|c| (0..256u64).map(|i| StoredBlock::new(mix(c << 32 | i), mix(i))).collect()).collect()
}

/// A publisher's full batch: 256 events, three stores of 16-block chains to one removal.
fn bench_decode(c: &mut Criterion) {
    let chains = chains();
    let events: Vec<_> = (0..256u64)
        .map(|i| {
            let c = &chains[i as usize % 64];
            let data = if i % 4 == 3 {
                Event::Removed { hashes: c[..16].iter().map(|b| b.block_hash).collect(), tier: Tier::Device }
            } else {
                let k = (i as usize % 14) * 16;
                Event::Stored { parent: Some(c[k].block_hash), blocks: c[k + 1..k + 17].to_vec(), tier: Tier::Device }
            };
            Ok(KvEvent { event_id: i, data })
        })
        .collect();
    let header = BatchHeader { worker_id: 3, epoch: 1, ts_ns: 1, next_event_id: Some(256), ..BatchHeader::default() };
    let batch = EventBatch { header, worker: None, events };
    let bytes = encode_batch(&batch);
    let mut g = c.benchmark_group("protocol");
    g.throughput(Throughput::Elements(256 * 16));
    g.bench_function("decode_batch_4096_blocks", |b| b.iter(|| decode_batch(black_box(&bytes))));
    g.finish();
}

/// A router's lookup of a 4,096-token prompt (256 blocks of 16), and of its 256 local hashes.
fn bench_lookup_request(c: &mut Criterion) {
    let mut g = c.benchmark_group("protocol");
    let by_tokens = serde_json::json!({"tokens": (0..4096u32).collect::<Vec<_>>(), "block_size": 16, "max_matches": 64});
    let by_hashes =
        serde_json::json!({"block_hashes": (0..256u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect::<Vec<_>>()});
    for (name, req) in [("decode_lookup_4096_tokens", by_tokens), ("decode_lookup_256_hashes", by_hashes)] {
        let bytes = rmp_serde::to_vec_named(&req).expect("msgpack");
        g.bench_function(name, |b| b.iter(|| LookupRequest::decode(black_box(&bytes))));
    }
    g.finish();
}

criterion_group! {
    name = decode;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = bench_decode, bench_lookup_request
}
criterion_main!(decode);
