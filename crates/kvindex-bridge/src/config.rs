//! The bridge's configuration, layered as the daemon's: built-in defaults < the configuration
//! file (its NATS keys, `prefix` and its `[bridge]` table) < `KVINDEX_*` environment (the NATS
//! keys and `KVINDEX_PREFIX`; `KVINDEX_BRIDGE_*` for the table) < command-line flags.

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use kvindex_client::core::names::WorkerInfo;
use kvindex_client::nats::NatsSettings;
use kvindex_client::protocol::check_prefix;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What `kvindex bridge` is told beyond the NATS settings it shares with `serve`: the file's
/// `[bridge]` table, `KVINDEX_BRIDGE_*`, and these flags.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeSettings {
    /// The engine's ZMQ PUB endpoint (rank 0); rank r publishes on its port + r.
    pub zmq: String,
    /// The engine's ZMQ ROUTER for replay (rank 0; rank r on its port + r); none: a gap
    /// cannot be replayed and starts a new epoch instead.
    pub replay: Option<String>,
    /// The worker id the engine's blocks are published under; none: the id `worker_name`
    /// stands for. One of the two is needed.
    pub worker_id: Option<u64>,
    /// The engine's name (its pod name, say): unique in the fleet, listed by kvindex and put
    /// in answers for routers.
    pub worker_name: Option<String>,
    /// Where routers send this engine requests (its serving URL), put beside its name.
    pub engine_url: Option<String>,
    /// The model the engine serves, as it names it.
    pub model: Option<String>,
    /// The engine's data-parallel ranks, one ZMQ endpoint each.
    pub dp_ranks: Vec<u32>,
    /// Tokens per block, for events that do not carry `block_size`.
    pub block_size: Option<u32>,
    /// Where the bridge serves `/metrics`, `/healthz` and `/readyz`.
    pub metrics_addr: String,
    /// Milliseconds to wait for each replayed batch before giving the replay up.
    pub replay_timeout_ms: u64,
}

impl Default for BridgeSettings {
    fn default() -> Self {
        BridgeSettings {
            zmq: "tcp://127.0.0.1:5557".into(),
            replay: None,
            worker_id: None,
            worker_name: None,
            engine_url: None,
            model: None,
            dp_ranks: vec![0],
            block_size: None,
            metrics_addr: "0.0.0.0:9465".into(),
            replay_timeout_ms: 2000,
        }
    }
}

/// `kvindex bridge`'s own flags; each overrides the `[bridge]` table and `KVINDEX_BRIDGE_*`
/// (`None` leaves the lower layers' value).
#[derive(Clone, Debug, Default, Serialize, clap::Args)]
pub struct BridgeFlags {
    /// The engine's ZMQ PUB endpoint for rank 0 (rank r: port + r).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zmq: Option<String>,
    /// The engine's ZMQ ROUTER for replay, rank 0 (rank r: port + r).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// Worker id to publish the engine's blocks under (default: the id --worker-name stands for).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<u64>,
    /// The engine's name, unique in the fleet (a pod name): kvindex lists it and routers read it.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker_name: Option<String>,
    /// Where routers send this engine requests (its serving URL).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_url: Option<String>,
    /// The model the engine serves.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The engine's data-parallel ranks.
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_ranks: Option<Vec<u32>>,
    /// Tokens per block, for events without block_size.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Address of the bridge's /metrics, /healthz, /readyz.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
}

/// Everything the bridge runs with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BridgeConfig {
    /// Where NATS is, as `serve` reaches it.
    #[serde(flatten)]
    pub nats: NatsSettings,
    /// Subject prefix, as `serve`'s.
    pub prefix: String,
    /// The bridge's own settings.
    pub bridge: BridgeSettings,
    /// Test builds only: a fault to make on purpose; never read from a file or the environment.
    #[cfg(feature = "fault-injection")]
    #[serde(skip)]
    pub fault: BridgeFault,
}

