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
mod writer;

pub use writer::RunWriter;

use super::{candidate_slots, DepthGroups, IndexError, IndexStats, KvIndex, MatchOptions, Saved, WorkerMatch};
use crate::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use crate::workers::{Slot, SlotBits, WorkerRegistry};
use cover::{Cover, Dense, List};
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
    /// Most blocks one worker holds (engine hashes in its writer): a store past it is cut
    /// short and the rest counted as [`ApplyOutcome::over_limit`], so one publisher cannot
    /// grow the index without bound.
    pub max_blocks_per_worker: u64,
    /// Workers holding a run before its coverage turns dense, a cutoff per slot (and half as
    /// many to turn back), if they are also a sixteenth of the fleet: a dense cover costs four
    /// bytes a slot of the fleet. A setting so that tests can make runs switch forms often.
    pub dense_at: u32,
}

/// Blocks a worker may hold by default: a large engine's device and host caches together.
pub const MAX_BLOCKS_PER_WORKER: u64 = 1 << 23;

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { max_depth: 1 << 16, max_workers: 1 << 16, max_blocks_per_worker: MAX_BLOCKS_PER_WORKER, dense_at: 32 }
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
            // Who holds how much of the run: those holding fewer than `k` blocks end here, those
            // holding none where it starts.
            s.next.clear_to(width);
            let mut ended = s.spare.pop().unwrap_or_default();
            ended.clear_to(width);
            s.cuts.clear();
            run.prefetch_hashes(guard);
            let k = match run.cover(guard) {
                Cover::List(l) => step_list(l, run, &q[pos..], pos, s, &mut ended, guard),
                Cover::Dense(d) => step_dense(d, run, &q[pos..], pos, s, &mut ended, guard),
            };
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

    /// The answer from the walk's ends, grouped by depth into `out`: every worker, or the
    /// `limit` deepest. A set tied at the cut gives the members a rotation picks
    /// ([`super::rotation`]), so a thousand workers tied at the depth of a shared system prompt
    /// cost the few the answer keeps, and not the same few every time. Slots map to workers
    /// here, while the lookup is still pinned: a slot met in the walk has no new owner yet.
    fn collect(&self, s: &mut Scratch, limit: Option<usize>, out: &mut DepthGroups) {
        out.clear();
        s.out.sort_unstable_by_key(|x| std::cmp::Reverse(x.1));
        s.groups.sort_unstable_by_key(|g| std::cmp::Reverse(g.0));
        let reg = &self.registry;
        let mut room = limit.unwrap_or(usize::MAX);
        let (mut i, mut j) = (0, 0);
        while room > 0 {
            let d = match (s.out.get(i), s.groups.get(j)) {
                (Some(a), Some(g)) => a.1.max(g.0),
                (Some(a), None) => a.1,
                (None, Some(g)) => g.0,
                (None, None) => break,
            };
            let singles = s.out[i..].iter().take_while(|x| x.1 == d).count();
            let sets = s.groups[j..].iter().take_while(|g| g.0 == d).count();
            let (ones, sets_here) = (&s.out[i..i + singles], &s.groups[j..j + sets]);
            let here = singles + sets_here.iter().map(|(_, g)| g.len()).sum::<usize>();
            if here <= room {
                for &(slot, _) in ones {
                    if let Some(w) = reg.worker(slot) {
                        out.push_worker(w);
                    }
                }
                for (_, g) in sets_here {
                    reg.name_each(g, |w| out.push_worker(w));
                }
                out.close_group(d);
                room -= here;
            } else {
                let mut tied = s.spare.pop().unwrap_or_default();
                tied.clear_to(sets_here.iter().map(|(_, g)| g.words().len()).max().unwrap_or(0));
                ones.iter().for_each(|&(slot, _)| tied.insert(slot));
                for (_, g) in sets_here {
                    for (t, &w) in tied.words_mut().iter_mut().zip(g.words()) {
                        *t |= w;
                    }
                }
                let start = super::rotation(tied.len(), room);
                tied.each_from_rank(start, room, |slot| {
                    if let Some(w) = reg.worker(slot) {
                        out.push_worker(w);
                    }
                });
                out.close_group(d);
                out.set_cut();
                s.spare.push(tied);
                break;
            }
            i += singles;
            j += sets;
        }
    }

    /// Every match of one lookup as slots, deepest first, given to `f` while the lookup is
    /// still pinned (`opts.max_matches` is not applied): for callers that name workers
    /// themselves through [`SlotAnswer::worker`], or only count them. A thousand workers tied
    /// at one depth are one set of slots here, named only if the caller asks.
    pub fn with_every_match<R>(&self, query: &[LocalHash], opts: &MatchOptions, f: impl FnOnce(&SlotAnswer<'_>) -> R) -> R {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.reset();
            let guard = epoch::pin();
            if n > 0 {
                candidate_slots(&self.registry, opts, &mut s.alive);
                self.walk(&query[..n], &mut s, &guard);
            }
            s.out.sort_unstable_by_key(|x| std::cmp::Reverse(x.1));
            s.groups.sort_unstable_by_key(|g| std::cmp::Reverse(g.0));
            let answer = SlotAnswer { singles: &s.out, sets: &s.groups, registry: &self.registry };
            let r = f(&answer);
            drop(guard);
            r
        })
    }

    /// One lookup into `out`, pinned from the walk to the naming of its workers.
    fn lookup(&self, query: &[LocalHash], opts: &MatchOptions, out: &mut DepthGroups) {
        out.clear();
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        if n == 0 {
            return;
        }
        SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            s.reset();
            // Pinned before the filter names its slots: none of them changes owner until the end.
            let guard = epoch::pin();
            candidate_slots(&self.registry, opts, &mut s.alive);
            self.walk(&query[..n], &mut s, &guard);
            self.collect(&mut s, opts.max_matches, out);
            drop(guard);
        })
    }
}

