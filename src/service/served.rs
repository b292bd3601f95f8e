//! One model served: its state, apply pool, NATS connections and tasks, started from its own
//! configuration; its event loop until shutdown; its drain. A daemon serves one model or
//! several ([`Models`]), each on its own subject prefix.

use super::state::{now_ns, State};
use super::{connect, huge_pages, ingest, lookup, recovery, replicas, routed, snapshot, stream, workers, LookupRuntime};
use crate::apply::{ApplyPool, OnApplied, Timing};
use crate::config::{Config, Ingest};
use crate::metrics::Metrics;
use async_nats::Client;
use futures::StreamExt;
use kvindex_core::index::KvIndex;
use kvindex_core::model::Model;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// What the HTTP APIs read of one served model.
pub(super) struct Served<I: KvIndex> {
    /// What `model_name` calls it (`default` for a daemon without a model table).
    pub(super) name: String,
    /// Its shared state: configuration, metrics, cursors, stale workers, health.
    pub(super) state: Arc<State>,
    /// Its apply pool, over its model.
    pub(super) pool: Arc<ApplyPool<I>>,
    /// Its ingest connection: a sharded model's other shards are asked over it.
    pub(super) client: Client,
}

// By hand: a derive would ask `I: Clone` of the index, which is shared, not copied.
impl<I: KvIndex> Clone for Served<I> {
    fn clone(&self) -> Self {
        Served { name: self.name.clone(), state: self.state.clone(), pool: self.pool.clone(), client: self.client.clone() }
    }
}

/// Every model a daemon serves, in the order configured.
pub(super) struct Models<I: KvIndex>(pub(super) Vec<Served<I>>);

impl<I: KvIndex> Models<I> {
    /// The model `name` names; without a name, the only one. The error says what to ask for.
    pub(super) fn pick(&self, name: Option<&str>) -> Result<&Served<I>, String> {
        match (name, &self.0[..]) {
            (None, [only]) => Ok(only),
            (Some(name), all) => all.iter().find(|m| m.name == name).ok_or_else(|| self.unknown(name)),
            (None, _) => Err(format!("name a model (model_name): this daemon serves {}", self.names())),
        }
    }

    /// Why `name` names no model.
    pub(super) fn unknown(&self, name: &str) -> String {
        format!("unknown model {name:?}: this daemon serves {}", self.names())
    }

    /// Alive: every model's apply threads run; or how many died.
    pub(super) fn alive(&self) -> Result<(), String> {
        let dead: usize = self.0.iter().map(|m| m.pool.dead_threads()).sum();
        if dead == 0 {
            Ok(())
        } else {
            Err(format!("{dead} apply thread(s) died"))
        }
    }

    /// Ready to answer lookups: every model is; or why not (the first model that is not).
    pub(super) fn ready(&self) -> Result<&'static str, String> {
        let mut said = "ready: answering lookups\n";
        for m in &self.0 {
            let (ready, why) = m.state.health.readyz();
            if !ready {
                return Err(if self.0.len() == 1 { why.to_string() } else { format!("model {:?}: {why}", m.name) });
            }
            said = why;
        }
        Ok(said)
    }

    fn names(&self) -> String {
        self.0.iter().map(|m| format!("{:?}", m.name)).collect::<Vec<_>>().join(", ")
    }
}

/// What the event loop is told besides events.
struct Signals {
    /// JetStream: read through a new consumer (see `stream::stream_watch`).
    reopen: mpsc::Receiver<()>,
    /// The snapshot task asks for a cut between two messages.
    cuts: mpsc::Receiver<snapshot::CutRequest>,
}

/// One model, started: what its event loop needs, and what it stops at shutdown.
pub(super) struct Running<I: KvIndex> {
    /// What the HTTP APIs read of it.
    served: Served<I>,
    /// Its lookups' connection, driven by the lookup runtime.
    lookup_client: Client,
    /// JetStream over its ingest connection.
    js: async_nats::jetstream::Context,
    /// Its events.
    events: stream::EventStream,
    /// Its event loop's other inputs.
    signals: Signals,
    /// Its background tasks, aborted after the drain.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Its membership in the lookup queue group, on the lookup runtime.
    membership: tokio::task::JoinHandle<()>,
    /// Tells the membership to leave the queue group.
    stop_lookups: watch::Sender<bool>,
}

