//! The atomics, locks and epoch collector of what lookups read while writers change it: the
//! standard ones, or loom's when the index is model-checked
//! (`RUSTFLAGS="--cfg loom --cfg crossbeam_loom"`, see `tests/loom_index.rs`).

pub(crate) use crossbeam_epoch as epoch;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;
#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex, MutexGuard};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

/// Lets other threads run while this one waits (a grace period, a slot given back).
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}

/// loom's mutex with parking_lot's interface (`lock` returns the guard).
#[cfg(loom)]
#[derive(Default)]
pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

#[cfg(loom)]
impl<T> Mutex<T> {
    pub(crate) fn new(t: T) -> Self {
        Mutex(loom::sync::Mutex::new(t))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        match self.0.lock() {
            Ok(g) => g,
            Err(e) => e.into_inner(),
        }
    }
}
