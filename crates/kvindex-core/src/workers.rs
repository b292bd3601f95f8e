//! Worker interning and worker sets: each `(worker_id, dp_rank)` gets a dense slot, reused
//! after the worker is removed and every lookup that could have seen it is over, so that
//! index entries hold workers as bits.

use crate::hash::WorkerId;
use crate::index::linear::prefetch_lines;
use crate::seeded::SeededMap;
use crate::sync::{epoch, Arc, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Mutex, Ordering};
use smallvec::SmallVec;

/// A worker's dense slot number.
pub type Slot = u32;

/// Interns worker identities to dense slots and maps slots back for lookup answers.
///
/// Lookups read the slot-to-worker table without a lock. A released slot is reused only after
/// every lookup in flight at its release has finished (its free goes through the epoch
/// collector), so a lookup that met a slot in a coverage word and names it at the end names
/// the worker that held it, or nobody if that worker left meanwhile: never the next owner.
pub struct WorkerRegistry {
    /// The most slots handed out at once.
    capacity: u32,
    /// Writers' side: workers to slots, free slots.
    inner: Mutex<RegistryInner>,
    /// Slot -> worker, for lookups: read without a lock.
    ids: IdTable,
    /// One past the highest slot ever handed out: the width of a dense slot set.
    high: AtomicU32,
    /// Slots that lookups must check position by position (a tangled positional writer).
    holey: Box<[AtomicU64]>,
    /// Set once a slot past the first inline window is handed out: only then can a worker set
    /// spill, so writers skip prefetching spilled members before.
    wide: AtomicBool,
    /// Released slots whose grace period is over, set by the epoch collector (which may run
    /// on a lookup's thread, so it takes no lock): harvested into the free list by `intern`.
    freed: Arc<Vec<AtomicU64>>,
}

#[derive(Default)]
struct RegistryInner {
    /// Workers and their slots.
    by_id: SeededMap<WorkerId, Slot>,
    /// Slots free for reuse, the highest first (so `pop` takes the lowest).
    free: Vec<Slot>,
    /// The next slot never handed out.
    next: Slot,
    /// Slots released and not yet back in `free` (their grace period may still run).
    pending: u32,
}

/// Why a worker could not be given a slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// Every slot is taken; the payload is the capacity.
    #[error("worker registry is full ({0} slots)")]
    Full(u32),
    /// The worker already has a slot, and so a writer: a second one would share its state.
    #[error("worker {0:?} already has a writer")]
    Taken(WorkerId),
}

/// Cells per chunk of the slot-to-worker table.
#[cfg(not(loom))]
const ID_CHUNK: usize = 1024;
/// Cells per chunk of the slot-to-worker table (few in the model).
#[cfg(loom)]
const ID_CHUNK: usize = 4;

/// A slot's worker: its id, and its rank with a presence bit, written before the bit.
#[derive(Default)]
struct IdCell {
    worker_id: AtomicU64,
    /// `dp_rank | PRESENT` while the slot is held, 0 when not.
    rank: AtomicU64,
}

const PRESENT: u64 = 1 << 32;

/// Slot -> worker in chunks allocated on first use, never moved or freed while the registry
/// lives: a lookup reads a cell with two atomic loads and no lock.
struct IdTable {
    chunks: Box<[AtomicPtr<[IdCell; ID_CHUNK]>]>,
}

impl IdTable {
    fn new(capacity: u32) -> IdTable {
        IdTable { chunks: (0..(capacity as usize).div_ceil(ID_CHUNK)).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect() }
    }

    /// The cell of `slot`, if its chunk exists.
    #[inline]
    fn cell(&self, slot: Slot) -> Option<&IdCell> {
        let chunk = self.chunks.get(slot as usize / ID_CHUNK)?.load(Ordering::Acquire);
        // SAFETY: chunks are published once and freed only with the table.
        unsafe { chunk.as_ref() }.map(|cells| &cells[slot as usize % ID_CHUNK])
    }

    /// Writer (registry locked): the cell of `slot`, allocating its chunk.
    fn cell_mut(&self, slot: Slot) -> &IdCell {
        let at = &self.chunks[slot as usize / ID_CHUNK];
        if at.load(Ordering::Acquire).is_null() {
            let chunk: Box<[IdCell; ID_CHUNK]> = Box::new(std::array::from_fn(|_| IdCell::default()));
            at.store(Box::into_raw(chunk), Ordering::Release);
        }
        match self.cell(slot) {
            Some(cell) => cell,
            None => unreachable!("the chunk was just published"),
        }
    }

    #[inline]
    fn get(&self, slot: Slot) -> Option<WorkerId> {
        let cell = self.cell(slot)?;
        let rank = cell.rank.load(Ordering::Acquire);
        (rank & PRESENT != 0).then(|| WorkerId::new(cell.worker_id.load(Ordering::Relaxed), rank as u32))
    }

    /// Writer: `slot` is `worker`'s (the slot is free: no lookup reads its cell meanwhile).
    fn set(&self, slot: Slot, worker: WorkerId) {
        let cell = self.cell_mut(slot);
        cell.worker_id.store(worker.worker_id, Ordering::Relaxed);
        cell.rank.store(u64::from(worker.dp_rank) | PRESENT, Ordering::Release);
    }

    /// Writer: `slot` is nobody's.
    fn clear(&self, slot: Slot) {
        if let Some(cell) = self.cell(slot) {
            cell.rank.store(0, Ordering::Release);
        }
    }
}

impl Drop for IdTable {
    fn drop(&mut self) {
        for at in self.chunks.iter() {
            let chunk = at.load(Ordering::Relaxed);
            if !chunk.is_null() {
                // SAFETY: the table is being dropped, so no reader is left.
                drop(unsafe { Box::from_raw(chunk) });
            }
        }
    }
}

/// How often `intern` waits for the collector to give back a released slot when every other
/// slot is taken, before it reports the registry full.
const FREE_WAITS: usize = 10_000;

impl WorkerRegistry {
    /// A registry for at most `capacity` workers at once.
    pub fn new(capacity: u32) -> Self {
        let words = capacity.div_ceil(64) as usize;
        WorkerRegistry {
            capacity,
            inner: Mutex::new(RegistryInner::default()),
            ids: IdTable::new(capacity),
            high: AtomicU32::new(0),
            holey: (0..words).map(|_| AtomicU64::new(0)).collect(),
            wide: AtomicBool::new(false),
            freed: Arc::new((0..words).map(|_| AtomicU64::new(0)).collect()),
        }
    }

