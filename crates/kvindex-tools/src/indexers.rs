//! The indexes a benchmark can replay: kvindex's backends and, with `--features peers`, the
//! field's peers, each made by name and run through a computation generic over the index.

use crate::answering::Answering;
use kvindex_core::index::positional::{PositionalConfig, PositionalIndex};
use kvindex_core::index::reference::ReferenceIndex;
use kvindex_core::index::runs::{RunConfig, RunIndex};
use kvindex_core::index::Backend;

/// What the bench can replay: one of kvindex's backends, or a peer's index to compare with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Indexer {
    /// A kvindex backend.
    Kvindex(Backend),
    /// smg's `PositionalIndexer` (`kv-index` 1.4.0).
    #[cfg(feature = "peers")]
    SmgPositional,
    /// smg's `ChainIndex` (`kv-index` 2.0.0).
    #[cfg(feature = "peers")]
    SmgChain,
    /// Dynamo's `ConcurrentRadixTreeCompressed` in its `ThreadPoolIndexer` (`dynamo-kv-router` 1.6.1).
    #[cfg(feature = "peers")]
    DynamoCrtc,
    /// Dynamo's `PositionalIndexer` (`dynamo-kv-router` 1.6.1).
    #[cfg(feature = "peers")]
    DynamoPositional,
    /// smg's `RadixTree` (`smg-radix-tree` 0.1.0), behind a `RwLock`.
    #[cfg(feature = "peers")]
    SmgRadix,
}

impl std::str::FromStr for Indexer {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            #[cfg(feature = "peers")]
            "smg-positional" => Ok(Indexer::SmgPositional),
            #[cfg(feature = "peers")]
            "smg-chain" => Ok(Indexer::SmgChain),
            #[cfg(feature = "peers")]
            "dynamo-crtc" => Ok(Indexer::DynamoCrtc),
            #[cfg(feature = "peers")]
            "dynamo-positional" => Ok(Indexer::DynamoPositional),
            #[cfg(feature = "peers")]
            "smg-radix" => Ok(Indexer::SmgRadix),
            #[cfg(not(feature = "peers"))]
            "smg-positional" | "smg-chain" | "dynamo-crtc" | "dynamo-positional" | "smg-radix" => {
                Err(format!("{s} needs the peers built in: cargo run --release --features peers -- bench ..."))
            }
            _ => s
                .parse()
                .map(Indexer::Kvindex)
                .map_err(|e| format!("{e}, smg-positional, smg-chain, smg-radix, dynamo-crtc, dynamo-positional")),
        }
    }
}

/// Builds an indexer and runs `f` on it. `f` makes each index with the number of threads that
/// will write to it (an index that applies writes on threads of its own, Dynamo's thread pool,
/// starts as many).
pub fn with_backend<R>(indexer: Indexer, jump: usize, f: impl FnOnceIndex<R>) -> R {
    let max_depth = PositionalConfig::default().max_depth;
    let max_workers = PositionalConfig::default().max_workers;
    match indexer {
        Indexer::Kvindex(Backend::Runs) => {
            f.call(|_| RunIndex::new(RunConfig { max_depth, max_workers, ..RunConfig::default() }))
        }
        Indexer::Kvindex(Backend::Positional) => {
            f.call(|_| PositionalIndex::new(PositionalConfig { jump, ..Default::default() }))
        }
        Indexer::Kvindex(Backend::Reference) => f.call(|_| ReferenceIndex::new(max_depth, max_workers)),
        #[cfg(feature = "peers")]
        Indexer::SmgPositional => f.call(|_| crate::peers::SmgPositional::new(max_workers)),
        #[cfg(feature = "peers")]
        Indexer::SmgChain => f.call(|_| crate::peers::SmgChain::new(max_workers)),
        #[cfg(feature = "peers")]
        Indexer::DynamoCrtc => f.call(|threads| crate::peers::DynamoCrtc::new(threads, max_workers)),
        #[cfg(feature = "peers")]
        Indexer::DynamoPositional => f.call(|_| crate::peers::DynamoPositional::new(jump, max_workers)),
        #[cfg(feature = "peers")]
        Indexer::SmgRadix => f.call(|_| crate::peers::SmgRadix::new(max_workers)),
    }
}

/// A computation generic over the index type (a closure cannot be generic).
pub trait FnOnceIndex<R> {
    fn call<I: Answering>(self, make: impl Fn(usize) -> I) -> R;
}
