//! A run's coverage: for each worker holding the run, how many of its first blocks it holds
//! contiguously (its cutoff), as lookups see them.
//!
//! A worker's whole state in a run is one atomic value, so a lookup that reads it while the
//! worker's writer changes it sees the state before or after, never a mix: there is no version
//! to validate and no retry. Two forms, chosen by how many workers hold the run:
//! - a [`List`] of words, each a slot and its cutoff, unordered: few holders (most runs);
//! - [`Dense`]: a cutoff per slot, with two bitsets (holders, and those holding the whole run)
//!   that let a lookup take a run most of the fleet holds a word of 64 workers at a time. Its
//!   bits are hints the cutoff overrides: a writer stores the cutoff before it sets a bit and
//!   after it clears one, and a reader loads the holders' bits, then the full bits, then the
//!   cutoffs of holders not full.
//!
//! A cover is replaced, not changed in form or size in place: the run retires the old one to
//! the epoch collector, so a lookup still reading it reads valid (if older) values.
//!
//! The list's protocol, model-checked under loom (`RUSTFLAGS="--cfg loom"`, the tests at the
//! end):
//! - every change is made by a writer holding the run's lock; a worker's word changes in place
//!   while the worker stays;
//! - a word is written (release) before `used` counts it (release); a reader loads `used`
//!   (acquire), then the words (acquire);
//! - a reader keeps the first word it meets for a slot: a worker that vacated one word and took
//!   another meanwhile is seen once, in one of its states.

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::workers::Slot;

/// A word that holds no worker (no slot is `u32::MAX`).
pub(crate) const EMPTY: u64 = u64::MAX;

/// The word of `slot` holding the run's first `cut` blocks.
#[inline]
fn word(slot: Slot, cut: u32) -> u64 {
    (u64::from(slot) << 32) | u64::from(cut)
}

/// Coverage as a list of words.
pub(crate) struct List {
    /// Words written so far: a reader reads `words[..used]`.
    used: AtomicU32,
    /// `EMPTY` or a worker's word.
    words: Box<[AtomicU64]>,
}

impl List {
    /// An empty list with room for `cap` workers.
    pub(crate) fn new(cap: usize) -> List {
        List { used: AtomicU32::new(0), words: (0..cap.max(1)).map(|_| AtomicU64::new(EMPTY)).collect() }
    }

    /// Words it has room for.
    pub(crate) fn capacity(&self) -> usize {
        self.words.len()
    }

    /// Reader: calls `f(slot, cut)` for every worker's word (a slot may come twice while its
    /// worker moves between words; see the module doc).
    #[inline]
    pub(crate) fn scan(&self, mut f: impl FnMut(Slot, u32)) {
        let used = (self.used.load(Ordering::Acquire) as usize).min(self.words.len());
        for w in &self.words[..used] {
            let v = w.load(Ordering::Acquire);
            if v != EMPTY {
                f((v >> 32) as Slot, v as u32);
            }
        }
    }

    /// Writer: the index of `slot`'s word, trying `hint` first.
    #[inline]
    pub(crate) fn find(&self, slot: Slot, hint: usize) -> Option<usize> {
        let used = self.used.load(Ordering::Relaxed) as usize;
        let is = |i: usize| self.words[i].load(Ordering::Relaxed) >> 32 == u64::from(slot);
        if hint < used && is(hint) {
            return Some(hint);
        }
        (0..used).find(|&i| is(i))
    }

    /// Writer: sets the cutoff of the worker in word `i`.
    #[inline]
    pub(crate) fn set(&self, i: usize, slot: Slot, cut: u32) {
        self.words[i].store(word(slot, cut), Ordering::Release);
    }

    /// Writer: the worker in word `i` leaves.
    #[inline]
    pub(crate) fn vacate(&self, i: usize) {
        self.words[i].store(EMPTY, Ordering::Release);
    }

