//! Test builds only (feature `fault-injection`): a wrong application made on purpose, so that
//! the replicas' digest comparison has a silent divergence to find. With
//! `KVINDEX_FAULT_LOSE_BLOCK=<engine hash>` in the environment, the first `stored` event (of
//! any tier) whose chain ends in that block is applied without it, once; nothing else changes.

use crate::Event;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The engine hash to lose, read from the environment once.
fn target() -> Option<u64> {
    static TARGET: OnceLock<Option<u64>> = OnceLock::new();
    *TARGET.get_or_init(|| std::env::var("KVINDEX_FAULT_LOSE_BLOCK").ok().and_then(|v| v.parse().ok()))
}

/// Whether the block was lost already.
static LOST: AtomicBool = AtomicBool::new(false);

/// `events` with the target block dropped from the end of its chain, the first time it comes.
pub(crate) fn lose_once(events: &[Event]) -> Option<Vec<Event>> {
    let target = target()?;
    let at = events
        .iter()
        .position(|ev| matches!(ev, Event::Stored { blocks, .. } if blocks.last().is_some_and(|b| b.block_hash.0 == target)))?;
    if LOST.swap(true, Ordering::SeqCst) {
        return None;
    }
    let mut out = events.to_vec();
    if let Event::Stored { blocks, .. } = &mut out[at] {
        blocks.pop();
    }
    Some(out)
}
