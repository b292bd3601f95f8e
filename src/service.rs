//! `kvindex serve`: the NATS service (DESIGN §3). Ingests publishers' event batches into the
//! apply pool, tracks each worker's event sequence, answers routers' lookups, asks publishers
//! to resync, drops silent workers, and serves metrics and health over HTTP.

use crate::apply::{ApplyPool, OnApplied, WorkerEvent};
use crate::config::Config;
use crate::hash::WorkerId;
use crate::index::positional::{PositionalConfig, PositionalIndex};
use crate::index::radix::RadixIndex;
use crate::index::{Backend, KvIndex, MatchOptions};
use crate::metrics::Metrics;
use crate::protocol::{decode_batch, EventData, LookupRequest, LookupResponse, MatchEntry, ResyncRequest, Tier};
use anyhow::Context;
use async_nats::{Client, ConnectOptions, Event};
use dashmap::DashMap;
use futures::StreamExt;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Where a worker's event sequence stands.
struct Cursor {
    epoch: u64,
    /// The event id expected next; `None` until the first event of an epoch.
    next_id: Option<u64>,
    last_seen: Instant,
    /// A snapshot opened with `cleared` and has had no gap since.
    snapshot_clean: bool,
}

/// Resync requests to one stale worker: when the last went out and how many have.
#[derive(Clone, Copy, Default)]
struct Resync {
    asked: Option<Instant>,
    attempts: u32,
}

/// Whether the index has been rebuilt since the last broadcast resync.
struct Readiness {
    broadcast_at: Instant,
    /// Snapshots begun (opening `cleared`) and not yet ended.
    open: HashSet<WorkerId>,
    /// Snapshots ended since the broadcast.
    completed: u64,
    /// When a snapshot last began or ended.
    last_activity: Instant,
    ready: bool,
}

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
    metrics: Arc<Metrics>,
    cursors: Mutex<HashMap<WorkerId, Cursor>>,
    /// Stale workers and the resync requests sent to each.
    stale: Arc<DashMap<WorkerId, Resync>>,
    resync_tx: mpsc::UnboundedSender<WorkerId>,
    log: RateLimitedLog,
    connected: AtomicBool,
    readiness: Mutex<Readiness>,
    /// Connected and rebuilt: what `/readyz` says.
    ready: AtomicBool,
}

impl State {
    fn fail(&self, reason: &'static str, detail: impl FnOnce() -> String) {
        self.metrics.decode_failures.with_label_values(&[reason]).inc();
        self.log.warn(reason, detail);
    }

    fn mark_stale(&self, w: WorkerId) {
        if self.stale.insert(w, Resync::default()).is_none() {
            self.metrics.stale_workers.inc();
        }
        let _ = self.resync_tx.send(w);
    }

    fn clear_stale(&self, w: WorkerId) {
        if self.stale.remove(&w).is_some() {
            self.metrics.stale_workers.dec();
        }
    }
}

impl State {
    /// A broadcast resync went out: not ready until the publishers' snapshots are in.
    fn begin_rebuild(&self) {
        let mut r = self.readiness.lock();
        let now = Instant::now();
        *r = Readiness { broadcast_at: now, open: HashSet::new(), completed: 0, last_activity: now, ready: false };
        self.ready.store(false, Ordering::Relaxed);
        self.metrics.ready.set(0);
    }

    fn snapshot_progress(&self, w: WorkerId, opened: bool, ended: bool) {
        let mut r = self.readiness.lock();
        r.last_activity = Instant::now();
        if opened {
            r.open.insert(w);
        }
        if ended {
            r.open.remove(&w);
            r.completed += 1;
        }
    }

