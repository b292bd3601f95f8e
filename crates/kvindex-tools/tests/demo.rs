//! `kvindex demo` in short: the closed loop of router, mock engines and kvindex against a real
//! nats-server, on the shipped trace. KV-aware routing must beat round-robin and random on
//! prefix-cache hits, and come as close to the oracle (which reads the caches) as exact
//! answers allow; approximate mode (announcements alone) must beat round-robin, and bursts
//! sharing a new prefix must hit more with predicted placements than without.

use kvindex_tools as tools;

use tools::demo::{run, DemoConfig, Live};
use tools::fleet::Policy;
use tools::trace::read_trace_file;

/// The shipped trace's first 2,000 requests.
fn trace() -> Vec<tools::trace::TraceRequest> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/traces/conversation_trace.jsonl");
    let mut trace = read_trace_file(path.as_ref()).expect("shipped trace");
    trace.truncate(2000);
    trace
}

/// The demo on its own NATS and kvindex (`shards` of them), 16 workers a fleet.
fn config(shards: u32, burst: bool) -> DemoConfig {
    DemoConfig {
        nats_url: None,
        kvindex_metrics: None,
        prefix: "demo".into(),
        workers: 16,
        capacity: 16384,
        factor: 16,
        // Fast, yet each lookup follows the previous request's events by a few milliseconds.
        speed: 300.0,
        load_weight: 1.0,
        seed: 42,
        repeat: false,
        live: Live::Off,
        burst,
        shards,
        python: None,
    }
}

/// The Python that `scripts/python-client` set up with the client installed.
fn python() -> std::path::PathBuf {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/python-client");
    let out = std::process::Command::new(script).output().expect("scripts/python-client runs");
    assert!(out.status.success(), "the Python client's environment: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("a path").trim().into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_beats_blind_routing_on_the_shipped_trace() {
    let (trace, mut cfg) = (trace(), config(1, true));
    cfg.python = Some(python());
    let report = run(&trace, &cfg, std::future::pending()).await.expect("the demo runs");
    let rate = |p: Policy| report.fleets.iter().find(|f| f.policy == p).expect("every policy reports").hit_rate;
    let (kv, oracle, rr, random) = (rate(Policy::KvAware), rate(Policy::Oracle), rate(Policy::RoundRobin), rate(Policy::Random));
    println!("hit rates: kv-aware {kv:.3}, oracle {oracle:.3}, round-robin {rr:.3}, random {random:.3}");
    assert_eq!(report.requests, 2000);
    assert_eq!(report.lookups, 2000, "every request was routed with kvindex's answer ({} failed)", report.lookup_errors);
    assert_eq!(report.partial_answers, 0);
    assert!(kv > rr * 2.0 && kv > random * 2.0, "kv-aware {kv} does not beat round-robin {rr} and random {random}");
    // Exact answers route as well as reading the caches, but for the events still in flight.
    assert!(kv >= oracle * 0.9, "kv-aware {kv} falls short of the oracle {oracle}");
    // A router asking the HTTP query API, as one written against Dynamo's would, does as well.
    let http = rate(Policy::KvAwareHttp);
    println!("kv-aware over HTTP {http:.3}");
    assert_eq!(report.query_api_errors, 0, "every HTTP query answered");
    assert!(http >= oracle * 0.9, "kv-aware over HTTP {http} falls short of the oracle {oracle}");
    // A router whose lookups go through the Python client does as well.
    let python = rate(Policy::KvAwarePython);
    println!("kv-aware through the Python client {python:.3}");
    assert_eq!(report.python_errors, 0, "every Python lookup answered");
    assert!(python >= oracle * 0.9, "kv-aware through the Python client {python} falls short of the oracle {oracle}");
    let total: f64 = report.fleets[0].requests_per_worker_mean * cfg.workers as f64;
    assert_eq!(total.round() as u64, 2000);

    // Approximate mode: engines without events, kvindex answering from announcements alone.
    let approximate = rate(Policy::Approximate);
    println!("approximate mode {approximate:.3}");
    assert!(approximate > rr * 2.0, "approximate mode {approximate} does not beat round-robin {rr}");

    // Bursts sharing a new prefix: announced placements keep them together.
    let burst = report.burst.expect("the bursts ran");
    let (with, without) = (&burst.with_predictions, &burst.events_only);
    println!("bursts: with predictions {:.3}, events only {:.3}", with.hit_rate, without.hit_rate);
    assert!(with.hit_rate > without.hit_rate + 0.3, "predictions {} against events only {}", with.hit_rate, without.hit_rate);
    assert!(with.prefill_tokens_saved > without.prefill_tokens_saved);
    // Kept together, yet not all on one worker: the router still weighs load.
    assert!(burst.burst_max_with > 1 && burst.burst_max_with < burst.requests_per_burst as u64, "{}", burst.burst_max_with);
}

/// The same closed loop on three shards of kvindex (a NATS server of the demo's own
/// partitioning the workers, the router's lookups merged across the shards), beside one index
/// on the same trace: it routes as well as the one index does, as close to the oracle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_shards_route_as_well_as_one_index() {
    let trace = trace();
    let one = run(&trace, &config(1, false), std::future::pending()).await.expect("the demo runs on one index");
    let report = run(&trace, &config(3, false), std::future::pending()).await.expect("the demo runs on three shards");
    let rate =
        |r: &tools::demo::DemoReport, p: Policy| r.fleets.iter().find(|f| f.policy == p).expect("every policy reports").hit_rate;
    let (kv, oracle, rr) = (rate(&report, Policy::KvAware), rate(&report, Policy::Oracle), rate(&report, Policy::RoundRobin));
    let kv_one = rate(&one, Policy::KvAware);
    println!("three shards: kv-aware {kv:.3}, oracle {oracle:.3}, round-robin {rr:.3}; one index: kv-aware {kv_one:.3}");
    assert_eq!(report.lookups, 2000, "every request was routed with the merged answer ({} failed)", report.lookup_errors);
    assert_eq!(report.partial_answers, 0, "every answer had every shard's part");
    // Both route on exact answers; only events still in flight (a few ms) tell them apart.
    assert!(kv >= kv_one * 0.97, "kv-aware on three shards {kv} falls short of one index {kv_one}");
    assert!(kv >= oracle * 0.97, "kv-aware on three shards {kv} falls short of the oracle {oracle}");
    assert!(kv > rr * 2.0, "kv-aware on three shards {kv} does not beat round-robin {rr}");
    assert!(rate(&report, Policy::Approximate) > rr * 2.0, "approximate mode works across shards too");
    assert_eq!(report.query_api_errors, 0);
    assert!(rate(&report, Policy::KvAwareHttp) >= oracle * 0.97, "the query API answers for every shard");
}
