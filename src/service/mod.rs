//! `kvindex serve`: the NATS service (docs/PROTOCOL.md). Ingests publishers' event batches
//! into the apply pool, tracks each worker's event sequence, answers routers' lookups, asks publishers
//! to resync, drops silent workers, and serves metrics and health over HTTP.
//!
//! - this file: start-up, the shared state, the event loop, shutdown;
//! - [`ingest`]: decoding batches and following each worker's event sequence;
//! - [`lookup`]: answering routers;
//! - [`routed`]: routers' announced placements (predictions, approximate mode);
//! - [`recovery`]: resync requests, readiness after a rebuild, TTL expiry, NATS reconnects;
//! - [`catch_up`]: whether a JetStream replica has caught up with its stream;
//! - [`snapshot`]: JetStream mode's index snapshots in the NATS object store;
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`;
//! - [`huge_pages`]: whether the heap gets transparent huge pages, said at start-up.

mod catch_up;
mod http;
mod huge_pages;
mod ingest;
mod inspect;
mod lookup;
mod recovery;
mod routed;
mod snapshot;

use crate::apply::{ApplyPool, OnApplied};
use crate::config::{Config, Ingest};
use crate::metrics::Metrics;
use anyhow::Context;
use async_nats::{Client, Event};
use dashmap::DashMap;
use futures::StreamExt;
use ingest::Cursors;
use kvindex_core::groups::Groups;
use kvindex_core::hash::WorkerId;
use kvindex_core::index::positional::{PositionalConfig, PositionalIndex};
use kvindex_core::index::runs::{RunConfig, RunIndex};
use kvindex_core::index::{Backend, KvIndex};
use kvindex_core::tiers::OtherTiers;
use parking_lot::Mutex;
use recovery::{Readiness, Resync};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Logs a warning at most once per interval per key, counting what it held back.
struct RateLimitedLog {
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
    every: Duration,
}

impl RateLimitedLog {
    fn warn(&self, key: &'static str, msg: impl FnOnce() -> String) {
        let mut last = self.last.lock();
        let now = Instant::now();
        let entry = last.entry(key).or_insert((now - self.every, 0));
        if now.duration_since(entry.0) >= self.every {
            let suppressed = entry.1;
            *entry = (now, 0);
            tracing::warn!(reason = key, suppressed, "{}", msg());
        } else {
            entry.1 += 1;
        }
    }
}

/// State shared by the service's tasks and the apply threads.
struct State {
    cfg: Config,
    /// `{prefix}.events.`, the part of an events subject before the worker id.
    events_prefix: String,
    /// `.k` in shard `k` of a sharded deployment (the NATS mapping's suffix), else empty.
    shard_suffix: String,
    metrics: Arc<Metrics>,
    cursors: Mutex<Cursors>,
    /// Stale workers and the resync requests sent to each.
    stale: Arc<DashMap<WorkerId, Resync>>,
    /// The workers dropped last for silence past `worker_ttl`, and when (the newest last, at
    /// most `EXPIRED_KEPT`): what the inspect API tells of a worker that is gone.
    expired: Mutex<std::collections::VecDeque<(WorkerId, Instant)>>,
    resync_tx: mpsc::UnboundedSender<WorkerId>,
    log: RateLimitedLog,
    connected: AtomicBool,
    readiness: Mutex<Readiness>,
    /// Connected and rebuilt: what `/readyz` says, and when this replica is in the lookup
    /// queue group.
    ready: tokio::sync::watch::Sender<bool>,
    /// In the lookup queue group, the server acknowledging the subscriptions.
    member: AtomicBool,
    /// JetStream: whether the replica has caught up with the stream (always in core mode):
    /// until then it is not ready.
    caught_up: catch_up::CatchUp,
    /// JetStream: the last stream message ingested (or the restored snapshot's), which the
    /// snapshot task reads to see how many came since its last snapshot.
    stream_seq: AtomicU64,
    /// When the newest snapshot this replica wrote or loaded was written, in ns since the Unix
    /// epoch (0: none), for its age metric; wall-clock, since a loaded one may predate boot.
    snapshot_written: AtomicU64,
    /// Bumped whenever a worker is marked stale or cleared: a stale flag cleared after its
    /// snapshot is applied is not one set again meanwhile, and a lookup that raced a clear
    /// answers again.
    stale_generation: AtomicU64,
    /// The routed-only workers (approximate mode), from `cfg`.
    routed_only: Arc<crate::config::RoutedOnly>,
}

impl State {
    fn fail(&self, reason: &'static str, detail: impl FnOnce() -> String) {
        self.metrics.decode_failures.with_label_values(&[reason]).inc();
        self.log.warn(reason, detail);
    }

    /// Marks `w` stale and asks it to resync at once, unless it is stale already: then its
    /// backoff stands (whatever marks it stale again, requests keep doubling their interval
    /// until a snapshot completes), so a publisher that keeps sending what cannot be placed
    /// is not asked again on every batch.
    fn mark_stale(&self, w: WorkerId, reason: &'static str) {
        if self.mark(w, false, reason) {
            let _ = self.resync_tx.send(w);
        }
    }

    /// Marks `w` stale as already asked (its snapshot is open, or a broadcast went out): a
    /// per-worker request follows only if the snapshot does not end within the backoff.
    fn mark_stale_asked(&self, w: WorkerId, reason: &'static str) {
        self.mark(w, true, reason);
    }

    /// Marks `w` stale for `reason` under a new generation (so a clear pending from an
    /// earlier snapshot does not undo it); whether it was not stale before.
    fn mark(&self, w: WorkerId, asked: bool, reason: &'static str) -> bool {
        let generation = self.stale_generation.fetch_add(1, Ordering::SeqCst) + 1;
        match self.stale.entry(w) {
            dashmap::mapref::entry::Entry::Vacant(v) => {
                let asked = asked.then(Instant::now);
                v.insert(Resync { asked, attempts: asked.is_some() as u32, generation, reason, since: Instant::now() });
                self.metrics.stale_workers.inc();
                true
            }
            dashmap::mapref::entry::Entry::Occupied(mut o) => {
                o.get_mut().generation = generation;
                o.get_mut().reason = reason;
                false
            }
        }
    }

    /// Clears `w`'s stale flag if nothing marked it stale again since `generation` was read.
    /// The generation moves first, so a lookup that saw the flag gone sees it moved too
    /// (see `lookup::respond`).
    fn clear_stale_if(&self, w: WorkerId, generation: u64) {
        self.stale_generation.fetch_add(1, Ordering::SeqCst);
        if self.stale.remove_if(&w, |_, r| r.generation == generation).is_some() {
            self.metrics.stale_workers.dec();
        }
    }

    fn clear_stale(&self, w: WorkerId) {
        self.stale_generation.fetch_add(1, Ordering::SeqCst);
        if self.stale.remove(&w).is_some() {
            self.metrics.stale_workers.dec();
        }
    }
}

/// Expired workers the inspect API remembers.
const EXPIRED_KEPT: usize = 256;

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// The runtime that answers lookups, apart from ingest's. Shut down without waiting when
/// dropped (it may be dropped inside the main runtime, where a blocking shutdown panics).
struct LookupRuntime {
    rt: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
}

impl LookupRuntime {
    fn start(threads: usize) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("kvindex-lookup")
            .enable_all()
            .build()
            .context("starting the lookup runtime")?;
        Ok(LookupRuntime { handle: rt.handle().clone(), rt: Some(rt) })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }
}

impl Drop for LookupRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// The subject prefix of events, with the trailing dot.
fn events_prefix(cfg: &Config) -> String {
    format!("{}.events.", cfg.prefix)
}

/// Runs the service until `shutdown` resolves; then stops taking events, applies what is
/// queued, answers the lookups in flight and returns.
///
/// Needs a multi-threaded tokio runtime: a full apply queue makes ingest wait in place.
pub async fn serve(cfg: Config, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    if tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
        anyhow::bail!("kvindex serve needs a multi-threaded tokio runtime");
    }
    match cfg.backend {
        Backend::Runs => {
            let index_cfg = RunConfig {
                max_depth: cfg.max_depth,
                max_workers: cfg.max_workers,
                max_blocks_per_worker: cfg.max_blocks_per_worker,
                ..RunConfig::default()
            };
            run(cfg, move || RunIndex::new(index_cfg), shutdown).await
        }
        Backend::Positional => {
            let index_cfg = PositionalConfig {
                jump: cfg.jump,
                max_depth: cfg.max_depth,
                max_workers: cfg.max_workers,
                max_blocks_per_worker: cfg.max_blocks_per_worker,
            };
            run(cfg, move || PositionalIndex::new(index_cfg), shutdown).await
        }
        Backend::Reference => anyhow::bail!("configuration: backend: the reference model is for tests, not for serving"),
    }
}

/// A connection to NATS with `cfg`'s servers, credentials and TLS that tells `events` of its
/// state changes (connected, disconnected, slow consumer).
async fn connect(cfg: &Config, events: mpsc::UnboundedSender<Event>) -> anyhow::Result<Client> {
    let opts = cfg.nats.options("kvindex").await?.subscription_capacity(cfg.subscription_capacity).event_callback(move |e| {
        let events = events.clone();
        async move {
            let _ = events.send(e);
        }
    });
    Ok(cfg.nats.connect_with(opts).await?)
}

/// An events message, whatever it came from.
struct Incoming {
    subject: async_nats::Subject,
    payload: bytes::Bytes,
    /// JetStream: messages of the stream not yet delivered to this replica.
    pending: Option<u64>,
    /// JetStream: the message's sequence in the stream.
    seq: Option<u64>,
}

/// Where the events come from.
type EventStream = std::pin::Pin<Box<dyn futures::Stream<Item = Incoming> + Send>>;

/// The events, and whether the index was restored from a snapshot (no broadcast resync is
/// needed then).
type Events = (EventStream, bool);

/// Where events come from: a core subscription, or an ordered consumer of the JetStream
/// stream (created if missing) from the message after the newest snapshot, which is restored
/// first, or else from its first kept message.
async fn event_source<I: KvIndex>(client: &Client, state: &Arc<State>, pool: &Arc<ApplyPool<I>>) -> anyhow::Result<Events> {
    let cfg = &state.cfg;
    if cfg.ingest == Ingest::Core {
        // Sharded: only this shard's workers, as the NATS server's mapping partitions them.
        let subject = format!("{}*{}", state.events_prefix, state.shard_suffix);
        let sub = client.subscribe(subject).await.context("subscribing to events")?;
        return Ok((Box::pin(sub.map(|m| Incoming { subject: m.subject, payload: m.payload, pending: None, seq: None })), false));
    }
    use async_nats::jetstream::{self, consumer, stream};
    let js = jetstream::new(client.clone());
    let name = cfg.stream_name();
    let mut kept = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{}>", state.events_prefix)],
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
    state.caught_up.aim_at(end);
    let began = Instant::now();
    // What is left to read (sharded: at most; the stream holds every shard's events).
    let all = if cfg.shards > 1 { end.saturating_sub(kept_state.first_sequence.saturating_sub(1)) } else { kept_state.messages };
    let (mut held, mut deliver_policy, mut restored) = (all, consumer::DeliverPolicy::All, false);
    if let Some((snap, bytes)) = snapshot::load(&js, state, kept_state.first_sequence).await {
        let seq = snap.stream_seq;
        snapshot::restore(state, pool, snap, bytes, began).await;
        state.stream_seq.store(seq, Ordering::Relaxed);
        held = end.saturating_sub(seq);
        deliver_policy = consumer::DeliverPolicy::ByStartSequence { start_sequence: seq + 1 };
        restored = true;
    }
    let (messages, _) = ordered_from(&js, state, deliver_policy).await?;
    tracing::info!(stream = %name, messages = held, "reading events from JetStream; replaying what the stream keeps");
    state.metrics.stream_pending.set(held as i64);
    if held == 0 {
        state.caught_up.done_now();
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
    format!("{}*{}", state.events_prefix, state.shard_suffix)
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
fn replay_progress<I: KvIndex>(state: &Arc<State>, pool: &Arc<ApplyPool<I>>, pending: u64) {
    state.metrics.stream_pending.set(pending as i64);
    let Some(round) = state.caught_up.reached(state.stream_seq.load(Ordering::Relaxed), pending) else {
        return;
    };
    let (state, pool) = (state.clone(), pool.clone());
    tokio::spawn(async move {
        let _ = tokio::task::spawn_blocking(move || pool.flush()).await;
        if state.caught_up.flushed(round) {
            tracing::info!(sequence = state.stream_seq.load(Ordering::Relaxed), "caught up with the JetStream stream");
        }
    });
}

/// JetStream: a new consumer from the message after the last one ingested, the replica caught
/// up once it has ingested and applied up to the stream's last message as read now; `None`
/// (logged) if it cannot be made within 5 s, and the stream watch asks again.
async fn reopen<I: KvIndex>(
    js: &async_nats::jetstream::Context,
    state: &Arc<State>,
    pool: &Arc<ApplyPool<I>>,
) -> Option<EventStream> {
    let from = state.stream_seq.load(Ordering::Relaxed) + 1;
    let policy = async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: from };
    let reopened = tokio::time::timeout(Duration::from_secs(5), ordered_from(js, state, policy)).await;
    match reopened.unwrap_or_else(|_| Err(anyhow::anyhow!("timed out"))) {
        Ok((fresh, last)) => {
            state.caught_up.aim_at(last);
            state.metrics.stream_consumer_restarts.inc();
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
async fn stream_watch(js: async_nats::jetstream::Context, state: Arc<State>, reopen: mpsc::Sender<()>) {
    let name = state.cfg.stream_name();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut prev, mut still) = (state.stream_seq.load(Ordering::Relaxed), 0);
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
        let seen = state.stream_seq.load(Ordering::Relaxed);
        match tokio::time::timeout(Duration::from_secs(2), info).await {
            Ok(Ok(last)) => {
                state.metrics.stream_pending.set(last.saturating_sub(seen) as i64);
                // Catching up after a loss: now the end to reach is known.
                state.caught_up.aim_at_if_unknown(last);
                // Behind, or waiting to be told it caught up (a reopen that failed, an idle
                // stream), with nothing delivered for a tick.
                let waiting = last > seen || !state.caught_up.is_done();
                still = if waiting && seen == prev { still + 1 } else { 0 };
            }
            Ok(Err(e)) => state.log.warn("stream_info", || format!("reading the stream's state: {e}")),
            // JetStream requests hang while the cluster elects leaders after a node died: with
            // nothing delivered meanwhile either, whether this replica follows is unknown.
            Err(_) => {
                state.log.warn("stream_info", || "reading the stream's state timed out".into());
                if state.stream_seq.load(Ordering::Relaxed) == seen {
                    still += 2;
                }
            }
        }
        prev = state.stream_seq.load(Ordering::Relaxed);
        if still >= 2 {
            if state.caught_up.is_done() {
                tracing::warn!("the stream's consumer is stalled; out of the lookup queue group until a new one catches up");
            }
            state.caught_up.again();
            let _ = reopen.try_send(());
            still = 0;
        }
    }
}

/// Serves with indexes made by `make`: the device index, and one for each other tier.
async fn run<I: KvIndex>(cfg: Config, make: impl Fn() -> I, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    metrics.apply_queue_capacity.set(cfg.queue_capacity as i64);
    let index = Arc::new(make());
    let others = Arc::new(OtherTiers::new(&make));
    let groups = Arc::new(Groups::new(make()));
    let (resync_tx, resync_rx) = mpsc::unbounded_channel();
    let state = Arc::new(State {
        metrics: metrics.clone(),
        cursors: Mutex::new(Cursors::default()),
        stale: Arc::new(DashMap::new()),
        expired: Mutex::new(std::collections::VecDeque::new()),
        resync_tx,
        log: RateLimitedLog { last: Mutex::new(HashMap::new()), every: Duration::from_secs(10) },
        connected: AtomicBool::new(false),
        readiness: Mutex::new(Readiness::new()),
        ready: tokio::sync::watch::Sender::new(false),
        stale_generation: AtomicU64::new(0),
        member: AtomicBool::new(false),
        caught_up: catch_up::CatchUp::new(cfg.ingest == Ingest::Core),
        stream_seq: AtomicU64::new(0),
        snapshot_written: AtomicU64::new(0),
        events_prefix: events_prefix(&cfg),
        shard_suffix: cfg.shard_suffix(),
        routed_only: Arc::new(cfg.routed_only()),
        cfg: cfg.clone(),
    });
    let hook: OnApplied = {
        let state = state.clone();
        Arc::new(move |worker, out, ts_ns, _taken| {
            let m = &state.metrics;
            m.hot.blocks_stored.inc_by(out.stored);
            m.hot.blocks_removed.inc_by(out.removed);
            m.unknown_removes.inc_by(out.unknown_removes);
            // Past max_depth: ignored and counted, the worker stays whole (a resync would
            // bring the same chain back).
            m.too_deep_blocks.inc_by(out.too_deep);
            // Host or disk chains whose parent is not in that tier: counted, never stale.
            m.tier_unplaceable_blocks.inc_by(out.tier_unplaceable);
            // Hybrid groups' blocks without a place: the depth comes out shallower, never stale.
            m.group_missed_blocks.inc_by(out.group_missed);
            if out.refused > 0 {
                m.refused_events.with_label_values(&["registry_full"]).inc_by(out.refused);
                let max = state.cfg.max_workers;
                state.log.warn("registry_full", || {
                    format!("refused the events of worker {worker}: all {max} worker slots are taken (max_workers)")
                });
            }
            if out.over_limit > 0 {
                // Its blocks past max_blocks_per_worker are refused: its state is incomplete.
                m.over_limit_blocks.inc_by(out.over_limit);
                let max = state.cfg.max_blocks_per_worker;
                state.log.warn("over_limit", || {
                    format!("refused {} blocks of worker {worker}: it holds the most a worker may (max_blocks_per_worker = {max}); it is stale", out.over_limit)
                });
                state.mark_stale(worker, "over_limit");
            }
            if out.unplaceable > 0 {
                // Its position and prefix are unknown: the worker's state is off until a resync.
                m.unplaceable_blocks.inc_by(out.unplaceable);
                state.mark_stale(worker, "unplaceable");
            }
            let now = now_ns();
            if ts_ns > 0 && now >= ts_ns {
                m.event_lag.observe((now - ts_ns) as f64 / 1e9);
            }
        })
    };
    let announcing = routed::announcing(&state, Arc::new(make()));
    let threads = cfg.apply_threads();
    let pool = Arc::new(ApplyPool::start(
        index.clone(),
        Some(others.clone()),
        Some(groups),
        Some(announcing),
        threads,
        cfg.queue_capacity,
        Some(hook),
    ));

    let http = tokio::net::TcpListener::bind(&cfg.metrics_addr)
        .await
        .with_context(|| format!("binding metrics_addr {}", cfg.metrics_addr))?;
    let inspect = match cfg.inspect_addr.as_str() {
        "" => None,
        addr => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding inspect_addr {addr}"))?),
    };
    let (nats_tx, nats_rx) = mpsc::unbounded_channel();
    // JetStream: asks the ingest loop to read through a new consumer (see `stream_watch`).
    let (reopen_tx, mut reopen_rx) = mpsc::channel::<()>(1);
    let client = connect(&cfg, nats_tx).await?;
    // Lookups first: a runtime and a NATS connection of their own (its I/O driven by that
    // runtime), so an answer never waits behind event batches, in the socket or for a thread.
    let lookup_rt = LookupRuntime::start(cfg.lookup_threads())?;
    let lookup_client = {
        let cfg = cfg.clone();
        let (lookup_events, _ignored) = mpsc::unbounded_channel();
        lookup_rt.handle().spawn(async move { connect(&cfg, lookup_events).await }).await??
    };
    let (mut events, restored) = event_source(&client, &state, &pool).await?;
    let connected = client.connection_state() == async_nats::connection::State::Connected;
    state.connected.store(connected, Ordering::Relaxed);
    metrics.nats_connected.set(connected as i64);
    tracing::info!(
        nats = %cfg.nats.nats_url, prefix = %cfg.prefix, metrics = %cfg.metrics_addr, inspect = %cfg.inspect_addr, backend = index.name(),
        apply_threads = cfg.apply_threads(), "kvindex serving"
    );
    huge_pages::log_state();
    let ignored = Config::ignored_env();
    if !ignored.is_empty() {
        tracing::info!(variables = ?ignored, "ignoring KVINDEX_* variables that name no configuration key");
    }
    // A restarted daemon rebuilds its index from the publishers, unless a snapshot and the
    // stream after it did.
    if restored {
        state.rebuilt();
    } else {
        recovery::broadcast_resync(&client, &state).await;
    }
    let (cut_tx, mut cut_rx) = mpsc::channel::<snapshot::CutRequest>(1);
    let js = async_nats::jetstream::new(client.clone());
    let durable = (cfg.ingest == Ingest::Jetstream).then(|| {
        [
            tokio::spawn(snapshot::snapshot_loop(js.clone(), state.clone(), cut_tx)),
            tokio::spawn(stream_watch(js.clone(), state.clone(), reopen_tx.clone())),
        ]
    });

    let background = [
        tokio::spawn(recovery::nats_events(client.clone(), state.clone(), nats_rx, reopen_tx.clone())),
        tokio::spawn(recovery::resync_loop(client.clone(), state.clone(), resync_rx)),
        tokio::spawn(recovery::ttl_loop(state.clone(), pool.clone())),
        tokio::spawn(recovery::readiness_loop(state.clone())),
        tokio::spawn(routed::routed_loop(client.clone(), state.clone(), pool.clone())),
        tokio::spawn(inspect::workers_responder(client.clone(), state.clone(), pool.clone())),
        tokio::spawn(http::http_server(http, state.clone(), index.clone(), pool.clone())),
    ];
    let inspecting = inspect.map(|listener| {
        tokio::spawn(inspect::inspect_server(listener, state.clone(), index.clone(), pool.clone(), client.clone()))
    });
    // In the lookup queue group only while ready: a replica rebuilding its index (after a
    // start or a reconnect) leaves lookups to the complete ones.
    let (stop_lookups, stopped) = tokio::sync::watch::channel(false);
    let subscribers = cfg.lookup_threads();
    let membership = lookup_rt.handle().spawn(lookup::lookup_membership(
        lookup_client.clone(),
        state.clone(),
        pool.clone(),
        subscribers,
        stopped,
    ));

    tokio::pin!(shutdown);
    let mut watchdog = tokio::time::interval(Duration::from_secs(1));
    let mut failure = None;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            msg = events.next() => match msg {
                Some(msg) => {
                    ingest::ingest(&state, &pool, msg.subject.as_str(), &msg.payload);
                    if let Some(seq) = msg.seq {
                        state.stream_seq.store(seq, Ordering::Relaxed);
                    }
                    if let Some(pending) = msg.pending {
                        replay_progress(&state, &pool, pending);
                    }
                }
                None => break,
            },
            Some(()) = reopen_rx.recv() => {
                if let Some(fresh) = reopen(&js, &state, &pool).await {
                    events = fresh;
                }
            }
            Some(reply) = cut_rx.recv() => {
                let _ = reply.send(snapshot::cut(&state, &pool, state.stream_seq.load(Ordering::Relaxed)));
            }
            _ = watchdog.tick() => {
                let dead = pool.dead_threads();
                metrics.dead_apply_threads.set(dead as i64);
                if dead > 0 {
                    tracing::error!(dead, "an apply thread died: its workers' events can no longer be applied; exiting");
                    failure = Some(anyhow::anyhow!("{dead} apply thread(s) died"));
                    break;
                }
            }
        }
    }

    tracing::info!(grace_s = cfg.shutdown_grace, "shutting down: applying queued events, answering lookups in flight");
    let _ = stop_lookups.send(true);
    drop(events);
    let drain = async {
        let _ = membership.await;
        let flushing = pool.clone();
        let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
        let _ = client.flush().await;
        let _ = lookup_client.flush().await;
    };
    // Unsubscribing and flushing wait for NATS; applying waits for the apply threads. Neither
    // may keep a terminating pod alive.
    if tokio::time::timeout(Duration::from_secs(cfg.shutdown_grace), drain).await.is_err() {
        tracing::warn!(
            grace_s = cfg.shutdown_grace,
            "shutdown grace period over (NATS unreachable or apply queues long); exiting anyway"
        );
    }
    for task in background.into_iter().chain(durable.into_iter().flatten()).chain(inspecting) {
        task.abort();
    }
    if let Some(e) = failure {
        return Err(e);
    }
    tracing::info!("kvindex stopped");
    Ok(())
}
