//! The positional index: for each position, the entries of the blocks cached
//! there, each one prefix hash with the set of workers holding it.
//!
//! DESIGN's layout is position -> local hash -> entry (prefix + workers). Every probe
//! compares the prefix hash anyway, so each position's table is keyed by the prefix hash
//! itself: the two inner steps fold into one probe, and blocks that share a chunk hash under
//! different parents (collisions) are simply separate entries, never merged.
//!
//! Lookups use jump search: probe every `jump` positions and binary-search inside a jump
//! only where workers dropped out. That is exact only if, inside each jump window
//! `(k * jump, (k + 1) * jump]`, what a lookup sees of a worker is prefix-closed. A block
//! whose ancestor is missing can never be part of a match, so the writer hides from lookups
//! every orphan (a held block whose parent is not held) and its descendants in the orphan's
//! own window, and shows them again when a block is stored at the missing parent's place.
//! Holes cost the writes that make and fill them, bounded by one window, and nothing to
//! lookups. Each block links to its children for that; orphans wait by the place they need.
//! A worker that holds one place under two engine hashes at once is "tangled": nothing is
//! hidden, and lookups that meet it check every position, until it is cleared.

use super::linear::{prefetch_raw, LinearMap, Split, Spot, NO_SLOT};
use super::{
    candidate_slots, finish_matches, ApplyOutcome, Beyond, IndexError, IndexStats, KvIndex, MatchOptions, Saved, SavedBlock,
    SavedParent, WorkerMatch,
};
use crate::hash::{extend_chain, BlockHash, LocalHash, PrefixHash, StoredBlock, WorkerId};
use crate::seeded::SeededMap;
use crate::workers::{Slot, SlotBits, Spill, WorkerRegistry, WorkerSet};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicI64, AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Positions per chunk. A chunk is allocated on first use and its levels share one lock,
/// so a writer applying a chain of blocks takes one lock per chunk, not one per block.
const CHUNK: usize = 128;
/// Most blocks a writer applies under one chunk lock before it lets waiting lookups in.
const MAX_HOLD: u32 = 32;

/// Tuning of the positional index.
#[derive(Clone, Copy, Debug)]
pub struct PositionalConfig {
    /// Probe every `jump` positions.
    pub jump: usize,
    /// Deepest position accepted (blocks beyond are rejected as too deep).
    pub max_depth: u32,
    /// Most workers (worker id, dp rank) held at once.
    pub max_workers: u32,
    /// Most blocks one worker holds; a store past it is cut short (see
    /// [`super::runs::RunConfig::max_blocks_per_worker`]).
    pub max_blocks_per_worker: u64,
}

impl Default for PositionalConfig {
    fn default() -> Self {
        PositionalConfig {
            jump: 64,
            max_depth: 1 << 16,
            max_workers: 1 << 16,
            max_blocks_per_worker: super::runs::MAX_BLOCKS_PER_WORKER,
        }
    }
}

/// All entries at one position, behind one lock: prefix hash -> workers holding it.
#[derive(Default)]
struct LevelData {
    table: LinearMap<WorkerSet>,
    /// Members of entries whose set spans more than one inline window.
    spill: Spill,
}

/// Where a level's slots are, readable without the lock, so that an apply thread can
/// prefetch the slot of a block it will apply soon.
#[derive(Default)]
struct Hint {
    slots: AtomicPtr<u8>,
    cap: AtomicUsize,
}

impl Hint {
    fn publish(&self, data: &LevelData) {
        let (ptr, cap) = data.table.raw_hint();
        self.slots.store(ptr as *mut u8, Ordering::Relaxed);
        self.cap.store(cap, Ordering::Relaxed);
    }
}

/// `CHUNK` consecutive positions under one lock.
struct Chunk {
    levels: RwLock<Box<[LevelData; CHUNK]>>,
    hints: Box<[Hint; CHUNK]>,
}

impl Chunk {
    fn new() -> Self {
        Chunk { levels: RwLock::new(boxed_array(LevelData::default)), hints: boxed_array(Hint::default) }
    }
}

/// `CHUNK` values on the heap, typed as an array so that indexing by `pos % CHUNK` needs no
/// bounds check.
fn boxed_array<T>(f: impl FnMut() -> T) -> Box<[T; CHUNK]> {
    let all: Box<[T]> = std::iter::repeat_with(f).take(CHUNK).collect();
    match all.try_into() {
        Ok(array) => array,
        Err(_) => unreachable!("exactly CHUNK values were collected"),
    }
}

/// A writer's hold on the chunk it is applying to: the lock is kept across consecutive
/// blocks of the same chunk (at most `MAX_HOLD`), and index counters are summed locally.
struct WriteCursor<'a> {
    index: &'a PositionalIndex,
    chunk: usize,
    guard: Option<RwLockWriteGuard<'a, Box<[LevelData; CHUNK]>>>,
    /// The hints of the chunk whose levels `guard` holds: kept apart from the chunk, so that
    /// a level's hint is one load away, not two.
    hints: Option<&'a [Hint; CHUNK]>,
    held: u32,
    entries: i64,
    hidden: i64,
}

impl<'a> WriteCursor<'a> {
    fn new(index: &'a PositionalIndex) -> Self {
        WriteCursor { index, chunk: 0, guard: None, hints: None, held: 0, entries: 0, hidden: 0 }
    }

    /// The level at `pos`, write-locked; `create` allocates its chunk if missing.
    #[inline]
    fn level(&mut self, pos: u32, create: bool) -> Option<(&mut LevelData, &'a Hint)> {
        let c = pos as usize / CHUNK;
        if self.chunk == c && self.held < MAX_HOLD && self.guard.is_some() {
            self.held += 1;
            let hints = self.hints?;
            let levels = self.guard.as_mut()?;
            return Some((&mut levels[pos as usize % CHUNK], &hints[pos as usize % CHUNK]));
        }
        self.relock(pos, create)
    }

    /// [`Self::level`] when the chunk of `pos` is not the one held, or was held long enough:
    /// lets the held one go and locks that of `pos`.
    #[inline(never)]
    fn relock(&mut self, pos: u32, create: bool) -> Option<(&mut LevelData, &'a Hint)> {
        let c = pos as usize / CHUNK;
        let slot = self.index.chunks.get(c)?;
        let chunk: &'a Chunk = if create { slot.get_or_init(Chunk::new) } else { slot.get()? };
        if let Some(g) = self.guard.take() {
            RwLockWriteGuard::unlock_fair(g);
        }
        self.guard = Some(chunk.levels.write());
        self.hints = Some(&chunk.hints);
        self.chunk = c;
        self.held = 1;
        let levels = self.guard.as_mut()?;
        Some((&mut levels[pos as usize % CHUNK], &chunk.hints[pos as usize % CHUNK]))
    }

    /// Starts fetching the spilled members of the entry (pos, prefix), if it is in the chunk
    /// held: its set is known only once its slot is in cache, so removals do this `STAGE`
    /// blocks ahead, after the slot's own prefetch. Stores skip it: measured, it gained
    /// nothing in replays and cost 10% of a cached chain store.
    #[inline]
    fn prefetch_members(&self, pos: u32, prefix: u64) {
        let Some(levels) = self.guard.as_ref().filter(|_| self.chunk == pos as usize / CHUNK) else { return };
        let level = &levels[pos as usize % CHUNK];
        if !level.spill.is_empty() {
            if let Some(&set) = level.table.get(prefix) {
                level.spill.prefetch(set);
            }
        }
    }
}

