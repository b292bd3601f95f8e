//! `kvindex demo`: the routing win, live. NATS (started here unless given), `kvindex serve`
//! (unless one runs already), a fleet of mock engines with LRU prefix caches whose publishers
//! feed kvindex, and a router that asks kvindex about each request of a Mooncake trace and
//! sends it to a worker. The chosen worker's cache then serves and stores the request's
//! blocks, so routing decisions drive the events: a closed loop.
//!
//! The same requests also go to three fleets simulated alike but routed without kvindex:
//! round-robin, random, and an oracle that reads every cache directly (the best any index can
//! do with this cost function; kvindex, being exact, should come close). With a kvindex of its
//! own, a fifth fleet runs in approximate mode: its engines publish no events, its router
//! announces each choice, and kvindex answers from the announcements alone. After the trace,
//! [`crate::burst`] shows what predicted placements do for bursts that share a new prefix.

pub use crate::fleet::{DemoConfig, Live};
use crate::fleet::{Fleet, FleetReport, Policy, APPROXIMATE_BASE};
use crate::harness::{buckets, free_port, http_body, nats_or_own, quantile, sample, Daemon, NatsProcess};
use crate::http_router::{HttpRouter, Prompt};
use crate::python_router::PythonRouter;
use crate::trace::{chain_hashes, request_locals, TraceRequest};
use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use kvindex::config::Config;
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock};
use serde::Serialize;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct DemoReport {
    pub requests: u64,
    pub seconds: f64,
    pub fleets: Vec<FleetReport>,
    pub lookups: u64,
    pub lookup_errors: u64,
    /// Lookups answered without every shard (`missing_shards`): routed on part of the fleet.
    pub partial_answers: u64,
    pub lookup_rtt_p50_us: f64,
    pub lookup_rtt_p99_us: f64,
    /// The HTTP fleet's queries that got no answer.
    pub query_api_errors: u64,
    /// The Python fleet's lookups that got no answer.
    pub python_errors: u64,
    /// Interrupted (Ctrl-C) before the trace ended.
    pub interrupted: bool,
    /// Bursts of requests sharing a new prefix, routed with and without predictions.
    pub burst: Option<crate::burst::BurstReport>,
}

/// A scrape of the daemons' `/metrics`, for the live view's rates.
struct Scrape {
    /// When it was read.
    at: Instant,
    /// The metrics' text.
    text: String,
}

fn sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Quantile `q` of a histogram series between two scrapes.
fn delta_quantile(old: &str, new: &str, series: &str, q: f64) -> f64 {
    let (a, b) = (buckets(old, series), buckets(new, series));
    let delta: Vec<(f64, f64)> = b.iter().map(|&(le, c)| (le, c - a.iter().find(|x| x.0 == le).map_or(0.0, |x| x.1))).collect();
    quantile(&delta, q)
}

/// The live panel's lines.
fn panel(
    prev: &Scrape,
    now: &Scrape,
    fleets: &[Fleet],
    rtt: &Histogram<u64>,
    done: u64,
    total: Option<u64>,
    started: Instant,
) -> Vec<String> {
    let dt = now.at.duration_since(prev.at).as_secs_f64().max(1e-3);
    let rate = |name: &str| (sum(&now.text, name) - sum(&prev.text, name)).max(0.0) / dt;
    let lag = delta_quantile(&prev.text, &now.text, "kvindex_event_lag_seconds_bucket{", 0.99);
    let answer = delta_quantile(&prev.text, &now.text, "kvindex_lookup_duration_seconds_bucket{result=\"ok\",", 0.99);
    let progress = match total {
        Some(t) => format!("{done}/{t} requests"),
        None => format!("{done} requests"),
    };
    let mut lines = vec![
        format!("kvindex demo  {:>6.1} s  {progress}", started.elapsed().as_secs_f64()),
        format!(
            "  kvindex   events/s {:>9.0}   blocks/s {:>10.0}   lookups/s {:>7.0}   event lag p99 <= {:.1} ms   answer p99 <= {:.0} us",
            rate("kvindex_events_applied_total"),
            rate("kvindex_blocks_applied_total"),
            rate("kvindex_lookups_total"),
            lag * 1e3,
            answer * 1e6,
        ),
        format!(
            "  router    lookup round trip p50 {:.0} us, p99 {:.0} us ({} lookups)",
            rtt.value_at_quantile(0.5) as f64 / 1e3,
            rtt.value_at_quantile(0.99) as f64 / 1e3,
            rtt.len()
        ),
        format!(
            "  index     {:>9.0} blocks   {:>9.0} entries   {:>4.0} workers   {:.0} stale",
            sample(&now.text, "kvindex_index_blocks"),
            sample(&now.text, "kvindex_index_entries"),
            sample(&now.text, "kvindex_index_workers"),
            sample(&now.text, "kvindex_stale_workers"),
        ),
        "  hit rate so far:".to_string(),
    ];
    for f in fleets {
        lines.push(format!("    {:<24} {:>6.1} %", f.policy.name(), f.hit_rate() * 100.0));
    }
    lines
}