impl<I: KvIndex> Running<I> {
    /// Starts model `name` with `cfg` and indexes made by `make`: its pool, its connections
    /// (lookups on `lookup_rt`), its event source and its tasks; asks the publishers to
    /// resync unless a snapshot restored it. `labelled`: its metrics carry `model="<name>"`.
    pub(super) async fn start(
        name: String,
        cfg: Config,
        labelled: bool,
        make: impl Fn() -> I,
        lookup_rt: &LookupRuntime,
    ) -> anyhow::Result<Running<I>> {
        let metrics = Arc::new(if labelled { Metrics::for_model(&name) } else { Metrics::new() });
        metrics.index.apply_queue_capacity.set(cfg.queue_capacity as i64);
        let (resync_tx, resync_rx) = mpsc::unbounded_channel();
        let state = Arc::new(State::new(cfg.clone(), metrics.clone(), resync_tx));
        // A restatement names a worker's blocks in every tier and group: four tiers' bounds.
        let restate_max = usize::try_from(cfg.max_blocks_per_worker.saturating_mul(4)).unwrap_or(usize::MAX);
        let model = Arc::new(Model::complete(&make, cfg.announcing()).with_restate_max(restate_max));
        let pool = Arc::new(ApplyPool::new(
            model,
            cfg.apply_threads(),
            cfg.queue_capacity,
            Some(applied_hook(&state)),
            Some(routed::announced_hook(&state)),
        ));
        let (events_tx, client_events) = mpsc::unbounded_channel();
        let client = connect(&cfg, events_tx).await?;
        let lookup_client = {
            let cfg = cfg.clone();
            let (lookup_events, _ignored) = mpsc::unbounded_channel();
            lookup_rt.handle.spawn(async move { connect(&cfg, lookup_events).await }).await??
        };
        let (events, restored) = stream::event_source(&client, &state, &pool).await?;
        started(&name, &state, &client, pool.model().device().name());
        // A restarted daemon rebuilds its index from the publishers, unless a snapshot and the
        // stream after it did.
        if restored {
            state.health.rebuilt();
        } else {
            recovery::broadcast_resync(&client, &state).await;
        }
        let (reopen_tx, reopen) = mpsc::channel::<()>(1);
        let (cut_tx, cuts) = mpsc::channel::<snapshot::CutRequest>(1);
        let js = async_nats::jetstream::new(client.clone());
        let mut tasks = Vec::new();
        if cfg.ingest == Ingest::Jetstream {
            tasks.push(tokio::spawn(snapshot::snapshot_loop(js.clone(), state.clone(), cut_tx)));
            tasks.push(tokio::spawn(stream::stream_watch(js.clone(), state.clone(), reopen_tx.clone())));
        }
        let c = &client;
        tasks.push(tokio::spawn(recovery::nats_events(c.clone(), state.clone(), client_events, reopen_tx)));
        tasks.push(tokio::spawn(recovery::resync_loop(c.clone(), state.clone(), resync_rx)));
        tasks.push(tokio::spawn(recovery::ttl_loop(state.clone(), pool.clone())));
        tasks.push(tokio::spawn(recovery::readiness_loop(state.clone())));
        tasks.push(tokio::spawn(routed::routed_loop(c.clone(), state.clone(), pool.clone())));
        tasks.push(tokio::spawn(workers::workers_responder(c.clone(), state.clone(), pool.clone())));
        tasks.push(tokio::spawn(replicas::replicas_loop(c.clone(), state.clone())));
        // In the lookup queue group only while ready: a replica rebuilding its index (after a
        // start or a reconnect) leaves lookups to the complete ones.
        let (stop_lookups, stopped) = watch::channel(false);
        let membership = lookup_rt.handle.spawn(lookup::lookup_membership(
            lookup_client.clone(),
            state.clone(),
            pool.clone(),
            cfg.lookup_threads(),
            stopped,
        ));
        Ok(Running {
            served: Served { name, state, pool, client },
            lookup_client,
            js,
            events,
            signals: Signals { reopen, cuts },
            tasks,
            membership,
            stop_lookups,
        })
    }

    /// What the HTTP APIs read of it.
    pub(super) fn served(&self) -> Served<I> {
        self.served.clone()
    }

    /// Ingests events until `stop` says so (or its events end), then drains: an error if an
    /// apply thread died (the daemon must then stop).
    pub(super) async fn run(self, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let Running { served, lookup_client, js, events, signals, tasks, membership, stop_lookups } = self;
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let failure = event_loop(&served.state, &served.pool, &js, events, signals, shutdown).await;
        let _ = stop_lookups.send(true);
        drain(&served, &lookup_client, membership).await;
        for task in tasks {
            task.abort();
        }
        match failure {
            Some(e) => Err(e.context(format!("model {:?}", served.name))),
            None => Ok(()),
        }
    }
}

/// The hook of every applied batch: counts what it did, and marks the worker stale when its
/// state here is now off (blocks over its bound, blocks that could not be placed).
fn applied_hook(state: &Arc<State>) -> OnApplied {
    let state = state.clone();
    Arc::new(move |worker, out, ts_ns, timing: Timing| {
        let applied = timing.taken.elapsed();
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
        if out.restatements_given_up > 0 {
            // Its old blocks stay beside the snapshot's: stale until a snapshot rebuilds it.
            metrics.apply.restatements_given_up.inc_by(out.restatements_given_up);
            state.log.warn("snapshot_too_large", || {
                format!("gave up restating worker {worker}: its snapshot names more blocks than a worker may hold; it is stale")
            });
            state.stale.mark(worker, "snapshot_too_large");
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
        if ts_ns > 0 {
            let hot = &metrics.hot;
            hot.stage_queued.observe(timing.taken.saturating_duration_since(timing.queued).as_secs_f64());
            hot.stage_apply.observe(applied.as_secs_f64());
        }
    })
}

/// Records the first connection's state and says what the model is served with.
fn started(name: &str, state: &State, client: &Client, backend: &str) {
    let cfg = &state.cfg;
    let connected = client.connection_state() == async_nats::connection::State::Connected;
    state.health.connected.store(connected, Ordering::Relaxed);
    state.metrics.nats.connected.set(connected as i64);
    tracing::info!(
        model = name, nats = %cfg.nats.nats_url, prefix = %cfg.prefix, backend, apply_threads = cfg.apply_threads(),
        "kvindex serving"
    );
    huge_pages::log_state();
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
async fn drain<I: KvIndex>(served: &Served<I>, lookup_client: &Client, membership: tokio::task::JoinHandle<()>) {
    let (state, pool) = (&served.state, &served.pool);
    let grace = state.cfg.shutdown_grace;
    tracing::info!(grace_s = grace, "shutting down: applying queued events, answering lookups in flight");
    let drain = async {
        let _ = membership.await;
        let flushing = pool.clone();
        let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
        let _ = served.client.flush().await;
        let _ = lookup_client.flush().await;
    };
    if tokio::time::timeout(Duration::from_secs(grace), drain).await.is_err() {
        tracing::warn!(grace_s = grace, "shutdown grace period over (NATS unreachable or apply queues long); exiting anyway");
    }
}