    /// The most workers it holds at once.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// A slot for `id`, the lowest free one; an error if `id` has one already (its writer
    /// exists: a second would silently share its state) or if every slot is taken.
    pub fn intern(&self, id: WorkerId) -> Result<Slot, RegistryError> {
        let mut inner = self.inner.lock();
        if inner.by_id.contains_key(&id) {
            return Err(RegistryError::Taken(id));
        }
        let slot = match self.take_free(&mut inner) {
            Some(s) => s,
            None => return Err(RegistryError::Full(self.capacity)),
        };
        inner.by_id.insert(id, slot);
        if slot >= WINDOW_BITS {
            self.wide.store(true, Ordering::Relaxed);
        }
        self.ids.set(slot, id);
        self.high.fetch_max(slot + 1, Ordering::Release);
        Ok(slot)
    }

    /// The lowest free slot: a released one whose grace period is over, else a new one; when
    /// every slot is taken but some wait for their grace period, waits for it.
    fn take_free(&self, inner: &mut RegistryInner) -> Option<Slot> {
        for attempt in 0..=FREE_WAITS {
            self.harvest(inner);
            if let Some(s) = inner.free.pop() {
                return Some(s);
            }
            if inner.next < self.capacity {
                inner.next += 1;
                return Some(inner.next - 1);
            }
            if inner.pending == 0 || attempt == FREE_WAITS {
                return None;
            }
            epoch::pin().flush();
            crate::sync::yield_now();
        }
        None
    }

    /// Moves slots the collector gave back into the free list.
    fn harvest(&self, inner: &mut RegistryInner) {
        if inner.pending == 0 {
            return;
        }
        let mut got = false;
        for (i, w) in self.freed.iter().enumerate() {
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::Acquire);
            while bits != 0 {
                inner.free.push(i as Slot * 64 + bits.trailing_zeros());
                inner.pending -= 1;
                bits &= bits - 1;
                got = true;
            }
        }
        if got {
            // Lowest slots first keeps worker sets inside the first inline window.
            inner.free.sort_unstable_by(|a, b| b.cmp(a));
        }
    }

    /// Frees the slot of `id`. The caller has already withdrawn its blocks from lookups. The
    /// slot names nobody from now on and is handed out again once every lookup in flight now
    /// has finished.
    pub fn release(&self, id: WorkerId) {
        let mut inner = self.inner.lock();
        let Some(slot) = inner.by_id.remove(&id) else { return };
        self.ids.clear(slot);
        self.set_holey(slot, false);
        inner.pending += 1;
        drop(inner);
        let freed = self.freed.clone();
        let guard = epoch::pin();
        guard.defer(move || {
            freed[slot as usize / 64].fetch_or(1 << (slot % 64), Ordering::Release);
        });
        guard.flush();
    }

    /// The slot of `id`, if it has one.
    pub fn slot(&self, id: WorkerId) -> Option<Slot> {
        self.inner.lock().by_id.get(&id).copied()
    }

    /// The worker holding `slot`, read without a lock.
    #[inline]
    pub fn worker(&self, slot: Slot) -> Option<WorkerId> {
        self.ids.get(slot)
    }

    /// Calls `f` with the worker of every slot of `set` that has one, read without a lock:
    /// one look-up of the table's chunk per chunk of slots, not per slot.
    pub fn name_each(&self, set: &SlotBits, mut f: impl FnMut(WorkerId)) {
        let mut at: Option<(usize, &[IdCell; ID_CHUNK])> = None;
        for (i, &word) in set.words.iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                let slot = i * 64 + rest.trailing_zeros() as usize;
                rest &= rest - 1;
                let number = slot / ID_CHUNK;
                let chunk = match at {
                    Some((held, chunk)) if held == number => chunk,
                    _ => {
                        let published =
                            self.ids.chunks.get(number).map_or(std::ptr::null_mut(), |ptr| ptr.load(Ordering::Acquire));
                        // SAFETY: chunks are published once and freed only with the table.
                        let Some(chunk) = (unsafe { published.as_ref() }) else { continue };
                        at = Some((number, chunk));
                        chunk
                    }
                };
                let cell = &chunk[slot % ID_CHUNK];
                let rank = cell.rank.load(Ordering::Acquire);
                if rank & PRESENT != 0 {
                    f(WorkerId::new(cell.worker_id.load(Ordering::Relaxed), rank as u32));
                }
            }
        }
    }

    /// Whether worker sets may have spilled: a slot past the first inline window was handed out.
    #[inline]
    pub fn may_spill(&self) -> bool {
        self.wide.load(Ordering::Relaxed)
    }

    /// Number of workers holding a slot.
    pub fn len(&self) -> usize {
        self.inner.lock().by_id.len()
    }

    /// True when no worker holds a slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// One past the highest slot ever assigned: the width of a dense slot bitset.
    #[inline]
    pub fn high_water(&self) -> u32 {
        self.high.load(Ordering::Acquire)
    }

    pub(crate) fn set_holey(&self, slot: Slot, on: bool) {
        let (w, b) = ((slot / 64) as usize, slot % 64);
        if on {
            self.holey[w].fetch_or(1 << b, Ordering::Relaxed);
        } else {
            self.holey[w].fetch_and(!(1 << b), Ordering::Relaxed);
        }
    }

    /// True if any slot in `set` is holey.
    pub(crate) fn any_holey(&self, set: &SlotBits) -> bool {
        set.words
            .iter()
            .enumerate()
            .any(|(i, &w)| w != 0 && self.holey.get(i).is_some_and(|h| h.load(Ordering::Relaxed) & w != 0))
    }
}

/// Slots per inline window of a [`WorkerSet`].
const WINDOW_BITS: u32 = 56;
const MEMBER_MASK: u64 = (1 << WINDOW_BITS) - 1;
const SPILLED_WINDOW: u64 = 255;
/// The window byte of an inline list: up to `LIST_MAX` slots below 2^16 anywhere, in 16-bit
/// lanes, their count in the byte below.
const LIST_WINDOW: u64 = 254;
const LIST_MAX: u32 = 3;
const LANE: u32 = 16;

/// A set of worker slots in 8 bytes, inline in one of two forms: up to 56 slots of one aligned
/// window (the top byte names the window), or up to three slots anywhere below 2^16, as a
/// list. On a big fleet most entries are held by two or three workers in different windows,
/// which the list keeps without a spill. A larger set spanning windows is marked spilled and
/// its members live in the [`Spill`] kept by the owner of the set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerSet(u64);

/// What inserting into a [`WorkerSet`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum SetInsert {
    /// The slot was not in the set and now is.
    Added,
    /// The slot was already in the set.
    AlreadyPresent,
    /// The set must spill: its members plus the slot move into the owner's [`Spill`].
    NeedsSpill,
}

