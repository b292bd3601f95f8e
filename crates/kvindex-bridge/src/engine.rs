//! The engines' side of the bridge: the msgpack batches vLLM, SGLang and TensorRT-LLM publish
//! on their ZMQ sockets, decoded into kvindex's domain events. Every shape those engines use
//! is accepted (array or map batches, array or map events, u64, i64 or digest hashes); an odd
//! event is counted and skipped, never its batch.

use kvindex_core::hash::{local_hashes, with_extra_keys, with_lookahead, BlockHash, LocalHash, StoredBlock};
use kvindex_core::{Event, GroupKind, Tier};
use rmpv::Value;

/// Largest payload decoded: a batch bigger than this is refused whole (counted), so a frame
/// cannot make the bridge allocate without bound.
pub const MAX_PAYLOAD: usize = 64 << 20;

/// One engine batch: when it was made, its data-parallel rank if it says, its events.
#[derive(Debug, PartialEq)]
pub struct EngineBatch {
    /// Seconds since the epoch, as the engine stamped it (0 if absent).
    pub ts: f64,
    /// `data_parallel_rank` (vLLM, TensorRT-LLM) or `attn_dp_rank` (SGLang).
    pub dp_rank: Option<u32>,
    /// Each event decoded on its own: kept, or skipped with a reason.
    pub events: Vec<Result<EngineEvent, Skip>>,
}

/// One decoded engine event, with the KV-cache group it names (vLLM's hybrid models).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineEvent {
    /// The event. A store of a group that is not full attention comes as
    /// [`Event::GroupStored`] with group 0: the rank's group map numbers it.
    pub event: Event,
    /// `group_idx` and what the event says of the group's kind; `None` when it names none.
    pub group: Option<EngineGroup>,
}

/// The KV-cache group an engine event names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineGroup {
    /// The engine's `group_idx`.
    pub idx: u32,
    /// Its kind, if the event says (stores do, removals do not).
    pub kind: Option<EngineKind>,
}

/// A group's kind as kvindex can follow it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineKind {
    /// Full attention, sliding window or state: indexed.
    Known(GroupKind),
    /// A kind kvindex does not model (chunked local, cross or encoder-only attention, unknown).
    Unsupported,
}

/// The kind of a group from vLLM's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`.
pub fn engine_kind(kind: Option<&str>, window: Option<u64>, block_size: Option<u32>) -> Option<EngineKind> {
    let window_kind = || match (window.and_then(|w| u32::try_from(w).ok()).filter(|w| *w > 0), block_size) {
        (Some(w), Some(b)) => EngineKind::Known(GroupKind::window(w, b)),
        _ => EngineKind::Unsupported,
    };
    let Some(kind) = kind else { return window.filter(|w| *w > 0).map(|_| window_kind()) };
    Some(match kind.to_ascii_lowercase().as_str() {
        "full_attention" | "mla_attention" | "sink_full_attention" => EngineKind::Known(GroupKind::Full),
        "sliding_window" | "sliding_window_mla" => window_kind(),
        "mamba" => EngineKind::Known(GroupKind::State),
        _ => EngineKind::Unsupported,
    })
}

/// Why an event was not forwarded: its metric label says which.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Not what the engines send; counted as a decode failure.
    Bad(&'static str),
    /// Valid, but not for the index: a KV-cache group of a kind kvindex does not model, a
    /// remote block.
    Filtered(&'static str),
    /// A storage medium kvindex has no tier for, named so the log can say which.
    UnknownMedium(String),
}

/// Why a whole batch was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("payload is not msgpack, or a length in it overruns the payload")]
    NotMsgpack,
    #[error("payload is over the size limit")]
    TooLarge,
    #[error("batch is neither [ts, events, dp_rank] nor a map with events")]
    BadBatch,
}

impl BatchError {
    /// Stable metric label.
    pub fn reason(self) -> &'static str {
        match self {
            BatchError::NotMsgpack => "not_msgpack",
            BatchError::TooLarge => "too_large",
            BatchError::BadBatch => "bad_batch",
        }
    }
}

