//! A model engine for recovery tests: a prefix cache over a tiny token alphabet (so workers
//! share prefixes), storing chains under random held blocks and evicting leaves when full,
//! as engines do. It reports through a real `Publisher`, and it is the truth lookups are
//! checked against.

use kvindex_client::protocol::{LookupRequest, LookupResponse, MatchEntry};
use kvindex_client::publisher::Publisher;
use kvindex_core::hash::{BlockHash, StoredBlock};
use std::collections::BTreeMap;

/// Local hashes are drawn from `0..ALPHABET`.
pub const ALPHABET: u64 = 3;

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The engine's block hash of local hash `l` under `parent`: the same prefix always gets the
/// same hash, on every worker (as vLLM's are).
pub fn block_hash(parent: Option<BlockHash>, l: u64) -> BlockHash {
    BlockHash(mix(parent.map_or(1, |p| p.0).wrapping_mul(31).wrapping_add(l)))
}

#[derive(Clone)]
pub struct ModelEngine {
    pub worker_id: u64,
    rng: u64,
    capacity: usize,
    /// One step in `reset_every` drops the whole cache (0: never).
    reset_every: u64,
    /// Held blocks: parent and local hash (ordered, so a seed replays the same steps).
    blocks: BTreeMap<BlockHash, (Option<BlockHash>, u64)>,
    children: BTreeMap<BlockHash, usize>,
}

impl ModelEngine {
    pub fn new(worker_id: u64, seed: u64, capacity: usize) -> Self {
        ModelEngine {
            worker_id,
            rng: mix(seed ^ worker_id),
            capacity,
            reset_every: 500,
            blocks: BTreeMap::new(),
            children: BTreeMap::new(),
        }
    }

    /// The same engine, never resetting its cache.
    pub fn without_resets(self) -> Self {
        ModelEngine { reset_every: 0, ..self }
    }

    fn rand(&mut self, n: u64) -> u64 {
        self.rng = mix(self.rng);
        self.rng % n.max(1)
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// One engine step: cache a chain under a random held block (or at the root), evicting
    /// leaves beyond capacity; now and then a full cache reset.
    pub fn step(&mut self, p: &Publisher) {
        if self.reset_every > 0 && self.rand(self.reset_every) == 0 {
            self.blocks.clear();
            self.children.clear();
            p.cleared();
            return;
        }
        let mut parent = if self.blocks.is_empty() || self.rand(4) == 0 {
            None
        } else {
            let i = self.rand(self.blocks.len() as u64) as usize;
            self.blocks.keys().nth(i).copied()
        };
        // Walk down through blocks already held, then store the new rest as one chain.
        let len = 1 + self.rand(5);
        let mut chain = Vec::new();
        let chain_parent = {
            let mut first_new = None;
            for _ in 0..len {
                let l = self.rand(ALPHABET);
                let h = block_hash(parent, l);
                if first_new.is_none() && self.blocks.contains_key(&h) {
                    parent = Some(h);
                    continue;
                }
                if first_new.is_none() {
                    first_new = Some(parent);
                }
                chain.push(StoredBlock { block_hash: h, tokens_hash: kvindex_core::hash::LocalHash(l) });
                self.blocks.insert(h, (parent, l));
                if let Some(par) = parent {
                    *self.children.entry(par).or_default() += 1;
                }
                parent = Some(h);
            }
            first_new.flatten()
        };
        if !chain.is_empty() {
            p.stored(chain_parent, &chain);
        }
        self.evict(p);
    }

    fn evict(&mut self, p: &Publisher) {
        let mut removed = Vec::new();
        while self.blocks.len() > self.capacity {
            let leaves: Vec<BlockHash> =
                self.blocks.keys().filter(|h| self.children.get(h).copied().unwrap_or(0) == 0).copied().collect();
            let victim = leaves[self.rand(leaves.len() as u64) as usize];
            let (parent, _) = self.blocks.remove(&victim).expect("a held leaf");
            if let Some(par) = parent {
                *self.children.get_mut(&par).expect("parent counted") -= 1;
            }
            self.children.remove(&victim);
            removed.push(victim);
        }
        if !removed.is_empty() {
            p.removed(&removed);
        }
    }

    /// Contiguous blocks of `locals` this engine holds from the start.
    pub fn prefix_len(&self, locals: &[u64]) -> u32 {
        let mut parent = None;
        let mut n = 0;
        for &l in locals {
            let h = block_hash(parent, l);
            if !self.blocks.contains_key(&h) {
                break;
            }
            parent = Some(h);
            n += 1;
        }
        n
    }
}

/// Every query of up to `depth` blocks over the alphabet that starts at the root.
pub fn all_queries(depth: usize) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    let mut frontier = vec![Vec::new()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for q in &frontier {
            for l in 0..ALPHABET {
                let mut q2: Vec<u64> = q.clone();
                q2.push(l);
                next.push(q2);
            }
        }
        out.extend(next.iter().cloned());
        frontier = next;
    }
    out
}

/// What a lookup of `q` must answer: every engine holding its first block, deepest first,
/// none stale.
pub fn truth<'a>(engines: impl IntoIterator<Item = &'a ModelEngine>, q: &[u64]) -> Vec<MatchEntry> {
    let mut m: Vec<MatchEntry> = engines
        .into_iter()
        .map(|e| MatchEntry {
            worker_id: e.worker_id,
            dp_rank: 0,
            blocks: e.prefix_len(q),
            stale: false,
            tiers: Default::default(),
            ..Default::default()
        })
        .filter(|m| m.blocks > 0)
        .collect();
    m.sort_by(|a, b| b.blocks.cmp(&a.blocks).then(a.worker_id.cmp(&b.worker_id)));
    m
}

/// The daemon's answer to `q`, in the same order as [`truth`]; `None` if it did not answer.
pub async fn ask(client: &async_nats::Client, subject: &str, q: &[u64]) -> Option<Vec<MatchEntry>> {
    let req = LookupRequest { block_hashes: Some(q.to_vec()), ..Default::default() };
    let payload = rmp_serde::to_vec_named(&req).ok()?;
    let reply = tokio::time::timeout(std::time::Duration::from_secs(2), client.request(subject.to_string(), payload.into()))
        .await
        .ok()?
        .ok()?;
    match rmp_serde::from_slice(&reply.payload).ok()? {
        LookupResponse::Matches { mut matches, .. } => {
            matches.sort_by(|a: &MatchEntry, b: &MatchEntry| b.blocks.cmp(&a.blocks).then(a.worker_id.cmp(&b.worker_id)));
            Some(matches)
        }
        LookupResponse::Error { .. } => None,
    }
}

/// The first query whose answer differs from the truth, with both answers; `None` when all agree.
pub async fn first_difference(
    client: &async_nats::Client,
    subject: &str,
    engines: &[ModelEngine],
    queries: &[Vec<u64>],
) -> Option<(Vec<u64>, Vec<MatchEntry>, Option<Vec<MatchEntry>>)> {
    for q in queries {
        let want = truth(engines, q);
        let got = ask(client, subject, q).await;
        if got.as_ref() != Some(&want) {
            return Some((q.clone(), want, got));
        }
    }
    None
}