impl WorkerSet {
    /// No worker.
    pub const EMPTY: WorkerSet = WorkerSet(0);
    /// The window byte of a set whose members live in the owner's [`Spill`] (the other bits
    /// hold their index there).
    const SPILLED: WorkerSet = WorkerSet(SPILLED_WINDOW << WINDOW_BITS);

    /// No member.
    #[inline]
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Its members live in the owner's [`Spill`].
    #[inline]
    pub fn is_spilled(self) -> bool {
        self.0 >> WINDOW_BITS == SPILLED_WINDOW
    }

    #[inline]
    fn window(self) -> u64 {
        self.0 >> WINDOW_BITS
    }

    /// Held as an inline list (see `LIST_WINDOW`).
    #[inline]
    fn is_list(self) -> bool {
        self.window() == LIST_WINDOW
    }

    /// Members of an inline list.
    #[inline]
    fn list_len(self) -> u32 {
        ((self.0 >> (LIST_MAX * LANE)) & 0xff) as u32
    }

    /// The `i`-th member of an inline list.
    #[inline]
    fn lane(self, i: u32) -> Slot {
        ((self.0 >> (i * LANE)) & 0xffff) as Slot
    }

    /// The inline list of `slots` (ascending, at most `LIST_MAX`, each below 2^16).
    fn list_of(slots: &[Slot]) -> WorkerSet {
        let lanes = slots.iter().enumerate().fold(0u64, |acc, (i, &s)| acc | (u64::from(s) << (i as u32 * LANE)));
        WorkerSet((LIST_WINDOW << WINDOW_BITS) | ((slots.len() as u64) << (LIST_MAX * LANE)) | lanes)
    }

    #[inline]
    fn locate(slot: Slot) -> (u64, u64) {
        ((slot / WINDOW_BITS) as u64, 1u64 << (slot % WINDOW_BITS))
    }

    /// Inline membership test; not valid on a spilled set.
    #[inline]
    pub fn contains_inline(self, slot: Slot) -> bool {
        if self.is_list() {
            return (0..self.list_len()).any(|i| self.lane(i) == slot);
        }
        let (w, bit) = Self::locate(slot);
        !self.is_empty() && self.window() == w && self.0 & bit != 0
    }

    /// Adds `slot` inline when it fits.
    #[inline]
    pub fn insert(&mut self, slot: Slot) -> SetInsert {
        debug_assert!(!self.is_spilled());
        let (w, bit) = Self::locate(slot);
        if w >= LIST_WINDOW {
            self.insert_far(slot)
        } else if self.is_empty() {
            self.0 = (w << WINDOW_BITS) | bit;
            SetInsert::Added
        } else if self.window() != w {
            self.insert_far(slot)
        } else if self.0 & bit != 0 {
            SetInsert::AlreadyPresent
        } else {
            self.0 |= bit;
            SetInsert::Added
        }
    }

    /// Adds `slot` outside the set's window (or to a list): as a list while one fits. Kept out
    /// of line, so that sets of one window (every set of a small fleet) pay nothing for lists.
    #[inline(never)]
    fn insert_far(&mut self, slot: Slot) -> SetInsert {
        if self.contains_inline(slot) {
            return SetInsert::AlreadyPresent;
        }
        let len = if self.is_list() { self.list_len() } else { (self.0 & MEMBER_MASK).count_ones() };
        if len >= LIST_MAX || slot >> LANE != 0 {
            return SetInsert::NeedsSpill;
        }
        let mut slots = [slot; LIST_MAX as usize];
        for (to, s) in slots.iter_mut().zip(self.members()) {
            *to = s;
        }
        let slots = &mut slots[..len as usize + 1];
        slots.sort_unstable();
        *self = Self::list_of(slots);
        SetInsert::Added
    }

    /// Removes `slot` from an inline set; returns whether it was there.
    #[inline]
    pub fn remove(&mut self, slot: Slot) -> bool {
        debug_assert!(!self.is_spilled());
        if self.is_list() {
            return self.remove_listed(slot);
        }
        let (w, bit) = Self::locate(slot);
        if self.is_empty() || self.window() != w || self.0 & bit == 0 {
            return false;
        }
        self.0 &= !bit;
        if self.0 & MEMBER_MASK == 0 {
            self.0 = 0;
        }
        true
    }

    /// Removes `slot` from an inline list, back to the window form once one window holds the
    /// rest (out of line, as `insert_far`).
    #[inline(never)]
    fn remove_listed(&mut self, slot: Slot) -> bool {
        if !self.contains_inline(slot) {
            return false;
        }
        let mut rest = [0; LIST_MAX as usize];
        let mut n = 0;
        for s in self.members().filter(|&s| s != slot) {
            rest[n] = s;
            n += 1;
        }
        let rest = &rest[..n];
        *self = Self::inline_of(rest.first().copied(), rest.last().copied(), rest.iter().copied())
            .unwrap_or_else(|| Self::list_of(rest));
        true
    }

    /// Intersects `alive` with this inline set in place.
    #[inline]
    pub fn and_into(self, alive: &mut SlotBits) {
        debug_assert!(!self.is_spilled());
        if self.is_empty() {
            alive.clear();
            return;
        }
        if self.is_list() {
            self.and_listed_into(alive);
            return;
        }
        // The 56-slot window covers at most two 64-bit words of the dense set.
        let start = self.window() as u32 * WINDOW_BITS;
        let (w0, off) = ((start / 64) as usize, start % 64);
        let m = self.0 & MEMBER_MASK;
        let lo = m << off;
        let hi = if off == 0 { 0 } else { m >> (64 - off) };
        for (i, word) in alive.words.iter_mut().enumerate() {
            if i == w0 {
                *word &= lo;
            } else if i == w0 + 1 {
                *word &= hi;
            } else {
                *word = 0;
            }
        }
    }

    /// `alive &= self` for an inline list.
    fn and_listed_into(self, alive: &mut SlotBits) {
        let mut kept = [NO_SLOT; LIST_MAX as usize];
        for (i, k) in kept.iter_mut().enumerate().take(self.list_len() as usize) {
            let s = self.lane(i as u32);
            if alive.contains(s) {
                *k = s;
            }
        }
        alive.words.fill(0);
        kept.iter().filter(|&&s| s != NO_SLOT).for_each(|&s| alive.insert(s));
    }

    /// Tries to fold a spilled set back inline; `None` if it still spans windows and is too big
    /// for a list. Its first and last members tell whether it spans windows, so a set of a
    /// thousand workers costs a word scan, not a walk.
    pub fn from_bits(bits: &SlotBits) -> Option<WorkerSet> {
        Self::from_words(&bits.words)
    }

    /// As [`Self::from_bits`], on a bitset's words.
    fn from_words(words: &[u64]) -> Option<WorkerSet> {
        Self::inline_of(first_of(words), last_of(words), iter_of(words))
    }

