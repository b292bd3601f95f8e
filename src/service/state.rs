//! What the service's tasks share, in parts a task can take alone: the configuration and the
//! subjects it names, the metrics and a rate-limited log, each worker's event sequence, the
//! stale workers, the replica's health, and its place in a durable stream.

use super::checkpoints::Replicas;
use super::cursors::{Cursors, Names};
use super::health::{Health, RebuildWait};
use super::stale::Stale;
use crate::config::{Config, Ingest};
use crate::metrics::Metrics;
use kvindex_core::hash::WorkerId;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Logs a warning at most once per interval per key, counting what it held back.
pub(super) struct RateLimitedLog {
    /// Per key: when it was last logged, and how many were held back since.
    last: Mutex<HashMap<&'static str, (Instant, u64)>>,
    /// At most one line per key this often.
    every: Duration,
}

impl RateLimitedLog {
    /// Logs `msg` under `key` unless a line of that key went out within the interval.
    pub(super) fn warn(&self, key: &'static str, msg: impl FnOnce() -> String) {
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

/// The subjects `cfg` names for this daemon.
pub(super) struct Subjects {
    /// `{prefix}.events.`, the part of an events subject before the worker id.
    pub(super) events_prefix: String,
    /// `.k` in shard `k` of a sharded deployment (the NATS mapping's suffix), else empty.
    pub(super) shard_suffix: String,
}

/// A durable replica's place in its JetStream stream and snapshots.
#[derive(Default)]
pub(super) struct Durable {
    /// The last stream message ingested (or the restored snapshot's), which the snapshot
    /// task reads to see how many came since its last snapshot.
    pub(super) stream_seq: AtomicU64,
    /// When the newest snapshot this replica wrote or loaded was written, in ns since the Unix
    /// epoch (0: none), for its age metric; wall-clock, since a loaded one may predate boot.
    pub(super) snapshot_written: AtomicU64,
}

/// Expired workers the inspect API remembers.
pub(super) const EXPIRED_KEPT: usize = 256;

/// State shared by the service's tasks and the apply threads.
pub(super) struct State {
    /// The configuration it runs with.
    pub(super) cfg: Config,
    /// The subjects it names.
    pub(super) subjects: Subjects,
    /// Every metric.
    pub(super) metrics: Arc<Metrics>,
    /// Warnings, at a bounded rate per reason.
    pub(super) log: RateLimitedLog,
    /// Each worker's event sequence.
    pub(super) cursors: Mutex<Cursors>,
    /// What the named workers say they are, read without the cursors' lock.
    pub(super) names: Arc<Names>,
    /// The stale workers.
    pub(super) stale: Stale,
    /// The workers dropped last for silence past `worker_ttl`, and when (the newest last, at
    /// most [`EXPIRED_KEPT`]): what the inspect API tells of a worker that is gone.
    pub(super) expired: Mutex<VecDeque<(WorkerId, Instant)>>,
    /// Whether this replica may answer.
    pub(super) health: Health,
    /// Its place in a durable stream.
    pub(super) durable: Durable,
    /// Its workers' checkpoints and its siblings', compared.
    pub(super) replicas: Replicas,
}

impl State {
    /// A fresh state for `cfg`; stale workers to ask at once go to `resync`.
    pub(super) fn new(cfg: Config, metrics: Arc<Metrics>, resync: mpsc::UnboundedSender<WorkerId>) -> State {
        let wait =
            RebuildWait { settle: Duration::from_millis(cfg.ready_settle_ms), timeout: Duration::from_secs(cfg.ready_timeout) };
        let names = Arc::new(Names::default());
        State {
            cursors: Mutex::new(Cursors::new(names.clone())),
            names,
            subjects: Subjects { events_prefix: format!("{}.events.", cfg.prefix), shard_suffix: cfg.shard_suffix() },
            log: RateLimitedLog { last: Mutex::new(HashMap::new()), every: Duration::from_secs(10) },
            stale: Stale::new(resync, metrics.clone()),
            expired: Mutex::new(VecDeque::new()),
            health: Health::new(cfg.ingest == Ingest::Jetstream, wait, metrics.clone()),
            durable: Durable::default(),
            replicas: Replicas::new(cfg.replica_check_interval),
            metrics,
            cfg,
        }
    }

    /// Counts a refused input under `reason` and logs it at a bounded rate.
    pub(super) fn fail(&self, reason: &'static str, detail: impl FnOnce() -> String) {
        self.metrics.ingest.decode_failures.with_label_values(&[reason]).inc();
        self.log.warn(reason, detail);
    }

    /// A digest of `worker` that differs from `source`'s (a publisher, a sibling replica):
    /// counted, logged under `key`, and the worker flagged stale (`drift`), so it resyncs.
    pub(super) fn drifted(&self, worker: WorkerId, source: &'static str, key: &'static str, detail: impl FnOnce() -> String) {
        self.metrics.ingest.digest_mismatches.with_label_values(&[source]).inc();
        self.log.warn(key, detail);
        self.stale.mark(worker, "drift");
    }
}

/// Nanoseconds since the Unix epoch, wall-clock (what publishers stamp batches with).
pub(super) use kvindex_client::protocol::now_ns;
