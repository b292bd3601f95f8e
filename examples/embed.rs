//! The index in your own process, no NATS: a gateway that receives its engines' KV events
//! itself applies them to a `Model` (what `kvindex serve` runs) and asks it for the best
//! worker before routing.
//!
//! `cargo run --example embed`

use kvindex_core::model::{AnnounceConfig, Answer, Model, Writers};
use kvindex_core::{local_hashes, BlockHash, Event, MatchOptions, RunIndex, StoredBlock, Tier, WorkerId};

const BLOCK_SIZE: usize = 16;

fn main() {
    // The device index, the host and disk tiers, hybrid groups and routers' predictions, each
    // held by a run index; announcements held for 5 s.
    let announcing = AnnounceConfig {
        predicted_capacity: 65_536,
        predicted_total: 1 << 20,
        predicted_ttl_ms: 5_000,
        routed_only: Default::default(),
        routed_only_capacity: 65_536,
        routed_only_ttl_ms: 120_000,
    };
    let model = Model::complete(RunIndex::default, announcing);
    // The write state of the workers: every event of a worker goes through the same Writers.
    let mut writers = Writers::default();

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
    // last block. Events arrive as the engines send them.
    let (gpu0, gpu1) = (WorkerId::new(0, 0), WorkerId::new(1, 0));
    let b = blocks_of(&req_b, 2000);
    let stored = |blocks| Event::Stored { parent: None, blocks, tier: Tier::Device };
    model.apply(&mut writers, gpu0, &[stored(blocks_of(&req_a, 1000))]).expect("a free worker slot");
    let evicted = Event::Removed { hashes: vec![b[4].block_hash], tier: Tier::Device };
    model.apply(&mut writers, gpu1, &[stored(b), evicted]).expect("a free worker slot");
    // The router sent request B to worker 2 a moment ago: its engine has not said so yet.
    let incoming = local_hashes(&req_b, BLOCK_SIZE, None, None);
    model.announce(&mut writers, WorkerId::new(2, 0), &incoming);

    // A new request: the system prompt, then request B's continuation.
    let mut answer = Answer::default();
    model.answer(&incoming, &MatchOptions::default(), &[Tier::Device], &(), &mut answer);
    for (depths, workers) in answer.groups() {
        let predicted = depths.predicted.map_or(String::new(), |p| format!(" (announced: {p})"));
        let names: Vec<String> = workers.iter().map(|w| w.to_string()).collect();
        println!("workers {}: {} of {} blocks{predicted}", names.join(", "), depths.blocks, incoming.len());
    }
}
