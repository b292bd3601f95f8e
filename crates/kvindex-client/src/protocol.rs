//! Wire protocol version 1, msgpack: the event batches publishers send, and the
//! lookup requests and answers of routers.
//!
//! Decoding is lenient and per event: a batch whose envelope decodes yields one result per
//! event, so a bad event is reported with a reason while its siblings still apply. Nothing
//! here panics on input. Batches and events are accepted as msgpack maps or in the positional
//! array form; hashes are accepted as unsigned or as signed 64-bit integers (two's complement,
//! for publishers in languages without u64).

use kvindex_core::digest::Digest;
use kvindex_core::groups::{GroupKind, MAX_GROUP};
use kvindex_core::hash::{local_hashes_ahead, BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::model::{Answer, Depths};
use kvindex_core::names::WorkerInfo;
use kvindex_core::{Event, Tier};
use serde::{Deserialize, Serialize};

/// One event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEvent {
    /// Consecutive per (worker, dp rank, epoch): how kvindex sees duplicates and gaps.
    pub event_id: u64,
    /// What happened.
    pub data: Event,
}

impl KvEvent {
    /// A device-tier `stored` event of `(block_hash, tokens_hash)` pairs under `parent`.
    pub fn stored(event_id: u64, parent: Option<u64>, blocks: &[(u64, u64)]) -> Self {
        KvEvent { event_id, data: Event::stored(parent, blocks) }
    }
}

/// A decoded batch: the envelope, and each event or the reason it could not be decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The envelope: whose events, which epoch, snapshot marks.
    pub header: BatchHeader,
    /// What the publisher says its engine is (`worker`), on the batches that carry it: the
    /// first of an epoch, heartbeats and snapshots. An error says why it was not read; the
    /// events stand either way.
    pub worker: Option<Result<WorkerInfo, &'static str>>,
    /// Each event, or why it could not be decoded (its siblings are unaffected).
    pub events: Vec<Result<KvEvent, DecodeError>>,
}

/// Why a message or an event could not be decoded; `reason()` is its metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are not msgpack at all.
    #[error("not a msgpack value")]
    NotMsgpack,
    /// The envelope lacks `worker_id` or `events`, or is not a map or array.
    #[error("batch is not a map or array with worker_id and events")]
    BadBatch,
    /// An event is neither `{event_id, data}` nor `[event_id, data]`.
    #[error("event is not a map {{event_id, data}} or an array [event_id, data]")]
    BadEvent,
    /// `event_id` is missing or not an unsigned integer.
    #[error("event_id missing or not an unsigned integer")]
    BadEventId,
    /// `data` names a kind other than `stored`, `removed`, `cleared`.
    #[error("event kind is not stored, removed or cleared")]
    UnknownKind,
    /// A `stored` body without a valid `blocks` chain.
    #[error("stored event without a valid blocks list")]
    BadStored,
    /// A `removed` body without a valid `block_hashes` list.
    #[error("removed event without a valid block_hashes list")]
    BadRemoved,
    /// `tier` names none of `device`, `host`, `disk`.
    #[error("tier is not device, host or disk")]
    BadTier,
    /// A group event (`group` above 0) without a group in 1..=63, a `kind` of `full`,
    /// `window` (with `window_blocks`) or `state`, or in a tier other than device.
    #[error("group event without a group in 1..=63, a kind of full, window or state, or on device")]
    BadGroup,
}

impl DecodeError {
    /// Every kind, so that a daemon can export each reason's counter from the start.
    pub const ALL: [DecodeError; 9] = [
        DecodeError::NotMsgpack,
        DecodeError::BadBatch,
        DecodeError::BadEvent,
        DecodeError::BadEventId,
        DecodeError::UnknownKind,
        DecodeError::BadStored,
        DecodeError::BadRemoved,
        DecodeError::BadTier,
        DecodeError::BadGroup,
    ];

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
            DecodeError::BadGroup => "bad_group",
        }
    }
}

/// A msgpack reader over a byte slice that allocates nothing: the ingest hot path reads
/// every block of every batch through it. `None` means truncated or malformed input.
struct Rd<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// A msgpack value's kind, as far as the decoder cares.
enum Head<'a> {
    Uint(u64),
    Int(i64),
    Nil,
    Bool(bool),
    Str(&'a [u8]),
    Array(usize),
    Map(usize),
    Other,
}

impl<'a> Rd<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Rd { buf, pos: 0 }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    /// A big-endian unsigned integer of `n` (1, 2, 4 or 8) bytes.
    #[inline]
    fn be(&mut self, n: usize) -> Option<u64> {
        let b = self.take(n)?;
        Some(match n {
            1 => b[0] as u64,
            2 => u16::from_be_bytes(b.try_into().ok()?) as u64,
            4 => u32::from_be_bytes(b.try_into().ok()?) as u64,
            _ => u64::from_be_bytes(b.try_into().ok()?),
        })
    }

    /// Reads the head of the next value (and a string's bytes); containers' items follow.
    #[inline]
    fn head(&mut self) -> Option<Head<'a>> {
        let m = *self.take(1)?.first()?;
        Some(match m {
            0x00..=0x7f => Head::Uint(m as u64),
            0xe0..=0xff => Head::Int(m as i8 as i64),
            0x80..=0x8f => Head::Map((m & 0x0f) as usize),
            0x90..=0x9f => Head::Array((m & 0x0f) as usize),
            0xa0..=0xbf => Head::Str(self.take((m & 0x1f) as usize)?),
            0xc0 => Head::Nil,
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xcc => Head::Uint(self.be(1)?),
            0xcd => Head::Uint(self.be(2)?),
            0xce => Head::Uint(self.be(4)?),
            0xcf => Head::Uint(self.be(8)?),
            0xd0 => Head::Int(self.be(1)? as u8 as i8 as i64),
            0xd1 => Head::Int(self.be(2)? as u16 as i16 as i64),
            0xd2 => Head::Int(self.be(4)? as u32 as i32 as i64),
            0xd3 => Head::Int(self.be(8)? as i64),
            0xd9 => {
                let n = self.be(1)? as usize;
                Head::Str(self.take(n)?)
            }
            0xda => {
                let n = self.be(2)? as usize;
                Head::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.be(4)? as usize;
                Head::Str(self.take(n)?)
            }
            0xdc => Head::Array(self.be(2)? as usize),
            0xdd => Head::Array(self.be(4)? as usize),
            0xde => Head::Map(self.be(2)? as usize),
            0xdf => Head::Map(self.be(4)? as usize),
            0xc4..=0xc6 => {
                let n = self.be(1 << (m - 0xc4))? as usize;
                self.take(n)?;
                Head::Other
            }
            0xc7..=0xc9 => {
                let n = self.be(1 << (m - 0xc7))? as usize;
                self.take(n + 1)?;
                Head::Other
            }
            0xca => {
                self.take(4)?;
                Head::Other
            }
            0xcb => {
                self.take(8)?;
                Head::Other
            }
            0xd4..=0xd8 => {
                self.take(1 + (1 << (m - 0xd4)))?;
                Head::Other
            }
            0xc1 => return None,
        })
    }

    /// Skips one whole value, items included.
    fn skip(&mut self) -> Option<()> {
        let mut pending = 1usize;
        while pending > 0 {
            pending -= 1;
            match self.head()? {
                Head::Array(n) => pending = pending.checked_add(n)?,
                Head::Map(n) => pending = pending.checked_add(n.checked_mul(2)?)?,
                _ => {}
            }
        }
        Some(())
    }

    /// A hash, unsigned or signed; `None` (and the value not consumed whole) for anything else.
    #[inline]
    fn hash(&mut self) -> Option<u64> {
        match self.head()? {
            Head::Uint(u) => Some(u),
            Head::Int(i) => Some(i as u64),
            _ => None,
        }
    }

    /// The bytes of the next whole value.
    fn value(&mut self) -> Option<&'a [u8]> {
        let start = self.pos;
        self.skip()?;
        Some(&self.buf[start..self.pos])
    }
}

/// Reads the map with string keys, or the array whose items are named by `names`, at `rd`,
/// in place: `f(key, rd)` gets `rd` at each value and must consume exactly that value
/// (reading or skipping it). `None` if it is neither, or is malformed.
fn fields<'a>(rd: &mut Rd<'a>, names: &[&'static str], mut f: impl FnMut(&[u8], &mut Rd<'a>) -> Option<()>) -> Option<()> {
    match rd.head()? {
        Head::Map(n) => {
            for _ in 0..n {
                let start = rd.pos;
                let key = match rd.head()? {
                    Head::Str(k) => k,
                    _ => {
                        rd.pos = start;
                        rd.skip()?;
                        &[][..]
                    }
                };
                f(key, rd)?;
            }
        }
        Head::Array(n) => {
            for i in 0..n {
                match names.get(i) {
                    Some(name) => f(name.as_bytes(), rd)?,
                    None => rd.skip()?,
                }
            }
        }
        _ => return None,
    }
    Some(())
}

fn is_nil(v: &[u8]) -> bool {
    v == [0xc0]
}