impl Drop for WriteCursor<'_> {
    fn drop(&mut self) {
        if self.entries != 0 {
            self.index.entries.fetch_add(self.entries, Ordering::Relaxed);
        }
        if self.hidden != 0 {
            self.index.hidden.fetch_add(self.hidden, Ordering::Relaxed);
        }
    }
}

/// The positional backend.
pub struct PositionalIndex {
    cfg: PositionalConfig,
    registry: WorkerRegistry,
    chunks: Box<[OnceLock<Chunk>]>,
    placements: AtomicI64,
    entries: AtomicI64,
    hidden: AtomicI64,
}

/// `Rec::meta` bits: the block has a first child (`Rec::first_child` is valid).
const HAS_CHILD: u32 = 1 << 31;
/// `Rec::meta` bits: hidden from lookups (an ancestor is missing; see the module doc).
const HIDDEN: u32 = 1 << 30;
/// `Rec::meta` bits: an orphan, waiting in `PositionalWriter::waiting`.
const ORPHAN: u32 = 1 << 29;
/// `Rec::meta` bits: the block has children past the first (in `more_children`).
const HAS_MORE: u32 = 1 << 28;
/// `Rec::meta` bits: its parent was removed by the removal in progress, which lists it in its
/// `LEFT` scratch at the index in its `SIB_MASK` bits; `parent` is the removed parent's prefix.
/// So a child removed later in the same event is struck from that list, not looked for.
const PARENT_GONE: u32 = 1 << 27;
/// `Rec::meta` bits: 1 + its index in the list that holds it (its parent's `more_children`),
/// 0 if it is its parent's first child or a root; for an orphan, 1 if it is the first of its
/// place in `waiting`, 2 + its index in `more_waiting` otherwise; under `PARENT_GONE`, its
/// index in the removal's list.
const SIB_MASK: u32 = PARENT_GONE - 1;
/// Most blocks one hole may hide or show (the reference trace needs under 200, with every
/// block in one worker): a publisher that builds a bigger subtree in one jump window gets its
/// worker tangled instead, so a one-block event never costs more than this.
const MAX_WALK: usize = 4096;

/// A held block in a worker's reverse map (40 bytes with its key, the engine hash).
#[derive(Clone, Copy, Debug, Default)]
struct Rec {
    /// Engine hash of its parent; for an orphan, the prefix hash of the parent it waits for.
    parent: u64,
    prefix: u64,
    /// Engine hash of its first child (valid under `HAS_CHILD`), so subtrees can be walked.
    first_child: u64,
    pos: u32,
    /// Flags and sibling index (see `HAS_CHILD`, `HIDDEN`, `ORPHAN`, `HAS_MORE`, `SIB_MASK`).
    meta: u32,
}

impl Rec {
    fn hidden(&self) -> bool {
        self.meta & HIDDEN != 0
    }

    fn place(&self) -> (u32, u64) {
        (self.pos, self.prefix)
    }

    /// For an orphan (or a block whose parent is gone): the key of the place it waits for in
    /// `PositionalWriter::waiting`.
    fn wait_key(&self) -> u64 {
        place_key((self.pos.wrapping_sub(1), self.parent))
    }
}

/// One word for a place (position, prefix hash). Two places of one worker share a word with
/// odds of about 2^-64 a pair; if they do, the worker is taken for an alias and tangled: its
/// lookups stay exact, only slower.
#[inline]
fn place_key((pos, prefix): (u32, u64)) -> u64 {
    prefix ^ (u64::from(pos) + 1).wrapping_mul(SPREAD)
}

/// The 64-bit golden-ratio multiplier: its product's top bits depend on every bit of the factor.
const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;

/// The wait table of orphans: it swings by large factors as holes open and close, so it is
/// never shrunk step by step, and given back only when empty and bigger than is worth keeping
/// (see `PositionalWriter::trim`); each entry is a held block, which bounds it.
type HoleMap<V> = LinearMap<V, false>;

/// A worker's reverse map: most stored blocks are new to it, and a probe for an absent key
/// reads to the end of its run, so the keys are kept apart from the 32-byte records.
type ReverseMap = LinearMap<Rec, true, Split<Rec>>;

/// Engine hashes of a parent's children past the first, or of the orphans past the first
/// waiting at one place: most such lists hold one block, kept without an allocation.
type Siblings = SmallVec<[u64; 1]>;

/// A worker's reverse map: engine block hash -> (position, prefix hash), with the links
/// that keep the blocks under a missing ancestor out of the lookups' sight.
pub struct PositionalWriter {
    id: WorkerId,
    slot: Slot,
    blocks: ReverseMap,
    /// Children past the first, by the parent's engine hash (only branch points have any).
    more_children: SeededMap<u64, Siblings>,
    /// Orphans (held blocks whose parent is not held), the first of each place, by the
    /// [`place_key`] of the parent's place they wait for: a block stored there, under any
    /// engine hash, adopts them. One probe per check, as every store checks while any wait.
    waiting: HoleMap<u64>,
    /// The orphans past the first waiting at one place (the children of a removed branch
    /// point), by the same key.
    more_waiting: SeededMap<u64, Siblings>,
    /// Which places may have orphans waiting: a store asks it before it probes `waiting`,
    /// whose slots are seldom in cache.
    wait_filter: WaitFilter,
    /// Set when one place is held under two engine hashes at once (an alias), which the
    /// links cannot follow: nothing is hidden and lookups check the worker position by
    /// position, until it is cleared.
    tangled: bool,
    /// In a tangled worker, extra records holding an already-held place.
    aliases: SeededMap<(u32, u64), u32>,
    /// Its blocks past `max_depth` (see [`Beyond`]).
    beyond: Beyond,
}

/// The keys of a worker's wait table as 4,096 bits (512 bytes, so that a chain's checks stay in
/// a few cache lines), each key setting two bits of one word. A bit is cleared only when the
/// filter is rebuilt from the table, which happens once the keys added since the last rebuild
/// pass twice those left, so stale bits cost at most a few probes per key.
struct WaitFilter {
    /// The 4,096 bits, set by [`Self::bits`] of each key.
    bits: [u64; 64],
    /// Keys added since the last rebuild.
    added: usize,
}

impl Default for WaitFilter {
    fn default() -> Self {
        WaitFilter { bits: [0; 64], added: 0 }
    }
}

impl WaitFilter {
    /// Word and the two bits of `key` in it, from the top bits of a multiply: prefix hashes are
    /// polynomial, not mixed (a root's is its local hash), so their own bits can be anything
    /// but even. At hole rate 0.5, 1.9% of the stores made while orphans wait probe the table
    /// for nothing, where one bit of 2,048 let 10.2% through (two bits of 2,048: 5.7%); two
    /// bits of one word cost the same one load as one bit.
    #[inline]
    fn bits(key: u64) -> (usize, u64) {
        let mixed = key.wrapping_mul(SPREAD);
        ((mixed >> 58) as usize, 1 << ((mixed >> 52) & 63) | 1 << ((mixed >> 46) & 63))
    }

