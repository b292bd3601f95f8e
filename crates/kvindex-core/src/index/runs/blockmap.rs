//! A worker's map from engine hash to place: the one per-block table of the run index's writes.
//!
//! A SwissTable in small: 16-byte slots with a control byte each (empty, deleted, or seven
//! bits of the key's hash), probed eight control bytes at a time by word arithmetic, so a probe
//! costs a line of control bytes and touches a slot only when its byte matches. Removal marks a
//! byte empty when no probe can have passed it, else deleted; a table whose room is used up by
//! deleted bytes is rebuilt at the same size, and it doubles only when more than five eighths
//! full of keys. That policy is why this is not `hashbrown`: under steady churn (an engine
//! storing and evicting at the same rate for hours) hashbrown doubles a table half full of keys,
//! which measured 79 bytes per placement here instead of 44. Keys are hashed with the process
//! seed (publishers choose engine hashes).

use crate::digest::Digest;
use crate::index::linear::prefetch_lines;

/// Control byte of a slot never used since the last rebuild.
const EMPTY: u8 = 0xFF;
/// Control byte of a slot whose key was removed after probes may have passed it.
const DELETED: u8 = 0x80;
/// Smallest table a map with keys allocates.
const MIN_SLOTS: usize = 32;

#[derive(Clone, Copy, Default)]
struct Slot {
    /// An engine hash (meaningful while its control byte says full).
    key: u64,
    /// Its place.
    val: u64,
}

/// Control bytes probed at once, and their masks: one bit per byte, lowest byte first.
#[cfg(target_arch = "x86_64")]
mod group {
    use std::arch::x86_64::{__m128i, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8};

    pub(super) const GROUP: usize = 16;

    /// Sixteen control bytes.
    #[derive(Clone, Copy)]
    pub(super) struct Group(__m128i);

    impl Group {
        #[inline]
        pub(super) fn load(b: &[u8]) -> Group {
            assert!(b.len() >= GROUP);
            // SAFETY: SSE2 is part of x86_64; the read is unaligned and within `b`.
            Group(unsafe { _mm_loadu_si128(b.as_ptr().cast::<__m128i>()) })
        }
        #[inline]
        pub(super) fn matching(self, c: u8) -> u32 {
            // SAFETY: SSE2 is part of x86_64.
            unsafe { _mm_movemask_epi8(_mm_cmpeq_epi8(self.0, _mm_set1_epi8(c as i8))) as u32 }
        }
        #[inline]
        pub(super) fn free(self) -> u32 {
            // SAFETY: SSE2 is part of x86_64: the top bit of each byte (empty and deleted).
            unsafe { _mm_movemask_epi8(self.0) as u32 }
        }
        #[inline]
        pub(super) fn empty(self) -> u32 {
            self.matching(super::EMPTY)
        }
    }
}

/// Control bytes probed at once, by word arithmetic where SSE2 is not there.
#[cfg(not(target_arch = "x86_64"))]
mod group {
    pub(super) const GROUP: usize = 8;
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;

    /// Eight control bytes.
    #[derive(Clone, Copy)]
    pub(super) struct Group(u64);

    /// One bit per byte from the bytes' high bits.
    fn compress(m: u64) -> u32 {
        (0..8).fold(0, |acc, i| acc | (((m >> (8 * i + 7)) & 1) as u32) << i)
    }

    impl Group {
        #[inline]
        pub(super) fn load(b: &[u8]) -> Group {
            let mut w = [0u8; GROUP];
            w.copy_from_slice(&b[..GROUP]);
            Group(u64::from_le_bytes(w))
        }
        #[inline]
        pub(super) fn matching(self, c: u8) -> u32 {
            let x = self.0 ^ (LO * u64::from(c));
            // Exact: a byte is zero iff adding 0x7f to its low seven bits leaves its top bit clear.
            compress(!(((x & !HI).wrapping_add(!HI & (LO * 0x7f))) | x) & HI)
        }
        #[inline]
        pub(super) fn free(self) -> u32 {
            compress(self.0 & HI)
        }
        #[inline]
        pub(super) fn empty(self) -> u32 {
            self.matching(super::EMPTY)
        }
    }
}

use group::{Group, GROUP};

