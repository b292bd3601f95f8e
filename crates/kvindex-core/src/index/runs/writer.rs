//! The write side of the run index: a worker's private state and the walks that store and
//! remove its blocks.
//!
//! A worker's writer owns everything about the worker that lookups do not read: its map from
//! engine hash to place (the only per-block work of a write), its state in each run it holds
//! blocks in (cutoff, hidden blocks), the places it holds under more than one engine hash, and
//! its blocks past the depth limit. The shared runs change only under their own locks, one at a
//! time: a writer never holds two run locks except while linking a run no one else can reach.
//!
//! # What a lookup sees of a worker
//!
//! A lookup reads a worker's coverage words run after run down the query's path, each at a
//! different instant. Each event is published so that whatever instants those are, the lookup
//! finds the worker's depth in the state before the event or in the state after it, never a
//! mix (the guarantee of [`crate::index`]):
//!
//! - an event first changes the writer's private state, then publishes (`sync`): cutoffs that
//!   go down from the top of the tree down, then cutoffs that go up from the bottom up, so a
//!   path's depth changes at one word: the highest run of the path the event lowers, or the
//!   highest it raises (which makes the runs below it, written before, reachable at once);
//! - a run is shown only where the worker holds its whole path (`Mine::reach`): blocks stored
//!   under a block the worker no longer holds stay private until the hole is filled;
//! - a run that loses `reach` keeps its published cutoff until every lookup that may have
//!   reached it through the old path is over (a grace period of the epoch collector), then it
//!   is withdrawn: a lookup that read the parent before the change reads the child as it was.

use super::blockmap::BlockMap;
use super::cover::{Cover, Dense};
use super::held::{Hidden, Mine};
use super::shared::{Children, Meta, Run, RunId, ROOT};
use super::{new_hashes, RunIndex};
use crate::hash::{BlockHash, StoredBlock, WorkerId};
use crate::index::linear::LinearMap;
use crate::index::{ApplyOutcome, Beyond, Saved, SavedBlock, SavedParent};
use crate::seeded::SeededMap;
use crate::sync::{Arc, AtomicBool, MutexGuard, Ordering};
use crate::workers::Slot;
use crossbeam_epoch::{self as epoch, Guard, Owned, Shared};
use smallvec::SmallVec;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// How many blocks ahead a write prefetches the map slot of the block it will come to: a
/// worker's map is too big to stay in cache between its events.
const AHEAD: usize = 8;

/// A block's place: its run's id (high half) and its offset in the run (low half).
type Place = u64;

#[inline]
fn place(run: RunId, off: u32) -> Place {
    (u64::from(run) << 32) | u64::from(off)
}

#[inline]
fn unplace(p: Place) -> (RunId, u32) {
    ((p >> 32) as RunId, p as u32)
}

/// A worker's write state; one thread at a time owns it (an apply thread, in the daemon).
pub struct RunWriter {
    /// The worker.
    pub(crate) worker: WorkerId,
    /// Its slot: the number its coverage words carry.
    slot: Slot,
    /// Engine hash -> the place of the block: what `removed` events name blocks by.
    blocks: BlockMap,
    /// Run id -> its state there, for every run it holds a block in.
    runs: LinearMap<Mine>,
    /// Run id -> its hidden intervals, for the runs where it has a hole.
    hidden: SeededMap<RunId, Hidden>,
    /// Place -> engine hashes it holds there beyond the first (an engine naming one block twice):
    /// the place stays held until the last of them goes.
    aliases: LinearMap<u32>,
    /// Engine hashes of its blocks past the depth limit.
    beyond: Beyond,
    /// Places given up by a store (engine hashes stored again elsewhere), let go after it.
    moved: Vec<Place>,
    /// Run -> the runs hanging under it where the worker has state: what a change of its
    /// cutoff there shows or hides.
    kids: SeededMap<RunId, SmallVec<[RunId; 2]>>,
    /// Runs whose private state the event being applied changed: published at its end.
    touched: Vec<RunId>,
    /// Runs that lost `reach` with a cutoff still shown (`Mine::frozen`), to withdraw once
    /// their grace period is over (stale entries are skipped).
    frozen: Vec<RunId>,
    /// Grace periods asked for, oldest first: the generation, and whether it is over (set by
    /// the epoch collector once every lookup pinned before it asked has finished).
    graces: VecDeque<(u32, Arc<AtomicBool>)>,
    /// The last grace generation asked for.
    gen: u32,
    /// `sync`'s scratch, kept to reuse the allocations.
    scratch: SyncScratch,
}

/// The working lists of one `sync`.
#[derive(Default)]
struct SyncScratch {
    /// Runs to look at, top of the tree first: (start position, run).
    todo: BinaryHeap<Reverse<(u32, RunId)>>,
    /// Runs looked at.
    seen: Vec<RunId>,
    /// Runs whose shown cutoff goes down, top first.
    lower: Vec<RunId>,
    /// Runs whose shown cutoff goes up, top first (published in reverse).
    raise: Vec<RunId>,
}

