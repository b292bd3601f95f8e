//! The one domain event type: what a worker's KV cache did. The wire decoder, the replay
//! stream and the benchmarks each convert into it at their edge; the index applies it.

use crate::hash::{BlockHash, StoredBlock};
use crate::hybrid::GroupKind;
use crate::index::{ApplyOutcome, KvIndex};

/// Where a block is cached. Lookups match `Device` blocks unless they ask for other tiers;
/// each tier is indexed apart ([`crate::tiers`]) so that a block offloaded to host memory
/// never counts as a GPU hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Tier {
    /// GPU memory: the blocks a lookup matches.
    #[default]
    Device,
    /// CPU memory of the worker's host.
    Host,
    /// Local disk or a remote store.
    Disk,
}

impl Tier {
    /// The tier's protocol and metric name.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }

    /// Parses a protocol name (`device`, `host`, `disk`).
    pub fn parse(name: &[u8]) -> Option<Tier> {
        match name {
            b"device" => Some(Tier::Device),
            b"host" => Some(Tier::Host),
            b"disk" => Some(Tier::Disk),
            _ => None,
        }
    }
}

/// One KV event of one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A chain of blocks cached under `parent` (`None`: the chain starts at position 0); each
    /// next block's parent is the block before it.
    Stored {
        /// The engine hash of the first block's parent; `None` for a root block.
        parent: Option<BlockHash>,
        /// The chain, parents first.
        blocks: Vec<StoredBlock>,
        /// Where the chain is cached.
        tier: Tier,
    },
    /// Blocks dropped from one tier, by engine hash.
    Removed {
        /// Engine hashes of the dropped blocks.
        hashes: Vec<BlockHash>,
        /// The tier they were dropped from; another tier's copy stays.
        tier: Tier,
    },
    /// Every block of the worker is gone, in every tier and group.
    Cleared,
    /// GPU blocks of one of a hybrid model's other groups (sliding-window or state layers
    /// beside the primary full-attention group), by engine hash: each is placed where the
    /// worker's primary group holds the same hash (see [`crate::groups`]).
    GroupStored {
        /// The group, 1..=[`crate::hybrid::MAX_GROUP`] (0 is the primary group).
        group: u8,
        /// What the group needs of a prefix.
        kind: GroupKind,
        /// Engine hashes of the blocks.
        hashes: Vec<BlockHash>,
    },
    /// GPU blocks dropped from one of a hybrid model's other groups.
    GroupRemoved {
        /// The group, 1..=[`crate::hybrid::MAX_GROUP`].
        group: u8,
        /// Engine hashes of the dropped blocks.
        hashes: Vec<BlockHash>,
    },
}

impl Event {
    /// A device-tier chain of `(block_hash, tokens_hash)` pairs under `parent`.
    pub fn stored(parent: Option<u64>, blocks: &[(u64, u64)]) -> Event {
        Event::Stored {
            parent: parent.map(BlockHash),
            blocks: blocks.iter().map(|&(b, t)| StoredBlock::new(b, t)).collect(),
            tier: Tier::Device,
        }
    }

    /// A device-tier removal of these engine hashes.
    pub fn removed(hashes: &[u64]) -> Event {
        Event::Removed { hashes: hashes.iter().map(|&h| BlockHash(h)).collect(), tier: Tier::Device }
    }

    /// The kind of change, as metrics label it: `stored`, `removed` or `cleared` (a hybrid
    /// group's stores and removals count as stores and removals).
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Stored { .. } | Event::GroupStored { .. } => "stored",
            Event::Removed { .. } | Event::GroupRemoved { .. } => "removed",
            Event::Cleared => "cleared",
        }
    }

    /// Blocks this event names (stored or removed), for throughput counting.
    pub fn blocks(&self) -> usize {
        match self {
            Event::Stored { blocks, .. } => blocks.len(),
            Event::Removed { hashes, .. } | Event::GroupStored { hashes, .. } | Event::GroupRemoved { hashes, .. } => {
                hashes.len()
            }
            Event::Cleared => 0,
        }
    }

    /// Applies this event to `index` through the worker's writer. The index holds the device
    /// tier's primary group: events of other tiers ([`crate::tiers::OtherTiers`]) and groups
    /// ([`crate::groups::Groups`]) change nothing here.
    pub fn apply_to<I: KvIndex>(&self, index: &I, w: &mut I::Writer) -> ApplyOutcome {
        match self {
            Event::Stored { parent, blocks, tier: Tier::Device } => index.store(w, *parent, blocks),
            Event::Removed { hashes, tier: Tier::Device } => index.remove(w, hashes),
            Event::Cleared => index.clear(w),
            Event::Stored { .. } | Event::Removed { .. } | Event::GroupStored { .. } | Event::GroupRemoved { .. } => {
                ApplyOutcome::default()
            }
        }
    }
}
