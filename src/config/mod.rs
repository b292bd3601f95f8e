//! Configuration, layered: built-in defaults < `config/kvindex.toml` (or
//! `--config FILE`) < `KVINDEX_*` environment < command-line flags; [`models`]: the models one
//! daemon serves, each with its own keys over the daemon's.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Map};
use figment::{Figment, Metadata, Profile, Provider};
use kvindex_client::nats::NatsSettings;
use kvindex_client::protocol::check_prefix;
use kvindex_core::index::positional::PositionalConfig;
use kvindex_core::index::runs::RunConfig;
use kvindex_core::index::Backend;
use kvindex_core::model::{AnnounceConfig, RoutedOnly};
use serde::{Deserialize, Serialize};
use std::path::Path;

mod models;
pub use models::{ModelTable, DEFAULT_MODEL};

/// Where the daemon reads events from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ingest {
    /// A core NATS subscription (the default): nothing is kept.
    Core,
    /// An ordered consumer of a JetStream stream that keeps the events.
    Jetstream,
}

/// Everything `kvindex serve` can be told. Every field has a default; `config/kvindex.toml`
/// lists them all with comments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Where NATS is: servers, credentials, TLS (`nats_*` keys).
    #[serde(flatten)]
    pub nats: NatsSettings,
    /// Subject prefix: one per model or deployment.
    pub prefix: String,
    /// Shards of the deployment: each applies the events of its own workers, as the NATS
    /// server's subject mapping partitions them (1: one index holds every worker).
    pub shards: u32,
    /// This daemon's shard, from 0 (below `shards`).
    pub shard: u32,
    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub metrics_addr: String,
    /// Where the inspect API (`/v1/workers`, `/v1/lookup`, a worker's blocks) is served; empty:
    /// not served. Loopback by default: it shows every worker's state and blocks.
    pub inspect_addr: String,
    /// A bearer token the inspect API requires (`Authorization: Bearer <token>`); none: open to
    /// whoever reaches `inspect_addr`.
    pub inspect_token: Option<String>,
    /// Where the query API for routers is served (`/query`, `/query_by_hash`, `/workers`,
    /// `/health`: the shape of Dynamo's standalone indexer and Mooncake's indexer API); empty:
    /// not served.
    pub query_addr: String,
    /// A bearer token the query API requires; none: open to whoever reaches `query_addr`.
    pub query_token: Option<String>,
    /// The largest query API request body, in bytes.
    pub query_max_body: usize,
    /// Most token ids or block hashes one query API request may carry.
    pub query_max_tokens: usize,
    /// Tokens per block of the model's engines, what `/query` hashes token ids with; none: the
    /// block size its named workers announce.
    pub block_size: Option<u32>,
    /// Several models in one daemon: a `[[models]]` table each, with its `name`, its `prefix` and
    /// the keys it sets for itself (`block_size`, bounds, `shards`, `ingest`, ...); none: one
    /// model, `default`, on `prefix`.
    pub models: Vec<ModelTable>,
    /// Apply threads (0: one per core, less one for NATS and lookups, at least one).
    pub apply_threads: usize,
    /// Threads that answer lookups, apart from ingest's (0: one per four cores, at least one).
    pub lookup_threads: usize,
    /// Batches queued per apply thread before ingest waits (backpressure).
    pub queue_capacity: usize,
    /// Messages the events subscription buffers; past it NATS drops some (a slow consumer) and
    /// every worker is marked stale and asked to resync.
    pub subscription_capacity: usize,
    /// Seconds without a batch (events or heartbeat) after which a worker is dropped (0: never).
    pub worker_ttl: u64,
    /// Seconds a placement a router announced on `{prefix}.routed` is held as predicted, until
    /// the engine's events show it (0: predictions are not kept).
    pub predicted_ttl: f64,
    /// The most predicted blocks one worker holds (least recently announced go first).
    pub predicted_max_blocks: u64,
    /// The most predicted blocks all workers hold together; past it announcements are refused.
    pub predicted_max_total: u64,
    /// Routed-only workers (approximate mode): engines that publish no events, whose blocks are
    /// what routers announce for them. Their matches are flagged `approximate`.
    pub routed_only_workers: Vec<u64>,
    /// Every worker of this prefix is routed-only.
    pub routed_only_all: bool,
    /// The most blocks a routed-only worker holds: its engine's prefix cache, in blocks.
    pub routed_only_capacity: u64,
    /// Seconds a routed-only worker's block is held after its last announcement.
    pub routed_only_ttl: f64,
    /// Where events are read from: `core` (a NATS subscription; a restart rebuilds from the
    /// publishers) or `jetstream` (a stream that keeps them; a restart needs no publisher).
    pub ingest: Ingest,
    /// JetStream mode: the stream over `{prefix}.events.>` (created if missing; empty: the
    /// prefix upper-cased with `_EVENTS`).
    pub stream: String,
    /// JetStream mode: seconds an event is kept (a worker whose events aged out is resynced).
    pub stream_max_age: u64,
    /// JetStream mode: bytes the stream keeps at most (the oldest events go first).
    pub stream_max_bytes: i64,
    /// JetStream mode: copies of the stream (1, or 3 in a NATS cluster).
    pub stream_replicas: usize,
    /// JetStream mode: the replica holding the lease (KV bucket `{stream}_LEASE`) writes the
    /// index to the object store `{stream}_SNAPSHOTS` every this many seconds (0: never by time).
    pub snapshot_interval: u64,
    /// JetStream mode: a snapshot is also written after this many stream messages (0: never by
    /// count).
    pub snapshot_events: u64,
    /// JetStream mode: snapshots kept in the object store (the newest first).
    pub snapshot_keep: usize,
    /// Index backend.
    pub backend: Backend,
    /// Jump of the positional index's search.
    pub jump: usize,
    /// Deepest block position accepted.
    pub max_depth: u32,
    /// Most (worker, dp rank) pairs tracked at once.
    pub max_workers: u32,
    /// Most dp ranks tracked per worker id: one publisher cannot take every worker slot.
    pub max_dp_ranks: u32,
    /// Most blocks one worker (and dp rank) holds in a tier: past it, stored blocks are
    /// refused, counted and logged, and the worker is flagged stale.
    pub max_blocks_per_worker: u64,
    /// Seconds before a stale worker that has not resynced is asked again; the wait doubles
    /// with each unanswered request, up to `resync_max_interval`.
    pub resync_interval: u64,
    /// The longest wait, in seconds, between two resync requests to one stale worker.
    pub resync_max_interval: u64,
    /// Seconds of publisher time between two checkpoints of a worker that replicas of this
    /// prefix (and shard) compare on `{prefix}.replicas`: a difference is drift, resynced (0:
    /// replicas do not compare).
    pub replica_check_interval: u64,
    /// After a broadcast resync (start, NATS reconnect), `/readyz` waits for the publishers'
    /// snapshots until none has been open or begun for this many milliseconds...
    pub ready_settle_ms: u64,
    /// ...or at most this many seconds after the broadcast.
    pub ready_timeout: u64,
    /// Seconds a shutdown may take to apply queued events and answer lookups in flight; past
    /// it the process exits anyway.
    pub shutdown_grace: u64,
}

