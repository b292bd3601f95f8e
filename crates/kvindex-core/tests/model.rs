//! The model composed, as an embedder drives it: one `apply` reaches the device index, the host
//! and disk tiers and a hybrid model's groups; one `answer` composes depths per tier,
//! predictions, routed-only workers, stale flags, a worker filter and a cut, and with none of
//! them it is the device index's own grouped answer.

use kvindex_core::groups::{GroupKind, Groups};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::{DepthGroups, KvIndex, MatchOptions};
use kvindex_core::model::{AnnounceConfig, Answer, Depths, Model, RoutedOnly, Staleness, Writers};
use kvindex_core::tiers::OtherTiers;
use kvindex_core::{Event, RunIndex, Tier};
use std::collections::HashSet;

fn q(locals: &[u64]) -> Vec<LocalHash> {
    locals.iter().map(|&l| LocalHash(l)).collect()
}

/// A chain of blocks with engine hashes `base + i` and local hashes `locals`, in `tier`.
fn chain(base: u64, locals: &[u64], tier: Tier) -> Event {
    let blocks = locals.iter().enumerate().map(|(i, &l)| StoredBlock::new(base + i as u64, l)).collect();
    Event::Stored { parent: None, blocks, tier }
}

fn announcing(routed_only: &[u64]) -> AnnounceConfig {
    AnnounceConfig {
        predicted_capacity: 1000,
        predicted_total: 10_000,
        predicted_ttl_ms: 60_000,
        routed_only: RoutedOnly { all: false, workers: routed_only.iter().copied().collect() },
        routed_only_capacity: 1000,
        routed_only_ttl_ms: 60_000,
    }
}

fn answer(model: &Model<RunIndex>, query: &[u64], opts: &MatchOptions, tiers: &[Tier], stale: &dyn Staleness) -> Answer {
    let mut out = Answer::default();
    model.answer(&q(query), opts, tiers, stale, &mut out);
    out
}

fn w(id: u64) -> WorkerId {
    WorkerId::new(id, 0)
}

#[test]
fn one_apply_reaches_every_tier_and_a_clear_empties_them() {
    let model = Model::complete(RunIndex::default, announcing(&[]));
    let mut writers = Writers::default();
    let a_events = [chain(100, &[1, 2, 3], Tier::Device), chain(200, &[1, 2, 3, 4], Tier::Host)];
    model.apply(&mut writers, w(1), &a_events).unwrap();
    model.apply(&mut writers, w(2), &[chain(300, &[1, 2], Tier::Disk)]).unwrap();
    let all = [Tier::Device, Tier::Host, Tier::Disk];
    let got = answer(&model, &[1, 2, 3, 4, 5], &MatchOptions::default(), &all, &());
    let groups: Vec<(Depths, Vec<WorkerId>)> = got.groups().map(|(d, ws)| (d, ws.to_vec())).collect();
    assert_eq!(
        groups,
        [
            (Depths { blocks: 3, host: Some(4), disk: Some(0), ..Depths::default() }, vec![w(1)]),
            (Depths { blocks: 0, host: Some(0), disk: Some(2), ..Depths::default() }, vec![w(2)]),
        ],
        "deepest first, each tier's depth where asked"
    );
    // Device alone: the host copy is no GPU hit.
    let device = answer(&model, &[1, 2, 3, 4, 5], &MatchOptions::default(), &[Tier::Device], &());
    assert_eq!(device.depths_of(w(1)).map(|d| d.blocks), Some(3));
    assert_eq!(device.depths_of(w(2)), None);
    // A host removal leaves the device copy; a clear drops every tier.
    model.apply(&mut writers, w(1), &[Event::Removed { hashes: vec![BlockHash(200)], tier: Tier::Host }]).unwrap();
    let after = answer(&model, &[1, 2, 3], &MatchOptions::default(), &all, &());
    assert_eq!(after.depths_of(w(1)), Some(Depths { blocks: 3, host: Some(0), disk: Some(0), ..Depths::default() }));
    model.apply(&mut writers, w(1), &[Event::Cleared]).unwrap();
    assert_eq!(answer(&model, &[1, 2, 3], &MatchOptions::default(), &all, &()).depths_of(w(1)), None);
    let held: Vec<u64> = {
        let mut v = Vec::new();
        model.held(&writers, |h| v.push(h.device + h.host + h.disk));
        v
    };
    assert_eq!(held.iter().sum::<u64>(), 2, "worker 2's disk blocks alone");
}

#[test]
fn predictions_stand_beside_held_depths_and_routed_only_workers_are_approximate() {
    let model = Model::complete(RunIndex::default, announcing(&[9]));
    let mut writers = Writers::default();
    model.apply(&mut writers, w(1), &[chain(100, &[1, 2], Tier::Device)]).unwrap();
    let announced = model.announce(&mut writers, w(1), &q(&[1, 2, 3, 4]));
    assert_eq!((announced.routed_only, announced.outcome.added), (false, 4));
    model.announce(&mut writers, w(3), &q(&[1, 2, 3]));
    let routed = model.announce(&mut writers, w(9), &q(&[1, 2]));
    assert!(routed.routed_only);
    assert_eq!(model.predicted_blocks(), 7);
    let got = answer(&model, &[1, 2, 3, 4], &MatchOptions::default(), &[Tier::Device], &());
    assert_eq!(
        got.depths_of(w(1)),
        Some(Depths { blocks: 2, predicted: Some(4), ..Depths::default() }),
        "held never counts a prediction"
    );
    assert_eq!(got.depths_of(w(3)), Some(Depths { blocks: 0, predicted: Some(3), ..Depths::default() }));
    assert_eq!(got.depths_of(w(9)), Some(Depths { blocks: 2, approximate: true, ..Depths::default() }));
    let order: Vec<u64> = got.groups().flat_map(|(_, ws)| ws.iter().map(|w| w.worker_id)).collect();
    assert_eq!(order, [1, 3, 9], "by the deepest of held and predicted");
    // A worker dropped takes its predictions with it.
    let (_, dropped) = model.remove_worker(&mut writers, w(1));
    assert_eq!((dropped, model.predicted_blocks()), (4, 3));
}

