//! A replica's checkpoints of its workers and its siblings' ([`super::replicas`] sends and
//! compares them): what is kept per worker is a few checkpoints of this replica's and a few of
//! its siblings' not yet matched, for the workers this replica tracks (bounded by
//! `max_workers`), dropped when the worker has taken none for a while.

use kvindex_core::digest::{Digest, WorkerDigests};
use kvindex_core::hash::WorkerId;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Checkpoints kept per worker, this replica's and its siblings' each.
pub(super) const KEPT: usize = 4;

/// A sibling not heard for this many intervals is no longer counted.
pub(super) const SIBLING_INTERVALS: u32 = 3;

/// Siblings counted at most (their ids come from the network).
const MAX_SIBLINGS: usize = 64;

/// One worker's digest at a point of its event sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Checkpoint {
    /// The worker id.
    pub(super) worker_id: u64,
    /// Its dp rank.
    pub(super) dp_rank: u32,
    /// Its publisher's epoch.
    pub(super) epoch: u64,
    /// The event id it expected next: every event before it is in the digest.
    pub(super) next_event_id: u64,
    /// Device blocks it held there.
    pub(super) blocks: u64,
    /// Their digest's sum.
    pub(super) sum: u64,
    /// Its host and disk blocks' digests, where this replica keeps those tiers (absent from
    /// older replicas' messages).
    #[serde(default)]
    pub(super) tiers: Option<[Digest; 2]>,
    /// Its hybrid groups' digest, where every group block it was told of is placed.
    #[serde(default)]
    pub(super) groups: Option<Digest>,
}

impl Checkpoint {
    /// `worker`'s digests `d` at `(epoch, next_event_id)`.
    pub(super) fn new(worker: WorkerId, epoch: u64, next_event_id: u64, d: WorkerDigests) -> Checkpoint {
        let (blocks, sum) = (d.device.blocks, d.device.sum);
        Checkpoint {
            worker_id: worker.worker_id,
            dp_rank: worker.dp_rank,
            epoch,
            next_event_id,
            blocks,
            sum,
            tiers: d.tiers,
            groups: d.groups,
        }
    }

    /// The worker it is of.
    pub(super) fn worker(&self) -> WorkerId {
        WorkerId::new(self.worker_id, self.dp_rank)
    }

    /// Whether the two are of the same point of the worker's sequence.
    fn same_point(&self, other: &Checkpoint) -> bool {
        self.point() == other.point()
    }

    /// Whether it is of a later point of the worker's sequence than `other`.
    fn after(&self, other: &Checkpoint) -> bool {
        self.point() > other.point()
    }

    fn point(&self) -> (u64, u64) {
        (self.epoch, self.next_event_id)
    }

    /// Its digests, every part it knows.
    pub(super) fn digests(&self) -> WorkerDigests {
        WorkerDigests { device: Digest { blocks: self.blocks, sum: self.sum }, tiers: self.tiers, groups: self.groups }
    }
}

/// One worker's checkpoints: this replica's, newest last, and siblings' not yet matched.
struct Kept {
    /// This replica's.
    mine: VecDeque<Checkpoint>,
    /// Siblings' at points this replica has not reached yet.
    theirs: VecDeque<Checkpoint>,
    /// When this replica last took one (entries go when it has been a while).
    at: Instant,
}

/// The book every task shares: checkpoints per worker, those to send, the siblings heard.
#[derive(Default)]
struct Book {
    /// Per tracked worker (its keys: workers this replica checkpointed, bounded by
    /// `max_workers`).
    workers: HashMap<WorkerId, Kept>,
    /// Taken since the last message, to send (at most one per worker and interval).
    fresh: Vec<Checkpoint>,
    /// Each sibling heard, when last (bounded: forgotten after [`SIBLING_INTERVALS`]).
    siblings: HashMap<u64, Instant>,
}

/// This replica's checkpoints and its siblings'.
pub(super) struct Replicas {
    /// This replica's id in its messages.
    pub(super) me: u64,
    /// How often checkpoints are taken and sent (`None`: not compared).
    pub(super) every: Option<Duration>,
    /// The book.
    book: Mutex<Book>,
}

/// Two checkpoints of one point that a replica compared: its own and a sibling's.
pub(super) type Compared = (Checkpoint, Checkpoint);

impl Replicas {
    /// Checkpoints every `secs` seconds of publisher time (0: never).
    pub(super) fn new(secs: u64) -> Replicas {
        Replicas {
            me: kvindex_core::seeded::process_seed() ^ u64::from(std::process::id()),
            every: (secs > 0).then(|| Duration::from_secs(secs)),
            book: Mutex::default(),
        }
    }

    /// The interval of publisher time a batch stamped `ts_ns` falls in (0: no comparison, or no
    /// stamp): a worker is checkpointed at its first batch of each.
    pub(super) fn bucket(&self, ts_ns: u64) -> u64 {
        match self.every {
            Some(every) if ts_ns > 0 => ts_ns / (every.as_nanos() as u64).max(1) + 1,
            _ => 0,
        }
    }

    /// Takes this replica's checkpoint; what it now matches among its siblings'.
    pub(super) fn record(&self, c: Checkpoint) -> Vec<Compared> {
        let mut book = self.book.lock();
        book.fresh.push(c);
        let now = Instant::now();
        let kept =
            book.workers.entry(c.worker()).or_insert_with(|| Kept { mine: VecDeque::new(), theirs: VecDeque::new(), at: now });
        kept.at = now;
        let mut matched = Vec::new();
        kept.theirs.retain(|t| {
            if t.same_point(&c) {
                matched.push((c, *t));
            }
            // Older points than this one will not come again here.
            t.after(&c)
        });
        if kept.mine.len() == KEPT {
            kept.mine.pop_front();
        }
        kept.mine.push_back(c);
        matched
    }

