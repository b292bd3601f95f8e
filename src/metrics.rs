//! The daemon's Prometheus metrics (`service::http` serves them on `metrics_addr`), in groups
//! by what they watch: what arrives, what applying did, workers' health, lookups and
//! announcements, the index's size, durable mode, the NATS connection.

use kvindex_client::protocol::DecodeError;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Registers a counter.
fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

/// Registers a labelled counter.
fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

/// Registers an integer gauge.
fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

/// Registers a labelled integer gauge.
fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

/// Registers a float gauge.
fn gauge_f64(r: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

/// Registers a histogram with these buckets.
fn histogram(r: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets)).expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

/// Registers a labelled histogram with these buckets.
fn histogram_vec(r: &Registry, name: &str, help: &str, labels: &[&str], buckets: Vec<f64>) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels).expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

/// Buckets for one hop or stage: from 1 us (a decode, an apply) to 1 s (a stalled queue).
fn stage_buckets() -> Vec<f64> {
    vec![0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0]
}

/// Every metric the daemon exports; names follow Prometheus conventions.
pub struct Metrics {
    /// Where they are registered, for rendering.
    pub registry: Registry,
    /// What arrives: batches, decoding, each worker's sequence.
    pub ingest: IngestMetrics,
    /// What applying did to the index.
    pub apply: ApplyMetrics,
    /// Workers' health: stale, resynced, expired; the replica's readiness.
    pub workers: WorkerMetrics,
    /// Lookups, and routers' announcements.
    pub lookups: LookupMetrics,
    /// The index's size and the apply pool.
    pub index: IndexMetrics,
    /// Durable mode: the stream and the snapshots.
    pub durable: DurableMetrics,
    /// The NATS connection.
    pub nats: NatsMetrics,
    /// Replicas comparing their workers' digests.
    pub replicas: ReplicaMetrics,
    /// Children of the vectors above that the hot paths (ingest, apply, lookup) update,
    /// resolved once instead of by label on every event.
    pub hot: HotMetrics,
}

/// What arrives: batches, decoding, each worker's sequence.
pub struct IngestMetrics {
    /// `kvindex_batches_received_total`.
    pub batches_received: IntCounter,
    /// `kvindex_decode_failures_total{reason}`.
    pub decode_failures: IntCounterVec,
    /// `kvindex_duplicate_events_total`.
    pub duplicate_events: IntCounter,
    /// `kvindex_event_gaps_total`.
    pub event_gaps: IntCounter,
    /// `kvindex_refused_events_total{reason}`.
    pub refused_events: IntCounterVec,
    /// `kvindex_non_device_blocks_total{tier,kind}`.
    pub non_device_blocks: IntCounterVec,
    /// `kvindex_midstream_workers_total`.
    pub midstream_workers: IntCounter,
    /// `kvindex_epoch_changes_total`.
    pub epochs_changed: IntCounter,
    /// `kvindex_digest_checks_total`.
    pub digest_checks: IntCounter,
    /// `kvindex_digest_mismatch_total{source}`.
    pub digest_mismatches: IntCounterVec,
    /// `kvindex_snapshots_total{result}`: publishers' snapshots.
    pub snapshots: IntCounterVec,
    /// `kvindex_event_lag_seconds`.
    pub event_lag: Histogram,
    /// `kvindex_event_stage_seconds{stage}`: the lag's parts (their children are in `hot`).
    pub event_stages: HistogramVec,
}