/// Test builds only (feature `fault-injection`): what a broken bridge would do, so that tests
/// can show the digest finds it.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BridgeFault {
    /// The engine block hash whose first `stored` event each rank loses: counted in the
    /// rank's block set and digest as if forwarded, never sent, and no event id skipped.
    pub lose_event_storing: Option<u64>,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        BridgeConfig {
            nats: NatsSettings::default(),
            prefix: "kv".into(),
            bridge: BridgeSettings::default(),
            #[cfg(feature = "fault-injection")]
            fault: BridgeFault::default(),
        }
    }
}

/// The keys of the daemon's file and environment that the bridge reads; it ignores the others.
fn shared_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.starts_with("nats_") || key == "prefix"
}

impl BridgeConfig {
    /// Loads the layers: `file` (default: `config/kvindex.toml` if present), the environment,
    /// then `nats_url`, `prefix` and `flags` from the command line.
    pub fn load(
        file: Option<&Path>,
        nats_url: Option<String>,
        prefix: Option<String>,
        flags: &BridgeFlags,
    ) -> Result<Self, String> {
        let mut fig = Figment::from(Serialized::defaults(BridgeConfig::default()));
        fig = match file {
            Some(f) if !f.exists() => return Err(format!("config file {} does not exist", f.display())),
            Some(f) => fig.merge(Toml::file(f)),
            None => fig.merge(Toml::file("config/kvindex.toml")),
        };
        fig = fig.merge(Env::prefixed("KVINDEX_").filter(|k| shared_key(k.as_str())));
        if let Some(url) = nats_url {
            fig = fig.merge(Serialized::default("nats_url", url));
        }
        if let Some(prefix) = prefix {
            fig = fig.merge(Serialized::default("prefix", prefix));
        }
        let mut cfg: BridgeConfig = fig.extract().map_err(errors)?;
        cfg.bridge = Figment::from(Serialized::defaults(cfg.bridge))
            .merge(Env::prefixed("KVINDEX_BRIDGE_"))
            .merge(Serialized::defaults(flags))
            .extract()
            .map_err(|e| errors(e).replace("configuration: ", "configuration: bridge: "))?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        let bad = |why: String| Err(format!("configuration: {why}"));
        if let Err(why) = self.nats.validate() {
            return bad(why);
        }
        if let Err(why) = check_prefix(&self.prefix) {
            return bad(format!("prefix: {why}"));
        }
        if self.bridge.dp_ranks.is_empty() || self.bridge.dp_ranks.len() > 1024 {
            return bad("bridge: dp_ranks: 1 to 1024 ranks".into());
        }
        if self.bridge.metrics_addr.parse::<std::net::SocketAddr>().is_err() {
            return bad("bridge: metrics_addr: must be host:port with an IP address".into());
        }
        let b = &self.bridge;
        if b.worker_id.is_none() && b.worker_name.is_none() {
            return bad("bridge: give the engine a worker_name (--worker-name, e.g. its pod name) or a worker_id: \
                without either, every such bridge would publish as one worker"
                .into());
        }
        if b.worker_name.is_none() && (b.engine_url.is_some() || b.model.is_some()) {
            return bad("bridge: engine_url and model are said beside a worker_name: give one".into());
        }
        if let Some(Err(why)) = self.worker().map(|w| w.check()) {
            return bad(format!("bridge: worker_name, engine_url, model: {why}"));
        }
        Ok(())
    }

    /// What the bridge says its engine is, when it has a name.
    pub fn worker(&self) -> Option<WorkerInfo> {
        let b = &self.bridge;
        Some(WorkerInfo {
            name: b.worker_name.clone()?,
            url: b.engine_url.clone(),
            model: b.model.clone(),
            block_size: b.block_size,
        })
    }

    /// The worker id the engine's blocks are published under: `worker_id`, or the one its
    /// name stands for.
    pub fn worker_id(&self) -> u64 {
        self.bridge.worker_id.or_else(|| self.worker().map(|w| w.worker_id())).unwrap_or_default()
    }
}

