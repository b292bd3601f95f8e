//! Whether a JetStream replica has caught up with the stream it reads, so that it may answer
//! lookups. Caught up means: the stream's last sequence, read from the stream, has been
//! ingested, nothing is pending, and the apply threads have applied it all. A consumer's own
//! "nothing pending" is not enough: one recreated while a cluster elects leaders has been seen
//! to say so hundreds of messages short of the stream's end.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Where a replica stands against its stream. Written by the ingest loop, the stream watch and
/// the flush that ends a catch-up; read by readiness, `/readyz` and the snapshot task.
pub(super) struct CatchUp {
    /// Caught up (always true in core mode, which has no stream to catch up with).
    done: AtomicBool,
    /// The end was reached and the apply threads are being flushed toward `done`.
    flushing: AtomicBool,
    /// Bumped whenever the stream must be caught up with again (a reconnect, a stalled
    /// consumer), so that a flush begun before cannot declare the catch-up done.
    round: AtomicU64,
    /// The stream sequence to have ingested before the replica may be caught up (`u64::MAX`:
    /// unknown until the stream's state is read).
    target: AtomicU64,
}

impl CatchUp {
    /// Caught up from the start (`done`: core mode), or aiming at sequence 0 until told more.
    pub fn new(done: bool) -> Self {
        CatchUp {
            done: AtomicBool::new(done),
            flushing: AtomicBool::new(false),
            round: AtomicU64::new(0),
            target: AtomicU64::new(0),
        }
    }

    pub fn is_done(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }

    /// The stream held nothing to replay.
    pub fn done_now(&self) {
        self.done.store(true, Ordering::Relaxed);
    }

    /// The replica may have fallen behind (its consumer or connection was lost): not caught up
    /// until it has reached an end read from the stream again.
    pub fn again(&self) {
        self.round.fetch_add(1, Ordering::Relaxed);
        self.target.store(u64::MAX, Ordering::Relaxed);
        self.flushing.store(false, Ordering::Relaxed);
        self.done.store(false, Ordering::Relaxed);
    }

    /// The end to reach is the stream's sequence `last`.
    pub fn aim_at(&self, last: u64) {
        self.target.store(last, Ordering::Relaxed);
    }

    /// The end to reach is `last`, unless one is known already.
    pub fn aim_at_if_unknown(&self, last: u64) {
        let _ = self.target.compare_exchange(u64::MAX, last, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// With sequence `ingested` ingested and `pending` messages left: the round of the flush
    /// the caller must now run and then pass to [`Self::flushed`], or `None` (short of the end,
    /// or a flush is already under way).
    pub fn reached(&self, ingested: u64, pending: u64) -> Option<u64> {
        let short = ingested < self.target.load(Ordering::Relaxed);
        if pending > 0 || short || self.flushing.swap(true, Ordering::Relaxed) {
            return None;
        }
        Some(self.round.load(Ordering::Relaxed))
    }

    /// The flush begun in `round` is done: caught up, unless the replica fell behind since;
    /// whether it is.
    pub fn flushed(&self, round: u64) -> bool {
        if self.round.load(Ordering::Relaxed) != round {
            return false;
        }
        self.done.store(true, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caught_up_only_at_the_stream_end_with_nothing_pending_and_once_flushed() {
        let c = CatchUp::new(false);
        c.aim_at(10);
        assert_eq!(c.reached(9, 0), None, "short of the stream's end");
        assert_eq!(c.reached(10, 3), None, "messages still pending");
        let round = c.reached(10, 0).expect("at the end");
        assert_eq!(c.reached(10, 0), None, "one flush at a time");
        assert!(!c.is_done(), "not before the flush");
        assert!(c.flushed(round));
        assert!(c.is_done());
    }

    #[test]
    fn a_flush_begun_before_falling_behind_does_not_count() {
        let c = CatchUp::new(true);
        c.aim_at(5);
        let round = c.reached(5, 0).expect("at the end");
        c.again();
        assert!(!c.is_done());
        assert!(!c.flushed(round), "the old round");
        assert!(!c.is_done());
        assert_eq!(c.reached(1_000, 0), None, "the end is unknown until read from the stream");
        c.aim_at_if_unknown(7);
        c.aim_at_if_unknown(9);
        assert_eq!(c.reached(8, 0).map(|_| ()), Some(()), "the first end read stands");
    }
}