    /// Re-evaluates readiness; logs and records the rebuild when it completes.
    fn check_ready(&self) {
        let connected = self.connected.load(Ordering::Relaxed);
        let mut r = self.readiness.lock();
        if !r.ready {
            let now = Instant::now();
            let settle = Duration::from_millis(self.cfg.ready_settle_ms);
            let quiet = r.open.is_empty() && now.duration_since(r.last_activity.max(r.broadcast_at)) >= settle;
            let timed_out = now.duration_since(r.broadcast_at) >= Duration::from_secs(self.cfg.ready_timeout);
            if connected && (quiet || timed_out) {
                r.ready = true;
                let took = now.duration_since(r.broadcast_at).as_secs_f64();
                self.metrics.rebuild_seconds.set(took);
                if quiet {
                    tracing::info!(
                        snapshots = r.completed,
                        seconds = took,
                        "ready: index rebuilt from the publishers' snapshots"
                    );
                } else {
                    tracing::warn!(
                        snapshots = r.completed,
                        still_open = r.open.len(),
                        seconds = took,
                        "ready after ready_timeout with snapshots still open; those workers stay stale until they finish"
                    );
                }
            }
        }
        let ready = connected && r.ready;
        self.ready.store(ready, Ordering::Relaxed);
        self.metrics.ready.set(ready as i64);
    }
}

fn now_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
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
        Backend::Positional => {
            let idx =
                PositionalIndex::new(PositionalConfig { jump: cfg.jump, max_depth: cfg.max_depth, max_workers: cfg.max_workers });
            run(cfg, idx, shutdown).await
        }
        Backend::Radix => {
            let idx = RadixIndex::new(cfg.max_depth, cfg.max_workers);
            run(cfg, idx, shutdown).await
        }
        Backend::Reference => anyhow::bail!("configuration: backend: the reference model is for tests, not for serving"),
    }
}

async fn connect(cfg: &Config, events: mpsc::UnboundedSender<Event>) -> anyhow::Result<Client> {
    let mut opts = ConnectOptions::new().name("kvindex").retry_on_initial_connect().max_reconnects(None);
    if let Some(creds) = &cfg.nats_creds {
        opts = opts.credentials_file(creds).await.with_context(|| format!("reading nats_creds {creds}"))?;
    }
    if let (Some(u), Some(p)) = (&cfg.nats_user, &cfg.nats_password) {
        opts = opts.user_and_password(u.clone(), p.clone());
    }
    if let Some(t) = &cfg.nats_token {
        opts = opts.token(t.clone());
    }
    if let Some(ca) = &cfg.nats_tls_ca {
        opts = opts.add_root_certificates(ca.into());
    }
    if let (Some(c), Some(k)) = (&cfg.nats_tls_cert, &cfg.nats_tls_key) {
        opts = opts.add_client_certificate(c.into(), k.into());
    }
    opts = opts.require_tls(cfg.nats_require_tls).event_callback(move |e| {
        let events = events.clone();
        async move {
            let _ = events.send(e);
        }
    });
    opts.connect(cfg.nats_url.as_str()).await.with_context(|| format!("connecting to NATS at {}", cfg.nats_url))
}