/// Where the demo runs: NATS (ours unless given; sharded, ours with the shards' mapping) and
/// kvindex (ours unless given: one daemon per shard).
struct Deployment {
    /// Our own `nats-server`, stopped on drop.
    _nats: Option<NatsProcess>,
    /// NATS's URL.
    url: String,
    /// Our own daemons, one per shard (none: a kvindex already running was given).
    daemons: Vec<Daemon>,
    /// Every kvindex's `/metrics` address.
    metrics_addrs: Vec<String>,
    /// The query API of our first daemon (none: kvindex was given).
    query_addr: Option<String>,
}

impl Deployment {
    async fn start(cfg: &DemoConfig) -> Result<Deployment> {
        let (nats, url) = if cfg.shards > 1 {
            let server = NatsProcess::start_sharded(&cfg.prefix, cfg.shards)?;
            let url = server.url();
            (Some(server), url)
        } else {
            nats_or_own(cfg.nats_url.as_deref())?
        };
        if let Some(addr) = &cfg.kvindex_metrics {
            let addr = addr.trim_start_matches("http://").trim_end_matches('/').to_string();
            return Ok(Deployment { _nats: nats, url, daemons: Vec::new(), metrics_addrs: vec![addr], query_addr: None });
        }
        let mut daemons = Vec::new();
        for shard in 0..cfg.shards {
            let daemon_cfg = Config {
                prefix: cfg.prefix.clone(),
                shards: cfg.shards,
                shard,
                metrics_addr: format!("127.0.0.1:{}", free_port()?),
                inspect_addr: format!("127.0.0.1:{}", free_port()?),
                query_addr: format!("127.0.0.1:{}", free_port()?),
                block_size: Some(block_tokens(cfg) as u32),
                routed_only_workers: (APPROXIMATE_BASE..APPROXIMATE_BASE + cfg.workers).collect(),
                routed_only_capacity: cfg.capacity as u64,
                ..Config::with_nats_url(url.clone())
            };
            daemons.push(Daemon::start(daemon_cfg).await.context("starting kvindex serve")?);
        }
        let metrics_addrs = daemons.iter().map(|d| d.cfg.metrics_addr.clone()).collect();
        let query_addr = daemons.first().map(|d| d.cfg.query_addr.clone());
        Ok(Deployment { _nats: nats, url, daemons, metrics_addrs, query_addr })
    }

    /// Every shard's metrics, as one text: counters add up across shards.
    async fn scrape(&self) -> Scrape {
        let mut text = String::new();
        for addr in &self.metrics_addrs {
            text += &http_body(addr, "/metrics").await;
        }
        Scrape { at: Instant::now(), text }
    }
}

/// The router and the fleets it routes for, with what it measured.
struct Routing {
    /// The event-fed fleet's engines' publishers, by worker.
    publishers: Vec<Publisher>,
    /// kvindex, asked and told.
    router: LookupClient,
    /// Every fleet, routed its own way.
    fleets: Vec<Fleet>,
    /// The event-fed fleet's worker ids.
    event_fed: Vec<u64>,
    /// The approximate fleet's (routed-only) worker ids, when kvindex is ours.
    routed_only: Option<Vec<u64>>,
    /// The HTTP fleet's router, when kvindex is ours.
    http: Option<HttpRouter>,
    /// The Python fleet's router, when a Python with the client was given.
    python: Option<PythonRouter>,
    /// Lookup round trips, ns.
    rtt: Histogram<u64>,
    /// Lookups that failed.
    lookup_errors: u64,
    /// Lookups answered without every shard.
    partial_answers: u64,
}

