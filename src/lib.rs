//! kvindex: a global index of the KV-cache blocks cached on every LLM inference worker,
//! answering "which workers hold the longest prefix of this request?" for KV-aware routers.
//!
//! # Layout
//!
//! - [`hash`]: block identity: local, engine and prefix hashes, worker ids, token hashing.
//! - [`workers`]: interning of worker identities to dense slots, and the slot sets.
//! - [`index`]: the [`index::KvIndex`] trait and its backends (positional, radix, reference).
//! - [`apply`]: the apply pool: one thread owns each worker's writes, queues are bounded.
//! - [`trace`]: Mooncake trace reader and the mock engine that turns it into events.
//! - [`stream`]: the JSONL replay stream format shared by benchmarks and tools.
//! - [`bench`]: `kvindex bench`, the trace-replay benchmark.
//! - [`alloc`]: a counting global allocator, so benchmarks can report index memory.
//!
//! The `kvindex` binary (`src/bin/kvindex.rs`) is a thin CLI over these modules.

pub mod alloc;
pub mod apply;
pub mod bench;
pub mod hash;
pub mod index;
pub mod stream;
pub mod trace;
pub mod workers;