impl Default for Config {
    fn default() -> Self {
        let index = PositionalConfig::default();
        Config {
            nats: NatsSettings::default(),
            prefix: "kv".into(),
            shards: 1,
            shard: 0,
            metrics_addr: "0.0.0.0:9464".into(),
            inspect_addr: "127.0.0.1:9466".into(),
            inspect_token: None,
            query_addr: String::new(),
            query_token: None,
            query_max_body: 16 << 20,
            query_max_tokens: 1 << 20,
            block_size: None,
            models: Vec::new(),
            apply_threads: 0,
            lookup_threads: 0,
            queue_capacity: 1024,
            subscription_capacity: 65536,
            worker_ttl: 30,
            predicted_ttl: 5.0,
            predicted_max_blocks: 65_536,
            predicted_max_total: 1 << 20,
            routed_only_workers: Vec::new(),
            routed_only_all: false,
            routed_only_capacity: 65_536,
            routed_only_ttl: 120.0,
            ingest: Ingest::Core,
            stream: String::new(),
            stream_max_age: 3600,
            stream_max_bytes: 1 << 30,
            stream_replicas: 1,
            snapshot_interval: 60,
            snapshot_events: 1_000_000,
            snapshot_keep: 3,
            backend: Backend::Runs,
            jump: index.jump,
            max_depth: index.max_depth,
            max_workers: index.max_workers,
            max_dp_ranks: 256,
            max_blocks_per_worker: kvindex_core::index::runs::MAX_BLOCKS_PER_WORKER,
            resync_interval: 1,
            resync_max_interval: 30,
            replica_check_interval: 10,
            ready_settle_ms: 500,
            ready_timeout: 10,
            shutdown_grace: 10,
        }
    }
}