    /// The inline set of `slots` (ascending), or `None` if they span windows and are too many
    /// for a list.
    fn from_slots(slots: &[Slot]) -> Option<WorkerSet> {
        Self::inline_of(slots.first().copied(), slots.last().copied(), slots.iter().copied())
    }

    /// The inline set of `slots` (ascending), whose lowest and highest are `first` and `last`;
    /// `None` if they span windows and are too many for a list.
    fn inline_of(first: Option<Slot>, last: Option<Slot>, mut slots: impl Iterator<Item = Slot>) -> Option<WorkerSet> {
        let (Some(first), Some(last)) = (first, last) else { return Some(WorkerSet::EMPTY) };
        if first / WINDOW_BITS != last / WINDOW_BITS || u64::from(first / WINDOW_BITS) >= LIST_WINDOW {
            let few: SmallVec<[Slot; 4]> = slots.by_ref().take(LIST_MAX as usize + 1).collect();
            return (few.len() <= LIST_MAX as usize && last >> LANE == 0).then(|| Self::list_of(&few));
        }
        let mut s = WorkerSet::EMPTY;
        for slot in slots {
            if s.insert(slot) == SetInsert::NeedsSpill {
                return None;
            }
        }
        Some(s)
    }
}

/// Whether `len` slots up to `last` are kept as a list: when it takes at most half the bytes
/// of a bitset (4 bytes a slot against 8 per 64 slots) and that bitset is wide (8 words or
/// more; narrower ones intersect faster than a list and cost about as much). A bitset turns
/// back into a list only at half that, so a set on the boundary does not convert on every
/// change.
fn few_fits(len: usize, last: Slot) -> bool {
    let words = last as usize / 64 + 1;
    words >= 8 && len <= words.min(FEW_MAX)
}

/// Most slots a set keeps as a list: every list of a level takes the room of its longest, so
/// a cap keeps them half a cache line.
const FEW_MAX: usize = 8;

/// Spilled-set bits naming the list slab rather than the bitset slab.
const FEW: u64 = 1 << (WINDOW_BITS - 1);
/// Spilled-set bits holding the index in its slab.
const SLAB_INDEX: u64 = FEW - 1;

/// Padding after the members of a list entry: slots are below the registry's capacity.
const NO_SLOT: Slot = Slot::MAX;

/// Entries of `stride` items each, all in one allocation, so that reaching a spilled set's
/// members costs one cache miss, not two (a vector's header, then its items). Freed entries
/// are reused; an entry that needs more room widens them all, which a level pays once per
/// width, not per change.
struct FlatSlab<T> {
    /// Every entry's items, entry `i` from `i * stride`.
    items: Vec<T>,
    /// Items per entry: as many as the widest entry has needed.
    stride: usize,
    /// Entries, used and freed (kept, not divided out of `items`: a division costs more than
    /// the rest of a membership change).
    entries: usize,
    /// Freed entries.
    free: Vec<u32>,
    /// What an unused item holds.
    blank: T,
}

impl<T: Copy> FlatSlab<T> {
    fn new(blank: T) -> Self {
        FlatSlab { items: Vec::new(), stride: 0, entries: 0, free: Vec::new(), blank }
    }

    fn len(&self) -> usize {
        self.entries - self.free.len()
    }

    fn get(&self, i: usize) -> Option<&[T]> {
        self.items.get(i * self.stride..(i + 1) * self.stride)
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut [T]> {
        self.items.get_mut(i * self.stride..(i + 1) * self.stride)
    }

    /// Makes every entry at least `stride` items wide.
    fn widen(&mut self, stride: usize) {
        if stride <= self.stride {
            return;
        }
        let mut items = vec![self.blank; self.entries * stride];
        if self.stride > 0 {
            for (to, from) in items.chunks_exact_mut(stride).zip(self.items.chunks_exact(self.stride)) {
                to[..from.len()].copy_from_slice(from);
            }
        }
        self.items = items;
        self.stride = stride;
    }

    /// A blank entry at least `stride` items wide: its index and its items.
    fn alloc(&mut self, stride: usize) -> (u64, &mut [T]) {
        self.widen(stride.max(1));
        let i = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                self.items.resize(self.items.len() + self.stride, self.blank);
                self.entries += 1;
                self.entries - 1
            }
        };
        (i as u64, &mut self.items[i * self.stride..(i + 1) * self.stride])
    }

    /// Hints the CPU to fetch entry `i`.
    fn prefetch(&self, i: usize) {
        if let Some(entry) = self.get(i) {
            prefetch_lines(entry.as_ptr().cast(), std::mem::size_of_val(entry));
        }
    }

    fn release(&mut self, i: u64) {
        let blank = self.blank;
        if let Some(entry) = self.get_mut(i as usize) {
            entry.fill(blank);
            self.free.push(i as u32);
        }
    }
}

/// Members of the [`WorkerSet`]s that spilled, kept by the owner of the sets: slabs whose index
/// the spilled set holds inline, so reaching the members costs no hash probe. A set's members
/// are its slots in order while that list is small against a bitset as wide as its highest
/// slot, the bitset after: on a big fleet most spills are a few workers far apart (four or
/// more, past an inline list, spanning windows as soon as two of their slots do), which a
/// bitset would pay for with the width of the whole registry.
///
/// Most positions never spill a set: the slabs are allocated with the first spill and freed
/// with the last, so an idle `Spill` is one word.
#[derive(Default)]
pub struct Spill(Option<Box<Slabs>>);

/// The two forms of spilled members.
struct Slabs {
    /// Members as bitsets.
    dense: FlatSlab<u64>,
    /// Members as ascending slots, padded with `NO_SLOT`.
    few: FlatSlab<Slot>,
}

impl Default for Slabs {
    fn default() -> Self {
        Slabs { dense: FlatSlab::new(0), few: FlatSlab::new(NO_SLOT) }
    }
}

