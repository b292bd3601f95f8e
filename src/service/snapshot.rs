//! JetStream mode's index snapshots (docs/OPERATIONS.md, "Durable mode (JetStream)"). One
//! replica at a time, the holder of a lease in the KV bucket `{stream}_LEASE`, writes the whole index with
//! every worker's sequence and the stream sequence they reflect to the object store
//! `{stream}_SNAPSHOTS`. A starting replica loads the newest snapshot and replays only the
//! stream after it; if the stream no longer holds that, it replays what the stream holds and
//! rebuilds the rest from the publishers (the broadcast resync of core mode).

use super::State;
use crate::apply::ApplyPool;
use async_nats::jetstream::{self, kv, object_store};
use kvindex_core::hash::WorkerId;
use kvindex_core::index::KvIndex;
use kvindex_core::model::SavedWorker;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, oneshot};

/// The snapshot format; a replica loads only its own (prefix hashes and backend keys are
/// kvindex's own choice, and may change with it).
const VERSION: u32 = 1;

/// A lease not renewed for this long is free for another replica to take.
const LEASE_TTL: Duration = Duration::from_secs(10);

/// The lease's key in its bucket.
const LEASE_KEY: &str = "snapshot-writer";

/// How often the snapshot task renews the lease and looks whether a snapshot is due.
const TICK: Duration = Duration::from_secs(1);

/// A snapshot object: the index as the events up to `stream_seq` left it.
#[derive(Serialize, Deserialize)]
pub(super) struct Snapshot {
    /// [`VERSION`] of the writer.
    version: u32,
    /// The backend that saved the blocks: their keys are its own.
    backend: String,
    /// The last stream message applied; a restore replays from the one after.
    pub(super) stream_seq: u64,
    /// When it was written (ns since the Unix epoch), for its age.
    written_ns: u64,
    /// Every worker tracked.
    workers: Vec<SnapshotWorker>,
}

/// One worker in a snapshot: its sequence and its blocks.
#[derive(Serialize, Deserialize)]
struct SnapshotWorker {
    /// Its publisher's epoch.
    epoch: u64,
    /// The event id expected next (`None`: none seen in this epoch).
    next_id: Option<u64>,
    /// Stale when saved: its blocks may be partial, so it is stale again once restored.
    stale: bool,
    /// Its blocks in every tier.
    saved: SavedWorker,
}

/// What the ingest loop hands the snapshot task between two messages: a consistent cut.
pub(super) struct Cut {
    /// The last stream message ingested.
    stream_seq: u64,
    /// Every worker's (epoch, next event id) after it.
    positions: Vec<(WorkerId, u64, Option<u64>)>,
    /// Workers stale at the cut.
    stale: HashSet<WorkerId>,
    /// The workers' blocks, saved by each apply thread after the events queued before the cut.
    saved: crossbeam_channel::Receiver<SavedWorker>,
}

/// The snapshot task asks the ingest loop for a cut with one of these.
pub(super) type CutRequest = oneshot::Sender<Cut>;

/// Takes a cut: called by the ingest loop, so no message is ingested meanwhile.
pub(super) fn cut<I: KvIndex>(state: &State, pool: &ApplyPool<I>, stream_seq: u64) -> Cut {
    let positions = state.cursors.lock().positions();
    let stale = state.stale.list().into_iter().collect();
    Cut { stream_seq, positions, stale, saved: pool.save() }
}

/// The snapshot bucket of `state`'s stream.
fn bucket(state: &State) -> String {
    format!("{}_SNAPSHOTS{}", state.cfg.stream_name(), shard_tag(state))
}

/// Object names sort by the stream sequence they reflect.
/// What tells one shard's snapshots and lease from another's (each shard saves its own
/// workers): `_S{k}OF{S}`, or nothing when the deployment is not sharded.
fn shard_tag(state: &State) -> String {
    state.cfg.shard_of().map_or_else(String::new, |s| format!("_S{}OF{}", s.shard, s.shards))
}

fn object_name(stream_seq: u64) -> String {
    format!("index-{stream_seq:020}")
}

fn seq_of(name: &str) -> Option<u64> {
    name.strip_prefix("index-")?.parse().ok()
}