/// Runs `parse` at `rd`; if it fails, skips the whole value instead, so the caller can go on
/// with its siblings. `None` only if the value cannot even be skipped (truncated input).
fn or_skip<'a, T, E>(rd: &mut Rd<'a>, parse: impl FnOnce(&mut Rd<'a>) -> Result<T, E>) -> Option<Result<T, E>> {
    let start = rd.pos;
    let r = parse(rd);
    if r.is_err() {
        rd.pos = start;
        rd.skip()?;
    }
    Some(r)
}

fn read_blocks(rd: &mut Rd<'_>) -> Result<Vec<StoredBlock>, ()> {
    let Some(Head::Array(n)) = rd.head() else { return Err(()) };
    let mut out = Vec::with_capacity(n.min(rd.buf.len()));
    for _ in 0..n {
        // The pair form [block_hash, tokens_hash], as publishers send it, or a map.
        let start = rd.pos;
        match rd.head() {
            Some(Head::Array(2)) => match (rd.hash(), rd.hash()) {
                (Some(b), Some(t)) => out.push(StoredBlock::new(b, t)),
                _ => return Err(()),
            },
            Some(Head::Map(_)) => {
                rd.pos = start;
                let (mut b, mut t) = (None, None);
                fields(rd, &[], |k, rd| {
                    match k {
                        b"block_hash" => b = rd.hash(),
                        b"tokens_hash" => t = rd.hash(),
                        _ => rd.skip()?,
                    }
                    Some(())
                })
                .ok_or(())?;
                out.push(StoredBlock::new(b.ok_or(())?, t.ok_or(())?));
            }
            _ => return Err(()),
        }
    }
    Ok(out)
}

fn read_stored(rd: &mut Rd<'_>) -> Result<Event, DecodeError> {
    let (mut parent, mut blocks, mut tier) = (None, None, None);
    let (mut group, mut kind, mut window, mut hashes) = (None, None, None, None);
    fields(rd, &["parent_hash", "blocks", "tier"], |k, rd| {
        match k {
            b"parent_hash" => parent = Some(rd.value()?),
            b"blocks" => blocks = Some(or_skip(rd, read_blocks)?),
            b"tier" => tier = Some(rd.value()?),
            b"group" => group = Some(rd.value()?),
            b"kind" => kind = Some(rd.value()?),
            b"window_blocks" => window = Some(rd.value()?),
            b"block_hashes" => hashes = Some(or_skip(rd, read_hashes)?),
            _ => rd.skip()?,
        }
        Some(())
    })
    .ok_or(DecodeError::BadStored)?;
    if let Some(group) = read_group(group)? {
        read_tier(tier).ok().filter(|t| *t == Tier::Device).ok_or(DecodeError::BadGroup)?;
        let kind = read_kind(kind, window).ok_or(DecodeError::BadGroup)?;
        let hashes = hashes.and_then(Result::ok).ok_or(DecodeError::BadStored)?;
        return Ok(Event::GroupStored { group, kind, hashes });
    }
    let parent = match parent {
        None => None,
        Some(p) if is_nil(p) => None,
        Some(p) => Some(BlockHash(Rd::new(p).hash().ok_or(DecodeError::BadStored)?)),
    };
    let blocks = blocks.and_then(Result::ok).ok_or(DecodeError::BadStored)?;
    Ok(Event::Stored { parent, blocks, tier: read_tier(tier)? })
}

/// An optional `group` field: absent, nil or 0 is the primary group (`None`).
fn read_group(v: Option<&[u8]>) -> Result<Option<u8>, DecodeError> {
    let Some(v) = v.filter(|v| !is_nil(v)) else { return Ok(None) };
    match Rd::new(v).hash() {
        Some(0) => Ok(None),
        Some(g) if g <= u64::from(MAX_GROUP) => Ok(Some(g as u8)),
        _ => Err(DecodeError::BadGroup),
    }
}

/// A group's `kind` (`full`, `window` with `window_blocks` of at least 1, `state`).
fn read_kind(kind: Option<&[u8]>, window: Option<&[u8]>) -> Option<GroupKind> {
    match Rd::new(kind?).head()? {
        Head::Str(b"full") => Some(GroupKind::Full),
        Head::Str(b"state") => Some(GroupKind::State),
        Head::Str(b"window") => {
            let blocks = Rd::new(window?).hash()?;
            (1..=u64::from(u32::MAX)).contains(&blocks).then_some(GroupKind::Window { blocks: blocks as u32 })
        }
        _ => None,
    }
}

/// An optional `tier` field's value: absent or nil is `device`.
fn read_tier(v: Option<&[u8]>) -> Result<Tier, DecodeError> {
    match v {
        None => Ok(Tier::Device),
        Some(t) if is_nil(t) => Ok(Tier::Device),
        Some(t) => match Rd::new(t).head() {
            Some(Head::Str(name)) => Tier::parse(name).ok_or(DecodeError::BadTier),
            _ => Err(DecodeError::BadTier),
        },
    }
}

fn read_hashes(rd: &mut Rd<'_>) -> Result<Vec<BlockHash>, ()> {
    let Some(Head::Array(n)) = rd.head() else { return Err(()) };
    (0..n).map(|_| rd.hash().map(BlockHash).ok_or(())).collect()
}

fn read_removed(rd: &mut Rd<'_>) -> Result<Event, DecodeError> {
    let (mut hashes, mut tier, mut group) = (None, None, None);
    fields(rd, &["block_hashes", "tier"], |k, rd| {
        match k {
            b"block_hashes" => hashes = Some(or_skip(rd, read_hashes)?),
            b"tier" => tier = Some(rd.value()?),
            b"group" => group = Some(rd.value()?),
            _ => rd.skip()?,
        }
        Some(())
    })
    .ok_or(DecodeError::BadRemoved)?;
    let hashes = hashes.and_then(Result::ok).ok_or(DecodeError::BadRemoved)?;
    match read_group(group)? {
        Some(group) => {
            read_tier(tier).ok().filter(|t| *t == Tier::Device).ok_or(DecodeError::BadGroup)?;
            Ok(Event::GroupRemoved { group, hashes })
        }
        None => Ok(Event::Removed { hashes, tier: read_tier(tier)? }),
    }
}

/// An event's `data`: `"cleared"`, or a map of one kind to its body.
fn read_data(rd: &mut Rd<'_>) -> Result<Event, DecodeError> {
    match rd.head() {
        Some(Head::Str(b"cleared")) => Ok(Event::Cleared),
        Some(Head::Map(1)) => match rd.head() {
            Some(Head::Str(b"stored")) => read_stored(rd),
            Some(Head::Str(b"removed")) => read_removed(rd),
            Some(Head::Str(b"cleared")) => rd.skip().map(|_| Event::Cleared).ok_or(DecodeError::BadEvent),
            _ => Err(DecodeError::UnknownKind),
        },
        Some(Head::Str(_)) | Some(Head::Map(_)) => Err(DecodeError::UnknownKind),
        _ => Err(DecodeError::BadEvent),
    }
}

fn read_event(rd: &mut Rd<'_>) -> Result<KvEvent, DecodeError> {
    let start = rd.pos;
    match rd.head() {
        Some(Head::Map(_)) | Some(Head::Array(2)) => rd.pos = start,
        _ => return Err(DecodeError::BadEvent),
    }
    let (mut id, mut data) = (None, None);
    fields(rd, &["event_id", "data"], |k, rd| {
        match k {
            b"event_id" => id = Some(rd.value()?),
            b"data" => data = Some(or_skip(rd, read_data)?),
            _ => rd.skip()?,
        }
        Some(())
    })
    .ok_or(DecodeError::BadEvent)?;
    let event_id = match id.and_then(|i| Rd::new(i).head()) {
        Some(Head::Uint(u)) => u,
        _ => return Err(DecodeError::BadEventId),
    };
    let data = data.ok_or(DecodeError::BadEvent)??;
    Ok(KvEvent { event_id, data })
}

/// Decodes one event, `{event_id, data}` or `[event_id, data]`, from its bytes.
pub fn decode_event(v: &[u8]) -> Result<KvEvent, DecodeError> {
    read_event(&mut Rd::new(v))
}