impl RunWriter {
    pub(super) fn new(worker: WorkerId, slot: Slot) -> Self {
        RunWriter {
            worker,
            slot,
            blocks: BlockMap::default(),
            runs: LinearMap::default(),
            hidden: SeededMap::default(),
            aliases: LinearMap::default(),
            beyond: Beyond::default(),
            moved: Vec::new(),
            kids: SeededMap::default(),
            touched: Vec::new(),
            frozen: Vec::new(),
            graces: VecDeque::new(),
            gen: 0,
            scratch: SyncScratch::default(),
        }
    }

    /// Engine hashes it holds.
    pub(super) fn held(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// The digest of the engine hashes held, placed or past the depth limit.
    pub(super) fn digest(&self) -> crate::digest::Digest {
        self.blocks.digest().join(self.beyond.digest())
    }

    /// One more engine hash holds `p` (it was held already).
    fn alias_add(&mut self, p: Place) {
        *self.aliases.upsert(p, 0).0 += 1;
    }

    /// If another engine hash still holds `p`, counts one fewer and says so: the place stays.
    #[inline]
    fn alias_drop(&mut self, p: Place) -> bool {
        !self.aliases.is_empty() && self.alias_drop_slow(p)
    }

    #[inline(never)]
    fn alias_drop_slow(&mut self, p: Place) -> bool {
        self.aliases
            .update_or_remove(p, |n| {
                *n -= 1;
                *n == 0
            })
            .is_some()
    }
}

/// Counters a write sums locally and adds to the index's once.
#[derive(Default)]
struct Delta {
    /// Change in (worker, engine hash) placements.
    placements: i64,
    /// Change in local hashes held by live runs (runs opened, appended to, killed).
    blocks: i64,
    /// Change in placements hidden past a hole.
    hidden: i64,
}

/// The run a walk was in died before the worker held a block of it: look again from the last
/// place the walk stood on.
struct Dead;

/// Removals of one run gathered before its coverage word is written once.
struct Batch {
    /// The run the removals are in.
    run: RunId,
    /// The worker's state there before them: what its coverage word says until the flush.
    before: Mine,
    /// Its state after the removals gathered so far.
    now: Mine,
}

impl RunIndex {
    /// Adds a write's counters to the index's.
    fn commit(&self, d: &Delta) {
        if d.placements != 0 {
            self.placements.fetch_add(d.placements, Ordering::Relaxed);
        }
        if d.blocks != 0 {
            self.blocks.fetch_add(d.blocks, Ordering::Relaxed);
        }
        if d.hidden != 0 {
            self.hidden.fetch_add(d.hidden, Ordering::Relaxed);
        }
    }

