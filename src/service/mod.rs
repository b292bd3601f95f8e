//! `kvindex serve`: the NATS service (docs/PROTOCOL.md). Ingests publishers' event batches
//! into the apply pool, tracks each worker's event sequence, answers routers' lookups, asks
//! publishers to resync, drops silent workers, and serves metrics and health over HTTP; for
//! one model or several, each on its own subject prefix.
//!
//! - this file: start-up (the listeners, the lookup runtime, each model, the HTTP servers),
//!   and shutdown;
//! - [`served`]: one model served: its state, pool, connections, tasks, event loop and drain;
//! - [`state`]: what the tasks share, in parts; [`stale`]: the stale workers; [`cursors`]:
//!   each worker's event sequence; [`health`]: readiness;
//! - [`ingest`]: decoding batches and following each worker's event sequence;
//! - [`stream`]: where events come from (a subscription, or a JetStream consumer);
//! - [`answer`]: a lookup request answered from the model, in the wire's form;
//! - [`lookup`]: answering routers over NATS, in the lookup queue group while ready;
//! - [`routed`]: routers' announced placements (predictions, approximate mode);
//! - [`recovery`]: resync requests, TTL expiry, NATS reconnects;
//! - [`replicas`]: replicas of a prefix comparing their workers' digests at the same event ids;
//!   [`checkpoints`]: what each keeps of its own and its siblings';
//! - [`catch_up`]: whether a JetStream replica has caught up with its stream;
//! - [`snapshot`]: JetStream mode's index snapshots in the NATS object store;
//! - [`http`]: `/metrics`, `/healthz`, `/readyz`; [`inspect`]: the inspect API; [`query`]: the
//!   query API for routers; [`workers`]: the workers listed by both;
//! - [`huge_pages`]: whether the heap gets transparent huge pages, said at start-up.

mod answer;
mod catch_up;
mod checkpoints;
mod cursors;
mod health;
mod http;
mod huge_pages;
mod ingest;
mod inspect;
mod lookup;
mod query;
mod recovery;
mod replicas;
mod routed;
mod served;
mod snapshot;
mod stale;
mod state;
mod stream;
mod workers;

use crate::config::Config;
use anyhow::Context;
use async_nats::{Client, Event};
use kvindex_core::index::positional::PositionalIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{Backend, KvIndex};
use served::{Models, Running};
use state::State;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};

/// The runtime that answers lookups, apart from ingest's. Shut down without waiting when
/// dropped (it may be dropped inside the main runtime, where a blocking shutdown panics).
pub(super) struct LookupRuntime {
    /// The runtime; taken on drop.
    rt: Option<tokio::runtime::Runtime>,
    /// A handle to spawn on it.
    pub(super) handle: tokio::runtime::Handle,
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
        Backend::Runs => run(cfg, |c: &Config| RunIndex::new(c.run_config()), shutdown).await,
        Backend::Positional => run(cfg, |c: &Config| PositionalIndex::new(c.positional_config()), shutdown).await,
        Backend::Reference => anyhow::bail!("configuration: backend: the reference model is for tests, not for serving"),
    }
}

/// A connection to NATS with `cfg`'s servers, credentials and TLS that tells `events` of its
/// state changes (connected, disconnected, slow consumer).
pub(super) async fn connect(cfg: &Config, events: mpsc::UnboundedSender<Event>) -> anyhow::Result<Client> {
    let opts = cfg.nats.options("kvindex").await?.subscription_capacity(cfg.subscription_capacity).event_callback(move |e| {
        let events = events.clone();
        async move {
            let _ = events.send(e);
        }
    });
    Ok(cfg.nats.connect_with(opts).await?)
}

/// The HTTP listeners, bound before anything else starts so that a taken port fails at once.
struct Listeners {
    /// `/metrics`, `/healthz`, `/readyz`.
    metrics: tokio::net::TcpListener,
    /// The inspect API, unless `inspect_addr` is empty.
    inspect: Option<tokio::net::TcpListener>,
    /// The query API, unless `query_addr` is empty.
    query: Option<tokio::net::TcpListener>,
}

impl Listeners {
    async fn bind(cfg: &Config) -> anyhow::Result<Listeners> {
        let metrics = tokio::net::TcpListener::bind(&cfg.metrics_addr)
            .await
            .with_context(|| format!("binding metrics_addr {}", cfg.metrics_addr))?;
        let optional = |key: &'static str, addr: String| async move {
            match addr.as_str() {
                "" => Ok(None),
                addr => tokio::net::TcpListener::bind(addr).await.map(Some).with_context(|| format!("binding {key} {addr}")),
            }
        };
        let inspect = optional("inspect_addr", cfg.inspect_addr.clone()).await?;
        let query = optional("query_addr", cfg.query_addr.clone()).await?;
        Ok(Listeners { metrics, inspect, query })
    }
}

/// Serves every model of `cfg` with indexes made by `make` from the model's configuration,
/// until `shutdown` resolves or a model fails; then stops them all.
async fn run<I: KvIndex>(
    cfg: Config,
    make: impl Fn(&Config) -> I,
    shutdown: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let models = cfg.served_models().map_err(|e| anyhow::anyhow!(e))?;
    let labelled = !cfg.models.is_empty();
    let listeners = Listeners::bind(&cfg).await?;
    let lookup_rt = LookupRuntime::start(cfg.lookup_threads())?;
    let mut running: Vec<Running<I>> = Vec::with_capacity(models.len());
    for (name, model_cfg) in models {
        let make = || make(&model_cfg);
        running.push(Running::start(name, model_cfg.clone(), labelled, make, &lookup_rt).await?);
    }
    let served = Arc::new(Models(running.iter().map(Running::served).collect()));
    let ignored = Config::ignored_env();
    if !ignored.is_empty() {
        tracing::info!(variables = ?ignored, "ignoring KVINDEX_* variables that name no configuration key");
    }
    tracing::info!(metrics = %cfg.metrics_addr, inspect = %cfg.inspect_addr, query = %cfg.query_addr, "kvindex listening");
    let query_metrics = Arc::new(query::QueryMetrics::new());
    let mut tasks = vec![tokio::spawn(http::http_server(listeners.metrics, served.clone(), query_metrics.clone()))];
    if let Some(listener) = listeners.inspect {
        tasks.push(tokio::spawn(inspect::inspect_server(listener, served.clone(), cfg.inspect_token.clone())));
    }
    if let Some(listener) = listeners.query {
        tasks.push(tokio::spawn(query::query_server(listener, served.clone(), cfg.clone(), query_metrics)));
    }
    // Every model runs until shutdown, or until one fails: then all stop.
    let (stop, stopped) = watch::channel(false);
    let (failed_tx, mut failed) = mpsc::channel::<()>(running.len());
    let loops: Vec<_> = running
        .into_iter()
        .map(|m| {
            let (stopped, failed_tx) = (stopped.clone(), failed_tx.clone());
            tokio::spawn(async move {
                let ended = m.run(stopped).await;
                if ended.is_err() {
                    let _ = failed_tx.send(()).await;
                }
                ended
            })
        })
        .collect();
    tokio::select! {
        _ = shutdown => {}
        _ = failed.recv() => {}
    }
    let _ = stop.send(true);
    let mut first_failure = None;
    for ended in futures::future::join_all(loops).await {
        if let Err(e) = ended.map_err(anyhow::Error::from).and_then(|r| r) {
            first_failure.get_or_insert(e);
        }
    }
    for task in tasks {
        task.abort();
    }
    match first_failure {
        Some(e) => Err(e),
        None => {
            tracing::info!("kvindex stopped");
            Ok(())
        }
    }
}
