//! kvindex: the daemon that keeps a global index of every cached KV-cache block on every LLM
//! inference worker and answers "which workers hold the longest prefix of this request?" for
//! KV-aware routers. Engines publish KV events to NATS; kvindex applies them; routers ask it
//! over NATS request-reply or HTTP; Prometheus scrapes it.
//!
//! # Layout
//!
//! - [`service`]: `kvindex serve`: start-up and shutdown, each model served (NATS ingest,
//!   sequence tracking, lookups, recovery, JetStream snapshots), the HTTP servers (metrics,
//!   inspect API, query API).
//! - [`apply`]: the apply pool: one thread owns each worker's writes, queues are bounded.
//! - [`config`]: layered configuration (defaults, file, `KVINDEX_*` environment, flags), and
//!   the models one daemon serves.
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
