//! A small open-addressing hash map for the index's hot tables: u64 keys that are already
//! hashes (prefix hashes, engine block hashes), linear probing, backward-shift deletion.
//!
//! By default key and value share one slot, so a lookup costs one cache miss where a
//! SwissTable costs two (control bytes, then the bucket). A table of wide values whose probes
//! mostly miss (a worker's reverse map: most stored blocks are new) keeps its keys apart
//! instead ([`Split`]), so that a probe reads 8-byte keys, not whole records. Deletion leaves
//! no tombstones, so steady churn never grows the table; the table shrinks when mostly empty.
//! Any capacity works (the home slot is a fast range reduction, not a mask), so a table grows
//! by half, not by doubling, and load stays below 3/4 (above 3/16 once past 64 slots), about
//! 0.6 in steady state.

/// Slot key marking an empty slot; a real key equal to it lives in `zero`.
const EMPTY: u64 = 0;
const MIN_CAP: usize = 8;
/// Tables this small are not shrunk (only freed when empty): resizing them under churn
/// costs more than the few hundred bytes it would give back.
const SHRINK_ABOVE: usize = 64;
/// A slot index that names no slot: key 0's place (it lives in `zero`), or "no hint" for the
/// `_near` calls.
pub(crate) const NO_SLOT: usize = usize::MAX;

#[derive(Clone, Copy, Default)]
struct Slot<V> {
    key: u64,
    val: V,
}

/// How a table keeps its slots: an index past the capacity panics, as a slice's does.
pub(crate) trait Layout<V: Copy + Default>: Default {
    /// `cap` empty slots.
    fn with_cap(cap: usize) -> Self;
    fn cap(&self) -> usize;
    fn key(&self, i: usize) -> u64;
    /// The key at `i`, or `None` past the capacity (for hints, which may be stale).
    fn key_get(&self, i: usize) -> Option<u64>;
    fn val(&self, i: usize) -> &V;
    fn val_mut(&mut self, i: usize) -> &mut V;
    fn set(&mut self, i: usize, key: u64, val: V);
    fn set_empty(&mut self, i: usize);
    /// Moves slot `from` to `to` (a backward shift).
    fn shift(&mut self, from: usize, to: usize);
    /// Hints the CPU to fetch what a probe or removal at slot `i` reads first (each layout
    /// says which lines).
    fn prefetch(&self, i: usize);
    /// As [`Self::prefetch`], and the rest of a probe run from `i`; by default no more (only
    /// the reverse map, a [`Split`] table, prefetches runs).
    #[inline]
    fn prefetch_run(&self, i: usize) {
        self.prefetch(i);
    }
    #[cfg(test)]
    fn heap_bytes(&self) -> usize;
}

/// Key and value side by side in one slot (the default).
pub(crate) struct Inline<V>(Vec<Slot<V>>);

impl<V> Default for Inline<V> {
    fn default() -> Self {
        Inline(Vec::new())
    }
}

impl<V: Copy + Default> Layout<V> for Inline<V> {
    fn with_cap(cap: usize) -> Self {
        Inline(vec![Slot::default(); cap])
    }
    #[inline]
    fn cap(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn key(&self, i: usize) -> u64 {
        self.0[i].key
    }
    #[inline]
    fn key_get(&self, i: usize) -> Option<u64> {
        self.0.get(i).map(|s| s.key)
    }
    #[inline]
    fn val(&self, i: usize) -> &V {
        &self.0[i].val
    }
    #[inline]
    fn val_mut(&mut self, i: usize) -> &mut V {
        &mut self.0[i].val
    }
    #[inline]
    fn set(&mut self, i: usize, key: u64, val: V) {
        self.0[i] = Slot { key, val };
    }
    #[inline]
    fn set_empty(&mut self, i: usize) {
        self.0[i].key = EMPTY;
    }
    #[inline]
    fn shift(&mut self, from: usize, to: usize) {
        self.0[to] = self.0[from];
    }
    #[inline]
    fn prefetch(&self, i: usize) {
        prefetch_lines(self.0.as_ptr().wrapping_add(i) as *const u8, 2 * std::mem::size_of::<Slot<V>>());
    }
    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<Slot<V>>()
    }
}

/// Keys in one array and values in another: a probe past occupied slots reads eight keys a
/// cache line, and only the slot it stops at costs a line of values.
pub(crate) struct Split<V> {
    /// The keys, `EMPTY` in a free slot: all a probe reads until it stops.
    keys: Vec<u64>,
    /// The value of each slot, meaningful only where its key is not `EMPTY`.
    vals: Vec<V>,
}

