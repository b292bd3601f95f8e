//! kvindex: a global index of the KV-cache blocks cached on every LLM inference worker,
//! answering "which workers hold the longest prefix of this request?" for KV-aware routers.
//!
//! # Layout
//!
//! - [`hash`]: block identity: local, engine and prefix hashes, worker ids, token hashing.
//! - [`workers`]: interning of worker identities to dense slots, and the slot sets.
//! - [`index`]: the [`index::KvIndex`] trait and its backends (positional, radix, reference).
//! - [`protocol`]: wire protocol v1 (msgpack): event batches, lookup requests and answers.
//! - [`publisher`]: the engine side: block set, batching, heartbeats, snapshots on resync.
//! - [`service`]: `kvindex serve`: NATS ingest, lookups, recovery (resync, readiness, TTL), HTTP.
//! - [`config`]: layered configuration (defaults, file, environment, flags).
//! - [`metrics`]: the Prometheus metrics.
//! - [`apply`]: the apply pool: one thread owns each worker's writes, queues are bounded.
//! - [`trace`]: Mooncake trace reader and the mock engine that turns it into events.
//! - [`stream`]: the JSONL replay stream format shared by benchmarks and tools.
//! - [`bench`]: `kvindex bench`, the trace-replay benchmark.
//! - [`e2e`]: `kvindex e2e`: NATS, the daemon, mock engines and a router on one machine.
//! - [`alloc`]: a counting global allocator, so benchmarks can report index memory.
//!
//! The `kvindex` binary (`src/bin/kvindex.rs`) is a thin CLI over these modules.
//!
//! # Example
//!
//! A worker caches three blocks of a request; a router asks who holds its prefix.
//!
//! ```
//! use kvindex::hash::{local_hashes, BlockHash, StoredBlock, WorkerId};
//! use kvindex::index::positional::{PositionalConfig, PositionalIndex};
//! use kvindex::index::{KvIndex, MatchOptions};
//!
//! let index = PositionalIndex::new(PositionalConfig::default());
//! let tokens: Vec<u32> = (0..64).collect();
//! let locals = local_hashes(&tokens, 16, None, None); // four full blocks
//!
//! // The engine reports the first three blocks, under its own block hashes.
//! let mut writer = index.writer(WorkerId::new(7, 0)).unwrap();
//! let blocks: Vec<StoredBlock> =
//!     locals[..3].iter().enumerate().map(|(i, l)| StoredBlock { block_hash: BlockHash(100 + i as u64), tokens_hash: *l }).collect();
//! index.store(&mut writer, None, &blocks);
//!
//! let matches = index.find_matches(&locals, &MatchOptions::default());
//! assert_eq!(matches[0].worker, WorkerId::new(7, 0));
//! assert_eq!(matches[0].blocks, 3);
//! ```

pub mod alloc;
pub mod apply;
pub mod bench;
pub mod config;
pub mod e2e;
pub mod hash;
pub mod index;
pub mod metrics;
pub mod protocol;
pub mod publisher;
pub mod service;
pub mod stream;
pub mod trace;
pub mod workers;
