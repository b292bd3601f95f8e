//! The JSONL replay stream (docs/STREAM.md): one index operation per line, so that
//! any two indexers can be fed exactly the same work.

use anyhow::{Context, Result};
use kvindex_core::{Event, LocalHash, WorkerId};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};

/// One operation of a replay stream. Hashes are u64; workers have dp rank 0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum StreamOp {
    /// A router asks for the workers holding the longest prefix of these local hashes.
    Lookup { local: Vec<u64> },
    /// `blocks` are `[local, engine]` pairs forming a chain under `parent` (null: position 0).
    Stored { worker: u64, event_id: u64, parent: Option<u64>, blocks: Vec<(u64, u64)> },
    /// Engine hashes the worker dropped.
    Removed { worker: u64, event_id: u64, seq: Vec<u64> },
    /// The worker dropped everything.
    Cleared { worker: u64, event_id: u64 },
}

/// A stream op converted to the domain types, once, before any timing starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A router's lookup of these local hashes.
    Lookup(Vec<LocalHash>),
    /// A worker's KV event.
    Event(WorkerId, Event),
}

impl From<StreamOp> for Op {
    fn from(op: StreamOp) -> Op {
        let w = |worker| WorkerId::new(worker, 0);
        match op {
            StreamOp::Lookup { local } => Op::Lookup(local.into_iter().map(LocalHash).collect()),
            StreamOp::Stored { worker, parent, blocks, .. } => {
                let pairs: Vec<(u64, u64)> = blocks.into_iter().map(|(local, block)| (block, local)).collect();
                Op::Event(w(worker), Event::stored(parent, &pairs))
            }
            StreamOp::Removed { worker, seq, .. } => Op::Event(w(worker), Event::removed(&seq)),
            StreamOp::Cleared { worker, .. } => Op::Event(w(worker), Event::Cleared),
        }
    }
}

/// Reads JSON lines of `what` (blank lines skipped); a bad line is an error naming its number.
pub fn read_jsonl<T: serde::de::DeserializeOwned>(r: impl BufRead, what: &str) -> Result<Vec<T>> {
    let mut out = Vec::new();
    for (n, line) in r.lines().enumerate() {
        let line = line.with_context(|| format!("reading {what} line {}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(serde_json::from_str(&line).with_context(|| format!("{what} line {}", n + 1))?);
    }
    Ok(out)
}

/// Reads a whole stream; a bad line is an error naming its line number.
pub fn read_stream(r: impl BufRead) -> Result<Vec<StreamOp>> {
    read_jsonl(r, "stream")
}

/// Writes ops as JSONL.
pub fn write_stream<'a>(mut w: impl Write, ops: impl IntoIterator<Item = &'a StreamOp>) -> Result<()> {
    for op in ops {
        serde_json::to_writer(&mut w, op)?;
        w.write_all(b"\n")?;
    }
    w.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_documented_format() {
        let text = r#"{"op":"lookup","local":[1,2]}
{"op":"stored","worker":3,"event_id":0,"parent":null,"blocks":[[1,10],[2,11]]}
{"op":"removed","worker":3,"event_id":1,"seq":[11]}

{"op":"cleared","worker":3,"event_id":2}
"#;
        let ops = read_stream(text.as_bytes()).unwrap();
        assert_eq!(
            ops,
            vec![
                StreamOp::Lookup { local: vec![1, 2] },
                StreamOp::Stored { worker: 3, event_id: 0, parent: None, blocks: vec![(1, 10), (2, 11)] },
                StreamOp::Removed { worker: 3, event_id: 1, seq: vec![11] },
                StreamOp::Cleared { worker: 3, event_id: 2 },
            ]
        );
        let mut out = Vec::new();
        write_stream(&mut out, &ops).unwrap();
        assert_eq!(read_stream(&out[..]).unwrap(), ops);
        assert!(String::from_utf8(out).unwrap().starts_with(r#"{"op":"lookup","local":[1,2]}"#));
    }

    #[test]
    fn bad_line_is_named() {
        let err = read_stream("{\"op\":\"lookup\",\"local\":[]}\n{\"op\":\"nope\"}\n".as_bytes()).unwrap_err();
        assert!(format!("{err:#}").contains("stream line 2"), "{err:#}");
    }
}