async fn run<I: KvIndex>(cfg: Config, index: I, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let index = Arc::new(index);
    let (resync_tx, resync_rx) = mpsc::unbounded_channel();
    let state = Arc::new(State {
        metrics: metrics.clone(),
        cursors: Mutex::new(HashMap::new()),
        stale: Arc::new(DashMap::new()),
        resync_tx,
        log: RateLimitedLog { last: Mutex::new(HashMap::new()), every: Duration::from_secs(10) },
        connected: AtomicBool::new(false),
        readiness: Mutex::new(Readiness {
            broadcast_at: Instant::now(),
            open: HashSet::new(),
            completed: 0,
            last_activity: Instant::now(),
            ready: false,
        }),
        ready: AtomicBool::new(false),
        events_prefix: events_prefix(&cfg),
        cfg: cfg.clone(),
    });
    let hook: OnApplied = {
        let state = state.clone();
        Arc::new(move |worker, out, ts_ns| {
            let m = &state.metrics;
            m.blocks_applied.with_label_values(&["stored"]).inc_by(out.stored);
            m.blocks_applied.with_label_values(&["removed"]).inc_by(out.removed);
            m.unknown_removes.inc_by(out.unknown_removes);
            if out.unplaceable > 0 {
                // Its position and prefix are unknown: the worker's state is off until a resync.
                m.unplaceable_blocks.inc_by(out.unplaceable);
                state.mark_stale(worker);
            }
            let now = now_ns();
            if ts_ns > 0 && now >= ts_ns {
                m.event_lag.observe((now - ts_ns) as f64 / 1e9);
            }
        })
    };
    let pool = Arc::new(ApplyPool::new(index.clone(), cfg.apply_threads(), cfg.queue_capacity, Some(hook)));

    let http = tokio::net::TcpListener::bind(&cfg.metrics_addr)
        .await
        .with_context(|| format!("binding metrics_addr {}", cfg.metrics_addr))?;
    let (nats_tx, nats_rx) = mpsc::unbounded_channel();
    let client = connect(&cfg, nats_tx).await?;
    // Lookups get a connection of their own, so a reply never queues behind event batches.
    let (lookup_events, _ignored) = mpsc::unbounded_channel();
    let lookup_client = connect(&cfg, lookup_events).await?;
    let mut events = client.subscribe(format!("{}*", state.events_prefix)).await.context("subscribing to events")?;
    // One queue subscriber per core: NATS spreads lookups over them, each answers in turn.
    let mut lookups = Vec::new();
    for _ in 0..std::thread::available_parallelism().map_or(2, |n| n.get()) {
        let sub = lookup_client
            .queue_subscribe(format!("{}.lookup", cfg.prefix), "kvindex".into())
            .await
            .context("subscribing to lookups")?;
        lookups.push(sub);
    }
    let connected = client.connection_state() == async_nats::connection::State::Connected;
    state.connected.store(connected, Ordering::Relaxed);
    metrics.nats_connected.set(connected as i64);
    tracing::info!(
        nats = %cfg.nats_url, prefix = %cfg.prefix, metrics = %cfg.metrics_addr, backend = index.name(),
        apply_threads = cfg.apply_threads(), "kvindex serving"
    );
    // A restarted daemon rebuilds its index from the publishers.
    broadcast_resync(&client, &state).await;

    let background = [
        tokio::spawn(nats_events(client.clone(), state.clone(), nats_rx)),
        tokio::spawn(resync_loop(client.clone(), state.clone(), resync_rx)),
        tokio::spawn(ttl_loop(state.clone(), pool.clone())),
        tokio::spawn(readiness_loop(state.clone())),
        tokio::spawn(http_server(http, state.clone(), index.clone(), pool.clone())),
    ];
    let (stop_lookups, stopped) = tokio::sync::watch::channel(false);
    let lookup_tasks: Vec<_> = lookups
        .into_iter()
        .map(|sub| tokio::spawn(serve_lookups(lookup_client.clone(), sub, state.clone(), index.clone(), stopped.clone())))
        .collect();

    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            msg = events.next() => match msg {
                Some(msg) => ingest(&state, &pool, msg.subject.as_str(), &msg.payload),
                None => break,
            },
        }
    }

    tracing::info!("shutting down: applying queued events, answering lookups in flight");
    let _ = events.unsubscribe().await;
    let _ = stop_lookups.send(true);
    for task in lookup_tasks {
        let _ = task.await;
    }
    let flushing = pool.clone();
    let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
    let _ = client.flush().await;
    let _ = lookup_client.flush().await;
    for task in background {
        task.abort();
    }
    tracing::info!("kvindex stopped");
    Ok(())
}

/// Answers the lookups of one queue subscriber until told to stop; then takes no new ones.
/// The answer in progress is finished before the task returns.
async fn serve_lookups<I: KvIndex>(
    client: Client,
    mut lookups: async_nats::Subscriber,
    state: Arc<State>,
    index: Arc<I>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = lookups.next() => match msg {
                Some(msg) => answer(&client, &state, &*index, msg).await,
                None => break,
            },
        }
    }
    let _ = lookups.unsubscribe().await;
}

