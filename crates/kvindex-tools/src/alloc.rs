//! A counting global allocator: the benchmark reads how many heap bytes the index holds and
//! the peak during a replay. The `kvindex` binary installs it; counting is off (one relaxed
//! load per allocation) until [`enable`] is called, so the daemon does not pay for it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// The system allocator, counting live and peak bytes.
pub struct CountingAlloc;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);
static ON: AtomicBool = AtomicBool::new(false);

/// Starts counting. Frees of blocks allocated before are not subtracted, so only
/// differences between two readings after this call mean anything.
pub fn enable() {
    ON.store(true, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() && ON.load(Ordering::Relaxed) {
            let size = layout.size() as isize;
            let now = LIVE.fetch_add(size, Ordering::Relaxed) + size;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        if ON.load(Ordering::Relaxed) {
            // May go below zero: a block allocated before `enable` may be freed after it.
            LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() && ON.load(Ordering::Relaxed) {
            let grow = new_size as isize - layout.size() as isize;
            let now = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
}

/// Heap bytes live now, counted since [`enable`] (0 unless [`CountingAlloc`] is installed).
pub fn live_bytes() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Highest live heap bytes since the last [`reset_peak`].
pub fn peak_bytes() -> isize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak measurement from the current live bytes.
pub fn reset_peak() {
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// True when counting is on and the counting allocator is installed.
pub fn is_counting() -> bool {
    ON.load(Ordering::Relaxed) && LIVE.load(Ordering::Relaxed) != 0
}
