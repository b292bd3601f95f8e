//! Restatements on every backend, against a rebuild: a worker holding state S that is sent a
//! snapshot of state T, applied as a difference in any number of batches, ends exactly as a
//! worker rebuilt from T alone, and never lets go of a block S and T both hold on the way.

use kvindex_core::groups::{GroupKind, Groups};
use kvindex_core::hash::{BlockHash, StoredBlock, WorkerId};
use kvindex_core::index::positional::PositionalIndex;
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::KvIndex;
use kvindex_core::model::{Model, Restate, SavedWorker, Writers};
use kvindex_core::tiers::OtherTiers;
use kvindex_core::{Event, RunIndex, Tier};
use proptest::prelude::*;
use std::collections::BTreeSet;

const W: WorkerId = WorkerId::new(7, 0);

/// A block's engine hash: its path of local hashes (1..=3 each, at most 5 deep), as an engine
/// chains them, so a hash names one place.
fn hash_of(path: &[u64]) -> u64 {
    path.iter().fold(1u64, |h, &l| h * 4 + l)
}

/// One tier's blocks: paths closed under their prefixes, parents first.
fn closed(paths: &[Vec<u64>]) -> BTreeSet<Vec<u64>> {
    let mut all = BTreeSet::new();
    for p in paths {
        for n in 1..=p.len() {
            all.insert(p[..n].to_vec());
        }
    }
    all
}

/// A worker's state: device, host and disk paths, and which device blocks group 1 holds.
#[derive(Clone, Debug)]
struct State {
    device: BTreeSet<Vec<u64>>,
    host: BTreeSet<Vec<u64>>,
    disk: BTreeSet<Vec<u64>>,
    group: BTreeSet<u64>,
}

fn paths() -> impl Strategy<Value = BTreeSet<Vec<u64>>> {
    proptest::collection::vec(proptest::collection::vec(1u64..4, 1..6), 0..8).prop_map(|p| closed(&p))
}

fn state() -> impl Strategy<Value = State> {
    (paths(), paths(), paths(), proptest::collection::vec(any::<prop::sample::Index>(), 0..6)).prop_map(
        |(device, host, disk, picks)| {
            let hashes: Vec<u64> = device.iter().map(|p| hash_of(p)).collect();
            let group =
                if hashes.is_empty() { BTreeSet::new() } else { picks.iter().map(|i| hashes[i.index(hashes.len())]).collect() };
            State { device, host, disk, group }
        },
    )
}

/// The state as a snapshot sends it, without its `cleared`: one store per block, parents
/// first, then group 1's blocks.
fn snapshot(s: &State) -> Vec<Event> {
    let mut out = Vec::new();
    for (tier, paths) in [(Tier::Device, &s.device), (Tier::Host, &s.host), (Tier::Disk, &s.disk)] {
        let mut by_len: Vec<&Vec<u64>> = paths.iter().collect();
        by_len.sort_by_key(|p| p.len());
        for p in by_len {
            let parent = (p.len() > 1).then(|| BlockHash(hash_of(&p[..p.len() - 1])));
            let blocks = vec![StoredBlock::new(hash_of(p), *p.last().unwrap())];
            out.push(Event::Stored { parent, blocks, tier });
        }
    }
    let hashes = s.group.iter().map(|&h| BlockHash(h)).collect();
    out.push(Event::GroupStored { group: 1, kind: GroupKind::Window { blocks: 1 }, hashes });
    out
}

fn model<I: KvIndex>(make: &impl Fn() -> I) -> Model<I> {
    Model::new(make()).with_tiers(OtherTiers::new(make)).with_groups(Groups::new(make()))
}

/// A saved worker in a canonical order, for comparing two that hold the same.
fn canonical(saved: Option<SavedWorker>) -> String {
    let Some(mut s) = saved else { return "nothing".into() };
    let sort = |v: &mut kvindex_core::index::Saved| {
        v.blocks.sort_by_key(|b| (b.pos, b.hash));
        v.beyond.sort_unstable();
    };
    sort(&mut s.device);
    for tier in [&mut s.tiers.host, &mut s.tiers.disk] {
        // A tier the worker once used and holds nothing in is a tier it never used.
        tier.take_if(|t| t.blocks.is_empty() && t.beyond.is_empty());
        tier.as_mut().map(sort);
    }
    if let Some(g) = s.groups.as_mut() {
        g.kinds.sort_unstable_by_key(|k| k.0);
        // A block no group holds any more is not kept by a rebuild.
        g.blocks.retain(|b| b.3 != 0);
    }
    format!("{s:?}")
}

