//! The CLI's tooling: benchmarks, the end-to-end run, the demo and their workload. Part of the
//! binary, not of the library API.
//!
//! - [`trace`]: Mooncake trace reader and the mock engine (LRU prefix caches) that turns a
//!   trace into events.
//! - [`stream`]: the JSONL replay stream format (docs/STREAM.md), converted to and from
//!   the domain event at this edge.
//! - [`flood`]: a hash-flooding workload (keys built to collide without a seed) and its control.
//! - [`bench`]: `kvindex bench`, the trace-replay benchmark of the index backends.
//! - [`keepup`]: `kvindex bench --keep-up`: open-loop runs on the trace's compressed timeline,
//!   drain counted, and where each index stops keeping up.
//! - [`harness`]: a `nats-server` child and an in-process daemon, for `e2e` and the tests.
//! - [`inspect`]: `kvindex workers`, `lookup` and `dump`: the daemon's inspect API from a shell.
//! - [`e2e`]: `kvindex e2e`: NATS, the daemon, mock engines and a router on one machine.
//! - [`demo`]: `kvindex demo`: a closed loop of router, mock engines and kvindex, showing the
//!   prefix-cache hit rate of KV-aware routing against round-robin and random.
//! - [`burst`]: the demo's bursts sharing a new prefix, routed with and without predictions.
//! - [`bridge_bench`]: `kvindex bridge-bench`: an engine's ZMQ socket to applied in kvindex.
//! - [`shard_bench`]: `kvindex shard-bench`: S shards against one daemon on the same stream,
//!   each in its own process (CPU, memory, merged lookups).
//! - `peers`: smg's and NVIDIA Dynamo's indexes behind kvindex's index trait, so `bench`
//!   compares them in one run (only with `--features peers`).
//! - [`alloc`]: a counting global allocator, so benchmarks can report index memory.

pub mod alloc;
pub mod bench;
pub mod bridge_bench;
pub mod burst;
pub mod demo;
pub mod e2e;
pub mod flood;
pub mod harness;
pub mod inspect;
pub mod keepup;
#[cfg(feature = "peers")]
pub mod peers;
pub mod shard_bench;
pub mod stream;
pub mod trace;
