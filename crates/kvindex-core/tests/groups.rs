//! Hybrid models: every backend, with the groups beside it, must answer like a model that
//! keeps each group's held prefixes as plain sets and applies the rule by brute force (every
//! length tried, deepest first). Streams mix primary chains, group blocks (some of hashes the
//! worker does not hold), removals in any group, clears, workers removed, and restarts from
//! snapshots; a tiny local-hash alphabet makes prefixes share blocks. The groups' digest must
//! equal the model's after every step.

use kvindex_core::digest::{group_member, Digest};
use kvindex_core::groups::{hybrid_depth, GroupKind, GroupWriter, Groups};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::positional::PositionalIndex;
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{KvIndex, MatchOptions, WorkerMatch};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap, HashSet};

/// A path of local hashes from the root.
type Path = Vec<u64>;

/// The engine's hash of a path: a function of the whole path, as engines chain theirs.
fn engine_hash(p: &[u64]) -> u64 {
    p.iter().fold(0x51_7cc1_b727_220a_u64, |h, &l| (h ^ l).wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(23)) | 1
}

#[derive(Clone, Debug)]
enum Op {
    /// The primary group stores `path[from..]` under `path[..from]`.
    Primary {
        worker: usize,
        path: Path,
        from: usize,
    },
    PrimaryRemove {
        worker: usize,
        path: Path,
    },
    Group {
        worker: usize,
        group: u8,
        paths: Vec<Path>,
    },
    GroupRemove {
        worker: usize,
        group: u8,
        paths: Vec<Path>,
    },
    Clear {
        worker: usize,
    },
    RemoveWorker {
        worker: usize,
    },
    Restart,
    Lookup {
        query: Path,
    },
}

fn path(max: usize) -> impl Strategy<Value = Path> {
    proptest::collection::vec(0u64..2, 1..max)
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0usize..3;
    let g = 1u8..4;
    prop_oneof![
        5 => (w.clone(), path(7), 0usize..6).prop_map(|(worker, path, from)| {
            let from = from.min(path.len() - 1);
            Op::Primary { worker, path, from }
        }),
        2 => (w.clone(), path(7)).prop_map(|(worker, path)| Op::PrimaryRemove { worker, path }),
        6 => (w.clone(), g.clone(), proptest::collection::vec(path(7), 1..5))
            .prop_map(|(worker, group, paths)| Op::Group { worker, group, paths }),
        3 => (w.clone(), g, proptest::collection::vec(path(7), 1..3))
            .prop_map(|(worker, group, paths)| Op::GroupRemove { worker, group, paths }),
        1 => w.clone().prop_map(|worker| Op::Clear { worker }),
        1 => w.prop_map(|worker| Op::RemoveWorker { worker }),
        1 => Just(Op::Restart),
        5 => path(9).prop_map(|query| Op::Lookup { query }),
    ]
}

fn kind() -> impl Strategy<Value = GroupKind> {
    prop_oneof![Just(GroupKind::Full), (1u32..4).prop_map(|blocks| GroupKind::Window { blocks }), Just(GroupKind::State),]
}

/// The model: per worker, the set of held paths per group (0: primary), and the groups seen.
#[derive(Default, Clone)]
struct ModelWorker {
    held: BTreeMap<u8, HashSet<Path>>,
    seen: BTreeMap<u8, GroupKind>,
    /// A group block of a path the worker held nowhere came since the last clear.
    unplaced: bool,
}

impl ModelWorker {
    fn holds_anywhere(&self, p: &Path) -> bool {
        self.held.values().any(|s| s.contains(p))
    }

    fn set(&mut self, g: u8) -> &mut HashSet<Path> {
        self.held.entry(g).or_default()
    }

    /// The digest the groups must keep: of every (group, hash) pair held outside the primary
    /// group, unknown once a block was left unplaced.
    fn digest(&self) -> Option<Digest> {
        let pairs = self.held.iter().filter(|(g, _)| **g > 0);
        let members = pairs.flat_map(|(g, set)| set.iter().map(move |p| group_member(*g, engine_hash(p))));
        (!self.unplaced).then(|| Digest::of(members))
    }

