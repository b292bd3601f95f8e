//! Criterion benchmarks of hybrid models' groups: a lookup of a fleet whose workers all hold a
//! sliding-window group and a Mamba group beside their full-attention chains, against the same
//! lookup of the same fleet without groups; and a request's apply cost with and without groups.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvindex_core::groups::{GroupKind, Groups};
use kvindex_core::{BlockHash, KvIndex, LocalHash, MatchOptions, RunIndex, StoredBlock, WorkerId};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Blocks per request.
const CHAIN: usize = 256;
/// Blocks a sliding window needs (a 128-token window over 16-token blocks).
const WINDOW: GroupKind = GroupKind::Window { blocks: 8 };

/// `n` chains of `CHAIN` blocks, each sharing its first half with the others (a system prompt).
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

/// What vLLM keeps of a request in a window group (the last 64 blocks) and a Mamba group (a
/// checkpoint every 16 blocks and the last state).
fn kept(chain: &[StoredBlock]) -> (Vec<BlockHash>, Vec<BlockHash>) {
    let window = chain[CHAIN - 64..].iter().map(|b| b.block_hash).collect();
    let state = chain.iter().enumerate().filter(|(i, _)| i % 16 == 15).map(|(_, b)| b.block_hash).collect();
    (window, state)
}

/// The time `work` takes on `state`, `iters` times, each after an untimed `undo`.
fn undone<S, A, B>(iters: u64, state: &mut S, undo: impl Fn(&mut S) -> A, work: impl Fn(&mut S) -> B) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        undo(state);
        let t = Instant::now();
        black_box(work(state));
        spent += t.elapsed();
    }
    spent
}

fn benches(c: &mut Criterion) {
    let mut g = c.benchmark_group("groups");
    for n in [16u64, 256] {
        let all = chains(n + 1);
        let (plain, main) = (RunIndex::default(), RunIndex::default());
        let groups = Groups::new(RunIndex::default());
        for (w, chain) in all.iter().take(n as usize).enumerate() {
            let id = WorkerId::new(w as u64, 0);
            let mut pw = plain.writer(id).unwrap();
            plain.store(&mut pw, None, chain);
            let (mut mw, mut gw) = (main.writer(id).unwrap(), groups.writer(id));
            main.store(&mut mw, None, chain);
            groups.primary_stored(&mut gw, None, chain);
            let (window, state) = kept(chain);
            groups.store(&mut gw, 1, WINDOW, &window);
            groups.store(&mut gw, 2, GroupKind::State, &state);
        }
        // A request sharing chain 1 to its end: every worker matches its first half, worker 1 all of it.
        let query: Vec<LocalHash> = all[1].iter().map(|s| s.tokens_hash).collect();
        let top = MatchOptions { max_matches: Some(64), ..Default::default() };
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("lookup_without_groups", n), |b| {
            b.iter(|| plain.find_matches(black_box(&query), &top))
        });
        g.bench_function(BenchmarkId::new("lookup_with_groups", n), |b| {
            b.iter(|| {
                let mut m = main.find_matches(black_box(&query), &MatchOptions::default());
                groups.limit(&query, &mut m);
                m.truncate(64);
                m
            })
        });
        // A new worker's request, undone (untimed) each time: into the primary index alone, and
        // through every group beside it.
        let fresh = &all[n as usize];
        let (window, state) = kept(fresh);
        let id = WorkerId::new(n, 0);
        let mut pw = plain.writer(id).unwrap();
        g.throughput(Throughput::Elements(CHAIN as u64));
        g.bench_function(BenchmarkId::new("apply_primary", n), |b| {
            b.iter_custom(|iters| undone(iters, &mut pw, |pw| plain.clear(pw), |pw| plain.store(pw, None, fresh)))
        });
        let (mut mw, mut gw) = (main.writer(id).unwrap(), groups.writer(id));
        main.store(&mut mw, None, fresh);
        g.throughput(Throughput::Elements((CHAIN + window.len() + state.len()) as u64));
        g.bench_function(BenchmarkId::new("apply_request", n), |b| {
            b.iter_custom(|iters| {
                undone(
                    iters,
                    &mut gw,
                    |gw| groups.clear(gw),
                    |gw| {
                        groups.primary_stored(gw, None, fresh);
                        groups.store(gw, 1, WINDOW, &window);
                        groups.store(gw, 2, GroupKind::State, &state)
                    },
                )
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = groups;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(groups);
