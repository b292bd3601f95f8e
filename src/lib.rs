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
//! - [`cli`]: the `kvindex` command line (`src/main.rs` only calls it).
//!
//! The index itself is the `kvindex-core` crate; the wire protocol, the publisher and the
//! lookup client are `kvindex-client`; `kvindex bridge` is `kvindex-bridge`; the benchmarks,
//! the demo and the test harness are `kvindex-tools`.

pub mod apply;
pub mod cli;
pub mod config;
pub mod metrics;
pub mod service;