    /// Writer: writes `slot`'s word into a vacated word (when `reuse`, the caller knowing there
    /// is one) or after the used ones: its index, and whether it was a vacated word. `None`
    /// when the list is full.
    pub(crate) fn join(&self, slot: Slot, cut: u32, reuse: bool) -> Option<(usize, bool)> {
        let used = self.used.load(Ordering::Relaxed) as usize;
        if reuse {
            if let Some(i) = (0..used).find(|&i| self.words[i].load(Ordering::Relaxed) == EMPTY) {
                self.set(i, slot, cut);
                return Some((i, true));
            }
        }
        if used == self.words.len() {
            return None;
        }
        self.set(used, slot, cut);
        self.used.store(used as u32 + 1, Ordering::Release);
        Some((used, false))
    }

    /// Writer: a copy without vacated words, with room for `extra` more workers.
    pub(crate) fn grown(&self, extra: usize) -> List {
        let used = self.used.load(Ordering::Relaxed) as usize;
        let live: Vec<u64> = self.words[..used].iter().map(|w| w.load(Ordering::Relaxed)).filter(|&v| v != EMPTY).collect();
        let c = List::new((live.len() + extra).max(self.words.len()));
        for (to, v) in c.words.iter().zip(&live) {
            to.store(*v, Ordering::Relaxed);
        }
        c.used.store(live.len() as u32, Ordering::Relaxed);
        c
    }

    /// Writer: words in use, vacated ones included.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed) as usize
    }

    /// Heap bytes of its words.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.words.len() * 8
    }
}

/// Coverage as a cutoff per slot, for runs much of the fleet holds.
pub(crate) struct Dense {
    /// The run's length, fixed while it is dense (a dense run takes no appends): what a full
    /// bit means.
    len: u32,
    /// Slots with a cutoff (a hint; see the module doc for the order that makes it safe).
    holders: Box<[AtomicU64]>,
    /// Slots whose cutoff is `len` (a hint, likewise).
    full: Box<[AtomicU64]>,
    /// Each slot's cutoff, 0 for none: what a lookup trusts.
    cuts: Box<[AtomicU32]>,
    /// Offsets inside the run where children hang, in the order marked (`marks` of them):
    /// a lookup that leaves the run into a child there takes the holders that go on from the
    /// mark's bits, 64 workers a word, instead of reading each one's cutoff.
    mark_at: Box<[AtomicU32]>,
    /// Marks in use: `mark_at[..marks]`, published after their bits.
    marks: AtomicU32,
    /// Mark `m`'s bits, words `m * words..`: slots whose cutoff reaches the mark (hints, as the
    /// full bits are: set after the cutoff is stored, cleared with it).
    mark_bits: Box<[AtomicU64]>,
}

/// Most offsets a dense cover marks.
pub(crate) const MARKS: usize = 16;

impl Dense {
    /// The dense form of `list` for a run of `len` blocks, with room for `width` slots.
    pub(crate) fn from_list(list: &List, len: u32, width: usize) -> Dense {
        let mut top = width;
        list.scan(|slot, _| top = top.max(slot as usize + 1));
        let d = Dense::empty(len, top);
        list.scan(|slot, cut| d.set(slot, 0, cut));
        d
    }

    /// A cover of a run of `len` blocks with room for `width` slots, held by nobody.
    pub(crate) fn empty(len: u32, width: usize) -> Dense {
        let width = width.div_ceil(64) * 64;
        let words = |n: usize| (0..n * width / 64).map(|_| AtomicU64::new(0)).collect();
        Dense {
            len,
            holders: words(1),
            full: words(1),
            cuts: (0..width).map(|_| AtomicU32::new(0)).collect(),
            mark_at: (0..MARKS).map(|_| AtomicU32::new(0)).collect(),
            marks: AtomicU32::new(0),
            mark_bits: words(MARKS),
        }
    }

    /// Writer (run locked): marks offset `at` (inside the run, where a child hangs), unless it
    /// is marked or every mark is taken. Its bits are filled before it is published.
    pub(crate) fn mark(&self, at: u32) {
        let n = self.marks.load(Ordering::Relaxed) as usize;
        if at == 0 || at >= self.len || n == MARKS || self.mark_at[..n].iter().any(|m| m.load(Ordering::Relaxed) == at) {
            return;
        }
        let words = self.holders.len();
        for (i, bits) in self.mark_bits[n * words..(n + 1) * words].iter().enumerate() {
            let mut v = 0u64;
            for (b, c) in self.cuts[i * 64..i * 64 + 64].iter().enumerate() {
                v |= u64::from(c.load(Ordering::Relaxed) >= at) << b;
            }
            bits.store(v, Ordering::Relaxed);
        }
        self.mark_at[n].store(at, Ordering::Relaxed);
        self.marks.store(n as u32 + 1, Ordering::Release);
    }