/// Decodes a batch in one pass over its bytes. The envelope must be valid; each event
/// decodes on its own, so a bad one is reported while its siblings are kept.
pub fn decode_batch(bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut h = BatchHeader::default();
    let mut events = Vec::new();
    let (mut worker, mut bad) = (None, false);
    let uint = |v: &[u8], bad: &mut bool| match Rd::new(v).head() {
        Some(Head::Uint(u)) => u,
        Some(Head::Nil) => 0,
        _ => {
            *bad = true;
            0
        }
    };
    let flag = |v: &[u8], bad: &mut bool| match Rd::new(v).head() {
        Some(Head::Bool(x)) => x,
        Some(Head::Nil) => false,
        _ => {
            *bad = true;
            false
        }
    };
    let names = [
        "worker_id",
        "dp_rank",
        "epoch",
        "ts_ns",
        "snapshot",
        "events",
        "snapshot_end",
        "next_event_id",
        "incomplete",
        "worker",
        "digest",
        "tier_digests",
        "group_digest",
    ];
    let mut info = None;
    let mut rd = Rd::new(bytes);
    let read = fields(&mut rd, &names, |k, rd| {
        if k == b"events" {
            let start = rd.pos;
            match rd.head()? {
                Head::Nil => {}
                Head::Array(n) => {
                    events.reserve(n.min(bytes.len()));
                    for _ in 0..n {
                        events.push(or_skip(rd, read_event)?);
                    }
                }
                _ => {
                    bad = true;
                    rd.pos = start;
                    rd.skip()?;
                }
            }
            return Some(());
        }
        let v = rd.value()?;
        match k {
            b"worker_id" => worker = Rd::new(v).hash(),
            b"dp_rank" => match u32::try_from(uint(v, &mut bad)) {
                Ok(r) => h.dp_rank = r,
                Err(_) => bad = true,
            },
            b"epoch" => h.epoch = uint(v, &mut bad),
            b"ts_ns" => h.ts_ns = uint(v, &mut bad),
            b"snapshot" => h.snapshot = flag(v, &mut bad),
            b"snapshot_end" => h.snapshot_end = flag(v, &mut bad),
            b"next_event_id" if !is_nil(v) => h.next_event_id = Some(uint(v, &mut bad)),
            b"incomplete" => h.incomplete = flag(v, &mut bad),
            b"worker" if !is_nil(v) => info = Some(read_info(v)),
            b"digest" if !is_nil(v) => match read_digest(v) {
                Some(d) => h.digest = Some(d),
                None => bad = true,
            },
            b"tier_digests" if !is_nil(v) => match read_tier_digests(v) {
                Some(d) => h.tier_digests = Some(d),
                None => bad = true,
            },
            b"group_digest" if !is_nil(v) => match read_digest(v) {
                Some(d) => h.group_digest = Some(d),
                None => bad = true,
            },
            _ => {}
        }
        Some(())
    });
    if read.is_none() {
        // Truncated or not msgpack at all, or msgpack but not a batch.
        return Err(if Rd::new(bytes).value().is_none() { DecodeError::NotMsgpack } else { DecodeError::BadBatch });
    }
    h.worker_id = worker.ok_or(DecodeError::BadBatch)?;
    if bad {
        return Err(DecodeError::BadBatch);
    }
    Ok(EventBatch { header: h, worker: info, events })
}

/// A batch's `digest`: `[blocks, sum]`.
fn read_digest(v: &[u8]) -> Option<Digest> {
    let mut rd = Rd::new(v);
    let Head::Array(2) = rd.head()? else { return None };
    match (rd.head()?, rd.head()?) {
        (Head::Uint(blocks), Head::Uint(sum)) => Some(Digest { blocks, sum }),
        _ => None,
    }
}

/// A batch's `tier_digests`: `[[host blocks, sum], [disk blocks, sum]]`.
fn read_tier_digests(v: &[u8]) -> Option<[Digest; 2]> {
    let mut rd = Rd::new(v);
    let Head::Array(2) = rd.head()? else { return None };
    let host = read_digest(rd.value()?)?;
    let disk = read_digest(rd.value()?)?;
    Some([host, disk])
}

/// A batch's `worker` map (`name`, and optionally `url`, `model`, `block_size`), checked.
fn read_info(v: &[u8]) -> Result<WorkerInfo, &'static str> {
    const MALFORMED: &str = "worker: a map with a string name, and optionally url, model and block_size";
    let text = |v: &[u8]| match Rd::new(v).head() {
        Some(Head::Str(s)) => std::str::from_utf8(s).ok().map(str::to_owned).ok_or(MALFORMED),
        _ => Err(MALFORMED),
    };
    let mut info = WorkerInfo::default();
    let mut rd = Rd::new(v);
    let mut failed = None;
    fields(&mut rd, &["name", "url", "model", "block_size"], |k, rd| {
        let v = rd.value()?;
        let read = match k {
            b"name" => text(v).map(|t| info.name = t),
            b"url" if !is_nil(v) => text(v).map(|t| info.url = Some(t)),
            b"model" if !is_nil(v) => text(v).map(|t| info.model = Some(t)),
            b"block_size" if !is_nil(v) => match Rd::new(v).head() {
                Some(Head::Uint(n)) => u32::try_from(n).map(|n| info.block_size = Some(n)).map_err(|_| MALFORMED),
                _ => Err(MALFORMED),
            },
            _ => Ok(()),
        };
        failed = failed.or(read.err());
        Some(())
    })
    .ok_or(MALFORMED)?;
    if let Some(why) = failed {
        return Err(why);
    }
    info.check()?;
    Ok(info)
}

/// Writes one event: maps, with each block in the positional form `[block_hash, tokens_hash]`.
pub fn write_event(out: &mut Vec<u8>, e: &KvEvent) {
    match &e.data {
        Event::Stored { parent, blocks, tier } => write_stored(out, e.event_id, *parent, blocks, *tier),
        Event::Removed { hashes, tier } => write_removed(out, e.event_id, hashes, *tier),
        Event::Cleared => write_cleared(out, e.event_id),
        Event::GroupStored { group, kind, hashes } => write_group_stored(out, e.event_id, *group, *kind, hashes),
        Event::GroupRemoved { group, hashes } => write_group_removed(out, e.event_id, *group, hashes),
    }
}

fn write_event_head(out: &mut Vec<u8>, event_id: u64) {
    use rmp::encode::{write_map_len, write_str, write_uint};
    // Writing to a Vec cannot fail: the results here and below are all Ok.
    let _ = write_map_len(out, 2);
    let _ = write_str(out, "event_id");
    let _ = write_uint(out, event_id);
    let _ = write_str(out, "data");
}

/// Writes a `stored` event without building a [`KvEvent`].
pub fn write_stored(out: &mut Vec<u8>, event_id: u64, parent: Option<BlockHash>, blocks: &[StoredBlock], tier: Tier) {
    use rmp::encode::{write_array_len, write_map_len, write_nil, write_str, write_uint};
    write_event_head(out, event_id);
    let _ = write_map_len(out, 1);
    let _ = write_str(out, "stored");
    let _ = write_map_len(out, 3);
    let _ = write_str(out, "parent_hash");
    match parent {
        Some(p) => {
            let _ = write_uint(out, p.0);
        }
        None => {
            let _ = write_nil(out);
        }
    }
    let _ = write_str(out, "blocks");
    let _ = write_array_len(out, blocks.len() as u32);
    // Blocks in the positional form [block_hash, tokens_hash]: half the bytes of a map.
    for b in blocks {
        let _ = write_array_len(out, 2);
        let _ = write_uint(out, b.block_hash.0);
        let _ = write_uint(out, b.tokens_hash.0);
    }
    let _ = write_str(out, "tier");
    let _ = write_str(out, tier.as_str());
}

/// Writes a `removed` event; the tier is written only when it is not `device`, the default.
pub fn write_removed(out: &mut Vec<u8>, event_id: u64, hashes: &[BlockHash], tier: Tier) {
    use rmp::encode::{write_array_len, write_map_len, write_str, write_uint};
    write_event_head(out, event_id);
    let _ = write_map_len(out, 1);
    let _ = write_str(out, "removed");
    let _ = write_map_len(out, if tier == Tier::Device { 1 } else { 2 });
    let _ = write_str(out, "block_hashes");
    let _ = write_array_len(out, hashes.len() as u32);
    for h in hashes {
        let _ = write_uint(out, h.0);
    }
    if tier != Tier::Device {
        let _ = write_str(out, "tier");
        let _ = write_str(out, tier.as_str());
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) {
    let _ = rmp::encode::write_array_len(out, hashes.len() as u32);
    for h in hashes {
        let _ = rmp::encode::write_uint(out, h.0);
    }
}

/// Writes a `stored` event of a hybrid model's other group: `group`, `kind` (and
/// `window_blocks`), `block_hashes`.
pub fn write_group_stored(out: &mut Vec<u8>, event_id: u64, group: u8, kind: GroupKind, hashes: &[BlockHash]) {
    use rmp::encode::{write_map_len, write_str, write_uint};
    write_event_head(out, event_id);
    let _ = write_map_len(out, 1);
    let _ = write_str(out, "stored");
    let window = match kind {
        GroupKind::Window { blocks } => Some(blocks),
        _ => None,
    };
    let _ = write_map_len(out, if window.is_some() { 4 } else { 3 });
    let _ = write_str(out, "group");
    let _ = write_uint(out, u64::from(group));
    let _ = write_str(out, "kind");
    let _ = write_str(out, kind_name(kind));
    if let Some(blocks) = window {
        let _ = write_str(out, "window_blocks");
        let _ = write_uint(out, u64::from(blocks));
    }
    let _ = write_str(out, "block_hashes");
    write_hashes(out, hashes);
}

/// Writes a `removed` event of a hybrid model's other group.
pub fn write_group_removed(out: &mut Vec<u8>, event_id: u64, group: u8, hashes: &[BlockHash]) {
    use rmp::encode::{write_map_len, write_str, write_uint};
    write_event_head(out, event_id);
    let _ = write_map_len(out, 1);
    let _ = write_str(out, "removed");
    let _ = write_map_len(out, 2);
    let _ = write_str(out, "group");
    let _ = write_uint(out, u64::from(group));
    let _ = write_str(out, "block_hashes");
    write_hashes(out, hashes);
}

/// A group kind's protocol name.
pub fn kind_name(kind: GroupKind) -> &'static str {
    match kind {
        GroupKind::Full => "full",
        GroupKind::Window { .. } => "window",
        GroupKind::State => "state",
    }
}

