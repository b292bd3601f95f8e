//! How a benchmark asks an index for its complete answer: each in its own form, as a router
//! using that index would take it.

use kvindex_core::hash::LocalHash;
use kvindex_core::index::positional::PositionalIndex;
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::RunIndex;
use kvindex_core::index::{DepthGroups, KvIndex, MatchOptions};

/// How an index gives every match in its own form, as a router using it would take it:
/// kvindex's backends their depth groups ([`KvIndex::find_grouped`]), a peer the list or map
/// its API returns, unsorted. What "every match" lookups measure.
pub trait Answering: KvIndex {
    /// Every match for `query`; how many there are.
    fn every_match(&self, query: &[LocalHash]) -> usize {
        GROUPED.with_borrow_mut(|g| {
            self.find_grouped(query, &MatchOptions::default(), g);
            g.len()
        })
    }
}

/// The run index's own form is slots by depth; each match goes out as `(slot, depth)`, as a
/// peer's callback gives `(its worker index, depth)`.
impl Answering for RunIndex {
    fn every_match(&self, query: &[LocalHash]) -> usize {
        PAIRS.with_borrow_mut(|out| {
            self.with_every_match(query, &MatchOptions::default(), |a| {
                out.clear();
                a.for_each(|depth, slot| out.push((slot, depth)));
                out.len()
            })
        })
    }
}
impl Answering for PositionalIndex {}
impl Answering for ReferenceIndex {}

thread_local! {
    /// The run index's matches as `(slot, depth)`, reused across lookups on a thread.
    static PAIRS: std::cell::RefCell<Vec<(u32, u32)>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A kvindex backend's grouped answer, reused across lookups on a thread.
    static GROUPED: std::cell::RefCell<DepthGroups> = std::cell::RefCell::new(DepthGroups::default());
}
