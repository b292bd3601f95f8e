//! The publisher: the piece that runs beside an inference engine. The engine
//! reports what it stored, removed or cleared; the publisher keeps the worker's current block
//! set, numbers events under a fresh epoch per process, batches them (size and linger bounds),
//! sends heartbeats when idle, and answers kvindex's resync requests with a snapshot of the
//! block set in chunks under the NATS payload limit. While NATS is away, batches wait in a
//! bounded queue; the overflow is dropped and counted, and the gap it leaves is healed by the
//! resync that kvindex asks for (or broadcasts after its own reconnect).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use kvindex_client::core::{BlockHash, StoredBlock};
//! use kvindex_client::{Publisher, PublisherConfig};
//!
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let publisher = Publisher::start(client, PublisherConfig::new("kv", 7, 0)).await?;
//! // The engine cached two blocks of a new request, then evicted the second.
//! publisher.stored(None, &[StoredBlock::new(100, 0xa1), StoredBlock::new(101, 0xb2)]);
//! publisher.removed(&[BlockHash(101)]);
//! publisher.flush().await; // batches also go out by themselves after `linger`
//! # Ok(()) }
//! ```

use crate::error::ClientError;
use crate::protocol::{
    write_batch_header_named, write_cleared, write_group_removed, write_group_stored, write_removed, write_stored, BatchHeader,
    ResyncAck, ResyncRequest,
};
use crate::shards::ResyncShard;
use async_nats::{Client, Subject};
use bytes::Bytes;
use futures::StreamExt;
use kvindex_core::digest::{group_member, Digest};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::names::WorkerInfo;
use kvindex_core::{Event, GroupKind, Tier};
use parking_lot::Mutex;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;

/// Bytes one block can take in a `stored` event (`[u64, u64]` in msgpack).
const BLOCK_BYTES: usize = 19;
/// Bytes a `stored` event takes besides its blocks, at most.
const STORED_OVERHEAD: usize = 80;
/// Bytes one hash takes in a `removed` event, and the event's other bytes at most.
const HASH_BYTES: usize = 9;
const REMOVED_OVERHEAD: usize = 48;
/// Room kept for a batch's envelope (its digests included).
const HEADER_BYTES: usize = 256;

/// How a publisher batches and where it sends.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Subject prefix, as kvindex's `prefix`.
    pub prefix: String,
    /// The engine instance: the publisher writes `{prefix}.events.{worker_id}`.
    pub worker_id: u64,
    /// Its data-parallel rank (one publisher per rank).
    pub dp_rank: u32,
    /// This process's epoch. The default, the start time in nanoseconds, changes at every
    /// restart, which tells kvindex to drop what the worker held before.
    pub epoch: u64,
    /// A batch is sent once it holds this many events...
    pub max_batch_events: usize,
    /// ...or this many bytes (snapshot chunks too, and never above the server's payload limit)...
    pub max_batch_bytes: usize,
    /// ...or when its first event has waited this long (zero: every call sends at once).
    pub linger: Duration,
    /// An empty batch is sent after this long without one, so kvindex knows the worker lives.
    pub heartbeat: Duration,
    /// Batches waiting for NATS; beyond this they are dropped (and later resynced).
    pub queue_capacity: usize,
    /// Durable mode: publish through JetStream, each batch of events with the message id
    /// `{worker}-{dp rank}-{epoch}-{first event id}` and waiting (pipelined) for the stream's
    /// acknowledgement. A batch not acknowledged is sent again, with those after it, in order,
    /// until acknowledged (for up to 30 s), under the same ids, which the stream's
    /// de-duplication window keeps from landing twice. Off: plain publishes, which a stream
    /// captures all the same, without confirmation.
    pub jetstream_acks: bool,
    /// What the engine is (name, serving URL, model, block size), said on the first batch,
    /// every snapshot and heartbeat, and at least once a heartbeat interval: kvindex lists it
    /// and routers read it from answers. `None`: the worker is known by its id alone.
    pub worker: Option<WorkerInfo>,
}

impl PublisherConfig {
    /// Defaults for worker `worker_id`, rank `dp_rank`, under `prefix`.
    pub fn new(prefix: &str, worker_id: u64, dp_rank: u32) -> Self {
        PublisherConfig {
            prefix: prefix.into(),
            worker_id,
            dp_rank,
            epoch: SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
            max_batch_events: 256,
            max_batch_bytes: 64 * 1024,
            linger: Duration::from_millis(2),
            heartbeat: Duration::from_secs(1),
            queue_capacity: 4096,
            jetstream_acks: false,
            worker: None,
        }
    }