    /// Takes a sibling's checkpoint: compared now if this replica holds that point, kept for
    /// later if it has not reached it, dropped otherwise (or if it tracks no such worker).
    fn theirs(&self, book: &mut Book, t: Checkpoint) -> Option<Compared> {
        let kept = book.workers.get_mut(&t.worker())?;
        if let Some(m) = kept.mine.iter().find(|m| m.same_point(&t)) {
            return Some((*m, t));
        }
        let newest = kept.mine.back().copied();
        let ahead = newest.is_none_or(|m| t.after(&m));
        if ahead && !kept.theirs.iter().any(|x| x.same_point(&t)) {
            if kept.theirs.len() == KEPT {
                kept.theirs.pop_front();
            }
            kept.theirs.push_back(t);
        }
        None
    }

    /// Takes what to send, and forgets workers and siblings gone quiet for `quiet`.
    pub(super) fn take_fresh(&self, quiet: Duration) -> (Vec<Checkpoint>, usize) {
        let mut book = self.book.lock();
        book.workers.retain(|_, k| k.at.elapsed() < quiet);
        let every = self.every.unwrap_or_default();
        book.siblings.retain(|_, t| t.elapsed() < every * SIBLING_INTERVALS);
        (std::mem::take(&mut book.fresh), book.siblings.len())
    }

    /// Takes sibling `replica`'s checkpoints; the pairs now comparable.
    pub(super) fn heard(&self, replica: u64, checkpoints: Vec<Checkpoint>) -> Vec<Compared> {
        let mut book = self.book.lock();
        if book.siblings.len() < MAX_SIBLINGS || book.siblings.contains_key(&replica) {
            book.siblings.insert(replica, Instant::now());
        }
        checkpoints.into_iter().filter_map(|t| self.theirs(&mut book, t)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(next: u64, sum: u64) -> Checkpoint {
        Checkpoint { worker_id: 7, dp_rank: 0, epoch: 1, next_event_id: next, blocks: 3, sum, tiers: None, groups: None }
    }

    /// A checkpoint of an older replica (six fields, device only) is still read; every part
    /// of a new one travels.
    #[test]
    fn checkpoints_of_older_replicas_are_read_and_new_ones_carry_every_part() {
        let old = rmp_serde::to_vec(&(7u64, 0u32, 1u64, 5u64, 3u64, 9u64)).unwrap();
        assert_eq!(rmp_serde::from_slice::<Checkpoint>(&old).unwrap(), at(5, 9));
        let d = |n| Digest { blocks: n, sum: n * 11 };
        let new = Checkpoint { tiers: Some([d(1), d(2)]), groups: Some(d(3)), ..at(5, 9) };
        assert_eq!(rmp_serde::from_slice::<Checkpoint>(&rmp_serde::to_vec(&new).unwrap()).unwrap(), new);
    }

    #[test]
    fn checkpoints_compare_at_the_same_point_whichever_comes_first() {
        let r = Replicas::new(1);
        assert!(r.record(at(5, 1)).is_empty());
        let mut book = r.book.lock();
        // A sibling at the same point: compared at once; behind or unknown: dropped.
        assert_eq!(r.theirs(&mut book, at(5, 2)), Some((at(5, 1), at(5, 2))));
        assert_eq!(r.theirs(&mut book, at(4, 2)), None);
        assert_eq!(r.theirs(&mut book, Checkpoint { worker_id: 8, ..at(5, 2) }), None);
        // Ahead: kept until this replica gets there.
        assert_eq!(r.theirs(&mut book, at(9, 1)), None);
        drop(book);
        assert_eq!(r.record(at(9, 1)), vec![(at(9, 1), at(9, 1))]);
        assert!(r.book.lock().workers[&WorkerId::new(7, 0)].theirs.is_empty(), "matched once");
    }

    #[test]
    fn a_worker_keeps_a_few_checkpoints_and_quiet_ones_go() {
        let r = Replicas::new(1);
        for i in 0..10 {
            r.record(at(i, i));
        }
        assert_eq!(r.book.lock().workers[&WorkerId::new(7, 0)].mine.len(), KEPT);
        let (fresh, _) = r.take_fresh(Duration::from_secs(60));
        assert_eq!(fresh.len(), 10);
        assert!(r.take_fresh(Duration::ZERO).0.is_empty());
        assert!(r.book.lock().workers.is_empty(), "forgotten once quiet");
    }

    #[test]
    fn what_siblings_send_is_bounded() {
        let r = Replicas::new(1);
        r.record(at(1, 1));
        for sibling in 0..100 {
            r.heard(sibling, (2..20).flat_map(|i| [at(i, 1), Checkpoint { worker_id: 8, ..at(i, 1) }]).collect());
        }
        let book = r.book.lock();
        assert_eq!(book.siblings.len(), MAX_SIBLINGS, "siblings counted at most");
        assert_eq!(book.workers[&WorkerId::new(7, 0)].theirs.len(), KEPT, "points ahead kept at most");
        assert_eq!(book.workers.len(), 1, "a worker this replica does not track is not kept");
    }

    #[test]
    fn batches_fall_in_intervals_of_the_publisher_clock() {
        let r = Replicas::new(2);
        assert_eq!(r.bucket(0), 0, "no stamp, no checkpoint");
        assert_eq!(r.bucket(1_999_999_999), r.bucket(1));
        assert_ne!(r.bucket(2_000_000_000), r.bucket(1_999_999_999));
        assert_eq!(Replicas::new(0).bucket(5_000_000_000), 0);
    }
}