/// The snapshots in the bucket, oldest first.
async fn list(store: &object_store::ObjectStore) -> anyhow::Result<Vec<(u64, String)>> {
    use futures::StreamExt;
    let mut found = Vec::new();
    let mut objects = store.list().await.map_err(|e| anyhow::anyhow!("listing snapshots: {e}"))?;
    while let Some(info) = objects.next().await {
        let info = info.map_err(|e| anyhow::anyhow!("listing snapshots: {e}"))?;
        if let (false, Some(seq)) = (info.deleted, seq_of(&info.name)) {
            found.push((seq, info.name));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest snapshot, if there is one this replica can use: same format and backend, and
/// the stream still holds every message after it (`first_seq` is the stream's first kept).
pub(super) async fn load(js: &jetstream::Context, state: &State, first_seq: u64) -> Option<(Snapshot, usize)> {
    let store = js.get_object_store(bucket(state)).await.ok()?;
    let found = match list(&store).await {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!("{e}; replaying the whole stream instead");
            return None;
        }
    };
    let (seq, name) = found.last()?.clone();
    if seq + 1 < first_seq {
        tracing::warn!(
            snapshot = %name, first_kept = first_seq,
            "the stream no longer holds the messages after the newest snapshot; replaying what it holds and asking the publishers"
        );
        return None;
    }
    let mut bytes = Vec::new();
    let read = async {
        let mut object = store.get(&name).await.map_err(|e| anyhow::anyhow!("{e}"))?;
        object.read_to_end(&mut bytes).await.map_err(anyhow::Error::from)
    };
    if let Err(e) = read.await {
        tracing::warn!(snapshot = %name, "reading the snapshot failed ({e}); replaying the whole stream instead");
        return None;
    }
    let snap: Snapshot = match rmp_serde::from_slice(&bytes) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(snapshot = %name, "the snapshot does not decode ({e}); replaying the whole stream instead");
            return None;
        }
    };
    let backend = state.cfg.backend.as_str();
    if snap.version != VERSION || snap.backend != backend || snap.stream_seq != seq {
        tracing::warn!(
            snapshot = %name, version = snap.version, backend = %snap.backend,
            "the snapshot is of another format or backend (this replica: version {VERSION}, {backend}); replaying the whole stream instead"
        );
        return None;
    }
    Some((snap, bytes.len()))
}

/// Puts a loaded snapshot's workers in the index (through their apply threads) and their
/// sequences in the cursors; waits until it is applied.
pub(super) async fn restore<I: KvIndex>(
    state: &Arc<State>,
    pool: &Arc<ApplyPool<I>>,
    snap: Snapshot,
    bytes: usize,
    began: Instant,
) {
    let (mut workers, mut blocks) = (0u64, 0usize);
    let written_ns = snap.written_ns;
    for w in snap.workers {
        let id = w.saved.worker;
        if !super::ingest::resume(state, id, w.epoch, w.next_id) {
            continue;
        }
        if w.stale {
            state.stale.mark(id, "stale_in_snapshot");
        }
        workers += 1;
        blocks += w.saved.device.blocks.len();
        pool.restore(w.saved);
    }
    let flushing = pool.clone();
    let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
    let took = began.elapsed().as_secs_f64();
    let metrics = &state.metrics;
    metrics.durable.snapshot_restore_seconds.set(took);
    metrics.durable.snapshot_bytes.set(bytes as i64);
    state.durable.snapshot_written.store(written_ns, Ordering::Relaxed);
    tracing::info!(
        stream_seq = snap.stream_seq,
        workers,
        device_blocks = blocks,
        bytes,
        seconds = took,
        "restored the index from the newest snapshot; replaying the stream after it"
    );
}

/// The snapshot writer: holds or waits for the lease, and while it holds it, writes a
/// snapshot every `snapshot_interval` seconds or `snapshot_events` stream messages.
pub(super) async fn snapshot_loop(js: jetstream::Context, state: Arc<State>, cuts: mpsc::Sender<CutRequest>) {
    let cfg = &state.cfg;
    if cfg.snapshot_interval == 0 && cfg.snapshot_events == 0 {
        return;
    }
    let me = bytes::Bytes::from(format!("{}-{}", std::process::id(), kvindex_core::seeded::process_seed()));
    let mut lease = Lease { bucket: None, revision: None };
    let mut last = (Instant::now(), state.durable.stream_seq.load(Ordering::Relaxed));
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        let held = lease.hold(&js, &state, &me).await;
        state.metrics.durable.snapshot_lease.set(held as i64);
        let seq = state.durable.stream_seq.load(Ordering::Relaxed);
        let by_time = cfg.snapshot_interval > 0 && last.0.elapsed() >= Duration::from_secs(cfg.snapshot_interval);
        let by_count = cfg.snapshot_events > 0 && seq.saturating_sub(last.1) >= cfg.snapshot_events;
        let whole = state.health.caught_up.is_done() && state.health.connected.load(Ordering::Relaxed);
        if !held || !whole || seq == last.1 || !(by_time || by_count) {
            continue;
        }
        match write(&js, &state, &cuts).await {
            Ok(Some(seq)) => last = (Instant::now(), seq),
            Ok(None) => return,
            Err(e) => {
                state.metrics.durable.snapshot_writes.with_label_values(&["error"]).inc();
                state.log.warn("snapshot_write", || format!("writing a snapshot failed: {e:#}"));
                last.0 = Instant::now();
            }
        }
    }
}

/// The snapshot lease: a key of a KV bucket whose entries expire after [`LEASE_TTL`].
struct Lease {
    bucket: Option<kv::Store>,
    /// The key's revision this replica wrote last, while it holds the lease.
    revision: Option<u64>,
}

