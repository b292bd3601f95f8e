//! Lookups racing writes, checked against exact states: every worker in an answer must be
//! answered at its depth in one of the states it went through while the lookup ran (the
//! states from before the lookup to the end of the write in flight after it), never a depth
//! between two of them, and never under another worker's name.
//!
//! Writer threads own disjoint workers and apply a fixed, seeded schedule of events to each:
//! chains stored under any block the worker holds (under a hole too: the blocks past it stay
//! hidden until it is filled), tails evicted across several runs at once, holes made and
//! filled, clears, and the worker leaving the index and joining it again (its slot freed and
//! interned again, by it or by a worker that never holds anything). Chains share prefixes at
//! every level, so runs are shared, split, emptied and killed, and with a low dense threshold
//! they turn dense and back while lookups read them. Lookups ask for every match, through a
//! worker filter, and for a cut answer. A reader notes every worker's progress before and
//! after its lookup; nothing here depends on timing: the schedules are fixed, the readers stop
//! when the writers are done, and the check holds for any interleaving of a correct index.

use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use kvindex_core::index::{DepthGroups, KvIndex, MatchOptions};
use kvindex_core::{PositionalIndex, RunConfig, RunIndex};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Workers with schedules.
const WORKERS: usize = 24;
/// Writer threads (each owns every `WRITERS`-th worker).
const WRITERS: usize = 2;
/// Reader threads.
const READERS: usize = 2;
/// Events per worker.
const STEPS: usize = 2000;

/// The blocks every chain is made of: a tree of nodes, each a local hash with its parent.
struct Tree {
    /// Node -> (parent node, local hash); node 0's parent is none.
    nodes: Vec<(Option<usize>, u64)>,
    /// Every chain: the nodes from the root to a leaf.
    chains: Vec<Vec<usize>>,
}

impl Tree {
    /// A shared trunk of 24 blocks; six branches of 24 under it, four at its end and two in its
    /// middle; three twigs of 16 under each branch, at its end, in its middle and near its start.
    fn new() -> Tree {
        let mut t = Tree { nodes: Vec::new(), chains: Vec::new() };
        let trunk = t.segment(None, 24, 1);
        for b in 0..6 {
            let at = if b < 4 { trunk.len() } else { 10 + b };
            let branch = t.segment(Some(trunk[at - 1]), 24, 100 + b as u64);
            for (k, cut) in [branch.len(), 12, 3].into_iter().enumerate() {
                let twig = t.segment(Some(branch[cut - 1]), 16, 1_000 + 10 * b as u64 + k as u64);
                let chain: Vec<usize> = trunk[..at].iter().chain(&branch[..cut]).chain(&twig).copied().collect();
                t.chains.push(chain);
            }
        }
        t
    }

    /// `n` new nodes in a line under `parent`, their hashes drawn from `tag`.
    fn segment(&mut self, mut parent: Option<usize>, n: usize, tag: u64) -> Vec<usize> {
        (0..n)
            .map(|i| {
                let id = self.nodes.len();
                self.nodes.push((parent, tag << 20 | i as u64));
                parent = Some(id);
                id
            })
            .collect()
    }

    /// How deep a worker holding `held` matches `chain`: its leading nodes held.
    fn depth(held: &BTreeSet<usize>, chain: &[usize]) -> u32 {
        chain.iter().take_while(|n| held.contains(n)).count() as u32
    }
}

/// One event of a worker's schedule.
#[derive(Clone, Debug)]
enum Ev {
    /// Store `nodes` (a line) under `parent` (a held node, or the root).
    Store { parent: Option<usize>, nodes: Vec<usize> },
    /// Remove these held nodes, in this order.
    Remove(Vec<usize>),
    /// Drop every block.
    Clear,
    /// Leave the index (its slot is freed), and join it again, with nothing.
    Rejoin,
}

