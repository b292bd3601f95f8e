//! The bridge of one dp rank: the engine's PUB socket read in a loop, its sequence followed
//! (restarts start a new epoch, gaps are replayed from the engine's ROUTER or leave the rank
//! `incomplete`), and each batch forwarded through the rank's [`Publisher`].

use crate::config::{BridgeConfig, BridgeSettings};
use crate::engine::{decode_batch, EngineBatch, Hashing, Skip};
use crate::groups::RankGroups;
use crate::metrics::BridgeMetrics;
use anyhow::Context;
use bytes::Bytes;
use kvindex_client::protocol::now_ns;
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_core::Event;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The end-of-replay marker: seq -1 as a big-endian i64.
const REPLAY_END: u64 = u64::MAX;

/// Where the engine's sequence stands, for one rank.
struct Sequence {
    /// The seq expected next; `None` before the first batch.
    next: Option<u64>,
    /// The topic the engine publishes under; a new one means a new engine process.
    topic: Option<Bytes>,
}

/// The bridge of one dp rank: its ZMQ sockets, its publisher, its place in the sequence.
pub(crate) struct RankBridge {
    rank: u32,
    endpoint: String,
    replay: Option<String>,
    nats: async_nats::Client,
    publisher_cfg: PublisherConfig,
    publisher: Publisher,
    hashing: Hashing,
    replay_timeout: Duration,
    seq: Sequence,
    metrics: Arc<BridgeMetrics>,
    /// Unknown media already named in the log, so each is named once (at most
    /// [`MEDIA_NAMED`]: the engine picks them).
    media_named: HashSet<String>,
    /// The block set misses blocks the engine cached before the bridge could see them.
    incomplete: bool,
    /// The engine's KV-cache groups, as its events have shown them.
    groups: RankGroups,
    /// Test builds: the engine block whose first `stored` event this rank loses silently.
    #[cfg(feature = "fault-injection")]
    lose_storing: Option<u64>,
}

/// How many unknown media a rank names in its log.
const MEDIA_NAMED: usize = 16;

impl RankBridge {
    pub(crate) async fn start(
        cfg: &BridgeConfig,
        rank: u32,
        endpoint: String,
        replay: Option<String>,
        nats: async_nats::Client,
        metrics: Arc<BridgeMetrics>,
    ) -> anyhow::Result<Self> {
        let b: &BridgeSettings = &cfg.bridge;
        let publisher_cfg = PublisherConfig { worker: cfg.worker(), ..PublisherConfig::new(&cfg.prefix, cfg.worker_id(), rank) };
        let publisher = Publisher::start(nats.clone(), publisher_cfg.clone()).await?;
        Ok(RankBridge {
            rank,
            endpoint,
            replay,
            nats,
            publisher_cfg,
            publisher,
            hashing: Hashing { block_size: b.block_size },
            replay_timeout: Duration::from_millis(b.replay_timeout_ms.max(1)),
            seq: Sequence { next: None, topic: None },
            metrics,
            media_named: HashSet::new(),
            incomplete: false,
            groups: RankGroups::default(),
            #[cfg(feature = "fault-injection")]
            lose_storing: cfg.fault.lose_event_storing,
        })
    }