/// Where a spilled set's members are.
enum Members<'a> {
    Dense(&'a [u64]),
    Few(&'a [Slot]),
}

/// The members of a list entry, without its padding.
fn listed(entry: &[Slot]) -> &[Slot] {
    &entry[..entry.partition_point(|&s| s != NO_SLOT)]
}

impl Spill {
    fn get(&self, set: WorkerSet) -> Option<Members<'_>> {
        let slabs = self.0.as_deref()?;
        let i = (set.0 & SLAB_INDEX) as usize;
        if set.0 & FEW != 0 {
            slabs.few.get(i).map(|e| Members::Few(listed(e)))
        } else {
            slabs.dense.get(i).map(Members::Dense)
        }
    }

    /// Stores `slots` (ascending) and returns the spilled set naming them.
    fn add(&mut self, slots: &[Slot]) -> WorkerSet {
        self.0.get_or_insert_with(Box::default).add(slots)
    }

    /// Frees the members of the spilled set `set`, and the slabs with the last.
    fn release(&mut self, set: WorkerSet) {
        if let Some(slabs) = &mut self.0 {
            slabs.release(set);
            if slabs.dense.len() + slabs.few.len() == 0 {
                self.0 = None;
            }
        }
    }

    /// Hints the CPU to fetch the members of `set` (a set of this owner), so that a write
    /// applied soon finds them in cache.
    #[inline]
    pub fn prefetch(&self, set: WorkerSet) {
        if !set.is_spilled() {
            return;
        }
        let Some(slabs) = self.0.as_deref() else { return };
        let i = (set.0 & SLAB_INDEX) as usize;
        if set.0 & FEW != 0 {
            slabs.few.prefetch(i);
        } else {
            slabs.dense.prefetch(i);
        }
    }

    /// Spilled sets alive.
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |s| s.dense.len() + s.few.len())
    }

    /// No spilled set alive (the slabs go with the last one).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }
}

impl Slabs {
    fn add(&mut self, slots: &[Slot]) -> WorkerSet {
        match slots.last() {
            Some(&last) if !few_fits(slots.len(), last) => {
                let (i, entry) = self.dense.alloc(last as usize / 64 + 1);
                for &s in slots {
                    set_bit(entry, s);
                }
                WorkerSet(WorkerSet::SPILLED.0 | i)
            }
            _ => {
                let (i, entry) = self.few.alloc(slots.len());
                entry[..slots.len()].copy_from_slice(slots);
                WorkerSet(WorkerSet::SPILLED.0 | FEW | i)
            }
        }
    }

    fn release(&mut self, set: WorkerSet) {
        if set.0 & FEW != 0 {
            self.few.release(set.0 & SLAB_INDEX);
        } else {
            self.dense.release(set.0 & SLAB_INDEX);
        }
    }

    /// Stores the members of `set`, now `slots` (ascending), in the form that fits them.
    fn reform(&mut self, set: WorkerSet, slots: &[Slot]) -> WorkerSet {
        self.release(set);
        self.add(slots)
    }
}

impl WorkerSet {
    /// Adds `slot`, spilling into `spill` when the set outgrows its window; returns whether
    /// the slot was new. An inline set takes the slot here, inline in the caller (every write
    /// of a small fleet); a spill and a spilled set are out of line.
    #[inline]
    pub fn insert_spilling(&mut self, slot: Slot, spill: &mut Spill) -> bool {
        if !self.is_spilled() {
            match self.insert(slot) {
                SetInsert::Added => return true,
                SetInsert::AlreadyPresent => return false,
                SetInsert::NeedsSpill => {}
            }
        }
        self.insert_spilling_far(slot, spill)
    }

    /// The rest of `insert_spilling`: an inline set that must spill, or a spilled set.
    #[inline(never)]
    fn insert_spilling_far(&mut self, slot: Slot, spill: &mut Spill) -> bool {
        if !self.is_spilled() {
            let mut slots: SmallVec<[Slot; 64]> = self.members().collect();
            let at = slots.partition_point(|&s| s < slot);
            slots.insert(at, slot);
            *self = spill.add(&slots);
            return true;
        }
        let Some(slabs) = spill.0.as_deref_mut() else { return false };
        let i = (self.0 & SLAB_INDEX) as usize;
        if self.0 & FEW == 0 {
            if i >= slabs.dense.entries {
                return false;
            }
            slabs.dense.widen(slot as usize / 64 + 1);
            return slabs.dense.get_mut(i).is_some_and(|bits| set_bit(bits, slot));
        }
        let Some(entry) = slabs.few.get(i) else { return false };
        let list = listed(entry);
        let (len, last) = (list.len(), list.last().map_or(slot, |&l| l.max(slot)));
        let Err(at) = list.binary_search(&slot) else { return false };
        if !few_fits(len + 1, last) {
            let mut slots: SmallVec<[Slot; 64]> = list.iter().copied().collect();
            slots.insert(at, slot);
            *self = slabs.reform(*self, &slots);
            return true;
        }
        slabs.few.widen(len + 1);
        if let Some(entry) = slabs.few.get_mut(i) {
            entry[at..=len].rotate_right(1);
            entry[at] = slot;
        }
        true
    }

    /// Removes `slot`, folding a spilled set back inline when it fits again; an inline set is
    /// handled inline in the caller, as in `insert_spilling`.
    #[inline]
    pub fn remove_spilling(&mut self, slot: Slot, spill: &mut Spill) {
        if !self.is_spilled() {
            self.remove(slot);
            return;
        }
        self.remove_spilled(slot, spill)
    }

    /// The rest of `remove_spilling`: a spilled set.
    #[inline(never)]
    fn remove_spilled(&mut self, slot: Slot, spill: &mut Spill) {
        let Some(slabs) = spill.0.as_deref_mut() else {
            *self = WorkerSet::EMPTY;
            return;
        };
        let i = (self.0 & SLAB_INDEX) as usize;
        let inline = if self.0 & FEW != 0 {
            match slabs.few.get_mut(i) {
                Some(entry) => {
                    let mut len = listed(entry).len();
                    if let Ok(at) = entry[..len].binary_search(&slot) {
                        entry[at..len].rotate_left(1);
                        len -= 1;
                        entry[len] = NO_SLOT;
                    }
                    WorkerSet::from_slots(&entry[..len])
                }
                None => Some(WorkerSet::EMPTY),
            }
        } else {
            match slabs.dense.get_mut(i) {
                Some(bits) => {
                    clear_bit(bits, slot);
                    let inline = WorkerSet::from_words(bits);
                    if inline.is_none() && last_of(bits).is_some_and(|last| few_fits(2 * count_of(bits), last)) {
                        let slots: SmallVec<[Slot; 64]> = iter_of(bits).collect();
                        *self = slabs.reform(*self, &slots);
                    }
                    inline
                }
                None => Some(WorkerSet::EMPTY),
            }
        };
        if let Some(inline) = inline {
            spill.release(*self);
            *self = inline;
        }
    }

    /// `alive &= self`, reading spilled members from `spill`.
    #[inline]
    pub fn and_into_spilling(self, spill: &Spill, alive: &mut SlotBits) {
        if !self.is_spilled() {
            self.and_into(alive);
            return;
        }
        match spill.get(self) {
            Some(Members::Dense(bits)) => alive.and_with_words(bits),
            Some(Members::Few(slots)) => alive.and_with_slots(slots),
            None => alive.clear(),
        }
    }