/// `kvindex serve`'s flags: each overrides the file and the environment (`None` leaves the
/// lower layers' value).
#[derive(Clone, Debug, Default, Serialize, clap::Args)]
pub struct Flags {
    /// Where NATS is and the subject prefix (shared with `kvindex bridge`).
    #[command(flatten)]
    #[serde(flatten)]
    pub connect: ConnectFlags,
    /// Address of /metrics, /healthz, /readyz [KVINDEX_METRICS_ADDR].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
    /// Address of the inspect API, "" for none [KVINDEX_INSPECT_ADDR].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inspect_addr: Option<String>,
    /// Address of the query API for routers, "" for none [KVINDEX_QUERY_ADDR].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub query_addr: Option<String>,
    /// Apply threads, 0 for one per core less one [KVINDEX_APPLY_THREADS].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apply_threads: Option<usize>,
    /// Seconds of silence after which a worker is dropped, 0 for never [KVINDEX_WORKER_TTL].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_ttl: Option<u64>,
    /// Index backend: runs (the default) or positional [KVINDEX_BACKEND].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<Backend>,
    /// Shards of a deployment sharded by worker [KVINDEX_SHARDS].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<u32>,
    /// This daemon's shard, from 0 [KVINDEX_SHARD].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
}

/// The flags `serve` and `bridge` share: where NATS is, and the subject prefix.
#[derive(Clone, Debug, Default, Serialize, clap::Args)]
pub struct ConnectFlags {
    /// NATS server(s), comma-separated [KVINDEX_NATS_URL].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_url: Option<String>,
    /// Subject prefix, one per model or deployment [KVINDEX_PREFIX].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

/// A provider under a name of ours, so that `kvindex config` can tell the layers apart.
struct Named<P> {
    name: &'static str,
    inner: P,
}

impl<P: Provider> Provider for Named<P> {
    fn metadata(&self) -> Metadata {
        let mut md = self.inner.metadata();
        md.name = self.name.into();
        md
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        self.inner.data()
    }
}

/// One key of the effective configuration, for `kvindex config`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Explained {
    /// The key, as the file spells it.
    pub key: String,
    /// The value; `null` when unset.
    pub value: serde_json::Value,
    /// Where it comes from: `default`, `file PATH`, `env KVINDEX_...` or `flag --...`.
    pub source: String,
}

/// Keys whose values `kvindex config` does not print.
const SECRETS: [&str; 4] = ["inspect_token", "query_token", "nats_password", "nats_token"];

/// `kvindex config`'s output: one TOML line per key, its source in a comment; secrets hidden.
pub fn explain_table(values: &[Explained]) -> String {
    let lines: Vec<(String, &str)> = values
        .iter()
        .map(|e| {
            let line = match &e.value {
                serde_json::Value::Null => format!("# {} (not set)", e.key),
                _ if SECRETS.contains(&e.key.as_str()) => format!("{} = \"<hidden>\"", e.key),
                v => format!("{} = {v}", e.key),
            };
            (line, e.source.as_str())
        })
        .collect();
    let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    lines.iter().map(|(l, source)| format!("{l:width$}  # {source}\n")).collect()
}