impl Lease {
    /// Renews the lease, or takes it if it is free; whether this replica holds it.
    async fn hold(&mut self, js: &jetstream::Context, state: &State, me: &bytes::Bytes) -> bool {
        if self.bucket.is_none() {
            let name = format!("{}_LEASE{}", state.cfg.stream_name(), shard_tag(state));
            // The bucket's stream, made directly: `create_key_value` first reads the account
            // info, whose reply from nats-server 2.9 this client cannot parse.
            let made = js
                .get_or_create_stream(jetstream::stream::Config {
                    name: format!("KV_{name}"),
                    subjects: vec![format!("$KV.{name}.>")],
                    max_messages_per_subject: 1,
                    max_age: LEASE_TTL,
                    duplicate_window: LEASE_TTL,
                    storage: jetstream::stream::StorageType::File,
                    num_replicas: state.cfg.stream_replicas,
                    allow_rollup: true,
                    deny_delete: true,
                    allow_direct: true,
                    discard: jetstream::stream::DiscardPolicy::New,
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string());
            let store = match made {
                Ok(_) => js.get_key_value(name).await.map_err(|e| e.to_string()),
                Err(e) => Err(e),
            };
            match store {
                Ok(store) => self.bucket = Some(store),
                Err(e) => {
                    state.log.warn("snapshot_lease", || format!("opening the snapshot lease bucket failed: {e}"));
                    return false;
                }
            }
        }
        let Some(store) = &self.bucket else { return false };
        self.revision = match self.revision {
            Some(rev) => store.update(LEASE_KEY, me.clone(), rev).await.ok(),
            None => store.create(LEASE_KEY, me.clone()).await.ok(),
        };
        self.revision.is_some()
    }
}

/// Writes one snapshot and drops the oldest past `snapshot_keep`; the stream sequence it
/// reflects, or `None` if the ingest loop is gone (shutting down).
async fn write(js: &jetstream::Context, state: &Arc<State>, cuts: &mpsc::Sender<CutRequest>) -> anyhow::Result<Option<u64>> {
    let began = Instant::now();
    let (tx, rx) = oneshot::channel();
    if cuts.send(tx).await.is_err() {
        return Ok(None);
    }
    let Ok(cut) = rx.await else { return Ok(None) };
    let backend = state.cfg.backend.as_str().to_string();
    let stream_seq = cut.stream_seq;
    let bytes = tokio::task::spawn_blocking(move || encode(cut, backend)).await??;
    let store = match js.get_object_store(bucket(state)).await {
        Ok(store) => store,
        Err(_) => js
            .create_object_store(object_store::Config {
                bucket: bucket(state),
                description: Some("kvindex index snapshots".into()),
                storage: jetstream::stream::StorageType::File,
                num_replicas: state.cfg.stream_replicas,
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("creating the snapshot bucket {}: {e}", bucket(state)))?,
    };
    let name = object_name(stream_seq);
    store.put(name.as_str(), &mut bytes.as_slice()).await.map_err(|e| anyhow::anyhow!("writing {name}: {e}"))?;
    let found = list(&store).await?;
    for (_, old) in found.iter().take(found.len().saturating_sub(state.cfg.snapshot_keep)) {
        if let Err(e) = store.delete(old).await {
            state.log.warn("snapshot_prune", || format!("deleting the old snapshot {old} failed: {e}"));
        }
    }
    let took = began.elapsed().as_secs_f64();
    let metrics = &state.metrics;
    metrics.durable.snapshot_writes.with_label_values(&["ok"]).inc();
    metrics.durable.snapshot_write_seconds.set(took);
    metrics.durable.snapshot_bytes.set(bytes.len() as i64);
    state.durable.snapshot_written.store(super::state::now_ns(), Ordering::Relaxed);
    tracing::info!(snapshot = %name, bytes = bytes.len(), seconds = took, "wrote an index snapshot");
    Ok(Some(stream_seq))
}

/// Collects the apply threads' saved workers and encodes the snapshot (msgpack).
fn encode(cut: Cut, backend: String) -> anyhow::Result<Vec<u8>> {
    let Cut { stream_seq, positions, stale, saved } = cut;
    let mut by_worker: std::collections::HashMap<WorkerId, SavedWorker> = saved.iter().map(|s| (s.worker, s)).collect();
    let workers = positions
        .into_iter()
        .map(|(w, epoch, next_id)| {
            // A worker heard from (heartbeats) but holding nothing has no writer yet.
            let saved = by_worker.remove(&w).unwrap_or_else(|| SavedWorker {
                worker: w,
                device: Default::default(),
                tiers: Default::default(),
                groups: None,
            });
            SnapshotWorker { epoch, next_id, stale: stale.contains(&w), saved }
        })
        .collect();
    let snap = Snapshot { version: VERSION, backend, stream_seq, written_ns: super::state::now_ns(), workers };
    Ok(rmp_serde::to_vec(&snap)?)
}
