//! The positional index (DESIGN §2): for each position, the entries of the blocks cached
//! there, each one prefix hash with the set of workers holding it.
//!
//! DESIGN's layout is position -> local hash -> entry (prefix + workers). Every probe
//! compares the prefix hash anyway, so each position's table is keyed by the prefix hash
//! itself: the two inner steps fold into one probe, and blocks that share a chunk hash under
//! different parents (collisions) are simply separate entries, never merged.
//!
//! Lookups use jump search: probe every `jump` positions and binary-search inside a jump
//! only where workers dropped out. That is exact only for workers whose cache is
//! prefix-closed (every held block's parent is held), so each writer counts its orphans
//! (blocks whose parent was removed under them); a lookup that meets a worker with orphans
//! checks every position instead.

use super::linear::{prefetch_raw, LinearMap};
use super::{candidate_slots, finish_matches, ApplyOutcome, Beyond, IndexError, IndexStats, KvIndex, MatchOptions, WorkerMatch};
use crate::hash::{extend_chain, BlockHash, LocalHash, PrefixHash, StoredBlock, WorkerId};
use crate::seeded::SeededMap;
use crate::workers::{Slot, SlotBits, Spill, WorkerRegistry, WorkerSet};
use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::cell::RefCell;
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
}

impl Default for PositionalConfig {
    fn default() -> Self {
        PositionalConfig { jump: 64, max_depth: 1 << 16, max_workers: 1 << 16 }
    }
}

/// All entries at one position, behind one lock: prefix hash -> workers holding it.
#[derive(Default)]
struct LevelData {
    table: LinearMap<WorkerSet>,
    /// Members of entries whose set spans more than one inline window, by prefix.
    spill: Spill<u64>,
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
    levels: RwLock<Box<[LevelData]>>,
    hints: Box<[Hint]>,
}

impl Chunk {
    fn new() -> Self {
        Chunk {
            levels: RwLock::new((0..CHUNK).map(|_| LevelData::default()).collect()),
            hints: (0..CHUNK).map(|_| Hint::default()).collect(),
        }
    }
}

/// A writer's hold on the chunk it is applying to: the lock is kept across consecutive
/// blocks of the same chunk (at most `MAX_HOLD`), and index counters are summed locally.
struct WriteCursor<'a> {
    index: &'a PositionalIndex,
    chunk: usize,
    guard: Option<RwLockWriteGuard<'a, Box<[LevelData]>>>,
    held: u32,
    entries: i64,
}

impl<'a> WriteCursor<'a> {
    fn new(index: &'a PositionalIndex) -> Self {
        WriteCursor { index, chunk: 0, guard: None, held: 0, entries: 0 }
    }

    /// The level at `pos`, write-locked; `create` allocates its chunk if missing.
    fn level(&mut self, pos: u32, create: bool) -> Option<(&mut LevelData, &'a Hint)> {
        let c = pos as usize / CHUNK;
        let slot = self.index.chunks.get(c)?;
        let chunk: &'a Chunk = if create { slot.get_or_init(Chunk::new) } else { slot.get()? };
        if self.guard.is_none() || self.chunk != c || self.held >= MAX_HOLD {
            if let Some(g) = self.guard.take() {
                RwLockWriteGuard::unlock_fair(g);
            }
            self.guard = Some(chunk.levels.write());
            self.chunk = c;
            self.held = 0;
        }
        self.held += 1;
        let levels = self.guard.as_mut()?;
        Some((&mut levels[pos as usize % CHUNK], &chunk.hints[pos as usize % CHUNK]))
    }
}

