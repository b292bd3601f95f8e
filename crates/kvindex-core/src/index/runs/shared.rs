//! What lookups read while writers change it: runs, their local hashes and their child tables.
//! Readers reach all of it under an epoch guard and take no lock; writers change a run only
//! while holding its lock, in place where one atomic store says it all, else by publishing a
//! new copy and retiring the old one to the epoch collector.

use super::cover::{Cover, List};
use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Mutex, Ordering};
use crossbeam_epoch::{self as epoch, Atomic, Guard};
use std::ptr::NonNull;

/// A run's number in the index's slab: how writers' maps name it (four bytes, not eight).
pub(crate) type RunId = u32;

/// The root's id: the virtual run of no blocks whose children are the chains' first blocks.
pub(crate) const ROOT: RunId = 0;

/// A run's published hashes as a reader sees them: the array itself (a copy in the model).
#[cfg(not(loom))]
pub(crate) type HashView<'a> = &'a [u64];
/// A run's published hashes as a reader sees them: the array itself (a copy in the model).
#[cfg(loom)]
pub(crate) type HashView<'a> = Vec<u64>;

/// A run's local hashes, append-only: the first `len` never change while the array lives, so a
/// reader that loads `len` reads them as plain memory.
pub(crate) struct Hashes {
    /// Hashes written: released after them.
    len: AtomicU32,
    /// The hashes; past `len`, room for appends.
    words: Box<[AtomicU64]>,
}

impl Hashes {
    /// The array of `locals`, with room for `cap` in all.
    pub(crate) fn new(locals: impl Iterator<Item = u64>, cap: usize) -> Hashes {
        let mut words: Vec<AtomicU64> = locals.map(AtomicU64::new).collect();
        let len = words.len();
        words.resize_with(cap.max(len), || AtomicU64::new(0));
        Hashes { len: AtomicU32::new(len as u32), words: words.into_boxed_slice() }
    }

    /// The published hashes.
    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn published(&self) -> HashView<'_> {
        let len = (self.len.load(Ordering::Acquire) as usize).min(self.words.len());
        // SAFETY: `AtomicU64` has the layout of `u64`. The first `len` words were stored before
        // `len` was released (the acquire above orders them before these reads), and no word
        // below `len` is written again while the array lives, so nothing races the reads.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u64>(), len) }
    }

    /// The published hashes, each loaded (loom's atomics are not plain memory).
    #[cfg(loom)]
    pub(crate) fn published(&self) -> HashView<'_> {
        let len = (self.len.load(Ordering::Acquire) as usize).min(self.words.len());
        self.words[..len].iter().map(|w| w.load(Ordering::Relaxed)).collect()
    }

    /// Writer: hashes written.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed) as usize
    }

    /// Writer: room in all.
    pub(crate) fn capacity(&self) -> usize {
        self.words.len()
    }

    /// Writer (run locked): appends `locals`, which the caller made room for.
    pub(crate) fn append(&self, locals: impl Iterator<Item = u64>) {
        let mut len = self.len();
        for l in locals {
            self.words[len].store(l, Ordering::Relaxed);
            len += 1;
        }
        self.len.store(len as u32, Ordering::Release);
    }

    /// Writer: a copy with room for `cap` hashes.
    pub(crate) fn grown(&self, cap: usize) -> Hashes {
        Hashes::new(self.published().iter().copied(), cap)
    }

    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.words.len() * 8
    }
}

/// The sentinel of a child slot whose child died: probes go past it; the next child linked on
/// a probe path through it takes it.
fn tomb() -> *mut Run {
    NonNull::<Run>::dangling().as_ptr()
}

/// One child of a run: the hash of its first block and the child.
struct ChildSlot {
    /// The child's first local hash, stored before `run` is released: a filter only, since a
    /// reader may pair it with the slot's previous child (the child's own `head` decides).
    head: AtomicU64,
    /// Null (never used), the tomb sentinel, or the child.
    run: AtomicPtr<Run>,
}

/// A run's children, keyed by (the offset they diverge at, their first local hash): open
/// addressing, linear probing, a power-of-two number of slots. A slot goes from empty to a
/// child, then between tomb and child, never back to empty: a probe that meets an empty slot
/// has seen every key of its path. A dead child's tomb is reused, so a child unlinked and
/// linked again lands where it was instead of growing its cluster.
pub(crate) struct Children {
    /// A power of two many.
    slots: Box<[ChildSlot]>,
}

/// Slot a (divergence offset, first hash) pair starts probing at: keyed with the process seed,
/// since publishers choose the hashes.
#[inline]
fn home(attach: u32, head: u64, seed: u64, mask: usize) -> usize {
    crate::seeded::mix(head ^ u64::from(attach).wrapping_mul(0xA24B_AED4_963E_E407), seed) as usize & mask
}

impl Children {
    /// An empty table of `cap` slots (rounded up to a power of two).
    pub(crate) fn new(cap: usize) -> Children {
        let cap = cap.max(2).next_power_of_two();
        Children {
            slots: (0..cap).map(|_| ChildSlot { head: AtomicU64::new(0), run: AtomicPtr::new(std::ptr::null_mut()) }).collect(),
        }
    }

