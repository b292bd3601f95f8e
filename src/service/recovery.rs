//! Healing: resync requests with backoff, the broadcast that starts a rebuild, TTL expiry of
//! silent workers, and a broadcast resync after every NATS reconnect.

use super::stale::INCOMPLETE;
use super::state::EXPIRED_KEPT;
use super::State;
use crate::apply::ApplyPool;
use async_nats::{Client, Event};
use kvindex_client::protocol::ResyncRequest;
use kvindex_core::hash::WorkerId;
use kvindex_core::index::KvIndex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Asks every publisher for its block set; `/readyz` waits for their snapshots.
pub(super) async fn broadcast_resync(client: &Client, state: &State) {
    state.health.begin_rebuild();
    ask_everyone(client, state).await;
}

/// Publishes the resync broadcast that every publisher answers with its snapshot.
async fn ask_everyone(client: &Client, state: &State) {
    // Sharded, the payload names the shard: only its workers' publishers answer.
    let payload = state.cfg.shard_of().map_or_else(bytes::Bytes::new, |s| {
        kvindex_client::shards::ResyncShard { shard: s.shard, shards: s.shards }.encode().into()
    });
    match client.publish(format!("{}.resync", state.cfg.prefix), payload).await {
        Ok(()) => state.metrics.workers.resync_requests.with_label_values(&["all"]).inc(),
        Err(e) => state.log.warn("resync_broadcast", || format!("could not broadcast a resync request: {e}")),
    }
}

/// Follows the NATS connection: state in metrics and logs, and after a reconnect what was
/// missed meanwhile: in core mode a broadcast resync; in JetStream mode, where the stream kept
/// it, a new consumer from the message after the last one ingested (`reopen`), and not ready
/// until it has caught up.
pub(super) async fn nats_events(
    client: Client,
    state: Arc<State>,
    mut rx: mpsc::UnboundedReceiver<Event>,
    reopen: mpsc::Sender<()>,
) {
    let metrics = &state.metrics;
    // The first connection's broadcast is sent by `run`, once the subscriptions exist.
    let mut reconnect = false;
    let mut last_loss: Option<Instant> = None;
    while let Some(e) = rx.recv().await {
        let kind = match &e {
            Event::Connected => "connected",
            Event::Disconnected => "disconnected",
            Event::LameDuckMode => "lame_duck",
            Event::SlowConsumer(_) => "slow_consumer",
            Event::ServerError(_) => "server_error",
            Event::ClientError(_) => "client_error",
            Event::Draining => "draining",
            Event::Closed => "closed",
        };
        metrics.nats.events.with_label_values(&[kind]).inc();
        match e {
            Event::Connected => {
                tracing::info!("connected to NATS");
                let durable = state.cfg.ingest == crate::config::Ingest::Jetstream;
                if reconnect && durable {
                    // The consumer may have died with the server: not ready until one delivers
                    // up to the stream's last message (marked before `connected`, so that the
                    // replica never looks whole in between).
                    state.health.caught_up.again();
                    let _ = reopen.try_send(());
                }
                state.health.connected.store(true, Ordering::Relaxed);
                metrics.nats.connected.set(1);
                if reconnect && !durable {
                    // Events published while we were away are lost: ask every publisher for its state.
                    broadcast_resync(&client, &state).await;
                }
                reconnect = true;
            }
            Event::Disconnected | Event::Closed => {
                state.log.warn("nats_disconnected", || format!("lost the NATS connection ({e}); reconnecting"));
                state.health.connected.store(false, Ordering::Relaxed);
                metrics.nats.connected.set(0);
            }
            Event::SlowConsumer(_) => {
                // The client dropped messages of ours: events of unknown workers are lost.
                // Every worker is suspect: stale at once, and asked (one broadcast per
                // resync_interval however long the burst) to send its state.
                let every = Duration::from_secs(state.cfg.resync_interval);
                if last_loss.is_none_or(|t| t.elapsed() >= every) {
                    last_loss = Some(Instant::now());
                    let workers = state.cursors.lock().workers();
                    for w in &workers {
                        state.stale.mark_asked(*w, "slow_consumer");
                    }
                    state.log.warn("slow_consumer", || {
                        format!(
                            "NATS dropped event batches (slow consumer; subscription_capacity {}): {} workers marked stale, asking every publisher to resync",
                            state.cfg.subscription_capacity,
                            workers.len()
                        )
                    });
                    ask_everyone(&client, &state).await;
                }
            }
            other => state.log.warn("nats_event", || format!("NATS: {other}")),
        }
    }
}