impl<V> Default for Split<V> {
    fn default() -> Self {
        Split { keys: Vec::new(), vals: Vec::new() }
    }
}

impl<V: Copy + Default> Layout<V> for Split<V> {
    fn with_cap(cap: usize) -> Self {
        Split { keys: vec![EMPTY; cap], vals: vec![V::default(); cap] }
    }
    #[inline]
    fn cap(&self) -> usize {
        self.keys.len()
    }
    #[inline]
    fn key(&self, i: usize) -> u64 {
        self.keys[i]
    }
    #[inline]
    fn key_get(&self, i: usize) -> Option<u64> {
        self.keys.get(i).copied()
    }
    #[inline]
    fn val(&self, i: usize) -> &V {
        &self.vals[i]
    }
    #[inline]
    fn val_mut(&mut self, i: usize) -> &mut V {
        &mut self.vals[i]
    }
    #[inline]
    fn set(&mut self, i: usize, key: u64, val: V) {
        self.keys[i] = key;
        self.vals[i] = val;
    }
    #[inline]
    fn set_empty(&mut self, i: usize) {
        self.keys[i] = EMPTY;
    }
    #[inline]
    fn shift(&mut self, from: usize, to: usize) {
        self.keys[to] = self.keys[from];
        self.vals[to] = self.vals[from];
    }
    /// A line of keys from `i` (probes read keys, not values) and the value at `i`.
    #[inline]
    fn prefetch(&self, i: usize) {
        prefetch_lines(self.keys.as_ptr().wrapping_add(i) as *const u8, 64);
        prefetch_lines(self.vals.as_ptr().wrapping_add(i) as *const u8, std::mem::size_of::<V>());
    }
    /// A line of keys holds a run at the load kept; a removal's shift moves the value after.
    #[inline]
    fn prefetch_run(&self, i: usize) {
        prefetch_lines(self.keys.as_ptr().wrapping_add(i) as *const u8, 64);
        prefetch_lines(self.vals.as_ptr().wrapping_add(i) as *const u8, 2 * std::mem::size_of::<V>());
    }
    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        self.keys.capacity() * 8 + self.vals.capacity() * std::mem::size_of::<V>()
    }
}

/// Map from u64 keys to small `Copy` values. With `SHRINK` false the table keeps its room,
/// even when empty, until its owner drops it: for tables that grow and shrink by large
/// factors all the time, whose owner knows how much room is worth keeping.
pub(crate) struct LinearMap<V: Copy + Default, const SHRINK: bool = true, L: Layout<V> = Inline<V>> {
    /// The slots, laid out by `L`.
    slots: L,
    /// Keys in `slots` (not counting `zero`).
    used: usize,
    /// The value of key 0, which marks empty slots and so cannot live in one.
    zero: Option<V>,
    /// The process seed: keys are chosen by publishers, so their home slots must not be.
    seed: u64,
    /// Removals and resizes so far (wrapping): they move slots, so a [`Spot`] taken before
    /// one of them no longer names a place to insert.
    moves: u32,
}

/// Where [`LinearMap::spot`] found a key, or the empty slot its insert would take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spot {
    idx: usize,
    held: bool,
    moves: u32,
}

impl Spot {
    /// The slot, as a hint for [`LinearMap::get_mut_near`].
    pub(crate) fn slot(self) -> usize {
        self.idx
    }
}

impl<V: Copy + Default, const SHRINK: bool, L: Layout<V>> Default for LinearMap<V, SHRINK, L> {
    fn default() -> Self {
        LinearMap { slots: L::default(), used: 0, zero: None, seed: crate::seeded::process_seed(), moves: 0 }
    }
}

/// The home slot of `key` in a table of `cap` slots: the key is mixed under the seed (a
/// folded multiply), then reduced to `0..cap` by a 128-bit multiply.
#[inline]
fn home_of(key: u64, seed: u64, cap: usize) -> usize {
    let mixed = crate::seeded::mix(key, seed);
    ((mixed as u128 * cap as u128) >> 64) as usize
}

impl<V: Copy + Default, const SHRINK: bool, L: Layout<V>> LinearMap<V, SHRINK, L> {
    #[inline]
    fn home(&self, key: u64) -> usize {
        home_of(key, self.seed, self.slots.cap())
    }