impl Routing {
    async fn start(cfg: &DemoConfig, at: &Deployment, nats: &async_nats::Client) -> Result<Routing> {
        let mut publishers = Vec::with_capacity(cfg.workers as usize);
        for w in 0..cfg.workers {
            publishers.push(Publisher::start(nats.clone(), PublisherConfig::new(&cfg.prefix, w, 0)).await?);
        }
        let router = LookupClient::new(async_nats::connect(&at.url).await?, &cfg.prefix).with_timeout(Duration::from_secs(2));
        // Approximate mode needs its workers declared routed-only: only a kvindex of our own is.
        let own = !at.daemons.is_empty();
        let fleets = [
            Policy::KvAware,
            Policy::KvAwareHttp,
            Policy::KvAwarePython,
            Policy::Approximate,
            Policy::Oracle,
            Policy::RoundRobin,
            Policy::Random,
        ]
        .into_iter()
        .filter(|&p| own || !matches!(p, Policy::Approximate | Policy::KvAwareHttp))
        .filter(|&p| cfg.python.is_some() || p != Policy::KvAwarePython)
        .map(|p| Fleet::new(p, cfg.workers as usize, cfg.seed))
        .collect();
        Ok(Routing {
            publishers,
            router,
            fleets,
            event_fed: (0..cfg.workers).collect(),
            routed_only: own.then(|| (APPROXIMATE_BASE..APPROXIMATE_BASE + cfg.workers).collect()),
            http: match &at.query_addr {
                Some(addr) => Some(HttpRouter::start(nats, &cfg.prefix, cfg.workers, addr.clone(), block_tokens(cfg)).await?),
                None => None,
            },
            python: match &cfg.python {
                Some(python) => Some(PythonRouter::start(nats, &at.url, &cfg.prefix, cfg.workers, python).await?),
                None => None,
            },
            rtt: Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?,
            lookup_errors: 0,
            partial_answers: 0,
        })
    }

    /// The event-fed fleet's depths for `hashes`: kvindex's answer (no answer: none).
    async fn depths(&mut self, hashes: &[LocalHash], workers: u64) -> HashMap<usize, u64> {
        let t = Instant::now();
        match self.router.lookup(&Query::hashes(hashes).only_workers(&self.event_fed)).await {
            Ok(answer) => {
                let _ = self.rtt.record(t.elapsed().as_nanos() as u64);
                self.partial_answers += u64::from(answer.is_partial());
                answer
                    .matches
                    .iter()
                    .filter(|m| m.worker_id < workers && !m.stale)
                    .map(|m| (m.worker_id as usize, m.blocks as u64))
                    .collect()
            }
            Err(e) => {
                self.lookup_errors += 1;
                if self.lookup_errors == 1 {
                    tracing::warn!("lookup failed ({e}); routing by load alone until kvindex answers");
                }
                HashMap::new()
            }
        }
    }

    /// Routes one request in every fleet; the event-fed fleet's chosen engine reports what its
    /// cache did, the approximate fleet's router announces its choice.
    async fn route(&mut self, req: &TraceRequest, now_ms: u64, cfg: &DemoConfig) {
        let locals = request_locals(req, cfg.factor);
        let engine = chain_hashes(&locals);
        let hashes: Vec<LocalHash> = locals.iter().map(|&l| LocalHash(l)).collect();
        let depths = self.depths(&hashes, cfg.workers).await;
        let approximate = match &self.routed_only {
            Some(ids) => routed_depths(&self.router, &hashes, ids).await,
            None => HashMap::new(),
        };
        let prompt = self.http.as_ref().map(|_| Prompt::of(req, cfg.factor, block_tokens(cfg)));
        let over_http = match (&mut self.http, &prompt) {
            (Some(h), Some(p)) => h.depths(&p.tokens).await,
            _ => HashMap::new(),
        };
        let over_python = match &mut self.python {
            Some(p) => p.depths(&hashes).await,
            None => HashMap::new(),
        };
        for fleet in self.fleets.iter_mut() {
            fleet.expire(now_ms);
            let asked = match fleet.policy {
                Policy::Approximate => &approximate,
                Policy::KvAwareHttp => &over_http,
                Policy::KvAwarePython => &over_python,
                _ => &depths,
            };
            // The HTTP fleet's engines make their blocks from the prompt's tokens.
            let (engine, locals) = match (&prompt, fleet.policy) {
                (Some(p), Policy::KvAwareHttp) => (&p.engine, &p.locals),
                _ => (&engine, &locals),
            };
            let w = fleet.choose(engine, asked, cfg.load_weight);
            let served = fleet.serve(w, req, engine, cfg, now_ms);
            match fleet.policy {
                Policy::Approximate => {
                    // No events: the router's word is all kvindex has (waited for, so the next
                    // request's answer includes it).
                    let to = APPROXIMATE_BASE + w as u64;
                    if let Err(e) = self.router.announce_applied(&Query::hashes(&hashes), to, 0).await {
                        tracing::warn!("announcement failed: {e}");
                    }
                }
                Policy::KvAware => report_cache(&self.publishers[w], &served, engine, locals).await,
                Policy::KvAwareHttp => {
                    if let Some(h) = &self.http {
                        report_cache(&h.publishers[w], &served, engine, locals).await;
                    }
                }
                Policy::KvAwarePython => {
                    if let Some(p) = &self.python {
                        report_cache(&p.publishers[w], &served, engine, locals).await;
                    }
                }
                _ => {}
            }
        }
    }
}