fn device_hashes(saved: Option<SavedWorker>) -> BTreeSet<u64> {
    saved.map(|s| s.device.blocks.iter().map(|b| b.hash).collect()).unwrap_or_default()
}

/// S, then T restated in `cuts`' batches, against T rebuilt on a fresh model.
fn check<I: KvIndex>(make: impl Fn() -> I, s: &State, t: &State, cuts: &[prop::sample::Index]) {
    let restated = model(&make);
    let mut w = Writers::default();
    restated.apply(&mut w, W, &snapshot(s)).unwrap();
    let rebuilt = model(&make);
    let mut wr = Writers::default();
    let mut whole = vec![Event::Cleared];
    whole.extend(snapshot(t));
    rebuilt.apply(&mut wr, W, &whole).unwrap();

    let both: BTreeSet<u64> = s.device.intersection(&t.device).map(|p| hash_of(p)).collect();
    let events = snapshot(t);
    let mut at: Vec<usize> = cuts.iter().map(|c| c.index(events.len() + 1)).collect();
    at.extend([0, events.len()]);
    at.sort_unstable();
    at.dedup();
    for (i, pair) in at.windows(2).enumerate() {
        let r = Restate { opens: i == 0, ends: (pair[1] == events.len()).then_some(true) };
        let out = restated.apply_restating(&mut w, W, &events[pair[0]..pair[1]], r).unwrap();
        assert_eq!(out.unplaceable, 0, "{}", restated.device().name());
        let held = device_hashes(restated.save(&w, W));
        assert!(held.is_superset(&both), "{}: a block both states hold was let go mid-way", restated.device().name());
    }
    if at.len() == 1 {
        restated.apply_restating(&mut w, W, &[], Restate { opens: true, ends: Some(true) }).unwrap();
    }
    assert_eq!(canonical(restated.save(&w, W)), canonical(rebuilt.save(&wr, W)), "{}", restated.device().name());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    /// Every backend restates S into T exactly, in any batches.
    #[test]
    fn a_restatement_ends_as_a_rebuild(s in state(), t in state(), cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4)) {
        check(RunIndex::default, &s, &t, &cuts);
        check(PositionalIndex::default, &s, &t, &cuts);
        check(|| ReferenceIndex::new(1 << 16, 1 << 10), &s, &t, &cuts);
    }
}

/// A restatement of the state held changes nothing at any point; one whose snapshot had a gap
/// is given up and keeps both; a `cleared` inside one ends it; one naming more than its bound
/// is given up and counted.
#[test]
fn a_restatement_of_the_same_state_changes_nothing_and_ends_as_told() {
    let m = model(&RunIndex::default);
    let mut w = Writers::default();
    let s = State { device: closed(&[vec![1, 2, 3]]), host: BTreeSet::new(), disk: BTreeSet::new(), group: BTreeSet::new() };
    m.apply(&mut w, W, &snapshot(&s)).unwrap();
    let before = canonical(m.save(&w, W));
    let events = snapshot(&s);
    let out = m.apply_restating(&mut w, W, &events[..1], Restate { opens: true, ends: None }).unwrap();
    assert_eq!((out.stored, out.duplicates), (0, 1));
    assert_eq!(canonical(m.save(&w, W)), before);
    let out = m.apply_restating(&mut w, W, &events[1..], Restate { opens: false, ends: Some(true) }).unwrap();
    assert_eq!((out.stored, out.removed), (0, 0));
    assert_eq!(canonical(m.save(&w, W)), before);

    // Given up (a gap): the old blocks stay beside the new.
    let t = State { device: closed(&[vec![2]]), ..s.clone() };
    m.apply_restating(&mut w, W, &snapshot(&t), Restate { opens: true, ends: Some(false) }).unwrap();
    assert_eq!(device_hashes(m.save(&w, W)).len(), 4);
    // A `cleared` ends it: nothing is removed at its end but what the events removed.
    m.apply_restating(&mut w, W, &[Event::Cleared], Restate { opens: true, ends: None }).unwrap();
    m.apply_restating(&mut w, W, &snapshot(&s), Restate { opens: false, ends: Some(true) }).unwrap();
    assert_eq!(canonical(m.save(&w, W)), before);

    let small = model(&RunIndex::default).with_restate_max(2);
    let mut w = Writers::default();
    let out = small.apply_restating(&mut w, W, &snapshot(&s), Restate { opens: true, ends: Some(true) }).unwrap();
    assert_eq!((out.stored, out.restatements_given_up, out.removed), (3, 1, 0));
}