/// A seeded xorshift generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Worker `w`'s events and the set of nodes it holds after each (`states[0]` is empty).
fn schedule(tree: &Tree, w: usize) -> (Vec<Ev>, Vec<BTreeSet<usize>>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (w as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    let mut held = BTreeSet::new();
    let (mut evs, mut states) = (Vec::new(), vec![held.clone()]);
    // Each worker favours a few chains, so that workers share and diverge.
    let mine: Vec<usize> = (0..4).map(|k| (w * 5 + k * 7) % tree.chains.len()).collect();
    for _ in 0..STEPS {
        let chain = &tree.chains[mine[rng.below(mine.len())]];
        let depth = Tree::depth(&held, chain) as usize;
        let ev = match rng.below(20) {
            // Extend a chain from its held prefix.
            0..=7 if depth < chain.len() => {
                let n = 1 + rng.below(chain.len() - depth);
                Ev::Store { parent: depth.checked_sub(1).map(|i| chain[i]), nodes: chain[depth..depth + n].to_vec() }
            }
            // Store under a held block past the contiguous prefix (under a hole: hidden).
            8..=9 => {
                let past: Vec<usize> = chain.iter().skip(depth + 1).copied().filter(|n| held.contains(n)).collect();
                let Some(&p) = past.get(rng.below(past.len())) else { continue };
                let at = chain.iter().position(|&n| n == p).unwrap_or(0) + 1;
                let n = (1 + rng.below(6)).min(chain.len() - at);
                let nodes: Vec<usize> = chain[at..at + n].iter().copied().filter(|n| !held.contains(n)).collect();
                if nodes.len() != n || n == 0 {
                    continue;
                }
                Ev::Store { parent: Some(p), nodes }
            }
            // Evict the tail of what it holds of a chain, deepest first, across runs.
            10..=14 => {
                let on: Vec<usize> = chain.iter().copied().filter(|n| held.contains(n)).collect();
                if on.is_empty() {
                    continue;
                }
                // Only blocks no other held block hangs under (an engine evicts leaves).
                let mut gone = Vec::new();
                for &n in on.iter().rev().take(1 + rng.below(40)) {
                    if held.iter().any(|&c| tree.nodes[c].0 == Some(n) && !gone.contains(&c)) {
                        break;
                    }
                    gone.push(n);
                }
                if gone.is_empty() {
                    continue;
                }
                Ev::Remove(gone)
            }
            // A hole: one block in the middle of what it holds.
            15..=17 if depth > 2 => Ev::Remove(vec![chain[1 + rng.below(depth - 2)]]),
            18 => Ev::Clear,
            19 => Ev::Rejoin,
            _ => continue,
        };
        match &ev {
            Ev::Store { nodes, .. } => held.extend(nodes.iter().copied()),
            Ev::Remove(gone) => gone.iter().for_each(|n| {
                held.remove(n);
            }),
            Ev::Clear | Ev::Rejoin => held.clear(),
        }
        evs.push(ev);
        states.push(held.clone());
    }
    (evs, states)
}

/// Worker `w`'s engine hash of node `n` (engines hash their own blocks).
fn engine(w: usize, n: usize) -> u64 {
    (w as u64 + 1) << 32 | n as u64
}

/// The id of worker `w`; the ghosts (ids from 1000) are interned and removed and never hold
/// anything, so they must never be named.
fn worker(w: usize) -> WorkerId {
    WorkerId::new(w as u64, 0)
}

const GHOST: u64 = 1_000;

/// What each lookup of a reader asks: every match, through a filter, or the deepest few.
fn options(i: usize) -> MatchOptions {
    match i % 3 {
        0 => MatchOptions::default(),
        1 => MatchOptions {
            workers: Some((0..WORKERS as u64).filter(|w| (w + i as u64) % 3 != 0).collect()),
            ..Default::default()
        },
        _ => MatchOptions { max_matches: Some(1 + i % 7), ..Default::default() },
    }
}

/// Counts a writer out when it ends, however it ends.
struct Leaving<'a>(&'a AtomicUsize);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn race<I: KvIndex>(index: I, exact: bool) {
    let tree = Tree::new();
    let plans: Vec<(Vec<Ev>, Vec<BTreeSet<usize>>)> = (0..WORKERS).map(|w| schedule(&tree, w)).collect();
    let done: Vec<AtomicUsize> = (0..WORKERS).map(|_| AtomicUsize::new(0)).collect();
    let writing = AtomicUsize::new(WRITERS);
    let checked = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..WRITERS {
            let (index, tree, plans, done, writing) = (&index, &tree, &plans, &done, &writing);
            s.spawn(move || {
                // Readers stop when every writer is done, or has failed.
                let _leaving = Leaving(writing);
                let mut mine: Vec<(usize, Option<I::Writer>)> =
                    (t..WORKERS).step_by(WRITERS).map(|w| (w, Some(index.writer(worker(w)).expect("room")))).collect();
                let ghost = WorkerId::new(GHOST + t as u64, 0);
                for step in 0..STEPS {
                    for (w, writer) in mine.iter_mut() {
                        let Some(ev) = plans[*w].0.get(step) else { continue };
                        let wr = writer.as_mut().expect("joined");
                        match ev {
                            Ev::Store { parent, nodes } => {
                                let blocks: Vec<StoredBlock> =
                                    nodes.iter().map(|&n| StoredBlock::new(engine(*w, n), tree.nodes[n].1)).collect();
                                let out = index.store(wr, parent.map(|p| BlockHash(engine(*w, p))), &blocks);
                                assert_eq!(out.stored + out.duplicates, nodes.len() as u64, "worker {w} step {step}: {out:?}");
                            }
                            Ev::Remove(gone) => {
                                let hashes: Vec<BlockHash> = gone.iter().map(|&n| BlockHash(engine(*w, n))).collect();
                                let out = index.remove(wr, &hashes);
                                assert_eq!(out.removed, gone.len() as u64, "worker {w} step {step}: {out:?}");
                            }
                            Ev::Clear => {
                                index.clear(wr);
                            }
                            Ev::Rejoin => {
                                index.remove_worker(writer.take().expect("joined"));
                                // A worker that never holds anything may take the freed slot.
                                let g = index.writer(ghost).expect("room");
                                index.remove_worker(g);
                                *writer = Some(index.writer(worker(*w)).expect("room"));
                            }
                        }
                        done[*w].store(step + 1, Ordering::SeqCst);
                    }
                }
            });
        }
        for r in 0..READERS {
            let (index, tree, plans, done, writing, checked) = (&index, &tree, &plans, &done, &writing, &checked);
            s.spawn(move || {
                let mut i = r;
                let mut grouped = DepthGroups::default();
                // At least one pass over every chain and option, then on until the writers are done.
                while i < tree.chains.len() * 6 || writing.load(Ordering::SeqCst) > 0 {
                    let chain = &tree.chains[i % tree.chains.len()];
                    let opts = options(i / tree.chains.len());
                    i += READERS;
                    let q: Vec<LocalHash> = chain.iter().map(|&n| LocalHash(tree.nodes[n].1)).collect();
                    let before: Vec<usize> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
                    let answer = if i % 2 == 0 {
                        index.find_matches(&q, &opts)
                    } else {
                        index.find_grouped(&q, &opts, &mut grouped);
                        grouped.to_matches()
                    };
                    let after: Vec<usize> = done.iter().map(|d| d.load(Ordering::SeqCst)).collect();
                    if let Some(k) = opts.max_matches {
                        assert!(answer.len() <= k, "a cut answer of {} matches for max_matches {k}", answer.len());
                    }
                    let mut named = BTreeSet::new();
                    for m in &answer {
                        assert!(m.worker.worker_id < WORKERS as u64, "{m:?} names a worker that never held a block");
                        assert!(named.insert(m.worker), "{m:?} named twice in {answer:?}");
                        let admitted = opts.workers.as_ref().is_none_or(|f| f.contains(&m.worker.worker_id));
                        assert!(admitted, "{m:?} is not among the filter's workers");
                    }
                    for (v, plan) in plans.iter().enumerate() {
                        let got = answer.iter().find(|m| m.worker == worker(v)).map_or(0, |m| m.blocks);
                        let admitted = opts.workers.as_ref().is_none_or(|f| f.contains(&(v as u64)));
                        if !admitted || (opts.max_matches.is_some() && got == 0) {
                            continue;
                        }
                        // Its states from before the lookup to the end of the event in flight after it.
                        let states = &plan.1[before[v]..=(after[v] + 1).min(plan.1.len() - 1)];
                        let depths: Vec<u32> = states.iter().map(|h| Tree::depth(h, chain)).collect();
                        if exact {
                            assert!(
                                depths.contains(&got),
                                "worker {v} answered at {got} on chain {:?}; between events {} and {} it was at {depths:?}; events {:?}",
                                i % tree.chains.len(),
                                before[v],
                                after[v],
                                &plan.0[before[v].saturating_sub(3)..(after[v] + 1).min(plan.0.len())]
                            );
                        } else {
                            let (lo, hi) = (depths.iter().min().copied(), depths.iter().max().copied());
                            assert!(lo <= Some(got) && Some(got) <= hi, "worker {v} answered at {got}, its states {depths:?}");
                        }
                    }
                    checked.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    assert!(checked.load(Ordering::SeqCst) >= tree.chains.len() * 6);
    // Quiet again: every worker at its last state, exactly.
    for chain in &tree.chains {
        let q: Vec<LocalHash> = chain.iter().map(|&n| LocalHash(tree.nodes[n].1)).collect();
        let answer = index.find_matches(&q, &MatchOptions::default());
        for (v, plan) in plans.iter().enumerate() {
            let got = answer.iter().find(|m| m.worker == worker(v)).map_or(0, |m| m.blocks);
            assert_eq!(got, Tree::depth(plan.1.last().expect("a state"), chain), "at rest: worker {v}");
        }
    }
}

#[test]
fn run_index_answers_each_worker_in_one_of_its_states() {
    // Dense from two holders: runs change form all the time.
    race(RunIndex::new(RunConfig { dense_at: 2, ..RunConfig::default() }), true);
}

#[test]
fn run_index_answers_exactly_with_list_covers_only() {
    race(RunIndex::new(RunConfig { dense_at: u32::MAX, ..RunConfig::default() }), true);
}

/// The positional backend keeps a weaker promise: each answer lies between the worker's
/// states around the lookup (it reads a worker's positions under separate chunk locks).
#[test]
fn positional_index_answers_lie_between_the_states_of_each_worker() {
    race(PositionalIndex::default(), false);
}