    /// Brute force: the deepest `e` up to the primary depth that every seen group accepts.
    fn depth(&self, query: &[u64]) -> u32 {
        let empty = HashSet::new();
        let primary = self.held.get(&0).unwrap_or(&empty);
        let d0 = (1..=query.len()).take_while(|&n| primary.contains(&query[..n].to_vec())).count();
        let accepts = |e: usize| {
            self.seen.iter().all(|(g, kind)| {
                let set = self.held.get(g).unwrap_or(&empty);
                let held = |i: usize| set.contains(&query[..=i].to_vec());
                match *kind {
                    GroupKind::Full => (0..e).all(held),
                    GroupKind::Window { blocks } => (e.saturating_sub(blocks as usize)..e).all(held),
                    GroupKind::State => e == 0 || held(e - 1),
                }
            })
        };
        (0..=d0).rev().find(|&e| accepts(e)).unwrap_or(0) as u32
    }
}

fn id(w: usize) -> WorkerId {
    WorkerId::new(w as u64 + 1, (w % 2) as u32)
}

fn hashes(paths: &[Path]) -> Vec<BlockHash> {
    paths.iter().map(|p| BlockHash(engine_hash(p))).collect()
}

/// A worker's writers: in the main index (its primary group) and in the groups.
type Writers<I> = HashMap<usize, (<I as KvIndex>::Writer, GroupWriter<<I as KvIndex>::Writer>)>;

fn writer<'a, I: KvIndex>(
    ws: &'a mut Writers<I>,
    main: &I,
    groups: &Groups<I>,
    w: usize,
) -> &'a mut (I::Writer, GroupWriter<I::Writer>) {
    ws.entry(w).or_insert_with(|| (main.writer(id(w)).unwrap(), groups.writer(id(w))))
}