    #[inline]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.cap() {
            0
        } else {
            i + 1
        }
    }

    /// Index of `key`'s slot, if present (`key` != EMPTY).
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.cap() == 0 {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let k = self.slots.key(i);
            if k == key {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = self.next(i);
        }
    }

    pub fn len(&self) -> usize {
        self.used + self.zero.is_some() as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<&V> {
        if key == EMPTY {
            return self.zero.as_ref();
        }
        self.find(key).map(|i| self.slots.val(i))
    }

    #[inline]
    pub fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == EMPTY {
            return self.zero.as_mut();
        }
        self.find(key).map(|i| self.slots.val_mut(i))
    }

    /// Makes room for `more` keys beyond those held: one resize, where inserting them one by
    /// one would grow the table step by step (a big store into an empty worker: a dozen).
    pub fn reserve(&mut self, more: usize) {
        let want = self.used + more;
        let cap = self.slots.cap();
        if want * 4 > cap * 3 {
            self.resize((want * 4 / 3 + 1).max(cap + cap / 2).max(MIN_CAP));
        }
    }

    /// Grows the table by half if one more key would take it past three quarters.
    #[inline]
    fn room_for_one(&mut self) {
        let cap = self.slots.cap();
        if (self.used + 1) * 4 > cap * 3 {
            self.resize((cap + cap / 2).max(MIN_CAP));
        }
    }

    /// Inserts or replaces; returns the old value.
    #[inline]
    pub fn insert(&mut self, key: u64, val: V) -> Option<V> {
        if key == EMPTY {
            return self.zero.replace(val);
        }
        self.room_for_one();
        let mut i = self.home(key);
        loop {
            let k = self.slots.key(i);
            if k == key {
                return Some(std::mem::replace(self.slots.val_mut(i), val));
            }
            if k == EMPTY {
                self.slots.set(i, key, val);
                self.used += 1;
                return None;
            }
            i = self.next(i);
        }
    }

    /// The value of `key`, inserting `default` first if absent; true if it was inserted.
    #[inline]
    pub fn upsert(&mut self, key: u64, default: V) -> (&mut V, bool) {
        if key == EMPTY {
            let new = self.zero.is_none();
            return (self.zero.get_or_insert(default), new);
        }
        self.room_for_one();
        let mut i = self.home(key);
        loop {
            let k = self.slots.key(i);
            if k == key {
                return (self.slots.val_mut(i), false);
            }
            if k == EMPTY {
                self.slots.set(i, key, default);
                self.used += 1;
                return (self.slots.val_mut(i), true);
            }
            i = self.next(i);
        }
    }

    /// Applies `f` to the value of `key` and removes the key if `f` says so; `None` if absent.
    #[inline]
    pub fn update_or_remove(&mut self, key: u64, f: impl FnOnce(&mut V) -> bool) -> Option<bool> {
        if key == EMPTY {
            let v = self.zero.as_mut()?;
            let gone = f(v);
            if gone {
                self.zero = None;
            }
            return Some(gone);
        }
        let i = self.find(key)?;
        let gone = f(self.slots.val_mut(i));
        if gone {
            self.remove_at(i);
        }
        Some(gone)
    }

    /// As [`Self::update_or_remove`], trying the slot `hint` first (see [`Self::get_mut_near`]).
    #[inline]
    pub fn update_or_remove_near(&mut self, key: u64, hint: usize, f: impl FnOnce(&mut V) -> bool) -> Option<bool> {
        if key == EMPTY || self.slots.key_get(hint) != Some(key) {
            return self.update_or_remove(key, f);
        }
        let gone = f(self.slots.val_mut(hint));
        if gone {
            self.remove_at(hint);
        }
        Some(gone)
    }

    /// Where `key` is held, or the empty slot an insert of it would take: one probe that a
    /// caller reads with [`Self::at`] and then fills with [`Self::put`].
    #[inline]
    pub fn spot(&self, key: u64) -> Spot {
        let moves = self.moves;
        if key == EMPTY {
            return Spot { idx: NO_SLOT, held: self.zero.is_some(), moves };
        }
        if self.slots.cap() == 0 {
            return Spot { idx: NO_SLOT, held: false, moves };
        }
        let mut i = self.home(key);
        loop {
            let k = self.slots.key(i);
            if k == key || k == EMPTY {
                return Spot { idx: i, held: k == key, moves };
            }
            i = self.next(i);
        }
    }

    /// The value at a held [`Spot`] taken since the last removal or resize.
    #[inline]
    pub fn at(&self, spot: Spot) -> Option<&V> {
        match (spot.held, spot.idx) {
            (false, _) => None,
            (true, NO_SLOT) => self.zero.as_ref(),
            (true, i) => Some(self.slots.val(i)),
        }
    }

    /// Inserts `key`, absent at `spot`: straight into the slot the spot found if nothing was
    /// removed or resized since and no resize is due, else by an ordinary insert. Returns
    /// the slot it now holds, a hint for [`Self::get_mut_near`].
    #[inline]
    pub fn put(&mut self, spot: Spot, key: u64, val: V) -> usize {
        let i = spot.idx;
        if !spot.held
            && spot.moves == self.moves
            && i != NO_SLOT
            && (self.used + 1) * 4 <= self.slots.cap() * 3
            && self.slots.key(i) == EMPTY
        {
            self.slots.set(i, key, val);
            self.used += 1;
            return i;
        }
        self.insert(key, val);
        if key == EMPTY {
            return NO_SLOT;
        }
        self.find(key).unwrap_or(NO_SLOT)
    }

    /// As [`Self::get_mut`], trying the slot `hint` first (a slot `key` was seen in before;
    /// any value is safe, a stale one costs the ordinary probe).
    #[inline]
    pub fn get_mut_near(&mut self, key: u64, hint: usize) -> Option<&mut V> {
        if key != EMPTY && self.slots.key_get(hint) == Some(key) {
            return Some(self.slots.val_mut(hint));
        }
        self.get_mut(key)
    }

    /// As [`Self::get`], also naming the slot, for a later [`Self::get_mut_near`].
    #[inline]
    pub fn get_at(&self, key: u64) -> Option<(&V, usize)> {
        if key == EMPTY {
            return self.zero.as_ref().map(|v| (v, NO_SLOT));
        }
        self.find(key).map(|i| (self.slots.val(i), i))
    }

    /// Removes `key`; shifts later keys of its probe run back so no tombstone remains.
    #[inline]
    pub fn remove(&mut self, key: u64) -> Option<V> {
        if key == EMPTY {
            return self.zero.take();
        }
        let i = self.find(key)?;
        let val = *self.slots.val(i);
        self.remove_at(i);
        Some(val)
    }

    /// Empties slot `hole`, moving later keys of its probe run back into it. The run is
    /// scanned to its end: up to the last slot, then on from slot 0 if it wraps.
    fn remove_at(&mut self, mut hole: usize) {
        self.moves = self.moves.wrapping_add(1);
        let (n, seed) = (self.slots.cap(), self.seed);
        let slots = &mut self.slots;
        // dist(hole, j): how far the hole is behind the key looked at.
        let mut gap = 0;
        let mut j = hole + 1;
        'run: loop {
            while j < n {
                let k = slots.key(j);
                if k == EMPTY {
                    break 'run;
                }
                gap += 1;
                // Move k back into the hole unless its home lies cyclically in (hole, j].
                let home = home_of(k, seed, n);
                let behind = if j >= home { j - home } else { j + n - home };
                if behind >= gap {
                    slots.shift(j, hole);
                    hole = j;
                    gap = 0;
                }
                j += 1;
            }
            j = 0;
        }
        slots.set_empty(hole);
        self.used -= 1;
        if SHRINK && self.used == 0 {
            self.slots = L::default();
        } else if SHRINK && n > SHRINK_ABOVE && self.used * 16 < n * 3 {
            self.resize((self.used * 2).max(SHRINK_ABOVE));
        }
    }

    fn resize(&mut self, cap: usize) {
        self.moves = self.moves.wrapping_add(1);
        let old = std::mem::replace(&mut self.slots, L::with_cap(cap));
        for j in 0..old.cap() {
            let k = old.key(j);
            if k == EMPTY {
                continue;
            }
            let mut i = self.home(k);
            while self.slots.key(i) != EMPTY {
                i = self.next(i);
            }
            self.slots.set(i, k, *old.val(j));
        }
    }

    /// As [`Self::prefetch`], and the rest of the probe run: removing `key` shifts it back,
    /// and inserting an absent key reads to its end.
    #[inline]
    pub fn prefetch_run(&self, key: u64) {
        if self.slots.cap() != 0 {
            self.slots.prefetch_run(self.home(key));
        }
    }

    /// Hints the CPU to fetch `key`'s home slot and the one after it: a removal shifts the
    /// slots after the one it empties, and a wide slot's successor is often on the next line.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        if self.slots.cap() != 0 {
            self.slots.prefetch(self.home(key));
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &V)> + '_ {
        let held = (0..self.slots.cap()).filter(|&i| self.slots.key(i) != EMPTY);
        self.zero.iter().map(|v| (EMPTY, v)).chain(held.map(|i| (self.slots.key(i), self.slots.val(i))))
    }

    /// Slots allocated.
    pub fn capacity(&self) -> usize {
        self.slots.cap()
    }

    /// Heap bytes held.
    #[cfg(test)]
    pub fn heap_bytes(&self) -> usize {
        self.slots.heap_bytes()
    }
}

