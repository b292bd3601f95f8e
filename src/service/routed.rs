//! Routers' announcements on `{prefix}.routed`: "I sent this request to worker W". Every
//! replica subscribes (no queue group: each keeps its own copy) and hands each announcement to
//! the worker's apply thread, which holds it as predicted (a worker that publishes events) or
//! as the worker's blocks (a routed-only worker, approximate mode). An announcement sent with a
//! reply subject is answered once it is applied, for a router that wants to read its own write.

use super::State;
use crate::apply::{ApplyPool, OnAnnounced};
use async_nats::Client;
use futures::StreamExt;
use kvindex_client::protocol::Routed;
use kvindex_client::shards::partition;
use kvindex_core::index::KvIndex;
use kvindex_core::WorkerId;
use std::sync::Arc;
use std::time::Duration;

/// How often announced blocks past their TTL are dropped: a block lives up to this much past
/// its TTL.
const EXPIRE_EVERY: Duration = Duration::from_millis(100);

/// The hook of every announcement and expiry: counts what it did, and logs refusals.
pub(super) fn announced_hook(state: &Arc<State>) -> OnAnnounced {
    let state = state.clone();
    Arc::new(move |worker: WorkerId, routed_only, out, no_slot| {
        let mode = if routed_only { "routed_only" } else { "predicted" };
        let blocks = &state.metrics.lookups.announced_blocks;
        for (change, n) in [("added", out.added), ("evicted", out.evicted), ("expired", out.expired), ("refused", out.refused)] {
            if n > 0 {
                blocks.with_label_values(&[mode, change]).inc_by(n);
            }
        }
        if no_slot {
            let max = state.cfg.max_workers;
            state.log.warn("announce_refused", || {
                format!("refused an announcement for worker {worker}: all {max} worker slots are taken (max_workers)")
            });
        }
    })
}

/// Takes announcements until the subscription ends, and drops expired ones meanwhile.
pub(super) async fn routed_loop<I: KvIndex>(client: Client, state: Arc<State>, pool: Arc<ApplyPool<I>>) {
    // Announcements on the worker's subject (`routed.{worker}`, sharded: mapped to the
    // worker's shard, `routed.{worker}.{k}`), and on the bare subject routers of the first
    // protocol used (sharded, each shard keeps those of its own workers).
    let prefix = &state.cfg.prefix;
    let mut subs = Vec::new();
    for subject in [format!("{prefix}.routed"), format!("{prefix}.routed.*{}", state.subjects.shard_suffix)] {
        match client.subscribe(subject.clone()).await {
            Ok(sub) => subs.push(sub),
            Err(e) => {
                tracing::error!("cannot subscribe to {subject}: {e}; announcements are not kept");
                return;
            }
        }
    }
    let mut sub = futures::stream::select_all(subs);
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            msg = sub.next() => match msg {
                Some(msg) => take(&client, &state, &pool, msg),
                None => return,
            },
            _ = tick.tick() => {
                pool.expire_announced();
                state.metrics.lookups.predicted_blocks.set(pool.model().predicted_blocks() as i64);
            }
        }
    }
}

/// Checks one announcement and queues it on its worker's apply thread.
fn take<I: KvIndex>(client: &Client, state: &Arc<State>, pool: &Arc<ApplyPool<I>>, msg: async_nats::Message) {
    let counted = |result: &str| state.metrics.lookups.announcements.with_label_values(&[result]).inc();
    let routed = match Routed::decode(&msg.payload) {
        Ok(r) if r.dp_rank < state.cfg.max_dp_ranks => r,
        Ok(r) => {
            counted("bad");
            let max = state.cfg.max_dp_ranks;
            state.fail("bad_announcement", || {
                format!("announcement for worker {} rank {}: ranks stop at {max}", r.worker_id, r.dp_rank)
            });
            return;
        }
        Err(e) => {
            counted("bad");
            state.fail("bad_announcement", || format!("announcement on {}: {e}", msg.subject));
            return;
        }
    };
    let routed_only = pool.model().routed_only().is_some_and(|r| r.contains(routed.worker_id));
    if state.cfg.predicted_ttl == 0.0 && !routed_only {
        counted("ignored");
        // Nothing to apply: a router waiting for the ack gets it now rather than a timeout.
        if let Some(reply) = msg.reply {
            let client = client.clone();
            tokio::spawn(async move {
                let _ = client.publish(reply, bytes::Bytes::new()).await;
            });
        }
        return;
    }
    if state.cfg.shard_of().is_some_and(|s| partition(routed.worker_id, s.shards) != s.shard) {
        // Another shard's worker, on the bare subject every shard hears: that shard keeps it.
        return;
    }
    let worker = WorkerId::new(routed.worker_id, routed.dp_rank);
    pool.announce(worker, routed.local_hashes(state.cfg.max_depth as usize));
    counted("applied");
    if let Some(reply) = msg.reply {
        let (done, applied) = tokio::sync::oneshot::channel();
        pool.then(
            worker,
            Box::new(move || {
                let _ = done.send(());
            }),
        );
        let client = client.clone();
        tokio::spawn(async move {
            if applied.await.is_ok() {
                let _ = client.publish(reply, bytes::Bytes::new()).await;
            }
        });
    }
}
