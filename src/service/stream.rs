//! Where events come from: a core NATS subscription, or (durable mode) an ordered consumer of
//! the JetStream stream that keeps them, from the message after the newest index snapshot;
//! whether the replica has caught up with that stream, and a new consumer when one stalls.

use super::{snapshot, State};
use crate::apply::ApplyPool;
use crate::config::Ingest;
use anyhow::Context;
use async_nats::Client;
use futures::StreamExt;
use kvindex_core::index::KvIndex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// An events message, whatever it came from.
pub(super) struct Incoming {
    /// Its subject: `{prefix}.events.{worker_id}` (sharded: with the shard's suffix).
    pub(super) subject: async_nats::Subject,
    /// The batch.
    pub(super) payload: bytes::Bytes,
    /// JetStream: messages of the stream not yet delivered to this replica.
    pub(super) pending: Option<u64>,
    /// JetStream: the message's sequence in the stream.
    pub(super) seq: Option<u64>,
}

/// Where the events come from.
pub(super) type EventStream = std::pin::Pin<Box<dyn futures::Stream<Item = Incoming> + Send>>;

/// The events, and whether the index was restored from a snapshot (no broadcast resync is
/// needed then).
pub(super) type Events = (EventStream, bool);

/// Where events come from: a core subscription, or an ordered consumer of the JetStream
/// stream (created if missing) from the message after the newest snapshot, which is restored
/// first, or else from its first kept message.
pub(super) async fn event_source<I: KvIndex>(
    client: &Client,
    state: &Arc<State>,
    pool: &Arc<ApplyPool<I>>,
) -> anyhow::Result<Events> {
    let cfg = &state.cfg;
    if cfg.ingest == Ingest::Core {
        // Sharded: only this shard's workers, as the NATS server's mapping partitions them.
        let subject = format!("{}*{}", state.subjects.events_prefix, state.subjects.shard_suffix);
        let sub = client.subscribe(subject).await.context("subscribing to events")?;
        return Ok((Box::pin(sub.map(|m| Incoming { subject: m.subject, payload: m.payload, pending: None, seq: None })), false));
    }
    use async_nats::jetstream::{self, consumer, stream};
    let js = jetstream::new(client.clone());
    let name = cfg.stream_name();
    let mut kept = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{}>", state.subjects.events_prefix)],
            max_age: Duration::from_secs(cfg.stream_max_age),
            max_bytes: cfg.stream_max_bytes,
            storage: stream::StorageType::File,
            num_replicas: cfg.stream_replicas,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("creating or binding the JetStream stream {name}: {e}"))?;
    let kept_state = kept.info().await.map_err(|e| anyhow::anyhow!("reading stream {name}: {e}"))?.state.clone();
    let end = stream_end(&kept, kept_state.last_sequence, state).await?;
    state.health.caught_up.aim_at(end);
    let began = Instant::now();
    // What is left to read (sharded: at most; the stream holds every shard's events).
    let all = if cfg.shards > 1 { end.saturating_sub(kept_state.first_sequence.saturating_sub(1)) } else { kept_state.messages };
    let (mut held, mut deliver_policy, mut restored) = (all, consumer::DeliverPolicy::All, false);
    if let Some((snap, bytes)) = snapshot::load(&js, state, kept_state.first_sequence).await {
        let seq = snap.stream_seq;
        snapshot::restore(state, pool, snap, bytes, began).await;
        state.durable.stream_seq.store(seq, Ordering::Relaxed);
        held = end.saturating_sub(seq);
        deliver_policy = consumer::DeliverPolicy::ByStartSequence { start_sequence: seq + 1 };
        restored = true;
    }
    let (messages, _) = ordered_from(&js, state, deliver_policy).await?;
    tracing::info!(stream = %name, messages = held, "reading events from JetStream; replaying what the stream keeps");
    state.metrics.durable.stream_pending.set(held as i64);
    if held == 0 {
        state.health.caught_up.done_now();
    }
    Ok((messages, restored))
}

/// The stream's messages through a new ordered consumer delivering from `deliver_policy`, and
/// the stream's last sequence just before.
async fn ordered_from(
    js: &async_nats::jetstream::Context,
    state: &Arc<State>,
    deliver_policy: async_nats::jetstream::consumer::DeliverPolicy,
) -> anyhow::Result<(EventStream, u64)> {
    use async_nats::jetstream::consumer;
    let name = state.cfg.stream_name();
    let stream = js.get_stream(&name).await.map_err(|e| anyhow::anyhow!("binding stream {name}: {e}"))?;
    let last = stream_end(&stream, stream.cached_info().state.last_sequence, state).await?;
    // Sharded: one stream for every shard, each shard's consumer reading its own workers.
    let filter_subject = if state.cfg.shards > 1 { shard_subjects(state) } else { String::new() };
    let ordered = stream
        .create_consumer(consumer::pull::OrderedConfig { deliver_policy, filter_subject, ..Default::default() })
        .await
        .map_err(|e| anyhow::anyhow!("creating a consumer of stream {name}: {e}"))?;
    let messages = ordered.messages().await.map_err(|e| anyhow::anyhow!("reading stream {name}: {e}"))?;
    let state = state.clone();
    let messages = messages.filter_map(move |m| {
        let state = state.clone();
        async move {
            match m {
                Ok(m) => {
                    let (pending, seq) = m.info().map(|i| (i.pending, i.stream_sequence)).unwrap_or((0, 0));
                    Some(Incoming {
                        subject: m.message.subject,
                        payload: m.message.payload,
                        pending: Some(pending),
                        seq: Some(seq),
                    })
                }
                Err(e) => {
                    state.log.warn("stream_error", || format!("reading the JetStream stream: {e}"));
                    None
                }
            }
        }
    });
    Ok((Box::pin(messages), last))
}