/// The chosen engine reports what its cache did: evictions, then the new blocks.
async fn report_cache(p: &Publisher, served: &crate::trace::Served, engine: &[u64], locals: &[u64]) {
    p.wait_for_room().await;
    if !served.evicted.is_empty() {
        let gone: Vec<BlockHash> = served.evicted.iter().map(|&b| BlockHash(b)).collect();
        p.removed(&gone);
    }
    if served.hit < engine.len() {
        let parent = served.hit.checked_sub(1).map(|i| BlockHash(engine[i]));
        let blocks: Vec<StoredBlock> = (served.hit..engine.len()).map(|i| StoredBlock::new(engine[i], locals[i])).collect();
        p.stored(parent, &blocks);
    }
}

/// The live view's state: the last scrape, and what is drawn.
struct View {
    /// The previous scrape, for rates.
    prev: Scrape,
    /// Panel lines on screen.
    drawn: usize,
    /// When the last log line went out.
    last_line: Instant,
}

/// Runs the demo over `trace` until it ends (or forever with `repeat`), or until `stop`
/// resolves; then reports.
pub async fn run(trace: &[TraceRequest], cfg: &DemoConfig, stop: impl std::future::Future<Output = ()>) -> Result<DemoReport> {
    anyhow::ensure!(!trace.is_empty(), "the trace has no requests");
    anyhow::ensure!(cfg.workers > 0 && cfg.workers <= 4096, "workers: 1 to 4096");
    anyhow::ensure!(
        cfg.shards == 1 || (cfg.nats_url.is_none() && cfg.kvindex_metrics.is_none()),
        "--shards runs a NATS server and kvindex shards of its own: leave out --nats-url and --kvindex"
    );
    anyhow::ensure!(cfg.shards >= 1, "shards: at least 1");
    let at = Deployment::start(cfg).await?;
    let nats = async_nats::connect(&at.url).await.with_context(|| format!("connecting to NATS at {}", at.url))?;
    let mut routing = Routing::start(cfg, &at, &nats).await?;
    let span_ms = trace.last().map_or(0, |r| r.timestamp) + 3_000;
    let total = (!cfg.repeat).then_some(trace.len() as u64);
    let started = Instant::now();
    let mut view = View { prev: at.scrape().await, drawn: 0, last_line: Instant::now() };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    tokio::pin!(stop);
    let (mut done, mut interrupted) = (0u64, false);
    'passes: for pass in 0u64.. {
        for req in trace {
            let now_ms = req.timestamp + pass * span_ms;
            let due = (cfg.speed > 0.0).then(|| started + Duration::from_secs_f64(now_ms as f64 / 1e3 / cfg.speed));
            // Wait for the request's arrival, redrawing the live view meanwhile.
            loop {
                let wait = async {
                    match due {
                        Some(d) => tokio::time::sleep_until(d.into()).await,
                        None => tokio::task::yield_now().await,
                    }
                };
                tokio::select! {
                    _ = &mut stop => { interrupted = true; break 'passes; }
                    _ = tick.tick() => {
                        if cfg.live == Live::Off { continue; }
                        let now = at.scrape().await;
                        let lines = panel(&view.prev, &now, &routing.fleets, &routing.rtt, done, total, started);
                        show(cfg.live, &lines, &mut view.drawn, &mut view.last_line);
                        view.prev = now;
                    }
                    _ = wait => break,
                }
            }
            routing.route(req, now_ms, cfg).await;
            done += 1;
        }
        if !cfg.repeat {
            break;
        }
    }
    if view.drawn > 0 {
        println!();
    }
    let http = routing.http.iter().flat_map(|h| h.publishers.iter());
    let python = routing.python.iter().flat_map(|p| p.publishers.iter());
    for p in routing.publishers.iter().chain(http).chain(python) {
        p.flush().await;
    }
    let burst =
        if cfg.burst && !interrupted && !cfg.repeat { Some(crate::burst::run(&nats, &routing.router, cfg).await?) } else { None };
    for d in at.daemons {
        d.stop().await?;
    }
    let rtt = &routing.rtt;
    Ok(DemoReport {
        requests: done,
        seconds: started.elapsed().as_secs_f64(),
        fleets: routing.fleets.iter().map(Fleet::report).collect(),
        lookups: rtt.len(),
        lookup_errors: routing.lookup_errors,
        partial_answers: routing.partial_answers,
        lookup_rtt_p50_us: rtt.value_at_quantile(0.5) as f64 / 1e3,
        lookup_rtt_p99_us: rtt.value_at_quantile(0.99) as f64 / 1e3,
        query_api_errors: routing.http.as_ref().map_or(0, |h| h.errors),
        python_errors: routing.python.as_ref().map_or(0, |p| p.errors),
        interrupted,
        burst,
    })
}

