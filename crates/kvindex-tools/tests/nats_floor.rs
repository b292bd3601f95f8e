//! `nats-floor` measures every path it names: each bare NATS path and kvindex's beside it,
//! every lookup answered and every event applied (it fails otherwise).

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_is_measured() {
    let r = kvindex_tools::nats_floor::run(50, 1000.0).await.expect("the floor runs");
    let names: Vec<&str> = r.paths.iter().map(|p| p.what).collect();
    assert_eq!(names.len(), 4, "{names:?}");
    for p in &r.paths {
        assert!(p.p50_us > 0.0 && p.p99_us >= p.p50_us && p.mean_us > 0.0, "{p:?}");
    }
}