/// Writes a `cleared` event.
pub fn write_cleared(out: &mut Vec<u8>, event_id: u64) {
    write_event_head(out, event_id);
    let _ = rmp::encode::write_str(out, "cleared");
}

/// The envelope of a batch: everything but its events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchHeader {
    /// The engine instance; must equal the worker id of the subject it came on.
    pub worker_id: u64,
    /// Data-parallel rank: each rank has its own cache and event sequence.
    pub dp_rank: u32,
    /// Changes when the publisher restarts: kvindex then clears the worker first.
    pub epoch: u64,
    /// Publish time (ns since the Unix epoch), for event lag; 0: not measured.
    pub ts_ns: u64,
    /// Part of an answer to a resync request: the worker's whole block set.
    pub snapshot: bool,
    /// The last batch of a snapshot: the worker is whole again if no event was missed.
    pub snapshot_end: bool,
    /// The id the publisher will give its next event (optional): lets a heartbeat reveal
    /// events lost at the tail of the stream.
    pub next_event_id: Option<u64>,
    /// The publisher knows its block set misses blocks its engine holds (it started after
    /// the engine, or lost events it could not recover): lookups flag the worker stale while
    /// its batches say so. Written only when true.
    pub incomplete: bool,
    /// The digest of the device blocks the publisher holds after every event before
    /// `next_event_id` (sent with it, once a heartbeat interval): kvindex compares it with
    /// its own and resyncs a worker that drifted.
    pub digest: Option<Digest>,
    /// The digests of the host and disk blocks the publisher holds, at the same point as
    /// `digest` (sent with it by publishers that follow those tiers).
    pub tier_digests: Option<[Digest; 2]>,
    /// The digest of the (group, hash) pairs a hybrid model's other groups hold, at the same
    /// point as `digest` (sent with it by publishers that have seen a group).
    pub group_digest: Option<Digest>,
}

/// Writes a batch's envelope, up to and including the length of its `events` list; the
/// caller appends `events` events written with [`write_event`].
pub fn write_batch_header(out: &mut Vec<u8>, h: &BatchHeader, events: u32) {
    write_batch_header_named(out, h, None, events)
}

/// Writes a batch's envelope as [`write_batch_header`] does, with what the publisher says its
/// engine is (`worker`) when given.
pub fn write_batch_header_named(out: &mut Vec<u8>, h: &BatchHeader, worker: Option<&WorkerInfo>, events: u32) {
    use rmp::encode::{write_array_len, write_bool, write_map_len, write_str, write_uint};
    let optional = h.next_event_id.is_some() as u32
        + h.incomplete as u32
        + worker.is_some() as u32
        + h.digest.is_some() as u32
        + h.tier_digests.is_some() as u32
        + h.group_digest.is_some() as u32;
    let _ = write_map_len(out, 7 + optional);
    if let Some(info) = worker {
        write_info(out, info);
    }
    for (k, v) in [("worker_id", h.worker_id), ("dp_rank", h.dp_rank as u64), ("epoch", h.epoch), ("ts_ns", h.ts_ns)] {
        let _ = write_str(out, k);
        let _ = write_uint(out, v);
    }
    if let Some(n) = h.next_event_id {
        let _ = write_str(out, "next_event_id");
        let _ = write_uint(out, n);
    }
    for (k, v) in [("snapshot", h.snapshot), ("snapshot_end", h.snapshot_end)] {
        let _ = write_str(out, k);
        let _ = write_bool(out, v);
    }
    if h.incomplete {
        let _ = write_str(out, "incomplete");
        let _ = write_bool(out, true);
    }
    let write_digest = |out: &mut Vec<u8>, d: Digest| {
        let _ = write_array_len(out, 2);
        let _ = write_uint(out, d.blocks);
        let _ = write_uint(out, d.sum);
    };
    if let Some(d) = h.digest {
        let _ = write_str(out, "digest");
        write_digest(out, d);
    }
    if let Some(tiers) = h.tier_digests {
        let _ = write_str(out, "tier_digests");
        let _ = write_array_len(out, 2);
        for d in tiers {
            write_digest(out, d);
        }
    }
    if let Some(d) = h.group_digest {
        let _ = write_str(out, "group_digest");
        write_digest(out, d);
    }
    let _ = write_str(out, "events");
    let _ = write_array_len(out, events);
}

/// Writes `"worker": {name, url?, model?, block_size?}`.
fn write_info(out: &mut Vec<u8>, info: &WorkerInfo) {
    use rmp::encode::{write_map_len, write_str, write_uint};
    let _ = write_str(out, "worker");
    let texts = [("url", info.url.as_deref()), ("model", info.model.as_deref())];
    let _ = write_map_len(out, 1 + texts.iter().filter(|(_, t)| t.is_some()).count() as u32 + info.block_size.is_some() as u32);
    let _ = write_str(out, "name");
    let _ = write_str(out, &info.name);
    for (k, t) in texts {
        if let Some(t) = t {
            let _ = write_str(out, k);
            let _ = write_str(out, t);
        }
    }
    if let Some(n) = info.block_size {
        let _ = write_str(out, "block_size");
        let _ = write_uint(out, n as u64);
    }
}

/// Encodes a batch (map form, blocks as pairs); events that are errors are left out.
pub fn encode_batch(b: &EventBatch) -> Vec<u8> {
    let events: Vec<&KvEvent> = b.events.iter().filter_map(|e| e.as_ref().ok()).collect();
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    let worker = b.worker.as_ref().and_then(|w| w.as_ref().ok());
    write_batch_header_named(&mut out, &b.header, worker, events.len() as u32);
    for e in events {
        write_event(&mut out, e);
    }
    out
}

/// Checks a subject prefix (`kv`, `llama.70b`): subjects are built under it, so it is a
/// non-empty NATS subject without wildcards, spaces or a trailing dot.
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    if prefix.is_empty() || prefix.contains(['*', '>', ' ']) || prefix.ends_with('.') || prefix.starts_with('.') {
        return Err("must be a non-empty NATS subject without wildcards, spaces or a trailing dot".into());
    }
    Ok(())
}

/// A request's blocks, as a lookup and an announcement both give them (each message carries
/// these keys flat, for a decoder as fast as the plain struct's): their local hashes, or the
/// token ids with what hashes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockSpec<'a> {
    /// Local hashes of the blocks.
    pub block_hashes: Option<&'a [u64]>,
    /// Or the token ids.
    pub tokens: Option<&'a [u32]>,
    /// Tokens per block, for `tokens`.
    pub block_size: Option<u32>,
    /// The LoRA adapter, for `tokens`.
    pub lora_name: Option<&'a str>,
    /// The cache salt, for `tokens`.
    pub salt: Option<&'a str>,
    /// Tokens past each block its hash covers, for `tokens`.
    pub lookahead: Option<u32>,
}

/// The [`BlockSpec`] of a message that carries the six block keys (a lookup, an announcement).
macro_rules! block_spec_of {
    ($message:expr) => {
        BlockSpec {
            block_hashes: $message.block_hashes.as_deref(),
            tokens: $message.tokens.as_deref(),
            block_size: $message.block_size,
            lora_name: $message.lora_name.as_deref(),
            salt: $message.salt.as_deref(),
            lookahead: $message.lookahead,
        }
    };
}

impl BlockSpec<'_> {
    /// The blocks are given one way: hashes, or tokens with a block size above 0.
    pub fn check(&self) -> Result<(), String> {
        match (self.block_hashes.is_some(), self.tokens.is_some(), self.block_size) {
            (true, false, _) => Ok(()),
            (false, true, Some(bs)) if bs > 0 => Ok(()),
            (false, true, _) => Err("tokens need a block_size above 0".into()),
            (true, true, _) => Err("give block_hashes or tokens, not both".into()),
            (false, false, _) => Err("give block_hashes or tokens".into()),
        }
    }

    /// The local hashes to match, at most `limit` (blocks past the index's depth limit can
    /// never match, so they are not hashed).
    pub fn local_hashes(&self, limit: usize) -> Vec<LocalHash> {
        match (self.block_hashes, self.tokens) {
            (Some(h), _) => h.iter().take(limit).map(|&h| LocalHash(h)).collect(),
            (None, Some(t)) => {
                let bs = self.block_size.unwrap_or(0) as usize;
                let ahead = self.lookahead.unwrap_or(0) as usize;
                let t = &t[..t.len().min(limit.saturating_mul(bs).saturating_add(ahead))];
                local_hashes_ahead(t, bs, self.lora_name, self.salt, ahead)
            }
            (None, None) => Vec::new(),
        }
    }
}