    #[inline]
    fn may_hold(&self, key: u64) -> bool {
        let (word, bits) = Self::bits(key);
        self.bits[word] & bits == bits
    }

    /// Adds `key`, a key new to `table`, rebuilding from `table` when stale bits pile up.
    fn add(&mut self, key: u64, table: &HoleMap<u64>) {
        if table.len() == 1 {
            *self = WaitFilter::default();
        }
        let (word, bits) = Self::bits(key);
        self.bits[word] |= bits;
        self.added += 1;
        if self.added > 2 * table.len() + 64 {
            *self = WaitFilter::default();
            for (k, _) in table.iter() {
                let (word, bits) = Self::bits(k);
                self.bits[word] |= bits;
            }
        }
    }
}

/// Entries an empty hole-bookkeeping table may keep room for (see `PositionalWriter::trim`).
const TRIM_ABOVE: usize = 16;

/// How far ahead of the block being applied its reverse-map slot is prefetched.
const PREFETCH: usize = 8;
/// How far ahead of the block being removed the spilled members of its entry are prefetched
/// (its slot, prefetched `PREFETCH` ahead, has arrived by then).
const STAGE: usize = PREFETCH / 2;
/// Slot hints a removal keeps for the blocks ahead: more than `PREFETCH`, a power of two.
const RING: usize = 2 * PREFETCH;

impl PositionalWriter {
    fn holey(&self) -> bool {
        self.tangled
    }

    /// Gives back the hole bookkeeping's tables once they are empty, so that a worker keeps
    /// what it holds, not room for the most holes it ever had. Small ones stay, so that a
    /// worker whose holes come and go does not allocate and regrow its tables each time: the
    /// wait table up to one slot per 16 blocks held (1.5% of the reverse map's room).
    fn trim(&mut self) {
        if self.waiting.is_empty() && self.waiting.capacity() > (self.blocks.len() / 16).max(TRIM_ABOVE) {
            self.waiting = HoleMap::default();
        }
        if self.more_waiting.is_empty() && self.more_waiting.capacity() > TRIM_ABOVE {
            self.more_waiting = SeededMap::default();
        }
        if self.more_children.is_empty() && self.more_children.capacity() > TRIM_ABOVE {
            self.more_children = SeededMap::default();
        }
    }

    fn set_sib(&mut self, hash: u64, idx: u32) {
        if let Some(r) = self.blocks.get_mut(hash) {
            r.meta = (r.meta & !SIB_MASK) | idx;
        }
    }

    /// Puts `hash` in the wait list of the place `key`; its index there (see `SIB_MASK`).
    fn wait(&mut self, key: u64, hash: u64) -> usize {
        if self.waiting.upsert(key, hash).1 {
            self.wait_filter.add(key, &self.waiting);
            return 1;
        }
        let v = self.more_waiting.entry(key).or_default();
        v.push(hash);
        v.len() + 1
    }

    /// The block `hash`, whose parent a removal took (`PARENT_GONE`), becomes an orphan waiting
    /// for its parent's place, hidden: `None` if it is not such a block, else whether its index
    /// still fits (only a worker with hundreds of millions of blocks gets past it) and its
    /// record, or none if it was hidden already (so is all it holds in its window).
    fn orphan(&mut self, hash: u64) -> Option<(bool, Option<Rec>)> {
        let (r, slot) = self.blocks.get_at(hash)?;
        if r.meta & PARENT_GONE == 0 {
            return None;
        }
        let idx = self.wait(r.wait_key(), hash);
        let r = self.blocks.get_mut_near(hash, slot)?;
        r.meta = (r.meta & !(SIB_MASK | PARENT_GONE)) | ORPHAN | (idx as u32 & SIB_MASK);
        let was_hidden = r.hidden();
        r.meta |= HIDDEN;
        Some((idx < SIB_MASK as usize, (!was_hidden).then_some(*r)))
    }

    /// Takes the orphan with index `idx` out of the wait list of the place `key`.
    fn unwait(&mut self, key: u64, idx: u32) {
        if idx > 1 {
            Self::swap_out(&mut self.more_waiting, &mut self.blocks, key, idx, 2);
            return;
        }
        let more = if self.more_waiting.is_empty() { None } else { self.more_waiting.get_mut(&key) };
        let next = match more {
            Some(v) => {
                let last = v.pop();
                if v.is_empty() {
                    self.more_waiting.remove(&key);
                }
                last
            }
            None => None,
        };
        match next {
            Some(h) => {
                self.waiting.insert(key, h);
                self.set_sib(h, 1);
            }
            None => {
                self.waiting.remove(key);
            }
        }
    }

    /// Removes the entry with index `idx` from the list at `key` (whose entry 0 has index
    /// `first`), moving the last one into its place; whether the list is gone.
    fn swap_out<K: std::hash::Hash + Eq>(
        lists: &mut SeededMap<K, Siblings>,
        blocks: &mut ReverseMap,
        key: K,
        idx: u32,
        first: u32,
    ) -> bool {
        let Some(v) = lists.get_mut(&key) else { return true };
        let i = (idx as usize).wrapping_sub(first as usize);
        if i >= v.len() {
            return false;
        }
        v.swap_remove(i);
        if let Some(&moved) = v.get(i) {
            if let Some(r) = blocks.get_mut(moved) {
                r.meta = (r.meta & !SIB_MASK) | idx;
            }
        }
        if v.is_empty() {
            lists.remove(&key);
            return true;
        }
        false
    }

    /// Hangs the held block `child` under the held block `parent`; false if the links no
    /// longer fit (see `push_all`).
    fn link(&mut self, parent: u64, child: u64) -> bool {
        let Some(p) = self.blocks.get_mut(parent) else { return true };
        if p.meta & HAS_CHILD == 0 {
            p.meta |= HAS_CHILD;
            p.first_child = child;
            if let Some(c) = self.blocks.get_mut(child) {
                c.parent = parent;
                c.meta &= !(SIB_MASK | ORPHAN);
            }
        } else {
            p.meta |= HAS_MORE;
            let v = self.more_children.entry(parent).or_default();
            v.push(child);
            let idx = v.len();
            if let Some(c) = self.blocks.get_mut(child) {
                c.parent = parent;
                c.meta = (c.meta & !(SIB_MASK | ORPHAN)) | (idx as u32 & SIB_MASK);
            }
            return idx < SIB_MASK as usize;
        }
        true
    }

    /// Whether a sibling of the hidden block being stored at `place` (its record `rec`, linked
    /// but not yet in the reverse map) is held there too: its parent's children, or the
    /// orphans waiting at its parent's place. Only such a store can make the first alias out
    /// of the index's sight: siblings share their visibility, a visible second copy meets the
    /// first in its entry, and walks and removals move whole groups. A group too big to scan
    /// counts as held (the caller tangles the worker). Out of line: hidden stores are rare.
    #[inline(never)]
    fn sibling_at(&self, rec: &Rec, place: (u32, u64)) -> bool {
        let (first, more) = if rec.meta & ORPHAN != 0 {
            let key = rec.wait_key();
            (self.waiting.get(key).copied(), self.more_waiting.get(&key))
        } else {
            match self.blocks.get(rec.parent) {
                Some(p) if p.meta & HAS_CHILD != 0 => (Some(p.first_child), self.more_children.get(&rec.parent)),
                _ => (None, None),
            }
        };
        let more = more.map_or(&[][..], |m| m.as_slice());
        more.len() >= MAX_WALK || first.iter().chain(more).any(|&h| self.blocks.get(h).is_some_and(|r| r.place() == place))
    }