impl<V: Copy + Default, const SHRINK: bool> LinearMap<V, SHRINK, Inline<V>> {
    /// Where the slots are and how keys map to them, for [`prefetch_raw`] by a thread that
    /// does not hold the map.
    pub fn raw_hint(&self) -> (*const u8, usize) {
        (self.slots.0.as_ptr() as *const u8, self.slots.0.len())
    }
}

/// Prefetches `key`'s home slot and the line after it given a [`LinearMap::raw_hint`] that may
/// be stale: the address is only computed and hinted, never dereferenced, so a stale hint is
/// harmless. The next line is what a removal's backward shift and a new key's probe read on.
#[inline]
pub(crate) fn prefetch_raw<V>(ptr: *const u8, cap: usize, key: u64) {
    if ptr.is_null() || cap == 0 {
        return;
    }
    let idx = home_of(key, crate::seeded::process_seed(), cap);
    prefetch_lines(ptr.wrapping_add(idx * std::mem::size_of::<Slot<V>>()), std::mem::size_of::<Slot<V>>() + 64);
}

/// Hints the CPU to fetch every cache line of the `len` bytes at `from`. The address is only
/// hinted, never dereferenced, so any address is harmless.
#[inline]
pub(crate) fn prefetch_lines(from: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in 0..(from as usize % 64 + len).div_ceil(64) {
        // SAFETY: prefetching is a hint and cannot fault, whatever the address.
        #[allow(unused_unsafe)]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(from.wrapping_add(line * 64) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (from, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #[test]
        fn behaves_like_a_hashmap(ops in proptest::collection::vec((0u8..10, 0u64..40, any::<u32>()), 0..600)) {
            behaves_like_a_hashmap_in::<Inline<u32>>(ops)?;
        }

        #[test]
        fn split_behaves_like_a_hashmap(ops in proptest::collection::vec((0u8..10, 0u64..40, any::<u32>()), 0..600)) {
            behaves_like_a_hashmap_in::<Split<u32>>(ops)?;
        }
    }

    /// Every operation, in either layout, against `HashMap`.
    fn behaves_like_a_hashmap_in<L: Layout<u32>>(ops: Vec<(u8, u64, u32)>) -> Result<(), TestCaseError> {
        let mut m: LinearMap<u32, true, L> = LinearMap::default();
        let mut r: HashMap<u64, u32> = HashMap::new();
        // Slots last seen per key: hints that later removals and resizes make stale.
        let mut seen: HashMap<u64, usize> = HashMap::new();
        for (op, k, v) in ops {
            // Small keys collide in probe runs; also exercise key 0 and multiples of 2^60.
            let key = if k % 7 == 0 { k << 58 } else { k };
            // A hint: where the key was last seen, or any slot at all.
            let hint = seen.get(&key).copied().unwrap_or(v as usize % 64);
            match op {
                5 | 6 => {
                    // One probe, then an insert there; with 6 another key goes in between
                    // (removed if held, else inserted), which may move or fill slots.
                    let spot = m.spot(key);
                    prop_assert_eq!(m.at(spot).copied(), r.get(&key).copied());
                    let other = key ^ 1;
                    if op == 6 {
                        if r.remove(&other).is_some() {
                            m.remove(other);
                        } else {
                            m.insert(other, v);
                            r.insert(other, v);
                        }
                    }
                    if let std::collections::hash_map::Entry::Vacant(e) = r.entry(key) {
                        seen.insert(key, m.put(spot, key, v));
                        e.insert(v);
                    }
                }
                7 => {
                    let got = m.get_mut_near(key, hint).map(|x| {
                        *x = x.wrapping_add(v);
                        *x
                    });
                    let want = r.get_mut(&key).map(|x| {
                        *x = x.wrapping_add(v);
                        *x
                    });
                    prop_assert_eq!(got, want);
                }
                8 => {
                    let f = |x: &mut u32| {
                        *x /= 2;
                        *x % 2 == 1
                    };
                    let want = r.get_mut(&key).map(f);
                    if want == Some(true) {
                        r.remove(&key);
                    }
                    prop_assert_eq!(m.update_or_remove_near(key, hint, f), want);
                }
                9 => {
                    let got = m.get_at(key).map(|(x, slot)| {
                        seen.insert(key, slot);
                        *x
                    });
                    prop_assert_eq!(got, r.get(&key).copied());
                }
                0 => prop_assert_eq!(m.insert(key, v), r.insert(key, v)),
                1 => prop_assert_eq!(m.remove(key), r.remove(&key)),
                2 => {
                    let (got, new) = m.upsert(key, v);
                    prop_assert_eq!(new, !r.contains_key(&key));
                    prop_assert_eq!(*got, *r.entry(key).or_insert(v));
                }
                3 => {
                    // Remove odd values, halve even ones.
                    let f = |x: &mut u32| {
                        *x /= 2;
                        *x % 2 == 1
                    };
                    let want = r.get_mut(&key).map(f);
                    if want == Some(true) {
                        r.remove(&key);
                    }
                    prop_assert_eq!(m.update_or_remove(key, f), want);
                }
                4 => m.reserve(k as usize),
                _ => prop_assert_eq!(m.get(key).copied(), r.get(&key).copied()),
            }
            prop_assert_eq!(m.len(), r.len());
        }
        let mut got: Vec<_> = m.iter().map(|(k, v)| (k, *v)).collect();
        let mut want: Vec<_> = r.into_iter().collect();
        got.sort_unstable();
        want.sort_unstable();
        prop_assert_eq!(got, want);
        Ok(())
    }

    #[test]
    fn reserving_makes_room_in_one_step() {
        let mut m: LinearMap<u64> = LinearMap::default();
        m.insert(7, 7);
        m.reserve(1000);
        let cap = m.heap_bytes();
        for k in 1000..2000u64 {
            m.insert(k, k);
        }
        assert_eq!(m.heap_bytes(), cap, "inserting what was reserved resized the table");
        assert!((1000..2000u64).all(|k| m.get(k) == Some(&k)) && m.get(7) == Some(&7));
        m.reserve(0);
        assert_eq!(m.heap_bytes(), cap);
    }

    #[test]
    fn churn_keeps_size_and_emptying_gives_memory_back() {
        churn_keeps_size_and_emptying_gives_memory_back_in::<Inline<u64>>();
        churn_keeps_size_and_emptying_gives_memory_back_in::<Split<u64>>();
    }

    fn churn_keeps_size_and_emptying_gives_memory_back_in<L: Layout<u64>>() {
        let mut m: LinearMap<u64, true, L> = LinearMap::default();
        for i in 1..=16384u64 {
            m.insert(i, i);
        }
        let settled = m.heap_bytes();
        for i in 16385..1_000_000u64 {
            assert_eq!(m.remove(i - 16384), Some(i - 16384));
            m.insert(i, i);
        }
        assert_eq!(m.len(), 16384);
        assert_eq!(m.heap_bytes(), settled);
        for i in 1_000_000 - 16384..1_000_000u64 {
            m.remove(i);
        }
        assert_eq!(m.len(), 0);
        assert_eq!(m.heap_bytes(), 0);
    }

    #[test]
    fn a_table_that_does_not_shrink_keeps_its_room_even_when_empty() {
        let mut shrinks: LinearMap<u64> = LinearMap::default();
        let mut keeps: LinearMap<u64, false> = LinearMap::default();
        for i in 1..=4096u64 {
            shrinks.insert(i, i);
            keeps.insert(i, i);
        }
        let full = keeps.heap_bytes();
        for i in 2..=4096u64 {
            shrinks.remove(i);
            keeps.remove(i);
        }
        assert!(shrinks.heap_bytes() < full / 8, "the default table shrinks: {} of {full}", shrinks.heap_bytes());
        assert_eq!(keeps.heap_bytes(), full);
        assert_eq!(keeps.get(1), Some(&1));
        keeps.remove(1);
        assert_eq!(keeps.heap_bytes(), full);
        shrinks.remove(1);
        assert_eq!(shrinks.heap_bytes(), 0);
    }
}