/// This shard's events subjects as the server maps them: `{prefix}.events.*.{k}`.
fn shard_subjects(state: &State) -> String {
    format!("{}*{}", state.subjects.events_prefix, state.subjects.shard_suffix)
}

/// The stream sequence a replica must have ingested to be caught up, given the stream's last
/// (`last_sequence`): that, or in a sharded deployment the last message on this shard's
/// subjects (0 if none), since its consumer delivers those alone and another shard's last
/// message would never come.
async fn stream_end(stream: &async_nats::jetstream::stream::Stream, last_sequence: u64, state: &State) -> anyhow::Result<u64> {
    use async_nats::jetstream::stream::LastRawMessageErrorKind;
    if state.cfg.shards <= 1 {
        return Ok(last_sequence);
    }
    match stream.get_last_raw_message_by_subject(&shard_subjects(state)).await {
        Ok(m) => Ok(m.sequence),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(0),
        Err(e) => Err(anyhow::anyhow!("reading the last message of {} in the stream: {e}", shard_subjects(state))),
    }
}

/// JetStream: the replay is done once the stream has nothing more pending for this replica
/// and what was handed to the apply threads is applied.
pub(super) fn replay_progress<I: KvIndex>(state: &Arc<State>, pool: &Arc<ApplyPool<I>>, pending: u64) {
    state.metrics.durable.stream_pending.set(pending as i64);
    let Some(round) = state.health.caught_up.reached(state.durable.stream_seq.load(Ordering::Relaxed), pending) else {
        return;
    };
    let (state, pool) = (state.clone(), pool.clone());
    tokio::spawn(async move {
        let _ = tokio::task::spawn_blocking(move || pool.flush()).await;
        if state.health.caught_up.flushed(round) {
            tracing::info!(sequence = state.durable.stream_seq.load(Ordering::Relaxed), "caught up with the JetStream stream");
        }
    });
}

/// JetStream: a new consumer from the message after the last one ingested, the replica caught
/// up once it has ingested and applied up to the stream's last message as read now; `None`
/// (logged) if it cannot be made within 5 s, and the stream watch asks again.
pub(super) async fn reopen<I: KvIndex>(
    js: &async_nats::jetstream::Context,
    state: &Arc<State>,
    pool: &Arc<ApplyPool<I>>,
) -> Option<EventStream> {
    let from = state.durable.stream_seq.load(Ordering::Relaxed) + 1;
    let policy = async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: from };
    let reopened = tokio::time::timeout(Duration::from_secs(5), ordered_from(js, state, policy)).await;
    match reopened.unwrap_or_else(|_| Err(anyhow::anyhow!("timed out"))) {
        Ok((fresh, last)) => {
            state.health.caught_up.aim_at(last);
            state.metrics.durable.stream_consumer_restarts.inc();
            tracing::info!(from, last, "reading the stream through a new consumer");
            if last < from {
                // Nothing to deliver: caught up once what is queued is applied.
                replay_progress(state, pool, 0);
            }
            Some(fresh)
        }
        Err(e) => {
            state.log.warn("stream_error", || format!("replacing the stalled consumer: {e:#}"));
            None
        }
    }
}

/// JetStream: every second, the true lag (the stream's last sequence against the last one
/// ingested), so `kvindex_stream_pending` does not freeze when deliveries stop. A consumer
/// that stays behind without progress for two seconds (its server died; the client
/// recreates it after missed heartbeats), or a stream that cannot be read for two seconds
/// while nothing arrives, takes the replica out of the lookup queue group and has the ingest
/// loop read through a new consumer from the message after the last one ingested, until it
/// has caught up again: a replica that cannot tell it follows must not answer.
pub(super) async fn stream_watch(js: async_nats::jetstream::Context, state: Arc<State>, reopen: mpsc::Sender<()>) {
    let name = state.cfg.stream_name();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut prev, mut still) = (state.durable.stream_seq.load(Ordering::Relaxed), 0);
    loop {
        tick.tick().await;
        let info = async {
            match js.get_stream(&name).await {
                Ok(mut stream) => {
                    let last = stream.info().await.map(|i| i.state.last_sequence).map_err(|e| e.to_string())?;
                    stream_end(&stream, last, &state).await.map_err(|e| e.to_string())
                }
                Err(e) => Err(e.to_string()),
            }
        };
        let seen = state.durable.stream_seq.load(Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_secs(2), info).await {
            Ok(Ok(last)) => {
                state.metrics.durable.stream_pending.set(last.saturating_sub(seen) as i64);
                // Catching up after a loss: now the end to reach is known.
                state.health.caught_up.aim_at_if_unknown(last);
                // Behind, or waiting to be told it caught up (a reopen that failed, an idle
                // stream), with nothing delivered for a tick.
                let waiting = last > seen || !state.health.caught_up.is_done();
                still = if waiting && seen == prev { still + 1 } else { 0 };
            }
            Ok(Err(e)) => state.log.warn("stream_info", || format!("reading the stream's state: {e}")),
            // JetStream requests hang while the cluster elects leaders after a node died: with
            // nothing delivered meanwhile either, whether this replica follows is unknown.
            Err(_) => {
                state.log.warn("stream_info", || "reading the stream's state timed out".into());
                if state.durable.stream_seq.load(Ordering::Relaxed) == seen {
                    still += 2;
                }
            }
        }
        prev = state.durable.stream_seq.load(Ordering::Relaxed);
        if still >= 2 {
            if state.health.caught_up.is_done() {
                tracing::warn!("the stream's consumer is stalled; out of the lookup queue group until a new one catches up");
            }
            state.health.caught_up.again();
            let _ = reopen.try_send(());
            still = 0;
        }
    }
}
