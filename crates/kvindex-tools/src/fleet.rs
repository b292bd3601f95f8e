//! The demo's world: its settings, and the fleets of mock engines (LRU prefix caches, requests
//! in service) behind a router that picks a worker by a policy, with what each fleet achieved.

use crate::trace::{PrefixCache, SplitMix64, TraceRequest};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Settings of a demo run.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// An existing NATS server; `None` starts `nats-server` on a free loopback port.
    pub nats_url: Option<String>,
    /// `/metrics` address of a kvindex already serving `prefix` on that NATS; `None` starts
    /// `kvindex serve` in this process.
    pub kvindex_metrics: Option<String>,
    /// Subject prefix of the kvindex the engines feed and the router asks.
    pub prefix: String,
    /// Workers per fleet.
    pub workers: u64,
    /// LRU capacity of each worker, in blocks.
    pub capacity: usize,
    /// Each trace block (512 tokens) becomes this many blocks.
    pub factor: u64,
    /// Timeline compression: 60 plays a minute of the trace per second; 0 as fast as possible.
    pub speed: f64,
    /// Weight of a worker's active blocks against the blocks a request must compute.
    pub load_weight: f64,
    /// Seed of the random policy.
    pub seed: u64,
    /// Play the trace again and again (a load generator for dashboards) until interrupted.
    pub repeat: bool,
    /// How progress is shown.
    pub live: Live,
    /// Run the burst scenario after the trace (with or without predictions).
    pub burst: bool,
    /// Shards of kvindex, each applying its own workers' events (on a NATS server of its own
    /// that partitions them); lookups merged across the shards.
    pub shards: u32,
    /// A Python with kvindex's client installed (`scripts/python-client`): a fleet of its own
    /// is then routed through it. None: no Python fleet.
    pub python: Option<std::path::PathBuf>,
}

/// How a run shows progress while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Live {
    /// A panel redrawn every second (a terminal).
    Panel,
    /// One line every few seconds (logs).
    Lines,
    /// Nothing (tests).
    Off,
}

/// How a fleet's router picks a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Asks kvindex: least (blocks to compute + load weight x active blocks).
    KvAware,
    /// The same, asking kvindex's HTTP query API as a router written against Dynamo's would.
    KvAwareHttp,
    /// The same, asking through kvindex's Python client, as a router written in Python would.
    KvAwarePython,
    /// The same cost, kvindex answering from the router's announcements alone (the fleet's
    /// engines publish no events: approximate mode).
    Approximate,
    /// The same cost, the depths read from the caches themselves.
    Oracle,
    RoundRobin,
    Random,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::KvAware => "kv-aware (kvindex)",
            Policy::KvAwareHttp => "kv-aware, HTTP /query",
            Policy::KvAwarePython => "kv-aware, Python client",
            Policy::Approximate => "kv-aware, no events",
            Policy::Oracle => "oracle (reads caches)",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
        }
    }
}

/// What one fleet achieved.
#[derive(Clone, Debug, Serialize)]
pub struct FleetReport {
    pub policy: Policy,
    /// Cached blocks / requested blocks.
    pub hit_rate: f64,
    /// Prompt tokens not computed thanks to cached prefixes.
    pub prefill_tokens_saved: u64,
    pub requests_per_worker_max: u64,
    pub requests_per_worker_mean: f64,
}

/// Simulated service time: prompt tokens computed per second, tokens decoded per second.
pub const PREFILL_TOKENS_PER_S: f64 = 20_000.0;
const DECODE_TOKENS_PER_S: f64 = 30.0;

/// Worker ids of the approximate fleet: its worker `w` is `APPROXIMATE_BASE + w`, apart from
/// the event-fed fleet's `0..workers`.
pub const APPROXIMATE_BASE: u64 = 1_000_000;

/// One fleet of workers: their caches, their load, what they served.
pub struct Fleet {
    /// How its router picks a worker.
    pub policy: Policy,
    caches: Vec<PrefixCache>,
    /// Requests in service per worker: (end time in trace ms, blocks held).
    running: Vec<BinaryHeap<Reverse<(u64, u64)>>>,
    active_blocks: Vec<u64>,
    /// Requests each worker served.
    pub requests: Vec<u64>,
    requested_blocks: u64,
    hit_blocks: u64,
    saved_tokens: u64,
    clock: u64,
    next: usize,
    rng: SplitMix64,
}