/// Engine hash -> place, for one worker.
pub(crate) struct BlockMap {
    /// One byte per slot, then the first `GROUP` again, so a group read never wraps.
    ctrl: Box<[u8]>,
    /// A power of two many, or none before the first insert.
    slots: Box<[Slot]>,
    /// Keys held.
    len: usize,
    /// Empty slots that may still take a key before a rebuild (seven eighths of the table in
    /// all; deleted bytes do not give theirs back until the rebuild).
    room: usize,
    /// The process seed the hashes are keyed with.
    seed: u64,
    /// The digest of the keys held: a key inserted anew adds to it, one removed takes away.
    digest: Digest,
}

impl Default for BlockMap {
    fn default() -> Self {
        BlockMap {
            ctrl: Box::default(),
            slots: Box::default(),
            len: 0,
            room: 0,
            seed: crate::seeded::process_seed(),
            digest: Digest::default(),
        }
    }
}

impl BlockMap {
    /// Keys held.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The digest of the keys held.
    #[inline]
    pub(crate) fn digest(&self) -> Digest {
        self.digest
    }

    #[inline]
    fn hash(&self, key: u64) -> u64 {
        crate::seeded::mix(key, self.seed)
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The home slot (low bits of the hash) and the control byte (its top seven bits).
    #[inline]
    fn split(&self, hash: u64) -> (usize, u8) {
        (hash as usize & self.mask(), (hash >> 57) as u8)
    }

    #[inline]
    fn group(&self, i: usize) -> Group {
        Group::load(&self.ctrl[i..])
    }

    #[inline]
    fn set_ctrl(&mut self, i: usize, c: u8) {
        self.ctrl[i] = c;
        self.ctrl[(i.wrapping_sub(GROUP) & self.mask()) + GROUP] = c;
    }

    /// The slot of `key`, if held; needs slots.
    #[inline(always)]
    fn find(&self, key: u64, hash: u64) -> Option<usize> {
        let (mut pos, h2) = self.split(hash);
        let mask = self.mask();
        let mut stride = 0;
        loop {
            let g = self.group(pos);
            let mut m = g.matching(h2);
            while m != 0 {
                let i = (pos + m.trailing_zeros() as usize) & mask;
                if self.slots[i].key == key {
                    return Some(i);
                }
                m &= m - 1;
            }
            if g.empty() != 0 {
                return None;
            }
            stride += GROUP;
            pos = (pos + stride) & mask;
        }
    }

    /// The first empty or deleted slot on `hash`'s probe path; needs room.
    #[inline]
    fn free_slot(&self, hash: u64) -> usize {
        let (mut pos, _) = self.split(hash);
        let mask = self.mask();
        let mut stride = 0;
        loop {
            let m = self.group(pos).free();
            if m != 0 {
                return (pos + m.trailing_zeros() as usize) & mask;
            }
            stride += GROUP;
            pos = (pos + stride) & mask;
        }
    }

    /// The place of `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        self.find(key, self.hash(key)).map(|i| self.slots[i].val)
    }

