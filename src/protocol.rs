//! Wire protocol version 1 (DESIGN §3), msgpack: the event batches publishers send, and the
//! lookup requests and answers of routers.
//!
//! Decoding is lenient and per event: a batch whose envelope decodes yields one result per
//! event, so a bad event is reported with a reason while its siblings still apply. Nothing
//! here panics on input. Batches and events are accepted as msgpack maps or in the positional
//! array form; hashes are accepted as unsigned or as signed 64-bit integers (two's complement,
//! for publishers in languages without u64).

use crate::hash::{local_hashes, BlockHash, LocalHash, StoredBlock};
use rmpv::Value;
use serde::{Deserialize, Serialize};

/// Where a block is cached; only `Device` blocks take part in lookups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Tier {
    #[default]
    Device,
    Host,
    Disk,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// What one event says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventData {
    /// A chain of blocks under `parent` (`None`: starting at position 0).
    Stored {
        parent: Option<BlockHash>,
        blocks: Vec<StoredBlock>,
        tier: Tier,
    },
    Removed {
        hashes: Vec<BlockHash>,
    },
    /// Every block of this worker and dp rank is gone.
    Cleared,
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    pub event_id: u64,
    pub data: EventData,
}

/// A decoded batch: the envelope, and each event or the reason it could not be decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub epoch: u64,
    pub ts_ns: u64,
    pub snapshot: bool,
    pub snapshot_end: bool,
    pub events: Vec<Result<KvEvent, DecodeError>>,
}

/// Why a message or an event could not be decoded; `reason()` is its metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not a msgpack value")]
    NotMsgpack,
    #[error("batch is not a map or array with worker_id and events")]
    BadBatch,
    #[error("event is not a map {{event_id, data}} or an array [event_id, data]")]
    BadEvent,
    #[error("event_id missing or not an unsigned integer")]
    BadEventId,
    #[error("event kind is not stored, removed or cleared")]
    UnknownKind,
    #[error("stored event without a valid blocks list")]
    BadStored,
    #[error("removed event without a valid block_hashes list")]
    BadRemoved,
    #[error("tier is not device, host or disk")]
    BadTier,
}

impl DecodeError {
    /// Stable label for metrics.
    pub fn reason(self) -> &'static str {
        match self {
            DecodeError::NotMsgpack => "not_msgpack",
            DecodeError::BadBatch => "bad_batch",
            DecodeError::BadEvent => "bad_event",
            DecodeError::BadEventId => "bad_event_id",
            DecodeError::UnknownKind => "unknown_kind",
            DecodeError::BadStored => "bad_stored",
            DecodeError::BadRemoved => "bad_removed",
            DecodeError::BadTier => "bad_tier",
        }
    }
}

/// A u64 from an unsigned or (two's complement) signed msgpack integer.
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        _ => None,
    }
}

fn field<'a>(map: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    map.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

fn hashes(v: &Value) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(as_u64).collect()
}

fn decode_block(v: &Value) -> Option<StoredBlock> {
    let (b, t) = match v {
        Value::Map(m) => (field(m, "block_hash")?, field(m, "tokens_hash")?),
        Value::Array(a) if a.len() == 2 => (&a[0], &a[1]),
        _ => return None,
    };
    Some(StoredBlock::new(as_u64(b)?, as_u64(t)?))
}

fn decode_stored(v: &Value) -> Result<EventData, DecodeError> {
    let (parent, blocks, tier) = match v {
        Value::Map(m) => (field(m, "parent_hash"), field(m, "blocks"), field(m, "tier")),
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        _ => return Err(DecodeError::BadStored),
    };
    let parent = match parent {
        None | Some(Value::Nil) => None,
        Some(p) => Some(BlockHash(as_u64(p).ok_or(DecodeError::BadStored)?)),
    };
    let blocks = blocks
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(decode_block).collect::<Option<Vec<_>>>())
        .ok_or(DecodeError::BadStored)?;
    let tier = match tier {
        None | Some(Value::Nil) => Tier::Device,
        Some(t) => match t.as_str() {
            Some("device") => Tier::Device,
            Some("host") => Tier::Host,
            Some("disk") => Tier::Disk,
            _ => return Err(DecodeError::BadTier),
        },
    };
    Ok(EventData::Stored { parent, blocks, tier })
}

fn decode_removed(v: &Value) -> Result<EventData, DecodeError> {
    let list = match v {
        Value::Map(m) => field(m, "block_hashes"),
        Value::Array(a) => a.first(),
        _ => None,
    };
    let hashes = list.and_then(hashes).ok_or(DecodeError::BadRemoved)?;
    Ok(EventData::Removed { hashes: hashes.into_iter().map(BlockHash).collect() })
}