    /// Clears `HAS_MORE` on `parent` (its extra children are gone).
    fn no_more(&mut self, parent: u64) {
        if let Some(p) = self.blocks.get_mut(parent) {
            p.meta &= !HAS_MORE;
        }
    }

    /// Takes the removed block `rec` out of its parent's children, or out of its wait list;
    /// `parent_near` hints where the parent's record is.
    fn unlink(&mut self, rec: &Rec, parent_near: usize) {
        let idx = rec.meta & SIB_MASK;
        if rec.meta & ORPHAN != 0 {
            self.unwait(rec.wait_key(), idx);
        } else if rec.pos > 0 && idx > 0 {
            if Self::swap_out(&mut self.more_children, &mut self.blocks, rec.parent, idx, 1) {
                self.no_more(rec.parent);
            }
        } else if rec.pos > 0 {
            match self.blocks.get_mut_near(rec.parent, parent_near) {
                Some(p) if p.meta & HAS_MORE == 0 => {
                    p.meta &= !HAS_CHILD;
                    return;
                }
                None => return,
                Some(_) => {}
            }
            let promoted = match self.more_children.get_mut(&rec.parent) {
                Some(v) => {
                    let last = v.pop();
                    if v.is_empty() {
                        self.more_children.remove(&rec.parent);
                        self.no_more(rec.parent);
                    }
                    last
                }
                None => None,
            };
            if let Some(p) = self.blocks.get_mut(rec.parent) {
                match promoted {
                    Some(x) => p.first_child = x,
                    None => p.meta &= !HAS_CHILD,
                }
            }
            if let Some(x) = promoted {
                self.set_sib(x, 0);
            }
        }
    }

    /// Starts fetching the record of `rec`'s first child, so that a subtree walk's next
    /// step overlaps this one's index update instead of waiting after it.
    #[inline]
    fn prefetch_first_child(&self, rec: &Rec) {
        if rec.meta & HAS_CHILD != 0 {
            self.blocks.prefetch(rec.first_child);
        }
    }

    /// Pushes the children of `hash` (its record `rec`) onto `out`.
    fn children_into(&self, hash: u64, rec: &Rec, out: &mut Vec<u64>) {
        if rec.meta & HAS_CHILD != 0 {
            out.push(rec.first_child);
            if rec.meta & HAS_MORE != 0 {
                if let Some(more) = self.more_children.get(&hash) {
                    out.extend_from_slice(more);
                }
            }
        }
    }
}

/// Where the next block of a stored chain goes.
#[derive(Clone, Copy)]
struct ParentRef {
    hash: u64,
    prefix: u64,
    /// False if the parent was dropped while the chain was stored.
    held: bool,
    /// Its reverse-map slot when last seen, a hint that saves a probe (see `get_mut_near`).
    slot: usize,
}

/// Per-thread buffers of lookups, so a lookup allocates nothing once warm.
#[derive(Default)]
struct Scratch {
    prefixes: Vec<PrefixHash>,
    alive: SlotBits,
    probe: SlotBits,
    pool: Vec<SlotBits>,
    depths: Vec<(Slot, u32)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// Writes' scratch: the prefix hashes of the chain being stored. Kept per apply thread,
    /// not per worker, where a thousand workers would each keep their longest chain's worth.
    static CHAIN: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
    /// Writes' scratch: the blocks a subtree walk visits, in the order it visits them (per
    /// thread, as `CHAIN`).
    static QUEUE: Cell<Vec<u64>> = const { Cell::new(Vec::new()) };
    /// Writes' scratch: the places a hole's walk hides (per thread, as `CHAIN`).
    static PLACES: Cell<Vec<(u32, u64)>> = const { Cell::new(Vec::new()) };
    /// Writes' scratch: the children of the blocks a removal took out (`PARENT_GONE`), struck
    /// out (`None`) as the removal takes them too; those left once all its blocks are gone
    /// become orphans and are hidden (per thread, as `CHAIN`).
    static LEFT: Cell<Vec<Option<u64>>> = const { Cell::new(Vec::new()) };
}

impl Default for PositionalIndex {
    fn default() -> Self {
        PositionalIndex::new(PositionalConfig::default())
    }
}

impl PositionalIndex {
    /// An empty index; position chunks are allocated on first use.
    pub fn new(cfg: PositionalConfig) -> Self {
        let nchunks = (cfg.max_depth as usize).div_ceil(CHUNK);
        PositionalIndex {
            cfg: PositionalConfig { jump: cfg.jump.max(1), ..cfg },
            registry: WorkerRegistry::new(cfg.max_workers),
            chunks: (0..nchunks).map(|_| OnceLock::new()).collect(),
            placements: AtomicI64::new(0),
            entries: AtomicI64::new(0),
            hidden: AtomicI64::new(0),
        }
    }

    #[inline]
    fn chunk(&self, pos: u32) -> Option<&Chunk> {
        self.chunks.get(pos as usize / CHUNK)?.get()
    }

    /// Adds `slot` to the entry (pos, prefix); false if it was already there.
    #[inline(always)]
    fn index_add(&self, cur: &mut WriteCursor<'_>, pos: u32, prefix: u64, slot: Slot) -> bool {
        let Some((level, hint)) = cur.level(pos, true) else { return true };
        let LevelData { table, spill } = level;
        let (set, new) = table.upsert(prefix, WorkerSet::EMPTY);
        let added = set.insert_spilling(slot, spill);
        if new {
            hint.publish(level);
            cur.entries += 1;
        }
        added
    }

    /// Removes `slot` from the entry (pos, prefix), dropping the entry when empty.
    #[inline(always)]
    fn index_remove(&self, cur: &mut WriteCursor<'_>, pos: u32, prefix: u64, slot: Slot) {
        let Some((level, hint)) = cur.level(pos, false) else { return };
        let LevelData { table, spill } = level;
        let emptied = table.update_or_remove(prefix, |set| {
            set.remove_spilling(slot, spill);
            set.is_empty()
        });
        if emptied == Some(true) {
            hint.publish(level);
            cur.entries -= 1;
        }
    }

    /// Hints the CPU to fetch the slot of (pos, prefix) before it is written.
    #[inline]
    fn prefetch_entry(&self, pos: u32, prefix: u64) {
        if let Some(chunk) = self.chunk(pos) {
            let hint = &chunk.hints[pos as usize % CHUNK];
            prefetch_raw::<WorkerSet>(hint.slots.load(Ordering::Relaxed), hint.cap.load(Ordering::Relaxed), prefix);
        }
    }

