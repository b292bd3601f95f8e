//! kvindex-client: what engines and routers link to talk to kvindex over NATS, and nothing
//! heavier (no HTTP server, metrics registry, config layering or CLI).
//!
//! # Layout
//!
//! - [`protocol`]: wire protocol v1 (msgpack): event batches (one-pass, allocation-light
//!   decoder and the writers), lookup requests and answers, resync requests and acks.
//! - [`publisher`]: the engine side: keeps the worker's block set, numbers and batches
//!   events, sends heartbeats, answers kvindex's resync requests with snapshots.
//! - [`lookup`]: the router side: [`LookupClient`] asks kvindex which workers hold the
//!   longest prefix of a request, by tokens or by local hashes, every shard of a sharded
//!   deployment at once.
//! - [`nats`]: how to reach NATS (servers, credentials, TLS), under the configuration keys the
//!   daemon and the bridge share.
//! - [`shards`]: a deployment sharded by worker: the shard that owns a worker (as the NATS
//!   server partitions subjects), and the merge of the shards' answers.
//! - [`error`]: [`ClientError`], what can go wrong talking to NATS and kvindex.
//!
//! Block identity (token hashing, the event type) comes from [`kvindex_core`], re-exported
//! here as [`core`] so that an engine or router needs one dependency.

#![deny(missing_docs)]

pub mod error;
pub mod lookup;
pub mod nats;
pub mod protocol;
pub mod publisher;
pub mod shards;

pub use error::ClientError;
pub use kvindex_core as core;
pub use lookup::{Answer, LookupClient, Query};
pub use protocol::{MatchEntry, Routed, WorkerRef};
pub use publisher::{Publisher, PublisherConfig};
