//! The daemon's Prometheus metrics (`service::http` serves them on `metrics_addr`).

use kvindex_client::protocol::DecodeError;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Every metric the daemon exports; names follow Prometheus conventions.
pub struct Metrics {
    pub registry: Registry,
    pub event_lag: Histogram,
    pub events_applied: IntCounterVec,
    pub blocks_applied: IntCounterVec,
    pub batches_received: IntCounter,
    pub decode_failures: IntCounterVec,
    pub duplicate_events: IntCounter,
    pub event_gaps: IntCounter,
    pub unplaceable_blocks: IntCounter,
    pub over_limit_blocks: IntCounter,
    pub unknown_removes: IntCounter,
    pub refused_events: IntCounterVec,
    pub too_deep_blocks: IntCounter,
    pub lookup_reply_failures: IntCounter,
    pub lookup_member: IntGauge,
    pub dead_apply_threads: IntGauge,
    pub non_device_blocks: IntCounterVec,
    pub resync_requests: IntCounterVec,
    pub resync_unanswered: IntCounter,
    pub snapshots: IntCounterVec,
    pub midstream_workers: IntCounter,
    pub ready: IntGauge,
    pub rebuild_seconds: Gauge,
    pub stale_workers: IntGauge,
    pub epochs_changed: IntCounter,
    pub workers_expired: IntCounter,
    pub apply_queue_depth: IntGaugeVec,
    pub apply_queue_capacity: IntGauge,
    pub tier_blocks: IntGaugeVec,
    pub tier_unplaceable_blocks: IntCounter,
    pub group_missed_blocks: IntCounter,
    pub lookups: IntCounterVec,
    pub lookup_duration: HistogramVec,
    pub index_placements: IntGauge,
    pub index_entries: IntGauge,
    pub index_hidden: IntGauge,
    pub stream_pending: IntGauge,
    pub stream_sequence: IntGauge,
    pub stream_consumer_restarts: IntCounter,
    pub snapshot_writes: IntCounterVec,
    pub snapshot_lease: IntGauge,
    pub snapshot_age: Gauge,
    pub snapshot_bytes: IntGauge,
    pub snapshot_write_seconds: Gauge,
    pub snapshot_restore_seconds: Gauge,
    pub index_workers: IntGauge,
    pub nats_connected: IntGauge,
    pub nats_events: IntCounterVec,
    pub announcements: IntCounterVec,
    pub announced_blocks: IntCounterVec,
    pub predicted_blocks: IntGauge,
    /// Children of the vectors above that the hot paths (ingest, apply, lookup) update,
    /// resolved once instead of by label on every event.
    pub hot: HotMetrics,
}

/// Pre-resolved label children of the per-event and per-lookup metrics.
pub struct HotMetrics {
    pub events_stored: IntCounter,
    pub events_removed: IntCounter,
    pub events_cleared: IntCounter,
    pub blocks_stored: IntCounter,
    pub blocks_removed: IntCounter,
    pub lookups_ok: IntCounter,
    pub lookups_error: IntCounter,
    pub lookup_duration_ok: Histogram,
    pub lookup_duration_error: Histogram,
}

/// Registers a counter (here and in the bridge's registry).
pub(crate) fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

/// Registers a labelled counter.
pub(crate) fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