impl Drop for WriteCursor<'_> {
    fn drop(&mut self) {
        if self.entries != 0 {
            self.index.entries.fetch_add(self.entries, Ordering::Relaxed);
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
}

/// A held block in a worker's reverse map (32 bytes with its key, the engine hash).
#[derive(Clone, Copy, Debug, Default)]
struct Rec {
    /// Engine hash of the parent this block was stored under (unused at position 0).
    parent: u64,
    prefix: u64,
    pos: u32,
    /// Held blocks stored under this one.
    children: u32,
}

/// A worker's reverse map: engine block hash -> (position, prefix hash), plus the
/// bookkeeping that tells whether its cache is prefix-closed.
pub struct PositionalWriter {
    id: WorkerId,
    slot: Slot,
    blocks: LinearMap<Rec>,
    /// Held blocks whose parent is not held (the cache is not prefix-closed while > 0).
    orphans: u64,
    /// Orphans by the engine hash of the parent they wait for: (its position, its prefix,
    /// how many wait).
    waiting: SeededMap<u64, (u32, u64, u32)>,
    /// Set when an engine hash was reused in a way the orphan count cannot follow; the
    /// worker is then always checked position by position, until it is cleared.
    tangled: bool,
    /// Extra records holding an already-held (position, prefix) under another engine hash.
    aliases: SeededMap<(u32, u64), u32>,
    /// Scratch: prefix hashes of the chain being stored.
    chain: Vec<u64>,
    /// Its blocks past `max_depth` (see [`Beyond`]).
    beyond: Beyond,
}

/// How far ahead of the block being applied its reverse-map slot is prefetched.
const PREFETCH: usize = 8;

impl PositionalWriter {
    fn holey(&self) -> bool {
        self.orphans > 0 || self.tangled
    }

    fn add_waiting(&mut self, parent: u64, parent_pos: u32, parent_prefix: u64, n: u32) {
        self.orphans += n as u64;
        match self.waiting.entry(parent) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((parent_pos, parent_prefix, n));
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (pos, p, c) = o.get_mut();
                if (*pos, *p) != (parent_pos, parent_prefix) {
                    self.tangled = true;
                }
                *c += n;
            }
        }
    }

    /// Orphans waiting for the block `hash` at (`pos`, `prefix`) attach to it now.
    fn take_waiting(&mut self, hash: u64, pos: u32, prefix: u64) -> u32 {
        match self.waiting.get(&hash) {
            Some(&(at, p, n)) if (at, p) == (pos, prefix) => {
                self.waiting.remove(&hash);
                self.orphans -= n as u64;
                n
            }
            Some(_) => {
                // Same engine hash, another block: its orphans are not this block's children.
                self.tangled = true;
                0
            }
            None => 0,
        }
    }

    /// An orphan stored under `parent` goes away.
    fn drop_waiting(&mut self, parent: u64) {
        if let Some((_, _, n)) = self.waiting.get_mut(&parent) {
            *n -= 1;
            self.orphans -= 1;
            if *n == 0 {
                self.waiting.remove(&parent);
            }
        } else {
            self.tangled = true;
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
        }
    }

    #[inline]
    fn chunk(&self, pos: u32) -> Option<&Chunk> {
        self.chunks.get(pos as usize / CHUNK)?.get()
    }

    /// Adds `slot` to the entry (pos, prefix); false if it was already there.
    fn index_add(&self, cur: &mut WriteCursor<'_>, pos: u32, prefix: u64, slot: Slot) -> bool {
        let Some((level, hint)) = cur.level(pos, true) else { return true };
        let LevelData { table, spill } = level;
        let (set, new) = table.upsert(prefix, WorkerSet::EMPTY);
        let added = set.insert_spilling(slot, prefix, spill);
        if new {
            hint.publish(level);
            cur.entries += 1;
        }
        added
    }

    /// Removes `slot` from the entry (pos, prefix), dropping the entry when empty.
    fn index_remove(&self, cur: &mut WriteCursor<'_>, pos: u32, prefix: u64, slot: Slot) {
        let Some((level, hint)) = cur.level(pos, false) else { return };
        let LevelData { table, spill } = level;
        let emptied = table.update_or_remove(prefix, |set| {
            set.remove_spilling(slot, prefix, spill);
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

    /// Block `hash` (its record `rec`, already taken out of the reverse map) leaves the index
    /// and its parent's children.
    fn remove_rec(&self, cur: &mut WriteCursor<'_>, w: &mut PositionalWriter, hash: u64, rec: Rec) {
        let key = (rec.pos, rec.prefix);
        match if w.aliases.is_empty() { None } else { w.aliases.get_mut(&key) } {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    w.aliases.remove(&key);
                }
            }
            None => self.index_remove(cur, rec.pos, rec.prefix, w.slot),
        }
        if rec.children > 0 {
            w.add_waiting(hash, rec.pos, rec.prefix, rec.children);
        }
        if rec.pos > 0 {
            match w.blocks.get_mut(rec.parent).filter(|p| p.pos + 1 == rec.pos) {
                Some(p) => p.children = p.children.saturating_sub(1),
                None => w.drop_waiting(rec.parent),
            }
        }
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
    guard: Option<RwLockReadGuard<'a, Box<[LevelData]>>>,
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
            Some(set) => set.and_into_spilling(prefix.0, &level.spill, alive),
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
            blocks: LinearMap::default(),
            orphans: 0,
            waiting: SeededMap::default(),
            tangled: false,
            aliases: SeededMap::default(),
            chain: Vec::new(),
            beyond: Beyond::default(),
        })
    }

    fn worker_id(w: &PositionalWriter) -> WorkerId {
        w.id
    }

    fn store(&self, w: &mut PositionalWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let was_holey = w.holey();
        let (mut parent_ref, mut pos) = match parent {
            None => (None, 0u32),
            Some(h) => match w.blocks.get(h.0) {
                Some(p) => (Some(ParentRef { hash: h.0, prefix: p.prefix, held: true }), p.pos + 1),
                None if w.beyond.contains(h) => {
                    out.too_deep = w.beyond.add(blocks);
                    return out;
                }
                None => {
                    out.unplaceable = blocks.len() as u64;
                    return out;
                }
            },
        };
        // The chain's prefixes first, so the slots of blocks D ahead can be prefetched.
        let mut chain = std::mem::take(&mut w.chain);
        chain.clear();
        let mut prev = parent_ref.map(|p| PrefixHash(p.prefix));
        for b in blocks {
            let p = PrefixHash::child_of(prev, b.tokens_hash);
            chain.push(p.0);
            prev = Some(p);
        }
        for (n, b) in blocks.iter().enumerate().take(PREFETCH) {
            w.blocks.prefetch(b.block_hash.0);
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
                w.blocks.prefetch(ahead.block_hash.0);
                self.prefetch_entry(start + (n + PREFETCH) as u32, chain[n + PREFETCH]);
            }
            let hash = b.block_hash.0;
            let prefix = chain[n];
            if let Some(&old) = w.blocks.get(hash) {
                if old.pos == pos && old.prefix == prefix {
                    out.duplicates += 1;
                    parent_ref = Some(ParentRef { hash, prefix, held: true });
                    pos += 1;
                    continue;
                }
                // The engine reused this hash for another block: its old placement goes.
                w.blocks.remove(hash);
                self.remove_rec(&mut cur, w, hash, old);
                self.placements.fetch_sub(1, Ordering::Relaxed);
                out.replaced += 1;
                if let Some(p) = parent_ref.as_mut() {
                    p.held = w.blocks.get(p.hash).is_some_and(|r| r.prefix == p.prefix && r.pos + 1 == pos);
                }
            }
            let mut rec = Rec { parent: 0, prefix, pos, children: 0 };
            match parent_ref {
                Some(ParentRef { hash: ph, held: true, .. }) => {
                    rec.parent = ph;
                    if let Some(p) = w.blocks.get_mut(ph) {
                        p.children += 1;
                    }
                }
                Some(ParentRef { hash: ph, prefix: pp, held: false }) => {
                    rec.parent = ph;
                    w.add_waiting(ph, pos - 1, pp, 1);
                }
                None => {}
            }
            if !w.waiting.is_empty() {
                rec.children += w.take_waiting(hash, pos, prefix);
            }
            w.blocks.insert(hash, rec);
            if !self.index_add(&mut cur, pos, prefix, w.slot) {
                *w.aliases.entry((pos, prefix)).or_default() += 1;
            }
            out.stored += 1;
            parent_ref = Some(ParentRef { hash, prefix, held: true });
            pos += 1;
        }
        w.chain = chain;
        self.placements.fetch_add(out.stored as i64, Ordering::Relaxed);
        self.note_holey(w, was_holey);
        out
    }

    fn remove(&self, w: &mut PositionalWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let was_holey = w.holey();
        // Two-stage prefetch: the reverse-map slot 2*D ahead, then (once that record is in
        // cache) the index entry and the parent's record D ahead.
        for h in hashes.iter().take(2 * PREFETCH) {
            w.blocks.prefetch(h.0);
        }
        let mut cur = WriteCursor::new(self);
        for (n, h) in hashes.iter().enumerate() {
            if let Some(ahead) = hashes.get(n + 2 * PREFETCH) {
                w.blocks.prefetch(ahead.0);
            }
            if let Some(rec) = hashes.get(n + PREFETCH).and_then(|a| w.blocks.get(a.0)) {
                self.prefetch_entry(rec.pos, rec.prefix);
                w.blocks.prefetch(rec.parent);
            }
            let was_beyond = w.beyond.forget(*h);
            match w.blocks.remove(h.0) {
                Some(rec) => {
                    self.remove_rec(&mut cur, w, h.0, rec);
                    out.removed += 1;
                }
                None if was_beyond => {}
                None => out.unknown_removes += 1,
            }
        }
        self.placements.fetch_sub(out.removed as i64, Ordering::Relaxed);
        self.note_holey(w, was_holey);
        out
    }

    fn clear(&self, w: &mut PositionalWriter) -> ApplyOutcome {
        let mut cur = WriteCursor::new(self);
        for (_, r) in w.blocks.iter() {
            self.index_remove(&mut cur, r.pos, r.prefix, w.slot);
        }
        drop(cur);
        let removed = w.blocks.len() as u64;
        self.placements.fetch_sub(removed as i64, Ordering::Relaxed);
        let was_holey = w.holey();
        w.blocks = LinearMap::default();
        w.waiting = SeededMap::default();
        w.aliases = SeededMap::default();
        w.beyond.clear();
        w.orphans = 0;
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
            finish_matches(&self.registry, depths)
        })
    }

    fn stats(&self) -> IndexStats {
        IndexStats {
            placements: self.placements.load(Ordering::Relaxed).max(0) as u64,
            entries: self.entries.load(Ordering::Relaxed).max(0) as u64,
            workers: self.registry.len() as u64,
        }
    }
}