/// Decodes one event: `{event_id, data}` or `[event_id, data]`.
pub fn decode_event(v: &Value) -> Result<KvEvent, DecodeError> {
    let (id, data) = match v {
        Value::Map(m) => (field(m, "event_id"), field(m, "data")),
        Value::Array(a) if a.len() == 2 => (a.first(), a.get(1)),
        _ => return Err(DecodeError::BadEvent),
    };
    let event_id = id.and_then(|i| i.as_u64()).ok_or(DecodeError::BadEventId)?;
    let data = match data.ok_or(DecodeError::BadEvent)? {
        Value::String(s) if s.as_str() == Some("cleared") => EventData::Cleared,
        Value::Map(m) if m.len() == 1 => match m[0].0.as_str() {
            Some("stored") => decode_stored(&m[0].1)?,
            Some("removed") => decode_removed(&m[0].1)?,
            Some("cleared") => EventData::Cleared,
            _ => return Err(DecodeError::UnknownKind),
        },
        Value::String(_) | Value::Map(_) => return Err(DecodeError::UnknownKind),
        _ => return Err(DecodeError::BadEvent),
    };
    Ok(KvEvent { event_id, data })
}

/// Decodes a batch (map, or the array `[worker_id, dp_rank, epoch, ts_ns, snapshot, events,
/// snapshot_end]` with trailing fields optional). Errors only if the envelope is unusable.
pub fn decode_batch(bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    let v = rmpv::decode::read_value(&mut &bytes[..]).map_err(|_| DecodeError::NotMsgpack)?;
    let get = |key: &str, idx: usize| -> Option<&Value> {
        match &v {
            Value::Map(m) => field(m, key),
            Value::Array(a) => a.get(idx),
            _ => None,
        }
    };
    if !matches!(v, Value::Map(_) | Value::Array(_)) {
        return Err(DecodeError::BadBatch);
    }
    let worker_id = get("worker_id", 0).and_then(as_u64).ok_or(DecodeError::BadBatch)?;
    let uint = |key: &str, idx: usize| -> Result<u64, DecodeError> {
        match get(key, idx) {
            None | Some(Value::Nil) => Ok(0),
            Some(x) => x.as_u64().ok_or(DecodeError::BadBatch),
        }
    };
    let flag = |key: &str, idx: usize| -> Result<bool, DecodeError> {
        match get(key, idx) {
            None | Some(Value::Nil) => Ok(false),
            Some(x) => x.as_bool().ok_or(DecodeError::BadBatch),
        }
    };
    let dp_rank = u32::try_from(uint("dp_rank", 1)?).map_err(|_| DecodeError::BadBatch)?;
    let events = match get("events", 5) {
        None | Some(Value::Nil) => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(decode_event).collect(),
        Some(_) => return Err(DecodeError::BadBatch),
    };
    Ok(EventBatch {
        worker_id,
        dp_rank,
        epoch: uint("epoch", 2)?,
        ts_ns: uint("ts_ns", 3)?,
        snapshot: flag("snapshot", 4)?,
        snapshot_end: flag("snapshot_end", 6)?,
        events,
    })
}

fn block_value(b: &StoredBlock) -> Value {
    Value::Map(vec![("block_hash".into(), b.block_hash.0.into()), ("tokens_hash".into(), b.tokens_hash.0.into())])
}

/// Encodes one event (map form), for publishers and tests.
pub fn event_value(e: &KvEvent) -> Value {
    let data = match &e.data {
        EventData::Stored { parent, blocks, tier } => Value::Map(vec![(
            "stored".into(),
            Value::Map(vec![
                ("parent_hash".into(), parent.map_or(Value::Nil, |p| p.0.into())),
                ("blocks".into(), Value::Array(blocks.iter().map(block_value).collect())),
                ("tier".into(), tier.as_str().into()),
            ]),
        )]),
        EventData::Removed { hashes } => Value::Map(vec![(
            "removed".into(),
            Value::Map(vec![("block_hashes".into(), Value::Array(hashes.iter().map(|h| h.0.into()).collect()))]),
        )]),
        EventData::Cleared => "cleared".into(),
    };
    Value::Map(vec![("event_id".into(), e.event_id.into()), ("data".into(), data)])
}

