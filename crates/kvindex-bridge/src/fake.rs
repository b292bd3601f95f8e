//! An engine's msgpack, built the way vLLM and SGLang send it: helpers for the bridge's tests,
//! the system tests and the bridge benchmark, so that each builds engine batches alike.

use rmpv::Value;

/// The msgpack bytes of `v`.
pub fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, v);
    out
}

/// A msgpack string.
pub fn s(x: &str) -> Value {
    Value::from(x)
}

/// A msgpack array.
pub fn arr(v: Vec<Value>) -> Value {
    Value::Array(v)
}

/// A msgpack map with string keys, in the order given.
pub fn map(kv: Vec<(&str, Value)>) -> Value {
    Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
}

/// A msgpack array of unsigned integers.
pub fn ints(v: impl IntoIterator<Item = u64>) -> Value {
    arr(v.into_iter().map(Value::from).collect())
}

/// A vLLM batch (`[ts, events, dp_rank]`) of `events` root chains of `blocks` blocks of
/// `block_size` tokens each, as positional `BlockStored` events, block hashes counting from
/// `first_hash`, token ids from the hashes (below 32,000, a vocabulary's size).
pub fn stored_batch(ts: f64, first_hash: u64, events: u64, blocks: u64, block_size: u64) -> Vec<u8> {
    let evs: Vec<Value> = (0..events)
        .map(|e| {
            let first = first_hash + e * blocks;
            arr(vec![
                s("BlockStored"),
                ints(first..first + blocks),
                Value::Nil,
                ints((0..blocks * block_size).map(|t| (first * block_size + t) % 32000)),
                Value::from(block_size),
            ])
        })
        .collect();
    encode(&arr(vec![Value::from(ts), arr(evs), Value::Nil]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{decode_batch, Hashing};

    #[test]
    fn a_stored_batch_decodes_to_its_chains() {
        let batch = decode_batch(&stored_batch(1.5, 100, 3, 4, 16), Hashing { block_size: None }).unwrap();
        assert_eq!(batch.events.len(), 3);
        let blocks: usize = batch.events.iter().map(|e| e.as_ref().map_or(0, |e| e.event.blocks())).sum();
        assert_eq!(blocks, 12);
    }
}