    /// The inline members, ascending; not valid on a spilled set.
    fn members(self) -> impl Iterator<Item = Slot> {
        let list = if self.is_list() { self.list_len() } else { 0 };
        let base = self.window() as u32 * WINDOW_BITS;
        let mut m = if self.is_spilled() || self.is_list() { 0 } else { self.0 & MEMBER_MASK };
        (0..list).map(move |i| self.lane(i)).chain(std::iter::from_fn(move || {
            if m == 0 {
                return None;
            }
            let b = m.trailing_zeros();
            m &= m - 1;
            Some(base + b)
        }))
    }
}

/// The lowest member of the bitset `words`.
fn first_of(words: &[u64]) -> Option<Slot> {
    let i = words.iter().position(|&w| w != 0)?;
    Some(i as Slot * 64 + words[i].trailing_zeros())
}

/// The highest member of the bitset `words`.
fn last_of(words: &[u64]) -> Option<Slot> {
    let i = words.iter().rposition(|&w| w != 0)?;
    Some(i as Slot * 64 + 63 - words[i].leading_zeros())
}

/// Adds `slot` to the bitset `words` (wide enough for it); whether it was new.
fn set_bit(words: &mut [u64], slot: Slot) -> bool {
    let Some(word) = words.get_mut(slot as usize / 64) else { return false };
    let had = *word & (1 << (slot % 64)) != 0;
    *word |= 1 << (slot % 64);
    !had
}

/// Removes `slot` from the bitset `words`; whether it was there.
fn clear_bit(words: &mut [u64], slot: Slot) -> bool {
    match words.get_mut(slot as usize / 64) {
        Some(word) if *word & (1 << (slot % 64)) != 0 => {
            *word &= !(1 << (slot % 64));
            true
        }
        _ => false,
    }
}

/// Number of members of the bitset `words`.
fn count_of(words: &[u64]) -> usize {
    words.iter().map(|w| w.count_ones() as usize).sum()
}

/// The members of the bitset `words`, ascending.
fn iter_of(words: &[u64]) -> impl Iterator<Item = Slot> + '_ {
    words.iter().enumerate().flat_map(|(i, &w)| {
        let mut m = w;
        std::iter::from_fn(move || {
            if m == 0 {
                return None;
            }
            let b = m.trailing_zeros();
            m &= m - 1;
            Some(i as u32 * 64 + b)
        })
    })
}

/// A dense bitset over worker slots: spilled sets and the running sets of a lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotBits {
    words: Vec<u64>,
}

