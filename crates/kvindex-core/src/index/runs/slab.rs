//! Runs by id. A writer's map names the run of each block by a four-byte id, which the slab
//! turns back into the run; lookups never use ids (they follow child pointers). An id is free
//! again as soon as its run is unlinked: only writers use ids, and a writer names by id only a
//! run it holds blocks in, which cannot die under it.

use super::shared::{Run, RunId, ROOT};
use crate::sync::{AtomicPtr, Mutex, Ordering};
use crossbeam_epoch::Guard;

/// Ids per chunk of the directory.
#[cfg(not(loom))]
const CHUNK_BITS: u32 = 12;
/// Ids per chunk of the directory (few in the model, where every atomic is tracked).
#[cfg(loom)]
const CHUNK_BITS: u32 = 3;
const CHUNK: usize = 1 << CHUNK_BITS;
/// Chunks in the directory: 64 Mi runs in all.
#[cfg(not(loom))]
const DIR: usize = 1 << 14;
/// Chunks in the directory (few in the model).
#[cfg(loom)]
const DIR: usize = 1 << 4;

/// One chunk of run pointers, allocated on first use.
type Chunk = [AtomicPtr<Run>; CHUNK];

/// The index's runs, each owned here (as a raw box) from creation until it is taken out.
pub(crate) struct Slab {
    /// Chunk pointers, null until used.
    dir: Box<[AtomicPtr<Chunk>]>,
    /// Ids free for reuse, and the next never used.
    ids: Mutex<(Vec<RunId>, RunId)>,
}

impl Slab {
    /// An empty slab (the root's id is handed out first).
    pub(crate) fn new() -> Slab {
        Slab { dir: (0..DIR).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect(), ids: Mutex::new((Vec::new(), ROOT)) }
    }

    /// A free id, or `None` when all 64 Mi are taken.
    pub(crate) fn alloc_id(&self) -> Option<RunId> {
        let mut ids = self.ids.lock();
        if let Some(id) = ids.0.pop() {
            return Some(id);
        }
        let id = ids.1;
        if id as usize >= DIR * CHUNK {
            return None;
        }
        ids.1 += 1;
        Some(id)
    }

    /// The chunk of `id`, allocated if missing.
    fn chunk(&self, id: RunId) -> &Chunk {
        let slot = &self.dir[id as usize >> CHUNK_BITS];
        let mut p = slot.load(Ordering::Acquire);
        if p.is_null() {
            let fresh: Box<Chunk> = Box::new(std::array::from_fn(|_| AtomicPtr::new(std::ptr::null_mut())));
            let fresh = Box::into_raw(fresh);
            match slot.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => p = fresh,
                Err(other) => {
                    // SAFETY: `fresh` was never shared.
                    drop(unsafe { Box::from_raw(fresh) });
                    p = other;
                }
            }
        }
        // SAFETY: chunks live as long as the slab.
        unsafe { &*p }
    }

    /// Takes ownership of `run` under its id (from [`Slab::alloc_id`]).
    pub(crate) fn publish<'g>(&self, run: Box<Run>, _guard: &'g Guard) -> &'g Run {
        let id = run.id;
        let p = Box::into_raw(run);
        self.chunk(id)[id as usize & (CHUNK - 1)].store(p, Ordering::Release);
        // SAFETY: just published; it is freed only after being taken out and retired through
        // the collector, which waits for `_guard`.
        unsafe { &*p }
    }

    /// The run of `id`, if published.
    #[inline]
    pub(crate) fn get<'g>(&self, id: RunId, _guard: &'g Guard) -> Option<&'g Run> {
        let c = self.dir.get(id as usize >> CHUNK_BITS)?.load(Ordering::Acquire);
        if c.is_null() {
            return None;
        }
        // SAFETY: chunks live as long as the slab; a run taken out is retired through the
        // collector, which waits for `_guard`.
        unsafe { (*c)[id as usize & (CHUNK - 1)].load(Ordering::Acquire).as_ref() }
    }

    /// Takes the run of `id` out (the caller retires it) and frees the id.
    pub(crate) fn take(&self, id: RunId) -> *mut Run {
        let p = self.chunk(id)[id as usize & (CHUNK - 1)].swap(std::ptr::null_mut(), Ordering::AcqRel);
        self.ids.lock().0.push(id);
        p
    }

    /// Every published run (writer side: stats and tests).
    pub(crate) fn each<'g>(&'g self, guard: &'g Guard) -> impl Iterator<Item = &'g Run> + 'g {
        let next = self.ids.lock().1;
        (0..next).filter_map(move |id| self.get(id, guard))
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        for c in self.dir.iter() {
            let c = c.load(Ordering::Relaxed);
            if c.is_null() {
                continue;
            }
            // SAFETY: the slab is being dropped: no reader or writer is left, and every run
            // still published is owned here.
            let chunk = unsafe { Box::from_raw(c) };
            for r in chunk.iter() {
                let r = r.load(Ordering::Relaxed);
                if !r.is_null() {
                    drop(unsafe { Box::from_raw(r) });
                }
            }
        }
    }
}