    /// Subscribes to the engine (again after any error) and bridges what it publishes.
    pub(crate) async fn run(mut self) {
        let mut backoff = Duration::from_millis(100);
        loop {
            let mut sub = zeromq::SubSocket::new();
            let connected = async {
                sub.connect(&self.endpoint).await?;
                sub.subscribe("").await
            };
            if let Err(e) = connected.await {
                tracing::warn!(rank = self.rank, endpoint = %self.endpoint, "cannot subscribe to the engine: {e}; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
            backoff = Duration::from_millis(100);
            self.metrics.zmq_connected.with_label_values(&[&self.rank.to_string()]).set(1);
            tracing::info!(rank = self.rank, endpoint = %self.endpoint, "subscribed to the engine's KV events");
            loop {
                match sub.recv().await {
                    Ok(msg) => self.on_message(msg).await,
                    Err(e) => {
                        tracing::warn!(rank = self.rank, "engine socket failed: {e}; reconnecting");
                        break;
                    }
                }
            }
            self.metrics.zmq_connected.with_label_values(&[&self.rank.to_string()]).set(0);
        }
    }

    /// One live message: `[topic, seq, payload]` (or `[seq, payload]`).
    async fn on_message(&mut self, msg: ZmqMessage) {
        let Some((topic, seq, payload)) = split_frames(msg.into_vec()) else {
            self.metrics.decode_failures.with_label_values(&["bad_frames"]).inc();
            return;
        };
        let restarted = match (self.seq.next, &self.seq.topic, &topic) {
            (_, Some(old), Some(new)) if old != new => true,
            (Some(next), _, _) if seq < next => true,
            _ => false,
        };
        let started = self.seq.next.is_none();
        if restarted {
            self.metrics.engine_restarts.inc();
            tracing::info!(
                rank = self.rank,
                seq,
                "the engine restarted (its sequence went back or its topic changed); new epoch"
            );
            self.new_epoch().await;
        }
        // Before this batch the engine published from 0 (in this process) or from `next`.
        let expected = if restarted { 0 } else { self.seq.next.unwrap_or(0) };
        if seq > expected {
            self.metrics.seq_gaps.inc();
            if started || restarted {
                tracing::warn!(
                    rank = self.rank,
                    first = seq,
                    "the engine published batches before the bridge saw it; asking for them from 0"
                );
            } else {
                tracing::warn!(rank = self.rank, from = expected, to = seq, "batches lost between the engine and the bridge");
            }
            if !self.replay_from(expected, seq).await {
                // What was lost is unknown: start over from what follows, and say that blocks
                // the engine cached before are missing until it clears or restarts.
                if !started && !restarted {
                    self.new_epoch().await;
                }
                self.set_incomplete(true);
            }
        }
        if topic.is_some() {
            self.seq.topic = topic;
        }
        self.seq.next = Some(seq + 1);
        self.forward(&payload).await;
    }

    /// Replays `[from, until)` from the engine's ROUTER; whether the gap was healed.
    async fn replay_from(&mut self, from: u64, until: u64) -> bool {
        let Some(endpoint) = self.replay.clone() else {
            self.metrics.replays.with_label_values(&["unavailable"]).inc();
            return false;
        };
        match tokio::time::timeout(self.replay_timeout * 4, self.replay(&endpoint, from, until)).await {
            Ok(Ok(true)) => {
                self.metrics.replays.with_label_values(&["ok"]).inc();
                true
            }
            Ok(Ok(false)) => {
                tracing::warn!(rank = self.rank, from, "the engine no longer holds the lost batches");
                self.metrics.replays.with_label_values(&["failed"]).inc();
                false
            }
            Ok(Err(e)) => {
                tracing::warn!(rank = self.rank, from, "replay failed: {e:#}");
                self.metrics.replays.with_label_values(&["failed"]).inc();
                false
            }
            Err(_) => {
                tracing::warn!(rank = self.rank, from, "replay timed out");
                self.metrics.replays.with_label_values(&["failed"]).inc();
                false
            }
        }
    }

    /// Asks for every batch from `from` and forwards those before `until`, in order. False if
    /// the first one back is not `from` (the engine's buffer has moved on).
    async fn replay(&mut self, endpoint: &str, from: u64, until: u64) -> anyhow::Result<bool> {
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await?;
        let ask =
            ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]).map_err(anyhow::Error::msg)?;
        dealer.send(ask).await?;
        let mut expected = from;
        loop {
            let msg = tokio::time::timeout(self.replay_timeout, dealer.recv()).await.context("no replayed batch in time")??;
            let mut frames = msg.into_vec();
            // The DEALER keeps the ROUTER's empty delimiter.
            while frames.first().is_some_and(|f| f.is_empty()) && frames.len() > 2 {
                frames.remove(0);
            }
            let Some((_, seq, payload)) = split_frames(frames) else {
                self.metrics.decode_failures.with_label_values(&["bad_frames"]).inc();
                continue;
            };
            if seq == REPLAY_END {
                return Ok(expected >= until);
            }
            if seq < expected {
                continue;
            }
            if seq > expected {
                return Ok(false);
            }
            if seq < until {
                self.forward(&payload).await;
            }
            expected = seq + 1;
        }
    }

    /// Says whether this rank misses blocks its engine holds: the publisher's batches tell
    /// kvindex (the worker is answered as stale meanwhile), the gauge tells the operator.
    fn set_incomplete(&mut self, incomplete: bool) {
        if incomplete {
            tracing::warn!(
                rank = self.rank,
                "blocks the engine cached before are unknown to the bridge: kvindex answers for this rank as stale until the engine clears its cache or restarts"
            );
        }
        self.incomplete = incomplete;
        self.publisher.set_incomplete(incomplete);
        self.metrics.incomplete.with_label_values(&[&self.rank.to_string()]).set(incomplete as i64);
    }