/// Every match of one lookup as the walk leaves it, slots by depth (see
/// [`RunIndex::with_every_match`]); valid while the lookup that made it is pinned.
pub struct SlotAnswer<'a> {
    /// Workers whose match ended on their own, deepest first.
    singles: &'a [(Slot, u32)],
    /// Sets of workers whose match ended together, deepest first.
    sets: &'a [(u32, SlotBits)],
    /// Names slots.
    registry: &'a WorkerRegistry,
}

impl SlotAnswer<'_> {
    /// Calls `f(depth, slot)` for every match, deepest first.
    pub fn for_each(&self, mut f: impl FnMut(u32, Slot)) {
        let (mut i, mut j) = (0, 0);
        loop {
            let single = self.singles.get(i).filter(|x| self.sets.get(j).is_none_or(|g| x.1 >= g.0));
            if let Some(&(slot, d)) = single {
                f(d, slot);
                i += 1;
                continue;
            }
            let Some((d, set)) = self.sets.get(j) else { return };
            for (w, &word) in set.words().iter().enumerate() {
                let mut m = word;
                while m != 0 {
                    f(*d, (w * 64) as Slot + m.trailing_zeros());
                    m &= m - 1;
                }
            }
            j += 1;
        }
    }

    /// Matches in all.
    pub fn len(&self) -> usize {
        self.singles.len() + self.sets.iter().map(|(_, s)| s.len()).sum::<usize>()
    }

    /// No match.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The worker that held `slot` in this answer (`None` if it has left since).
    pub fn worker(&self, slot: Slot) -> Option<WorkerId> {
        self.registry.worker(slot)
    }
}

/// How many leading hashes of `run` equal the query's.
#[inline]
fn common_len(run: impl AsRef<[u64]>, q: &[LocalHash]) -> usize {
    let run = run.as_ref();
    let n = run.len().min(q.len());
    // Eight at a time without a branch per hash (the compiler compares them as vectors), then
    // one by one in the chunk that differs.
    let mut i = 0;
    while i + 8 <= n {
        let same = run[i..i + 8].iter().zip(&q[i..i + 8]).fold(true, |all, (a, b)| all & (*a == b.0));
        if !same {
            break;
        }
        i += 8;
    }
    i + run[i..n].iter().zip(&q[i..n]).take_while(|(a, b)| **a == b.0).count()
}

