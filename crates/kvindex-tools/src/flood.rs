//! A hash-flooding workload: one publisher stores root blocks whose local and
//! engine hashes all share one home slot under an *unseeded* Fibonacci mix, then an honest
//! worker stores a chain behind them. With random keys instead, the same work is the control:
//! a seeded index applies both at about the same rate.

use crate::stream::StreamOp;
use crate::trace::mock_local_hash;

/// The multiplier of the unseeded mix the workload attacks.
const K: u64 = 0x9E37_79B9_7F4A_7C15;

/// `K^-1 mod 2^64` (Newton's iteration): `j * K^-1` mixes to `j`, so keys `1..n` all land in
/// the first slot of any table smaller than 2^64 / n.
fn inverse_of_k() -> u64 {
    (0..6).fold(K, |y, _| y.wrapping_mul(2u64.wrapping_sub(K.wrapping_mul(y))))
}

/// `n` root blocks from worker 1 (crafted to collide, or random), then a 64-block chain from
/// worker 2.
pub fn flood_stream(n: u64, crafted: bool) -> Vec<StreamOp> {
    let inv = inverse_of_k();
    let key = |j: u64, salt: u64| if crafted { j.wrapping_mul(inv) ^ salt } else { mock_local_hash(j ^ (salt << 40)) };
    let mut ops: Vec<StreamOp> = (1..=n)
        .map(|j| StreamOp::Stored { worker: 1, event_id: j - 1, parent: None, blocks: vec![(key(j, 0), key(j, 0))] })
        .collect();
    let chain: Vec<(u64, u64)> = (0..64u64).map(|i| (mock_local_hash(1 << 50 | i), mock_local_hash(2 << 50 | i))).collect();
    ops.push(StreamOp::Stored { worker: 2, event_id: 0, parent: None, blocks: chain });
    ops
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crafted_keys_collide_under_the_unseeded_mix() {
        assert_eq!(K.wrapping_mul(inverse_of_k()), 1);
        for op in &flood_stream(1000, true)[..1000] {
            let StreamOp::Stored { blocks, .. } = op else { panic!("{op:?}") };
            let mixed = blocks[0].0.wrapping_mul(K);
            assert!(mixed <= 1000, "lands in slot 0 of any table under 2^54 slots");
        }
    }
}
