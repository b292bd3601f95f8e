//! A real `nats-server` on a free port, and `kvindex serve` running against it in-process.

#![allow(dead_code)]

use kvindex::config::Config;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use kvindex::e2e::NatsProcess;

pub fn free_port() -> u16 {
    kvindex::e2e::free_port().expect("a free port")
}

/// A NATS server of the test's own, on loopback, stopped on drop.
pub struct NatsServer;

impl NatsServer {
    pub fn start() -> NatsProcess {
        NatsProcess::start().expect("nats-server starts")
    }

    pub fn start_on(port: u16) -> NatsProcess {
        NatsProcess::start_on(port).expect("nats-server starts")
    }
}

/// `kvindex serve` in this process; `stop` shuts it down the way SIGTERM does.
pub struct Daemon {
    pub cfg: Config,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    handle: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Daemon {
    pub async fn start(nats_url: &str, tune: impl FnOnce(&mut Config)) -> Self {
        let mut cfg = Config {
            nats_url: nats_url.into(),
            prefix: "t".into(),
            metrics_addr: format!("127.0.0.1:{}", free_port()),
            apply_threads: 2,
            resync_interval: 1,
            ready_settle_ms: 100,
            ..Config::default()
        };
        tune(&mut cfg);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(kvindex::service::serve(cfg.clone(), async move {
            let _ = rx.await;
        }));
        let d = Daemon { cfg, stop: Some(tx), handle };
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.http_get("/readyz").await.map(|(code, _)| code) != Some(200) {
            assert!(Instant::now() < deadline, "kvindex did not become ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        d
    }

    /// GET `path` from the metrics server: (status, body).
    pub async fn http_get(&self, path: &str) -> Option<(u16, String)> {
        http_get(&self.cfg.metrics_addr, path).await
    }

    pub async fn metrics(&self) -> String {
        self.http_get("/metrics").await.expect("metrics served").1
    }

    /// The value of one sample line of /metrics (`name{labels}`), 0 if absent.
    pub async fn metric(&self, sample: &str) -> f64 {
        metric_value(&self.metrics().await, sample)
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), &mut self.handle).await.expect("stops in time").expect("not panicked")
    }
}

/// GET `path` from an HTTP server (HTTP/1.0, so the server closes): (status, body).
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let get = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.ok()?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.ok()?;
        let code = buf.split_whitespace().nth(1)?.parse().ok()?;
        let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Some((code, body))
    };
    tokio::time::timeout(Duration::from_secs(5), get).await.ok().flatten()
}

/// The value of one sample line (`name{labels}`) of Prometheus text, 0 if absent.
pub fn metric_value(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Retries `check` until it returns `Some` or `secs` pass.
pub async fn eventually<T, F, Fut>(secs: u64, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
pub mod engine;
pub mod process;