/// Tokens per block of the demo's engines: a trace block is 512 tokens, split `factor` ways.
fn block_tokens(cfg: &DemoConfig) -> u64 {
    512 / cfg.factor.max(1)
}

/// The approximate fleet's depths: kvindex's answer over its routed-only workers.
async fn routed_depths(router: &LookupClient, hashes: &[LocalHash], routed_only: &[u64]) -> HashMap<usize, u64> {
    match router.lookup(&Query::hashes(hashes).only_workers(routed_only)).await {
        Ok(answer) => answer
            .matches
            .iter()
            .filter(|m| m.worker_id >= APPROXIMATE_BASE)
            .map(|m| ((m.worker_id - APPROXIMATE_BASE) as usize, m.blocks as u64))
            .collect(),
        Err(_) => HashMap::new(),
    }
}

/// Draws the live view: the panel in place on a terminal, a line every five seconds in logs.
fn show(live: Live, lines: &[String], drawn: &mut usize, last_line: &mut Instant) {
    let mut out = std::io::stdout().lock();
    match live {
        Live::Panel => {
            if *drawn > 0 {
                let _ = write!(out, "\x1b[{}A\x1b[J", *drawn);
            }
            for l in lines {
                let _ = writeln!(out, "{l}");
            }
            *drawn = lines.len();
        }
        Live::Lines if last_line.elapsed() >= Duration::from_secs(5) => {
            let _ = writeln!(out, "{}", lines.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" | "));
            *last_line = Instant::now();
        }
        _ => {}
    }
    let _ = out.flush();
}

/// The live mode for this process's stdout.
pub fn live_for_stdout() -> Live {
    if std::io::stdout().is_terminal() {
        Live::Panel
    } else {
        Live::Lines
    }
}

/// The summary table.
pub fn table(r: &DemoReport, cfg: &DemoConfig) -> String {
    let mut s = format!(
        "{} requests in {:.1} s{}; {} workers per fleet, {} blocks of {} tokens each\n\n",
        r.requests,
        r.seconds,
        if r.interrupted { " (interrupted)" } else { "" },
        cfg.workers,
        cfg.capacity,
        block_tokens(cfg)
    );
    s += &format!("{:<24} {:>9} {:>22} {:>26}\n", "routing", "hit rate", "prefill tokens saved", "requests/worker max/mean");
    for f in &r.fleets {
        s += &format!(
            "{:<24} {:>7.1} % {:>22} {:>17} / {:>6.1}\n",
            f.policy.name(),
            f.hit_rate * 100.0,
            f.prefill_tokens_saved,
            f.requests_per_worker_max,
            f.requests_per_worker_mean
        );
    }
    s += &format!(
        "\nkvindex lookups: {} answered, {} failed; round trip p50 {:.0} us, p99 {:.0} us\n",
        r.lookups, r.lookup_errors, r.lookup_rtt_p50_us, r.lookup_rtt_p99_us
    );
    if let Some(b) = &r.burst {
        s += &crate::burst::table(b);
    }
    s
}
