//! The atomics of the structures lookups read while writers change them: the standard ones,
//! or loom's when the read protocol is model-checked (`RUSTFLAGS="--cfg loom"`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