    /// Puts the new block `hash` at `place` in the reverse map (at `spot`, where a probe found
    /// it absent), linked under its parent (or as an orphan), shows or hides it, and adopts
    /// the orphans waiting for its place; whether it is hidden, and its reverse-map slot.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn place_new(
        &self,
        cur: &mut WriteCursor<'_>,
        w: &mut PositionalWriter,
        hash: u64,
        spot: Spot,
        place: (u32, u64),
        parent: Option<ParentRef>,
        under_hidden: bool,
    ) -> (bool, usize) {
        let (pos, prefix) = place;
        let mut rec = Rec { parent: 0, prefix, first_child: 0, pos, meta: 0 };
        let mut clean = true;
        let hidden = match parent {
            None => false,
            Some(ParentRef { hash: ph, held: true, slot, .. }) => {
                rec.parent = ph;
                match w.blocks.get_mut_near(ph, slot) {
                    Some(p) if p.meta & HAS_CHILD == 0 => {
                        p.meta |= HAS_CHILD;
                        p.first_child = hash;
                    }
                    Some(p) => {
                        p.meta |= HAS_MORE;
                        let v = w.more_children.entry(ph).or_default();
                        v.push(hash);
                        rec.meta = v.len() as u32 & SIB_MASK;
                        clean = v.len() < SIB_MASK as usize;
                    }
                    None => {}
                }
                under_hidden && self.same_window(pos - 1)
            }
            Some(ParentRef { prefix: pp, held: false, .. }) => {
                rec.parent = pp;
                let idx = w.wait(place_key((pos - 1, pp)), hash);
                rec.meta = ORPHAN | (idx as u32 & SIB_MASK);
                clean = idx < SIB_MASK as usize;
                true
            }
        };
        if hidden {
            rec.meta |= HIDDEN;
            cur.hidden += 1;
            clean &= !w.sibling_at(&rec, place);
        }
        let slot = w.blocks.put(spot, hash, rec);
        if !hidden && !self.index_add(cur, pos, prefix, w.slot) {
            *w.aliases.entry(place).or_default() += 1;
            clean = false;
        }
        let key = place_key(place);
        if !w.waiting.is_empty() && w.wait_filter.may_hold(key) {
            if let Some(first) = w.waiting.remove(key) {
                clean &= self.adopt(cur, w, hash, place, first, hidden);
            }
        }
        if !clean {
            self.tangle(cur, w);
        }
        (hidden, slot)
    }

    /// The new block `hash` at `place` takes in the orphans waiting for it (`first` and those
    /// in `more_waiting`), showing them unless it is hidden itself in their window; false if
    /// the links or the walk overflowed. Out of line: only a store that fills a hole gets here.
    #[inline(never)]
    fn adopt(
        &self,
        cur: &mut WriteCursor<'_>,
        w: &mut PositionalWriter,
        hash: u64,
        place: (u32, u64),
        first: u64,
        hidden: bool,
    ) -> bool {
        let (pos, prefix) = place;
        let key = place_key(place);
        let mut clean = true;
        let mut orphans = QUEUE.take();
        orphans.clear();
        orphans.push(first);
        if let Some(more) = if w.more_waiting.is_empty() { None } else { w.more_waiting.remove(&key) } {
            orphans.extend_from_slice(&more);
        }
        for &o in &orphans {
            // A key shared by two places (odds about 2^-64) mixes their orphans.
            let waits_here = w.blocks.get(o).is_some_and(|r| r.pos == pos + 1 && r.parent == prefix);
            clean &= waits_here && w.link(hash, o);
        }
        if !hidden || !self.same_window(pos) {
            clean &= self.walk(cur, w, &mut orphans, true, MAX_WALK);
        }
        QUEUE.set(orphans);
        clean
    }

    /// Block `hash` (its record `rec`, already taken out of the reverse map) leaves the index
    /// and its parent's children; its children are pushed on `left` for the caller to make
    /// orphans of (see [`Self::hide`]). `parent_near` is a hint of the parent's reverse-map
    /// slot (see `get_mut_near`).
    #[inline(always)]
    fn remove_rec(
        &self,
        cur: &mut WriteCursor<'_>,
        w: &mut PositionalWriter,
        hash: u64,
        rec: Rec,
        parent_near: usize,
        left: &mut Vec<Option<u64>>,
    ) {
        if w.tangled {
            let key = rec.place();
            match if w.aliases.is_empty() { None } else { w.aliases.get_mut(&key) } {
                Some(n) => {
                    *n -= 1;
                    if *n == 0 {
                        w.aliases.remove(&key);
                    }
                }
                None => self.index_remove(cur, rec.pos, rec.prefix, w.slot),
            }
            return;
        }
        if rec.hidden() {
            cur.hidden -= 1;
        } else {
            self.index_remove(cur, rec.pos, rec.prefix, w.slot);
        }
        if rec.meta & PARENT_GONE != 0 {
            if let Some(listed) = left.get_mut((rec.meta & SIB_MASK) as usize) {
                *listed = None;
            }
        } else {
            w.unlink(&rec, parent_near);
        }
        if rec.meta & HAS_CHILD != 0 {
            self.leave_children(cur, w, hash, &rec, left);
        }
    }

    /// The children of the removed block `hash` (its record `rec`) are marked `PARENT_GONE`
    /// and pushed on `left` for [`Self::hide`]: most leave in the same event (an engine freeing
    /// a sequence from a hole on), so they are not made orphans before it is done, and one
    /// that leaves strikes itself from `left` by the index its mark holds. Out of line: a
    /// removal in the usual order (tail first) finds no children.
    #[inline(never)]
    fn leave_children(
        &self,
        cur: &mut WriteCursor<'_>,
        w: &mut PositionalWriter,
        hash: u64,
        rec: &Rec,
        left: &mut Vec<Option<u64>>,
    ) {
        let more = if rec.meta & HAS_MORE != 0 { w.more_children.remove(&hash) } else { None };
        let more = more.as_deref().unwrap_or(&[]);
        if more.len() >= MAX_WALK || left.len() + more.len() >= SIB_MASK as usize {
            left.clear();
            self.tangle(cur, w);
            return;
        }
        for &child in std::iter::once(&rec.first_child).chain(more) {
            if let Some(r) = w.blocks.get_mut(child) {
                r.meta = (r.meta & !SIB_MASK) | PARENT_GONE | left.len() as u32;
                r.parent = rec.prefix;
                left.push(Some(child));
            }
        }
    }

    /// Takes out the block `hash` (its record `old`) that a store names again at another place,
    /// hiding its orphans at once. Rare, so kept out of the store loop's code.
    #[inline(never)]
    fn drop_replaced(&self, cur: &mut WriteCursor<'_>, w: &mut PositionalWriter, hash: u64, old: Rec) {
        w.blocks.remove(hash);
        let mut left = LEFT.take();
        left.clear();
        self.remove_rec(cur, w, hash, old, NO_SLOT, &mut left);
        self.hide(cur, w, &mut left, 1);
        LEFT.set(left);
    }

    /// Whether positions `pos` and `pos + 1` lie in one jump window: `(k * jump, (k + 1) * jump]`,
    /// position 0 alone in its own.
    #[inline]
    fn same_window(&self, pos: u32) -> bool {
        pos as usize % self.cfg.jump != 0
    }

    /// Makes orphans of the children a write's removals left (`left`, emptied: see
    /// [`Self::leave_children`]) that are still held, and hides them with their descendants in
    /// the same jump window: each orphan's own walk step is taken as it is made, its record at
    /// hand. Done once the write's removals are over, so that no walk hides,
    /// and no wait list holds, what the same event removes next. The walk may visit `MAX_WALK`
    /// blocks per block the write removed; past that, or if the wait lists overflow, the worker
    /// is tangled.
    fn hide(&self, cur: &mut WriteCursor<'_>, w: &mut PositionalWriter, left: &mut Vec<Option<u64>>, removed: usize) {
        if w.tangled || left.is_empty() {
            left.clear();
            return;
        }
        let mut queue = QUEUE.take();
        queue.clear();
        let mut places = PLACES.take();
        places.clear();
        let mut clean = true;
        let mut walked = 0;
        for &child in left.iter().flatten() {
            if let Some((fits, rec)) = w.orphan(child) {
                clean &= fits;
                walked += 1;
                if let Some(rec) = rec {
                    self.step(w, child, &rec, &mut places, &mut queue);
                }
            }
        }
        left.clear();
        clean &= self.walk_on(cur, w, &mut queue, &mut places, false, walked, MAX_WALK.saturating_mul(removed));
        QUEUE.set(queue);
        PLACES.set(places);
        if !clean {
            self.tangle(cur, w);
        }
    }

    /// The part of a walk step after the block `h` (its record `rec`, flag already changed)
    /// was hidden or shown: its index entry fetched, its place noted, its children in the same
    /// window put on `queue`.
    #[inline(always)]
    fn step(&self, w: &PositionalWriter, h: u64, rec: &Rec, places: &mut Vec<(u32, u64)>, queue: &mut Vec<u64>) {
        let deeper = self.same_window(rec.pos);
        if deeper {
            w.prefetch_first_child(rec);
        }
        self.prefetch_entry(rec.pos, rec.prefix);
        places.push(rec.place());
        if deeper {
            w.children_into(h, rec, queue);
        }
    }

    /// Hides (`show` false) or shows the blocks in `queue` (emptied) and their descendants in
    /// the same jump window; false if a shown place turned out to be held twice, or the walk
    /// passed `limit` blocks. Breadth first, so that the record of a child, prefetched when its
    /// parent is visited, has the rest of the walk's front to arrive in. The index entries are
    /// updated after the walk, their fetches started during it, so that they overlap one
    /// another rather than each wait for the one before.
    fn walk(&self, cur: &mut WriteCursor<'_>, w: &mut PositionalWriter, queue: &mut Vec<u64>, show: bool, limit: usize) -> bool {
        let mut places = PLACES.take();
        places.clear();
        let clean = self.walk_on(cur, w, queue, &mut places, show, 0, limit);
        PLACES.set(places);
        clean
    }

    /// [`Self::walk`] from blocks already stepped on: `places` holds theirs (emptied), `walked`
    /// counts them.
    #[allow(clippy::too_many_arguments)]
    fn walk_on(
        &self,
        cur: &mut WriteCursor<'_>,
        w: &mut PositionalWriter,
        queue: &mut Vec<u64>,
        places: &mut Vec<(u32, u64)>,
        show: bool,
        mut walked: usize,
        limit: usize,
    ) -> bool {
        let mut clean = true;
        let mut next = 0;
        while let Some(&h) = queue.get(next) {
            next += 1;
            walked += 1;
            if walked > limit {
                clean = false;
                break;
            }
            let Some(r) = w.blocks.get_mut(h) else { continue };
            if show {
                if !r.hidden() || r.meta & ORPHAN != 0 {
                    continue;
                }
                r.meta &= !HIDDEN;
            } else {
                if r.hidden() {
                    continue;
                }
                r.meta |= HIDDEN;
            }
            let rec = *r;
            self.step(w, h, &rec, places, queue);
        }
        queue.clear();
        for &(pos, prefix) in places.iter() {
            if show {
                cur.hidden -= 1;
                if !self.index_add(cur, pos, prefix, w.slot) {
                    *w.aliases.entry((pos, prefix)).or_default() += 1;
                    clean = false;
                }
            } else {
                cur.hidden += 1;
                self.index_remove(cur, pos, prefix, w.slot);
            }
        }
        places.clear();
        clean
    }

    /// The worker holds a place twice, or a hole's subtree is too big to walk (or its links
    /// overflowed): every hidden block is shown and the worker is checked position by position
    /// from now on, until it is cleared.
    fn tangle(&self, cur: &mut WriteCursor<'_>, w: &mut PositionalWriter) {
        w.tangled = true;
        let hidden: Vec<u64> = w.blocks.iter().filter(|(_, r)| r.hidden()).map(|(h, _)| h).collect();
        for h in hidden {
            let Some(r) = w.blocks.get_mut(h) else { continue };
            r.meta &= !HIDDEN;
            let rec = *r;
            cur.hidden -= 1;
            if !self.index_add(cur, rec.pos, rec.prefix, w.slot) {
                *w.aliases.entry(rec.place()).or_default() += 1;
            }
        }
        w.waiting = LinearMap::default();
        w.more_waiting = SeededMap::default();
        w.more_children = SeededMap::default();
    }

    /// A removal's staged prefetch before its `n`-th block (`key(i)`: the i-th block's hash):
    /// the reverse-map slot 2*D blocks ahead (all up to there at the start), then, that record
    /// being in cache by now, the index entry (none for a hidden block), the parent's record
    /// (for an orphan, its wait slot) and the first child's D ahead, then the entry's spilled
    /// members `STAGE` ahead.
    /// Returns the reverse-map slot of the block D ahead, a hint for its own removal.
    #[inline]
    fn prefetch_removal(
        &self,
        cur: &WriteCursor<'_>,
        w: &PositionalWriter,
        n: usize,
        key: impl Fn(usize) -> Option<u64>,
    ) -> Option<usize> {
        let far = n + 2 * PREFETCH;
        for i in if n == 0 { 0 } else { far }..=far {
            if let Some(h) = key(i) {
                w.blocks.prefetch_run(h);
            }
        }
        let ahead = key(n + PREFETCH).and_then(|h| w.blocks.get_at(h));
        if let Some((rec, _)) = ahead {
            if !rec.hidden() {
                self.prefetch_entry(rec.pos, rec.prefix);
            }
            if rec.meta & ORPHAN != 0 {
                w.waiting.prefetch(rec.wait_key());
            } else if rec.meta & PARENT_GONE == 0 {
                w.blocks.prefetch(rec.parent);
            }
            // A child the removal leaves, if it is not removed first (tail first, it is).
            if rec.meta & HAS_CHILD != 0 && key(n + PREFETCH - 1) != Some(rec.first_child) {
                w.blocks.prefetch(rec.first_child);
            }
        }
        if self.registry.may_spill() {
            if let Some(rec) = key(n + STAGE).and_then(|h| w.blocks.get(h)) {
                cur.prefetch_members(rec.pos, rec.prefix);
            }
        }
        ahead.map(|(_, slot)| slot)
    }

    fn note_holey(&self, w: &PositionalWriter, was: bool) {
        let now = w.holey();
        if now != was {
            self.registry.set_holey(w.slot, now);
        }
    }
}