    /// Hints the CPU to fetch what a write of `key` reads first: its control bytes and slot.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        let (i, _) = self.split(self.hash(key));
        prefetch_lines(self.ctrl.as_ptr().wrapping_add(i), GROUP);
        // The key sits a few slots past its home at most, mostly: two lines of slots.
        prefetch_lines(self.slots.as_ptr().wrapping_add(i) as *const u8, 4 * std::mem::size_of::<Slot>());
    }

    /// Makes room for `more` keys beyond those held, in at most one rebuild.
    pub(crate) fn reserve(&mut self, more: usize) {
        if more > self.room {
            self.rebuild_for(self.len + more);
        }
    }

    /// Inserts or replaces; the old value.
    #[inline]
    pub(crate) fn insert(&mut self, key: u64, val: u64) -> Option<u64> {
        let hash = self.hash(key);
        if self.slots.is_empty() {
            self.rebuild_for(1);
        }
        // One probe: the key's slot if it is held, else the first free slot on its path.
        let (mut pos, h2) = self.split(hash);
        let mask = self.mask();
        let mut stride = 0;
        let mut free = None;
        loop {
            let g = self.group(pos);
            let mut m = g.matching(h2);
            while m != 0 {
                let i = (pos + m.trailing_zeros() as usize) & mask;
                if self.slots[i].key == key {
                    return Some(std::mem::replace(&mut self.slots[i].val, val));
                }
                m &= m - 1;
            }
            if free.is_none() {
                let f = g.free();
                if f != 0 {
                    free = Some((pos + f.trailing_zeros() as usize) & mask);
                }
            }
            if g.empty() != 0 {
                break;
            }
            stride += GROUP;
            pos = (pos + stride) & mask;
        }
        let mut i = free.unwrap_or_else(|| self.free_slot(hash));
        if self.ctrl[i] == EMPTY {
            if self.room == 0 {
                self.rebuild_for(self.len + 1);
                i = self.free_slot(hash);
            }
            if self.ctrl[i] == EMPTY {
                self.room -= 1;
            }
        }
        self.set_ctrl(i, h2);
        self.slots[i] = Slot { key, val };
        self.len += 1;
        self.digest.add(key);
        None
    }

    /// Removes `key`; its value.
    #[inline]
    pub(crate) fn remove(&mut self, key: u64) -> Option<u64> {
        if self.len == 0 {
            return None;
        }
        let i = self.find(key, self.hash(key))?;
        let val = self.slots[i].val;
        // A probe stops at a group holding an empty byte, so the slot may go back to empty
        // (its room with it) only if no run of eight full bytes spans it.
        let mask = self.mask();
        let before = self.group(i.wrapping_sub(GROUP) & mask).empty() << (32 - GROUP);
        let after = self.group(i).empty() | (1 << GROUP);
        if (before.leading_zeros() + after.trailing_zeros()) as usize >= GROUP {
            self.set_ctrl(i, DELETED);
        } else {
            self.set_ctrl(i, EMPTY);
            self.room += 1;
        }
        self.len -= 1;
        self.digest.remove(key);
        if self.len == 0 {
            *self = BlockMap { seed: self.seed, ..BlockMap::default() };
        } else if self.slots.len() > MIN_SLOTS && self.len * 16 < self.slots.len() {
            self.rebuild_for(self.len);
        }
        Some(val)
    }

    /// Rebuilds the table for `want` keys: the same size while it is at most five eighths full
    /// of them (which drops the deleted bytes), else larger; smaller when an eighth full.
    fn rebuild_for(&mut self, want: usize) {
        let mut cap = self.slots.len().max(MIN_SLOTS);
        while want * 8 > cap * 5 {
            cap *= 2;
        }
        while cap > MIN_SLOTS && want * 8 < cap {
            cap /= 2;
        }
        let old_ctrl = std::mem::replace(&mut self.ctrl, vec![EMPTY; cap + GROUP].into_boxed_slice());
        let old_slots = std::mem::replace(&mut self.slots, vec![Slot::default(); cap].into_boxed_slice());
        self.room = cap / 8 * 7;
        for (s, &c) in old_slots.iter().zip(old_ctrl.iter()) {
            if c & 0x80 == 0 {
                let hash = self.hash(s.key);
                let i = self.free_slot(hash);
                self.set_ctrl(i, c);
                self.slots[i] = *s;
                self.room -= 1;
            }
        }
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots.iter().zip(self.ctrl.iter()).filter(|(_, &c)| c & 0x80 == 0).map(|(s, _)| (s.key, s.val))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

        /// Inserts, replaces and removes agree with a hash map, across growth, rebuilds that
        /// drop deleted bytes, shrinking, and probe groups that wrap around the table's end
        /// (few keys, so probes collide).
        #[test]
        fn behaves_like_a_hashmap(ops in proptest::collection::vec((0u8..10, 0u64..300, any::<u64>()), 0..3000)) {
            let mut m = BlockMap::default();
            let mut model = HashMap::new();
            for (op, k, v) in ops {
                match op {
                    0..=4 => prop_assert_eq!(m.insert(k, v), model.insert(k, v)),
                    5..=8 => prop_assert_eq!(m.remove(k), model.remove(&k)),
                    _ => prop_assert_eq!(m.get(k), model.get(&k).copied()),
                }
                prop_assert_eq!(m.len(), model.len());
                prop_assert!(m.slots.is_empty() || m.len * 8 <= m.slots.len() * 7);
                let free = m.ctrl[..m.slots.len()].iter().filter(|&&c| c == EMPTY).count();
                prop_assert!(m.slots.is_empty() || free > m.slots.len() / 8 - 1, "a probe always meets an empty byte");
            }
            let mut all: Vec<(u64, u64)> = m.iter().collect();
            all.sort_unstable();
            let mut want: Vec<(u64, u64)> = model.into_iter().collect();
            want.sort_unstable();
            prop_assert_eq!(all, want);
        }
    }
}