/// How stored events are hashed where they do not say.
#[derive(Clone, Copy, Debug)]
pub struct Hashing {
    /// Tokens per block, for events without `block_size`.
    pub block_size: Option<u32>,
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8], hashing: Hashing) -> Result<EngineBatch, BatchError> {
    if payload.len() > MAX_PAYLOAD {
        return Err(BatchError::TooLarge);
    }
    if !lengths_fit(payload) {
        return Err(BatchError::NotMsgpack);
    }
    let value = rmpv::decode::read_value(&mut &payload[..]).map_err(|_| BatchError::NotMsgpack)?;
    let (ts, events, rank) = match &value {
        Value::Array(a) if a.len() >= 2 => (a.first(), a.get(1), a.get(2)),
        Value::Map(_) => {
            (field(&value, "ts"), field(&value, "events"), field(&value, "data_parallel_rank").or(field(&value, "attn_dp_rank")))
        }
        _ => return Err(BatchError::BadBatch),
    };
    let Some(Value::Array(events)) = events else { return Err(BatchError::BadBatch) };
    let ts = ts.and_then(Value::as_f64).or_else(|| ts.and_then(Value::as_i64).map(|t| t as f64)).unwrap_or(0.0);
    let dp_rank = rank.and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok());
    Ok(EngineBatch { ts, dp_rank, events: events.iter().map(|e| decode_event(e, hashing)).collect() })
}

/// A map's value under `key`.
fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v).filter(|v| !v.is_nil())
}

/// The fields of an event, by name whether it came as a map or a tagged array.
struct Fields<'a> {
    kind: &'a str,
    named: Option<&'a Value>,
    positional: &'a [Value],
    /// Positions of the array form, after the tag.
    order: &'static [&'static str],
}

const STORED: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
const REMOVED: &[&str] = &["block_hashes", "medium", "group_idx", "locality"];