/// A lookup's hold on the chunk it is probing: consecutive probes in one chunk share one
/// read lock.
struct ReadCursor<'a> {
    index: &'a PositionalIndex,
    chunk: usize,
    guard: Option<RwLockReadGuard<'a, Box<[LevelData; CHUNK]>>>,
}

impl<'a> ReadCursor<'a> {
    fn new(index: &'a PositionalIndex) -> Self {
        ReadCursor { index, chunk: usize::MAX, guard: None }
    }

    /// `alive &= workers holding (pos, prefix)`.
    #[inline]
    fn probe(&mut self, pos: u32, prefix: PrefixHash, alive: &mut SlotBits) {
        let c = pos as usize / CHUNK;
        if c != self.chunk {
            self.guard = None;
            self.chunk = c;
            if let Some(chunk) = self.index.chunk(pos) {
                self.guard = Some(chunk.levels.read());
            }
        }
        let Some(levels) = &self.guard else {
            alive.clear();
            return;
        };
        let level = &levels[pos as usize % CHUNK];
        match level.table.get(prefix.0) {
            None => alive.clear(),
            Some(set) => set.and_into_spilling(&level.spill, alive),
        }
    }

    /// Workers in `set` hold position `lo` and not `hi`: find each one's exact depth.
    fn resolve(
        &mut self,
        prefixes: &[PrefixHash],
        lo: usize,
        hi: usize,
        set: &SlotBits,
        pool: &mut [SlotBits],
        depths: &mut Vec<(Slot, u32)>,
    ) {
        if hi - lo == 1 {
            depths.extend(set.iter().map(|s| (s, hi as u32)));
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let (held, rest) = pool.split_first_mut().expect("pool sized for the jump");
        let (gone, rest) = rest.split_first_mut().expect("pool sized for the jump");
        held.copy_from(set);
        self.probe(mid as u32, prefixes[mid], held);
        gone.copy_from(set);
        gone.and_not(held);
        if !held.is_empty() {
            self.resolve(prefixes, mid, hi, held, rest, depths);
        }
        if !gone.is_empty() {
            self.resolve(prefixes, lo, mid, gone, rest, depths);
        }
    }
}

impl KvIndex for PositionalIndex {
    type Writer = PositionalWriter;