/// A router's question (msgpack map).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LookupRequest {
    /// Local hashes of the request's blocks (unsigned or, from int64-only languages, signed).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "any_int_hashes")]
    pub block_hashes: Option<Vec<u64>>,
    /// Or the token ids, hashed here with `block_size`, `lora_name` and `salt`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    /// Tokens per block, for `tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// The LoRA adapter, for `tokens`: blocks of other adapters never match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// The cache salt (tenant isolation), for `tokens`: it changes the first block's hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
    /// Lookahead hashing, for `tokens`: each block's identity also covers this many tokens
    /// after it, as the engine's `num_hash_lookahead_tokens` (vLLM) makes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookahead: Option<u32>,
    /// Only these worker ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<Vec<u64>>,
    /// Only the first `max_blocks` blocks are matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_blocks: Option<u64>,
    /// At most this many matches, the deepest (by default every match, as far as one NATS
    /// message holds); where the cut falls among workers tied at one depth, those kept rotate
    /// from one lookup to the next.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_matches: Option<u32>,
    /// Answer in `groups`, one entry per distinct answer with its workers, rather than one
    /// entry per worker in `matches`: a thousand workers at one depth cost one entry.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grouped: bool,
    /// Tiers to match in: `device` (the default), `host`, `disk`. Device depth is a match's
    /// `blocks`; the others come in its `tiers`. A worker matching in any asked tier is listed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiers: Option<Vec<String>>,
    /// "I am sending this request to this worker": kvindex announces it on `{prefix}.routed`
    /// for every replica, as if the router had (see [`Routed`]), after answering.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route_to: Option<WorkerRef>,
    /// Say what each worker of the answer is (its name, URL, model), where its publisher said:
    /// the answer's `names`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub names: bool,
    /// When the router sent it, ns since the Unix epoch: kvindex times the hop to it
    /// (`kvindex_lookup_transit_seconds`). [`crate::LookupClient`] sets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_ns: Option<u64>,
}

/// Now, in ns since the Unix epoch: the wire's clock (`ts_ns`, `sent_ns`); 0 before 1970.
pub fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A 64-bit hash sent as an unsigned or a signed (two's complement) msgpack integer.
struct AnyInt64(u64);

impl<'de> Deserialize<'de> for AnyInt64 {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = AnyInt64;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a 64-bit integer")
            }
            fn visit_u64<E>(self, v: u64) -> Result<AnyInt64, E> {
                Ok(AnyInt64(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<AnyInt64, E> {
                Ok(AnyInt64(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}

/// Deserializes optional 64-bit hashes sent as unsigned or signed (two's complement)
/// integers, as `block_hashes` fields take them.
pub fn any_int_hashes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
    let hashes: Option<Vec<AnyInt64>> = Option::deserialize(d)?;
    Ok(hashes.map(|h| h.into_iter().map(|h| h.0).collect()))
}

impl LookupRequest {
    /// Decodes and checks a request; the error text goes back to the router.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let req: LookupRequest = rmp_serde::from_slice(bytes).map_err(|e| format!("undecodable lookup request: {e}"))?;
        req.tier_list()?;
        req.blocks().check()?;
        Ok(req)
    }

    /// The tiers asked for, in order, without repeats (device when none is named); an error
    /// names a tier that is not `device`, `host` or `disk`.
    pub fn tier_list(&self) -> Result<Vec<Tier>, String> {
        let Some(names) = &self.tiers else { return Ok(vec![Tier::Device]) };
        if names.is_empty() {
            return Err("tiers is empty: name device, host or disk".into());
        }
        let mut out = Vec::with_capacity(3);
        for n in names {
            let t = Tier::parse(n.as_bytes()).ok_or_else(|| format!("unknown tier {n:?}: use device, host or disk"))?;
            if !out.contains(&t) {
                out.push(t);
            }
        }
        Ok(out)
    }

    /// The request's blocks.
    pub fn blocks(&self) -> BlockSpec<'_> {
        block_spec_of!(self)
    }

    /// The local hashes to match, at most `limit`.
    pub fn local_hashes(&self, limit: usize) -> Vec<LocalHash> {
        self.blocks().local_hashes(limit)
    }

    /// The announcement `route_to` asks for: this request's blocks, hashed once here.
    pub fn routed(&self, limit: usize) -> Option<Routed> {
        let to = self.route_to?;
        let hashes = self.local_hashes(limit).into_iter().map(|h| h.0).collect();
        Some(Routed { worker_id: to.worker_id, dp_rank: to.dp_rank, block_hashes: Some(hashes), ..Routed::default() })
    }
}

/// A router's announcement on `{prefix}.routed` (msgpack map): it sent a request with these
/// blocks to this worker. kvindex holds them as predicted for that worker until its events
/// show them or `predicted_ttl` passes (or, for a routed-only worker, as its blocks).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routed {
    /// The engine instance the request went to.
    pub worker_id: u64,
    /// Its data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// Local hashes of the request's blocks.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "any_int_hashes")]
    pub block_hashes: Option<Vec<u64>>,
    /// Or its token ids, hashed with `block_size`, `lora_name` and `salt` as in a lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
    /// Tokens per block, for `tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// The LoRA adapter, for `tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// The cache salt, for `tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub salt: Option<String>,
    /// Lookahead tokens per block, for `tokens`, as in a lookup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookahead: Option<u32>,
}

impl Routed {
    /// Decodes and checks an announcement; the error says what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let r: Routed = rmp_serde::from_slice(bytes).map_err(|e| format!("undecodable announcement: {e}"))?;
        r.blocks().check()?;
        Ok(r)
    }

    /// The msgpack bytes of the announcement.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// The announced blocks.
    pub fn blocks(&self) -> BlockSpec<'_> {
        block_spec_of!(self)
    }

    /// The announced blocks' local hashes, at most `limit`.
    pub fn local_hashes(&self, limit: usize) -> Vec<LocalHash> {
        self.blocks().local_hashes(limit)
    }
}

/// One worker in a lookup answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchEntry {
    /// The engine instance.
    pub worker_id: u64,
    /// Its data-parallel rank.
    pub dp_rank: u32,
    /// Length of the longest contiguous prefix of the request it holds.
    pub blocks: u32,
    /// The worker's state is being resynchronised; its answer may be out of date.
    pub stale: bool,
    /// Depths in the host and disk tiers, for a request that asked for them (`tiers`).
    #[serde(default, skip_serializing_if = "TierDepths::is_empty")]
    pub tiers: TierDepths,
    /// The prefix it holds or was announced to receive (on `{prefix}.routed`, within
    /// `predicted_ttl`), where announcements reach past `blocks`; a worker with `blocks` 0 is
    /// listed for its predictions alone. Never counted in `blocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_blocks: Option<u32>,
    /// A routed-only worker (approximate mode): its `blocks` are what routers announced for
    /// it, not what its engine reported.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approximate: bool,
}

/// A worker's contiguous match depth in the host and disk tiers; a tier the request did not
/// ask for is absent. Device is [`MatchEntry::blocks`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierDepths {
    /// Blocks of the prefix held in host memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<u32>,
    /// Blocks of the prefix held on disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<u32>,
}

impl TierDepths {
    /// Neither tier asked for.
    pub fn is_empty(&self) -> bool {
        self.host.is_none() && self.disk.is_none()
    }
}

/// Workers with the same answer, as a grouped answer lists them (`grouped` in the request).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatchGroup {
    /// Its workers, each `[worker_id, dp_rank]`.
    pub workers: Vec<WorkerPair>,
    /// Length of the longest contiguous prefix of the request each holds.
    pub blocks: u32,
    /// Their states are being resynchronised (see [`MatchEntry::stale`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stale: bool,
    /// Depths in the host and disk tiers, for a request that asked for them.
    #[serde(default, skip_serializing_if = "TierDepths::is_empty")]
    pub tiers: TierDepths,
    /// As [`MatchEntry::predicted_blocks`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_blocks: Option<u32>,
    /// As [`MatchEntry::approximate`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub approximate: bool,
}

/// A worker and rank as a pair, `[worker_id, dp_rank]`: the compact form a group lists.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerPair(pub u64, pub u32);

impl MatchGroup {
    /// The group's workers as one entry each.
    pub fn entries(&self) -> impl Iterator<Item = MatchEntry> + '_ {
        self.workers.iter().map(move |w| MatchEntry {
            worker_id: w.0,
            dp_rank: w.1,
            blocks: self.blocks,
            stale: self.stale,
            tiers: self.tiers,
            predicted_blocks: self.predicted_blocks,
            approximate: self.approximate,
        })
    }

    /// Whether `e` carries this group's answer.
    pub fn same_answer(&self, e: &MatchEntry) -> bool {
        (self.blocks, self.stale, self.tiers, self.predicted_blocks, self.approximate)
            == (e.blocks, e.stale, e.tiers, e.predicted_blocks, e.approximate)
    }
}