/// Runs `ops` on `make`'s backend beside the model; with `placed_only`, group stores name only
/// blocks the worker holds somewhere (so that every group digest is known and compared).
fn run<I: KvIndex>(make: impl Fn() -> I, kinds: &[GroupKind; 3], ops: &[Op], placed_only: bool) -> Result<(), TestCaseError> {
    let (mut main, mut groups) = (make(), Groups::new(make()));
    let mut ws: Writers<I> = HashMap::new();
    let mut model: HashMap<usize, ModelWorker> = HashMap::new();
    for op in ops {
        match op {
            Op::Primary { worker, path, from } => {
                let m = model.entry(*worker).or_default();
                // Engines store under a parent they hold; otherwise the whole path from the root.
                let held = |n: usize| m.held.get(&0).is_some_and(|s| s.contains(&path[..n].to_vec()));
                let from = if *from > 0 && held(*from) { *from } else { 0 };
                let parent = (from > 0).then(|| BlockHash(engine_hash(&path[..from])));
                let blocks: Vec<StoredBlock> = (from..path.len())
                    .map(|i| StoredBlock { block_hash: BlockHash(engine_hash(&path[..=i])), tokens_hash: LocalHash(path[i]) })
                    .collect();
                for i in from..path.len() {
                    m.set(0).insert(path[..=i].to_vec());
                }
                let (mw, gw) = writer(&mut ws, &main, &groups, *worker);
                main.store(mw, parent, &blocks);
                groups.primary_stored(gw, parent, &blocks);
            }
            Op::PrimaryRemove { worker, path } => {
                model.entry(*worker).or_default().set(0).remove(path);
                let (mw, gw) = writer(&mut ws, &main, &groups, *worker);
                let h = hashes(std::slice::from_ref(path));
                main.remove(mw, &h);
                groups.primary_removed(gw, &h);
            }
            Op::Group { worker, group, paths } => {
                let kind = kinds[*group as usize - 1];
                let m = model.entry(*worker).or_default();
                m.seen.insert(*group, kind);
                let paths: Vec<Path> = paths.iter().filter(|p| !placed_only || m.holds_anywhere(p)).cloned().collect();
                for p in &paths {
                    if m.holds_anywhere(p) {
                        m.set(*group).insert(p.clone());
                    } else {
                        m.unplaced = true;
                    }
                }
                let (_, gw) = writer(&mut ws, &main, &groups, *worker);
                groups.store(gw, *group, kind, &hashes(&paths));
            }
            Op::GroupRemove { worker, group, paths } => {
                let m = model.entry(*worker).or_default();
                for p in paths {
                    m.set(*group).remove(p);
                }
                let (_, gw) = writer(&mut ws, &main, &groups, *worker);
                groups.remove(gw, *group, &hashes(paths));
            }
            Op::Clear { worker } => {
                let m = model.entry(*worker).or_default();
                (m.held, m.unplaced) = (BTreeMap::new(), false);
                let (mw, gw) = writer(&mut ws, &main, &groups, *worker);
                main.clear(mw);
                groups.clear(gw);
            }
            Op::RemoveWorker { worker } => {
                model.remove(worker);
                if let Some((mw, gw)) = ws.remove(worker) {
                    main.remove_worker(mw);
                    groups.remove_worker(gw);
                }
            }
            Op::Restart => {
                let saved: Vec<_> = ws.iter().map(|(&w, (mw, gw))| (w, main.save(mw), groups.save(gw))).collect();
                (main, groups) = (make(), Groups::new(make()));
                ws.clear();
                for (w, m, g) in saved {
                    let (mw, gw) = writer(&mut ws, &main, &groups, w);
                    main.restore(mw, &m);
                    groups.restore(gw, &g);
                }
            }
            Op::Lookup { query } => {
                let locals: Vec<LocalHash> = query.iter().map(|&l| LocalHash(l)).collect();
                let mut got = main.find_matches(&locals, &MatchOptions::default());
                groups.limit(&locals, &mut got);
                let mut want: Vec<WorkerMatch> = model
                    .iter()
                    .map(|(&w, m)| WorkerMatch { worker: id(w), blocks: m.depth(query) })
                    .filter(|m| m.blocks > 0)
                    .collect();
                want.sort_unstable_by(|a, b| b.blocks.cmp(&a.blocks).then(a.worker.cmp(&b.worker)));
                prop_assert_eq!(got, want, "query {:?}", query);
            }
        }
        for (w, (_, gw)) in &ws {
            prop_assert_eq!(groups.digest(gw), model[w].digest(), "worker {}'s group digest after {:?}", w, op);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn runs_with_groups_match_the_model(kinds in [kind(), kind(), kind()], ops in proptest::collection::vec(op(), 1..60)) {
        run(RunIndex::default, &kinds, &ops, false)?;
    }

    #[test]
    fn positional_with_groups_matches_the_model(kinds in [kind(), kind(), kind()], ops in proptest::collection::vec(op(), 1..60)) {
        run(PositionalIndex::default, &kinds, &ops, false)?;
    }

    #[test]
    fn reference_with_groups_matches_the_model(kinds in [kind(), kind(), kind()], ops in proptest::collection::vec(op(), 1..60)) {
        run(|| ReferenceIndex::new(64, 64), &kinds, &ops, false)?;
    }

    /// Group stores of held blocks only: the groups' digest is known at every step, and must
    /// be the model's.
    #[test]
    fn group_digests_match_the_model(kinds in [kind(), kind(), kind()], ops in proptest::collection::vec(op(), 1..60)) {
        run(RunIndex::default, &kinds, &ops, true)?;
    }

    /// The fixed point reaches the deepest length every group accepts, whatever the kinds.
    #[test]
    fn fixed_point_is_the_deepest_common_length(
        kinds in proptest::collection::vec(kind(), 1..4),
        held in proptest::collection::vec(proptest::collection::vec(any::<bool>(), 12), 3),
        limit in 0usize..13,
    ) {
        let got = hybrid_depth(limit, &kinds, |j, i| held[j][i]);
        let want = (0..=limit)
            .rev()
            .find(|&e| kinds.iter().enumerate().all(|(j, k)| k.accepts(e, &mut |i| held[j][i])))
            .unwrap_or(0);
        prop_assert_eq!(got, want);
    }
}

/// vLLM's sliding-window need: `ceil((window - 1) / block_size)`, at least one block.
#[test]
fn window_needs_what_vllm_needs() {
    assert_eq!(GroupKind::window(128, 16), GroupKind::Window { blocks: 8 });
    assert_eq!(GroupKind::window(129, 16), GroupKind::Window { blocks: 8 });
    assert_eq!(GroupKind::window(130, 16), GroupKind::Window { blocks: 9 });
    assert_eq!(GroupKind::window(1, 16), GroupKind::Window { blocks: 1 });
    assert_eq!(GroupKind::window(4096, 16), GroupKind::Window { blocks: 256 });
}

/// A worked case: a sliding window of 2 blocks and a state group under 6 primary blocks.
#[test]
fn a_window_and_a_state_group_limit_the_primary_depth() {
    let window = GroupKind::Window { blocks: 2 };
    // Window holds blocks 2, 3, 4 (the rest slid out); state holds blocks 1 and 3.
    let win = [false, false, true, true, true, false];
    let state = [false, true, false, true, false, false];
    let depth = hybrid_depth(6, &[window, GroupKind::State], |j, i| if j == 0 { win[i] } else { state[i] });
    // 5: window ok ([3,5)), state needs block 4: no. 4: window [2,4) ok, state block 3 ok.
    assert_eq!(depth, 4);
    // Without the state group, the window alone serves 5.
    assert_eq!(hybrid_depth(6, &[window], |_, i| win[i]), 5);
}

/// What a hybrid lookup keeps is bounded: many hybrid workers and a long query are taken in
/// batches whose probe bits stay under the bound, and the answer is the one an unbounded
/// lookup gives.
#[test]
fn a_hybrid_lookup_keeps_its_probes_within_the_bound() {
    let window = GroupKind::Window { blocks: 8 };
    let (small, large) = (
        Groups::new(RunIndex::default()).with_scratch_bits(1 << 16),
        Groups::new(RunIndex::default()).with_scratch_bits(usize::MAX / 4),
    );
    let main = RunIndex::default();
    let locals: Vec<u64> = (0..256).map(|i| 1_000 + i).collect();
    for w in 0..512u64 {
        let id = WorkerId::new(w, 0);
        let chain: Vec<StoredBlock> = locals.iter().enumerate().map(|(i, &l)| StoredBlock::new(w << 32 | i as u64, l)).collect();
        let mut mw = main.writer(id).unwrap();
        main.store(&mut mw, None, &chain);
        std::mem::forget(mw);
        // The window holds every block but those at positions hit by the worker's own stride,
        // so each worker's rule steps over holes of its own.
        let held: Vec<BlockHash> = (0..256u64).filter(|i| (i + w) % (3 + w % 5) != 0).map(|i| BlockHash(w << 32 | i)).collect();
        for g in [&small, &large] {
            let mut gw = g.writer(id);
            g.primary_stored(&mut gw, None, &chain);
            g.store(&mut gw, 1, window, &held);
            std::mem::forget(gw);
        }
    }
    let q: Vec<LocalHash> = locals.iter().map(|&l| LocalHash(l)).collect();
    let primary = main.find_matches(&q, &MatchOptions::default());
    assert_eq!(primary.len(), 512);
    let (mut a, mut b) = (primary.clone(), primary);
    let _ = kvindex_core::groups::scratch_peak();
    small.limit(&q, &mut a);
    let bounded = kvindex_core::groups::scratch_peak();
    large.limit(&q, &mut b);
    let unbounded = kvindex_core::groups::scratch_peak();
    assert_eq!(a, b, "batches answer what one pass does");
    assert!(a.iter().any(|m| m.blocks < 256) && a.iter().any(|m| m.blocks > 0), "the rule bites: {:?}", &a[..4]);
    assert!(unbounded > 1 << 16, "one pass keeps {unbounded} bits");
    assert!(bounded <= 1 << 16, "a batch keeps {bounded} bits, over the bound");
}