/// Registers a gauge.
pub(crate) fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn gauge_f64(r: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let lag_buckets =
            vec![0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
        let event_lag = Histogram::with_opts(
            HistogramOpts::new(
                "kvindex_event_lag_seconds",
                "Time from a batch's publish timestamp (ts_ns) to its events being applied.",
            )
            .buckets(lag_buckets),
        )
        .expect("valid metric");
        r.register(Box::new(event_lag.clone())).expect("unique metric");
        let lookup_duration = HistogramVec::new(
            HistogramOpts::new("kvindex_lookup_duration_seconds", "Time to answer a lookup, decode to reply.").buckets(vec![
                0.000002, 0.000003, 0.000005, 0.0000075, 0.00001, 0.000015, 0.00002, 0.00003, 0.00005, 0.000075, 0.0001, 0.00015,
                0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0,
            ]),
            &["result"],
        )
        .expect("valid metric");
        r.register(Box::new(lookup_duration.clone())).expect("unique metric");
        let apply_queue_depth =
            IntGaugeVec::new(Opts::new("kvindex_apply_queue_depth", "Batches waiting per apply thread."), &["thread"])
                .expect("valid metric");
        r.register(Box::new(apply_queue_depth.clone())).expect("unique metric");
        let tier_blocks = IntGaugeVec::new(
            Opts::new("kvindex_tier_blocks", "(worker, block) placements in the host and disk tiers' indexes."),
            &["tier"],
        )
        .expect("valid metric");
        r.register(Box::new(tier_blocks.clone())).expect("unique metric");
        let events_applied = counter_vec(&r, "kvindex_events_applied_total", "KV events applied, by kind.", &["kind"]);
        let blocks_applied =
            counter_vec(&r, "kvindex_blocks_applied_total", "Blocks stored or removed in the index, by kind.", &["kind"]);
        let lookups = counter_vec(&r, "kvindex_lookups_total", "Lookups answered, by result.", &["result"]);
        let hot = HotMetrics {
            events_stored: events_applied.with_label_values(&["stored"]),
            events_removed: events_applied.with_label_values(&["removed"]),
            events_cleared: events_applied.with_label_values(&["cleared"]),
            blocks_stored: blocks_applied.with_label_values(&["stored"]),
            blocks_removed: blocks_applied.with_label_values(&["removed"]),
            lookups_ok: lookups.with_label_values(&["ok"]),
            lookups_error: lookups.with_label_values(&["error"]),
            lookup_duration_ok: lookup_duration.with_label_values(&["ok"]),
            lookup_duration_error: lookup_duration.with_label_values(&["error"]),
        };
        Metrics {
            hot,
            events_applied,
            blocks_applied,
            lookups,
            event_lag,
            batches_received: counter(&r, "kvindex_batches_received_total", "Event batches received (including heartbeats)."),
            decode_failures: counter_vec(
                &r,
                "kvindex_decode_failures_total",
                "Messages or events that could not be decoded or were rejected, by reason.",
                &["reason"],
            ),
            duplicate_events: counter(&r, "kvindex_duplicate_events_total", "Events ignored as repeats of an applied event id."),
            event_gaps: counter(&r, "kvindex_event_gaps_total", "Jumps in a worker's event ids (events lost)."),
            unplaceable_blocks: counter(
                &r,
                "kvindex_unplaceable_blocks_total",
                "Stored blocks whose parent the worker does not hold.",
            ),
            unknown_removes: counter(&r, "kvindex_unknown_removes_total", "Removed block hashes the worker did not hold."),
            over_limit_blocks: counter(
                &r,
                "kvindex_over_limit_blocks_total",
                "Stored blocks refused because their worker holds max_blocks_per_worker blocks: the worker is flagged stale.",
            ),
            lookup_member: gauge(
                &r,
                "kvindex_lookup_member",
                "1 while this replica is in the lookup queue group (ready: connected and rebuilt).",
            ),
            lookup_reply_failures: counter(
                &r,
                "kvindex_lookup_reply_failures_total",
                "Lookup answers that could not be sent (NATS refused or lost the reply).",
            ),
            too_deep_blocks: counter(
                &r,
                "kvindex_too_deep_blocks_total",
                "Stored blocks past max_depth, or under such a block: ignored, the worker stays whole.",
            ),
            refused_events: counter_vec(
                &r,
                "kvindex_refused_events_total",
                "Events not applied because a limit was reached, by reason (registry_full: no free worker slot).",
                &["reason"],
            ),
            dead_apply_threads: gauge(
                &r,
                "kvindex_dead_apply_threads",
                "Apply threads that have exited: /healthz fails and the daemon exits non-zero.",
            ),
            non_device_blocks: counter_vec(
                &r,
                "kvindex_non_device_blocks_total",
                "Blocks of stored and removed events on host or disk tiers (counted, never matched as device blocks).",
                &["tier", "kind"],
            ),
            resync_requests: counter_vec(&r, "kvindex_resync_requests_total", "Resync requests sent, by scope.", &["scope"]),
            resync_unanswered: counter(
                &r,
                "kvindex_resync_unanswered_total",
                "Per-worker resync requests that got no answer in time (no publisher, or it is busy).",
            ),
            snapshots: counter_vec(
                &r,
                "kvindex_snapshots_total",
                "Snapshot batches that began a snapshot, ended one complete, or ended one with a gap.",
                &["result"],
            ),
            midstream_workers: counter(
                &r,
                "kvindex_midstream_workers_total",
                "Workers first heard mid-sequence (daemon restart, TTL expiry, new epoch): stale until their snapshot.",
            ),
            ready: gauge(&r, "kvindex_ready", "1 when connected and rebuilt after the last broadcast resync (/readyz)."),
            rebuild_seconds: gauge_f64(
                &r,
                "kvindex_rebuild_seconds",
                "Time from the last broadcast resync to ready: how long the last rebuild took.",
            ),
            stale_workers: gauge(&r, "kvindex_stale_workers", "Workers whose state is being resynchronised."),
            epochs_changed: counter(
                &r,
                "kvindex_epoch_changes_total",
                "Publisher restarts seen (new epoch: the worker was cleared).",
            ),
            workers_expired: counter(&r, "kvindex_workers_expired_total", "Workers dropped after being silent past the TTL."),
            announcements: counter_vec(
                &r,
                "kvindex_announcements_total",
                "Placements routers announced on {prefix}.routed, by result (applied; bad: undecodable or out of bounds, counted with its reason under decode failures; ignored: predictions are off).",
                &["result"],
            ),
            announced_blocks: counter_vec(
                &r,
                "kvindex_announced_blocks_total",
                "Announced blocks by mode (predicted, routed_only) and change (added; evicted: past the worker's capacity; expired: past the TTL or the worker gone; refused: past a bound or no worker slot).",
                &["mode", "change"],
            ),
            predicted_blocks: gauge(&r, "kvindex_predicted_blocks", "Predicted blocks held for all workers (announced, within predicted_ttl)."),
            apply_queue_depth,
            tier_blocks,
            tier_unplaceable_blocks: counter(
                &r,
                "kvindex_tier_unplaceable_blocks_total",
                "Host or disk blocks whose parent the worker does not hold in that tier (not placed there; the worker stays whole).",
            ),
            group_missed_blocks: counter(
                &r,
                "kvindex_group_missed_blocks_total",
                "Blocks of a hybrid model's other groups not placed (their hash not held in the worker's primary group) or removed unheld: such a worker's depth comes out shallower, never deeper.",
            ),
            apply_queue_capacity: gauge(
                &r,
                "kvindex_apply_queue_capacity",
                "Batches each apply thread's queue holds before ingest waits (queue_capacity).",
            ),
            lookup_duration,
            index_placements: gauge(&r, "kvindex_index_blocks", "(worker, block) placements in the index."),
            index_entries: gauge(&r, "kvindex_index_entries", "Distinct (position, prefix) entries in the index."),
            index_hidden: gauge(
                &r,
                "kvindex_index_hidden_blocks",
                "Placements hidden from lookups under an evicted ancestor (holes); they return when it is stored again.",
            ),
            index_workers: gauge(&r, "kvindex_index_workers", "Workers (worker id, dp rank) in the index."),
            stream_pending: gauge(
                &r,
                "kvindex_stream_pending",
                "JetStream ingest: messages of the stream not yet delivered to this replica (0 in core mode).",
            ),
            stream_sequence: gauge(
                &r,
                "kvindex_stream_sequence",
                "JetStream ingest: the stream sequence of the last message ingested (compare replicas, or with the stream's last).",
            ),
            stream_consumer_restarts: counter(
                &r,
                "kvindex_stream_consumer_restarts_total",
                "JetStream mode: stream consumers replaced after stalling behind the stream (their server died).",
            ),
            snapshot_writes: counter_vec(
                &r,
                "kvindex_snapshot_writes_total",
                "JetStream mode: index snapshots this replica wrote to the object store, by result (ok, error).",
                &["result"],
            ),
            snapshot_lease: gauge(&r, "kvindex_snapshot_lease", "1 while this replica holds the snapshot lease (it writes the snapshots)."),
            snapshot_age: gauge_f64(
                &r,
                "kvindex_snapshot_age_seconds",
                "Age of the newest snapshot this replica wrote or loaded (-1: none yet); a restart replays the stream after it.",
            ),
            snapshot_bytes: gauge(&r, "kvindex_snapshot_bytes", "Size of the last snapshot this replica wrote or loaded."),
            snapshot_write_seconds: gauge_f64(
                &r,
                "kvindex_snapshot_write_seconds",
                "Time the last snapshot took: saving the index, encoding it and writing it to the object store.",
            ),
            snapshot_restore_seconds: gauge_f64(
                &r,
                "kvindex_snapshot_restore_seconds",
                "Time this replica took at start to load the newest snapshot and apply it (before the stream after it).",
            ),
            nats_connected: gauge(&r, "kvindex_nats_connected", "1 while connected to NATS."),
            nats_events: counter_vec(&r, "kvindex_nats_events_total", "NATS connection events, by kind.", &["event"]),
            registry: r,
        }
        .with_known_series()
    }

    /// Creates every labelled series a dashboard or alert reads, at zero, so that `rate()` and
    /// panels see them before the first occurrence (a series born at 1 hides its first event).
    fn with_known_series(self) -> Self {
        let reasons =
            DecodeError::ALL.iter().map(|e| e.reason()).chain(["bad_subject", "worker_mismatch", "old_epoch", "other_shard"]);
        for reason in reasons {
            self.decode_failures.with_label_values(&[reason]);
        }
        for reason in ["registry_full", "max_workers", "max_dp_ranks"] {
            self.refused_events.with_label_values(&[reason]);
        }
        for scope in ["worker", "all"] {
            self.resync_requests.with_label_values(&[scope]);
        }
        for result in ["begun", "complete", "gap"] {
            self.snapshots.with_label_values(&[result]);
        }
        for result in ["ok", "error"] {
            self.snapshot_writes.with_label_values(&[result]);
        }
        self.snapshot_age.set(-1.0);
        for event in ["connected", "disconnected", "slow_consumer"] {
            self.nats_events.with_label_values(&[event]);
        }
        for tier in ["host", "disk"] {
            for kind in ["stored", "removed"] {
                self.non_device_blocks.with_label_values(&[tier, kind]);
            }
            self.tier_blocks.with_label_values(&[tier]);
        }
        self
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding our own registry into a Vec cannot fail.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