/// Applies one message from `{prefix}.events.{worker_id}`.
fn ingest<I: KvIndex>(state: &State, pool: &ApplyPool<I>, subject: &str, payload: &[u8]) {
    let m = &state.metrics;
    let Some(subject_id) = subject.strip_prefix(state.events_prefix.as_str()).and_then(|s| s.parse::<u64>().ok()) else {
        state.fail("bad_subject", || format!("events subject {subject:?} does not end in a worker id"));
        return;
    };
    let batch = match decode_batch(payload) {
        Ok(b) => b,
        Err(e) => {
            state.fail(e.reason(), || format!("dropped a message from worker {subject_id}: {e}"));
            return;
        }
    };
    m.batches_received.inc();
    if batch.worker_id != subject_id {
        state.fail("worker_mismatch", || {
            format!("dropped a batch for worker {} sent on the subject of worker {subject_id}", batch.worker_id)
        });
        return;
    }
    let w = WorkerId::new(batch.worker_id, batch.dp_rank);
    let mut out = Vec::with_capacity(batch.events.len() + 1);
    let mut cursors = state.cursors.lock();
    let c = cursors.entry(w).or_insert(Cursor {
        epoch: batch.epoch,
        next_id: None,
        last_seen: Instant::now(),
        snapshot_clean: false,
    });
    c.last_seen = Instant::now();
    if c.epoch != batch.epoch {
        // The publisher restarted: whatever it held before is gone.
        m.epochs_changed.inc();
        tracing::info!(worker = %w, old = c.epoch, new = batch.epoch, "publisher restarted with a new epoch; clearing the worker");
        *c = Cursor { epoch: batch.epoch, next_id: None, last_seen: Instant::now(), snapshot_clean: false };
        out.push(WorkerEvent::Cleared);
        state.clear_stale(w);
    }
    // Nothing is known of this worker's sequence (first heard from, new epoch, expired): unless
    // it starts at event 0 or with a snapshot, events came before that this index never saw.
    let mut unknown_history = c.next_id.is_none();
    let mut midstream = false;
    let mut gap = false;
    let mut opened = false;
    for ev in batch.events {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                state.fail(e.reason(), || format!("skipped an event of worker {w}: {e}"));
                continue;
            }
        };
        let opens_snapshot = batch.snapshot && ev.data == EventData::Cleared;
        if unknown_history {
            unknown_history = false;
            midstream = ev.event_id != 0 && !opens_snapshot;
        }
        match c.next_id {
            Some(n) if ev.event_id < n => {
                m.duplicate_events.inc();
                continue;
            }
            // A snapshot starts afresh, so events missed before it do not matter.
            Some(n) if ev.event_id > n && !opens_snapshot => {
                m.event_gaps.inc();
                gap = true;
                c.snapshot_clean = false;
            }
            _ => {}
        }
        c.next_id = Some(ev.event_id + 1);
        if opens_snapshot {
            c.snapshot_clean = true;
            opened = true;
        }
        match ev.data {
            EventData::Stored { tier, blocks, .. } if tier != Tier::Device => {
                m.non_device_blocks.with_label_values(&[tier.as_str()]).inc_by(blocks.len() as u64);
            }
            EventData::Stored { parent, blocks, .. } => {
                m.events_applied.with_label_values(&["stored"]).inc();
                out.push(WorkerEvent::Stored { parent, blocks });
            }
            EventData::Removed { hashes } => {
                m.events_applied.with_label_values(&["removed"]).inc();
                out.push(WorkerEvent::Removed { hashes });
            }
            EventData::Cleared => {
                m.events_applied.with_label_values(&["cleared"]).inc();
                out.push(WorkerEvent::Cleared);
            }
        }
    }
    // The publisher's next event id shows events lost at the tail (a heartbeat after them).
    match (batch.next_event_id, c.next_id) {
        (Some(n), Some(x)) if n > x => {
            m.event_gaps.inc();
            gap = true;
            c.snapshot_clean = false;
            c.next_id = Some(n);
        }
        (Some(n), None) => {
            midstream |= n > 0;
            c.next_id = Some(n);
        }
        // A heartbeat without it tells nothing of the sequence.
        (None, None) => midstream = true,
        _ => {}
    }
    let snapshot_done = batch.snapshot && batch.snapshot_end && c.snapshot_clean && !gap;
    if batch.snapshot_end {
        c.snapshot_clean = false;
    }
    drop(cursors);
    if batch.snapshot && (opened || batch.snapshot_end) {
        state.snapshot_progress(w, opened, batch.snapshot_end);
        m.snapshots
            .with_label_values(&[if snapshot_done {
                "complete"
            } else if batch.snapshot_end {
                "gap"
            } else {
                "begun"
            }])
            .inc();
    }
    if gap {
        state.log.warn("event_gap", || format!("worker {w} skipped event ids; marked stale, asking it to resync"));
        state.mark_stale(w);
    } else if midstream {
        m.midstream_workers.inc();
        state.log.warn("midstream", || format!("worker {w} first heard mid-sequence; stale until its snapshot"));
        state.mark_stale(w);
    } else if snapshot_done {
        state.clear_stale(w);
    }
    if !out.is_empty() {
        if let Err(full) = pool.try_apply(w, out, batch.ts_ns) {
            // Backpressure: wait for the worker's apply thread rather than drop anything.
            tokio::task::block_in_place(|| pool.apply(full.worker, full.events, batch.ts_ns));
        }
    }
}