    /// The run of an id the writer holds blocks in (so it is alive).
    fn held_run<'g>(&self, id: RunId, guard: &'g Guard) -> &'g Run {
        match self.slab.get(id, guard) {
            Some(r) => r,
            None => unreachable!("run {id} is held by a writer, so it is alive"),
        }
    }

    pub(super) fn store_chain(&self, w: &mut RunWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        if blocks.is_empty() {
            return out;
        }
        self.thaw(w);
        let held = &w.blocks;
        let blocks = out.within_bound(blocks, held.len() as u64, self.cfg.max_blocks_per_worker, |h| held.get(h).is_some());
        if blocks.is_empty() {
            return out;
        }
        let guard = epoch::pin();
        let start = match parent {
            None => (self.root(&guard), 0),
            Some(h) => match w.blocks.get(h.0) {
                Some(p) => {
                    let (run, off) = unplace(p);
                    (self.held_run(run, &guard), off + 1)
                }
                None => {
                    w.beyond.orphan_store(h, blocks, &mut out);
                    return out;
                }
            },
        };
        let mut d = Delta::default();
        self.walk_store(w, start, blocks, &mut out, &mut d, &guard);
        self.let_go_moved(w, &mut d, &guard);
        self.sync(w, &mut d, &guard);
        self.commit(&d);
        out
    }

    /// Places `blocks` from `(run, off)` on: the walk compares them with the runs already
    /// there, joins those, and appends or opens a run for the rest. `(run, off)` is the root
    /// or a place right after a block the worker holds, so the run cannot die under the walk.
    fn walk_store<'g>(
        &self,
        w: &mut RunWriter,
        (mut run, mut off): (&'g Run, u32),
        blocks: &[StoredBlock],
        out: &mut ApplyOutcome,
        d: &mut Delta,
        guard: &'g Guard,
    ) {
        // Where the walk last stood on a place it holds (or the start): a child reached from
        // there that dies before the worker joins it sends the walk back.
        let mut anchor = (run, off);
        let mut i = 0;
        while i < blocks.len() {
            let pos = run.start + off;
            if pos >= self.cfg.max_depth {
                out.too_deep += w.beyond.add(&blocks[i..]);
                return;
            }
            let room = (self.cfg.max_depth - pos) as usize;
            let chunk = &blocks[i..blocks.len().min(i + room)];
            let hashes = run.hashes(guard);
            let m =
                hashes.get(off as usize..).map_or(0, |h| h.iter().zip(chunk).take_while(|(a, b)| **a == b.tokens_hash.0).count());
            if m > 0 {
                let meta = run.meta.lock();
                match self.place_locked(w, run, meta, off, &chunk[..m], out, d, guard) {
                    Ok(()) => {
                        i += m;
                        off += m as u32;
                        anchor = (run, off);
                    }
                    Err(Dead) => (run, off) = anchor,
                }
                continue;
            }
            let head = chunk[0].tokens_hash.0;
            if let Some(c) = run.child(off, head, self.seed, guard) {
                (run, off) = (c, 0);
                continue;
            }
            let mut meta = run.meta.lock();
            if meta.dead {
                drop(meta);
                (run, off) = anchor;
                continue;
            }
            // Another writer may have appended or linked the same block since the look above.
            let hashes = run.hashes(guard);
            if hashes.get(off as usize) == Some(&head) {
                continue;
            }
            if let Some(c) = run.child(off, head, self.seed, guard) {
                drop(meta);
                (run, off) = (c, 0);
                continue;
            }
            let dense = matches!(run.cover(guard), Cover::Dense(_));
            if run.id != ROOT && off as usize == hashes.len() && !dense {
                self.append_locked(run, chunk, guard);
                d.blocks += chunk.len() as i64;
                match self.place_locked(w, run, meta, off, chunk, out, d, guard) {
                    Ok(()) => {}
                    Err(Dead) => unreachable!("the run was locked and alive when the blocks were appended"),
                }
            } else {
                let Some(c) = self.open_child(run, off, chunk, guard) else {
                    // Every run id is taken: the blocks cannot be placed.
                    out.unplaceable += (blocks.len() - i) as u64;
                    return;
                };
                // The child is locked before it is linked, so it is joined before anyone can
                // reach it; the parent's lock goes first.
                let child_meta = c.meta.lock();
                self.link_child(run, &mut meta, c, head, guard);
                drop(meta);
                d.blocks += chunk.len() as i64;
                match self.place_locked(w, c, child_meta, 0, chunk, out, d, guard) {
                    Ok(()) => {}
                    Err(Dead) => unreachable!("a new run is joined before it is reachable"),
                }
                run = c;
                off = 0;
            }
            i += chunk.len();
            off += chunk.len() as u32;
            anchor = (run, off);
        }
    }

    /// Appends `blocks`' hashes to `run` (locked), growing its array if it is full.
    fn append_locked(&self, run: &Run, blocks: &[StoredBlock], guard: &Guard) {
        let locals = blocks.iter().map(|b| b.tokens_hash.0);
        // SAFETY: the run is locked: its array is not replaced meanwhile.
        let cur = unsafe { run.hashes.load(Ordering::Relaxed, guard).deref() };
        if cur.len() + blocks.len() <= cur.capacity() {
            cur.append(locals);
            return;
        }
        let want = cur.len() + blocks.len();
        let grown = cur.grown(want.max(cur.capacity() * 2));
        grown.append(locals);
        let old = run.hashes.swap(Owned::new(grown), Ordering::AcqRel, guard);
        // SAFETY: unpublished by the swap; lookups still reading it are waited for.
        unsafe { guard.defer_destroy(old) };
    }

    /// A new run of `blocks` diverging from `run` (locked) after `off` of its blocks, not yet
    /// linked; `None` when every run id is taken.
    fn open_child<'g>(&self, run: &Run, off: u32, blocks: &[StoredBlock], guard: &'g Guard) -> Option<&'g Run> {
        let id = self.slab.alloc_id()?;
        let c = Run::new(id, run.id, run.start + off, off, Some(new_hashes(blocks)));
        Some(self.slab.publish(Box::new(c), guard))
    }

    /// Links `child` under `run` (locked), growing its child table when needed.
    fn link_child(&self, run: &Run, meta: &mut Meta, child: &Run, head: u64, guard: &Guard) {
        let cur = run.children.load(Ordering::Relaxed, guard);
        // SAFETY: the run is locked: its table is not replaced meanwhile.
        let full = unsafe { cur.as_ref() }.is_none_or(|t| (meta.kids + meta.tombs + 1) as usize * 4 > t.capacity() * 3);
        if full {
            let cap = ((meta.kids as usize + 1) * 2).max(2);
            let table = match unsafe { cur.as_ref() } {
                Some(t) => t.rebuilt(cap, self.seed),
                None => Children::new(cap),
            };
            let old = run.children.swap(Owned::new(table), Ordering::AcqRel, guard);
            meta.tombs = 0;
            if !old.is_null() {
                // SAFETY: unpublished by the swap; lookups still reading it are waited for.
                unsafe { guard.defer_destroy(old) };
            }
        }
        // SAFETY: the run is locked and its table was just made non-null.
        if unsafe { run.children.load(Ordering::Relaxed, guard).deref() }.insert(child, head, self.seed) {
            meta.tombs -= 1;
        }
        meta.kids += 1;
        if let Cover::Dense(d) = run.cover(guard) {
            d.mark(child.attach);
        }
    }

    /// Marks, in `d` (the new dense cover of `run`, locked), the offsets where children hang.
    fn mark_children(&self, run: &Run, d: &Dense, guard: &Guard) {
        // SAFETY: the run is locked: its table is not replaced meanwhile.
        if let Some(t) = unsafe { run.children.load(Ordering::Relaxed, guard).as_ref() } {
            // SAFETY: linked children are alive while their parent is locked.
            for (child, _) in t.each() {
                d.mark(unsafe { &*child }.attach);
            }
        }
    }

    /// The worker holds `blocks` at offsets `off..` of `run`, whose lock `meta` is: its map
    /// learns each block's place, its state in the run grows, its coverage word follows.
    #[allow(clippy::too_many_arguments)]
    fn place_locked(
        &self,
        w: &mut RunWriter,
        run: &Run,
        mut meta: MutexGuard<'_, Meta>,
        off: u32,
        blocks: &[StoredBlock],
        out: &mut ApplyOutcome,
        d: &mut Delta,
        _guard: &Guard,
    ) -> Result<(), Dead> {
        if meta.dead {
            return Err(Dead);
        }
        let key = u64::from(run.id);
        let before = w.runs.get(key).copied();
        let mine0 = before.unwrap_or_default();
        let hidden = w.hidden.get(&run.id);
        w.blocks.reserve(blocks.len());
        let mut aliases = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            if let Some(ahead) = blocks.get(j + AHEAD) {
                w.blocks.prefetch(ahead.block_hash.0);
            }
            let x = off + j as u32;
            let p = place(run.id, x);
            match w.blocks.insert(b.block_hash.0, p) {
                None => {
                    d.placements += 1;
                    out.stored += 1;
                    if mine0.holds(x, hidden) {
                        aliases.push(p);
                    }
                }
                Some(old) if old == p => out.duplicates += 1,
                Some(old) => {
                    out.replaced += 1;
                    out.stored += 1;
                    w.moved.push(old);
                    if mine0.holds(x, hidden) {
                        aliases.push(p);
                    }
                }
            }
        }
        for p in aliases {
            w.alias_add(p);
        }
        let mut mine = mine0;
        let end = off + blocks.len() as u32;
        if !mine.try_extend(off, end) {
            let h = w.hidden.entry(run.id).or_default();
            mine.add(off, end, h);
            if h.is_empty() {
                w.hidden.remove(&run.id);
            }
        }
        d.hidden += i64::from(mine.hidden) - i64::from(mine0.hidden);
        if before.is_none() {
            meta.holders += 1;
            if run.parent != ROOT {
                w.kids.entry(run.parent).or_default().push(run.id);
            }
        }
        drop(meta);
        w.runs.insert(key, mine);
        w.touched.push(run.id);
        Ok(())
    }

    /// Writes the worker's cutoff in `run` (locked) going from `from` to `to`: joins the
    /// coverage, changes its word (found from `hint`, which follows it), or leaves; changes the
    /// coverage's form or size when due.
    #[allow(clippy::too_many_arguments)]
    fn publish_cut(&self, slot: Slot, run: &Run, meta: &mut Meta, from: u32, to: u32, hint: &mut u32, guard: &Guard) {
        if from == to {
            return;
        }
        meta.covered = meta.covered + u32::from(from == 0) - u32::from(to == 0);
        // SAFETY: the run is locked: its coverage is not replaced meanwhile.
        let cover = unsafe { run.cover.load(Ordering::Relaxed, guard).deref() };
        let replace = |c: Cover| {
            let old = run.cover.swap(Owned::new(c), Ordering::AcqRel, guard);
            // SAFETY: unpublished by the swap; lookups still reading it are waited for.
            unsafe { guard.defer_destroy(old) };
        };
        let width = self.registry.high_water() as usize;
        match cover {
            Cover::Dense(d) => {
                if slot as usize >= d.width() {
                    let wide = d.widened(width.max(slot as usize + 1));
                    wide.set(slot, from, to);
                    replace(Cover::Dense(wide));
                } else {
                    d.set(slot, from, to);
                }
                if meta.covered < self.cfg.dense_at / 2 {
                    meta.vacated = 0;
                    // SAFETY: as above; just published.
                    let d = match unsafe { run.cover.load(Ordering::Relaxed, guard).deref() } {
                        Cover::Dense(d) => d,
                        Cover::List(_) => return,
                    };
                    replace(Cover::List(d.to_list(2)));
                }
            }
            Cover::List(l) => {
                if from == 0 {
                    if meta.covered >= self.cfg.dense_at && meta.covered as usize * 16 >= width {
                        let len = run.hashes(guard).len() as u32;
                        let d = Dense::from_list(l, len, width.max(slot as usize + 1));
                        d.set(slot, 0, to);
                        self.mark_children(run, &d, guard);
                        meta.vacated = 0;
                        replace(Cover::Dense(d));
                    } else if let Some((i, reused)) = l.join(slot, to, meta.vacated > 0) {
                        meta.vacated -= u32::from(reused);
                        *hint = i as u32;
                    } else {
                        let grown = l.grown(l.capacity().max(2));
                        let (i, _) = grown.join(slot, to, false).unwrap_or((0, false));
                        *hint = i as u32;
                        meta.vacated = 0;
                        replace(Cover::List(grown));
                    }
                    return;
                }
                let Some(i) = l.find(slot, *hint as usize) else {
                    debug_assert!(false, "a worker with a cutoff has a coverage word");
                    return;
                };
                *hint = i as u32;
                if to > 0 {
                    l.set(i, slot, to);
                    return;
                }
                l.vacate(i);
                meta.vacated += 1;
                // A list mostly vacated is compacted, so lookups do not read dead words.
                if meta.vacated as usize * 2 > l.used() && l.used() > 4 {
                    meta.vacated = 0;
                    replace(Cover::List(l.grown(0)));
                }
            }
        }
    }

    /// Lets go of the places the last store moved engine hashes away from.
    fn let_go_moved(&self, w: &mut RunWriter, d: &mut Delta, guard: &Guard) {
        if w.moved.is_empty() {
            return;
        }
        let mut moved = std::mem::take(&mut w.moved);
        let mut batch = None;
        for &p in &moved {
            self.let_go(w, p, &mut batch, d, guard);
        }
        self.flush(w, batch, d, guard);
        moved.clear();
        w.moved = moved;
    }

    pub(super) fn remove_blocks(&self, w: &mut RunWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        self.thaw(w);
        let guard = epoch::pin();
        let mut d = Delta::default();
        let mut batch = None;
        for (i, h) in hashes.iter().enumerate() {
            if let Some(ahead) = hashes.get(i + AHEAD) {
                w.blocks.prefetch(ahead.0);
            }
            let was_beyond = w.beyond.forget(*h);
            match w.blocks.remove(h.0) {
                Some(p) => {
                    out.removed += 1;
                    d.placements -= 1;
                    self.let_go(w, p, &mut batch, &mut d, &guard);
                }
                None if was_beyond => {}
                None => out.unknown_removes += 1,
            }
        }
        self.flush(w, batch, &mut d, &guard);
        self.sync(w, &mut d, &guard);
        self.commit(&d);
        // What dead runs left goes to the collector now, and the writer frees what is due, so
        // that lookups, which also collect now and then, rarely find a writer's garbage to free.
        guard.flush();
        out
    }

    /// The worker no longer holds place `p` under one engine hash: unless another hash holds it
    /// too, it leaves the place. Consecutive places of one run are gathered in `batch`, whose
    /// coverage word is written once.
    fn let_go(&self, w: &mut RunWriter, p: Place, batch: &mut Option<Batch>, d: &mut Delta, guard: &Guard) {
        if w.alias_drop(p) {
            return;
        }
        let (run, x) = unplace(p);
        if batch.as_ref().is_none_or(|b| b.run != run) {
            self.flush(w, batch.take(), d, guard);
            let Some(&mine) = w.runs.get(u64::from(run)) else {
                debug_assert!(false, "a held place's run is in the writer's state");
                return;
            };
            *batch = Some(Batch { run, before: mine, now: mine });
        }
        let Some(b) = batch.as_mut() else { return };
        if !b.now.try_drop_last(x) {
            let h = w.hidden.entry(run).or_default();
            let was = b.now.hidden;
            b.now.drop_offset(x, h);
            d.hidden += i64::from(b.now.hidden) - i64::from(was);
            if h.is_empty() {
                w.hidden.remove(&run);
            }
        }
    }

    /// Keeps a batch of removals' new state of its run, for `sync` to publish.
    fn flush(&self, w: &mut RunWriter, batch: Option<Batch>, _d: &mut Delta, _guard: &Guard) {
        let Some(Batch { run, before, now }) = batch else { return };
        if now != before {
            w.runs.insert(u64::from(run), now);
            w.touched.push(run);
        }
    }

    /// Publishes the event just applied to the writer's private state (see the module doc):
    /// works out which runs the worker now reaches, lowers the cutoffs that go down (top
    /// first), raises those that go up (bottom first), keeps the cutoffs of runs that lost
    /// `reach` for a grace period, and forgets the runs it no longer holds or shows.
    fn sync(&self, w: &mut RunWriter, d: &mut Delta, guard: &Guard) {
        if w.touched.is_empty() {
            return;
        }
        let mut s = std::mem::take(&mut w.scratch);
        for &id in &w.touched {
            s.todo.push(Reverse((self.held_run(id, guard).start, id)));
        }
        w.touched.clear();
        let gen = w.gen + 1;
        let mut froze = false;
        let mut last = None;
        while let Some(Reverse((_, id))) = s.todo.pop() {
            if last == Some(id) {
                continue;
            }
            last = Some(id);
            let run = self.held_run(id, guard);
            let reach = run.parent == ROOT || w.runs.get(u64::from(run.parent)).is_some_and(|p| p.reach && p.cut >= run.attach);
            let Some(m) = w.runs.get_mut(u64::from(id)) else { continue };
            let was = m.reach;
            m.reach = reach;
            if reach {
                m.frozen = 0;
                if m.cut < m.shown {
                    s.lower.push(id);
                } else if m.cut > m.shown {
                    s.raise.push(id);
                }
            } else if was && m.shown > 0 {
                m.frozen = gen;
                froze = true;
                w.frozen.push(id);
            }
            debug_assert!(m.reach || m.shown == 0 || m.frozen != 0, "an unreachable run shows a cutoff only while frozen");
            let (reach, cut) = (m.reach, m.cut);
            s.seen.push(id);
            if let Some(kids) = w.kids.get(&id) {
                for &k in kids {
                    let kr = self.held_run(k, guard);
                    if w.runs.get(u64::from(k)).is_some_and(|km| km.reach != (reach && cut >= kr.attach)) {
                        s.todo.push(Reverse((kr.start, k)));
                    }
                }
            }
        }
        for &id in &s.lower {
            self.show(w, id, guard);
        }
        for &id in s.raise.iter().rev() {
            self.show(w, id, guard);
        }
        if froze {
            w.gen = gen;
            let over = Arc::new(AtomicBool::new(false));
            let flag = over.clone();
            // Every lookup pinned now may have read a lowered parent before it went down.
            guard.defer(move || flag.store(true, Ordering::Release));
            guard.flush();
            w.graces.push_back((gen, over));
        }
        for &id in &s.seen {
            if w.runs.get(u64::from(id)).is_some_and(Mine::is_empty) {
                self.forget(w, id, d, guard);
            }
        }
        s.seen.clear();
        s.lower.clear();
        s.raise.clear();
        w.scratch = s;
    }

    /// Publishes the worker's cutoff in run `id`: `shown` becomes its target, `cut` where it
    /// reaches the run, 0 where it does not.
    fn show(&self, w: &mut RunWriter, id: RunId, guard: &Guard) {
        let Some(m) = w.runs.get_mut(u64::from(id)) else { return };
        let to = if m.reach { m.cut } else { 0 };
        if m.shown == to {
            return;
        }
        let run = self.held_run(id, guard);
        let mut meta = run.meta.lock();
        self.publish_cut(w.slot, run, &mut meta, m.shown, to, &mut m.hint, guard);
        m.shown = to;
    }

    /// The worker holds and shows nothing in run `id` any more: its writer forgets the run, and
    /// the run dies if no one else holds it and no child hangs off it.
    fn forget(&self, w: &mut RunWriter, id: RunId, d: &mut Delta, guard: &Guard) {
        w.runs.remove(u64::from(id));
        w.hidden.remove(&id);
        let run = self.held_run(id, guard);
        if run.parent != ROOT {
            if let Some(kids) = w.kids.get_mut(&run.parent) {
                kids.retain(|k| *k != id);
                if kids.is_empty() {
                    w.kids.remove(&run.parent);
                }
            }
        }
        let mut meta = run.meta.lock();
        meta.holders -= 1;
        if meta.holders == 0 && meta.kids == 0 {
            self.kill(run, meta, d, guard);
        }
    }

    /// Withdraws the cutoffs frozen by events whose grace period is over; a writer calls it
    /// before each event, so a worker's withdrawn runs go back no later than its next event.
    pub(super) fn thaw(&self, w: &mut RunWriter) {
        if w.frozen.is_empty() {
            return;
        }
        // A grace period over means every earlier one is over too.
        let Some(over) = w.graces.iter().filter(|(_, f)| f.load(Ordering::Acquire)).map(|(g, _)| *g).max() else { return };
        w.graces.retain(|(g, _)| *g > over);
        let guard = epoch::pin();
        let mut d = Delta::default();
        let mut frozen = std::mem::take(&mut w.frozen);
        frozen.retain(|&id| {
            let Some(m) = w.runs.get(u64::from(id)) else { return false };
            if m.frozen == 0 {
                return false;
            }
            if m.frozen > over {
                return true;
            }
            debug_assert!(!m.reach);
            if let Some(m) = w.runs.get_mut(u64::from(id)) {
                m.frozen = 0;
            }
            self.show(w, id, &guard);
            if w.runs.get(u64::from(id)).is_some_and(Mine::is_empty) {
                self.forget(w, id, &mut d, &guard);
            }
            false
        });
        frozen.append(&mut w.frozen);
        w.frozen = frozen;
        self.commit(&d);
    }

    /// Waits until the last grace period asked for is over, then withdraws every frozen
    /// cutoff: after it, the worker shows exactly what it holds. The caller holds no guard
    /// (the wait needs this thread unpinned).
    pub(super) fn settle_writer(&self, w: &mut RunWriter) {
        if let Some((_, over)) = w.graces.back() {
            let over = over.clone();
            debug_assert!(!epoch::is_pinned(), "waiting for a grace period while pinned never ends");
            while !over.load(Ordering::Acquire) {
                epoch::pin().flush();
                crate::sync::yield_now();
            }
        }
        self.thaw(w);
        debug_assert!(w.frozen.is_empty());
    }

    /// Unlinks `run` (locked, held by no one, no children) and retires it; its parent follows
    /// if that leaves it the same.
    fn kill<'g>(&self, mut run: &'g Run, mut meta: MutexGuard<'g, Meta>, d: &mut Delta, guard: &'g Guard) {
        loop {
            if run.id == ROOT {
                return;
            }
            meta.dead = true;
            drop(meta);
            d.blocks -= run.hashes(guard).len() as i64;
            let parent = self.held_run(run.parent, guard);
            let mut pm = parent.meta.lock();
            // SAFETY: the parent is locked: its table is not replaced meanwhile.
            if let Some(t) = unsafe { parent.children.load(Ordering::Relaxed, guard).as_ref() } {
                if t.remove(run, run.head, self.seed) {
                    pm.kids -= 1;
                    pm.tombs += 1;
                }
            }
            let p = self.slab.take(run.id);
            // SAFETY: taken out of the slab and unlinked from its parent: no new reader can
            // reach it, and the collector waits for those that did.
            unsafe { guard.defer_destroy(Shared::from(p as *const Run)) };
            if pm.holders != 0 || pm.kids != 0 {
                return;
            }
            run = parent;
            meta = pm;
        }
    }

    /// Drops every block: the worker's top runs go to 0 at once, the runs under them after a
    /// grace period, which this waits for (a clear is rare: an engine restart, an expiry), so
    /// that the worker shows nothing once it returns and its slot can be freed.
    pub(super) fn clear_worker(&self, w: &mut RunWriter) -> ApplyOutcome {
        self.thaw(w);
        let removed = w.blocks.len() as u64;
        {
            let guard = epoch::pin();
            let mut d = Delta { placements: -(removed as i64), ..Delta::default() };
            let ids: Vec<u64> = w.runs.iter().map(|(k, _)| k).collect();
            for key in ids {
                if let Some(m) = w.runs.get_mut(key) {
                    d.hidden -= i64::from(m.hidden);
                    (m.cut, m.hidden) = (0, 0);
                    w.touched.push(key as RunId);
                }
            }
            w.blocks = BlockMap::default();
            w.hidden = SeededMap::default();
            w.aliases = LinearMap::default();
            w.beyond.clear();
            self.sync(w, &mut d, &guard);
            self.commit(&d);
        }
        self.settle_writer(w);
        debug_assert!(w.runs.is_empty() && w.kids.is_empty());
        ApplyOutcome { removed, ..ApplyOutcome::default() }
    }

    /// The local hashes of the path from the root to `(run, x)`, that block included.
    fn path_to<'g>(&self, mut run: &'g Run, mut x: u32, guard: &'g Guard) -> Vec<u64> {
        let mut rev = Vec::new();
        loop {
            let h = run.hashes(guard);
            rev.extend(h[..=x as usize].iter().rev());
            if run.parent == ROOT || run.attach == 0 {
                break;
            }
            x = run.attach - 1;
            run = self.held_run(run.parent, guard);
        }
        rev.reverse();
        rev
    }

    pub(super) fn save_worker(&self, w: &RunWriter) -> Saved {
        let guard = epoch::pin();
        // One engine hash per held place, to name a parent by.
        let by_place: SeededMap<Place, u64> = w.blocks.iter().map(|(h, p)| (p, h)).collect();
        let mut blocks: Vec<SavedBlock> = w
            .blocks
            .iter()
            .map(|(hash, p)| {
                let (id, x) = unplace(p);
                let run = self.held_run(id, &guard);
                let key = run.hashes(&guard)[x as usize];
                let pos = run.start + x;
                let parent_place = if x > 0 {
                    Some((run, x - 1))
                } else if run.parent != ROOT {
                    Some((self.held_run(run.parent, &guard), run.attach - 1))
                } else {
                    None
                };
                let parent = match parent_place {
                    None => SavedParent::Root,
                    Some((r, px)) => match by_place.get(&place(r.id, px)) {
                        Some(&h) => SavedParent::Block(h),
                        None => SavedParent::Place(self.path_to(r, px, &guard)),
                    },
                };
                SavedBlock { hash, pos, key, parent }
            })
            .collect();
        blocks.sort_unstable_by_key(|b| (b.pos, b.hash));
        Saved { blocks, beyond: w.beyond.to_vec() }
    }

    pub(super) fn restore_worker(&self, w: &mut RunWriter, saved: &Saved) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        self.thaw(w);
        let guard = epoch::pin();
        let mut d = Delta::default();
        for b in &saved.blocks {
            if b.pos >= self.cfg.max_depth {
                out.too_deep += 1;
                continue;
            }
            if w.blocks.get(b.hash).is_some() {
                out.duplicates += 1;
                continue;
            }
            let block = [StoredBlock::new(b.hash, b.key)];
            let mut one = ApplyOutcome::default();
            match &b.parent {
                SavedParent::Root if b.pos == 0 => {
                    self.walk_store(w, (self.root(&guard), 0), &block, &mut one, &mut d, &guard);
                }
                SavedParent::Block(ph) => match w.blocks.get(*ph) {
                    Some(p) => {
                        let (id, x) = unplace(p);
                        let run = self.held_run(id, &guard);
                        if run.start + x + 1 == b.pos {
                            self.walk_store(w, (run, x + 1), &block, &mut one, &mut d, &guard);
                        } else {
                            one.unplaceable += 1;
                        }
                    }
                    None => one.unplaceable += 1,
                },
                SavedParent::Place(path) if path.len() == b.pos as usize => {
                    self.store_under_path(w, path, &block, &mut one, &mut d, &guard);
                }
                _ => one.unplaceable += 1,
            }
            out.stored += one.stored;
            out.duplicates += one.duplicates;
            out.unplaceable += one.unplaceable;
            out.too_deep += one.too_deep;
        }
        w.beyond.extend(&saved.beyond);
        self.let_go_moved(w, &mut d, &guard);
        self.sync(w, &mut d, &guard);
        self.commit(&d);
        out
    }

    /// Stores `blocks` after a path of local hashes the worker does not hold (a block saved
    /// past a hole): the path's runs are found or opened without holders, then the blocks
    /// are placed after them, which keeps them alive.
    fn store_under_path(
        &self,
        w: &mut RunWriter,
        path: &[u64],
        blocks: &[StoredBlock],
        out: &mut ApplyOutcome,
        d: &mut Delta,
        guard: &Guard,
    ) {
        loop {
            let Some((run, off)) = self.open_path(path, d, guard) else {
                out.unplaceable += blocks.len() as u64;
                return;
            };
            // The path's last run is kept alive only by what is placed after it: it counts the
            // walk as a holder until the blocks are placed.
            let mut meta = run.meta.lock();
            if meta.dead {
                continue;
            }
            meta.holders += 1;
            drop(meta);
            self.walk_store(w, (run, off), blocks, out, d, guard);
            let mut meta = run.meta.lock();
            meta.holders -= 1;
            if meta.holders == 0 && meta.kids == 0 {
                self.kill(run, meta, d, guard);
            }
            return;
        }
    }

    /// Finds or opens the runs along `path` (no worker joins them): the place after it, or
    /// `None` when every run id is taken.
    fn open_path<'g>(&self, path: &[u64], d: &mut Delta, guard: &'g Guard) -> Option<(&'g Run, u32)> {
        'again: loop {
            let (mut run, mut off) = (self.root(guard), 0u32);
            let mut i = 0;
            while i < path.len() {
                let m = run
                    .hashes(guard)
                    .get(off as usize..)
                    .map_or(0, |h| h.iter().zip(&path[i..]).take_while(|(a, b)| a == b).count());
                if m > 0 {
                    i += m;
                    off += m as u32;
                    continue;
                }
                if let Some(c) = run.child(off, path[i], self.seed, guard) {
                    (run, off) = (c, 0);
                    continue;
                }
                let mut meta = run.meta.lock();
                if meta.dead {
                    continue 'again;
                }
                if run.child(off, path[i], self.seed, guard).is_some() || run.hashes(guard).get(off as usize) == Some(&path[i]) {
                    continue;
                }
                let rest: Vec<StoredBlock> = path[i..].iter().map(|&l| StoredBlock::new(0, l)).collect();
                let c = self.open_child(run, off, &rest, guard)?;
                self.link_child(run, &mut meta, c, path[i], guard);
                d.blocks += rest.len() as i64;
                return Some((c, rest.len() as u32));
            }
            return Some((run, off));
        }
    }
}