impl<'a> Fields<'a> {
    fn of(v: &'a Value) -> Option<Fields<'a>> {
        let (kind, named, positional) = match v {
            Value::Array(a) => (a.first()?.as_str()?, None, &a[1..]),
            Value::Map(_) => (field(v, "type")?.as_str()?, Some(v), &[][..]),
            _ => return None,
        };
        let order = match kind {
            "BlockStored" => STORED,
            "BlockRemoved" => REMOVED,
            _ => &[],
        };
        Some(Fields { kind, named, positional, order })
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        match self.named {
            Some(m) => field(m, name),
            None => {
                let i = self.order.iter().position(|n| *n == name)?;
                self.positional.get(i).filter(|v| !v.is_nil())
            }
        }
    }
}

fn decode_event(v: &Value, hashing: Hashing) -> Result<EngineEvent, Skip> {
    let f = Fields::of(v).ok_or(Skip::Bad("bad_event"))?;
    match f.kind {
        "AllBlocksCleared" => return Ok(EngineEvent { event: Event::Cleared, group: None }),
        "BlockStored" | "BlockRemoved" => {}
        _ => return Err(Skip::Bad("unknown_kind")),
    }
    let idx = match f.get("group_idx") {
        None => None,
        Some(g) => Some(g.as_u64().and_then(|g| u32::try_from(g).ok()).ok_or(Skip::Bad("bad_group"))?),
    };
    let block_size_field = f.get("block_size").and_then(Value::as_u64).and_then(|b| u32::try_from(b).ok()).filter(|b| *b > 0);
    let kind = engine_kind(
        f.get("kv_cache_spec_kind").and_then(Value::as_str),
        f.get("kv_cache_spec_sliding_window").and_then(Value::as_u64),
        block_size_field.or(hashing.block_size),
    );
    // An event without a group index but with a kind other than full attention is a group of its own.
    let group = match (idx, kind) {
        (None, None | Some(EngineKind::Known(GroupKind::Full))) => None,
        (idx, kind) => Some(EngineGroup { idx: idx.unwrap_or(0), kind }),
    };
    let event = decode_block_event(&f, hashing, kind)?;
    Ok(EngineEvent { event, group })
}

/// A `BlockStored` or `BlockRemoved` as a domain event; a store of a group of `kind` other than
/// full attention needs only its hashes (its null blocks are left out of them).
fn decode_block_event(f: &Fields<'_>, hashing: Hashing, kind: Option<EngineKind>) -> Result<Event, Skip> {
    if f.get("locality").and_then(Value::as_str).is_some_and(|l| l.eq_ignore_ascii_case("remote")) {
        return Err(Skip::Filtered("remote"));
    }
    let tier = match f.get("medium") {
        None => Tier::Device,
        Some(m) => {
            let name = m.as_str().ok_or(Skip::Bad("bad_medium"))?;
            medium_tier(name).ok_or_else(|| Skip::UnknownMedium(name.chars().take(64).collect()))?
        }
    };
    let hashes = hash_list(f.get("block_hashes")).ok_or(Skip::Bad("bad_hashes"))?;
    if f.kind == "BlockRemoved" {
        return Ok(Event::Removed { hashes: hashes.into_iter().map(BlockHash).collect(), tier });
    }
    match kind {
        Some(EngineKind::Unsupported) => return Err(Skip::Filtered("unsupported_group")),
        Some(EngineKind::Known(kind)) if kind != GroupKind::Full => {
            if tier != Tier::Device {
                return Err(Skip::Filtered("group_off_device"));
            }
            return Ok(Event::GroupStored { group: 0, kind, hashes: hashes.into_iter().map(BlockHash).collect() });
        }
        _ => {}
    }
    let parent = match f.get("parent_block_hash") {
        None => None,
        Some(p) => Some(block_hash(p).ok_or(Skip::Bad("bad_hashes"))?),
    };
    let block_size = match f.get("block_size") {
        Some(b) => b.as_u64().and_then(|b| u32::try_from(b).ok()).filter(|b| *b > 0).ok_or(Skip::Bad("bad_block_size"))?,
        None => hashing.block_size.ok_or(Skip::Bad("no_block_size"))?,
    };
    let tokens = f.get("token_ids").and_then(Value::as_array).ok_or(Skip::Bad("no_tokens"))?;
    if tokens.len() != hashes.len() * block_size as usize {
        return Err(Skip::Bad("bad_tokens"));
    }
    let tokens: Vec<u32> = tokens
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<_>>()
        .ok_or(Skip::Bad("bad_tokens"))?;
    // LoRA: the adapter's name; the deprecated numeric id names it when the name is absent.
    let lora_id = f.get("lora_id").and_then(Value::as_i64).filter(|id| *id != 0).map(|id| id.to_string());
    let lora_field = f.get("lora_name");
    // SGLang >= 0.5.18 puts a metadata map where the LoRA name is.
    let (lora_name, meta) = match lora_field {
        Some(m @ Value::Map(_)) => (field(m, "lora_name").and_then(Value::as_str).map(str::to_string), Some(m)),
        Some(v) => (v.as_str().map(str::to_string), None),
        None => (None, None),
    };
    let lora_name = lora_name.or(lora_id);
    let extra = match f.get("extra_keys") {
        None => None,
        Some(e) => Some(e.as_array().filter(|e| e.len() == hashes.len()).ok_or(Skip::Bad("bad_extra_keys"))?),
    };
    // The salt is the request's first block's: SGLang sends it as a field on every event,
    // vLLM as a bare string in that block's extra keys. Later blocks chain from that one.
    let root = parent.is_none();
    let salt = meta.and_then(|m| field(m, "cache_salt")).or_else(|| f.get("cache_salt")).and_then(Value::as_str);
    let salt = salt.or_else(|| extra.and_then(|e| e.first()).and_then(|k| salt_key(k, lora_name.as_deref())));
    let salt = salt.filter(|_| root);
    let mut locals = local_hashes(&tokens, block_size as usize, lora_name.as_deref(), salt);
    if let Some(per_block) = extra {
        for (i, (local, keys)) in locals.iter_mut().zip(per_block).enumerate() {
            let salt = if i == 0 { salt } else { None };
            *local = fold_keys(*local, keys, lora_name.as_deref(), salt);
        }
    }
    if let Some(ahead) = f.get("lookahead_token_ids") {
        let per_block = ahead.as_array().filter(|a| a.len() == hashes.len()).ok_or(Skip::Bad("bad_lookahead"))?;
        // One buffer for every block's lookahead tokens.
        let mut toks = Vec::new();
        for (local, ahead) in locals.iter_mut().zip(per_block) {
            if ahead.is_nil() {
                continue;
            }
            toks.clear();
            for t in ahead.as_array().ok_or(Skip::Bad("bad_lookahead"))? {
                toks.push(t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or(Skip::Bad("bad_lookahead"))?);
            }
            if !toks.is_empty() {
                *local = with_lookahead(*local, &toks);
            }
        }
    }
    let blocks = hashes.iter().zip(&locals).map(|(&h, &l)| StoredBlock { block_hash: BlockHash(h), tokens_hash: l }).collect();
    Ok(Event::Stored { parent: parent.map(BlockHash), blocks, tier })
}

/// The salt in a request's first block's extra keys (vLLM): the bare string after the
/// adapter's name, if any (multimodal keys are pairs, prompt-embedding digests bytes).
fn salt_key<'a>(keys: &'a Value, lora_name: Option<&str>) -> Option<&'a str> {
    after_adapter(keys.as_array()?, lora_name).iter().find_map(Value::as_str)
}