/// Answers one lookup request; an undecodable request gets an `error` reply.
async fn answer<I: KvIndex>(client: &Client, state: &State, index: &I, msg: async_nats::Message) {
    let start = Instant::now();
    let (resp, result) = match LookupRequest::decode(&msg.payload) {
        Ok(req) => {
            let query = req.local_hashes();
            let opts = MatchOptions { workers: req.workers, max_blocks: req.max_blocks.map(|m| m as usize) };
            let matches = index
                .find_matches(&query, &opts)
                .into_iter()
                .map(|m| MatchEntry {
                    worker_id: m.worker.worker_id,
                    dp_rank: m.worker.dp_rank,
                    blocks: m.blocks,
                    stale: state.stale.contains_key(&m.worker),
                })
                .collect();
            (LookupResponse::Matches { matches }, "ok")
        }
        Err(error) => {
            state.log.warn("bad_lookup", || format!("lookup request rejected: {error}"));
            (LookupResponse::Error { error }, "error")
        }
    };
    if let Some(reply) = msg.reply {
        if let Err(e) = client.publish(reply, resp.encode().into()).await {
            state.log.warn("reply_failed", || format!("could not send a lookup reply: {e}"));
        }
    }
    state.metrics.lookups.with_label_values(&[result]).inc();
    state.metrics.lookup_duration.with_label_values(&[result]).observe(start.elapsed().as_secs_f64());
}

/// Asks every publisher for its block set; `/readyz` waits for their snapshots.
async fn broadcast_resync(client: &Client, state: &State) {
    state.begin_rebuild();
    match client.publish(format!("{}.resync", state.cfg.prefix), bytes::Bytes::new()).await {
        Ok(()) => state.metrics.resync_requests.with_label_values(&["all"]).inc(),
        Err(e) => tracing::warn!("could not broadcast a resync request: {e}"),
    }
}

/// Follows the NATS connection: state in metrics and logs, a broadcast resync on reconnect.
async fn nats_events(client: Client, state: Arc<State>, mut rx: mpsc::UnboundedReceiver<Event>) {
    let m = &state.metrics;
    // The first connection's broadcast is sent by `run`, once the subscriptions exist.
    let mut reconnect = false;
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
        m.nats_events.with_label_values(&[kind]).inc();
        match e {
            Event::Connected => {
                tracing::info!("connected to NATS");
                state.connected.store(true, Ordering::Relaxed);
                m.nats_connected.set(1);
                if reconnect {
                    // Events published while we were away are lost: ask every publisher for its state.
                    broadcast_resync(&client, &state).await;
                }
                reconnect = true;
            }
            Event::Disconnected | Event::Closed => {
                tracing::warn!("lost the NATS connection ({e}); reconnecting");
                state.connected.store(false, Ordering::Relaxed);
                m.nats_connected.set(0);
            }
            other => tracing::warn!("NATS: {other}"),
        }
    }
}

