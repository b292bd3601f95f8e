//! kvindex-core: an exact, concurrent index of the KV-cache blocks cached on LLM inference
//! workers, answering "which workers hold the longest prefix of this request?".
//!
//! No async runtime, no network, no metrics: embed it in a router or gateway process, feed it
//! the engines' KV events, ask it for matches. The `kvindex` daemon is this index behind NATS.
//!
//! # Layout
//!
//! - [`hash`]: block identity: local (token) hashes, the engine's opaque block hashes,
//!   kvindex's rolling prefix hashes, worker identities, token hashing (XXH3-64, seed 1337).
//! - [`event`]: the one domain event type (`stored`, `removed`, `cleared`) that the wire
//!   decoder, the replay stream and the benchmarks convert into.
//! - [`digest`]: an order-independent digest of a worker's blocks, kept by the index and by
//!   publishers alike, so that drift between them shows.
//! - `fault` (feature `fault-injection`, test builds only): a block lost on purpose, for the
//!   replicas' digest tests.
//! - [`seeded`]: hashing keyed with a per-process random seed, for every table keyed by
//!   values that publishers or routers choose (hash-flooding resistance).
//! - [`names`]: what a publisher says its engine is (name, URL, model, block size), and the
//!   worker id a name stands for.
//! - [`workers`]: interning of worker identities to dense slots, and the slot sets.
//! - [`announced`]: placements a router announces, per worker, under an LRU bound and a TTL
//!   (predictions beside the held blocks, and approximate mode for engines without events).
//! - [`hybrid`]: hybrid models' rule: what a KV-cache group of each kind needs of a prefix,
//!   and how deep all of a worker's groups can serve one.
//! - [`groups`]: hybrid models' other KV-cache groups (sliding-window, state layers) beside
//!   the primary one, kept for lookups.
//! - [`tiers`]: host and disk tiers, each with an index of its own beside the device index.
//! - [`index`]: the [`KvIndex`] trait and its backends: [`RunIndex`] (the default),
//!   [`PositionalIndex`] and the [`ReferenceIndex`] model the tests compare both against.
//! - [`model`]: a deployment's view of one model, composed: the device index, the tiers, the
//!   groups and the predictions behind one `apply` of a worker's events and one `answer` to a
//!   lookup (what the daemon runs; an embedder answers what the daemon answers).
//!
//! # Guarantees
//!
//! A worker's match depth is the length of the longest *contiguous* prefix of the request it
//! holds, compared by whole-prefix hash: holding the same block under another parent does not
//! count, and a removed block in the middle ends the match there.
//!
//! # Example
//!
//! A worker caches three blocks of a request; a router asks who holds its prefix.
//!
//! ```
//! use kvindex_core::{local_hashes, BlockHash, KvIndex, MatchOptions, RunIndex, StoredBlock, WorkerId};
//!
//! let index = RunIndex::default();
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

#![deny(missing_docs)]

pub mod announced;
pub mod digest;
pub mod event;
#[cfg(feature = "fault-injection")]
mod fault;
pub mod groups;
pub mod hash;
pub mod hybrid;
pub mod index;
pub mod model;
pub mod names;
pub mod seeded;
mod sync;
pub mod tiers;
pub mod workers;

pub use event::{Event, Tier};
pub use groups::{GroupKind, Groups};
pub use hash::{local_hashes, BlockHash, LocalHash, PrefixHash, StoredBlock, WorkerId};
pub use index::positional::{PositionalConfig, PositionalIndex};
pub use index::reference::ReferenceIndex;
pub use index::runs::{RunConfig, RunIndex};
pub use index::{ApplyOutcome, Backend, DepthGroups, IndexStats, KvIndex, MatchOptions, WorkerMatch};
pub use model::{Answer, Depths, Model, Writers};