    /// Defaults for the engine `info` names, rank `dp_rank`, under `prefix`: its worker id is
    /// the one its name stands for ([`WorkerInfo::worker_id`]).
    pub fn named(prefix: &str, info: WorkerInfo, dp_rank: u32) -> Self {
        PublisherConfig { worker: Some(info.clone()), ..PublisherConfig::new(prefix, info.worker_id(), dp_rank) }
    }
}

/// What a publisher has done, for its host's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Events sent.
    pub events: u64,
    /// Batches sent (event batches and heartbeats).
    pub batches: u64,
    /// Empty batches sent to show the worker is alive.
    pub heartbeats: u64,
    /// Snapshots sent in answer to resync requests.
    pub snapshots: u64,
    /// Batches dropped because NATS could not take them in time.
    pub dropped_batches: u64,
    /// Blocks left out of snapshots because their parent is not held (not reachable by any lookup).
    pub orphans_skipped: u64,
    /// With `jetstream_acks`: batches the stream acknowledged...
    pub acked: u64,
    /// ...and batches it did not, though sent again for 30 s (kvindex sees the gap and resyncs).
    pub unacked: u64,
}

#[derive(Default)]
struct Counters {
    events: AtomicU64,
    batches: AtomicU64,
    heartbeats: AtomicU64,
    snapshots: AtomicU64,
    dropped_batches: AtomicU64,
    orphans_skipped: AtomicU64,
    acked: AtomicU64,
    unacked: AtomicU64,
}

struct Block {
    parent: Option<BlockHash>,
    tokens_hash: LocalHash,
}

struct Inner {
    /// The blocks held, per tier (device, host, disk): what a snapshot sends.
    blocks: [FxHashMap<BlockHash, Block>; 3],
    /// A hybrid model's other groups: each group's kind and the hashes it holds (sent after
    /// the chains in a snapshot, so the primary group's blocks place them).
    groups: BTreeMap<u8, (GroupKind, FxHashSet<BlockHash>)>,
    next_id: u64,
    /// Encoded events of the batch being filled.
    pending: Vec<u8>,
    pending_events: u32,
    pending_since: Option<Instant>,
    last_sent: Instant,
    /// Dropping batches right now (to log once per episode).
    dropping: bool,
    /// The host said its block set misses blocks the engine holds ([`Publisher::set_incomplete`]):
    /// every batch says so until it is whole again.
    incomplete: bool,
    /// When a batch last said what the engine is (`None`: not yet).
    named_at: Option<Instant>,
    /// The digest of the blocks held in each tier (`blocks[t]`'s keys), kept as they come and go.
    digest: [Digest; 3],
    /// A host or disk block was ever held: batches that carry the device digest carry the
    /// other tiers' too.
    tiered: bool,
    /// The digest of the (group, hash) pairs `groups` holds, kept as they come and go.
    group_digest: Digest,
    /// When a batch last carried the digest (`None`: not yet).
    digested_at: Option<Instant>,
    /// Test builds: the next event is kept in the block set but never sent, as a bridge that
    /// loses an event silently would (no gap in the ids: only the digest can tell).
    #[cfg(feature = "fault-injection")]
    lose_next: bool,
}

enum Out {
    /// A message, with its JetStream message id if it carries events.
    Batch(Bytes, Option<String>),
    Flushed(oneshot::Sender<()>),
}

struct Shared {
    cfg: PublisherConfig,
    inner: Mutex<Inner>,
    out: mpsc::Sender<Out>,
    wake: Notify,
    counters: Counters,
    /// Largest message, from the server's payload limit and `max_batch_bytes`.
    max_message: usize,
    /// Most blocks of one `stored` event, and hashes of one `removed` event, that fit it.
    max_event_blocks: usize,
    max_event_hashes: usize,
}

