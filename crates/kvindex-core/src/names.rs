//! Workers with names: what a publisher says its engine is (a name, the URL a router sends
//! requests to, the model it serves, its block size), and the numeric id a name stands for.
//!
//! A router turns an answer's worker ids into addresses with these; a fleet names its engines
//! (pod names) instead of numbering them by hand. The id of a name is stable across processes
//! and languages: XXH3-64 (seed 1337) of its UTF-8 bytes, shifted right by 11 bits so that it
//! fits a JSON number exactly (53 bits).

use crate::hash::HASH_SEED;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The longest name accepted, in bytes: a DNS name's length, which holds a pod name.
pub const MAX_NAME: usize = 253;
/// The longest URL accepted, in bytes.
pub const MAX_URL: usize = 2048;
/// The longest model name accepted, in bytes.
pub const MAX_MODEL: usize = 256;

/// What a publisher says its engine is. Sent beside its events; the daemon lists it and puts
/// it in answers, so that a router needs no table of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WorkerInfo {
    /// The engine's name (a pod name, a host:port): unique in the fleet, and one worker id's
    /// only name while it lives.
    pub name: String,
    /// Where a router sends this engine requests (its serving URL), when the publisher knows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The model it serves, as its engine names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Tokens per block of its KV cache: what a lookup by tokens must hash with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
}

impl WorkerInfo {
    /// A worker called `name`, nothing else said.
    pub fn named(name: impl Into<String>) -> WorkerInfo {
        WorkerInfo { name: name.into(), ..WorkerInfo::default() }
    }

    /// The numeric worker id its name stands for.
    pub fn worker_id(&self) -> u64 {
        worker_id_for_name(&self.name)
    }

    /// Refuses what no engine sends: an empty or overlong name, an overlong URL or model, a
    /// block size of 0. A reason fit for an error message.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.name.is_empty() || self.name.len() > MAX_NAME || self.name.chars().any(char::is_control) {
            return Err("name: 1 to 253 bytes, no control characters");
        }
        if self.url.as_ref().is_some_and(|u| u.is_empty() || u.len() > MAX_URL) {
            return Err("url: 1 to 2048 bytes");
        }
        if self.model.as_ref().is_some_and(|m| m.is_empty() || m.len() > MAX_MODEL) {
            return Err("model: 1 to 256 bytes");
        }
        if self.block_size == Some(0) {
            return Err("block_size: at least 1");
        }
        Ok(())
    }
}

/// The worker id a name stands for: XXH3-64 (seed 1337) of its UTF-8 bytes, the top 53 bits.
pub fn worker_id_for_name(name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), HASH_SEED) >> 11
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_stands_for_one_id_that_fits_a_json_number() {
        let id = worker_id_for_name("vllm-0");
        assert_eq!(id, xxh3_64_with_seed(b"vllm-0", 1337) >> 11);
        assert!(id < 1 << 53);
        assert_ne!(id, worker_id_for_name("vllm-1"));
        assert_eq!(WorkerInfo::named("vllm-0").worker_id(), id);
    }

    #[test]
    fn what_no_engine_sends_is_refused() {
        assert!(WorkerInfo::named("pod-7").check().is_ok());
        assert!(WorkerInfo::named("").check().is_err());
        assert!(WorkerInfo::named("x".repeat(254)).check().is_err());
        assert!(WorkerInfo::named("a\nb").check().is_err());
        assert!(WorkerInfo { url: Some(String::new()), ..WorkerInfo::named("a") }.check().is_err());
        assert!(WorkerInfo { model: Some("m".repeat(257)), ..WorkerInfo::named("a") }.check().is_err());
        assert!(WorkerInfo { block_size: Some(0), ..WorkerInfo::named("a") }.check().is_err());
    }
}
