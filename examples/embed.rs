//! The index in your own process, no NATS: a gateway that receives its engines' KV events
//! itself applies them and asks for the best worker before routing.
//!
//! `cargo run --example embed`

use kvindex_core::{local_hashes, BlockHash, Event, KvIndex, MatchOptions, RunIndex, StoredBlock, WorkerId};

const BLOCK_SIZE: usize = 16;

fn main() {
    let index = RunIndex::default();
    // A writer per worker: its reverse map (engine hash -> place). Own it on one thread.
    let mut gpu0 = index.writer(WorkerId::new(0, 0)).expect("a free worker slot");
    let mut gpu1 = index.writer(WorkerId::new(1, 0)).expect("a free worker slot");

    // Two requests share a 48-token system prompt, then differ.
    let system: Vec<u32> = (0..48).collect();
    let req_a: Vec<u32> = system.iter().copied().chain(100..132).collect();
    let req_b: Vec<u32> = system.iter().copied().chain(200..232).collect();
    let blocks_of = |tokens: &[u32], salt: u64| -> Vec<StoredBlock> {
        local_hashes(tokens, BLOCK_SIZE, None, None)
            .into_iter()
            .enumerate()
            // The engine's own block hashes are opaque to kvindex: any scheme will do.
            .map(|(i, l)| StoredBlock { block_hash: BlockHash(salt + i as u64), tokens_hash: l })
            .collect()
    };

    // Worker 0 served request A (all 5 blocks); worker 1 served request B, then evicted its
    // last block. Events arrive as the engines send them: apply each through its writer.
    let a = blocks_of(&req_a, 1000);
    let b = blocks_of(&req_b, 2000);
    Event::Stored { parent: None, blocks: a, tier: Default::default() }.apply_to(&index, &mut gpu0);
    Event::Stored { parent: None, blocks: b.clone(), tier: Default::default() }.apply_to(&index, &mut gpu1);
    Event::Removed { hashes: vec![b[4].block_hash], tier: Default::default() }.apply_to(&index, &mut gpu1);

    // A new request: the system prompt, then request B's continuation.
    let incoming = local_hashes(&req_b, BLOCK_SIZE, None, None);
    for m in index.find_matches(&incoming, &MatchOptions::default()) {
        println!("worker {} holds the first {} of {} blocks", m.worker, m.blocks, incoming.len());
    }
    let stats = index.stats();
    println!("index: {} placements, {} entries, {} workers", stats.placements, stats.entries, stats.workers);
}