impl IngestMetrics {
    fn new(r: &Registry) -> Self {
        let lag_buckets =
            vec![0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
        IngestMetrics {
            batches_received: counter(r, "kvindex_batches_received_total", "Event batches received (including heartbeats)."),
            decode_failures: counter_vec(
                r,
                "kvindex_decode_failures_total",
                "Messages or events that could not be decoded or were rejected, by reason.",
                &["reason"],
            ),
            duplicate_events: counter(r, "kvindex_duplicate_events_total", "Events ignored as repeats of an applied event id."),
            event_gaps: counter(r, "kvindex_event_gaps_total", "Jumps in a worker's event ids (events lost)."),
            refused_events: counter_vec(
                r,
                "kvindex_refused_events_total",
                "Events not applied, by reason (a limit reached: registry_full, max_workers, max_dp_ranks; name_conflict: a worker id another engine's name holds).",
                &["reason"],
            ),
            non_device_blocks: counter_vec(
                r,
                "kvindex_non_device_blocks_total",
                "Blocks of stored and removed events on host or disk tiers (counted, never matched as device blocks).",
                &["tier", "kind"],
            ),
            midstream_workers: counter(
                r,
                "kvindex_midstream_workers_total",
                "Workers first heard mid-sequence (daemon restart, TTL expiry, new epoch): stale until their snapshot.",
            ),
            digest_checks: counter(
                r,
                "kvindex_digest_checks_total",
                "Digests of a worker's device blocks compared with this index's, the worker in sequence and not stale.",
            ),
            digest_mismatches: counter_vec(
                r,
                "kvindex_digest_mismatch_total",
                "Digests that differed from this index's (source: publisher, or a sibling replica at the same event id): the worker is flagged stale (drift) and resynced.",
                &["source"],
            ),
            epochs_changed: counter(
                r,
                "kvindex_epoch_changes_total",
                "Publisher restarts seen (new epoch: the worker was cleared).",
            ),
            snapshots: counter_vec(
                r,
                "kvindex_snapshots_total",
                "Snapshot batches that began a snapshot, ended one complete (rebuilt), ended one complete that restated a worker held whole (applied as a difference: no answer changed), or ended one with a gap.",
                &["result"],
            ),
            event_lag: histogram(
                r,
                "kvindex_event_lag_seconds",
                "Time from a batch's publish timestamp (ts_ns) to its events being applied.",
                lag_buckets,
            ),
            event_stages: histogram_vec(
                r,
                "kvindex_event_stage_seconds",
                "Where a batch's lag goes: transit (publish timestamp to received here), decode (received to queued for its apply thread: decoding, sequencing), queued (waiting for its apply thread), apply (applying it: visible to lookups once done).",
                &["stage"],
                stage_buckets(),
            ),
        }
    }
}

/// What applying did to the index.
pub struct ApplyMetrics {
    /// `kvindex_events_applied_total{kind}`.
    pub events_applied: IntCounterVec,
    /// `kvindex_blocks_applied_total{kind}`.
    pub blocks_applied: IntCounterVec,
    /// `kvindex_unplaceable_blocks_total`.
    pub unplaceable_blocks: IntCounter,
    /// `kvindex_over_limit_blocks_total`.
    pub over_limit_blocks: IntCounter,
    /// `kvindex_restatements_given_up_total`.
    pub restatements_given_up: IntCounter,
    /// `kvindex_unknown_removes_total`.
    pub unknown_removes: IntCounter,
    /// `kvindex_too_deep_blocks_total`.
    pub too_deep_blocks: IntCounter,
    /// `kvindex_tier_unplaceable_blocks_total`.
    pub tier_unplaceable_blocks: IntCounter,
    /// `kvindex_group_missed_blocks_total`.
    pub group_missed_blocks: IntCounter,
}

impl ApplyMetrics {
    fn new(r: &Registry) -> Self {
        ApplyMetrics {
            events_applied: counter_vec(r, "kvindex_events_applied_total", "KV events applied, by kind.", &["kind"]),
            blocks_applied: counter_vec(r, "kvindex_blocks_applied_total", "Blocks stored or removed in the index, by kind.", &["kind"]),
            unplaceable_blocks: counter(r, "kvindex_unplaceable_blocks_total", "Stored blocks whose parent the worker does not hold."),
            over_limit_blocks: counter(
                r,
                "kvindex_over_limit_blocks_total",
                "Stored blocks refused because their worker holds max_blocks_per_worker blocks: the worker is flagged stale.",
            ),
            restatements_given_up: counter(
                r,
                "kvindex_restatements_given_up_total",
                "Snapshots of workers held whole that named more blocks than a restatement may: the worker is flagged stale until a snapshot rebuilds it.",
            ),
            unknown_removes: counter(r, "kvindex_unknown_removes_total", "Removed block hashes the worker did not hold."),
            too_deep_blocks: counter(
                r,
                "kvindex_too_deep_blocks_total",
                "Stored blocks past max_depth, or under such a block: ignored, the worker stays whole.",
            ),
            tier_unplaceable_blocks: counter(
                r,
                "kvindex_tier_unplaceable_blocks_total",
                "Host or disk blocks whose parent the worker does not hold in that tier (not placed there; the worker stays whole).",
            ),
            group_missed_blocks: counter(
                r,
                "kvindex_group_missed_blocks_total",
                "Blocks of a hybrid model's other groups not placed (their hash not held in the worker's primary group) or removed unheld: such a worker's depth comes out shallower, never deeper.",
            ),
        }
    }
}

/// Workers' health, and the replica's readiness.
pub struct WorkerMetrics {
    /// `kvindex_resync_requests_total{scope}`.
    pub resync_requests: IntCounterVec,
    /// `kvindex_resync_unanswered_total`.
    pub resync_unanswered: IntCounter,
    /// `kvindex_stale_workers`.
    pub stale_workers: IntGauge,
    /// `kvindex_workers_expired_total`.
    pub workers_expired: IntCounter,
    /// `kvindex_ready`.
    pub ready: IntGauge,
    /// `kvindex_rebuild_seconds`.
    pub rebuild_seconds: Gauge,
    /// `kvindex_shard_superseded`.
    pub superseded: IntGauge,
}

impl WorkerMetrics {
    fn new(r: &Registry) -> Self {
        WorkerMetrics {
            resync_requests: counter_vec(r, "kvindex_resync_requests_total", "Resync requests sent, by scope.", &["scope"]),
            resync_unanswered: counter(
                r,
                "kvindex_resync_unanswered_total",
                "Per-worker resync requests that got no answer in time (no publisher, or it is busy).",
            ),
            stale_workers: gauge(r, "kvindex_stale_workers", "Workers whose state is being resynchronised."),
            workers_expired: counter(r, "kvindex_workers_expired_total", "Workers dropped after being silent past the TTL."),
            ready: gauge(r, "kvindex_ready", "1 when connected and rebuilt after the last broadcast resync (/readyz)."),
            rebuild_seconds: gauge_f64(
                r,
                "kvindex_rebuild_seconds",
                "Time from the last broadcast resync to ready: how long the last rebuild took.",
            ),
            superseded: gauge(
                r,
                "kvindex_shard_superseded",
                "1 once the NATS mapping brought this shard another shard's worker (the shard count changed): out of lookups until restarted.",
            ),
        }
    }
}

/// Lookups, and routers' announcements.
pub struct LookupMetrics {
    /// `kvindex_lookups_total{result}`.
    pub lookups: IntCounterVec,
    /// `kvindex_lookup_duration_seconds{result}`.
    pub lookup_duration: HistogramVec,
    /// `kvindex_lookup_reply_failures_total`.
    pub lookup_reply_failures: IntCounter,
    /// `kvindex_lookup_transit_seconds`: from a router's `sent_ns` to the request received.
    pub lookup_transit: Histogram,
    /// `kvindex_lookup_member`.
    pub lookup_member: IntGauge,
    /// `kvindex_announcements_total{result}`.
    pub announcements: IntCounterVec,
    /// `kvindex_announced_blocks_total{mode,change}`.
    pub announced_blocks: IntCounterVec,
    /// `kvindex_predicted_blocks`.
    pub predicted_blocks: IntGauge,
}

impl LookupMetrics {
    fn new(r: &Registry) -> Self {
        let buckets = vec![
            0.000002, 0.000003, 0.000005, 0.0000075, 0.00001, 0.000015, 0.00002, 0.00003, 0.00005, 0.000075, 0.0001, 0.00015,
            0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0, 5.0,
        ];
        let opts =
            HistogramOpts::new("kvindex_lookup_duration_seconds", "Time to answer a lookup, decode to reply.").buckets(buckets);
        let lookup_duration = HistogramVec::new(opts, &["result"]).expect("valid metric");
        r.register(Box::new(lookup_duration.clone())).expect("unique metric");
        LookupMetrics {
            lookups: counter_vec(r, "kvindex_lookups_total", "Lookups answered, by result.", &["result"]),
            lookup_duration,
            lookup_transit: histogram(
                r,
                "kvindex_lookup_transit_seconds",
                "Time from a lookup request's sent_ns (the router's clock) to its receipt here; the answer's own time is kvindex_lookup_duration_seconds.",
                stage_buckets(),
            ),
            lookup_reply_failures: counter(
                r,
                "kvindex_lookup_reply_failures_total",
                "Lookup answers that could not be sent (NATS refused or lost the reply).",
            ),
            lookup_member: gauge(
                r,
                "kvindex_lookup_member",
                "1 while this replica is in the lookup queue group (ready: connected and rebuilt).",
            ),
            announcements: counter_vec(
                r,
                "kvindex_announcements_total",
                "Placements routers announced on {prefix}.routed, by result (applied; bad: undecodable or out of bounds, counted with its reason under decode failures; ignored: predictions are off).",
                &["result"],
            ),
            announced_blocks: counter_vec(
                r,
                "kvindex_announced_blocks_total",
                "Announced blocks by mode (predicted, routed_only) and change (added; evicted: past the worker's capacity; expired: past the TTL or the worker gone; refused: past a bound or no worker slot).",
                &["mode", "change"],
            ),
            predicted_blocks: gauge(r, "kvindex_predicted_blocks", "Predicted blocks held for all workers (announced, within predicted_ttl)."),
        }
    }
}

/// The index's size and the apply pool.
pub struct IndexMetrics {
    /// `kvindex_index_blocks`.
    pub placements: IntGauge,
    /// `kvindex_index_entries`.
    pub entries: IntGauge,
    /// `kvindex_index_hidden_blocks`.
    pub hidden: IntGauge,
    /// `kvindex_index_workers`.
    pub workers: IntGauge,
    /// `kvindex_tier_blocks{tier}`.
    pub tier_blocks: IntGaugeVec,
    /// `kvindex_apply_queue_depth{thread}`.
    pub apply_queue_depth: IntGaugeVec,
    /// `kvindex_apply_queue_capacity`.
    pub apply_queue_capacity: IntGauge,
    /// `kvindex_dead_apply_threads`.
    pub dead_apply_threads: IntGauge,
}

impl IndexMetrics {
    fn new(r: &Registry) -> Self {
        IndexMetrics {
            placements: gauge(r, "kvindex_index_blocks", "(worker, block) placements in the index."),
            entries: gauge(r, "kvindex_index_entries", "Distinct (position, prefix) entries in the index."),
            hidden: gauge(
                r,
                "kvindex_index_hidden_blocks",
                "Placements hidden from lookups under an evicted ancestor (holes); they return when it is stored again.",
            ),
            workers: gauge(r, "kvindex_index_workers", "Workers (worker id, dp rank) in the index."),
            tier_blocks: gauge_vec(
                r,
                "kvindex_tier_blocks",
                "(worker, block) placements in the host and disk tiers' indexes.",
                &["tier"],
            ),
            apply_queue_depth: gauge_vec(r, "kvindex_apply_queue_depth", "Batches waiting per apply thread.", &["thread"]),
            apply_queue_capacity: gauge(
                r,
                "kvindex_apply_queue_capacity",
                "Batches each apply thread's queue holds before ingest waits (queue_capacity).",
            ),
            dead_apply_threads: gauge(
                r,
                "kvindex_dead_apply_threads",
                "Apply threads that have exited: /healthz fails and the daemon exits non-zero.",
            ),
        }
    }
}

/// Durable mode: the stream and the snapshots.
pub struct DurableMetrics {
    /// `kvindex_stream_pending`.
    pub stream_pending: IntGauge,
    /// `kvindex_stream_sequence`.
    pub stream_sequence: IntGauge,
    /// `kvindex_stream_consumer_restarts_total`.
    pub stream_consumer_restarts: IntCounter,
    /// `kvindex_snapshot_writes_total{result}`.
    pub snapshot_writes: IntCounterVec,
    /// `kvindex_snapshot_lease`.
    pub snapshot_lease: IntGauge,
    /// `kvindex_snapshot_age_seconds`.
    pub snapshot_age: Gauge,
    /// `kvindex_snapshot_bytes`.
    pub snapshot_bytes: IntGauge,
    /// `kvindex_snapshot_write_seconds`.
    pub snapshot_write_seconds: Gauge,
    /// `kvindex_snapshot_restore_seconds`.
    pub snapshot_restore_seconds: Gauge,
}

impl DurableMetrics {
    fn new(r: &Registry) -> Self {
        DurableMetrics {
            stream_pending: gauge(
                r,
                "kvindex_stream_pending",
                "JetStream ingest: messages of the stream not yet delivered to this replica (0 in core mode).",
            ),
            stream_sequence: gauge(
                r,
                "kvindex_stream_sequence",
                "JetStream ingest: the stream sequence of the last message ingested (compare replicas, or with the stream's last).",
            ),
            stream_consumer_restarts: counter(
                r,
                "kvindex_stream_consumer_restarts_total",
                "JetStream mode: stream consumers replaced after stalling behind the stream (their server died).",
            ),
            snapshot_writes: counter_vec(
                r,
                "kvindex_snapshot_writes_total",
                "JetStream mode: index snapshots this replica wrote to the object store, by result (ok, error).",
                &["result"],
            ),
            snapshot_lease: gauge(r, "kvindex_snapshot_lease", "1 while this replica holds the snapshot lease (it writes the snapshots)."),
            snapshot_age: gauge_f64(
                r,
                "kvindex_snapshot_age_seconds",
                "Age of the newest snapshot this replica wrote or loaded (-1: none yet); a restart replays the stream after it.",
            ),
            snapshot_bytes: gauge(r, "kvindex_snapshot_bytes", "Size of the last snapshot this replica wrote or loaded."),
            snapshot_write_seconds: gauge_f64(
                r,
                "kvindex_snapshot_write_seconds",
                "Time the last snapshot took: saving the index, encoding it and writing it to the object store.",
            ),
            snapshot_restore_seconds: gauge_f64(
                r,
                "kvindex_snapshot_restore_seconds",
                "Time this replica took at start to load the newest snapshot and apply it (before the stream after it).",
            ),
        }
    }
}

/// Replicas comparing their workers' digests (`service::replicas`).
pub struct ReplicaMetrics {
    /// `kvindex_replica_checkpoints_sent_total`.
    pub sent: IntCounter,
    /// `kvindex_replica_checkpoints_compared_total`.
    pub compared: IntCounter,
    /// `kvindex_replica_siblings`.
    pub siblings: IntGauge,
}

impl ReplicaMetrics {
    fn new(r: &Registry) -> Self {
        ReplicaMetrics {
            sent: counter(
                r,
                "kvindex_replica_checkpoints_sent_total",
                "Checkpoints (a worker's digest at an event id) this replica sent its siblings on {prefix}.replicas.",
            ),
            compared: counter(
                r,
                "kvindex_replica_checkpoints_compared_total",
                "Checkpoints of a sibling compared with this replica's at the same event id (differences: kvindex_digest_mismatch_total{source=\"replica\"}).",
            ),
            siblings: gauge(r, "kvindex_replica_siblings", "Sibling replicas of this prefix and shard heard comparing checkpoints lately."),
        }
    }
}

/// The NATS connection.
pub struct NatsMetrics {
    /// `kvindex_nats_connected`.
    pub connected: IntGauge,
    /// `kvindex_nats_events_total{event}`.
    pub events: IntCounterVec,
}

impl NatsMetrics {
    fn new(r: &Registry) -> Self {
        NatsMetrics {
            connected: gauge(r, "kvindex_nats_connected", "1 while connected to NATS."),
            events: counter_vec(r, "kvindex_nats_events_total", "NATS connection events, by kind.", &["event"]),
        }
    }
}

/// Pre-resolved label children of the per-event and per-lookup metrics.
pub struct HotMetrics {
    /// `kvindex_events_applied_total{kind="stored"}`.
    pub events_stored: IntCounter,
    /// `kvindex_events_applied_total{kind="removed"}`.
    pub events_removed: IntCounter,
    /// `kvindex_events_applied_total{kind="cleared"}`.
    pub events_cleared: IntCounter,
    /// `kvindex_blocks_applied_total{kind="stored"}`.
    pub blocks_stored: IntCounter,
    /// `kvindex_blocks_applied_total{kind="removed"}`.
    pub blocks_removed: IntCounter,
    /// `kvindex_lookups_total{result="ok"}`.
    pub lookups_ok: IntCounter,
    /// `kvindex_lookups_total{result="error"}`.
    pub lookups_error: IntCounter,
    /// `kvindex_lookup_duration_seconds{result="ok"}`.
    pub lookup_duration_ok: Histogram,
    /// `kvindex_lookup_duration_seconds{result="error"}`.
    pub lookup_duration_error: Histogram,
    /// `kvindex_event_stage_seconds{stage="transit"}`.
    pub stage_transit: Histogram,
    /// `kvindex_event_stage_seconds{stage="decode"}`.
    pub stage_decode: Histogram,
    /// `kvindex_event_stage_seconds{stage="queued"}`.
    pub stage_queued: Histogram,
    /// `kvindex_event_stage_seconds{stage="apply"}`.
    pub stage_apply: Histogram,
}

impl HotMetrics {
    fn of(ingest: &IngestMetrics, apply: &ApplyMetrics, lookups: &LookupMetrics) -> Self {
        let (events, blocks, stage) = (&apply.events_applied, &apply.blocks_applied, &ingest.event_stages);
        HotMetrics {
            events_stored: events.with_label_values(&["stored"]),
            events_removed: events.with_label_values(&["removed"]),
            events_cleared: events.with_label_values(&["cleared"]),
            blocks_stored: blocks.with_label_values(&["stored"]),
            blocks_removed: blocks.with_label_values(&["removed"]),
            lookups_ok: lookups.lookups.with_label_values(&["ok"]),
            lookups_error: lookups.lookups.with_label_values(&["error"]),
            lookup_duration_ok: lookups.lookup_duration.with_label_values(&["ok"]),
            lookup_duration_error: lookups.lookup_duration.with_label_values(&["error"]),
            stage_transit: stage.with_label_values(&["transit"]),
            stage_decode: stage.with_label_values(&["decode"]),
            stage_queued: stage.with_label_values(&["queued"]),
            stage_apply: stage.with_label_values(&["apply"]),
        }
    }
}

impl Metrics {
    /// Every metric, registered in a registry of its own.
    pub fn new() -> Self {
        Self::in_registry(Registry::new())
    }