/// A fixed set of stale workers.
struct StaleSet(HashSet<WorkerId>);

impl Staleness for StaleSet {
    fn any(&self) -> bool {
        !self.0.is_empty()
    }
    fn contains(&self, worker: WorkerId) -> bool {
        self.0.contains(&worker)
    }
    fn for_each(&self, f: &mut dyn FnMut(WorkerId)) {
        self.0.iter().copied().for_each(f);
    }
}

#[test]
fn stale_workers_are_flagged_or_named_beside_the_matches_within_the_filter() {
    let model = Model::complete(RunIndex::default, announcing(&[]));
    let mut writers = Writers::default();
    for id in 1..=3 {
        model.apply(&mut writers, w(id), &[chain(100 * id, &[1, 2, 3][..id as usize], Tier::Device)]).unwrap();
    }
    let stale = StaleSet([w(2), w(7), w(8)].into_iter().collect());
    let got = answer(&model, &[1, 2, 3], &MatchOptions::default(), &[Tier::Device], &stale);
    assert!(got.depths_of(w(2)).is_some_and(|d| d.stale && d.blocks == 2));
    assert!(got.depths_of(w(3)).is_some_and(|d| !d.stale));
    assert_eq!(got.stale_workers(), [w(7), w(8)], "stale, matching nothing, by worker");
    let only = MatchOptions { workers: Some(vec![3, 8]), ..MatchOptions::default() };
    let filtered = answer(&model, &[1, 2, 3], &only, &[Tier::Device], &stale);
    assert_eq!(filtered.len(), 1);
    assert_eq!(filtered.stale_workers(), [w(8)], "the filter holds for stale workers too");
}

#[test]
fn a_cut_keeps_the_deepest() {
    let model = Model::complete(RunIndex::default, announcing(&[]));
    let mut writers = Writers::default();
    for id in 1..=5 {
        let depth = (id as usize).min(4);
        model.apply(&mut writers, w(id), &[chain(100 * id, &[1, 2, 3, 4][..depth], Tier::Device)]).unwrap();
    }
    // A prediction makes the composed path answer; the cut is the same.
    model.announce(&mut writers, w(1), &q(&[1]));
    let cut = MatchOptions { max_matches: Some(3), ..MatchOptions::default() };
    let got = answer(&model, &[1, 2, 3, 4], &cut, &[Tier::Device], &());
    let depths: Vec<u32> = got.groups().flat_map(|(d, ws)| ws.iter().map(move |_| d.blocks)).collect();
    assert_eq!(depths, [4, 4, 3], "the three deepest; workers 4 and 5 tie at the top");
}

#[test]
fn a_hybrid_worker_is_answered_as_deep_as_every_group_serves() {
    let model = Model::complete(RunIndex::default, announcing(&[]));
    let mut writers = Writers::default();
    let window = GroupKind::Window { blocks: 1 };
    let events =
        [chain(101, &[1, 2, 3, 4], Tier::Device), Event::GroupStored { group: 1, kind: window, hashes: vec![BlockHash(102)] }];
    model.apply(&mut writers, w(1), &events).unwrap();
    model.apply(&mut writers, w(2), &[chain(201, &[1, 2, 3, 4], Tier::Device)]).unwrap();
    let got = answer(&model, &[1, 2, 3, 4], &MatchOptions::default(), &[Tier::Device], &());
    // Worker 1's window group holds position 1 alone: the deepest prefix it serves ends there.
    assert_eq!(got.depths_of(w(1)).map(|d| d.blocks), Some(2));
    assert_eq!(got.depths_of(w(2)).map(|d| d.blocks), Some(4), "a worker without groups keeps its depth");
}

#[test]
fn with_nothing_to_compose_the_answer_is_the_device_index_s_own() {
    let device = RunIndex::default();
    let reference = RunIndex::default();
    let model = Model::new(device).with_tiers(OtherTiers::new(RunIndex::default)).with_groups(Groups::new(RunIndex::default()));
    let mut writers = Writers::default();
    let mut reference_writers = Vec::new();
    for id in 0..40u64 {
        let locals: Vec<u64> = (0..(id % 7 + 1)).map(|i| i % 3 + 1).collect();
        let ev = chain(1000 * id, &locals, Tier::Device);
        model.apply(&mut writers, w(id), std::slice::from_ref(&ev)).unwrap();
        let mut rw = reference.writer(w(id)).unwrap();
        ev.apply_to(&reference, &mut rw);
        reference_writers.push(rw);
    }
    for query in [&[1u64, 2, 3, 1, 2, 3, 1][..], &[1, 2], &[2, 3]] {
        let mut want = DepthGroups::default();
        reference.find_grouped(&q(query), &MatchOptions::default(), &mut want);
        let got = answer(&model, query, &MatchOptions::default(), &[Tier::Device], &());
        let got: Vec<(u32, Vec<WorkerId>)> = got.groups().map(|(d, ws)| (d.blocks, sorted(ws))).collect();
        let want: Vec<(u32, Vec<WorkerId>)> = want.iter().map(|(d, ws)| (d, sorted(ws))).collect();
        assert_eq!(got, want);
    }
}

fn sorted(ws: &[WorkerId]) -> Vec<WorkerId> {
    let mut v = ws.to_vec();
    v.sort_unstable();
    v
}