    /// Starts a new epoch: kvindex clears the worker, and the block set starts empty.
    async fn new_epoch(&mut self) {
        let cfg =
            PublisherConfig { epoch: self.publisher_cfg.epoch.max(now_ns()).saturating_add(1), ..self.publisher_cfg.clone() };
        match Publisher::start(self.nats.clone(), cfg.clone()).await {
            Ok(p) => {
                let old = std::mem::replace(&mut self.publisher, p);
                self.publisher_cfg = cfg;
                old.close().await;
                self.metrics.epochs.inc();
                // A new epoch starts whole: a restarted engine starts empty.
                self.incomplete = false;
                self.metrics.incomplete.with_label_values(&[&self.rank.to_string()]).set(0);
            }
            Err(e) => tracing::error!(rank = self.rank, "cannot start a new epoch's publisher: {e}"),
        }
    }

    /// Decodes one payload and publishes its events.
    async fn forward(&mut self, payload: &[u8]) {
        let batch = match decode_batch(payload, self.hashing) {
            Ok(b) => b,
            Err(e) => {
                self.metrics.decode_failures.with_label_values(&[e.reason()]).inc();
                tracing::debug!(rank = self.rank, "dropped an engine batch: {e}");
                return;
            }
        };
        self.metrics.batches.inc();
        let EngineBatch { events, ts, .. } = batch;
        self.publisher.wait_for_room().await;
        for ev in self.groups.route(events) {
            match ev {
                Ok(ev) => {
                    self.metrics.events.with_label_values(&[ev.kind()]).inc();
                    self.metrics.blocks.inc_by(ev.blocks() as u64);
                    #[cfg(feature = "fault-injection")]
                    self.lose_if_storing(&ev);
                    self.publisher.publish(&ev);
                    // From an empty cache on, every block of the engine passes through here.
                    if ev == Event::Cleared && self.incomplete {
                        tracing::info!(rank = self.rank, "the engine cleared its cache: the rank is whole again");
                        self.set_incomplete(false);
                    }
                }
                Err(Skip::Bad(reason)) => self.metrics.decode_failures.with_label_values(&[reason]).inc(),
                Err(Skip::Filtered(reason)) => self.metrics.skipped.with_label_values(&[reason]).inc(),
                Err(Skip::UnknownMedium(name)) => {
                    self.metrics.skipped.with_label_values(&["unknown_medium"]).inc();
                    if self.media_named.len() < MEDIA_NAMED && self.media_named.insert(name.clone()) {
                        tracing::warn!(rank = self.rank, medium = %name, "skipping events of a storage medium kvindex has no tier for (counted as skipped{{reason=\"unknown_medium\"}}); said once per medium");
                    }
                }
            }
        }
        // The engine batched already: one NATS message per engine batch, without the linger.
        self.publisher.send_now();
        let now = now_ns() as f64 / 1e9;
        if ts > 0.0 && now >= ts {
            self.metrics.engine_lag.observe(now - ts);
        }
    }
}

#[cfg(feature = "fault-injection")]
impl RankBridge {
    /// Test builds: the publisher loses `ev` if it stores the block this rank is to lose.
    fn lose_if_storing(&mut self, ev: &Event) {
        let storing = |target: u64| matches!(ev, Event::Stored { blocks, .. } if blocks.iter().any(|b| b.block_hash.0 == target));
        if self.lose_storing.is_some_and(storing) {
            self.lose_storing = None;
            tracing::warn!(rank = self.rank, "fault injected: an engine event is lost without a trace");
            self.publisher.lose_next_event();
        }
    }
}

/// `(topic, seq, payload)` of `[topic, seq, payload]` or `[seq, payload]`.
fn split_frames(frames: Vec<Bytes>) -> Option<(Option<Bytes>, u64, Bytes)> {
    let seq = |f: &Bytes| Some(u64::from_be_bytes(f.as_ref().try_into().ok()?));
    match frames.as_slice() {
        [topic, s, payload] => Some((Some(topic.clone()), seq(s)?, payload.clone())),
        [s, payload] => Some((None, seq(s)?, payload.clone())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_with_and_without_a_topic() {
        let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
        let (t, s, p) = split_frames(vec![Bytes::from_static(b"kv"), seq.clone(), Bytes::from_static(b"x")]).unwrap();
        assert_eq!((t.as_deref(), s, p.as_ref()), (Some(&b"kv"[..]), 7, &b"x"[..]));
        assert_eq!(split_frames(vec![seq, Bytes::new()]).map(|f| f.1), Some(7));
        assert!(split_frames(vec![Bytes::from_static(b"short"), Bytes::new()]).is_none());
    }
}