    /// Writer: the offsets marked.
    fn marked(&self) -> impl Iterator<Item = u32> + '_ {
        self.mark_at[..self.marks.load(Ordering::Relaxed) as usize].iter().map(|m| m.load(Ordering::Relaxed))
    }

    /// Reader: the mark at offset `at`, if there is one.
    #[inline]
    pub(crate) fn find_mark(&self, at: u32) -> Option<usize> {
        let n = (self.marks.load(Ordering::Acquire) as usize).min(MARKS);
        self.mark_at[..n].iter().position(|m| m.load(Ordering::Relaxed) == at)
    }

    /// Reader: word `i` of mark `m`'s bits.
    #[inline]
    pub(crate) fn mark_word(&self, m: usize, i: usize) -> u64 {
        self.mark_bits.get(m * self.holders.len() + i).map_or(0, |b| b.load(Ordering::Acquire))
    }

    /// Slots it has room for.
    pub(crate) fn width(&self) -> usize {
        self.cuts.len()
    }

    /// Writer: a copy with room for `width` slots, with the same marks.
    pub(crate) fn widened(&self, width: usize) -> Dense {
        let d = Dense::empty(self.len, width.max(self.width()));
        for (slot, c) in self.cuts.iter().enumerate() {
            let c = c.load(Ordering::Relaxed);
            if c > 0 {
                d.set(slot as Slot, 0, c);
            }
        }
        for at in self.marked() {
            d.mark(at);
        }
        d
    }

    /// Writer: the list form, with room for `extra` more workers.
    pub(crate) fn to_list(&self, extra: usize) -> List {
        let live: Vec<(Slot, u32)> =
            self.cuts.iter().enumerate().map(|(s, c)| (s as Slot, c.load(Ordering::Relaxed))).filter(|&(_, c)| c > 0).collect();
        let l = List::new(live.len() + extra);
        for (slot, cut) in live {
            l.join(slot, cut, false);
        }
        l
    }

    /// Writer: the worker in `slot` (below the width) goes from cutoff `from` to `to`.
    pub(crate) fn set(&self, slot: Slot, from: u32, to: u32) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        self.cuts[slot as usize].store(to, Ordering::Release);
        let words = self.holders.len();
        let marks = self.marks.load(Ordering::Relaxed) as usize;
        if to > from {
            if from == 0 {
                self.holders[w].fetch_or(bit, Ordering::Release);
            }
            for (m, at) in self.mark_at[..marks].iter().enumerate() {
                if (from + 1..=to).contains(&at.load(Ordering::Relaxed)) {
                    self.mark_bits[m * words + w].fetch_or(bit, Ordering::Release);
                }
            }
            if to == self.len {
                self.full[w].fetch_or(bit, Ordering::Release);
            }
        } else {
            if from == self.len {
                self.full[w].fetch_and(!bit, Ordering::Release);
            }
            for (m, at) in self.mark_at[..marks].iter().enumerate() {
                if (to + 1..=from).contains(&at.load(Ordering::Relaxed)) {
                    self.mark_bits[m * words + w].fetch_and(!bit, Ordering::Release);
                }
            }
            if to == 0 {
                self.holders[w].fetch_and(!bit, Ordering::Release);
            }
        }
    }

    /// Reader: the run's length as this cover knows it.
    #[inline]
    pub(crate) fn len(&self) -> u32 {
        self.len
    }

    /// Reader: the holders' and the full bits of word `i` (zero past the width).
    #[inline]
    pub(crate) fn bits(&self, i: usize) -> (u64, u64) {
        match (self.holders.get(i), self.full.get(i)) {
            (Some(h), Some(f)) => {
                let h = h.load(Ordering::Acquire);
                (h, f.load(Ordering::Acquire) & h)
            }
            _ => (0, 0),
        }
    }

    /// Reader: the cutoff of `slot` (below the width).
    #[inline]
    pub(crate) fn cut(&self, slot: Slot) -> u32 {
        self.cuts.get(slot as usize).map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.cuts.len() * 4 + self.holders.len() * 16 + self.mark_bits.len() * 8 + MARKS * 4
    }
}

