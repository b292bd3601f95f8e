//! Digests of a worker's blocks: an order-independent sum over the engine hashes it holds, kept
//! as blocks come and go by the index and by a publisher alike, so that the two (or two
//! replicas) compare a worker's whole state in sixteen bytes. A lost event, a wrong application
//! or a replica that diverged shows as a difference.

use serde::{Deserialize, Serialize};

/// A set of engine hashes, digested: how many, and the wrapping sum of each one mixed. Adding
/// and removing a hash are inverse, so the digest depends on the set alone, not on the order
/// its blocks came in. Not a table key: the mix is fixed, the same in every process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Digest {
    /// Hashes in the set.
    pub blocks: u64,
    /// The wrapping sum of [`mix`] over them.
    pub sum: u64,
}

/// A 64-bit finalizer (splitmix64's), so that sets of nearby hashes do not sum alike.
#[inline]
pub fn mix(h: u64) -> u64 {
    let mut z = h.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Digest {
    /// `hash` joined the set (it was not in it).
    #[inline]
    pub fn add(&mut self, hash: u64) {
        self.blocks = self.blocks.wrapping_add(1);
        self.sum = self.sum.wrapping_add(mix(hash));
    }

    /// `hash` left the set (it was in it).
    #[inline]
    pub fn remove(&mut self, hash: u64) {
        self.blocks = self.blocks.wrapping_sub(1);
        self.sum = self.sum.wrapping_sub(mix(hash));
    }

    /// The digest of `hashes`, each one once.
    pub fn of(hashes: impl IntoIterator<Item = u64>) -> Digest {
        let mut d = Digest::default();
        for h in hashes {
            d.add(h);
        }
        d
    }

    /// The digest of two disjoint sets together.
    pub fn join(self, other: Digest) -> Digest {
        Digest { blocks: self.blocks.wrapping_add(other.blocks), sum: self.sum.wrapping_add(other.sum) }
    }
}

/// What a hybrid model's other group `group` holding engine hash `h` adds to the groups'
/// digest: one set of (group, hash) pairs for every group but the primary one.
#[inline]
pub fn group_member(group: u8, h: u64) -> u64 {
    mix(h) ^ u64::from(group)
}

/// A worker's digests: of its device blocks, of its host and disk blocks, and of its hybrid
/// groups' blocks, where they are known (a publisher that says them, an index that keeps them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerDigests {
    /// Its device blocks.
    pub device: Digest,
    /// Its host and disk blocks; `None`: not said, or not kept.
    pub tiers: Option<[Digest; 2]>,
    /// Its (group, hash) pairs of a hybrid model's other groups ([`group_member`]); `None`:
    /// not said, not kept, or an index that left some of the worker's group blocks unplaced
    /// (their primary block unknown), so that its digest would differ by design.
    pub groups: Option<Digest>,
}

impl WorkerDigests {
    /// Where `self` (what a publisher or sibling says) and `held` differ: the tier's name and
    /// both digests; tiers are compared only where both know them.
    pub fn differs(&self, held: &WorkerDigests) -> Option<(&'static str, Digest, Digest)> {
        if self.device != held.device {
            return Some(("device", self.device, held.device));
        }
        if let (Some(said), Some(kept)) = (self.tiers, held.tiers) {
            let tiers = ["host", "disk"].into_iter().zip(said.into_iter().zip(kept));
            if let Some((t, (a, b))) = tiers.into_iter().find(|(_, (a, b))| a != b) {
                return Some((t, a, b));
            }
        }
        let (said, kept) = (self.groups?, held.groups?);
        (said != kept).then_some(("groups", said, kept))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_is_of_the_set_not_of_the_order() {
        let mut d = Digest::default();
        for h in [5, 9, 7] {
            d.add(h);
        }
        d.remove(9);
        assert_eq!(d, Digest::of([7, 5]));
        assert_ne!(Digest::of([1, 2]), Digest::of([1, 3]));
        assert_eq!(Digest::of([1]).join(Digest::of([2])), Digest::of([2, 1]));
    }

    #[test]
    fn every_part_is_compared_where_both_sides_know_it() {
        let d = |h| Digest::of([h]);
        let a = WorkerDigests { device: d(1), tiers: Some([d(2), d(3)]), groups: Some(d(4)) };
        assert_eq!(a.differs(&a), None);
        assert_eq!(a.differs(&WorkerDigests { device: d(9), ..a }).map(|x| x.0), Some("device"));
        assert_eq!(a.differs(&WorkerDigests { tiers: Some([d(2), d(9)]), ..a }).map(|x| x.0), Some("disk"));
        assert_eq!(a.differs(&WorkerDigests { groups: Some(d(9)), ..a }).map(|x| x.0), Some("groups"));
        // A part one side does not know is not compared.
        assert_eq!(a.differs(&WorkerDigests { tiers: None, groups: None, ..a }), None);
        assert_ne!(group_member(1, 5), group_member(2, 5), "the same hash in two groups counts twice");
    }

    /// Pinned: publishers in other languages (the Python client's) compute the same.
    #[test]
    fn the_mix_is_splitmix64_s_finalizer() {
        assert_eq!(Digest::of([1, 2, 3]), Digest { blocks: 3, sum: 0x456D_78AF_809B_437C });
    }
}
