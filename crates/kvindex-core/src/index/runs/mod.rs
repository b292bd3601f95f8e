//! The run index (the default backend): a tree of runs, each a stretch of one chain stored
//! once however many workers hold it, with one coverage word per holding worker.
//!
//! - **A run** holds the local hashes of consecutive blocks of one chain. A run's children
//!   continue it with other blocks: each hangs at the offset where it diverges (any offset, so a
//!   chain that branches inside a run never splits it) and is keyed there by its first hash. A
//!   block's place is its path from the root, so two prefixes match only if every local hash
//!   on them does: collisions under another parent and aliases cannot give a wrong depth.
//! - **Coverage** is a cutoff per worker and run: the worker holds the run's first `cut` blocks.
//!   A worker holding a run only in part is one word, not a split; a removal in the middle of a
//!   run (a hole) lowers the worker's cutoff there and keeps the blocks past it in the writer's
//!   private state, hidden, until the hole is filled again. A lookup intersects workers run by
//!   run along the path, so a hole hides everything under it without touching any other run.
//! - **Writes**: a store walks from its parent block's place comparing local hashes, joins the
//!   runs already there (one coverage word per run, not per block), and appends the rest to the
//!   run it ends in (when it ends there) or opens a child run. The only per-block work is the
//!   writer's own map from engine hash to place. Each run has a lock that writers take to change
//!   it; one apply thread owns each worker's writer.
//! - **Reads** take no lock and never wait: a worker's state in a run is one atomic word, hash
//!   arrays are append-only below their published length, and whatever is replaced (a grown
//!   array, a dead run) is retired to `crossbeam-epoch`'s collector, so memory a lookup may
//!   still read is never freed under it (see [`cover`] for the protocol and its loom model).
//! - **Runs die** when no worker holds any of their blocks and no child hangs off them; their
//!   ids are reused and their memory goes back through the collector, so memory follows what
//!   is cached, not what ever was.

mod blockmap;
mod cover;
mod held;
mod shared;
mod slab;
mod sync;
mod writer;

pub use writer::RunWriter;

use super::{candidate_slots, finish_matches, IndexError, IndexStats, KvIndex, MatchOptions, Saved, WorkerMatch};
use crate::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use crate::workers::{Slot, SlotBits, WorkerRegistry};
use cover::Cover;
use crossbeam_epoch::{self as epoch, Guard};
use shared::{Hashes, Run, ROOT};
use slab::Slab;
use std::cell::RefCell;
use std::sync::atomic::{AtomicI64, Ordering};

/// Limits of the run index.
#[derive(Clone, Copy, Debug)]
pub struct RunConfig {
    /// Deepest position accepted (blocks beyond are rejected as too deep).
    pub max_depth: u32,
    /// Most workers (worker id, dp rank) held at once.
    pub max_workers: u32,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { max_depth: 1 << 16, max_workers: 1 << 16 }
    }
}

/// The run backend.
pub struct RunIndex {
    /// Its limits.
    cfg: RunConfig,
    /// Worker identities and their slots, which coverage words carry.
    registry: WorkerRegistry,
    /// Every run, the root first.
    slab: Slab,
    /// Keys child tables (publishers choose the hashes they are keyed by).
    seed: u64,
    /// (worker, engine hash) placements: the sum of the writers' map sizes.
    placements: AtomicI64,
    /// Local hashes held by live runs.
    blocks: AtomicI64,
    /// Placements past a hole in their run.
    hidden: AtomicI64,
}

impl Default for RunIndex {
    fn default() -> Self {
        RunIndex::new(RunConfig::default())
    }
}

impl RunIndex {
    /// An empty index.
    pub fn new(cfg: RunConfig) -> Self {
        let slab = Slab::new();
        let id = slab.alloc_id();
        debug_assert_eq!(id, Some(ROOT));
        slab.publish(Box::new(Run::new(ROOT, ROOT, 0, 0, None)), &epoch::pin());
        RunIndex {
            cfg,
            registry: WorkerRegistry::new(cfg.max_workers),
            slab,
            seed: crate::seeded::process_seed(),
            placements: AtomicI64::new(0),
            blocks: AtomicI64::new(0),
            hidden: AtomicI64::new(0),
        }
    }