/// Encodes a batch (map form) from its envelope and events.
pub fn encode_batch(b: &EventBatch) -> Vec<u8> {
    let events = b.events.iter().filter_map(|e| e.as_ref().ok()).map(event_value).collect();
    let v = Value::Map(vec![
        ("worker_id".into(), b.worker_id.into()),
        ("dp_rank".into(), b.dp_rank.into()),
        ("epoch".into(), b.epoch.into()),
        ("ts_ns".into(), b.ts_ns.into()),
        ("snapshot".into(), b.snapshot.into()),
        ("snapshot_end".into(), b.snapshot_end.into()),
        ("events".into(), Value::Array(events)),
    ]);
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &v);
    out
}

/// A router's question (msgpack map).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    /// Local hashes of the request's blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_hashes: Option<Vec<u64>>,
    /// Or the token ids, hashed here with `block_size`, `lora_name` and `salt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
    /// Only these worker ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_blocks: Option<u64>,
}

impl LookupRequest {
    /// Decodes and checks a request; the error text goes back to the router.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let req: LookupRequest = rmp_serde::from_slice(bytes).map_err(|e| format!("undecodable lookup request: {e}"))?;
        match (&req.block_hashes, &req.tokens, req.block_size) {
            (Some(_), None, _) => Ok(req),
            (None, Some(_), Some(bs)) if bs > 0 => Ok(req),
            (None, Some(_), _) => Err("tokens need a block_size above 0".into()),
            (Some(_), Some(_), _) => Err("give block_hashes or tokens, not both".into()),
            (None, None, _) => Err("give block_hashes or tokens".into()),
        }
    }

    /// The local hashes to match.
    pub fn local_hashes(&self) -> Vec<LocalHash> {
        match (&self.block_hashes, &self.tokens) {
            (Some(h), _) => h.iter().map(|&h| LocalHash(h)).collect(),
            (None, Some(t)) => {
                local_hashes(t, self.block_size.unwrap_or(0) as usize, self.lora_name.as_deref(), self.salt.as_deref())
            }
            (None, None) => Vec::new(),
        }
    }
}

/// One worker in a lookup answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchEntry {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub blocks: u32,
    /// The worker's state is being resynchronised; its answer may be out of date.
    pub stale: bool,
}

/// The answer to a lookup: matches deepest first, or an error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LookupResponse {
    Matches { matches: Vec<MatchEntry> },
    Error { error: String },
}

impl LookupResponse {
    pub fn encode(&self) -> Vec<u8> {
        // Serialising these plain structs to a Vec cannot fail.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(v: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    fn stored(id: u64, parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEvent {
        KvEvent {
            event_id: id,
            data: EventData::Stored {
                parent: parent.map(BlockHash),
                blocks: blocks.iter().map(|&(b, t)| StoredBlock::new(b, t)).collect(),
                tier: Tier::Device,
            },
        }
    }

    #[test]
    fn batch_round_trips() {
        let batch = EventBatch {
            worker_id: 7,
            dp_rank: 1,
            epoch: 3,
            ts_ns: 1_700_000_000_000_000_000,
            snapshot: true,
            snapshot_end: false,
            events: vec![
                Ok(KvEvent { event_id: 0, data: EventData::Cleared }),
                Ok(stored(1, None, &[(u64::MAX, 5), (11, 6)])),
                Ok(KvEvent { event_id: 2, data: EventData::Removed { hashes: vec![BlockHash(11)] } }),
            ],
        };
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
    }

    #[test]
    fn a_bad_event_does_not_drop_its_siblings() {
        let good = event_value(&stored(4, Some(9), &[(1, 2)]));
        let v = Value::Map(vec![
            ("worker_id".into(), 5.into()),
            (
                "events".into(),
                Value::Array(vec![
                    good.clone(),
                    Value::from("garbage"),
                    Value::Map(vec![
                        ("event_id".into(), 5.into()),
                        ("data".into(), Value::Map(vec![("evicted".into(), Value::Nil)])),
                    ]),
                    Value::Map(vec![("data".into(), "cleared".into())]),
                    Value::Map(vec![
                        ("event_id".into(), 7.into()),
                        ("data".into(), Value::Map(vec![("stored".into(), Value::Map(vec![]))])),
                    ]),
                    Value::Map(vec![
                        ("event_id".into(), 8.into()),
                        (
                            "data".into(),
                            Value::Map(vec![("removed".into(), Value::Map(vec![("block_hashes".into(), "x".into())]))]),
                        ),
                    ]),
                    good,
                ]),
            ),
        ]);
        let b = decode_batch(&enc(v)).unwrap();
        assert_eq!((b.worker_id, b.dp_rank, b.epoch, b.snapshot), (5, 0, 0, false));
        let got: Vec<_> = b.events.iter().map(|e| e.as_ref().map(|e| e.event_id).map_err(|e| e.reason())).collect();
        assert_eq!(
            got,
            vec![Ok(4), Err("bad_event"), Err("unknown_kind"), Err("bad_event_id"), Err("bad_stored"), Err("bad_removed"), Ok(4)]
        );
    }