    fn name(&self) -> &'static str {
        "positional"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<PositionalWriter, IndexError> {
        let slot = self.registry.intern(worker)?;
        Ok(PositionalWriter {
            id: worker,
            slot,
            blocks: ReverseMap::default(),
            more_children: SeededMap::default(),
            waiting: LinearMap::default(),
            more_waiting: SeededMap::default(),
            wait_filter: WaitFilter::default(),
            tangled: false,
            aliases: SeededMap::default(),
            beyond: Beyond::default(),
        })
    }

    fn worker_id(w: &PositionalWriter) -> WorkerId {
        w.id
    }

    fn store(&self, w: &mut PositionalWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let held = &w.blocks;
        let blocks = out.within_bound(blocks, held.len() as u64, self.cfg.max_blocks_per_worker, |h| held.get(h).is_some());
        if blocks.is_empty() {
            return out;
        }
        let was_holey = w.holey();
        // Whether the block before the next one is hidden (so the next one is too).
        let mut under_hidden = false;
        let (mut parent_ref, mut pos) = match parent {
            None => (None, 0u32),
            Some(h) => match w.blocks.get_at(h.0) {
                Some((p, slot)) => {
                    under_hidden = p.hidden();
                    (Some(ParentRef { hash: h.0, prefix: p.prefix, held: true, slot }), p.pos + 1)
                }
                None => {
                    w.beyond.orphan_store(h, blocks, &mut out);
                    return out;
                }
            },
        };
        // The chain's prefixes first, so the slots of blocks D ahead can be prefetched.
        let mut chain = CHAIN.take();
        chain.clear();
        let mut prev = parent_ref.map(|p| PrefixHash(p.prefix));
        for b in blocks {
            let p = PrefixHash::child_of(prev, b.tokens_hash);
            chain.push(p.0);
            prev = Some(p);
        }
        w.blocks.reserve(blocks.len().min(self.cfg.max_depth.saturating_sub(pos) as usize));
        for (n, b) in blocks.iter().enumerate().take(PREFETCH) {
            w.blocks.prefetch_run(b.block_hash.0);
            self.prefetch_entry(pos + n as u32, chain[n]);
        }
        let start = pos;
        let mut cur = WriteCursor::new(self);
        for (n, b) in blocks.iter().enumerate() {
            if pos >= self.cfg.max_depth {
                out.too_deep += w.beyond.add(&blocks[n..]);
                break;
            }
            if let Some(ahead) = blocks.get(n + PREFETCH) {
                w.blocks.prefetch_run(ahead.block_hash.0);
                self.prefetch_entry(start + (n + PREFETCH) as u32, chain[n + PREFETCH]);
            }
            let hash = b.block_hash.0;
            let prefix = chain[n];
            let spot = w.blocks.spot(hash);
            if let Some(&old) = w.blocks.at(spot) {
                if old.pos == pos && old.prefix == prefix {
                    out.duplicates += 1;
                    parent_ref = Some(ParentRef { hash, prefix, held: true, slot: spot.slot() });
                    under_hidden = old.hidden();
                    pos += 1;
                    continue;
                }
                // The engine reused this hash for another block: its old placement goes (and
                // `spot` with it: `put` sees the removal and inserts the ordinary way).
                self.drop_replaced(&mut cur, w, hash, old);
                self.placements.fetch_sub(1, Ordering::Relaxed);
                out.replaced += 1;
                if let Some(p) = parent_ref.as_mut() {
                    match w.blocks.get(p.hash) {
                        Some(r) if r.prefix == p.prefix && r.pos + 1 == pos => under_hidden = r.hidden(),
                        _ => p.held = false,
                    }
                }
            }
            let slot;
            (under_hidden, slot) = if w.tangled {
                let slot = w.blocks.put(spot, hash, Rec { parent: 0, prefix, first_child: 0, pos, meta: 0 });
                if !self.index_add(&mut cur, pos, prefix, w.slot) {
                    *w.aliases.entry((pos, prefix)).or_default() += 1;
                }
                (false, slot)
            } else {
                self.place_new(&mut cur, w, hash, spot, (pos, prefix), parent_ref, under_hidden)
            };
            out.stored += 1;
            parent_ref = Some(ParentRef { hash, prefix, held: true, slot });
            pos += 1;
        }
        CHAIN.set(chain);
        w.trim();
        self.placements.fetch_add(out.stored as i64, Ordering::Relaxed);
        self.note_holey(w, was_holey);
        out
    }