/// A run's coverage, in one of its two forms.
pub(crate) enum Cover {
    /// Few holders.
    List(List),
    /// Much of the fleet.
    Dense(Dense),
}

impl Cover {
    /// Heap bytes.
    pub(crate) fn heap_bytes(&self) -> usize {
        match self {
            Cover::List(l) => l.heap_bytes(),
            Cover::Dense(d) => d.heap_bytes(),
        }
    }
}

#[cfg(all(test, loom))]
mod loom_model {
    use super::*;
    use loom::sync::atomic::AtomicPtr;
    use loom::sync::Arc;

    /// A run's coverage pointer with the writer's retired lists kept alive until the model
    /// ends (the epoch collector's job outside the model).
    struct Run {
        cover: AtomicPtr<List>,
        /// The writer's step: which state of the script the worker words are in.
        step: AtomicU32,
    }

    /// Each step's cutoff of workers 0 and 1 (`None`: not holding). Step 4 fills the list of
    /// two, step 5 grows it to make room for worker 2, step 6 moves worker 0 to another word.
    const STATES: [[Option<u32>; 2]; 7] = [
        [None, None],
        [Some(3), None],
        [Some(3), Some(1)],
        [Some(5), Some(1)],
        [None, Some(1)],
        [None, Some(4)],
        [Some(2), Some(4)],
    ];

    #[test]
    fn a_reader_sees_each_worker_in_one_of_its_states_during_the_read() {
        loom::model(|| {
            let first = Box::into_raw(Box::new(List::new(2)));
            let run = Arc::new(Run { cover: AtomicPtr::new(first), step: AtomicU32::new(0) });
            let writer = {
                let run = run.clone();
                loom::thread::spawn(move || {
                    let mut retired = Vec::new();
                    let cover = |run: &Run| unsafe { &*run.cover.load(Ordering::Relaxed) };
                    let step = |n| run.step.store(n, Ordering::SeqCst);
                    let (i0, _) = cover(&run).join(0, 3, false).expect("room");
                    step(1);
                    cover(&run).join(1, 1, false).expect("room");
                    step(2);
                    cover(&run).set(i0, 0, 5);
                    step(3);
                    cover(&run).vacate(i0);
                    step(4);
                    let i1 = cover(&run).find(1, 0).expect("worker 1 holds");
                    cover(&run).set(i1, 1, 4);
                    // Worker 2 joins a full list: the writer grows it (worker 2 is not checked).
                    let old = run.cover.load(Ordering::Relaxed);
                    let grown = unsafe { &*old }.grown(2);
                    grown.join(2, 9, false).expect("room");
                    run.cover.store(Box::into_raw(Box::new(grown)), Ordering::Release);
                    retired.push(old);
                    step(5);
                    cover(&run).join(0, 2, true).expect("room");
                    step(6);
                    retired
                })
            };
            let before = run.step.load(Ordering::SeqCst) as usize;
            let cover = unsafe { &*run.cover.load(Ordering::Acquire) };
            let mut seen: [Option<Option<u32>>; 3] = [None; 3];
            cover.scan(|slot, cut| {
                let s = &mut seen[slot as usize];
                if s.is_none() {
                    *s = Some(Some(cut));
                }
            });
            // The change after the last step read may be in flight: its state counts too.
            let after = (run.step.load(Ordering::SeqCst) as usize + 1).min(STATES.len() - 1);
            for w in 0..2 {
                let got = seen[w].unwrap_or(None);
                assert!(
                    (before..=after).any(|s| STATES[s][w] == got),
                    "worker {w}: saw {got:?}, its states from step {before} to {after} were {:?}",
                    (before..=after).map(|s| STATES[s][w]).collect::<Vec<_>>()
                );
            }
            for old in writer.join().expect("writer") {
                drop(unsafe { Box::from_raw(old) });
            }
            drop(unsafe { Box::from_raw(run.cover.load(Ordering::Relaxed)) });
        });
    }
}
