//! Hybrid models' rule: what a KV-cache group of each kind (full attention, sliding window,
//! state) needs of a prefix, and the deepest prefix every group of a worker can serve (vLLM's
//! `find_longest_cache_hit` per kind, and its coordinator's fixed point, with equal block sizes):
//!
//! - full attention: blocks `[0, e)` all held;
//! - sliding window needing `k` blocks: blocks `[max(0, e - k), e)` all held;
//! - state (Mamba): `e = 0`, or block `e - 1` held.
//!
//! [`crate::groups`] keeps the groups' blocks and asks this rule at lookup time.

use serde::{Deserialize, Serialize};

/// The highest group number: a worker's groups fit one 64-bit mask, bit 0 the primary.
pub const MAX_GROUP: u8 = 63;

/// What a group's blocks must cover for a prefix to be reusable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GroupKind {
    /// Full attention: every block of the prefix.
    Full,
    /// Sliding-window attention: the last `blocks` blocks before the cut (vLLM:
    /// `max(1, ceil((window - 1) / block_size))`), or all of a shorter prefix.
    Window {
        /// Blocks the window needs, at least 1.
        blocks: u32,
    },
    /// A state-space layer: the state cached at the cut (the prefix's last block).
    State,
}

impl GroupKind {
    /// The blocks a sliding window of `window` tokens needs over blocks of `block_size`.
    pub fn window(window: u32, block_size: u32) -> GroupKind {
        let blocks = window.saturating_sub(1).div_ceil(block_size.max(1)).max(1);
        GroupKind::Window { blocks }
    }

    /// Whether a prefix of `e` blocks is reusable in a group of this kind holding `held`.
    pub fn accepts(self, e: usize, held: &mut impl FnMut(usize) -> bool) -> bool {
        match self {
            GroupKind::Full => (0..e).all(held),
            GroupKind::Window { blocks } => (e.saturating_sub(blocks as usize)..e).all(held),
            GroupKind::State => e == 0 || held(e - 1),
        }
    }

    /// The largest `e' <= e` this kind accepts (what vLLM's finder of the kind returns).
    pub fn reduce(self, e: usize, held: &mut impl FnMut(usize) -> bool) -> usize {
        self.reduce_held(e, &mut Scan(held))
    }
}

/// [`Held`] over a plain predicate: `below` tries each position down.
struct Scan<'a, F>(&'a mut F);

impl<F: FnMut(usize) -> bool> Held for Scan<'_, F> {
    fn held(&mut self, i: usize) -> bool {
        (self.0)(i)
    }

    fn below(&mut self, x: usize) -> Option<usize> {
        (0..x).rev().find(|&i| (self.0)(i))
    }
}

/// What a reduction asks of one worker's group: whether it holds a position, and the last
/// position it holds below a length (which lets a walk skip what the group does not hold).
pub(crate) trait Held {
    /// The group holds position `i`.
    fn held(&mut self, i: usize) -> bool;
    /// The highest position below `x` the group holds.
    fn below(&mut self, x: usize) -> Option<usize>;
}

impl GroupKind {
    /// [`GroupKind::reduce`], stepping down from the cut while the group holds each position,
    /// then from held position to held position.
    pub(crate) fn reduce_held(self, e: usize, h: &mut impl Held) -> usize {
        match self {
            GroupKind::Full => (0..e).find(|&i| !h.held(i)).unwrap_or(e),
            GroupKind::Window { blocks } => {
                let need = blocks.max(1) as usize;
                // A run of `run` held positions whose lowest is `x`.
                let (mut run, mut x) = (0, e);
                if e > 0 && h.held(e - 1) {
                    (run, x) = (1, e - 1);
                    while run < need && x > 0 && h.held(x - 1) {
                        (run, x) = (run + 1, x - 1);
                    }
                }
                while run < need {
                    let Some(j) = h.below(x) else { break };
                    run = if j + 1 == x { run + 1 } else { 1 };
                    x = j;
                }
                match run {
                    _ if run >= need => x + need,
                    _ if x == 0 => run,
                    _ => 0,
                }
            }
            GroupKind::State => match e {
                0 => 0,
                _ if h.held(e - 1) => e,
                _ => h.below(e - 1).map_or(0, |i| i + 1),
            },
        }
    }
}

/// The deepest prefix, at most `limit` blocks (the primary group's depth), that every group in
/// `kinds` accepts; `held(j, i)`: whether the group `kinds[j]` holds position `i`. Each kind's
/// reduction returns the largest accepted length at or below its input, so repeating them
/// until none moves stops at the largest length all accept, whatever their order.
pub fn hybrid_depth(limit: usize, kinds: &[GroupKind], mut held: impl FnMut(usize, usize) -> bool) -> usize {
    fixed_point(limit, kinds.len(), |j, e| kinds[j].reduce(e, &mut |i| held(j, i)))
}

/// [`hybrid_depth`] over `groups` groups, `reduce(j, e)` being group `j`'s reduction of `e`.
pub(crate) fn fixed_point(limit: usize, groups: usize, mut reduce: impl FnMut(usize, usize) -> usize) -> usize {
    let mut e = limit;
    loop {
        let before = e;
        for j in 0..groups {
            e = reduce(j, e);
        }
        if e == before {
            return e;
        }
    }
}