impl MatchGroup {
    /// The wire form of one group of a domain answer.
    fn of(depths: Depths, workers: &[WorkerId]) -> MatchGroup {
        MatchGroup {
            workers: workers.iter().map(|w| WorkerPair(w.worker_id, w.dp_rank)).collect(),
            blocks: depths.blocks,
            stale: depths.stale,
            tiers: TierDepths { host: depths.host, disk: depths.disk },
            predicted_blocks: depths.predicted,
            approximate: depths.approximate,
        }
    }
}

/// Upper bound of one encoded match (with both tiers' depths, a prediction and the
/// approximate flag) or stale worker, and of an answer's envelope, in bytes. A group of a
/// grouped answer costs one entry and each of its workers an eighth of one (16 bytes).
const ENTRY_BYTES: usize = 128;

/// Entries (matches and stale workers together) that fit in one NATS message of `max_payload`.
pub fn entries_that_fit(max_payload: usize) -> usize {
    max_payload.saturating_sub(ENTRY_BYTES) / ENTRY_BYTES
}

/// The groups that fit in `room` entries, deepest first, the last one cut if need be; and the
/// entries they take. In a grouped answer a group costs one entry and each of its workers an
/// eighth of one; in a flat one each worker is an entry of its own.
fn fit(mut groups: Vec<MatchGroup>, room: usize, grouped: bool) -> (Vec<MatchGroup>, usize) {
    let cost = |workers: usize| if grouped { 1 + workers.div_ceil(8) } else { workers };
    let mut used = 0;
    for (i, g) in groups.iter_mut().enumerate() {
        if used + cost(g.workers.len()) > room {
            let left = if grouped { room.saturating_sub(used + 1) * 8 } else { room - used };
            g.workers.truncate(left);
            let keep = i + usize::from(!g.workers.is_empty());
            used += if g.workers.is_empty() { 0 } else { cost(g.workers.len()) };
            groups.truncate(keep);
            return (groups, used);
        }
        used += cost(g.workers.len());
    }
    (groups, used)
}

/// One entry per worker, deepest first, ties by worker (the order a v1 answer promises).
fn flat(groups: &[MatchGroup]) -> Vec<MatchEntry> {
    let mut out = Vec::with_capacity(groups.iter().map(|g| g.workers.len()).sum());
    for g in groups {
        let from = out.len();
        out.extend(g.entries());
        out[from..].sort_unstable_by_key(|e: &MatchEntry| (e.worker_id, e.dp_rank));
    }
    out
}

/// Which shard of how many answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardOf {
    /// The shard, from 0.
    pub shard: u32,
    /// How many shards the deployment has.
    pub shards: u32,
}

/// A worker and rank, as named in a lookup answer's `stale_workers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerRef {
    /// The engine instance.
    pub worker_id: u64,
    /// Its data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
}

/// A worker of an answer and what its publisher says it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedWorker {
    /// The engine instance.
    pub worker_id: u64,
    /// Its name, URL, model and block size.
    #[serde(flatten)]
    pub info: WorkerInfo,
}

/// The answer to a lookup: matches deepest first, or an error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LookupResponse {
    /// Workers holding at least the first block, deepest first.
    Matches {
        /// One entry per matching worker, deepest first (empty in a grouped answer).
        matches: Vec<MatchEntry>,
        /// In a grouped answer, the workers with the same answer together, deepest first.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        groups: Vec<MatchGroup>,
        /// In a sharded deployment, the shard that answered and how many there are (each
        /// shard answers for its own workers; a client merges the answers of all of them).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        shard: Option<ShardOf>,
        /// A merged answer that lacks the shards named here (they did not answer in time): the
        /// workers they own are missing from it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        missing_shards: Vec<u32>,
        /// Workers being resynchronised that match nothing: a worker that lost its blocks
        /// would otherwise just be absent, and a partial answer would look like a true one.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        stale_workers: Vec<WorkerRef>,
        /// For a request that asked (`names`): what each named worker of the answer is.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        names: Vec<NamedWorker>,
    },
    /// Why the request could not be answered.
    Error {
        /// The reason, for the router's logs.
        error: String,
    },
}

impl LookupResponse {
    /// The wire form of a domain answer: in `groups` (`grouped`) or one entry per worker in
    /// `matches`, the deepest first, the stale workers that match nothing after them, never
    /// more than `room` entries together (see [`entries_that_fit`]).
    pub fn from_answer(answer: &Answer, grouped: bool, room: usize, shard: Option<ShardOf>) -> LookupResponse {
        let groups = answer.groups().map(|(depths, workers)| MatchGroup::of(depths, workers)).collect();
        let (groups, used) = fit(groups, room, grouped);
        let stale_workers = answer
            .stale_workers()
            .iter()
            .take(room.saturating_sub(used))
            .map(|w| WorkerRef { worker_id: w.worker_id, dp_rank: w.dp_rank })
            .collect();
        let (matches, groups) = if grouped { (Vec::new(), groups) } else { (flat(&groups), Vec::new()) };
        LookupResponse::Matches { matches, groups, shard, missing_shards: Vec::new(), stale_workers, names: Vec::new() }
    }

    /// The msgpack bytes of the answer.
    pub fn encode(&self) -> Vec<u8> {
        // Serialising these plain structs to a Vec cannot fail.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }
}

/// kvindex's request on `{prefix}.resync.{worker_id}`: send this rank's whole block set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncRequest {
    /// The worker asked.
    pub worker_id: u64,
    /// The rank asked; a publisher answers only for its own rank.
    #[serde(default)]
    pub dp_rank: u32,
}

impl ResyncRequest {
    /// The msgpack bytes of the request.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// `None` for a payload that is not a request (publishers then answer anyway).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        rmp_serde::from_slice(bytes).ok()
    }
}

/// A publisher's reply to a [`ResyncRequest`]: its snapshot of `blocks` blocks is on its way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResyncAck {
    /// The worker answering.
    pub worker_id: u64,
    /// Its rank.
    pub dp_rank: u32,
    /// Its epoch: the snapshot's batches carry it.
    pub epoch: u64,
    /// Blocks the snapshot will hold.
    pub blocks: u64,
}

