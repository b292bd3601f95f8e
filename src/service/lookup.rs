//! Routers' lookups over NATS: one queue subscriber per lookup thread, each answering in
//! turn, and only while this replica is ready: NATS then sends every lookup to replicas whose
//! index is whole.

use super::answer::respond;
use super::State;
use crate::apply::ApplyPool;
use async_nats::Client;
use futures::StreamExt;
use kvindex_client::protocol::{entries_that_fit, LookupRequest};
use kvindex_core::index::KvIndex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// Keeps this replica in the `kvindex` lookup queue group exactly while it is ready (connected
/// and rebuilt). Joining waits for everything received so far to be applied; leaving (NATS
/// lost, a rebuild begun) unsubscribes, so NATS routes lookups to the other replicas, or
/// routers get "no responders" at once rather than answers from a half-built index.
pub(super) async fn lookup_membership<I: KvIndex>(
    client: Client,
    state: Arc<State>,
    pool: Arc<ApplyPool<I>>,
    subscribers: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let subject = format!("{}.lookup", state.cfg.prefix);
    let mut ready = state.health.ready.subscribe();
    loop {
        tokio::select! {
            r = async { ready.wait_for(|r| *r).await.map(|_| ()) } => if r.is_err() { return },
            _ = stop.changed() => return,
        }
        let flushing = pool.clone();
        let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
        let mut subs = Vec::with_capacity(subscribers);
        for _ in 0..subscribers {
            // One queue group per shard: a lookup reaches one replica of every shard.
            match client.queue_subscribe(subject.clone(), state.cfg.lookup_group()).await {
                Ok(sub) => subs.push(sub),
                Err(e) => state.log.warn("lookup_subscribe", || format!("cannot subscribe to {subject}: {e}")),
            }
        }
        if subs.is_empty() {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            continue;
        }
        // The most entries an answer may hold under this server's payload limit, read once per
        // membership (a reconnect, possibly to another server, means leaving and rejoining).
        let room = entries_that_fit(match client.server_info().max_payload {
            0 => 1 << 20,
            n => n,
        });
        // Only once the server has the subscriptions does `/readyz` say so: a router asking
        // in between would hear "no responders".
        if let Err(e) = kvindex_client::nats::round_trip(
            &client,
            format!("{}.resync.probe", state.cfg.prefix),
            std::time::Duration::from_secs(5),
        )
        .await
        {
            state.log.warn("lookup_subscribe", || format!("{e}; joining the queue group anyway"));
        }
        state.health.member.store(true, Ordering::Relaxed);
        state.metrics.lookups.lookup_member.set(1);
        tracing::info!(subscribers = subs.len(), "answering lookups: joined the kvindex queue group");
        let (leave, left) = tokio::sync::watch::channel(false);
        let tasks: Vec<_> = subs
            .into_iter()
            .map(|sub| tokio::spawn(serve_lookups(client.clone(), sub, state.clone(), pool.clone(), room, left.clone())))
            .collect();
        let stopping = tokio::select! {
            _ = async { ready.wait_for(|r| !*r).await.map(|_| ()) } => false,
            _ = stop.changed() => true,
        };
        state.health.member.store(false, Ordering::Relaxed);
        let _ = leave.send(true);
        for t in tasks {
            let _ = t.await;
        }
        state.metrics.lookups.lookup_member.set(0);
        if stopping {
            return;
        }
        tracing::info!("left the kvindex queue group until the index is whole again");
    }
}

/// Answers the lookups of one queue subscriber until told to stop; then takes no new ones.
/// The answer in progress is finished before the task returns.
pub(super) async fn serve_lookups<I: KvIndex>(
    client: Client,
    mut lookups: async_nats::Subscriber,
    state: Arc<State>,
    pool: Arc<ApplyPool<I>>,
    room: usize,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = lookups.next() => match msg {
                Some(msg) => answer(&client, &state, &pool, room, msg).await,
                None => break,
            },
        }
    }
    // Bounded: with NATS away, the unsubscription cannot reach the server (and need not).
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), lookups.unsubscribe()).await;
}

/// Answers one lookup request; an undecodable request gets an `error` reply. The answer is
/// bounded: at most `max_matches` matches and, with the stale workers, never more than one
/// NATS message holds (`room` entries).
async fn answer<I: KvIndex>(client: &Client, state: &State, pool: &ApplyPool<I>, room: usize, msg: async_nats::Message) {
    let start = Instant::now();
    let req = LookupRequest::decode(&msg.payload);
    if let Some(sent) = req.as_ref().ok().and_then(|r| r.sent_ns) {
        let now = super::state::now_ns();
        if now >= sent {
            state.metrics.lookups.lookup_transit.observe((now - sent) as f64 / 1e9);
        }
    }
    let routed = req.as_ref().ok().and_then(|r| r.routed(state.cfg.max_depth as usize));
    let (resp, ok) = respond(state, pool.model(), room, req);
    if let Some(reply) = msg.reply {
        if let Err(e) = client.publish(reply, resp.encode().into()).await {
            state.metrics.lookups.lookup_reply_failures.inc();
            state.log.warn("reply_failed", || format!("could not send a lookup reply: {e}"));
        }
    }
    // Every replica keeps the announcement, this one included: it goes out as a router's would.
    if let (Some(routed), true) = (routed, ok) {
        // To the worker's subject: sharded, the NATS mapping takes it to the worker's shard.
        let subject = format!("{}.routed.{}", state.cfg.prefix, routed.worker_id);
        let _ = client.publish(subject, routed.encode().into()).await;
    }
    let hot = &state.metrics.hot;
    let (count, duration) =
        if ok { (&hot.lookups_ok, &hot.lookup_duration_ok) } else { (&hot.lookups_error, &hot.lookup_duration_error) };
    count.inc();
    duration.observe(start.elapsed().as_secs_f64());
}