    fn remove(&self, w: &mut PositionalWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let was_holey = w.holey();
        let mut cur = WriteCursor::new(self);
        // Children of removed blocks, made orphans and hidden at the end if still held: by
        // then the event's removals of them and their descendants are done, in whatever
        // order it named them.
        let mut left = LEFT.take();
        left.clear();
        // Reverse-map slots of the blocks ahead, as the prefetch saw them (hints: a removal
        // may have moved them since).
        let mut near = [NO_SLOT; RING];
        for (n, h) in hashes.iter().enumerate() {
            if let Some(slot) = self.prefetch_removal(&cur, w, n, |i| hashes.get(i).map(|h| h.0)) {
                near[(n + PREFETCH) % RING] = slot;
            }
            let was_beyond = w.beyond.forget(*h);
            let mut seen = None;
            w.blocks.update_or_remove_near(h.0, near[n % RING], |r| {
                seen = Some(*r);
                true
            });
            match seen {
                Some(rec) => {
                    // Tail first, the parent is often the next block named.
                    let parent_near = match hashes.get(n + 1) {
                        Some(next) if next.0 == rec.parent => near[(n + 1) % RING],
                        _ => NO_SLOT,
                    };
                    self.remove_rec(&mut cur, w, h.0, rec, parent_near, &mut left);
                    out.removed += 1;
                }
                None if was_beyond => {}
                None => out.unknown_removes += 1,
            }
        }
        self.hide(&mut cur, w, &mut left, hashes.len());
        LEFT.set(left);
        w.trim();
        self.placements.fetch_sub(out.removed as i64, Ordering::Relaxed);
        self.note_holey(w, was_holey);
        out
    }

    fn clear(&self, w: &mut PositionalWriter) -> ApplyOutcome {
        let mut cur = WriteCursor::new(self);
        for (_, r) in w.blocks.iter() {
            if r.hidden() {
                cur.hidden -= 1;
            } else {
                self.index_remove(&mut cur, r.pos, r.prefix, w.slot);
            }
        }
        drop(cur);
        let removed = w.blocks.len() as u64;
        self.placements.fetch_sub(removed as i64, Ordering::Relaxed);
        let was_holey = w.holey();
        w.blocks = ReverseMap::default();
        w.more_children = SeededMap::default();
        w.waiting = LinearMap::default();
        w.more_waiting = SeededMap::default();
        w.aliases = SeededMap::default();
        w.beyond.clear();
        w.tangled = false;
        self.note_holey(w, was_holey);
        ApplyOutcome { removed, ..Default::default() }
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        if n == 0 {
            return Vec::new();
        }
        let query = &query[..n];
        SCRATCH.with(|cell| {
            // Pinned from the filter to the naming of its slots: a slot released meanwhile has
            // no new owner until the end.
            let _pinned = crossbeam_epoch::pin();
            let s = &mut *cell.borrow_mut();
            let Scratch { prefixes, alive, probe, pool, depths } = s;
            prefixes.clear();
            depths.clear();
            candidate_slots(&self.registry, opts, alive);
            prefixes.push(PrefixHash::root(query[0]));
            let mut reader = ReadCursor::new(self);
            reader.probe(0, prefixes[0], alive);
            if alive.is_empty() {
                return Vec::new();
            }
            let jump = if self.registry.any_holey(alive) { 1 } else { self.cfg.jump };
            let levels = 2 * (usize::BITS - jump.leading_zeros()) as usize + 2;
            if pool.len() < levels {
                pool.resize_with(levels, SlotBits::default);
            }
            let mut lo = 0;
            while lo + 1 < n && !alive.is_empty() {
                let hi = (lo + jump).min(n - 1);
                // The query's prefix chain, computed once and only as deep as the search goes.
                extend_chain(query, prefixes, hi);
                probe.copy_from(alive);
                reader.probe(hi as u32, prefixes[hi], probe);
                if probe != alive {
                    let (dropped, rest) = pool.split_first_mut().expect("pool is non-empty");
                    dropped.copy_from(alive);
                    dropped.and_not(probe);
                    reader.resolve(prefixes, lo, hi, dropped, rest, depths);
                }
                std::mem::swap(alive, probe);
                lo = hi;
            }
            drop(reader);
            depths.extend(alive.iter().map(|s| (s, n as u32)));
            finish_matches(&self.registry, depths, opts.max_matches)
        })
    }

    fn held(&self, w: &PositionalWriter) -> u64 {
        w.blocks.len() as u64
    }

    /// Counted from the reverse map when asked (the run index keeps its own as it goes).
    fn digest(&self, w: &PositionalWriter) -> crate::digest::Digest {
        crate::digest::Digest::of(w.blocks.iter().map(|(h, _)| h)).join(w.beyond.digest())
    }

    fn save(&self, w: &PositionalWriter) -> Saved {
        let parent = |r: &Rec| {
            if r.pos == 0 {
                SavedParent::Root
            } else if w.tangled {
                SavedParent::Loose
            } else if r.meta & ORPHAN != 0 {
                SavedParent::Place(vec![r.parent])
            } else {
                SavedParent::Block(r.parent)
            }
        };
        let mut blocks: Vec<SavedBlock> =
            w.blocks.iter().map(|(hash, r)| SavedBlock { hash, pos: r.pos, key: r.prefix, parent: parent(r) }).collect();
        blocks.sort_unstable_by_key(|b| (b.pos, b.hash));
        Saved { blocks, beyond: w.beyond.to_vec() }
    }

    fn restore(&self, w: &mut PositionalWriter, saved: &Saved) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let was_holey = w.holey();
        let mut cur = WriteCursor::new(self);
        if saved.blocks.iter().any(|b| b.parent == SavedParent::Loose) {
            self.tangle(&mut cur, w);
        }
        for b in &saved.blocks {
            let place = (b.pos, b.key);
            if b.pos >= self.cfg.max_depth {
                out.too_deep += 1;
                continue;
            }
            let spot = w.blocks.spot(b.hash);
            if w.blocks.at(spot).is_some() {
                out.duplicates += 1;
                continue;
            }
            if w.tangled {
                w.blocks.put(spot, b.hash, Rec { parent: 0, prefix: b.key, first_child: 0, pos: b.pos, meta: 0 });
                if !self.index_add(&mut cur, b.pos, b.key, w.slot) {
                    *w.aliases.entry(place).or_default() += 1;
                }
                out.stored += 1;
                continue;
            }
            let (parent, under_hidden) = match &b.parent {
                SavedParent::Root if b.pos == 0 => (None, false),
                SavedParent::Block(ph) if b.pos > 0 => match w.blocks.get_at(*ph) {
                    Some((p, slot)) if p.pos + 1 == b.pos => {
                        (Some(ParentRef { hash: *ph, prefix: p.prefix, held: true, slot }), p.hidden())
                    }
                    _ => {
                        out.unplaceable += 1;
                        continue;
                    }
                },
                SavedParent::Place(key) if b.pos > 0 && key.len() == 1 => {
                    (Some(ParentRef { hash: 0, prefix: key[0], held: false, slot: NO_SLOT }), true)
                }
                _ => {
                    out.unplaceable += 1;
                    continue;
                }
            };
            self.place_new(&mut cur, w, b.hash, spot, place, parent, under_hidden);
            out.stored += 1;
        }
        drop(cur);
        w.beyond.extend(&saved.beyond);
        self.placements.fetch_add(out.stored as i64, Ordering::Relaxed);
        self.note_holey(w, was_holey);
        out
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            placements: self.placements.load(Ordering::Relaxed).max(0) as u64,
            entries: self.entries.load(Ordering::Relaxed).max(0) as u64,
            workers: self.registry.len() as u64,
            hidden: self.hidden.load(Ordering::Relaxed).max(0) as u64,
        }
    }
}