impl ResyncAck {
    /// The msgpack bytes of the ack.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_answer_fits_in_one_message_grouped_or_flat() {
        // Every worker of a large fleet at one depth, and stale workers beside them.
        let mut answer = Answer::default();
        let workers: Vec<WorkerId> = (0..20_000).map(|i| WorkerId::new(u64::MAX - i, u32::MAX)).collect();
        answer.push_group(Depths { blocks: u32::MAX, stale: true, ..Depths::default() }, &workers);
        answer.set_stale_workers((0..5_000).map(|i| WorkerId::new(i, 0)).collect());
        for max_payload in [64 << 10, 1 << 20] {
            let room = entries_that_fit(max_payload);
            for grouped in [false, true] {
                let bytes = LookupResponse::from_answer(&answer, grouped, room, None).encode();
                assert!(bytes.len() <= max_payload, "grouped {grouped}: {} bytes over {max_payload}", bytes.len());
            }
        }
        // A flat answer lists as many workers as fit, each an entry of its own.
        let LookupResponse::Matches { matches, stale_workers, .. } = LookupResponse::from_answer(&answer, false, 100, None)
        else {
            panic!("an answer")
        };
        assert_eq!((matches.len(), stale_workers.len()), (100, 0));
    }

    #[test]
    fn a_full_answer_fits_in_one_message() {
        for max_payload in [4096usize, 1 << 20, 8 << 20] {
            let n = entries_that_fit(max_payload);
            let tiers = TierDepths { host: Some(u32::MAX), disk: Some(u32::MAX) };
            let widest = MatchEntry {
                worker_id: u64::MAX,
                dp_rank: u32::MAX,
                blocks: u32::MAX,
                stale: true,
                tiers,
                predicted_blocks: Some(u32::MAX),
                approximate: true,
            };
            let stale = WorkerRef { worker_id: u64::MAX, dp_rank: u32::MAX };
            for split in [0, n / 2, n] {
                let answer = LookupResponse::Matches {
                    matches: vec![widest.clone(); split],
                    groups: vec![],
                    shard: None,
                    missing_shards: vec![],
                    stale_workers: vec![stale; n - split],
                    names: Vec::new(),
                };
                assert!(answer.encode().len() <= max_payload, "{split} of {n} entries overflow {max_payload}");
            }
        }
    }
    use kvindex_core::hash::local_hashes;

    #[test]
    fn announcements_decode_as_lookups_do() {
        let by_tokens = Routed { worker_id: 3, tokens: Some((0..40).collect()), block_size: Some(16), ..Routed::default() };
        let back = Routed::decode(&by_tokens.encode()).unwrap();
        assert_eq!(back.local_hashes(usize::MAX), local_hashes(&(0..40).collect::<Vec<_>>(), 16, None, None));
        // Signed hashes (int64-only languages) read as their two's complement; dp_rank defaults to 0.
        let signed = enc(Value::Map(vec![
            (Value::from("worker_id"), Value::from(9)),
            (Value::from("block_hashes"), Value::Array(vec![Value::from(-1), Value::from(5)])),
        ]));
        let back = Routed::decode(&signed).unwrap();
        assert_eq!((back.worker_id, back.dp_rank), (9, 0));
        assert_eq!(back.local_hashes(1), vec![LocalHash(u64::MAX)]);
        for bad in [Routed { worker_id: 1, ..Routed::default() }, Routed { tokens: Some(vec![1]), ..Routed::default() }] {
            assert!(Routed::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        assert!(Routed::decode(b"\xc1").is_err());
    }

    use rmpv::Value;

    fn field<'a>(map: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
        map.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    fn event_value(e: &KvEvent) -> Value {
        let mut buf = Vec::new();
        write_event(&mut buf, e);
        rmpv::decode::read_value(&mut &buf[..]).unwrap()
    }

    fn enc(v: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &v).unwrap();
        out
    }

    fn stored(id: u64, parent: Option<u64>, blocks: &[(u64, u64)]) -> KvEvent {
        KvEvent::stored(id, parent, blocks)
    }

    #[test]
    fn batch_round_trips() {
        let batch = EventBatch {
            header: BatchHeader {
                worker_id: 7,
                dp_rank: 1,
                epoch: 3,
                ts_ns: 1_700_000_000_000_000_000,
                snapshot: true,
                snapshot_end: false,
                next_event_id: None,
                incomplete: false,
                digest: None,
                tier_digests: None,
                group_digest: None,
            },
            worker: None,
            events: vec![
                Ok(KvEvent { event_id: 0, data: Event::Cleared }),
                Ok(stored(1, None, &[(u64::MAX, 5), (11, 6)])),
                Ok(KvEvent { event_id: 2, data: Event::Removed { hashes: vec![BlockHash(11)], tier: Tier::Device } }),
            ],
        };
        assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
    }

    #[test]
    fn a_batch_says_what_its_engine_is_and_a_bad_word_of_it_spares_the_events() {
        let info = WorkerInfo {
            name: "vllm-0".into(),
            url: Some("http://10.0.0.1:8000".into()),
            model: Some("llama".into()),
            block_size: Some(16),
        };
        let events = vec![Ok(stored(0, None, &[(1, 2)]))];
        let named = EventBatch { header: BatchHeader { worker_id: 7, ..Default::default() }, worker: Some(Ok(info)), events };
        assert_eq!(decode_batch(&encode_batch(&named)).unwrap(), named);
        let only_name = EventBatch { worker: Some(Ok(WorkerInfo::named("a"))), ..named.clone() };
        assert_eq!(decode_batch(&encode_batch(&only_name)).unwrap(), only_name);

        let with_worker = |worker: Value| {
            let mut v = rmpv::decode::read_value(&mut &encode_batch(&EventBatch { worker: None, ..named.clone() })[..]).unwrap();
            if let Value::Map(m) = &mut v {
                m.push((Value::from("worker"), worker));
            }
            decode_batch(&enc(v)).unwrap()
        };
        let map = |kv: Vec<(&str, Value)>| Value::Map(kv.into_iter().map(|(k, v)| (Value::from(k), v)).collect());
        for bad in [
            Value::from(5),
            map(vec![("name", Value::from(5))]),
            map(vec![("url", Value::from("http://x"))]),
            map(vec![("name", Value::from("a")), ("block_size", Value::from(-1))]),
            map(vec![("name", Value::from("a")), ("block_size", Value::from(0))]),
            map(vec![("name", Value::from("x".repeat(300)))]),
        ] {
            let got = with_worker(bad.clone());
            assert!(matches!(got.worker, Some(Err(_))), "{bad:?}: {:?}", got.worker);
            assert_eq!(got.events, named.events, "the events stand: {bad:?}");
        }
        assert_eq!(with_worker(Value::Nil).worker, None);
    }

    #[test]
    fn group_events_name_their_group_and_kind() {
        let ev = KvEvent {
            event_id: 3,
            data: Event::GroupStored { group: 2, kind: GroupKind::Window { blocks: 8 }, hashes: vec![BlockHash(5)] },
        };
        let v = event_value(&ev);
        let body = field(field(v.as_map().unwrap(), "data").unwrap().as_map().unwrap(), "stored").unwrap().as_map().unwrap();
        assert_eq!(field(body, "group").unwrap().as_u64(), Some(2));
        assert_eq!(field(body, "kind").unwrap().as_str(), Some("window"));
        assert_eq!(field(body, "window_blocks").unwrap().as_u64(), Some(8));
        // Group 0 is the primary group: a plain stored or removed event.
        let group_event = |body: Vec<(&str, Value)>, kind: &str| {
            let body = Value::Map(body.into_iter().map(|(k, v)| (Value::from(k), v)).collect());
            let data = Value::Map(vec![(Value::from(kind), body)]);
            decode_event(&enc(Value::Map(vec![(Value::from("event_id"), Value::from(1)), (Value::from("data"), data)])))
                .map(|e| e.data)
        };
        let hashes = || Value::Array(vec![Value::from(9)]);
        assert_eq!(group_event(vec![("group", Value::from(0)), ("block_hashes", hashes())], "removed"), Ok(Event::removed(&[9])));
        assert_eq!(
            group_event(vec![("group", Value::from(63)), ("block_hashes", hashes())], "removed"),
            Ok(Event::GroupRemoved { group: 63, hashes: vec![BlockHash(9)] })
        );
        for bad in [
            vec![("group", Value::from(64)), ("kind", Value::from("full")), ("block_hashes", hashes())],
            vec![("group", Value::from(1)), ("kind", Value::from("chunked")), ("block_hashes", hashes())],
            vec![("group", Value::from(1)), ("kind", Value::from("window")), ("block_hashes", hashes())],
            vec![
                ("group", Value::from(1)),
                ("kind", Value::from("window")),
                ("window_blocks", Value::from(0)),
                ("block_hashes", hashes()),
            ],
            vec![
                ("group", Value::from(1)),
                ("kind", Value::from("state")),
                ("tier", Value::from("host")),
                ("block_hashes", hashes()),
            ],
            vec![("group", Value::from(-1)), ("kind", Value::from("state")), ("block_hashes", hashes())],
        ] {
            assert_eq!(group_event(bad.clone(), "stored"), Err(DecodeError::BadGroup), "{bad:?}");
        }
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
        assert_eq!((b.header.worker_id, b.header.dp_rank, b.header.epoch, b.header.snapshot), (5, 0, 0, false));
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
        assert_eq!(
            (b.header.worker_id, b.header.dp_rank, b.header.epoch, b.header.ts_ns, b.header.snapshot_end),
            (9, 2, 1, 100, false)
        );
        assert_eq!(
            b.events,
            vec![Ok(KvEvent {
                event_id: 2,
                data: Event::Stored { parent: None, blocks: vec![StoredBlock::new(u64::MAX, 3)], tier: Tier::Host }
            })]
        );
    }

    #[test]
    fn map_form_blocks_in_any_key_order_with_unknown_keys() {
        let block = Value::Map(vec![
            ("note".into(), Value::Array(vec![1.into(), Value::Map(vec![("x".into(), 2.into())])])),
            ("tokens_hash".into(), 8.into()),
            ("block_hash".into(), 7.into()),
        ]);
        let body = Value::Map(vec![("blocks".into(), Value::Array(vec![block])), ("parent_hash".into(), 6.into())]);
        let ev = Value::Map(vec![
            ("data".into(), Value::Map(vec![("stored".into(), body)])),
            ("event_id".into(), 3.into()),
            ("trace".into(), "abc".into()),
        ]);
        let batch = Value::Map(vec![
            ("events".into(), Value::Array(vec![ev])),
            ("next_event_id".into(), 4.into()),
            ("worker_id".into(), 1.into()),
        ]);
        let b = decode_batch(&enc(batch)).unwrap();
        assert_eq!(b.header.next_event_id, Some(4));
        assert_eq!(b.events, vec![Ok(KvEvent::stored(3, Some(6), &[(7, 8)]))]);
    }

    #[test]
    fn lengths_that_lie_cost_nothing() {
        // Arrays that claim 2^32-1 items and hold one: rejected without reserving for the claim.
        let liar = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x01];
        let removed =
            [&[0x82, 0xa8][..], b"event_id", &[0x01, 0xa4], b"data", &[0x81, 0xa7], b"removed", &[0x91], &liar].concat();
        assert_eq!(decode_event(&removed), Err(DecodeError::BadEvent));
        let batch = [&[0x82, 0xa9][..], b"worker_id", &[0x01, 0xa6], b"events", &liar].concat();
        assert_eq!(decode_batch(&batch), Err(DecodeError::NotMsgpack));
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
        assert_eq!(back.local_hashes(usize::MAX), vec![LocalHash(1), LocalHash(2)]);

        let tokens: Vec<u32> = (0..40).collect();
        let by_tokens = LookupRequest {
            tokens: Some(tokens.clone()),
            block_size: Some(16),
            lora_name: Some("a".into()),
            ..Default::default()
        };
        let back = LookupRequest::decode(&rmp_serde::to_vec_named(&by_tokens).unwrap()).unwrap();
        assert_eq!(back.local_hashes(usize::MAX), local_hashes(&tokens, 16, Some("a"), None));
        assert_eq!(back.local_hashes(usize::MAX).len(), 2);
        let ahead = LookupRequest { lookahead: Some(9), salt: Some("t".into()), ..by_tokens };
        let back = LookupRequest::decode(&rmp_serde::to_vec_named(&ahead).unwrap()).unwrap();
        assert_eq!(back.local_hashes(usize::MAX), local_hashes_ahead(&tokens, 16, Some("a"), Some("t"), 9));
        assert_eq!(back.local_hashes(1), local_hashes_ahead(&tokens[..25], 16, Some("a"), Some("t"), 9));
        assert_eq!(back.local_hashes(usize::MAX).len(), 1, "the second block has only 8 tokens after it");

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
        let one = vec![MatchEntry {
            worker_id: 3,
            dp_rank: 0,
            blocks: 9,
            stale: false,
            tiers: Default::default(),
            ..Default::default()
        }];
        let ok = LookupResponse::Matches {
            matches: one.clone(),
            groups: vec![],
            shard: None,
            missing_shards: vec![],
            stale_workers: vec![],
            names: Vec::new(),
        };
        let v = rmpv::decode::read_value(&mut &ok.encode()[..]).unwrap();
        let matches = field(v.as_map().unwrap(), "matches").unwrap().as_array().unwrap();
        assert_eq!(field(matches[0].as_map().unwrap(), "blocks").unwrap().as_u64(), Some(9));
        assert!(field(v.as_map().unwrap(), "stale_workers").is_none(), "left out when empty, as before the field");
        let with_stale = LookupResponse::Matches {
            matches: one,
            groups: vec![],
            shard: None,
            missing_shards: vec![],
            stale_workers: vec![WorkerRef { worker_id: 4, dp_rank: 1 }],
            names: Vec::new(),
        };
        let v = rmpv::decode::read_value(&mut &with_stale.encode()[..]).unwrap();
        let stale = field(v.as_map().unwrap(), "stale_workers").unwrap().as_array().unwrap();
        assert_eq!(field(stale[0].as_map().unwrap(), "dp_rank").unwrap().as_u64(), Some(1));
        assert_eq!(rmp_serde::from_slice::<LookupResponse>(&with_stale.encode()).unwrap(), with_stale);
        let err = LookupResponse::Error { error: "nope".into() };
        let v = rmpv::decode::read_value(&mut &err.encode()[..]).unwrap();
        assert_eq!(field(v.as_map().unwrap(), "error").unwrap().as_str(), Some("nope"));
    }

    proptest::proptest! {
        /// Whatever arrives, decoding returns; and every valid batch survives a round trip.
        #[test]
        fn never_panics_and_round_trips(
            ids in proptest::collection::vec((proptest::prelude::any::<u64>(), proptest::prelude::any::<u64>()), 0..20),
            cut in 0usize..400,
            flip in proptest::prelude::any::<(usize, u8)>(),
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        ) {
            let events = ids.iter().enumerate().map(|(i, &(b, t))| Ok(match i % 5 {
                0 => stored(i as u64, (i > 0).then_some(b ^ 1), &[(b, t), (t, b)]),
                1 => KvEvent { event_id: i as u64, data: Event::removed(&[b]) },
                2 => {
                    let kind = [GroupKind::Full, GroupKind::State, GroupKind::Window { blocks: (t % 300) as u32 + 1 }][i % 3];
                    KvEvent { event_id: i as u64, data: Event::GroupStored { group: (b % 63) as u8 + 1, kind, hashes: vec![BlockHash(t)] } }
                }
                3 => KvEvent { event_id: i as u64, data: Event::GroupRemoved { group: (t % 63) as u8 + 1, hashes: vec![BlockHash(b)] } },
                _ => KvEvent { event_id: i as u64, data: Event::Cleared },
            })).collect();
            let next_event_id = (ids.len() % 2 == 0).then_some(ids.len() as u64);
            let incomplete = ids.len() % 3 == 0;
            let digest = (ids.len() % 4 == 1).then(|| Digest { blocks: ids.len() as u64, sum: ids.first().map_or(0, |x| x.0) });
            let tier_digests = (ids.len() % 5 == 1).then_some([Digest { blocks: 1, sum: u64::MAX }, Digest { blocks: ids.len() as u64, sum: 7 }]);
            let group_digest = (ids.len() % 3 == 2).then_some(Digest { blocks: 2, sum: ids.len() as u64 });
            let header = BatchHeader { worker_id: 3, dp_rank: 1, epoch: 2, ts_ns: 9, snapshot: true, snapshot_end: false, next_event_id, incomplete, digest, tier_digests, group_digest };
            let batch = EventBatch { header, worker: None, events };
            let bytes = encode_batch(&batch);
            proptest::prop_assert_eq!(decode_batch(&bytes).unwrap(), batch);
            let _ = decode_batch(&bytes[..cut.min(bytes.len())]);
            let mut bent = bytes.clone();
            if !bent.is_empty() {
                let i = flip.0 % bent.len();
                bent[i] ^= flip.1;
            }
            let _ = decode_batch(&bent);
            let _ = decode_batch(&noise);
        }
    }

    #[test]
    fn removed_carries_its_tier_and_device_stays_the_old_bytes() {
        let device = KvEvent { event_id: 4, data: Event::removed(&[7, 8]) };
        let host = KvEvent { event_id: 5, data: Event::Removed { hashes: vec![BlockHash(7)], tier: Tier::Host } };
        for e in [&device, &host] {
            let mut out = Vec::new();
            write_event(&mut out, e);
            assert_eq!(decode_event(&out), Ok(e.clone()));
        }
        assert_eq!(
            event_value(&device),
            Value::Map(vec![
                ("event_id".into(), 4.into()),
                (
                    "data".into(),
                    Value::Map(vec![(
                        "removed".into(),
                        Value::Map(vec![("block_hashes".into(), Value::Array(vec![7.into(), 8.into()]))])
                    )])
                ),
            ]),
            "a device removal is written as before the field existed"
        );
        let positional = Value::Array(vec![
            6.into(),
            Value::Map(vec![("removed".into(), Value::Array(vec![Value::Array(vec![9.into()]), "disk".into()]))]),
        ]);
        assert_eq!(
            decode_event(&enc(positional)),
            Ok(KvEvent { event_id: 6, data: Event::Removed { hashes: vec![BlockHash(9)], tier: Tier::Disk } })
        );
        let bad = Value::Map(vec![
            ("event_id".into(), 1.into()),
            (
                "data".into(),
                Value::Map(vec![(
                    "removed".into(),
                    Value::Map(vec![("block_hashes".into(), Value::Array(vec![])), ("tier".into(), "tape".into())]),
                )]),
            ),
        ]);
        assert_eq!(decode_event(&enc(bad)), Err(DecodeError::BadTier));
    }

    #[test]
    fn lookups_take_signed_hashes_as_their_twos_complement() {
        let req = Value::Map(vec![("block_hashes".into(), Value::Array(vec![(-1i64).into(), 5u64.into(), (i64::MIN).into()]))]);
        let got = LookupRequest::decode(&enc(req)).unwrap();
        assert_eq!(got.block_hashes, Some(vec![u64::MAX, 5, 1 << 63]));
        let bad = Value::Map(vec![("block_hashes".into(), Value::Array(vec!["x".into()]))]);
        assert!(LookupRequest::decode(&enc(bad)).is_err());
    }

    proptest::proptest! {
        /// Routers' and kvindex's requests decode or fail cleanly whatever the bytes: random
        /// ones, and valid requests cut short or with a byte flipped.
        #[test]
        fn request_decoders_never_panic(
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            hashes in proptest::collection::vec(proptest::prelude::any::<i64>(), 0..40),
            cut in 0usize..600,
            flip in proptest::prelude::any::<(usize, u8)>(),
        ) {
            let _ = LookupRequest::decode(&noise);
            let _ = ResyncRequest::decode(&noise);
            let req = Value::Map(vec![
                ("block_hashes".into(), Value::Array(hashes.iter().map(|&h| h.into()).collect())),
                ("max_matches".into(), 3.into()),
                ("workers".into(), Value::Array(vec![1.into(), 2.into()])),
            ]);
            let mut bytes = enc(req);
            let ok = LookupRequest::decode(&bytes).expect("a valid request");
            proptest::prop_assert_eq!(ok.local_hashes(usize::MAX).len(), hashes.len());
            if !bytes.is_empty() {
                let at = flip.0 % bytes.len();
                bytes[at] ^= flip.1;
            }
            let _ = LookupRequest::decode(&bytes);
            let _ = LookupRequest::decode(&bytes[..cut.min(bytes.len())]);
        }
    }
}
