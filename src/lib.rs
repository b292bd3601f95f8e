//! kvindex: the daemon that keeps a global index of every cached KV-cache block on every LLM
//! inference worker and answers "which workers hold the longest prefix of this request?" for
//! KV-aware routers. Engines publish KV events to NATS; kvindex applies them; routers ask it
//! over NATS request-reply; Prometheus scrapes it.
//!
//! # Layout
//!
//! - [`service`]: `kvindex serve`: start-up and shutdown, NATS ingest (batches, sequence
//!   tracking), lookups, recovery (resync, readiness, TTL, reconnects), JetStream snapshots,
//!   HTTP.
//! - [`apply`]: the apply pool: one thread owns each worker's writes, queues are bounded.
//! - [`config`]: layered configuration (defaults, file, `KVINDEX_*` environment, flags).
//! - [`metrics`]: the Prometheus metrics.
//! - [`bridge`]: `kvindex bridge`: the sidecar that turns an engine's ZMQ KV events (vLLM,
//!   SGLang, TensorRT-LLM) into kvindex's protocol.
//!
//! The index itself is the `kvindex-core` crate; the wire protocol, the publisher and the
//! lookup client are `kvindex-client`. The binary (`src/main.rs`) is a thin CLI over this
//! library plus its tooling in `src/tools/` (benchmarks, the end-to-end run, the mock engine),
//! which is not library API.

pub mod apply;
pub mod bridge;
pub mod config;
pub mod metrics;
pub mod service;