fn errors(e: figment::Error) -> String {
    e.into_iter().map(|e| format!("configuration: {e}")).collect::<Vec<_>>().join("; ")
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closures return figment::Error.
mod tests {
    use super::*;
    use figment::Jail;

    #[test]
    fn bridge_settings_layer_file_env_flags() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "b.toml",
                "prefix = \"p\"\nworker_ttl = 5\n[bridge]\nzmq = \"tcp://engine:5557\"\nworker_id = 3\ndp_ranks = [0, 1]\n",
            )?;
            jail.set_env("KVINDEX_BRIDGE_WORKER_ID", "4");
            jail.set_env("KVINDEX_BRIDGE_DP_RANKS", "[0,1,2]");
            jail.set_env("KVINDEX_NATS_URL", "nats://from-env:4222");
            let flags = BridgeFlags { block_size: Some(16), ..Default::default() };
            let cfg = BridgeConfig::load(Some(Path::new("b.toml")), None, None, &flags).map_err(figment::Error::from)?;
            assert_eq!(cfg.prefix, "p", "the file's key; the daemon's other keys are not the bridge's business");
            assert_eq!(cfg.nats.nats_url, "nats://from-env:4222");
            assert_eq!(cfg.bridge.zmq, "tcp://engine:5557");
            assert_eq!((cfg.bridge.worker_id, cfg.bridge.dp_ranks, cfg.bridge.block_size), (Some(4), vec![0, 1, 2], Some(16)));
            let flagged =
                BridgeConfig::load(Some(Path::new("b.toml")), Some("nats://flag:4222".into()), Some("q".into()), &flags)
                    .map_err(figment::Error::from)?;
            assert_eq!((flagged.nats.nats_url.as_str(), flagged.prefix.as_str()), ("nats://flag:4222", "q"));
            jail.create_file("typo.toml", "[bridge]\nzmq_url = \"x\"\n")?;
            let err = BridgeConfig::load(Some(Path::new("typo.toml")), None, None, &BridgeFlags::default()).unwrap_err();
            assert!(err.contains("zmq_url"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn bad_values_name_their_key() {
        Jail::expect_with(|jail| {
            jail.create_file("r.toml", "[bridge]\nworker_id = 1\ndp_ranks = []\n")?;
            let err = BridgeConfig::load(Some(Path::new("r.toml")), None, None, &BridgeFlags::default()).unwrap_err();
            assert!(err.contains("dp_ranks"), "{err}");
            let id = BridgeFlags { worker_id: Some(1), ..Default::default() };
            let err = BridgeConfig::load(None, None, Some("a.*".into()), &id).unwrap_err();
            assert!(err.contains("prefix"), "{err}");
            let url_alone = BridgeFlags { engine_url: Some("http://e:8000".into()), ..id.clone() };
            let err = BridgeConfig::load(None, None, None, &url_alone).unwrap_err();
            assert!(err.contains("worker_name"), "{err}");
            let long = BridgeFlags { worker_name: Some("x".repeat(300)), ..Default::default() };
            let err = BridgeConfig::load(None, None, None, &long).unwrap_err();
            assert!(err.contains("worker_name"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn a_bridge_without_an_identity_does_not_start() {
        Jail::expect_with(|_| {
            let err = BridgeConfig::load(None, None, None, &BridgeFlags::default()).unwrap_err();
            assert!(err.contains("worker_name") && err.contains("worker_id"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn a_named_engine_is_published_under_the_id_its_name_stands_for() {
        Jail::expect_with(|jail| {
            jail.set_env("KVINDEX_BRIDGE_WORKER_NAME", "vllm-7f9c");
            jail.set_env("KVINDEX_BRIDGE_ENGINE_URL", "http://10.0.0.7:8000");
            let flags = BridgeFlags { block_size: Some(16), model: Some("llama".into()), ..Default::default() };
            let cfg = BridgeConfig::load(None, None, None, &flags).map_err(figment::Error::from)?;
            let info = cfg.worker().expect("named");
            assert_eq!(cfg.worker_id(), kvindex_client::core::names::worker_id_for_name("vllm-7f9c"));
            assert_eq!(
                (info.name.as_str(), info.url.as_deref(), info.model.as_deref(), info.block_size),
                ("vllm-7f9c", Some("http://10.0.0.7:8000"), Some("llama"), Some(16))
            );
            let numbered = BridgeFlags { worker_id: Some(9), ..flags };
            assert_eq!(BridgeConfig::load(None, None, None, &numbered).map_err(figment::Error::from)?.worker_id(), 9);
            Ok(())
        });
    }
}
