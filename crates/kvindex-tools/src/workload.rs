//! A workload loaded once and replayed by the benchmarks: its ops (events and lookups), their
//! arrival times when it came from a trace, and its counts.

use crate::stream::{Op, StreamOp};
use crate::trace::TimedOp;
use kvindex_core::hash::LocalHash;
use kvindex_core::Event;

/// A replayable workload.
pub struct Workload {
    /// The ops, in order.
    pub ops: Vec<Op>,
    /// Arrival time (ms) of each op, when the workload came from a trace.
    pub ts_ms: Option<Vec<u64>>,
    /// Blocks the lookups ask about.
    pub lookup_blocks: u64,
    /// Blocks the `stored` events store.
    pub stored_blocks: u64,
    /// Blocks the other events remove.
    pub removed_blocks: u64,
    /// Lookups.
    pub lookups: u64,
}

impl Workload {
    /// From a stream, with arrival times when known.
    pub fn new(ops: Vec<StreamOp>, ts_ms: Option<Vec<u64>>) -> Self {
        let (mut lookup_blocks, mut stored_blocks, mut removed_blocks, mut lookups) = (0, 0, 0, 0);
        let ops: Vec<Op> = ops.into_iter().map(Op::from).collect();
        for op in &ops {
            match op {
                Op::Lookup(q) => {
                    lookups += 1;
                    lookup_blocks += q.len() as u64;
                }
                Op::Event(_, e @ Event::Stored { .. }) => stored_blocks += e.blocks() as u64,
                Op::Event(_, e) => removed_blocks += e.blocks() as u64,
            }
        }
        Workload { ops, ts_ms, lookup_blocks, stored_blocks, removed_blocks, lookups }
    }

    /// From the mock engine's timed ops.
    pub fn from_timed(ops: Vec<TimedOp>) -> Self {
        let ts = ops.iter().map(|o| o.ts_ms).collect();
        Self::new(ops.into_iter().map(|o| o.op).collect(), Some(ts))
    }

    pub fn block_ops(&self) -> u64 {
        self.lookup_blocks + self.stored_blocks + self.removed_blocks
    }

    pub fn lookup_queries(&self) -> Vec<&[LocalHash]> {
        self.ops.iter().filter_map(|o| if let Op::Lookup(q) = o { Some(&q[..]) } else { None }).collect()
    }
}