/// One step of the walk through a run covered by a list of holders: each alive holder goes on
/// (`s.next`), ends inside the run (`s.out`, at its depth) or ends where the run starts
/// (`ended`); returns the run's match length `k` with `rest` (the query from `pos` on).
///
/// A list is read before the hashes: a writer appends a run's hashes before it publishes a
/// cutoff over them, so no cutoff read here reaches past the hashes read after it. One pass
/// uses the match length of the hashes read first; a cutoff past them (a writer appended and
/// published since) would need hashes read after it: then, rarely, the run is read again,
/// coverage first.
#[inline(always)]
fn step_list(l: &List, run: &Run, rest: &[LocalHash], pos: usize, s: &mut Scratch, ended: &mut SlotBits, guard: &Guard) -> usize {
    let width = s.alive.words().len();
    let hashes = run.hashes(guard);
    let (seen_len, k0) = (hashes.len(), common_len(hashes, rest));
    let outs = s.out.len();
    s.seen.clear_to(width);
    let mut past = false;
    let (alive, seen, next, out) = (&s.alive, &mut s.seen, &mut s.next, &mut s.out);
    l.scan(|slot, cut| {
        if alive.contains(slot) && !seen.contains(slot) {
            seen.insert(slot);
            past |= cut as usize > seen_len;
            if cut as usize >= k0 {
                next.insert(slot);
            } else {
                out.push((slot, (pos + cut as usize) as u32));
            }
        }
    });
    let k = if past && k0 == seen_len { list_again(l, run, rest, pos, outs, s, guard) } else { k0 };
    for ((e, &a), &h) in ended.words_mut().iter_mut().zip(s.alive.words()).zip(s.seen.words()) {
        *e = a & !h;
    }
    k
}

/// [`step_list`]'s second reading of a run a writer appended to meanwhile: what the first
/// pass put out after `outs` is taken back, then the holders' cutoffs are read first and the
/// hashes after them, which now reach every cutoff read.
#[cold]
fn list_again(l: &List, run: &Run, rest: &[LocalHash], pos: usize, outs: usize, s: &mut Scratch, guard: &Guard) -> usize {
    let width = s.alive.words().len();
    s.out.truncate(outs);
    s.next.clear_to(width);
    s.seen.clear_to(width);
    let (alive, seen, cuts) = (&s.alive, &mut s.seen, &mut s.cuts);
    l.scan(|slot, cut| {
        if alive.contains(slot) && !seen.contains(slot) {
            seen.insert(slot);
            cuts.push((slot, cut));
        }
    });
    let k = common_len(run.hashes(guard), rest);
    for &(slot, cut) in &s.cuts {
        if cut as usize >= k {
            s.next.insert(slot);
        } else {
            s.out.push((slot, (pos + cut as usize) as u32));
        }
    }
    k
}

