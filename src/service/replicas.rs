//! Replicas that compare themselves: each replica of a prefix (and shard) takes a checkpoint of
//! a worker, the digests of its blocks (device, host, disk, hybrid groups) at an event id, at
//! the first batch of the worker in each `replica_check_interval` of the publisher's clock
//! (`ts_ns`); every replica sees the
//! same batches, so they checkpoint at the same event ids. Every interval each replica
//! publishes its new checkpoints on `{prefix}.replicas` (`.k` for shard k); a sibling holding
//! a checkpoint at the same epoch and event id compares the two. A difference is counted
//! (`kvindex_digest_mismatch_total{source="replica"}`), logged, and flags the worker stale
//! (`drift`) on each replica that sees it, so both ask its publisher for a snapshot and rebuild
//! from it: they converge on the engine's state, whichever of them was wrong.
//!
//! Checkpoints are taken only of a worker held whole (in sequence, not stale, no restatement
//! open), on its apply thread once the batch is applied; [`super::checkpoints`] keeps them.

use super::checkpoints::{Checkpoint, Compared, SIBLING_INTERVALS};
use super::state::State;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;

/// Checkpoints one message carries at most (at most about 110 bytes each: well under NATS's 1 MB).
const PER_MESSAGE: usize = 4096;

/// What a replica publishes on `{prefix}.replicas`: its new checkpoints (msgpack).
#[derive(Debug, Serialize, Deserialize)]
struct ReplicaDigests {
    /// The sender, a random id per process (a replica skips its own messages).
    replica: u64,
    /// The shard count it runs under (1: not sharded), so that two counts never compare.
    shards: u32,
    /// Its checkpoints taken since its last message.
    checkpoints: Vec<Checkpoint>,
}

/// Records this replica's checkpoint (taken on the worker's apply thread) and compares it with
/// the siblings' at the same point.
pub(super) fn checkpointed(state: &State, c: Checkpoint) {
    for pair in state.replicas.record(c) {
        judge(state, pair);
    }
}

/// Counts a comparison; a difference flags the worker stale (`drift`) and asks it to resync.
fn judge(state: &State, (mine, theirs): Compared) {
    state.metrics.replicas.compared.inc();
    let Some((part, here, there)) = mine.digests().differs(&theirs.digests()) else { return };
    let worker = mine.worker();
    state.drifted(worker, "replica", "replica_drift", || {
        format!(
            "worker {worker} differs between replicas at event {} of epoch {}: {} {part} blocks (digest {:016x}) here, {} ({:016x}) on a sibling; marked stale, asking it to resync",
            mine.next_event_id, mine.epoch, here.blocks, here.sum, there.blocks, there.sum
        )
    });
}

/// The subject replicas of this prefix and shard compare on.
fn subject(state: &State) -> String {
    format!("{}.replicas{}", state.cfg.prefix, state.subjects.shard_suffix)
}

/// Sends this replica's checkpoints every interval and compares its siblings' as they come.
pub(super) async fn replicas_loop(client: async_nats::Client, state: Arc<State>) {
    let Some(every) = state.replicas.every else { return };
    let subject = subject(&state);
    let mut sub = match client.subscribe(subject.clone()).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot subscribe to {subject}: {e}; this replica's digests are not compared with its siblings'");
            return;
        }
    };
    let shards = state.cfg.shards.max(1);
    // Workers quiet past this are forgotten here (their TTL drops them from the index too).
    let quiet = (every * SIBLING_INTERVALS).max(Duration::from_secs(state.cfg.worker_ttl));
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let (fresh, siblings) = state.replicas.take_fresh(quiet);
                state.metrics.replicas.siblings.set(siblings as i64);
                for part in fresh.chunks(PER_MESSAGE) {
                    let msg = ReplicaDigests { replica: state.replicas.me, shards, checkpoints: part.to_vec() };
                    let Ok(body) = rmp_serde::to_vec(&msg) else { continue };
                    if client.publish(subject.clone(), body.into()).await.is_ok() {
                        state.metrics.replicas.sent.inc_by(part.len() as u64);
                    }
                }
            }
            msg = sub.next() => match msg {
                Some(msg) => compare(&state, shards, &msg.payload),
                None => return,
            },
        }
    }
}

/// Compares a sibling's message with this replica's checkpoints.
fn compare(state: &State, shards: u32, payload: &[u8]) {
    let msg: ReplicaDigests = match rmp_serde::from_slice(payload) {
        Ok(m) => m,
        Err(e) => {
            state.fail("bad_replica_digests", || format!("dropped a message on {}: {e}", subject(state)));
            return;
        }
    };
    let r = &state.replicas;
    if msg.replica == r.me || msg.shards != shards {
        return;
    }
    for pair in r.heard(msg.replica, msg.checkpoints) {
        judge(state, pair);
    }
}