    /// Every metric of one of several models a daemon serves: each carries `model="<name>"`.
    pub fn for_model(name: &str) -> Self {
        let labels = std::collections::HashMap::from([("model".to_string(), name.to_string())]);
        Self::in_registry(Registry::new_custom(None, Some(labels)).expect("a valid label"))
    }

    fn in_registry(r: Registry) -> Self {
        let (ingest, apply, lookups) = (IngestMetrics::new(&r), ApplyMetrics::new(&r), LookupMetrics::new(&r));
        Metrics {
            hot: HotMetrics::of(&ingest, &apply, &lookups),
            ingest,
            apply,
            workers: WorkerMetrics::new(&r),
            lookups,
            index: IndexMetrics::new(&r),
            durable: DurableMetrics::new(&r),
            nats: NatsMetrics::new(&r),
            replicas: ReplicaMetrics::new(&r),
            registry: r,
        }
        .with_known_series()
    }

    /// Creates every labelled series a dashboard or alert reads, at zero, so that `rate()` and
    /// panels see them before the first occurrence (a series born at 1 hides its first event).
    fn with_known_series(self) -> Self {
        let reasons = DecodeError::ALL.iter().map(|e| e.reason()).chain([
            "bad_subject",
            "worker_mismatch",
            "old_epoch",
            "other_shard",
            "bad_worker_info",
            "bad_replica_digests",
        ]);
        for reason in reasons {
            self.ingest.decode_failures.with_label_values(&[reason]);
        }
        for reason in ["registry_full", "max_workers", "max_dp_ranks", "name_conflict"] {
            self.ingest.refused_events.with_label_values(&[reason]);
        }
        for scope in ["worker", "all"] {
            self.workers.resync_requests.with_label_values(&[scope]);
        }
        for source in ["publisher", "replica"] {
            self.ingest.digest_mismatches.with_label_values(&[source]);
        }
        for result in ["begun", "complete", "restated", "gap"] {
            self.ingest.snapshots.with_label_values(&[result]);
        }
        for result in ["ok", "error"] {
            self.durable.snapshot_writes.with_label_values(&[result]);
        }
        self.durable.snapshot_age.set(-1.0);
        for event in ["connected", "disconnected", "slow_consumer"] {
            self.nats.events.with_label_values(&[event]);
        }
        for tier in ["host", "disk"] {
            for kind in ["stored", "removed"] {
                self.ingest.non_device_blocks.with_label_values(&[tier, kind]);
            }
            self.index.tier_blocks.with_label_values(&[tier]);
        }
        self
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        render(&[&self.registry])
    }
}

/// The Prometheus text exposition of every metric of `registries` (one per model, and the
/// daemon's own), the series of one name under one family as the format requires.
pub fn render(registries: &[&Registry]) -> String {
    let mut families: Vec<prometheus::proto::MetricFamily> = Vec::new();
    for r in registries {
        for mut f in r.gather() {
            match families.iter_mut().find(|g| g.name() == f.name()) {
                Some(g) => g.mut_metric().extend(f.take_metric()),
                None => families.push(f),
            }
        }
    }
    families.sort_by(|a, b| a.name().cmp(b.name()));
    let mut buf = Vec::new();
    // Encoding gathered families into a Vec cannot fail.
    let _ = TextEncoder::new().encode(&families, &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