/// Asks stale workers to resync: at once when they turn stale (unless a broadcast has just
/// asked everyone), again after `resync_interval` if still stale, the wait doubling up to
/// `resync_max_interval`.
pub(super) async fn resync_loop(client: Client, state: Arc<State>, mut rx: mpsc::UnboundedReceiver<WorkerId>) {
    let base = Duration::from_secs(state.cfg.resync_interval);
    let max = Duration::from_secs(state.cfg.resync_max_interval);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        let due: Vec<WorkerId> = tokio::select! {
            w = rx.recv() => match w { Some(w) => vec![w], None => return },
            _ = tick.tick() => state.stale.list(),
        };
        let now = Instant::now();
        if now.duration_since(state.health.broadcast_at()) < base {
            // The broadcast's snapshots are on their way.
            continue;
        }
        for w in due {
            let ask = state.stale.update(&w, |r| {
                let waiting = r.asked.is_some_and(|t| now.duration_since(t) < resync_wait(base, max, r.attempts));
                if r.reason == INCOMPLETE || waiting {
                    return None;
                }
                r.asked = Some(now);
                r.attempts += 1;
                Some(r.attempts)
            });
            let Some(attempt) = ask.flatten() else { continue };
            state.metrics.workers.resync_requests.with_label_values(&["worker"]).inc();
            let payload = ResyncRequest { worker_id: w.worker_id, dp_rank: w.dp_rank }.encode();
            let subject = format!("{}.resync.{}", state.cfg.prefix, w.worker_id);
            let (client, state) = (client.clone(), state.clone());
            tokio::spawn(async move {
                let answer = tokio::time::timeout(Duration::from_secs(2), client.request(subject, payload.into())).await;
                if !matches!(answer, Ok(Ok(_))) {
                    state.metrics.workers.resync_unanswered.inc();
                    state.log.warn("resync_unanswered", || {
                        format!("worker {w} did not answer resync request {attempt}; asking again with backoff")
                    });
                }
            });
        }
    }
}

/// How long to wait after the `attempts`-th unanswered resync request before the next:
/// `base`, doubling each time, at most `max`.
fn resync_wait(base: Duration, max: Duration, attempts: u32) -> Duration {
    base.saturating_mul(1 << attempts.saturating_sub(1).min(16)).min(max)
}

/// Keeps `/readyz` and `kvindex_ready` current.
pub(super) async fn readiness_loop(state: Arc<State>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        state.health.check_ready();
    }
}

/// Drops workers silent for longer than `worker_ttl`, so a crashed engine stops attracting
/// requests.
pub(super) async fn ttl_loop<I: KvIndex>(state: Arc<State>, pool: Arc<ApplyPool<I>>) {
    if state.cfg.worker_ttl == 0 {
        return;
    }
    let ttl = Duration::from_secs(state.cfg.worker_ttl);
    let mut tick = tokio::time::interval((ttl / 4).max(Duration::from_millis(250)));
    loop {
        tick.tick().await;
        let now = Instant::now();
        // The removals are queued while the cursors are locked: a batch of the same worker that
        // arrives after its cursor is gone is then queued after its removal, never wiped by it.
        let expired = tokio::task::block_in_place(|| {
            let mut cursors = state.cursors.lock();
            let gone = cursors.expire(now, ttl);
            for w in &gone {
                pool.remove_worker(*w);
            }
            gone
        });
        for w in expired {
            state
                .log
                .warn("worker_expired", || format!("worker {w} silent past its TTL ({} s); dropping its blocks", ttl.as_secs()));
            state.metrics.workers.workers_expired.inc();
            state.stale.clear(w);
            let mut gone = state.expired.lock();
            if gone.len() == EXPIRED_KEPT {
                gone.pop_front();
            }
            gone.push_back((w, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resync_requests_back_off_doubling_up_to_the_cap() {
        let s = Duration::from_secs;
        let waits: Vec<u64> = (1..=7).map(|a| resync_wait(s(1), s(30), a).as_secs()).collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(resync_wait(s(5), s(5), 40), s(5));
    }
}