    /// The root run.
    fn root<'g>(&self, guard: &'g Guard) -> &'g Run {
        match self.slab.get(ROOT, guard) {
            Some(r) => r,
            None => unreachable!("the root is published at creation and never taken out"),
        }
    }

    /// Heap bytes of the runs (not the writers' maps), walking every run: for tests.
    pub fn run_bytes(&self) -> usize {
        let guard = epoch::pin();
        self.slab.each(&guard).map(|r| r.heap_bytes(&guard)).sum()
    }

    /// The lookup walk: `s.alive` starts as the candidates; the workers whose match ends go
    /// to `s.out` one by one (`(slot, depth)`) or to `s.groups` as sets ending at one depth.
    fn walk(&self, q: &[LocalHash], s: &mut Scratch, guard: &Guard) {
        let Some(mut run) = self.root(guard).child(0, q[0].0, self.seed, guard) else { return };
        let mut pos = 0usize;
        let width = s.alive.words().len();
        loop {
            let k = common_len(run.hashes(guard), &q[pos..]);
            // Who holds how much of the run: those holding fewer than `k` blocks end here, those
            // holding none where it starts.
            s.next.clear_to(width);
            let mut ended = s.spare.pop().unwrap_or_default();
            ended.clear_to(width);
            match run.cover(guard) {
                Cover::List(l) => {
                    s.seen.clear_to(width);
                    let (alive, next, seen, out) = (&s.alive, &mut s.next, &mut s.seen, &mut s.out);
                    l.scan(|slot, cut| {
                        if !alive.contains(slot) || seen.contains(slot) {
                            return;
                        }
                        seen.insert(slot);
                        if cut as usize >= k {
                            next.insert(slot);
                        } else {
                            out.push((slot, (pos + cut as usize) as u32));
                        }
                    });
                    for ((e, &a), &h) in ended.words_mut().iter_mut().zip(s.alive.words()).zip(s.seen.words()) {
                        *e = a & !h;
                    }
                }
                Cover::Dense(d) => {
                    let full_goes_on = d.len() as usize >= k;
                    let next = s.next.words_mut();
                    for (i, (&a, e)) in s.alive.words().iter().zip(ended.words_mut()).enumerate() {
                        if a == 0 {
                            continue;
                        }
                        let (h, f) = d.bits(i);
                        let (h, f) = (h & a, if full_goes_on { f & a } else { 0 });
                        let mut ends = a & !h;
                        let mut goes = f;
                        let mut rest = h & !f;
                        while rest != 0 {
                            let b = rest.trailing_zeros();
                            rest &= rest - 1;
                            let slot = (i * 64) as Slot + b;
                            match d.cut(slot) {
                                0 => ends |= 1 << b,
                                c if c as usize >= k => goes |= 1 << b,
                                c => s.out.push((slot, (pos + c as usize) as u32)),
                            }
                        }
                        *e = ends;
                        next[i] = goes;
                    }
                }
            }
            s.end(pos, ended);
            std::mem::swap(&mut s.alive, &mut s.next);
            pos += k;
            if s.alive.is_empty() {
                return;
            }
            let next = if pos < q.len() { run.child(k as u32, q[pos].0, self.seed, guard) } else { None };
            match next {
                Some(c) => run = c,
                None => {
                    let mut last = s.spare.pop().unwrap_or_default();
                    last.copy_from(&s.alive);
                    s.end(pos, last);
                    return;
                }
            }
        }
    }

    /// The answer from the walk's ends: every worker, or the `limit` deepest (ties by worker
    /// id). A set tied at the cut is read in worker order, so a thousand workers tied at the
    /// depth of a shared system prompt cost the few the answer keeps, not a sort of them all.
    fn answer(&self, s: &mut Scratch, limit: Option<usize>) -> Vec<WorkerMatch> {
        let total = s.out.len() + s.groups.iter().map(|(_, g)| g.len()).sum::<usize>();
        let Some(limit) = limit.filter(|&l| l < total) else {
            for (d, g) in &s.groups {
                s.out.extend(g.iter().map(|slot| (slot, *d)));
            }
            return finish_matches(&self.registry, &s.out, limit);
        };
        s.out.sort_unstable_by_key(|x| std::cmp::Reverse(x.1));
        s.groups.sort_unstable_by_key(|g| std::cmp::Reverse(g.0));
        let mut chosen: Vec<(Slot, u32)> = Vec::with_capacity(limit);
        let (mut i, mut j) = (0, 0);
        while chosen.len() < limit {
            let d = match (s.out.get(i), s.groups.get(j)) {
                (Some(a), Some(g)) => a.1.max(g.0),
                (Some(a), None) => a.1,
                (None, Some(g)) => g.0,
                (None, None) => break,
            };
            let singles = s.out[i..].iter().take_while(|x| x.1 == d).count();
            let sets = s.groups[j..].iter().take_while(|g| g.0 == d).count();
            let here = singles + s.groups[j..j + sets].iter().map(|(_, g)| g.len()).sum::<usize>();
            if chosen.len() + here <= limit {
                chosen.extend_from_slice(&s.out[i..i + singles]);
                for (_, g) in &s.groups[j..j + sets] {
                    chosen.extend(g.iter().map(|slot| (slot, d)));
                }
            } else {
                // The cut falls in this depth: keep its lowest worker ids.
                let mut tied = s.spare.pop().unwrap_or_default();
                tied.clear();
                s.out[i..i + singles].iter().for_each(|&(slot, _)| tied.insert(slot));
                for (_, g) in &s.groups[j..j + sets] {
                    for (t, &w) in tied.words_mut().iter_mut().zip(g.words()) {
                        *t |= w;
                    }
                    if g.words().len() > tied.words().len() {
                        g.iter().for_each(|slot| tied.insert(slot));
                    }
                }
                let want = limit - chosen.len();
                self.registry.with_order(|order| {
                    chosen.extend(order.iter().filter(|&&slot| tied.contains(slot)).take(want).map(|&slot| (slot, d)));
                });
                s.spare.push(tied);
                break;
            }
            i += singles;
            j += sets;
        }
        finish_matches(&self.registry, &chosen, Some(limit))
    }
}