/// A block's extra keys after the adapter's name, which vLLM puts first in every block's.
fn after_adapter<'a>(keys: &'a [Value], lora_name: Option<&str>) -> &'a [Value] {
    match keys.split_first() {
        Some((first, rest)) if lora_name.is_some() && first.as_str() == lora_name => rest,
        _ => keys,
    }
}

/// A block's local hash with its extra keys folded in ([`fold_extra`]), less what the
/// identity rule already covers: the adapter's name vLLM puts first in every block's keys,
/// and the salt it puts in the first block's. Encodes the rest without copying it.
fn fold_keys(local: LocalHash, keys: &Value, lora_name: Option<&str>, salt: Option<&str>) -> LocalHash {
    let Some(list) = keys.as_array() else { return fold_extra(local, keys) };
    let rest = after_adapter(list, lora_name);
    let salt_at = salt.and_then(|s| rest.iter().position(|k| k.as_str() == Some(s)));
    let len = rest.len() - usize::from(salt_at.is_some());
    if len == 0 {
        return local;
    }
    let mut buf = Vec::new();
    // Writing into a Vec cannot fail; the length fits u32 (the payload is 64 MiB at most).
    let _ = rmp::encode::write_array_len(&mut buf, len as u32);
    for (_, k) in rest.iter().enumerate().filter(|(i, _)| Some(*i) != salt_at) {
        let _ = rmpv::encode::write_value(&mut buf, k);
    }
    with_extra_keys(local, &buf)
}

/// A block's local hash with its extra keys (multimodal content hashes, prompt-embedding
/// digests) folded in: nothing for `nil` or an empty list, else over their canonical msgpack.
pub fn fold_extra(local: LocalHash, keys: &Value) -> LocalHash {
    match keys {
        Value::Nil => local,
        Value::Array(a) if a.is_empty() => local,
        v => {
            let mut buf = Vec::new();
            // Writing into a Vec cannot fail.
            let _ = rmpv::encode::write_value(&mut buf, v);
            with_extra_keys(local, &buf)
        }
    }
}

/// The tier of an engine's `medium`; `None` for one kvindex does not know.
pub fn medium_tier(medium: &str) -> Option<Tier> {
    match medium.to_ascii_uppercase().as_str() {
        "GPU" | "DEVICE" | "CUDA" => Some(Tier::Device),
        "CPU" | "CPU_PINNED" | "CPU_TIER1" => Some(Tier::Host),
        // vLLM 0.33 names its storage offload tier STORAGE.
        "CPU_TIER2" | "DISK" | "EXTERNAL" | "STORAGE" => Some(Tier::Disk),
        _ => None,
    }
}

/// An engine block hash: u64, i64 (TensorRT-LLM; its two's complement), or a digest (vLLM
/// with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), folded to its last 8 bytes, big-endian.
pub fn block_hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)),
        Value::Binary(b) if b.len() >= 8 => Some(u64::from_be_bytes(b[b.len() - 8..].try_into().ok()?)),
        _ => None,
    }
}

fn hash_list(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_array()?.iter().map(block_hash).collect()
}

