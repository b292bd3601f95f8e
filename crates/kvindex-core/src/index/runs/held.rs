//! A worker's blocks in one run, as its writer keeps them: the cutoff lookups see (it holds the
//! run's first `cut` blocks) and, past a hole, the blocks it holds beyond (hidden: a lookup
//! stops at the hole, so they count only when the hole is filled again). Holes cost the write
//! that makes or fills them, never a lookup, and never a change in another run.

/// A worker's state in a run, private to its writer.
///
/// Invariant, between events and once the grace periods asked for are over: `shown` (what
/// lookups see) is `cut` where `reach` holds, 0 elsewhere. Within a grace period, a run that
/// lost `reach` keeps the cutoff it showed (`frozen`), for the lookups that reached it before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Mine {
    /// It holds the run's first `cut` blocks.
    pub(crate) cut: u32,
    /// Its coverage word's index in the run's list (a hint: a grown list moves words).
    pub(crate) hint: u32,
    /// Blocks it holds past the cutoff, in its hidden intervals.
    pub(crate) hidden: u32,
    /// The cutoff its coverage word says.
    pub(crate) shown: u32,
    /// It holds the whole path to the run: the parent run up to where the run hangs, and so
    /// on to the root. Without it, nothing of the run is part of any match.
    pub(crate) reach: bool,
    /// Non-zero: the run lost `reach` with `shown` still published; it is withdrawn once the
    /// grace period of this generation is over.
    pub(crate) frozen: u32,
}

/// Offsets held past a hole: sorted, disjoint, non-adjacent `[start, end)` intervals, each
/// starting past the cutoff (the block at the cutoff is the hole).
pub(crate) type Hidden = Vec<(u32, u32)>;

impl Mine {
    /// Holds nothing in the run and shows nothing: its writer forgets the run.
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.cut == 0 && self.hidden == 0 && self.shown == 0
    }

    /// Whether it holds offset `x`; `hidden` is its list, needed only when `self.hidden > 0`.
    #[inline]
    pub(crate) fn holds(&self, x: u32, hidden: Option<&Hidden>) -> bool {
        x < self.cut || (self.hidden > 0 && hidden.is_some_and(|h| h.iter().any(|&(a, b)| a <= x && x < b)))
    }

    /// Extends the cutoff over `[a, b)` without hidden blocks to meet: the common store, which
    /// needs no list. `false` (and nothing changed) when the general [`Mine::add`] is needed.
    #[inline]
    pub(crate) fn try_extend(&mut self, a: u32, b: u32) -> bool {
        if self.hidden == 0 && a <= self.cut {
            self.cut = self.cut.max(b);
            true
        } else {
            false
        }
    }

    /// It now holds `[a, b)` as well.
    pub(crate) fn add(&mut self, a: u32, b: u32, hidden: &mut Hidden) {
        if a <= self.cut {
            self.cut = self.cut.max(b);
            // Hidden intervals the cutoff now reaches are seen again.
            while let Some(&(s, e)) = hidden.first() {
                if s > self.cut {
                    break;
                }
                self.hidden -= e - s;
                self.cut = self.cut.max(e);
                hidden.remove(0);
            }
        } else {
            let before: u32 = hidden.iter().map(|&(s, e)| e - s).sum();
            hidden.push((a, b));
            hidden.sort_unstable();
            let mut merged: Hidden = Vec::with_capacity(hidden.len());
            for &(s, e) in hidden.iter() {
                match merged.last_mut() {
                    Some(last) if s <= last.1 => last.1 = last.1.max(e),
                    _ => merged.push((s, e)),
                }
            }
            *hidden = merged;
            let after: u32 = hidden.iter().map(|&(s, e)| e - s).sum();
            self.hidden += after - before;
        }
    }

    /// It no longer holds offset `x`, which it held. The common removal (the last block it
    /// holds, no hidden blocks) needs no list: `false` (nothing changed) when it does.
    #[inline]
    pub(crate) fn try_drop_last(&mut self, x: u32) -> bool {
        if self.hidden == 0 && x + 1 == self.cut {
            self.cut = x;
            true
        } else {
            false
        }
    }

    /// It no longer holds offset `x`, which it held: a block before the cutoff makes a hole
    /// there (the blocks after it become hidden), a hidden one simply goes.
    pub(crate) fn drop_offset(&mut self, x: u32, hidden: &mut Hidden) {
        if x < self.cut {
            if x + 1 < self.cut {
                hidden.insert(0, (x + 1, self.cut));
                self.hidden += self.cut - x - 1;
            }
            self.cut = x;
            return;
        }
        let Some(i) = hidden.iter().position(|&(s, e)| s <= x && x < e) else {
            debug_assert!(false, "dropped offset {x} that was not held");
            return;
        };
        let (s, e) = hidden[i];
        self.hidden -= 1;
        match (s == x, x + 1 == e) {
            (true, true) => {
                hidden.remove(i);
            }
            (true, false) => hidden[i].0 = x + 1,
            (false, true) => hidden[i].1 = x,
            (false, false) => {
                hidden[i].1 = x;
                hidden.insert(i + 1, (x + 1, e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The state as the set of offsets it holds.
    fn held(m: &Mine, h: &Hidden) -> BTreeSet<u32> {
        (0..m.cut).chain(h.iter().flat_map(|&(s, e)| s..e)).collect()
    }

    /// Every invariant the module doc states.
    fn check(m: &Mine, h: &Hidden) {
        assert_eq!(m.hidden, h.iter().map(|&(s, e)| e - s).sum::<u32>());
        for w in h.windows(2) {
            assert!(w[0].1 < w[1].0, "disjoint and not adjacent: {h:?}");
        }
        assert!(h.iter().all(|&(s, e)| s > m.cut && s < e), "past the cutoff, not empty: {m:?} {h:?}");
    }

    #[test]
    fn holes_and_fills_agree_with_a_set_of_offsets() {
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..200 {
            let (mut m, mut h, mut model) = (Mine::default(), Hidden::new(), BTreeSet::new());
            for _ in 0..200 {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let x = (rng % 24) as u32;
                if rng >> 60 < 9 {
                    let b = (x + 1 + (rng >> 40) as u32 % 4).min(24);
                    if m.try_extend(x, b) {
                        assert!(m.hidden == 0);
                    } else {
                        m.add(x, b, &mut h);
                    }
                    model.extend(x..b);
                } else if model.remove(&x) && !m.try_drop_last(x) {
                    m.drop_offset(x, &mut h);
                }
                check(&m, &h);
                assert_eq!(held(&m, &h), model);
                let cut = (0..).find(|i| !model.contains(i)).unwrap_or(0);
                assert_eq!(m.cut, cut, "the cutoff is the longest held prefix");
                assert!((0..24).all(|x| m.holds(x, Some(&h)) == model.contains(&x)));
            }
        }
    }
}
