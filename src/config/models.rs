//! The models one daemon serves: a `[[models]]` table each, its keys over the daemon's (its
//! `prefix`, `block_size`, bounds, shards, durable mode), or, without a table, one model
//! named `default` on the daemon's own keys.

use super::Config;
use figment::providers::Serialized;
use figment::Figment;
use serde::{Deserialize, Serialize};

/// The name of the one model a daemon without a `[[models]]` table serves.
pub const DEFAULT_MODEL: &str = "default";

/// Keys the daemon has as a whole, which a model's table cannot set: its listeners, its NATS
/// connection (`nats_*`), its lookup threads, its backend, its shutdown, the table itself.
const DAEMON_WIDE: [&str; 11] = [
    "metrics_addr",
    "inspect_addr",
    "inspect_token",
    "query_addr",
    "query_token",
    "query_max_body",
    "query_max_tokens",
    "lookup_threads",
    "backend",
    "shutdown_grace",
    "models",
];

/// One model's table in `[[models]]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelTable {
    /// What `model_name` calls it in the query API, and its metrics' `model` label.
    pub name: String,
    /// The keys it sets for itself (`prefix` at least); the others are the daemon's.
    #[serde(flatten)]
    pub keys: serde_json::Map<String, serde_json::Value>,
}

impl Config {
    /// Each model this daemon serves and the configuration it runs with: every table of
    /// `models` over the daemon's keys, or the one model `default` on them. An error names the
    /// model and the key.
    pub fn served_models(&self) -> Result<Vec<(String, Config)>, String> {
        if self.models.is_empty() {
            return Ok(vec![(DEFAULT_MODEL.to_string(), self.clone())]);
        }
        let bad = |name: &str, why: String| Err(format!("configuration: models: {name:?}: {why}"));
        let known = Config::keys();
        let daemon = Config { models: Vec::new(), ..self.clone() };
        let mut out: Vec<(String, Config)> = Vec::with_capacity(self.models.len());
        for m in &self.models {
            if m.name.is_empty() || m.name.len() > kvindex_core::names::MAX_MODEL {
                return bad(&m.name, "a name of 1 to 256 bytes".into());
            }
            if out.iter().any(|(n, _)| *n == m.name) {
                return bad(&m.name, "two models of one name".into());
            }
            for key in m.keys.keys() {
                if DAEMON_WIDE.contains(&key.as_str()) || key.starts_with("nats_") {
                    return bad(&m.name, format!("`{key}` is the daemon's, not a model's: set it outside [[models]]"));
                }
                if !known.iter().any(|k| k == key) {
                    return bad(&m.name, format!("unknown key `{key}` (docs/CONFIGURATION.md lists them)"));
                }
            }
            if !m.keys.contains_key("prefix") {
                return bad(&m.name, "give its subject prefix (`prefix`): one per model".into());
            }
            let cfg: Config = Figment::from(Serialized::defaults(&daemon))
                .merge(Serialized::defaults(&m.keys))
                .extract()
                .map_err(|e| format!("configuration: models: {:?}: {e}", m.name))?;
            cfg.validate().map_err(|e| e.replace("configuration: ", &format!("configuration: models: {:?}: ", m.name)))?;
            if let Some((other, _)) = out.iter().find(|(_, c)| c.prefix == cfg.prefix) {
                return bad(&m.name, format!("prefix {:?} is model {other:?}'s too: one prefix per model", cfg.prefix));
            }
            out.push((m.name.clone(), cfg));
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closures return figment::Error.
mod tests {
    use super::super::{Config, Flags};
    use figment::Jail;
    use std::path::Path;

    fn load(toml: &str) -> Result<Config, String> {
        let mut out = Err(String::new());
        Jail::expect_with(|jail| {
            jail.create_file("m.toml", toml)?;
            out = Config::load(Some(Path::new("m.toml")), Config::env(), &Flags::default());
            Ok(())
        });
        out
    }

    #[test]
    fn without_a_table_one_model_named_default_runs_on_the_daemon_s_keys() {
        let cfg = load("prefix = \"p\"\nblock_size = 16\n").unwrap();
        let models = cfg.served_models().unwrap();
        assert_eq!(models.len(), 1);
        assert_eq!((models[0].0.as_str(), models[0].1.prefix.as_str(), models[0].1.block_size), ("default", "p", Some(16)));
    }

    #[test]
    fn each_model_s_keys_stand_over_the_daemon_s() {
        let cfg = load(
            "max_workers = 100\nworker_ttl = 9\n\
             [[models]]\nname = \"llama\"\nprefix = \"llama\"\nblock_size = 16\n\
             [[models]]\nname = \"qwen\"\nprefix = \"qwen\"\nblock_size = 32\nmax_workers = 7\nshards = 2\nshard = 1\n",
        )
        .unwrap();
        let models = cfg.served_models().unwrap();
        let (llama, qwen) = (&models[0].1, &models[1].1);
        assert_eq!((llama.prefix.as_str(), llama.block_size, llama.max_workers, llama.worker_ttl), ("llama", Some(16), 100, 9));
        assert_eq!(
            (qwen.prefix.as_str(), qwen.block_size, qwen.max_workers, qwen.shards, qwen.shard),
            ("qwen", Some(32), 7, 2, 1)
        );
        assert!(models.iter().all(|(_, c)| c.models.is_empty()));
    }

    #[test]
    fn a_wrong_table_is_refused_with_the_model_and_the_key() {
        for (toml, says) in [
            ("[[models]]\nname = \"a\"\n", "prefix"),
            ("[[models]]\nname = \"a\"\nprefix = \"a\"\n[[models]]\nname = \"a\"\nprefix = \"b\"\n", "two models"),
            ("[[models]]\nname = \"a\"\nprefix = \"x\"\n[[models]]\nname = \"b\"\nprefix = \"x\"\n", "one prefix per model"),
            ("[[models]]\nname = \"a\"\nprefix = \"a\"\nmetrics_addr = \"0.0.0.0:1\"\n", "metrics_addr"),
            ("[[models]]\nname = \"a\"\nprefix = \"a\"\nnats_url = \"nats://x:4222\"\n", "nats_url"),
            ("[[models]]\nname = \"a\"\nprefix = \"a\"\nmax_wrokers = 3\n", "max_wrokers"),
            ("[[models]]\nname = \"a\"\nprefix = \"a.*\"\n", "prefix"),
            ("[[models]]\nname = \"a\"\nprefix = \"a\"\nblock_size = 0\n", "block_size"),
            ("[[models]]\nname = \"\"\nprefix = \"a\"\n", "name"),
        ] {
            let err = load(toml).unwrap_err();
            assert!(err.contains("models") && err.contains(says), "{toml}: {err}");
        }
    }
}