impl Config {
    /// The defaults, with NATS at `nats_url` (tests and tools start daemons so).
    pub fn with_nats_url(nats_url: impl Into<String>) -> Config {
        Config { nats: NatsSettings { nats_url: nats_url.into(), ..NatsSettings::default() }, ..Config::default() }
    }

    /// Loads the layers. `file` is `--config`; without it `config/kvindex.toml` is read if
    /// present. An error names the key and the reason.
    pub fn load(file: Option<&Path>, env: Env, flags: &Flags) -> Result<Config, String> {
        Ok(Self::load_figment(file, env, flags)?.0)
    }

    /// The effective configuration, key by key, with the layer each value comes from (what
    /// `kvindex config` prints). Fails as [`Config::load`] does.
    pub fn explain(file: Option<&Path>, env: Env, flags: &Flags) -> Result<Vec<Explained>, String> {
        let (cfg, fig) = Self::load_figment(file, env, flags)?;
        let serde_json::Value::Object(values) = serde_json::to_value(&cfg).map_err(|e| e.to_string())? else {
            return Err("the configuration is not a map".into());
        };
        Ok(values
            .into_iter()
            .map(|(key, value)| {
                let source = match fig.find_metadata(&key) {
                    None => "default".to_string(),
                    Some(md) => match (&*md.name, &md.source) {
                        ("default", _) => "default".to_string(),
                        ("flag", _) => format!("flag --{}", key.replace('_', "-")),
                        (_, Some(figment::Source::File(path))) => format!("file {}", path.display()),
                        // The layer is `Config::env()`'s: `KVINDEX_` and the key upper-cased.
                        ("environment", _) => format!("env KVINDEX_{}", key.to_ascii_uppercase()),
                        (name, _) => name.to_string(),
                    },
                };
                Explained { key, value, source }
            })
            .collect())
    }

    fn load_figment(file: Option<&Path>, env: Env, flags: &Flags) -> Result<(Config, Figment), String> {
        let mut fig = Figment::from(Named { name: "default", inner: Serialized::defaults(Config::default()) });
        match file {
            Some(f) if !f.exists() => return Err(format!("config file {} does not exist", f.display())),
            Some(f) => fig = fig.merge(Toml::file(f)),
            None => fig = fig.merge(Toml::file("config/kvindex.toml")),
        }
        let fig = fig
            .merge(Named { name: "environment", inner: env })
            .merge(Named { name: "flag", inner: Serialized::defaults(flags) });
        Self::known_keys_only(&fig)?;
        let cfg: Config =
            fig.extract().map_err(|e| e.into_iter().map(|e| format!("configuration: {e}")).collect::<Vec<_>>().join("; "))?;
        cfg.validate()?;
        Ok((cfg, fig))
    }

    /// Refuses a key no layer should hold (a typo in the file): serde would pass over it. The
    /// `[bridge]` table is `kvindex bridge`'s, read by the bridge from the same file.
    fn known_keys_only(fig: &Figment) -> Result<(), String> {
        let known = Self::keys();
        let data = fig.data().map_err(|e| format!("configuration: {e}"))?;
        for key in data.values().flat_map(|dict| dict.keys()) {
            if key != "bridge" && !known.iter().any(|k| k == key) {
                return Err(format!("configuration: unknown key `{key}` (docs/CONFIGURATION.md lists them)"));
            }
        }
        Ok(())
    }

    /// The `KVINDEX_*` environment layer, restricted to the keys [`Config`] has. Other
    /// `KVINDEX_*` variables are ignored, not errors: Kubernetes injects `KVINDEX_PORT` and
    /// friends for a Service named `kvindex`. [`Config::ignored_env`] lists them for a log line.
    pub fn env() -> Env {
        let known = Self::keys();
        Env::prefixed("KVINDEX_").filter(move |k| known.iter().any(|n| k.as_str().eq_ignore_ascii_case(n)))
    }

    /// The `KVINDEX_*` variables set in this process that name no configuration key.
    pub fn ignored_env() -> Vec<String> {
        let known = Self::keys();
        std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .filter(|k| k.strip_prefix("KVINDEX_").is_some_and(|key| !known.iter().any(|n| key.eq_ignore_ascii_case(n))))
            .collect()
    }