/// One step of the walk through a run covered densely (a cutoff per slot): as [`step_list`].
/// A dense cover takes no appends and was made from hashes at least as long as its length,
/// published before it: hashes read now reach every cutoff in it, so the match length is
/// known before the cutoffs are read.
#[inline(always)]
fn step_dense(
    d: &Dense,
    run: &Run,
    rest: &[LocalHash],
    pos: usize,
    s: &mut Scratch,
    ended: &mut SlotBits,
    guard: &Guard,
) -> usize {
    let k = common_len(run.hashes(guard), rest);
    let (len, full_goes_on) = (d.len() as usize, d.len() as usize >= k);
    // Leaving the run into a child inside it: the holders reaching the child's offset, a word
    // at a time, from its mark.
    let mark = if k < len { d.find_mark(k as u32) } else { None };
    let (next, ends) = (s.next.words_mut(), ended.words_mut());
    for (i, &a) in s.alive.words().iter().enumerate() {
        if a == 0 {
            continue;
        }
        let (h, f) = d.bits(i);
        let (h, f) = (h & a, f & a);
        let (mut goes, mut end) = (0, a & !h);
        if full_goes_on {
            goes = f;
        } else {
            let mut full = f;
            while full != 0 {
                s.out.push(((i * 64) as Slot + full.trailing_zeros(), (pos + len) as u32));
                full &= full - 1;
            }
        }
        if let Some(m) = mark {
            goes |= d.mark_word(m, i) & h;
        }
        let mut rest_bits = h & !f & !goes;
        while rest_bits != 0 {
            let b = rest_bits.trailing_zeros();
            rest_bits &= rest_bits - 1;
            let slot = (i * 64) as Slot + b;
            match d.cut(slot) as usize {
                0 => end |= 1 << b,
                c if c >= k => goes |= 1 << b,
                c => s.out.push((slot, (pos + c) as u32)),
            }
        }
        next[i] = goes;
        ends[i] = end;
    }
    k
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
    /// The current run's `(slot, cutoff)` of the workers read one by one, before they are
    /// compared with the hashes.
    cuts: Vec<(Slot, u32)>,
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

#[cfg(not(loom))]
thread_local! {
    /// A lookup's working sets, reused by the thread's next lookup.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// A flat lookup's groups before they are flattened.
    static GROUPED: RefCell<DepthGroups> = RefCell::new(DepthGroups::default());
}

#[cfg(loom)]
loom::thread_local! {
    /// A lookup's working sets, per model thread.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// A flat lookup's groups, per model thread.
    static GROUPED: RefCell<DepthGroups> = RefCell::new(DepthGroups::default());
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
        GROUPED.with(|g| {
            let mut g = g.borrow_mut();
            self.lookup(query, opts, &mut g);
            g.to_matches()
        })
    }

    fn find_grouped(&self, query: &[LocalHash], opts: &MatchOptions, out: &mut DepthGroups) {
        self.lookup(query, opts, out);
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

    fn digest(&self, w: &RunWriter) -> crate::digest::Digest {
        w.digest()
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

/// A dense cover read by the walk's own step ([`step_dense`]) while its writer changes a
/// worker's cutoff: the step ends the worker, puts it out at its cutoff or takes it on, and
/// that must be one of the worker's states while the read ran.
#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::AtomicU32;
    use loom::sync::Arc;

    /// Worker 0's cutoff in a dense run of 5 blocks, step by step: it joins holding 3, holds
    /// all 5, drops to 2, leaves, and joins again holding all 5.
    const DENSE: [u32; 6] = [0, 3, 5, 2, 0, 5];

    #[test]
    fn a_walk_through_a_dense_cover_sees_one_of_the_worker_s_states() {
        loom::model(|| {
            let d = Arc::new(Dense::empty(5, 64));
            let step = Arc::new(AtomicU32::new(0));
            let writer = {
                let (d, step) = (d.clone(), step.clone());
                loom::thread::spawn(move || {
                    for n in 1..DENSE.len() {
                        d.set(0, DENSE[n - 1], DENSE[n]);
                        step.store(n as u32, std::sync::atomic::Ordering::SeqCst);
                    }
                })
            };
            let locals = 1..=5u64;
            let run = Run::new(1, ROOT, 0, 0, Some(Hashes::new(locals.clone(), 5)));
            let query: Vec<LocalHash> = locals.map(LocalHash).collect();
            let mut s = Scratch::default();
            s.alive.fill(1);
            s.next = SlotBits::with_width(1);
            let mut ended = SlotBits::with_width(1);
            let guard = epoch::pin();
            let before = step.load(std::sync::atomic::Ordering::SeqCst) as usize;
            let k = step_dense(&d, &run, &query, 0, &mut s, &mut ended, &guard);
            let after = (step.load(std::sync::atomic::Ordering::SeqCst) as usize + 1).min(DENSE.len() - 1);
            // Taken on past the run's end: it held all of it; put out: at its cutoff; ended: none.
            let got = match (s.next.contains(0), s.out.iter().find(|(slot, _)| *slot == 0), ended.contains(0)) {
                (true, None, false) => k as u32,
                (false, Some(&(_, depth)), false) => depth,
                (false, None, true) => 0,
                other => panic!("worker 0 came out of the step as {other:?}"),
            };
            assert!(
                DENSE[before..=after].contains(&got),
                "saw cutoff {got}; its states from step {before} to {after} were {:?}",
                &DENSE[before..=after]
            );
            drop(guard);
            writer.join().expect("writer");
        });
    }
}
