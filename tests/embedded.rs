//! An embedder of kvindex-core answers exactly what the daemon answers: the Mooncake trace
//! through the mock engine (evictions that leave holes), with routers' announcements, fed to a
//! daemon through publishers and to a `Model` in this process built from the same
//! configuration; every lookup's answer over NATS equals the embedded model's, in the wire's form.

mod support;

use kvindex::config::Config;
use kvindex_client::protocol::{entries_that_fit, LookupRequest, LookupResponse};
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::WorkerId;
use kvindex_core::index::MatchOptions;
use kvindex_core::model::{Answer, Model, Writers};
use kvindex_core::{RunIndex, Tier};
use kvindex_tools::stream::Op;
use kvindex_tools::trace::{read_trace_file, MockConfig, MockEngine};
use std::collections::HashMap;
use support::{eventually, Daemon, NatsServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_model_answers_what_the_daemon_answers() {
    let nats = NatsServer::start();
    // Announcements live long enough that neither side ages them out during the test.
    let daemon = Daemon::start(&nats.url(), |cfg: &mut Config| cfg.predicted_ttl = 3600.0).await;
    let model = Model::complete(|| RunIndex::new(daemon.cfg.run_config()), daemon.cfg.announcing());
    let mut writers = Writers::default();

    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/data/traces/conversation_trace.jsonl");
    let mut trace = read_trace_file(path.as_ref()).expect("shipped trace");
    trace.truncate(600);
    let ops = MockEngine::run(MockConfig { workers: 8, capacity: 1024, factor: 4, hole_rate: 0.2, ..Default::default() }, &trace);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let router = LookupClient::new(client.clone(), &daemon.cfg.prefix);
    let mut publishers: HashMap<WorkerId, Publisher> = HashMap::new();
    let (mut queries, mut stored, mut removed) = (Vec::new(), 0, 0);
    for op in ops.into_iter().map(|o| Op::from(o.op)) {
        match op {
            Op::Event(worker, ev) => {
                if let std::collections::hash_map::Entry::Vacant(slot) = publishers.entry(worker) {
                    let cfg = PublisherConfig::new(&daemon.cfg.prefix, worker.worker_id, worker.dp_rank);
                    slot.insert(Publisher::start(client.clone(), cfg).await.unwrap());
                }
                publishers[&worker].publish(&ev);
                let out = model.apply(&mut writers, worker, std::slice::from_ref(&ev)).expect("a slot");
                (stored, removed) = (stored + out.stored, removed + out.removed);
            }
            Op::Lookup(q) => {
                // Every tenth request is announced to a worker beyond the fleet's, as a router would.
                if queries.len() % 10 == 0 {
                    let to = WorkerId::new(100 + (queries.len() as u64 / 10) % 3, 0);
                    router.announce_applied(&Query::hashes(&q), to.worker_id, to.dp_rank).await.expect("applied");
                    model.announce(&mut writers, to, &q);
                }
                queries.push(q);
            }
        }
    }
    for p in publishers.values() {
        p.flush().await;
    }
    let applied = eventually(30, || async {
        let stored_there = daemon.metric("kvindex_blocks_applied_total{kind=\"stored\"}").await as u64;
        let removed_there = daemon.metric("kvindex_blocks_applied_total{kind=\"removed\"}").await as u64;
        (stored_there == stored && removed_there == removed).then_some(())
    })
    .await;
    assert!(applied.is_some(), "the daemon applied the {stored} stores and {removed} removals the model did");
    assert!(model.predicted_blocks() > 0, "predictions are part of what is compared");

    let room = entries_that_fit(client.server_info().max_payload);
    let mut answer = Answer::default();
    let (mut compared, mut deep) = (0, 0);
    for q in queries.iter().step_by(3) {
        let request = LookupRequest { block_hashes: Some(q.iter().map(|h| h.0).collect()), ..Default::default() };
        let reply = client.request(format!("{}.lookup", daemon.cfg.prefix), rmp_serde::to_vec_named(&request).unwrap().into());
        let over_nats: LookupResponse = rmp_serde::from_slice(&reply.await.expect("answered").payload).expect("an answer");
        model.answer(q, &MatchOptions::default(), &[Tier::Device], &(), &mut answer);
        assert_eq!(over_nats, LookupResponse::from_answer(&answer, false, room, None), "query {compared}");
        compared += 1;
        deep += answer.groups().next().is_some_and(|(d, _)| d.blocks > 1) as usize;
    }
    assert!(compared > 50 && deep > 10, "{compared} lookups compared, {deep} matched deeper than one block");
    daemon.stop().await.unwrap();
}