    /// Every key of the file and environment layers.
    fn keys() -> Vec<String> {
        match serde_json::to_value(Config::default()) {
            Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    /// In a sharded deployment, this daemon's shard of how many (`None`: not sharded).
    pub fn shard_of(&self) -> Option<kvindex_client::protocol::ShardOf> {
        (self.shards > 1).then_some(kvindex_client::protocol::ShardOf { shard: self.shard, shards: self.shards })
    }

    /// The queue group this replica answers lookups in: `kvindex`, or per shard and count
    /// (`kvindex-shard-{k}-of-{S}`), so that while the count changes a lookup reaches one
    /// replica of every shard of each count.
    pub fn lookup_group(&self) -> String {
        match self.shard_of() {
            Some(s) => format!("kvindex-shard-{}-of-{}", s.shard, s.shards),
            None => "kvindex".to_string(),
        }
    }

    /// What the NATS mapping appends to a worker's subjects for this daemon's shard (`.k`), or
    /// nothing when the deployment is not sharded.
    pub fn shard_suffix(&self) -> String {
        if self.shards > 1 {
            format!(".{}", self.shard)
        } else {
            String::new()
        }
    }

    fn validate(&self) -> Result<(), String> {
        let bad = |key: &str, why: &str| Err(format!("configuration: {key}: {why}"));
        if let Err(why) = self.nats.validate() {
            return Err(format!("configuration: {why}"));
        }
        if let Err(why) = check_prefix(&self.prefix) {
            return bad("prefix", &why);
        }
        if self.shards == 0 || self.shard >= self.shards {
            return bad("shard", "shards at least 1, and shard from 0 to shards - 1");
        }
        if self.metrics_addr.parse::<std::net::SocketAddr>().is_err() {
            return bad("metrics_addr", "must be host:port with an IP address, e.g. 0.0.0.0:9464");
        }
        if !self.inspect_addr.is_empty() && self.inspect_addr.parse::<std::net::SocketAddr>().is_err() {
            return bad("inspect_addr", "must be host:port with an IP address (e.g. 127.0.0.1:9466), or empty for none");
        }
        if self.inspect_token.as_ref().is_some_and(|t| t.is_empty() || t.contains(char::is_whitespace)) {
            return bad("inspect_token", "must be non-empty, without spaces");
        }
        if !self.query_addr.is_empty() && self.query_addr.parse::<std::net::SocketAddr>().is_err() {
            return bad("query_addr", "must be host:port with an IP address (e.g. 0.0.0.0:9467), or empty for none");
        }
        if self.query_token.as_ref().is_some_and(|t| t.is_empty() || t.contains(char::is_whitespace)) {
            return bad("query_token", "must be non-empty, without spaces");
        }
        if self.query_max_body < 1024 || self.query_max_tokens == 0 {
            return bad("query_max_body", "query_max_body at least 1024 bytes, query_max_tokens at least 1");
        }
        if self.block_size == Some(0) {
            return bad("block_size", "at least 1 token");
        }
        if !(0.0..=86_400.0).contains(&self.predicted_ttl) || !(0.0..=86_400.0).contains(&self.routed_only_ttl) {
            return bad("predicted_ttl", "predicted_ttl and routed_only_ttl: 0 to 86400 seconds");
        }
        if self.predicted_max_blocks == 0 || self.routed_only_capacity == 0 {
            return bad("predicted_max_blocks", "predicted_max_blocks and routed_only_capacity: at least 1");
        }
        if self.queue_capacity == 0 {
            return bad("queue_capacity", "must be at least 1");
        }
        if self.subscription_capacity == 0 {
            return bad("subscription_capacity", "must be at least 1");
        }
        if self.jump == 0 {
            return bad("jump", "must be at least 1");
        }
        if self.resync_interval == 0 || self.resync_max_interval < self.resync_interval {
            return bad("resync_interval", "must be at least 1 and at most resync_max_interval");
        }
        if self.ingest == Ingest::Jetstream {
            let name = self.stream_name();
            if name.is_empty() || name.contains(['.', '*', '>', ' ', '/', '\\']) {
                return bad("stream", "a JetStream stream name: no dots, wildcards, spaces or slashes");
            }
            if self.stream_max_age == 0 || self.stream_max_bytes <= 0 || !(1..=5).contains(&self.stream_replicas) {
                return bad("stream_max_age", "stream_max_age and stream_max_bytes above 0, stream_replicas 1 to 5");
            }
            if self.snapshot_keep == 0 {
                return bad("snapshot_keep", "at least 1 (the newest snapshot is what a restart loads)");
            }
        }
        if !self.models.is_empty() {
            self.served_models()?;
        }
        Ok(())
    }

    /// The routed-only workers (approximate mode), as a set asked on every batch and match.
    pub fn routed_only(&self) -> RoutedOnly {
        RoutedOnly { all: self.routed_only_all, workers: self.routed_only_workers.iter().copied().collect() }
    }

    /// How the model keeps routers' announcements.
    pub fn announcing(&self) -> AnnounceConfig {
        AnnounceConfig {
            predicted_capacity: self.predicted_max_blocks as usize,
            predicted_total: self.predicted_max_total,
            predicted_ttl_ms: (self.predicted_ttl * 1e3) as u64,
            routed_only: self.routed_only(),
            routed_only_capacity: self.routed_only_capacity as usize,
            routed_only_ttl_ms: (self.routed_only_ttl * 1e3) as u64,
        }
    }

    /// The run index's limits.
    pub fn run_config(&self) -> RunConfig {
        RunConfig {
            max_depth: self.max_depth,
            max_workers: self.max_workers,
            max_blocks_per_worker: self.max_blocks_per_worker,
            ..RunConfig::default()
        }
    }

    /// The positional index's limits.
    pub fn positional_config(&self) -> PositionalConfig {
        PositionalConfig {
            jump: self.jump,
            max_depth: self.max_depth,
            max_workers: self.max_workers,
            max_blocks_per_worker: self.max_blocks_per_worker,
        }
    }

    /// The JetStream stream's name: `stream`, or derived from the prefix (`kv` -> `KV_EVENTS`).
    pub fn stream_name(&self) -> String {
        if !self.stream.is_empty() {
            return self.stream.clone();
        }
        format!("{}_EVENTS", self.prefix.to_uppercase().replace(['.', '-', '*', '>', ' '], "_"))
    }

    /// Apply threads to start.
    pub fn apply_threads(&self) -> usize {
        if self.apply_threads > 0 {
            return self.apply_threads;
        }
        std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
    }

    /// Lookup threads to start.
    pub fn lookup_threads(&self) -> usize {
        if self.lookup_threads > 0 {
            return self.lookup_threads;
        }
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).max(1))
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closures return figment::Error.
mod tests {
    use super::*;
    use figment::Jail;

    #[test]
    fn layers_apply_in_order() {
        Jail::expect_with(|jail| {
            jail.create_file("k.toml", "prefix = \"from-file\"\nworker_ttl = 7\njump = 9\n")?;
            jail.set_env("KVINDEX_PREFIX", "from-env");
            jail.set_env("KVINDEX_JUMP", "11");
            let over =
                Flags { connect: ConnectFlags { prefix: Some("from-flag".into()), ..Default::default() }, ..Default::default() };
            let cfg = Config::load(Some(Path::new("k.toml")), Config::env(), &over).map_err(figment::Error::from)?;
            assert_eq!(cfg.prefix, "from-flag");
            assert_eq!(cfg.jump, 11);
            assert_eq!(cfg.worker_ttl, 7);
            assert_eq!(cfg.nats.nats_url, "nats://127.0.0.1:4222");
            Ok(())
        });
    }

    #[test]
    fn errors_name_the_key() {
        Jail::expect_with(|jail| {
            jail.create_file("bad.toml", "apply_threads = \"many\"\n")?;
            let err = Config::load(Some(Path::new("bad.toml")), Config::env(), &Flags::default()).unwrap_err();
            assert!(err.contains("apply_threads"), "{err}");
            jail.create_file("typo.toml", "nats_ulr = \"x\"\n")?;
            let err = Config::load(Some(Path::new("typo.toml")), Config::env(), &Flags::default()).unwrap_err();
            assert!(err.contains("nats_ulr"), "{err}");
            jail.set_env("KVINDEX_METRICS_ADDR", "localhost");
            let err = Config::load(None, Config::env(), &Flags::default()).unwrap_err();
            assert!(err.contains("metrics_addr"), "{err}");
            let err = Config::load(Some(Path::new("missing.toml")), Config::env(), &Flags::default()).unwrap_err();
            assert!(err.contains("does not exist"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn unknown_environment_is_ignored_but_file_keys_stay_strict() {
        Jail::expect_with(|jail| {
            // What Kubernetes injects for a Service named `kvindex`.
            jail.set_env("KVINDEX_PORT", "tcp://10.0.0.1:9464");
            jail.set_env("KVINDEX_SERVICE_HOST", "10.0.0.1");
            jail.set_env("KVINDEX_WORKER_TTL", "9");
            let cfg = Config::load(None, Config::env(), &Flags::default()).map_err(figment::Error::from)?;
            assert_eq!(cfg.worker_ttl, 9, "known variables still apply");
            let mut ignored = Config::ignored_env();
            ignored.sort();
            assert_eq!(ignored, ["KVINDEX_PORT", "KVINDEX_SERVICE_HOST"]);
            jail.create_file("typo.toml", "port = 9464\n")?;
            let err = Config::load(Some(Path::new("typo.toml")), Config::env(), &Flags::default()).unwrap_err();
            assert!(err.contains("port"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn explain_names_each_value_s_layer() {
        Jail::expect_with(|jail| {
            jail.create_file("k.toml", "worker_ttl = 7\njump = 9\nnats_password = \"hunter2\"\n")?;
            jail.set_env("KVINDEX_JUMP", "11");
            jail.set_env("KVINDEX_PREFIX", "from-env");
            let over =
                Flags { connect: ConnectFlags { prefix: Some("from-flag".into()), ..Default::default() }, ..Default::default() };
            let all = Config::explain(Some(Path::new("k.toml")), Config::env(), &over).map_err(figment::Error::from)?;
            let get = |key: &str| all.iter().find(|e| e.key == key).unwrap_or_else(|| panic!("{key} listed")).clone();
            assert_eq!((get("prefix").value, get("prefix").source), (serde_json::json!("from-flag"), "flag --prefix".into()));
            assert_eq!((get("jump").value, get("jump").source), (serde_json::json!(11), "env KVINDEX_JUMP".into()));
            let ttl = get("worker_ttl");
            assert!(ttl.value == 7 && ttl.source.starts_with("file ") && ttl.source.ends_with("/k.toml"), "{ttl:?}");
            assert_eq!(get("nats_url").source, "default");
            assert_eq!(get("nats_user").value, serde_json::Value::Null);
            assert_eq!(all.len(), Config::keys().len(), "every key, once");
            let table = explain_table(&all);
            assert!(table.lines().any(|l| l.starts_with("prefix = \"from-flag\"") && l.ends_with("# flag --prefix")), "{table}");
            assert!(table.contains("nats_password = \"<hidden>\"") && !table.contains("hunter2"), "{table}");
            assert!(table.contains("# nats_user (not set)"), "{table}");
            // An invalid value is an error, as for `serve`.
            jail.set_env("KVINDEX_METRICS_ADDR", "localhost");
            assert!(Config::explain(None, Config::env(), &Flags::default()).unwrap_err().contains("metrics_addr"));
            Ok(())
        });
    }

    #[test]
    fn shipped_file_parses_and_matches_the_defaults() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config/kvindex.toml"));
        let cfg = Config::load(Some(path), Env::prefixed("KVINDEX_TEST_UNSET_"), &Flags::default()).unwrap();
        assert_eq!(cfg, Config::default());
    }
}