    #[test]
    fn positional_forms_and_signed_hashes_are_accepted() {
        let ev = Value::Array(vec![
            2.into(),
            Value::Map(vec![(
                "stored".into(),
                Value::Array(vec![Value::Nil, Value::Array(vec![Value::Array(vec![(-1i64).into(), 3.into()])]), "host".into()]),
            )]),
        ]);
        let batch = Value::Array(vec![9.into(), 2.into(), 1.into(), 100.into(), false.into(), Value::Array(vec![ev])]);
        let b = decode_batch(&enc(batch)).unwrap();
        assert_eq!((b.worker_id, b.dp_rank, b.epoch, b.ts_ns, b.snapshot_end), (9, 2, 1, 100, false));
        assert_eq!(
            b.events,
            vec![Ok(KvEvent {
                event_id: 2,
                data: EventData::Stored { parent: None, blocks: vec![StoredBlock::new(u64::MAX, 3)], tier: Tier::Host }
            })]
        );
    }

    #[test]
    fn unusable_envelopes_are_errors() {
        assert_eq!(decode_batch(&[]), Err(DecodeError::NotMsgpack));
        assert_eq!(decode_batch(&[0x81]), Err(DecodeError::NotMsgpack));
        assert_eq!(decode_batch(&enc(Value::from(3))), Err(DecodeError::BadBatch));
        assert_eq!(decode_batch(&enc(Value::Map(vec![("events".into(), Value::Array(vec![]))]))), Err(DecodeError::BadBatch));
        let bad_events = Value::Map(vec![("worker_id".into(), 1.into()), ("events".into(), 5.into())]);
        assert_eq!(decode_batch(&enc(bad_events)), Err(DecodeError::BadBatch));
        let heartbeat = decode_batch(&enc(Value::Map(vec![("worker_id".into(), 1.into())]))).unwrap();
        assert!(heartbeat.events.is_empty());
    }

    #[test]
    fn lookup_requests_in_both_forms() {
        let by_hash = LookupRequest { block_hashes: Some(vec![1, 2]), workers: Some(vec![4]), ..Default::default() };
        let back = LookupRequest::decode(&rmp_serde::to_vec_named(&by_hash).unwrap()).unwrap();
        assert_eq!(back, by_hash);
        assert_eq!(back.local_hashes(), vec![LocalHash(1), LocalHash(2)]);

        let tokens: Vec<u32> = (0..40).collect();
        let by_tokens = LookupRequest {
            tokens: Some(tokens.clone()),
            block_size: Some(16),
            lora_name: Some("a".into()),
            ..Default::default()
        };
        let back = LookupRequest::decode(&rmp_serde::to_vec_named(&by_tokens).unwrap()).unwrap();
        assert_eq!(back.local_hashes(), local_hashes(&tokens, 16, Some("a"), None));
        assert_eq!(back.local_hashes().len(), 2);

        for bad in [
            LookupRequest::default(),
            LookupRequest { tokens: Some(vec![1]), ..Default::default() },
            LookupRequest { tokens: Some(vec![1]), block_size: Some(0), ..Default::default() },
            LookupRequest { tokens: Some(vec![1]), block_hashes: Some(vec![1]), block_size: Some(1), ..Default::default() },
        ] {
            assert!(LookupRequest::decode(&rmp_serde::to_vec_named(&bad).unwrap()).is_err(), "{bad:?}");
        }
        assert!(LookupRequest::decode(b"\xc1").unwrap_err().starts_with("undecodable"));
    }

    #[test]
    fn responses_are_msgpack_maps() {
        let ok = LookupResponse::Matches { matches: vec![MatchEntry { worker_id: 3, dp_rank: 0, blocks: 9, stale: false }] };
        let v = rmpv::decode::read_value(&mut &ok.encode()[..]).unwrap();
        let matches = field(v.as_map().unwrap(), "matches").unwrap().as_array().unwrap();
        assert_eq!(field(matches[0].as_map().unwrap(), "blocks").unwrap().as_u64(), Some(9));
        let err = LookupResponse::Error { error: "nope".into() };
        let v = rmpv::decode::read_value(&mut &err.encode()[..]).unwrap();
        assert_eq!(field(v.as_map().unwrap(), "error").unwrap().as_str(), Some("nope"));
    }
}
