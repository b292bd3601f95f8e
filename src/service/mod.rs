//! `kvindex serve`: the NATS service (docs/PROTOCOL.md). Ingests publishers' event batches
//! into the apply pool, tracks each worker's event sequence, answers routers' lookups, asks
//! publishers to resync, drops silent workers, and serves metrics and health over HTTP.
//!
//! - this file: start-up (the model, the pool, the connections, the tasks), the event loop,
//!   shutdown;
//! - [`state`]: what the tasks share, in parts; [`stale`]: the stale workers; [`cursors`]:
//!   each worker's event sequence; [`health`]: readiness;
//! - [`ingest`]: decoding batches and following each worker's event sequence;
//! - [`stream`]: where events come from (a subscription, or a JetStream consumer);
//! - [`answer`]: a lookup request answered from the model, in the wire's form;
//! - [`lookup`]: answering routers over NATS, in the lookup queue group while ready;
//! - [`routed`]: routers' announced placements (predictions, approximate mode);
//! - [`recovery`]: resync requests, TTL expiry, NATS reconnects;
//! - [`catch_up`]: whether a JetStream replica has caught up with its stream;
//! - [`snapshot`]: JetStream mode's index snapshots in the NATS object store;
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`; [`inspect`]: the inspect API;
//! - [`huge_pages`]: whether the heap gets transparent huge pages, said at start-up.

mod answer;
mod catch_up;
mod cursors;
mod health;
mod http;
mod huge_pages;
mod ingest;
mod inspect;
mod lookup;
mod recovery;
mod routed;
mod snapshot;
mod stale;
mod state;
mod stream;

use crate::apply::{ApplyPool, OnApplied};
use crate::config::{Config, Ingest};
use crate::metrics::Metrics;
use anyhow::Context;
use async_nats::{Client, Event};
use futures::StreamExt;
use kvindex_core::index::positional::PositionalIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{Backend, KvIndex};
use kvindex_core::model::Model;
use state::{now_ns, State};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// The runtime that answers lookups, apart from ingest's. Shut down without waiting when
/// dropped (it may be dropped inside the main runtime, where a blocking shutdown panics).
struct LookupRuntime {
    /// The runtime; taken on drop.
    rt: Option<tokio::runtime::Runtime>,
    /// A handle to spawn on it.
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
}

impl Drop for LookupRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
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
            let index_cfg = cfg.run_config();
            run(cfg, move || RunIndex::new(index_cfg), shutdown).await
        }
        Backend::Positional => {
            let index_cfg = cfg.positional_config();
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

/// The hook of every applied batch: counts what it did, and marks the worker stale when its
/// state here is now off (blocks over its bound, blocks that could not be placed).
fn applied_hook(state: &Arc<State>) -> OnApplied {
    let state = state.clone();
    Arc::new(move |worker, out, ts_ns, _taken| {
        let metrics = &state.metrics;
        metrics.hot.blocks_stored.inc_by(out.stored);
        metrics.hot.blocks_removed.inc_by(out.removed);
        metrics.apply.unknown_removes.inc_by(out.unknown_removes);
        // Past max_depth: ignored and counted, the worker stays whole (a resync would bring
        // the same chain back).
        metrics.apply.too_deep_blocks.inc_by(out.too_deep);
        // Host or disk chains whose parent is not in that tier: counted, never stale.
        metrics.apply.tier_unplaceable_blocks.inc_by(out.tier_unplaceable);
        // Hybrid groups' blocks without a place: the depth comes out shallower, never stale.
        metrics.apply.group_missed_blocks.inc_by(out.group_missed);
        if out.refused > 0 {
            metrics.ingest.refused_events.with_label_values(&["registry_full"]).inc_by(out.refused);
            let max = state.cfg.max_workers;
            state.log.warn("registry_full", || {
                format!("refused the events of worker {worker}: all {max} worker slots are taken (max_workers)")
            });
        }
        if out.over_limit > 0 {
            // Its blocks past max_blocks_per_worker are refused: its state is incomplete.
            metrics.apply.over_limit_blocks.inc_by(out.over_limit);
            let max = state.cfg.max_blocks_per_worker;
            state.log.warn("over_limit", || {
                format!(
                    "refused {} blocks of worker {worker}: it holds the most a worker may (max_blocks_per_worker = {max}); it is stale",
                    out.over_limit
                )
            });
            state.stale.mark(worker, "over_limit");
        }
        if out.unplaceable > 0 {
            // Its position and prefix are unknown: the worker's state is off until a resync.
            metrics.apply.unplaceable_blocks.inc_by(out.unplaceable);
            state.stale.mark(worker, "unplaceable");
        }
        let now = now_ns();
        if ts_ns > 0 && now >= ts_ns {
            metrics.ingest.event_lag.observe((now - ts_ns) as f64 / 1e9);
        }
    })
}

/// The HTTP listeners, bound before anything else starts so that a taken port fails at once.
struct Listeners {
    /// `/metrics`, `/healthz`, `/readyz`.
    metrics: tokio::net::TcpListener,
    /// The inspect API, unless `inspect_addr` is empty.
    inspect: Option<tokio::net::TcpListener>,
}

impl Listeners {
    async fn bind(cfg: &Config) -> anyhow::Result<Listeners> {
        let metrics = tokio::net::TcpListener::bind(&cfg.metrics_addr)
            .await
            .with_context(|| format!("binding metrics_addr {}", cfg.metrics_addr))?;
        let inspect = match cfg.inspect_addr.as_str() {
            "" => None,
            addr => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding inspect_addr {addr}"))?),
        };
        Ok(Listeners { metrics, inspect })
    }
}

/// The NATS connections: ingest's, and the lookups' on a runtime of their own (its I/O driven
/// by that runtime), so an answer never waits behind event batches, in the socket or for a
/// thread.
struct Connections {
    /// Events, announcements, resyncs, the inspect API's questions to other shards.
    client: Client,
    /// Lookups.
    lookup_client: Client,
    /// The runtime the lookups run on.
    lookup_rt: LookupRuntime,
}

impl Connections {
    /// The connections, and the state changes of ingest's.
    async fn open(cfg: &Config) -> anyhow::Result<(Connections, mpsc::UnboundedReceiver<Event>)> {
        let (events_tx, client_events) = mpsc::unbounded_channel();
        let client = connect(cfg, events_tx).await?;
        let lookup_rt = LookupRuntime::start(cfg.lookup_threads())?;
        let lookup_client = {
            let cfg = cfg.clone();
            let (lookup_events, _ignored) = mpsc::unbounded_channel();
            lookup_rt.handle.spawn(async move { connect(&cfg, lookup_events).await }).await??
        };
        Ok((Connections { client, lookup_client, lookup_rt }, client_events))
    }
}

/// What the event loop is told besides events.
struct Signals {
    /// JetStream: read through a new consumer (see `stream::stream_watch`).
    reopen: mpsc::Receiver<()>,
    /// The snapshot task asks for a cut between two messages.
    cuts: mpsc::Receiver<snapshot::CutRequest>,
}

/// Serves with indexes made by `make`: the device index, each other tier's, the groups' and
/// the predictions'.
async fn run<I: KvIndex>(cfg: Config, make: impl Fn() -> I, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    metrics.index.apply_queue_capacity.set(cfg.queue_capacity as i64);
    let (resync_tx, resync_rx) = mpsc::unbounded_channel();
    let state = Arc::new(State::new(cfg.clone(), metrics.clone(), resync_tx));
    let model = Arc::new(Model::complete(&make, cfg.announcing()));
    let pool = Arc::new(ApplyPool::new(
        model,
        cfg.apply_threads(),
        cfg.queue_capacity,
        Some(applied_hook(&state)),
        Some(routed::announced_hook(&state)),
    ));
    let listeners = Listeners::bind(&cfg).await?;
    let (conns, client_events) = Connections::open(&cfg).await?;
    let (events, restored) = stream::event_source(&conns.client, &state, &pool).await?;
    started(&state, &conns.client, pool.model().device().name());
    // A restarted daemon rebuilds its index from the publishers, unless a snapshot and the
    // stream after it did.
    if restored {
        state.health.rebuilt();
    } else {
        recovery::broadcast_resync(&conns.client, &state).await;
    }
    let (reopen_tx, reopen) = mpsc::channel::<()>(1);
    let (cut_tx, cuts) = mpsc::channel::<snapshot::CutRequest>(1);
    let js = async_nats::jetstream::new(conns.client.clone());
    let mut tasks = Vec::new();
    if cfg.ingest == Ingest::Jetstream {
        tasks.push(tokio::spawn(snapshot::snapshot_loop(js.clone(), state.clone(), cut_tx)));
        tasks.push(tokio::spawn(stream::stream_watch(js.clone(), state.clone(), reopen_tx.clone())));
    }
    let c = &conns.client;
    tasks.push(tokio::spawn(recovery::nats_events(c.clone(), state.clone(), client_events, reopen_tx)));
    tasks.push(tokio::spawn(recovery::resync_loop(c.clone(), state.clone(), resync_rx)));
    tasks.push(tokio::spawn(recovery::ttl_loop(state.clone(), pool.clone())));
    tasks.push(tokio::spawn(recovery::readiness_loop(state.clone())));
    tasks.push(tokio::spawn(routed::routed_loop(c.clone(), state.clone(), pool.clone())));
    tasks.push(tokio::spawn(inspect::workers_responder(c.clone(), state.clone(), pool.clone())));
    tasks.push(tokio::spawn(http::http_server(listeners.metrics, state.clone(), pool.clone())));
    if let Some(listener) = listeners.inspect {
        tasks.push(tokio::spawn(inspect::inspect_server(listener, state.clone(), pool.clone(), c.clone())));
    }
    // In the lookup queue group only while ready: a replica rebuilding its index (after a
    // start or a reconnect) leaves lookups to the complete ones.
    let (stop_lookups, stopped) = tokio::sync::watch::channel(false);
    let membership = conns.lookup_rt.handle.spawn(lookup::lookup_membership(
        conns.lookup_client.clone(),
        state.clone(),
        pool.clone(),
        cfg.lookup_threads(),
        stopped,
    ));
    let failure = event_loop(&state, &pool, &js, events, Signals { reopen, cuts }, shutdown).await;
    let _ = stop_lookups.send(true);
    drain(&state, &pool, &conns, membership).await;
    for task in tasks {
        task.abort();
    }
    match failure {
        Some(e) => Err(e),
        None => {
            tracing::info!("kvindex stopped");
            Ok(())
        }
    }
}

/// Records the first connection's state and says what the service runs with.
fn started(state: &State, client: &Client, backend: &str) {
    let cfg = &state.cfg;
    let connected = client.connection_state() == async_nats::connection::State::Connected;
    state.health.connected.store(connected, Ordering::Relaxed);
    state.metrics.nats.connected.set(connected as i64);
    tracing::info!(
        nats = %cfg.nats.nats_url, prefix = %cfg.prefix, metrics = %cfg.metrics_addr, inspect = %cfg.inspect_addr, backend,
        apply_threads = cfg.apply_threads(), "kvindex serving"
    );
    huge_pages::log_state();
    let ignored = Config::ignored_env();
    if !ignored.is_empty() {
        tracing::info!(variables = ?ignored, "ignoring KVINDEX_* variables that name no configuration key");
    }
}

/// Ingests events until `shutdown` resolves or the events end, answering the loop's other
/// signals between two messages; an error if an apply thread died (the daemon must then stop).
async fn event_loop<I: KvIndex>(
    state: &Arc<State>,
    pool: &Arc<ApplyPool<I>>,
    js: &async_nats::jetstream::Context,
    mut events: stream::EventStream,
    mut signals: Signals,
    shutdown: impl Future<Output = ()> + Send,
) -> Option<anyhow::Error> {
    tokio::pin!(shutdown);
    let mut watchdog = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = &mut shutdown => return None,
            msg = events.next() => match msg {
                Some(msg) => {
                    ingest::ingest(state, pool, msg.subject.as_str(), &msg.payload);
                    if let Some(seq) = msg.seq {
                        state.durable.stream_seq.store(seq, Ordering::Relaxed);
                    }
                    if let Some(pending) = msg.pending {
                        stream::replay_progress(state, pool, pending);
                    }
                }
                None => return None,
            },
            Some(()) = signals.reopen.recv() => {
                if let Some(fresh) = stream::reopen(js, state, pool).await {
                    events = fresh;
                }
            }
            Some(reply) = signals.cuts.recv() => {
                let _ = reply.send(snapshot::cut(state, pool, state.durable.stream_seq.load(Ordering::Relaxed)));
            }
            _ = watchdog.tick() => {
                let dead = pool.dead_threads();
                state.metrics.index.dead_apply_threads.set(dead as i64);
                if dead > 0 {
                    tracing::error!(dead, "an apply thread died: its workers' events can no longer be applied; exiting");
                    return Some(anyhow::anyhow!("{dead} apply thread(s) died"));
                }
            }
        }
    }
}

/// Stops taking events: answers the lookups in flight, applies what is queued, flushes NATS,
/// within `shutdown_grace` (a terminating pod must not hang while NATS is away).
async fn drain<I: KvIndex>(
    state: &State,
    pool: &Arc<ApplyPool<I>>,
    conns: &Connections,
    membership: tokio::task::JoinHandle<()>,
) {
    let grace = state.cfg.shutdown_grace;
    tracing::info!(grace_s = grace, "shutting down: applying queued events, answering lookups in flight");
    let drain = async {
        let _ = membership.await;
        let flushing = pool.clone();
        let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
        let _ = conns.client.flush().await;
        let _ = conns.lookup_client.flush().await;
    };
    if tokio::time::timeout(Duration::from_secs(grace), drain).await.is_err() {
        tracing::warn!(grace_s = grace, "shutdown grace period over (NATS unreachable or apply queues long); exiting anyway");
    }
}