/// Whether every length in the msgpack value at the start of `buf` fits in what follows, so
/// that no container is allocated for more elements than the payload could hold.
fn lengths_fit(buf: &[u8]) -> bool {
    let mut pos = 0usize;
    // Values still to read; each container adds its elements.
    let mut pending: u64 = 1;
    let len = |pos: &mut usize, n: usize| -> Option<u64> {
        let bytes = buf.get(*pos..*pos + n)?;
        *pos += n;
        Some(bytes.iter().fold(0u64, |acc, b| (acc << 8) | *b as u64))
    };
    while pending > 0 {
        pending -= 1;
        let Some(&m) = buf.get(pos) else { return false };
        pos += 1;
        let (skip, elements): (u64, u64) = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (0, 2 * (m & 0x0f) as u64),
            0x90..=0x9f => (0, (m & 0x0f) as u64),
            0xa0..=0xbf => ((m & 0x1f) as u64, 0),
            0xcc | 0xd0 => (1, 0),
            0xcd | 0xd1 => (2, 0),
            0xce | 0xd2 | 0xca => (4, 0),
            0xcf | 0xd3 | 0xcb => (8, 0),
            0xd4 => (2, 0),
            0xd5 => (3, 0),
            0xd6 => (5, 0),
            0xd7 => (9, 0),
            0xd8 => (17, 0),
            0xc4 | 0xd9 => match len(&mut pos, 1) {
                Some(n) => (n, 0),
                None => return false,
            },
            0xc5 | 0xda => match len(&mut pos, 2) {
                Some(n) => (n, 0),
                None => return false,
            },
            0xc6 | 0xdb => match len(&mut pos, 4) {
                Some(n) => (n, 0),
                None => return false,
            },
            0xc7 => match len(&mut pos, 1) {
                Some(n) => (n + 1, 0),
                None => return false,
            },
            0xc8 => match len(&mut pos, 2) {
                Some(n) => (n + 1, 0),
                None => return false,
            },
            0xc9 => match len(&mut pos, 4) {
                Some(n) => (n + 1, 0),
                None => return false,
            },
            0xdc => match len(&mut pos, 2) {
                Some(n) => (0, n),
                None => return false,
            },
            0xdd => match len(&mut pos, 4) {
                Some(n) => (0, n),
                None => return false,
            },
            0xde => match len(&mut pos, 2) {
                Some(n) => (0, 2 * n),
                None => return false,
            },
            0xdf => match len(&mut pos, 4) {
                Some(n) => (0, 2 * n),
                None => return false,
            },
            _ => return false,
        };
        let rest = (buf.len() - pos) as u64;
        // The bytes skipped, and at least one byte for each value still to read.
        if skip.saturating_add(elements).saturating_add(pending) > rest {
            return false;
        }
        pos += skip as usize;
        pending += elements;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::{arr, encode as enc, map, s};

    #[test]
    fn every_medium_of_todays_engines_has_a_tier() {
        for (medium, tier) in [
            ("GPU", Tier::Device),
            ("cuda", Tier::Device),
            ("CPU", Tier::Host),
            ("CPU_PINNED", Tier::Host),
            ("CPU_TIER1", Tier::Host),
            ("CPU_TIER2", Tier::Disk),
            ("DISK", Tier::Disk),
            ("EXTERNAL", Tier::Disk),
            ("STORAGE", Tier::Disk),
        ] {
            assert_eq!(medium_tier(medium), Some(tier), "{medium}");
        }
        assert_eq!(medium_tier("NVME_OVER_FABRIC"), None);
    }

    const H: Hashing = Hashing { block_size: None };

    fn tokens(n: u32) -> Value {
        arr((0..n).map(Value::from).collect())
    }

    #[test]
    fn array_and_map_shapes_decode_alike() {
        let stored_array =
            arr(vec![s("BlockStored"), arr(vec![Value::from(10u64), Value::from(11u64)]), Value::Nil, tokens(8), Value::from(4)]);
        let stored_map = map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", arr(vec![Value::from(10u64), Value::from(11u64)])),
            ("parent_block_hash", Value::Nil),
            ("token_ids", tokens(8)),
            ("block_size", Value::from(4)),
            ("medium", s("GPU")),
        ]);
        let batch_array = arr(vec![Value::from(1.5), arr(vec![stored_array]), Value::Nil]);
        let batch_map = map(vec![("ts", Value::from(1.5)), ("events", arr(vec![stored_map])), ("attn_dp_rank", Value::from(3))]);
        let a = decode_batch(&enc(&batch_array), H).unwrap();
        let m = decode_batch(&enc(&batch_map), H).unwrap();
        assert_eq!(a.events, m.events);
        assert_eq!((a.dp_rank, m.dp_rank), (None, Some(3)));
        let want: Vec<u32> = (0..8).collect();
        let locals = local_hashes(&want, 4, None, None);
        assert_eq!(
            a.events[0].clone().map(|e| e.event),
            Ok(Event::Stored {
                parent: None,
                blocks: vec![
                    StoredBlock { block_hash: BlockHash(10), tokens_hash: locals[0] },
                    StoredBlock { block_hash: BlockHash(11), tokens_hash: locals[1] }
                ],
                tier: Tier::Device
            })
        );
    }

    #[test]
    fn every_hash_form_reads_as_u64() {
        assert_eq!(block_hash(&Value::from(u64::MAX)), Some(u64::MAX));
        assert_eq!(block_hash(&Value::from(-1i64)), Some(u64::MAX));
        let mut digest = vec![0u8; 32];
        digest[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        assert_eq!(block_hash(&Value::Binary(digest)), Some(0x0102_0304_0506_0708));
        assert_eq!(block_hash(&s("x")), None);
    }

    #[test]
    fn odd_events_are_skipped_alone() {
        let good = arr(vec![s("BlockRemoved"), arr(vec![Value::from(5)]), s("CPU")]);
        let events = arr(vec![
            arr(vec![s("Nope")]),
            arr(vec![s("BlockStored"), arr(vec![Value::from(1)]), Value::Nil, tokens(3), Value::from(4)]),
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", arr(vec![Value::from(1)])),
                ("token_ids", tokens(4)),
                ("block_size", Value::from(4)),
                ("group_idx", Value::from(1)),
            ]),
            map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![Value::from(1)])), ("locality", s("REMOTE"))]),
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", arr(vec![Value::from(1)])),
                ("token_ids", tokens(4)),
                ("block_size", Value::from(4)),
                ("kv_cache_spec_kind", s("sliding_window")),
            ]),
            good,
            arr(vec![s("AllBlocksCleared")]),
        ]);
        let b = decode_batch(&enc(&arr(vec![Value::from(0), events])), H).unwrap();
        assert_eq!(
            crate::groups::RankGroups::default().route(b.events),
            vec![
                Err(Skip::Bad("unknown_kind")),
                Err(Skip::Bad("bad_tokens")),
                Err(Skip::Filtered("no_full_attention_group")),
                Err(Skip::Filtered("remote")),
                Err(Skip::Filtered("unsupported_group")),
                Ok(Event::Removed { hashes: vec![BlockHash(5)], tier: Tier::Host }),
                Ok(Event::Cleared),
            ]
        );
    }

    #[test]
    fn extra_keys_and_salt_change_local_hashes() {
        let stored = |extra: Value, meta: Value| {
            let ev = arr(vec![
                s("BlockStored"),
                arr(vec![Value::from(1), Value::from(2)]),
                Value::Nil,
                tokens(8),
                Value::from(4),
                Value::Nil,
                Value::Nil,
                meta,
                extra,
            ]);
            match decode_batch(&enc(&arr(vec![Value::from(0), arr(vec![ev])])), H).unwrap().events.remove(0).map(|e| e.event) {
                Ok(Event::Stored { blocks, .. }) => blocks.iter().map(|b| b.tokens_hash).collect::<Vec<_>>(),
                other => panic!("{other:?}"),
            }
        };
        let plain = stored(Value::Nil, Value::Nil);
        let image_a = stored(arr(vec![Value::Nil, arr(vec![s("img-a")])]), Value::Nil);
        let image_b = stored(arr(vec![Value::Nil, arr(vec![s("img-b")])]), Value::Nil);
        assert_eq!(plain[0], image_a[0], "a block without extra keys keeps its hash");
        assert_ne!(plain[1], image_a[1]);
        assert_ne!(image_a[1], image_b[1], "the same placeholder tokens with another image differ");
        let salted = stored(Value::Nil, map(vec![("cache_salt", s("tenant"))]));
        let want: Vec<u32> = (0..8).collect();
        assert_eq!(salted, local_hashes(&want, 4, None, Some("tenant")));
    }

    /// The locals of one decoded `BlockStored` map event.
    fn locals_of(fields: Vec<(&str, Value)>) -> Vec<LocalHash> {
        let ev = map([vec![("type", s("BlockStored")), ("block_size", Value::from(4))], fields].concat());
        match decode_batch(&enc(&arr(vec![Value::from(0), arr(vec![ev])])), H).unwrap().events.remove(0).map(|e| e.event) {
            Ok(Event::Stored { blocks, .. }) => blocks.iter().map(|b| b.tokens_hash).collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_identity_rule_whatever_the_engine() {
        let ids = |v: &[i64]| arr(v.iter().map(|&h| Value::from(h)).collect());
        let want: Vec<u32> = (0..12).collect();
        let rule = local_hashes(&want, 4, Some("sql"), Some("tenant"));
        // vLLM: the adapter first in every block's extra keys, the salt in the first block's.
        let vllm_root = locals_of(vec![
            ("block_hashes", ids(&[1, 2])),
            ("token_ids", tokens(8)),
            ("lora_name", s("sql")),
            ("extra_keys", arr(vec![arr(vec![s("sql"), s("tenant")]), arr(vec![s("sql")])])),
        ]);
        let vllm_next = locals_of(vec![
            ("block_hashes", ids(&[3])),
            ("parent_block_hash", Value::from(2)),
            ("token_ids", arr((8..12).map(Value::from).collect())),
            ("lora_name", s("sql")),
            ("extra_keys", arr(vec![arr(vec![s("sql")])])),
        ]);
        assert_eq!([vllm_root, vllm_next].concat(), rule);
        // SGLang: both as fields of every event; a continuation's salt is not its first block's.
        let sglang_root = locals_of(vec![
            ("block_hashes", ids(&[1, 2])),
            ("token_ids", tokens(8)),
            ("lora_name", s("sql")),
            ("cache_salt", s("tenant")),
        ]);
        let sglang_next = locals_of(vec![
            ("block_hashes", ids(&[3])),
            ("parent_block_hash", Value::from(2)),
            ("token_ids", arr((8..12).map(Value::from).collect())),
            ("lora_name", s("sql")),
            ("cache_salt", s("tenant")),
        ]);
        assert_eq!([sglang_root, sglang_next].concat(), rule);
        // What is left of the extra keys (an image pair) still folds.
        let image = locals_of(vec![
            ("block_hashes", ids(&[1, 2])),
            ("token_ids", tokens(8)),
            ("lora_name", s("sql")),
            ("extra_keys", arr(vec![arr(vec![s("sql")]), arr(vec![s("sql"), arr(vec![s("img"), Value::from(0)])])])),
        ]);
        assert_eq!(image[0], rule_no_salt(&want)[0]);
        assert_eq!(image[1], fold_extra(rule_no_salt(&want)[1], &arr(vec![arr(vec![s("img"), Value::from(0)])])));
    }

    fn rule_no_salt(tokens: &[u32]) -> Vec<LocalHash> {
        local_hashes(tokens, 4, Some("sql"), None)
    }

    #[test]
    fn lookahead_tokens_are_part_of_a_blocks_identity() {
        let ahead = arr(vec![arr(vec![Value::from(4), Value::from(5)]), arr(vec![Value::from(8), Value::from(9)])]);
        let got = locals_of(vec![
            ("block_hashes", arr(vec![Value::from(1), Value::from(2)])),
            ("token_ids", tokens(8)),
            ("lookahead_token_ids", ahead),
        ]);
        let want: Vec<u32> = (0..10).collect();
        assert_eq!(got, kvindex_core::hash::local_hashes_ahead(&want, 4, None, None, 2));
        let short = arr(vec![arr(vec![Value::from(4)])]);
        let ev = map(vec![
            ("type", s("BlockStored")),
            ("block_size", Value::from(4)),
            ("block_hashes", arr(vec![Value::from(1), Value::from(2)])),
            ("token_ids", tokens(8)),
            ("lookahead_token_ids", short),
        ]);
        let b = decode_batch(&enc(&arr(vec![Value::from(0), arr(vec![ev])])), H).unwrap();
        assert_eq!(b.events, vec![Err(Skip::Bad("bad_lookahead"))], "one list per block");
    }

    #[test]
    fn an_unknown_medium_is_named() {
        let ev = map(vec![("type", s("BlockRemoved")), ("block_hashes", arr(vec![Value::from(1)])), ("medium", s("HBM_POOL"))]);
        let b = decode_batch(&enc(&arr(vec![Value::from(0), arr(vec![ev])])), H).unwrap();
        assert_eq!(b.events, vec![Err(Skip::UnknownMedium("HBM_POOL".into()))]);
    }

    #[test]
    fn claimed_lengths_past_the_payload_are_refused() {
        // An array claiming 2^32-1 elements in five bytes, and a str claiming 255 bytes in two.
        assert_eq!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff], H), Err(BatchError::NotMsgpack));
        assert_eq!(decode_batch(&[0xd9, 0xff], H), Err(BatchError::NotMsgpack));
        assert_eq!(decode_batch(&enc(&Value::from(7)), H), Err(BatchError::BadBatch));
        assert!(lengths_fit(&enc(&arr(vec![Value::from(1), map(vec![("a", Value::Nil)])]))));
    }
}