/// How many leading hashes of `run` equal the query's.
#[inline]
fn common_len(run: &[u64], q: &[LocalHash]) -> usize {
    run.iter().zip(q).take_while(|(a, b)| **a == b.0).count()
}

/// A lookup's working sets, reused across lookups on a thread.
#[derive(Default)]
struct Scratch {
    /// Workers still matching.
    alive: SlotBits,
    /// Those of them holding the current run to where the query leaves it.
    next: SlotBits,
    /// Those of them with a coverage word in the current run.
    seen: SlotBits,
    /// `(slot, depth)` of workers whose match ended on their own.
    out: Vec<(Slot, u32)>,
    /// Sets of workers whose match ended together, with the depth.
    groups: Vec<(u32, SlotBits)>,
    /// Sets to reuse.
    spare: Vec<SlotBits>,
}

impl Scratch {
    /// Starts a lookup.
    fn reset(&mut self) {
        self.out.clear();
        let groups = std::mem::take(&mut self.groups);
        self.spare.extend(groups.into_iter().map(|(_, g)| g));
    }

    /// The workers of `set` end at `depth` (at depth 0 they held nothing: no answer).
    fn end(&mut self, depth: usize, set: SlotBits) {
        if depth > 0 && !set.is_empty() {
            self.groups.push((depth as u32, set));
        } else {
            self.spare.push(set);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl KvIndex for RunIndex {
    type Writer = RunWriter;

    fn name(&self) -> &'static str {
        "runs"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<RunWriter, IndexError> {
        let slot = self.registry.intern(worker)?;
        Ok(RunWriter::new(worker, slot))
    }

    fn worker_id(w: &RunWriter) -> WorkerId {
        w.worker
    }

    fn store(&self, w: &mut RunWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> super::ApplyOutcome {
        self.store_chain(w, parent, blocks)
    }

    fn remove(&self, w: &mut RunWriter, hashes: &[BlockHash]) -> super::ApplyOutcome {
        self.remove_blocks(w, hashes)
    }

    fn clear(&self, w: &mut RunWriter) -> super::ApplyOutcome {
        self.clear_worker(w)
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        if n == 0 {
            return Vec::new();
        }
        SCRATCH.with_borrow_mut(|s| {
            s.reset();
            candidate_slots(&self.registry, opts, &mut s.alive);
            let guard = epoch::pin();
            self.walk(&query[..n], s, &guard);
            drop(guard);
            self.answer(s, opts.max_matches)
        })
    }

    /// Writes apply on the caller's thread; what they retired (replaced arrays, dead runs) is
    /// freed here once no lookup in flight can still read it, so memory readings that follow
    /// are exact. The collector frees a few batches a call: this calls it until the thread's
    /// garbage has had every chance to go.
    fn settle(&self) {
        for _ in 0..SETTLE_ROUNDS {
            epoch::pin().flush();
        }
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            placements: self.placements.load(Ordering::Relaxed).max(0) as u64,
            entries: self.blocks.load(Ordering::Relaxed).max(0) as u64,
            workers: self.registry.len() as u64,
            hidden: self.hidden.load(Ordering::Relaxed).max(0) as u64,
        }
    }

    fn save(&self, w: &RunWriter) -> Saved {
        self.save_worker(w)
    }

    fn held(&self, w: &RunWriter) -> u64 {
        w.held()
    }

    fn restore(&self, w: &mut RunWriter, saved: &Saved) -> super::ApplyOutcome {
        self.restore_worker(w, saved)
    }
}

/// Collector calls [`RunIndex::settle`] makes: each frees up to eight batches of 64 retired
/// objects, and a churn pass retires a few thousand.
const SETTLE_ROUNDS: usize = 2048;

/// The hash array of a new run: exactly its blocks (an append grows it by doubling).
fn new_hashes(blocks: &[StoredBlock]) -> Hashes {
    Hashes::new(blocks.iter().map(|b| b.tokens_hash.0), blocks.len())
}