    /// Slots in all.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Reader: the child that diverges at `attach` with the first local hash `head`.
    #[inline]
    pub(crate) fn find<'g>(&self, attach: u32, head: u64, seed: u64, _guard: &'g Guard) -> Option<&'g Run> {
        let mask = self.slots.len() - 1;
        let mut i = home(attach, head, seed, mask);
        for _ in 0..self.slots.len() {
            let s = &self.slots[i];
            let run = s.run.load(Ordering::Acquire);
            if run.is_null() {
                return None;
            }
            if run != tomb() && s.head.load(Ordering::Relaxed) == head {
                // SAFETY: a child linked here is retired only after it is tombed, through the
                // epoch collector: the guard keeps it alive.
                let child = unsafe { &*run };
                if child.attach == attach && child.head == head {
                    return Some(child);
                }
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Writer (parent locked, room made by the caller, `child`'s key not linked): links
    /// `child` in the first tomb or empty slot of its path; whether it took a tomb.
    pub(crate) fn insert(&self, child: &Run, head: u64, seed: u64) -> bool {
        let mask = self.slots.len() - 1;
        let mut i = home(child.attach, head, seed, mask);
        loop {
            let run = self.slots[i].run.load(Ordering::Relaxed);
            if run.is_null() || run == tomb() {
                self.slots[i].head.store(head, Ordering::Relaxed);
                self.slots[i].run.store(child as *const Run as *mut Run, Ordering::Release);
                return run == tomb();
            }
            i = (i + 1) & mask;
        }
    }

    /// Writer (parent locked): unlinks `child`; whether it was linked.
    pub(crate) fn remove(&self, child: &Run, head: u64, seed: u64) -> bool {
        let mask = self.slots.len() - 1;
        let mut i = home(child.attach, head, seed, mask);
        let me = child as *const Run as *mut Run;
        for _ in 0..self.slots.len() {
            let run = self.slots[i].run.load(Ordering::Relaxed);
            if run.is_null() {
                return false;
            }
            if run == me {
                self.slots[i].run.store(tomb(), Ordering::Release);
                return true;
            }
            i = (i + 1) & mask;
        }
        false
    }

    /// Writer: every linked child with its head.
    pub(crate) fn each(&self) -> impl Iterator<Item = (*const Run, u64)> + '_ {
        self.slots.iter().filter_map(|s| {
            let run = s.run.load(Ordering::Relaxed);
            (!run.is_null() && run != tomb()).then(|| (run as *const Run, s.head.load(Ordering::Relaxed)))
        })
    }

    /// Writer: a copy without tombs, with `cap` slots.
    pub(crate) fn rebuilt(&self, cap: usize, seed: u64) -> Children {
        let t = Children::new(cap);
        for (run, head) in self.each() {
            // SAFETY: linked children are alive while their parent is locked.
            t.insert(unsafe { &*run }, head, seed);
        }
        t
    }

    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<ChildSlot>()
    }
}

/// A stretch of one chain: its blocks' local hashes, which workers hold how much of it, and
/// the runs that continue it with other blocks.
pub(crate) struct Run {
    /// Its number in the slab.
    pub(crate) id: RunId,
    /// The run it continues (`ROOT` for a chain's first run): it outlives its children.
    pub(crate) parent: RunId,
    /// Position of its first block in the sequence.
    pub(crate) start: u32,
    /// Its first local hash (0 for the root), never changed: with `attach`, its key in the
    /// parent, read by lookups that find it in a child slot.
    pub(crate) head: u64,
    /// How many of the parent's blocks it follows: its first block's parent is the parent's
    /// block `attach - 1` (0 under the root). With the first hash, its key in the parent.
    pub(crate) attach: u32,
    /// Its blocks' local hashes (null only for the root).
    pub(crate) hashes: Atomic<Hashes>,
    /// Who holds how much of it.
    pub(crate) cover: Atomic<Cover>,
    /// The runs diverging from it (null until it has one).
    pub(crate) children: Atomic<Children>,
    /// Writers' bookkeeping, behind the lock every change to the run takes.
    pub(crate) meta: Mutex<Meta>,
}

/// What writers keep of a run beside what lookups read.
#[derive(Default)]
pub(crate) struct Meta {
    /// Workers holding any of its blocks, seen or hidden behind a hole: with `kids`, what keeps
    /// it alive.
    pub(crate) holders: u32,
    /// Children linked.
    pub(crate) kids: u32,
    /// Tombs in the child table (rebuilt when they and the children fill three quarters).
    pub(crate) tombs: u32,
    /// Vacated words of its coverage list (reused by the next joiner).
    pub(crate) vacated: u32,
    /// Workers with a cutoff in it: what chooses its coverage's form.
    pub(crate) covered: u32,
    /// It was unlinked: a writer that reached it by a lookup goes back and looks again.
    pub(crate) dead: bool,
}