/// A worker's publisher. Dropping it stops it at once, without a goodbye, as a crash would;
/// [`Publisher::close`] sends what is pending first.
pub struct Publisher {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Publisher {
    /// Subscribes to the resync subjects and starts sending.
    pub async fn start(client: Client, cfg: PublisherConfig) -> Result<Publisher, ClientError> {
        let nats = |what: &str, e: &dyn std::fmt::Display| ClientError::Nats(format!("{what}: {e}"));
        let worker_resync = client
            .subscribe(format!("{}.resync.{}", cfg.prefix, cfg.worker_id))
            .await
            .map_err(|e| nats("subscribing to per-worker resync requests", &e))?;
        let all_resync =
            client.subscribe(format!("{}.resync", cfg.prefix)).await.map_err(|e| nats("subscribing to resync broadcasts", &e))?;
        client.flush().await.map_err(|e| nats("flushing subscriptions", &e))?;
        let server_max = client.server_info().max_payload;
        let server_max = if server_max == 0 { 1 << 20 } else { server_max };
        // A batch that says what the engine is carries that beside its envelope.
        let info_bytes = cfg.worker.as_ref().map_or(0, |i| {
            let mut out = Vec::new();
            write_batch_header_named(&mut out, &BatchHeader::default(), Some(i), 0);
            out.len()
        });
        let max_message =
            cfg.max_batch_bytes.min(server_max).saturating_sub(info_bytes).max(HEADER_BYTES + STORED_OVERHEAD + BLOCK_BYTES);
        let (tx, rx) = mpsc::channel(cfg.queue_capacity.max(1));
        let subject: Subject = format!("{}.events.{}", cfg.prefix, cfg.worker_id).into();
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                blocks: Default::default(),
                groups: BTreeMap::new(),
                next_id: 0,
                pending: Vec::with_capacity(max_message),
                pending_events: 0,
                pending_since: None,
                last_sent: Instant::now(),
                dropping: false,
                incomplete: false,
                named_at: None,
                digest: Default::default(),
                group_digest: Digest::default(),
                tiered: false,
                digested_at: None,
                #[cfg(feature = "fault-injection")]
                lose_next: false,
            }),
            out: tx,
            wake: Notify::new(),
            counters: Counters::default(),
            max_message,
            max_event_blocks: (max_message - HEADER_BYTES - STORED_OVERHEAD) / BLOCK_BYTES,
            max_event_hashes: (max_message - HEADER_BYTES - REMOVED_OVERHEAD) / HASH_BYTES,
            cfg,
        });
        let tasks = vec![
            tokio::spawn(send_loop(client.clone(), subject, rx, shared.clone())),
            tokio::spawn(control_loop(client, shared.clone(), worker_resync, all_resync)),
        ];
        Ok(Publisher { shared, tasks })
    }

    /// Reports one domain event: what an engine, a replay stream or a bridge saw, whichever
    /// its kind (the methods below, one per kind, are the same thing spelled out).
    pub fn publish(&self, event: &Event) {
        match event {
            Event::Stored { parent, blocks, tier } => self.stored_in(*tier, *parent, blocks),
            Event::Removed { hashes, tier } => self.removed_in(*tier, hashes),
            Event::Cleared => self.cleared(),
            Event::GroupStored { group, kind, hashes } => self.group_stored(*group, *kind, hashes),
            Event::GroupRemoved { group, hashes } => self.group_removed(*group, hashes),
        }
    }

    /// The engine cached `blocks`, a chain under `parent` (`None`: from the first position).
    /// A chain too long for one message goes out as several events, each under the last.
    pub fn stored(&self, parent: Option<BlockHash>, blocks: &[StoredBlock]) {
        self.stored_in(Tier::Device, parent, blocks);
    }

    /// As [`Publisher::stored`], in `tier` (blocks offloaded to host memory or disk).
    pub fn stored_in(&self, tier: Tier, parent: Option<BlockHash>, blocks: &[StoredBlock]) {
        let s = &self.shared;
        let mut inner = s.inner.lock();
        let mut parent = parent;
        for piece in blocks.chunks(s.max_event_blocks) {
            let write = |out: &mut Vec<u8>, id| write_stored(out, id, parent, piece, tier);
            s.push_noting(&mut inner, STORED_OVERHEAD + BLOCK_BYTES * piece.len(), write, |inner| {
                inner.tiered |= tier != Tier::Device;
                let mut prev = parent;
                for b in piece {
                    let held = Block { parent: prev, tokens_hash: b.tokens_hash };
                    if inner.blocks[tier as usize].insert(b.block_hash, held).is_none() {
                        inner.digest[tier as usize].add(b.block_hash.0);
                    }
                    prev = Some(b.block_hash);
                }
            });
            parent = piece.last().map(|b| b.block_hash);
        }
    }

    /// The engine evicted `hashes` (several events if they do not fit one message).
    pub fn removed(&self, hashes: &[BlockHash]) {
        self.removed_in(Tier::Device, hashes);
    }

    /// As [`Publisher::removed`], from `tier` only: the other tiers' copies stay.
    pub fn removed_in(&self, tier: Tier, hashes: &[BlockHash]) {
        let s = &self.shared;
        let mut inner = s.inner.lock();
        for piece in hashes.chunks(s.max_event_hashes) {
            let write = |out: &mut Vec<u8>, id| write_removed(out, id, piece, tier);
            s.push_noting(&mut inner, REMOVED_OVERHEAD + HASH_BYTES * piece.len(), write, |inner| {
                for h in piece {
                    if inner.blocks[tier as usize].remove(h).is_some() {
                        inner.digest[tier as usize].remove(h.0);
                    }
                }
            });
        }
    }

    /// A hybrid model's other group `group` (1..=63, of `kind`) cached `hashes`: blocks the
    /// primary group (the chains of [`Publisher::stored`]) holds under the same hashes.
    pub fn group_stored(&self, group: u8, kind: GroupKind, hashes: &[BlockHash]) {
        let s = &self.shared;
        let mut inner = s.inner.lock();
        inner.groups.entry(group).or_insert_with(|| (kind, FxHashSet::default())).0 = kind;
        for piece in hashes.chunks(s.max_event_hashes) {
            let write = |out: &mut Vec<u8>, id| write_group_stored(out, id, group, kind, piece);
            s.push_noting(&mut inner, STORED_OVERHEAD + HASH_BYTES * piece.len(), write, |inner| {
                let Some((_, held)) = inner.groups.get_mut(&group) else { return };
                for h in piece {
                    if held.insert(*h) {
                        inner.group_digest.add(group_member(group, h.0));
                    }
                }
            });
        }
    }

    /// A hybrid model's other group `group` evicted `hashes`.
    pub fn group_removed(&self, group: u8, hashes: &[BlockHash]) {
        let s = &self.shared;
        let mut inner = s.inner.lock();
        for piece in hashes.chunks(s.max_event_hashes) {
            let write = |out: &mut Vec<u8>, id| write_group_removed(out, id, group, piece);
            s.push_noting(&mut inner, REMOVED_OVERHEAD + HASH_BYTES * piece.len(), write, |inner| {
                let Some((_, held)) = inner.groups.get_mut(&group) else { return };
                for h in piece {
                    if held.remove(h) {
                        inner.group_digest.remove(group_member(group, h.0));
                    }
                }
            });
        }
    }

    /// Test builds: the next event is kept in this publisher's block set and digest but never
    /// sent, and takes no event id: a bridge losing an event silently, which only the digest
    /// can tell.
    #[cfg(feature = "fault-injection")]
    pub fn lose_next_event(&self) {
        self.shared.inner.lock().lose_next = true;
    }

    /// The engine dropped every block, in every tier and group (e.g. a cache reset).
    pub fn cleared(&self) {
        let s = &self.shared;
        let mut inner = s.inner.lock();
        s.push_noting(&mut inner, REMOVED_OVERHEAD, write_cleared, |inner| {
            for tier in inner.blocks.iter_mut() {
                tier.clear();
            }
            (inner.digest, inner.group_digest) = Default::default();
            for (_, held) in inner.groups.values_mut() {
                held.clear();
            }
        });
    }

    /// Says whether this publisher's block set misses blocks its engine holds (a bridge that
    /// started after its engine, or lost events it could not recover). While it does, every
    /// batch (heartbeats too) carries `incomplete` and kvindex answers for the worker as
    /// `stale`; the next batch after `false` clears that.
    pub fn set_incomplete(&self, incomplete: bool) {
        let s = &self.shared;
        let mut inner = s.inner.lock();
        if inner.incomplete != incomplete {
            // What is pending was made under the old word; a heartbeat carries the new one now.
            s.send_pending(&mut inner, false, false);
            inner.incomplete = incomplete;
            s.heartbeat(&mut inner);
        }
    }

    /// Sends what is pending now instead of after the linger: for a caller that batches
    /// already (the bridge forwards an engine's batch as one message).
    pub fn send_now(&self) {
        let mut inner = self.shared.inner.lock();
        self.shared.send_pending(&mut inner, false, false);
    }

    /// Waits until the queue to NATS has room. Engines that would rather wait than drop
    /// batches (and have them resynced later) call it before reporting.
    pub async fn wait_for_room(&self) {
        if self.shared.out.capacity() == 0 {
            drop(self.shared.out.reserve().await);
        }
    }

    /// Sends what is pending and waits until NATS has it.
    pub async fn flush(&self) {
        {
            let mut inner = self.shared.inner.lock();
            self.shared.send_pending(&mut inner, false, false);
        }
        let (tx, rx) = oneshot::channel();
        if self.shared.out.send(Out::Flushed(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Sends what is pending, then stops.
    pub async fn close(self) {
        self.flush().await;
    }

    /// The worker this publisher speaks for.
    pub fn worker(&self) -> WorkerId {
        WorkerId::new(self.shared.cfg.worker_id, self.shared.cfg.dp_rank)
    }

    /// The epoch this publisher's events carry (its start time in ns).
    pub fn epoch(&self) -> u64 {
        self.shared.cfg.epoch
    }

    /// Blocks the worker holds now on the device.
    pub fn len(&self) -> usize {
        self.shared.inner.lock().blocks[Tier::Device as usize].len()
    }

    /// No block is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counters since start.
    pub fn stats(&self) -> PublisherStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PublisherStats {
            events: get(&c.events),
            batches: get(&c.batches),
            heartbeats: get(&c.heartbeats),
            snapshots: get(&c.snapshots),
            dropped_batches: get(&c.dropped_batches),
            orphans_skipped: get(&c.orphans_skipped),
            acked: get(&c.acked),
            unacked: get(&c.unacked),
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Shared {
    /// Appends one event (at most `size` bytes, written by `write` under the next event id),
    /// sending the batch first if the event would not fit and afterwards if it is full;
    /// `note` changes the block set (and its digest) as the event is numbered: a batch sent
    /// before it never counts its blocks, one sent after always does, so that a batch's digest
    /// is of the events before its `next_event_id`.
    fn push_noting(&self, inner: &mut Inner, size: usize, write: impl FnOnce(&mut Vec<u8>, u64), note: impl FnOnce(&mut Inner)) {
        #[cfg(feature = "fault-injection")]
        if std::mem::take(&mut inner.lose_next) {
            note(inner);
            return;
        }
        if inner.pending_events > 0 && inner.pending.len() + size + HEADER_BYTES > self.max_message {
            self.send_pending(inner, false, false);
        }
        let id = inner.next_id;
        inner.next_id += 1;
        write(&mut inner.pending, id);
        note(inner);
        inner.pending_events += 1;
        self.counters.events.fetch_add(1, Ordering::Relaxed);
        if inner.pending_events as usize >= self.cfg.max_batch_events
            || inner.pending.len() + HEADER_BYTES >= self.max_message
            || self.cfg.linger.is_zero()
        {
            self.send_pending(inner, false, false);
        } else if inner.pending_since.is_none() {
            inner.pending_since = Some(Instant::now());
            self.wake.notify_one();
        }
    }

    /// Sends the pending events as one batch (also when there are none: a heartbeat, or the
    /// last chunk of a snapshot).
    fn send_pending(&self, inner: &mut Inner, snapshot: bool, snapshot_end: bool) {
        if inner.pending_events == 0 && !snapshot {
            return;
        }
        let mut msg = Vec::with_capacity(HEADER_BYTES + inner.pending.len());
        let header = self.header(inner, snapshot, snapshot_end, false);
        write_batch_header_named(&mut msg, &header, self.naming(inner, snapshot), inner.pending_events);
        msg.extend_from_slice(&inner.pending);
        let first_id = inner.next_id - inner.pending_events as u64;
        let c = &self.cfg;
        let id = (c.jetstream_acks && inner.pending_events > 0)
            .then(|| format!("{}-{}-{}-{first_id}", c.worker_id, c.dp_rank, c.epoch));
        inner.pending.clear();
        inner.pending_events = 0;
        inner.pending_since = None;
        self.send(inner, msg.into(), id);
    }

    fn send(&self, inner: &mut Inner, msg: Bytes, id: Option<String>) {
        inner.last_sent = Instant::now();
        match self.out.try_send(Out::Batch(msg, id)) {
            Ok(()) => {
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
                if inner.dropping {
                    inner.dropping = false;
                    tracing::info!(worker = self.cfg.worker_id, "NATS takes batches again; kvindex will resync the gap");
                }
            }
            Err(_) => {
                self.counters.dropped_batches.fetch_add(1, Ordering::Relaxed);
                if !inner.dropping {
                    inner.dropping = true;
                    tracing::warn!(worker = self.cfg.worker_id, "NATS is not taking batches; dropping them until it does");
                }
            }
        }
    }

    /// This worker's envelope, stamped now; `next_event_id` tells kvindex what it should
    /// have seen by the end of this batch.
    /// The digest rides on heartbeats, on a snapshot's end, and once a heartbeat interval on
    /// a busy publisher.
    fn header(&self, inner: &mut Inner, snapshot: bool, snapshot_end: bool, heartbeat: bool) -> BatchHeader {
        let due = heartbeat || snapshot_end || inner.digested_at.is_none_or(|t| t.elapsed() >= self.cfg.heartbeat);
        if due {
            inner.digested_at = Some(Instant::now());
        }
        BatchHeader {
            worker_id: self.cfg.worker_id,
            dp_rank: self.cfg.dp_rank,
            epoch: self.cfg.epoch,
            ts_ns: crate::protocol::now_ns(),
            snapshot,
            snapshot_end,
            next_event_id: Some(inner.next_id),
            incomplete: inner.incomplete,
            digest: due.then_some(inner.digest[0]),
            tier_digests: (due && inner.tiered).then_some([inner.digest[1], inner.digest[2]]),
            group_digest: (due && !inner.groups.is_empty()).then_some(inner.group_digest),
        }
    }

    /// What the engine is, if this batch should say it: always (`always`: heartbeats and
    /// snapshots), on the first batch, and once a heartbeat interval on a busy publisher, so
    /// that kvindex learns it soon after its own restart.
    fn naming(&self, inner: &mut Inner, always: bool) -> Option<&WorkerInfo> {
        let info = self.cfg.worker.as_ref()?;
        let due = always || inner.named_at.is_none_or(|t| t.elapsed() >= self.cfg.heartbeat);
        if due {
            inner.named_at = Some(Instant::now());
        }
        due.then_some(info)
    }

    fn heartbeat(&self, inner: &mut Inner) {
        let mut msg = Vec::with_capacity(HEADER_BYTES);
        let header = self.header(inner, false, false, true);
        write_batch_header_named(&mut msg, &header, self.naming(inner, true), 0);
        self.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
        self.send(inner, msg.into(), None);
    }

    /// Sends the whole block set as snapshot batches: `cleared`, then chains, parents before
    /// children, in chunks under the message limit; event ids continue the sequence. Returns
    /// the blocks sent.
    fn snapshot(&self) -> usize {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        self.send_pending(inner, false, false);
        let id = inner.next_id;
        inner.next_id += 1;
        write_cleared(&mut inner.pending, id);
        inner.pending_events = 1;

        let mut sent = 0;
        let mut held = 0;
        for tier in [Tier::Device, Tier::Host, Tier::Disk] {
            held += inner.blocks[tier as usize].len();
            sent += self.snapshot_tier(inner, tier);
        }
        self.snapshot_groups(inner);
        self.send_pending(inner, true, true);
        let orphans = (held - sent) as u64;
        self.counters.orphans_skipped.fetch_add(orphans, Ordering::Relaxed);
        self.counters.snapshots.fetch_add(1, Ordering::Relaxed);
        sent
    }

    /// The other groups' blocks into the snapshot, after the chains that place them.
    fn snapshot_groups(&self, inner: &mut Inner) {
        let groups = std::mem::take(&mut inner.groups);
        let mut piece: Vec<BlockHash> = Vec::new();
        for (&group, (kind, held)) in &groups {
            let mut rest: Vec<BlockHash> = held.iter().copied().collect();
            // A group with no block still says its kind, so kvindex knows the group from now on.
            loop {
                let room = self.max_message.saturating_sub(inner.pending.len() + HEADER_BYTES + STORED_OVERHEAD) / HASH_BYTES;
                if room == 0 {
                    self.send_pending(inner, true, false);
                    continue;
                }
                let n = room.min(rest.len());
                piece.clear();
                piece.extend(rest.drain(..n));
                let id = inner.next_id;
                inner.next_id += 1;
                write_group_stored(&mut inner.pending, id, group, *kind, &piece);
                inner.pending_events += 1;
                if rest.is_empty() {
                    break;
                }
            }
        }
        inner.groups = groups;
    }

    /// One tier's chains into the snapshot, parents before children; the blocks sent.
    fn snapshot_tier(&self, inner: &mut Inner, tier: Tier) -> usize {
        let mut children: FxHashMap<BlockHash, Vec<BlockHash>> = FxHashMap::default();
        let mut stack: Vec<(Option<BlockHash>, BlockHash)> = Vec::new();
        for (&h, b) in &inner.blocks[tier as usize] {
            match b.parent {
                None => stack.push((None, h)),
                Some(p) => children.entry(p).or_default().push(h),
            }
        }
        let mut chain: Vec<StoredBlock> = Vec::new();
        let mut reached: Vec<BlockHash> = Vec::new();
        let mut sent = 0;
        while let Some((parent, start)) = stack.pop() {
            chain.clear();
            let mut cur = start;
            loop {
                chain.push(StoredBlock { block_hash: cur, tokens_hash: inner.blocks[tier as usize][&cur].tokens_hash });
                match children.get(&cur).map(Vec::as_slice) {
                    Some([first, rest @ ..]) => {
                        stack.extend(rest.iter().map(|&k| (Some(cur), k)));
                        cur = *first;
                    }
                    _ => break,
                }
            }
            sent += chain.len();
            reached.extend(chain.iter().map(|b| b.block_hash));
            // The chain in pieces that fit the current chunk; each piece hangs off the last.
            let mut parent = parent;
            let mut rest = &chain[..];
            while !rest.is_empty() {
                let room = self.max_message.saturating_sub(inner.pending.len() + HEADER_BYTES + STORED_OVERHEAD) / BLOCK_BYTES;
                if room == 0 {
                    self.send_pending(inner, true, false);
                    continue;
                }
                let (piece, tail) = rest.split_at(room.min(rest.len()));
                let id = inner.next_id;
                inner.next_id += 1;
                write_stored(&mut inner.pending, id, parent, piece, tier);
                inner.pending_events += 1;
                parent = piece.last().map(|b| b.block_hash);
                rest = tail;
            }
        }
        // Blocks no chain reaches (their parent is gone) are not sent, so kvindex will not
        // hold them: forgotten here too, so that the digest stays the digest of kvindex's.
        if sent < inner.blocks[tier as usize].len() {
            let reached: FxHashSet<BlockHash> = reached.into_iter().collect();
            inner.blocks[tier as usize].retain(|h, _| reached.contains(h));
            inner.digest[tier as usize] = Digest::of(inner.blocks[tier as usize].keys().map(|h| h.0));
        }
        sent
    }

    /// When the control loop must next look: the pending batch's linger, or the heartbeat.
    fn next_deadline(&self) -> Instant {
        let inner = self.inner.lock();
        match inner.pending_since {
            Some(t) => t + self.cfg.linger,
            None => inner.last_sent + self.cfg.heartbeat,
        }
    }

    fn tick(&self) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        match inner.pending_since {
            Some(t) if now >= t + self.cfg.linger => self.send_pending(&mut inner, false, false),
            None if now >= inner.last_sent + self.cfg.heartbeat => self.heartbeat(&mut inner),
            _ => {}
        }
    }
}

/// Acknowledgements a JetStream publisher waits for at once (the pipeline's depth).
const ACKS_IN_FLIGHT: usize = 256;

/// How long a batch the stream did not acknowledge is sent again before it counts as lost.
const RESEND_FOR: Duration = Duration::from_secs(30);

/// Hands batches to NATS in order (with `jetstream_acks`, through JetStream: see there).
async fn send_loop(client: Client, subject: Subject, mut rx: mpsc::Receiver<Out>, shared: Arc<Shared>) {
    let js = shared.cfg.jetstream_acks.then(|| async_nats::jetstream::new(client.clone()));
    let mut acks = std::collections::VecDeque::new();
    while let Some(out) = rx.recv().await {
        match (out, &js) {
            (Out::Batch(msg, Some(id)), Some(js)) => {
                if acks.len() >= ACKS_IN_FLIGHT {
                    settle(js, &subject, &mut acks, &shared).await;
                }
                let ack = js.send_publish(subject.clone(), publish(&msg, &id)).await;
                acks.push_back((msg, id, ack));
            }
            (Out::Batch(msg, _), _) => {
                if let Err(e) = client.publish(subject.clone(), msg).await {
                    tracing::warn!(%subject, "could not publish a batch: {e}");
                }
            }
            (Out::Flushed(done), _) => {
                if let Some(js) = &js {
                    while !acks.is_empty() {
                        settle(js, &subject, &mut acks, &shared).await;
                    }
                }
                let _ = client.flush().await;
                let _ = done.send(());
            }
        }
    }
}

/// A JetStream publish of `msg` under the message id `id`.
fn publish(msg: &Bytes, id: &str) -> async_nats::jetstream::context::Publish {
    async_nats::jetstream::context::Publish::build().message_id(id).payload(msg.clone())
}

/// A batch sent through JetStream and its acknowledgement, awaited later.
type PendingAck =
    (Bytes, String, Result<async_nats::jetstream::context::PublishAckFuture, async_nats::jetstream::context::PublishError>);

/// Waits for the oldest batch's acknowledgement. Without one (a stream leader election, a
/// dying server), that batch and every one sent after it go again, in order, one at a time,
/// each until acknowledged or `RESEND_FOR` passes: the stream then holds every batch in order
/// (the ids keep copies that did land from landing twice), so a fault costs kvindex a delay,
/// not a gap and a resync.
async fn settle(
    js: &async_nats::jetstream::Context,
    subject: &Subject,
    acks: &mut std::collections::VecDeque<PendingAck>,
    shared: &Shared,
) {
    let Some((msg, id, ack)) = acks.pop_front() else { return };
    let acked = match ack {
        Ok(ack) => ack.await.is_ok(),
        Err(_) => false,
    };
    if acked {
        shared.counters.acked.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let again: Vec<(Bytes, String)> = std::iter::once((msg, id)).chain(acks.drain(..).map(|(m, i, _)| (m, i))).collect();
    for (msg, id) in again {
        resend(js, subject, &msg, &id, shared).await;
    }
}

/// Sends one batch until the stream acknowledges it, with a doubling pause, for `RESEND_FOR`.
async fn resend(js: &async_nats::jetstream::Context, subject: &Subject, msg: &Bytes, id: &str, shared: &Shared) {
    let deadline = Instant::now() + RESEND_FOR;
    let mut pause = Duration::from_millis(50);
    loop {
        if let Ok(ack) = js.send_publish(subject.clone(), publish(msg, id)).await {
            if ack.await.is_ok() {
                shared.counters.acked.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        if Instant::now() > deadline {
            shared.counters.unacked.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%subject, id, "the stream did not acknowledge a batch for 30 s; kvindex will resync the gap");
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Linger, heartbeats and resync requests.
async fn control_loop(
    client: Client,
    shared: Arc<Shared>,
    mut worker_resync: async_nats::Subscriber,
    mut all_resync: async_nats::Subscriber,
) {
    loop {
        let deadline = shared.next_deadline();
        tokio::select! {
            _ = tokio::time::sleep_until(deadline.into()) => shared.tick(),
            _ = shared.wake.notified() => {}
            msg = worker_resync.next() => {
                let Some(msg) = msg else { return };
                // A request names a dp rank; ranks sharing a worker id answer only their own.
                let mine = ResyncRequest::decode(&msg.payload).is_none_or(|r| r.dp_rank == shared.cfg.dp_rank);
                if !mine {
                    continue;
                }
                let blocks = shared.snapshot();
                tracing::debug!(worker = shared.cfg.worker_id, blocks, "answered a resync request");
                if let Some(reply) = msg.reply {
                    let ack = ResyncAck { worker_id: shared.cfg.worker_id, dp_rank: shared.cfg.dp_rank, epoch: shared.cfg.epoch, blocks: blocks as u64 };
                    let _ = client.publish(reply, ack.encode().into()).await;
                }
            }
            msg = all_resync.next() => {
                let Some(msg) = msg else { return };
                // In a sharded deployment, a restarted shard asks only its own workers.
                if !ResyncShard::answers(&msg.payload, shared.cfg.worker_id) {
                    continue;
                }
                let blocks = shared.snapshot();
                tracing::debug!(worker = shared.cfg.worker_id, blocks, "answered a resync broadcast");
            }
        }
    }
}
