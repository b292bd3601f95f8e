//! Worker interning and worker sets (DESIGN §2): each `(worker_id, dp_rank)` gets a dense
//! slot, reused after the worker is removed, so that index entries hold workers as bits.

use crate::hash::WorkerId;
use crate::seeded::SeededMap;
use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicU64, Ordering};

/// A worker's dense slot number.
pub type Slot = u32;

/// Interns worker identities to dense slots and maps slots back for lookup answers.
pub struct WorkerRegistry {
    capacity: u32,
    inner: Mutex<RegistryInner>,
    ids: RwLock<Vec<Option<WorkerId>>>,
    /// Slots that lookups must check position by position (a tangled positional writer).
    holey: Box<[AtomicU64]>,
}

#[derive(Default)]
struct RegistryInner {
    by_id: SeededMap<WorkerId, Slot>,
    free: Vec<Slot>,
    next: Slot,
}

/// Why a worker could not be given a slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// Every slot is taken; the payload is the capacity.
    #[error("worker registry is full ({0} slots)")]
    Full(u32),
}

impl WorkerRegistry {
    /// A registry for at most `capacity` workers at once.
    pub fn new(capacity: u32) -> Self {
        let words = capacity.div_ceil(64) as usize;
        WorkerRegistry {
            capacity,
            inner: Mutex::new(RegistryInner::default()),
            ids: RwLock::new(Vec::new()),
            holey: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The slot of `id`, assigning the lowest free one if it has none.
    pub fn intern(&self, id: WorkerId) -> Result<Slot, RegistryError> {
        let mut inner = self.inner.lock();
        if let Some(&s) = inner.by_id.get(&id) {
            return Ok(s);
        }
        let slot = match inner.free.pop() {
            Some(s) => s,
            None if inner.next < self.capacity => {
                inner.next += 1;
                inner.next - 1
            }
            None => return Err(RegistryError::Full(self.capacity)),
        };
        inner.by_id.insert(id, slot);
        let mut ids = self.ids.write();
        if ids.len() <= slot as usize {
            ids.resize(slot as usize + 1, None);
        }
        ids[slot as usize] = Some(id);
        Ok(slot)
    }

    /// Frees the slot of `id` for reuse. The caller has already removed its blocks.
    pub fn release(&self, id: WorkerId) {
        let mut inner = self.inner.lock();
        if let Some(slot) = inner.by_id.remove(&id) {
            self.ids.write()[slot as usize] = None;
            self.set_holey(slot, false);
            inner.free.push(slot);
            // Lowest slots first keeps worker sets inside the first inline window.
            inner.free.sort_unstable_by(|a, b| b.cmp(a));
        }
    }

    /// The slot of `id`, if it has one.
    pub fn slot(&self, id: WorkerId) -> Option<Slot> {
        self.inner.lock().by_id.get(&id).copied()
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
    pub fn high_water(&self) -> u32 {
        self.ids.read().len() as u32
    }

    /// Calls `f` with the slot-to-worker table (read-locked once per lookup).
    pub fn with_ids<R>(&self, f: impl FnOnce(&[Option<WorkerId>]) -> R) -> R {
        f(&self.ids.read())
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

/// A set of worker slots in 8 bytes: up to 56 slots of one aligned window inline (the top
/// byte names the window); a set spanning windows is marked spilled and its members live in
/// a [`SlotBits`] kept by the owner of the set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerSet(u64);

/// What inserting into a [`WorkerSet`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum SetInsert {
    /// The slot was not in the set and now is.
    Added,
    /// The slot was already in the set.
    AlreadyPresent,
    /// The set must spill: the owner moves `self.members()` plus the slot into a [`SlotBits`].
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

    /// Its members live in the owner's [`SlotBits`].
    #[inline]
    pub fn is_spilled(self) -> bool {
        self.0 >> WINDOW_BITS == SPILLED_WINDOW
    }

    #[inline]
    fn window(self) -> u64 {
        self.0 >> WINDOW_BITS
    }

    #[inline]
    fn locate(slot: Slot) -> (u64, u64) {
        ((slot / WINDOW_BITS) as u64, 1u64 << (slot % WINDOW_BITS))
    }

    /// Inline membership test; not valid on a spilled set.
    #[inline]
    pub fn contains_inline(self, slot: Slot) -> bool {
        let (w, bit) = Self::locate(slot);
        !self.is_empty() && self.window() == w && self.0 & bit != 0
    }

    /// Adds `slot` inline when it fits.
    #[inline]
    pub fn insert(&mut self, slot: Slot) -> SetInsert {
        debug_assert!(!self.is_spilled());
        let (w, bit) = Self::locate(slot);
        if w >= SPILLED_WINDOW {
            return SetInsert::NeedsSpill;
        }
        if self.is_empty() {
            self.0 = (w << WINDOW_BITS) | bit;
            SetInsert::Added
        } else if self.window() != w {
            SetInsert::NeedsSpill
        } else if self.0 & bit != 0 {
            SetInsert::AlreadyPresent
        } else {
            self.0 |= bit;
            SetInsert::Added
        }
    }

    /// Removes `slot` from an inline set; returns whether it was there.
    #[inline]
    pub fn remove(&mut self, slot: Slot) -> bool {
        debug_assert!(!self.is_spilled());
        if !self.contains_inline(slot) {
            return false;
        }
        let (_, bit) = Self::locate(slot);
        self.0 &= !bit;
        if self.0 & MEMBER_MASK == 0 {
            self.0 = 0;
        }
        true
    }

    /// Writes the inline members into `out` (cleared first).
    pub fn to_bits(self, out: &mut SlotBits) {
        out.clear();
        let base = self.window() as u32 * WINDOW_BITS;
        let mut m = self.0 & MEMBER_MASK;
        while m != 0 {
            out.insert(base + m.trailing_zeros());
            m &= m - 1;
        }
    }

    /// Intersects `alive` with this inline set in place.
    #[inline]
    pub fn and_into(self, alive: &mut SlotBits) {
        debug_assert!(!self.is_spilled());
        if self.is_empty() {
            alive.clear();
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

    /// Tries to fold a spilled set back inline; `None` if it still spans windows. Its first
    /// and last members tell, so a set of a thousand workers costs a word scan, not a walk.
    pub fn from_bits(bits: &SlotBits) -> Option<WorkerSet> {
        let (Some(first), Some(last)) = (bits.first(), bits.last()) else { return Some(WorkerSet::EMPTY) };
        if first / WINDOW_BITS != last / WINDOW_BITS {
            return None;
        }
        let mut s = WorkerSet::EMPTY;
        for slot in bits.iter() {
            if s.insert(slot) == SetInsert::NeedsSpill {
                return None;
            }
        }
        Some(s)
    }
}

/// Members of the [`WorkerSet`]s that spilled, kept by the owner of the sets: a slab whose
/// index the spilled set holds inline, so reaching the members costs no hash probe.
#[derive(Default)]
pub struct Spill {
    /// Members by slab index; a freed entry is emptied and reused.
    sets: Vec<SlotBits>,
    /// Freed indexes.
    free: Vec<u32>,
}

impl Spill {
    fn get(&self, set: WorkerSet) -> Option<&SlotBits> {
        self.sets.get((set.0 & MEMBER_MASK) as usize)
    }

    fn get_mut(&mut self, set: WorkerSet) -> Option<&mut SlotBits> {
        self.sets.get_mut((set.0 & MEMBER_MASK) as usize)
    }

    /// Stores `bits` and returns the spilled set naming them.
    fn add(&mut self, bits: SlotBits) -> WorkerSet {
        let idx = match self.free.pop() {
            Some(i) => {
                self.sets[i as usize] = bits;
                i
            }
            None => {
                self.sets.push(bits);
                (self.sets.len() - 1) as u32
            }
        };
        WorkerSet(WorkerSet::SPILLED.0 | idx as u64)
    }

    /// Frees the members of the spilled set `set`.
    fn release(&mut self, set: WorkerSet) {
        if let Some(bits) = self.get_mut(set) {
            *bits = SlotBits::default();
            self.free.push((set.0 & MEMBER_MASK) as u32);
        }
    }

    /// Spilled sets alive.
    pub fn len(&self) -> usize {
        self.sets.len() - self.free.len()
    }

    /// No spilled set alive.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl WorkerSet {
    /// Adds `slot`, spilling into `spill` when the set outgrows its window; returns whether
    /// the slot was new.
    pub fn insert_spilling(&mut self, slot: Slot, spill: &mut Spill) -> bool {
        if self.is_spilled() {
            let Some(bits) = spill.get_mut(*self) else { return false };
            let had = bits.contains(slot);
            bits.insert(slot);
            return !had;
        }
        match self.insert(slot) {
            SetInsert::Added => true,
            SetInsert::AlreadyPresent => false,
            SetInsert::NeedsSpill => {
                let mut bits = SlotBits::default();
                self.to_bits(&mut bits);
                bits.insert(slot);
                *self = spill.add(bits);
                true
            }
        }
    }

    /// Removes `slot`, folding a spilled set back inline when it fits again.
    pub fn remove_spilling(&mut self, slot: Slot, spill: &mut Spill) {
        if !self.is_spilled() {
            self.remove(slot);
            return;
        }
        let Some(bits) = spill.get_mut(*self) else {
            *self = WorkerSet::EMPTY;
            return;
        };
        bits.remove(slot);
        if let Some(inline) = WorkerSet::from_bits(bits) {
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
            Some(bits) => alive.and_with(bits),
            None => alive.clear(),
        }
    }
}

/// A dense bitset over worker slots: spilled sets and the running sets of a lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotBits {
    words: Vec<u64>,
}

impl SlotBits {
    /// Its lowest member.
    pub fn first(&self) -> Option<Slot> {
        let i = self.words.iter().position(|&w| w != 0)?;
        Some(i as Slot * 64 + self.words[i].trailing_zeros())
    }

    /// Its highest member.
    pub fn last(&self) -> Option<Slot> {
        let i = self.words.iter().rposition(|&w| w != 0)?;
        Some(i as Slot * 64 + 63 - self.words[i].leading_zeros())
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
        self.words[w] |= 1 << (slot % 64);
    }

    /// Removes `slot`; whether it was there.
    pub fn remove(&mut self, slot: Slot) -> bool {
        let w = (slot / 64) as usize;
        match self.words.get_mut(w) {
            Some(word) if *word & (1 << (slot % 64)) != 0 => {
                *word &= !(1 << (slot % 64));
                true
            }
            _ => false,
        }
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
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// `self &= other`.
    pub fn and_with(&mut self, other: &SlotBits) {
        for (i, w) in self.words.iter_mut().enumerate() {
            *w &= other.words.get(i).copied().unwrap_or(0);
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
        self.words.iter().enumerate().flat_map(|(i, &w)| {
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

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_reuses_released_slots() {
        let r = WorkerRegistry::new(4);
        let a = r.intern(WorkerId::new(10, 0)).unwrap();
        let b = r.intern(WorkerId::new(10, 1)).unwrap();
        assert_eq!((a, b), (0, 1));
        assert_eq!(r.intern(WorkerId::new(10, 0)).unwrap(), 0);
        r.release(WorkerId::new(10, 0));
        assert_eq!(r.slot(WorkerId::new(10, 0)), None);
        assert_eq!(r.intern(WorkerId::new(99, 0)).unwrap(), 0);
        r.intern(WorkerId::new(1, 0)).unwrap();
        r.intern(WorkerId::new(2, 0)).unwrap();
        assert_eq!(r.intern(WorkerId::new(3, 0)), Err(RegistryError::Full(4)));
    }

    #[test]
    fn inline_set_spills_across_windows() {
        let mut s = WorkerSet::EMPTY;
        assert_eq!(s.insert(3), SetInsert::Added);
        assert_eq!(s.insert(3), SetInsert::AlreadyPresent);
        assert_eq!(s.insert(55), SetInsert::Added);
        assert_eq!(s.insert(56), SetInsert::NeedsSpill);
        assert!(s.remove(3));
        assert!(!s.remove(3));
        assert!(s.remove(55));
        assert!(s.is_empty());
        // A lone high slot sits inline in its own window.
        assert_eq!(s.insert(1000), SetInsert::Added);
        assert!(s.contains_inline(1000));
        assert!(!s.contains_inline(1000 - 56));
        assert_eq!(s.insert(255 * 56), SetInsert::NeedsSpill);
    }

    #[test]
    fn spilled_sets_live_in_a_slab_that_reuses_freed_entries() {
        let mut spill = Spill::default();
        let (mut a, mut b) = (WorkerSet::EMPTY, WorkerSet::EMPTY);
        for s in [1, 100, 200] {
            assert!(a.insert_spilling(s, &mut spill));
            assert!(b.insert_spilling(s + 1, &mut spill));
        }
        assert!(!a.insert_spilling(100, &mut spill));
        assert!(a.is_spilled() && b.is_spilled() && a != b);
        assert_eq!(spill.len(), 2);
        let mut alive = SlotBits::default();
        alive.fill(256);
        a.and_into_spilling(&spill, &mut alive);
        assert_eq!(alive.iter().collect::<Vec<_>>(), vec![1, 100, 200]);
        // Down to one window: folded back inline, its slab entry freed and reused.
        a.remove_spilling(1, &mut spill);
        a.remove_spilling(200, &mut spill);
        assert!(!a.is_spilled() && a.contains_inline(100));
        assert_eq!(spill.len(), 1);
        let mut c = WorkerSet::EMPTY;
        c.insert_spilling(0, &mut spill);
        c.insert_spilling(255, &mut spill);
        assert_eq!(spill.len(), 2);
        assert_eq!(spill.sets.len(), 2);
        alive.fill(256);
        b.and_into_spilling(&spill, &mut alive);
        assert_eq!(alive.iter().collect::<Vec<_>>(), vec![2, 101, 201]);
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
            s.to_bits(&mut dense);
            assert_eq!(dense.iter().collect::<Vec<_>>(), slots.to_vec());
            assert_eq!(WorkerSet::from_bits(&dense), Some(s));
        }
    }
}