impl Fleet {
    pub fn new(policy: Policy, workers: usize, seed: u64) -> Self {
        Fleet {
            policy,
            caches: (0..workers).map(|_| PrefixCache::default()).collect(),
            running: vec![BinaryHeap::new(); workers],
            active_blocks: vec![0; workers],
            requests: vec![0; workers],
            requested_blocks: 0,
            hit_blocks: 0,
            saved_tokens: 0,
            clock: 0,
            next: 0,
            rng: SplitMix64::new(seed),
        }
    }

    /// Ends the requests finished by `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        for (w, heap) in self.running.iter_mut().enumerate() {
            while let Some(Reverse((end, blocks))) = heap.peek().copied() {
                if end > now_ms {
                    break;
                }
                heap.pop();
                self.active_blocks[w] -= blocks;
            }
        }
    }

    /// The worker of least cost, given each worker's cached depth of the request (`blocks`
    /// long): blocks to compute, plus the load weight times the blocks it holds for requests
    /// in service. Ties go to the lower worker.
    fn cheapest(&self, depth: impl Fn(usize) -> u64, blocks: u64, load_weight: f64) -> usize {
        (0..self.caches.len())
            .map(|w| (w, (blocks - depth(w).min(blocks)) as f64 + load_weight * self.active_blocks[w] as f64))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(0, |(w, _)| w)
    }

    /// Picks a worker for the request of engine hashes `engine`; `depths` are kvindex's
    /// answer, for the kv-aware fleet.
    pub fn choose(&mut self, engine: &[u64], depths: &HashMap<usize, u64>, load_weight: f64) -> usize {
        let n = self.caches.len();
        let blocks = engine.len() as u64;
        match self.policy {
            Policy::KvAware | Policy::KvAwareHttp | Policy::KvAwarePython | Policy::Approximate => {
                self.cheapest(|w| depths.get(&w).copied().unwrap_or(0), blocks, load_weight)
            }
            Policy::Oracle => self.cheapest(|w| self.caches[w].hits(engine) as u64, blocks, load_weight),
            Policy::RoundRobin => {
                self.next = (self.next + 1) % n;
                self.next
            }
            Policy::Random => self.rng.below(n as u64) as usize,
        }
    }

    /// Worker `w` serves the request; returns what its cache did.
    pub fn serve(&mut self, w: usize, req: &TraceRequest, engine: &[u64], cfg: &DemoConfig, now_ms: u64) -> crate::trace::Served {
        let served = self.caches[w].serve(engine, cfg.capacity, &mut self.clock, None);
        let tokens_per_block = 512 / cfg.factor.max(1);
        let (cached, asked) = (served.hit as u64 * tokens_per_block, engine.len() as u64 * tokens_per_block);
        // The trace's prompt length, where given, is what the blocks cover (the last one partly).
        let prompt = if req.input_length > 0 { req.input_length } else { asked };
        let saved = cached.min(prompt);
        let computed = prompt - saved;
        let busy_s = computed as f64 / PREFILL_TOKENS_PER_S + req.output_length as f64 / DECODE_TOKENS_PER_S;
        self.running[w].push(Reverse((now_ms + (busy_s * 1e3) as u64, engine.len() as u64)));
        self.active_blocks[w] += engine.len() as u64;
        self.requests[w] += 1;
        self.requested_blocks += engine.len() as u64;
        self.hit_blocks += served.hit as u64;
        self.saved_tokens += saved;
        served
    }

    /// Cached blocks / requested blocks so far.
    pub fn hit_rate(&self) -> f64 {
        if self.requested_blocks == 0 {
            0.0
        } else {
            self.hit_blocks as f64 / self.requested_blocks as f64
        }
    }

    pub fn report(&self) -> FleetReport {
        let total: u64 = self.requests.iter().sum();
        FleetReport {
            policy: self.policy,
            hit_rate: self.hit_rate(),
            prefill_tokens_saved: self.saved_tokens,
            requests_per_worker_max: self.requests.iter().copied().max().unwrap_or(0),
            requests_per_worker_mean: total as f64 / self.requests.len().max(1) as f64,
        }
    }
}

/// A fleet router's depths, or none when its lookup failed: counted in `errors`, the first
/// failure logged (the fleet is routed by load alone until its index answers).
pub fn depths_or_none(asked: anyhow::Result<HashMap<usize, u64>>, errors: &mut u64, router: &str) -> HashMap<usize, u64> {
    asked.unwrap_or_else(|e| {
        *errors += 1;
        if *errors == 1 {
            tracing::warn!("{router}'s lookup failed ({e:#}); routing its fleet by load alone until it answers");
        }
        HashMap::new()
    })
}
