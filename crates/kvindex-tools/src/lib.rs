//! kvindex-tools: kvindex's development tools, apart from the daemon: benchmarks, the peers'
//! adapters, workload generators, the demo and the end-to-end run. The `kvindex-tools` binary
//! runs them (`kvindex demo`, `bench`, `e2e`, `gen`, `bridge-bench` and `shard-bench` forward
//! to it); the system tests use its harness and workloads as a dev-dependency. Not published.
//!
//! # Layout
//!
//! - [`trace`]: Mooncake trace reader and the mock engine (LRU prefix caches) that turns a
//!   trace into events.
//! - [`stream`]: the JSONL replay stream format (docs/STREAM.md), converted to and from the
//!   domain event at this edge.
//! - [`flood`]: a hash-flooding workload (keys built to collide without a seed) and its control.
//! - [`workload`]: a replay stream or trace loaded once for the benchmarks, and its counts.
//! - [`answering`]: how a benchmark asks an index for its complete answer, each in its own form.
//! - [`bench`]: `bench`, the trace-replay benchmark of the index backends.
//! - [`keepup`]: `bench --keep-up`: open-loop runs on the trace's compressed timeline, drain
//!   counted, and where each index stops keeping up.
//! - [`harness`]: a `nats-server` child, an in-process daemon, HTTP and metric reads.
//! - [`e2e`]: `e2e`: NATS, the daemon, mock engines and a router on one machine.
//! - [`deploy`]: the compose file's command lines, for the tests that check them.
//! - [`fleet`]: the demo's engines and router: LRU caches, routing policies, their reports.
//! - [`demo`]: `demo`: a closed loop of router, mock engines and kvindex, showing the
//!   prefix-cache hit rate of KV-aware routing against round-robin and random.
//! - [`burst`]: the demo's bursts sharing a new prefix, routed with and without predictions.
//! - [`http_router`]: the demo's fleet routed over kvindex's HTTP query API.
//! - [`python_router`]: the demo's fleet routed through kvindex's Python client.
//! - [`bridge_bench`]: `bridge-bench`: an engine's ZMQ socket to applied in kvindex.
//! - [`nats_floor`]: `nats-floor`: a bare NATS request-reply and publish beside a kvindex
//!   lookup and event on the same server: the floor NATS sets, and kvindex's gap to it.
//! - [`dropin`]: `dropin`: kvindex beside Dynamo's standalone indexer on the same vLLM
//!   publishers, every `POST /query` answer checked against the engines.
//! - [`shard_bench`]: `shard-bench`: S shards against one daemon on the same stream, each in
//!   its own process (CPU, memory, merged lookups).
//! - `peers`: smg's and NVIDIA Dynamo's indexes behind kvindex's index trait, so `bench`
//!   compares them in one run (only with `--features peers`).
//! - [`indexers`]: the indexes a benchmark can replay, by name: kvindex's backends and the peers.
//! - [`cli`]: the `kvindex-tools` command line.
//! - [`config_reference`]: docs/CONFIGURATION.md, generated from the settings' code.
//! - [`alloc`]: a counting global allocator, so benchmarks can report index memory.
//! - [`report`]: number formatting shared by the tables.

pub mod alloc;
pub mod answering;
pub mod bench;
pub mod bridge_bench;
pub mod burst;
pub mod cli;
pub mod config_reference;
pub mod demo;
pub mod deploy;
pub mod dropin;
pub mod e2e;
pub mod fleet;
pub mod flood;
pub mod harness;
pub mod http_router;
pub mod indexers;
pub mod keepup;
pub mod nats_floor;
#[cfg(feature = "peers")]
pub mod peers;
pub mod python_router;
pub mod report;
pub mod shard_bench;
pub mod stream;
pub mod trace;
pub mod workload;
