//! A real `nats-server` on a free port, and `kvindex serve` running against it in-process.

#![allow(dead_code)]

use kvindex::config::Config;
use std::time::{Duration, Instant};

use kvindex_tools::harness;

pub use harness::NatsProcess;

pub fn free_port() -> u16 {
    harness::free_port().expect("a free port")
}

/// Two consecutive free ports, the first returned.
pub fn port_pair() -> u16 {
    harness::free_port_pair().expect("two consecutive free ports")
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
    inner: harness::Daemon,
}

impl Daemon {
    pub async fn start(nats_url: &str, tune: impl FnOnce(&mut Config)) -> Self {
        let mut cfg = Config {
            prefix: "t".into(),
            metrics_addr: format!("127.0.0.1:{}", free_port()),
            inspect_addr: format!("127.0.0.1:{}", free_port()),
            apply_threads: 2,
            resync_interval: 1,
            ready_settle_ms: 100,
            ..Config::with_nats_url(nats_url)
        };
        tune(&mut cfg);
        let inner = harness::Daemon::start(cfg.clone()).await.expect("kvindex becomes ready");
        Daemon { cfg, inner }
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

    pub async fn stop(self) -> anyhow::Result<()> {
        tokio::time::timeout(Duration::from_secs(10), self.inner.stop()).await.expect("stops in time")
    }
}

pub use harness::{http_get, sample as metric_value};

/// A `nats-server` with JetStream, storing in a fresh directory (removed on drop).
pub struct JetStreamNats {
    pub nats: NatsProcess,
    store: std::path::PathBuf,
}

impl JetStreamNats {
    pub fn start() -> JetStreamNats {
        let store = std::env::temp_dir().join(format!("kvindex-js-{}-{}", std::process::id(), free_port()));
        let js_args = ["-js", "-sd", store.to_str().expect("a UTF-8 temp dir")];
        let nats = NatsProcess::start_with(free_port(), &js_args, &[]).expect("nats-server with JetStream");
        JetStreamNats { nats, store }
    }
}

impl Drop for JetStreamNats {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.store);
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
/// Publishes `events` as one batch of `worker` (epoch 1) on prefix `t`, and flushes.
pub async fn publish(c: &async_nats::Client, worker: u64, events: Vec<kvindex_client::protocol::KvEvent>) {
    let ts_ns = kvindex_client::protocol::now_ns();
    let header = kvindex_client::protocol::BatchHeader { worker_id: worker, epoch: 1, ts_ns, ..Default::default() };
    publish_with(c, header, events).await;
}

/// Publishes `events` under `header` on its worker's subject of prefix `t`, and flushes.
pub async fn publish_with(
    c: &async_nats::Client,
    header: kvindex_client::protocol::BatchHeader,
    events: Vec<kvindex_client::protocol::KvEvent>,
) {
    use kvindex_client::protocol::{encode_batch, EventBatch};
    let b = EventBatch { header, worker: None, events: events.into_iter().map(Ok).collect() };
    c.publish(format!("t.events.{}", header.worker_id), encode_batch(&b).into()).await.expect("published");
    c.flush().await.expect("flushed");
}

pub mod cluster;
pub mod engine;
pub mod process;