/// Asks stale workers to resync: at once when they turn stale (unless a broadcast has just
/// asked everyone), again after `resync_interval` if still stale, the wait doubling up to
/// `resync_max_interval`.
async fn resync_loop(client: Client, state: Arc<State>, mut rx: mpsc::UnboundedReceiver<WorkerId>) {
    let base = Duration::from_secs(state.cfg.resync_interval);
    let max = Duration::from_secs(state.cfg.resync_max_interval);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        let due: Vec<WorkerId> = tokio::select! {
            w = rx.recv() => match w { Some(w) => vec![w], None => return },
            _ = tick.tick() => state.stale.iter().map(|e| *e.key()).collect(),
        };
        let now = Instant::now();
        if now.duration_since(state.readiness.lock().broadcast_at) < base {
            // The broadcast's snapshots are on their way.
            continue;
        }
        for w in due {
            let Some(mut r) = state.stale.get_mut(&w) else { continue };
            if r.asked.is_some_and(|t| now.duration_since(t) < resync_wait(base, max, r.attempts)) {
                continue;
            }
            r.asked = Some(now);
            r.attempts += 1;
            let attempt = r.attempts;
            drop(r);
            state.metrics.resync_requests.with_label_values(&["worker"]).inc();
            let payload = ResyncRequest { worker_id: w.worker_id, dp_rank: w.dp_rank }.encode();
            let subject = format!("{}.resync.{}", state.cfg.prefix, w.worker_id);
            let (client, state) = (client.clone(), state.clone());
            tokio::spawn(async move {
                let answer = tokio::time::timeout(Duration::from_secs(2), client.request(subject, payload.into())).await;
                if !matches!(answer, Ok(Ok(_))) {
                    state.metrics.resync_unanswered.inc();
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
async fn readiness_loop(state: Arc<State>) {
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        state.check_ready();
    }
}

/// Drops workers silent for longer than `worker_ttl`, so a crashed engine stops attracting
/// requests.
async fn ttl_loop<I: KvIndex>(state: Arc<State>, pool: Arc<ApplyPool<I>>) {
    if state.cfg.worker_ttl == 0 {
        return;
    }
    let ttl = Duration::from_secs(state.cfg.worker_ttl);
    let mut tick = tokio::time::interval((ttl / 4).max(Duration::from_millis(250)));
    loop {
        tick.tick().await;
        let now = Instant::now();
        let expired: Vec<WorkerId> = {
            let mut cursors = state.cursors.lock();
            let gone: Vec<WorkerId> =
                cursors.iter().filter(|(_, c)| now.duration_since(c.last_seen) > ttl).map(|(w, _)| *w).collect();
            for w in &gone {
                cursors.remove(w);
            }
            gone
        };
        for w in expired {
            tracing::warn!(worker = %w, ttl_s = ttl.as_secs(), "worker silent past its TTL; dropping its blocks");
            state.metrics.workers_expired.inc();
            state.clear_stale(w);
            let pool = pool.clone();
            let _ = tokio::task::spawn_blocking(move || pool.remove_worker(w)).await;
        }
    }
}

fn metrics_text<I: KvIndex>(state: &State, index: &I, pool: &ApplyPool<I>) -> String {
    let m = &state.metrics;
    let stats = index.stats();
    m.index_placements.set(stats.placements as i64);
    m.index_entries.set(stats.entries as i64);
    m.index_workers.set(stats.workers as i64);
    for (t, depth) in pool.queue_depths().into_iter().enumerate() {
        m.apply_queue_depth.with_label_values(&[&t.to_string()]).set(depth as i64);
    }
    m.render()
}

async fn http_server<I: KvIndex>(listener: tokio::net::TcpListener, state: Arc<State>, index: Arc<I>, pool: Arc<ApplyPool<I>>) {
    use axum::http::StatusCode;
    use axum::routing::get;
    let metrics_state = state.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let (state, index, pool) = (metrics_state.clone(), index.clone(), pool.clone());
                async move {
                    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics_text(&state, &*index, &pool))
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ready = state.ready.load(Ordering::Relaxed);
                let connected = state.connected.load(Ordering::Relaxed);
                async move {
                    match (ready, connected) {
                        (true, _) => (StatusCode::OK, "ready\n"),
                        (false, false) => (StatusCode::SERVICE_UNAVAILABLE, "not connected to NATS\n"),
                        (false, true) => (StatusCode::SERVICE_UNAVAILABLE, "rebuilding the index from publishers' snapshots\n"),
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("metrics server stopped: {e}");
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