impl SlotBits {
    /// Its words, 64 slots each.
    #[inline]
    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }

    /// Its words, to change in place.
    #[inline]
    pub(crate) fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }

    /// Empties it and sets its room to `words` words.
    #[inline]
    pub(crate) fn clear_to(&mut self, words: usize) {
        self.words.clear();
        self.words.resize(words, 0);
    }

    /// Its lowest member.
    pub fn first(&self) -> Option<Slot> {
        first_of(&self.words)
    }

    /// Its highest member.
    pub fn last(&self) -> Option<Slot> {
        last_of(&self.words)
    }

    /// An empty set with room for `slots` slots.
    pub fn with_width(slots: u32) -> Self {
        SlotBits { words: vec![0; slots.div_ceil(64) as usize] }
    }

    /// Resizes to cover `slots` slots and fills every one.
    pub fn fill(&mut self, slots: u32) {
        self.words.clear();
        self.words.resize(slots.div_ceil(64) as usize, u64::MAX);
        if slots % 64 != 0 {
            if let Some(last) = self.words.last_mut() {
                *last = (1u64 << (slots % 64)) - 1;
            }
        }
    }

    /// Removes every slot, keeping the allocation.
    pub fn clear(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    /// Adds `slot`, growing as needed.
    pub fn insert(&mut self, slot: Slot) {
        let w = (slot / 64) as usize;
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        set_bit(&mut self.words, slot);
    }

    /// Removes `slot`; whether it was there.
    pub fn remove(&mut self, slot: Slot) -> bool {
        clear_bit(&mut self.words, slot)
    }

    /// Whether `slot` is a member.
    pub fn contains(&self, slot: Slot) -> bool {
        self.words.get((slot / 64) as usize).is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }

    /// No member.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        count_of(&self.words)
    }

    /// `self &= other`.
    pub fn and_with(&mut self, other: &SlotBits) {
        self.and_with_words(&other.words);
    }

    /// `self &= other`, for another bitset's words.
    fn and_with_words(&mut self, other: &[u64]) {
        for (i, w) in self.words.iter_mut().enumerate() {
            *w &= other.get(i).copied().unwrap_or(0);
        }
    }

    /// `self &= slots`, for `slots` ascending.
    pub fn and_with_slots(&mut self, slots: &[Slot]) {
        let mut rest = slots;
        for (i, w) in self.words.iter_mut().enumerate() {
            let mut mask = 0u64;
            while let Some((&s, tail)) = rest.split_first() {
                if (s / 64) as usize != i {
                    break;
                }
                mask |= 1 << (s % 64);
                rest = tail;
            }
            *w &= mask;
        }
    }

    /// `self &= !other`.
    pub fn and_not(&mut self, other: &SlotBits) {
        for (w, o) in self.words.iter_mut().zip(&other.words) {
            *w &= !o;
        }
    }

    /// Copies `other` into `self`, reusing the allocation.
    pub fn copy_from(&mut self, other: &SlotBits) {
        self.words.clear();
        self.words.extend_from_slice(&other.words);
    }

    /// The members, ascending.
    pub fn iter(&self) -> impl Iterator<Item = Slot> + '_ {
        iter_of(&self.words)
    }

    /// Calls `f` with `n` members in ascending order starting from the member of rank `start`
    /// (counting from 0), going round to the lowest past the highest: a word's count at a time
    /// to the start, then one member at a time.
    pub fn each_from_rank(&self, start: usize, n: usize, mut f: impl FnMut(Slot)) {
        let total = self.len();
        if total == 0 || n == 0 {
            return;
        }
        let (mut skip, mut left) = (start % total, n.min(total));
        let mut i = 0;
        while skip >= self.words[i].count_ones() as usize {
            skip -= self.words[i].count_ones() as usize;
            i += 1;
        }
        let mut m = self.words[i];
        for _ in 0..skip {
            m &= m - 1;
        }
        loop {
            while m != 0 && left > 0 {
                f((i * 64) as Slot + m.trailing_zeros());
                m &= m - 1;
                left -= 1;
            }
            if left == 0 {
                return;
            }
            i = (i + 1) % self.words.len();
            m = self.words[i];
        }
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_reuses_released_slots_after_their_grace_period() {
        let r = WorkerRegistry::new(4);
        let a = r.intern(WorkerId::new(10, 0)).unwrap();
        let b = r.intern(WorkerId::new(10, 1)).unwrap();
        assert_eq!((a, b), (0, 1));
        assert_eq!(r.worker(0), Some(WorkerId::new(10, 0)));
        assert_eq!(r.intern(WorkerId::new(10, 0)), Err(RegistryError::Taken(WorkerId::new(10, 0))), "a second writer is refused");
        r.intern(WorkerId::new(1, 0)).unwrap();
        r.intern(WorkerId::new(2, 0)).unwrap();
        assert_eq!(r.intern(WorkerId::new(3, 0)), Err(RegistryError::Full(4)));
        r.release(WorkerId::new(10, 0));
        assert_eq!(r.slot(WorkerId::new(10, 0)), None);
        assert_eq!(r.worker(0), None, "a released slot names nobody at once");
        // Every other slot is taken: interning waits for the released one's grace period.
        assert_eq!(r.intern(WorkerId::new(99, 0)).unwrap(), 0);
        assert_eq!(r.worker(0), Some(WorkerId::new(99, 0)));
        assert_eq!(r.intern(WorkerId::new(3, 0)), Err(RegistryError::Full(4)));
    }

    #[test]
    fn a_slot_released_under_a_pinned_lookup_is_not_reused_before_it_ends() {
        let r = WorkerRegistry::new(2);
        r.intern(WorkerId::new(1, 0)).unwrap();
        r.intern(WorkerId::new(2, 0)).unwrap();
        let lookup = epoch::pin();
        r.release(WorkerId::new(1, 0));
        for _ in 0..100 {
            epoch::pin().flush();
        }
        // The lookup pinned before the release still runs: the slot stays out of reach.
        assert_eq!(r.intern(WorkerId::new(3, 0)), Err(RegistryError::Full(2)));
        drop(lookup);
        assert_eq!(r.intern(WorkerId::new(3, 0)).unwrap(), 0);
    }

    #[test]
    fn members_from_a_rank_go_round() {
        let mut set = SlotBits::default();
        for s in [3, 70, 71, 200, 900] {
            set.insert(s);
        }
        let from = |start, n| {
            let mut got = Vec::new();
            set.each_from_rank(start, n, |s| got.push(s));
            got
        };
        assert_eq!(from(0, 2), vec![3, 70]);
        assert_eq!(from(3, 4), vec![200, 900, 3, 70]);
        assert_eq!(from(7, 9), vec![71, 200, 900, 3, 70], "at most every member, once");
        assert_eq!(from(4, 0), Vec::<Slot>::new());
    }

    #[test]
    fn inline_set_spills_across_windows() {
        let mut s = WorkerSet::EMPTY;
        assert_eq!(s.insert(3), SetInsert::Added);
        assert_eq!(s.insert(3), SetInsert::AlreadyPresent);
        assert_eq!(s.insert(55), SetInsert::Added);
        assert_eq!(s.insert(54), SetInsert::Added);
        assert_eq!(s.insert(56), SetInsert::NeedsSpill, "four slots across windows spill");
        assert!(s.remove(3));
        assert!(!s.remove(3));
        assert!(s.remove(55) && s.remove(54));
        assert!(s.is_empty());
        // A lone high slot sits inline in its own window.
        assert_eq!(s.insert(1000), SetInsert::Added);
        assert!(s.contains_inline(1000));
        assert!(!s.contains_inline(1000 - 56));
        assert!(!s.is_list());
    }

    #[test]
    fn up_to_three_slots_anywhere_stay_inline_as_a_list() {
        let mut s = WorkerSet::EMPTY;
        for (x, want) in [(900, true), (7, true), (7, false), (65_535, true)] {
            assert_eq!(s.insert(x) == SetInsert::Added, want, "insert {x}");
        }
        assert!(s.is_list() && !s.is_spilled());
        assert_eq!(s.members().collect::<Vec<_>>(), [7, 900, 65_535]);
        assert!(s.contains_inline(900) && !s.contains_inline(901));
        let mut alive = SlotBits::default();
        alive.fill(1000);
        s.and_into(&mut alive);
        assert_eq!(alive.iter().collect::<Vec<_>>(), [7, 900], "slots past alive's width are not added");
        assert_eq!(s.insert(8), SetInsert::NeedsSpill);
        // Down to one window again: back to the window form, which holds 56.
        assert!(s.remove(65_535) && !s.remove(65_535) && s.remove(900));
        assert!(!s.is_list() && s.contains_inline(7));
        assert!((0..56).all(|x| s.insert(x) != SetInsert::NeedsSpill));
        // Slots whose window is past the window byte's range go in a list, those past 2^16 spill.
        let mut high = WorkerSet::EMPTY;
        assert_eq!(high.insert(255 * 56), SetInsert::Added);
        assert!(high.is_list());
        assert_eq!(high.insert(1 << 16), SetInsert::NeedsSpill);
        assert!(high.remove(255 * 56) && high.is_empty());
        assert_eq!(high.insert(1 << 16), SetInsert::NeedsSpill);
    }

    #[test]
    fn a_list_keeps_its_slots_in_order_whatever_the_order_they_come_and_go() {
        let triples = [[0, 56, 112], [5, 6, 900], [1, 14_000, 65_535], [55, 56, 57], [14_279, 14_280, 3]];
        let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
        for t in triples {
            let mut sorted = t;
            sorted.sort_unstable();
            for ins in orders {
                for del in orders {
                    let mut s = WorkerSet::EMPTY;
                    ins.iter().for_each(|&i| assert_eq!(s.insert(t[i]), SetInsert::Added, "{t:?} {ins:?}"));
                    assert_eq!(s.members().collect::<Vec<_>>(), sorted, "inserted {t:?} in order {ins:?}");
                    let mut left = sorted.to_vec();
                    for &i in &del {
                        assert!(s.remove(t[i]) && !s.contains_inline(t[i]));
                        left.retain(|&x| x != t[i]);
                        assert_eq!(s.members().collect::<Vec<_>>(), left, "{t:?}: removed in order {del:?}");
                        let one_window = left.first().map(|f| f / WINDOW_BITS) == left.last().map(|l| l / WINDOW_BITS);
                        assert_eq!(s.is_list(), !one_window || left.first().is_some_and(|&f| f >= 254 * WINDOW_BITS));
                    }
                    assert!(s.is_empty());
                }
            }
        }
    }

    #[test]
    fn spilled_sets_live_in_a_slab_that_reuses_freed_entries() {
        let mut spill = Spill::default();
        let (mut a, mut b) = (WorkerSet::EMPTY, WorkerSet::EMPTY);
        for s in [1, 100, 200, 300] {
            assert!(a.insert_spilling(s, &mut spill));
            assert!(b.insert_spilling(s + 1, &mut spill));
        }
        assert!(!a.insert_spilling(100, &mut spill));
        assert!(a.is_spilled() && b.is_spilled() && a != b);
        assert_eq!(spill.len(), 2);
        let mut alive = SlotBits::default();
        alive.fill(512);
        a.and_into_spilling(&spill, &mut alive);
        assert_eq!(alive.iter().collect::<Vec<_>>(), vec![1, 100, 200, 300]);
        // Down to three: folded back inline as a list, its slab entry freed and reused.
        a.remove_spilling(1, &mut spill);
        assert!(!a.is_spilled() && a.is_list() && a.contains_inline(300));
        a.remove_spilling(200, &mut spill);
        a.remove_spilling(300, &mut spill);
        assert!(!a.is_list() && a.contains_inline(100));
        assert_eq!(spill.len(), 1);
        let mut c = WorkerSet::EMPTY;
        for s in [0, 1, 2, 255] {
            c.insert_spilling(s, &mut spill);
        }
        assert_eq!(spill.len(), 2);
        assert_eq!(spill.0.as_ref().map(|s| s.dense.entries), Some(2));
        alive.fill(512);
        b.and_into_spilling(&spill, &mut alive);
        assert_eq!(alive.iter().collect::<Vec<_>>(), vec![2, 101, 201, 301]);
    }

    #[test]
    fn spilled_sets_keep_few_far_apart_slots_as_a_list_and_agree_with_a_model() {
        let mut spill = Spill::default();
        let mut set = WorkerSet::EMPTY;
        let mut model = std::collections::BTreeSet::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        // Sets seen as a list, as a bitset, and as a list again after a bitset.
        let mut saw = (false, false, false, false);
        for step in 0..20_000u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            // Phases that grow the set past the list's size, then shrink it again.
            let grow = step % 4_000 < 1_000;
            let slot = (rng % 600) as Slot;
            let insert = if grow { (rng >> 40) % 4 != 0 } else { (rng >> 40) % 256 == 0 };
            if insert {
                assert_eq!(set.insert_spilling(slot, &mut spill), model.insert(slot));
            } else {
                set.remove_spilling(slot, &mut spill);
                model.remove(&slot);
            }
            match spill.get(set).filter(|_| set.is_spilled()) {
                Some(Members::Few(slots)) => {
                    saw.0 = true;
                    saw.2 |= saw.1;
                    assert!(slots.windows(2).all(|w| w[0] < w[1]));
                    assert!(few_fits(slots.len(), *slots.last().expect("a spilled set holds slots")));
                }
                Some(Members::Dense(_)) => saw.1 = true,
                None => {
                    assert!(!set.is_spilled(), "a spilled set names a live slab entry");
                    let (Some(lo), Some(hi)) = (model.first(), model.last()) else { continue };
                    assert!(set.is_list() == (lo / WINDOW_BITS != hi / WINDOW_BITS), "a list only across windows");
                    assert!(model.len() <= LIST_MAX as usize || !set.is_list(), "inline: one window or a short list");
                    saw.3 |= set.is_list();
                }
            }
            if step % 7 == 0 {
                let mut alive = SlotBits::default();
                alive.fill(600);
                set.and_into_spilling(&spill, &mut alive);
                assert_eq!(alive.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>(), "step {step}");
            }
        }
        assert!(saw.0 && saw.1 && saw.2 && saw.3, "every form and both conversions were exercised: {saw:?}");
        for slot in model.clone() {
            set.remove_spilling(slot, &mut spill);
        }
        assert!(set.is_empty() && spill.is_empty());
    }

    #[test]
    fn widening_a_slab_keeps_every_entry() {
        let members = |set: WorkerSet, spill: &Spill| {
            let mut alive = SlotBits::default();
            alive.fill(1024);
            set.and_into_spilling(spill, &mut alive);
            alive.iter().collect::<Vec<_>>()
        };
        let mut spill = Spill::default();
        let mut sets = [WorkerSet::EMPTY; 4];
        // Two narrow bitsets and two short lists, then one of each grows past the stride.
        for (set, slots) in sets.iter_mut().zip([[1, 2, 4, 100], [3, 5, 6, 70], [0, 1, 2, 600], [4, 5, 6, 700]]) {
            slots.iter().for_each(|&s| assert!(set.insert_spilling(s, &mut spill)));
        }
        assert!(sets.iter().all(|s| s.is_spilled()));
        assert!(sets[0].insert_spilling(1000, &mut spill));
        for s in [601, 602, 603] {
            assert!(sets[2].insert_spilling(s, &mut spill));
        }
        let got: Vec<_> = sets.iter().map(|&set| members(set, &spill)).collect();
        assert_eq!(got, [vec![1, 2, 4, 100, 1000], vec![3, 5, 6, 70], vec![0, 1, 2, 600, 601, 602, 603], vec![4, 5, 6, 700]]);
        assert!(matches!(spill.get(sets[2]), Some(Members::Few(_))), "a short far-apart set stays a list");
        assert!(matches!(spill.get(sets[1]), Some(Members::Dense(_))), "a narrow set stays a bitset");
    }

    #[test]
    fn a_dense_set_folds_back_inline_only_within_one_window() {
        let mut b = SlotBits::with_width(300);
        assert_eq!((b.first(), b.last()), (None, None));
        assert_eq!(WorkerSet::from_bits(&b), Some(WorkerSet::EMPTY));
        for x in [57, 63, 64, 111] {
            b.insert(x);
        }
        assert_eq!((b.first(), b.last()), (Some(57), Some(111)));
        let inline = WorkerSet::from_bits(&b).expect("slots 56..=111 share a window");
        assert!([57, 63, 64, 111].iter().all(|&x| inline.contains_inline(x)));
        b.insert(299);
        assert_eq!(b.last(), Some(299));
        assert_eq!(WorkerSet::from_bits(&b), None);
        b.remove(299);
        b.insert(55);
        assert_eq!(b.first(), Some(55));
        assert_eq!(WorkerSet::from_bits(&b), None);
    }

    #[test]
    fn inline_and_matches_dense_and() {
        for slots in [[1u32, 2, 40], [60, 70, 111], [112, 130, 167]] {
            let mut s = WorkerSet::EMPTY;
            for &x in &slots {
                assert_eq!(s.insert(x), SetInsert::Added);
            }
            let mut alive = SlotBits::default();
            alive.fill(256);
            s.and_into(&mut alive);
            assert_eq!(alive.iter().collect::<Vec<_>>(), slots.to_vec());
            let mut dense = SlotBits::default();
            s.members().for_each(|x| dense.insert(x));
            assert_eq!(dense.iter().collect::<Vec<_>>(), slots.to_vec());
            assert_eq!(WorkerSet::from_bits(&dense), Some(s));
        }
    }
}