impl Run {
    /// A run of `locals` at `start`, continuing `parent` after `attach` of its blocks, with
    /// room for `cap` hashes.
    pub(crate) fn new(id: RunId, parent: RunId, start: u32, attach: u32, hashes: Option<Hashes>) -> Run {
        let head = hashes.as_ref().and_then(|h| h.published().first().copied()).unwrap_or(0);
        Run {
            id,
            parent,
            start,
            head,
            attach,
            hashes: hashes.map_or_else(Atomic::null, Atomic::new),
            cover: Atomic::new(Cover::List(List::new(2))),
            children: Atomic::null(),
            meta: Mutex::new(Meta::default()),
        }
    }

    /// Reader: its published hashes (none for the root).
    #[inline]
    pub(crate) fn hashes<'g>(&self, guard: &'g Guard) -> HashView<'g> {
        // SAFETY: arrays are retired through the collector only after being replaced.
        unsafe { self.hashes.load(Ordering::Acquire, guard).as_ref() }.map_or_else(Default::default, Hashes::published)
    }

    /// Reader: asks the CPU for the first lines of its hashes, which a lookup compares after
    /// reading its coverage (the two chains of loads then overlap).
    #[inline]
    pub(crate) fn prefetch_hashes(&self, guard: &Guard) {
        // SAFETY: as for `hashes`.
        if let Some(h) = unsafe { self.hashes.load(Ordering::Acquire, guard).as_ref() } {
            crate::index::linear::prefetch_lines(h.words.as_ptr().cast(), h.words.len().min(16) * 8);
        }
    }

    /// Reader: its coverage.
    #[inline]
    pub(crate) fn cover<'g>(&self, guard: &'g Guard) -> &'g Cover {
        // SAFETY: as for `hashes`; a run always has a coverage list.
        unsafe { self.cover.load(Ordering::Acquire, guard).deref() }
    }

    /// Reader: the child diverging at `attach` with the first local hash `head`.
    #[inline]
    pub(crate) fn child<'g>(&self, attach: u32, head: u64, seed: u64, guard: &'g Guard) -> Option<&'g Run> {
        // SAFETY: as for `hashes`.
        unsafe { self.children.load(Ordering::Acquire, guard).as_ref() }?.find(attach, head, seed, guard)
    }

    /// Heap bytes of the run and its arrays (writer side, for stats).
    pub(crate) fn heap_bytes(&self, guard: &Guard) -> usize {
        // SAFETY: as for `hashes`.
        let h = unsafe { self.hashes.load(Ordering::Acquire, guard).as_ref() }.map_or(0, Hashes::heap_bytes);
        let c = unsafe { self.cover.load(Ordering::Acquire, guard).as_ref() }.map_or(0, Cover::heap_bytes);
        let k = unsafe { self.children.load(Ordering::Acquire, guard).as_ref() }.map_or(0, Children::heap_bytes);
        std::mem::size_of::<Run>() + h + c + k
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        // SAFETY: a run is dropped when it is retired (unlinked, and every reader that could
        // reach it gone) or with its index: nothing else points at its arrays.
        unsafe {
            let g = epoch::unprotected();
            let h = self.hashes.load(Ordering::Relaxed, g);
            if !h.is_null() {
                drop(h.into_owned());
            }
            let c = self.cover.load(Ordering::Relaxed, g);
            if !c.is_null() {
                drop(c.into_owned());
            }
            let k = self.children.load(Ordering::Relaxed, g);
            if !k.is_null() {
                drop(k.into_owned());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(id: RunId, head: u64) -> Run {
        Run::new(id, ROOT, 0, 0, Some(Hashes::new([head].into_iter(), 1)))
    }

    #[test]
    fn a_child_linked_again_takes_its_tomb() {
        let guard = epoch::pin();
        let t = Children::new(64);
        let (a, b) = (run(1, 11), run(2, 22));
        assert!(!t.insert(&a, 11, 7));
        assert!(!t.insert(&b, 22, 7));
        for _ in 0..1000 {
            assert!(t.remove(&a, 11, 7));
            assert!(t.find(0, 11, 7, &guard).is_none());
            assert!(t.insert(&a, 11, 7), "the tomb on its path is reused");
            assert!(std::ptr::eq(t.find(0, 11, 7, &guard).unwrap(), &a));
        }
        assert_eq!(t.each().count(), 2);
        assert!(std::ptr::eq(t.find(0, 22, 7, &guard).unwrap(), &b));
    }

    #[test]
    fn a_slot_paired_with_another_head_is_not_its_child() {
        let guard = epoch::pin();
        let t = Children::new(2);
        let a = run(1, 11);
        t.insert(&a, 11, 7);
        // What a reader sees when it loads a slot's child before a writer reuses the slot and
        // its head after: the child's own head decides.
        let slot = t.slots.iter().find(|s| !s.run.load(Ordering::Relaxed).is_null()).unwrap();
        slot.head.store(33, Ordering::Relaxed);
        assert!(t.find(0, 33, 7, &guard).is_none());
    }
}
