//! The radix-tree backend: a prefix tree over local hashes, each node holding the set of
//! workers that cache the block at the end of its path. A lookup walks the query's path
//! once, with no prefix hashing, so it wins on short or highly divergent sequences.

use super::{
    candidate_slots, finish_matches, ApplyOutcome, Beyond, IndexError, IndexStats, KvIndex, MatchOptions, Saved, SavedBlock,
    SavedParent, WorkerMatch,
};
use crate::hash::{BlockHash, LocalHash, StoredBlock, WorkerId};
use crate::seeded::SeededMap;
use crate::workers::{Slot, SlotBits, Spill, WorkerRegistry, WorkerSet};
use parking_lot::RwLock;
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicI64, Ordering};

type NodeId = u32;
const ROOT: NodeId = 0;

#[derive(Clone, Copy, Default)]
struct Node {
    parent: NodeId,
    depth: u32,
    children: u32,
    /// False once the node is freed.
    live: bool,
    local: u64,
    set: WorkerSet,
}

#[derive(Default)]
struct Tree {
    nodes: Vec<Node>,
    /// Freed ids, reused lowest first so live nodes gather at the front and the tail can be
    /// given back (see `trim`).
    free: BTreeSet<NodeId>,
    children: SeededMap<(NodeId, u64), NodeId>,
    /// Members of node sets that span more than one inline window.
    spill: Spill,
}

impl Tree {
    fn child_or_insert(&mut self, parent: NodeId, local: u64) -> NodeId {
        if let Some(&c) = self.children.get(&(parent, local)) {
            return c;
        }
        let node =
            Node { parent, depth: self.nodes[parent as usize].depth + 1, children: 0, live: true, local, set: WorkerSet::EMPTY };
        let id = match self.free.pop_first() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        };
        self.nodes[parent as usize].children += 1;
        self.children.insert((parent, local), id);
        id
    }

    /// Frees `id` and its ancestors while they hold no worker and have no children.
    fn prune(&mut self, mut id: NodeId) {
        while id != ROOT {
            let Some(&n) = self.nodes.get(id as usize) else { return };
            if !n.live || !n.set.is_empty() || n.children > 0 {
                return;
            }
            self.nodes[id as usize].live = false;
            self.children.remove(&(n.parent, n.local));
            self.nodes[n.parent as usize].children -= 1;
            self.free.insert(id);
            id = n.parent;
        }
    }

    /// Gives memory back after removals: drops freed nodes at the end of the node array and
    /// shrinks the arrays once they are mostly empty, so churn keeps memory flat and an
    /// emptied index returns to its empty size.
    fn trim(&mut self) {
        while self.nodes.len() > 1 && self.nodes.last().is_some_and(|n| !n.live) {
            self.free.remove(&((self.nodes.len() - 1) as NodeId));
            self.nodes.pop();
        }
        if self.nodes.capacity() > 1024 && self.nodes.len() < self.nodes.capacity() / 4 {
            self.nodes.shrink_to(self.nodes.len() * 2);
        }
        if self.children.capacity() > 1024 && self.children.len() < self.children.capacity() / 4 {
            self.children.shrink_to(self.children.len() * 2);
        }
    }
}

/// The radix-tree backend.
pub struct RadixIndex {
    registry: WorkerRegistry,
    max_depth: u32,
    tree: RwLock<Tree>,
    placements: AtomicI64,
}

/// A worker's reverse map: engine block hash -> tree node.
pub struct RadixWriter {
    id: WorkerId,
    slot: Slot,
    blocks: SeededMap<u64, NodeId>,
    /// Extra engine hashes this worker holds at an already-held node.
    aliases: SeededMap<NodeId, u32>,
    /// Its blocks past `max_depth` (see [`Beyond`]).
    beyond: Beyond,
}

#[derive(Default)]
struct Scratch {
    alive: SlotBits,
    probe: SlotBits,
    depths: Vec<(Slot, u32)>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl RadixIndex {
    /// An empty tree accepting chains up to `max_depth` and `max_workers` workers.
    pub fn new(max_depth: u32, max_workers: u32) -> Self {
        let tree = Tree { nodes: vec![Node { live: true, ..Node::default() }], ..Default::default() };
        RadixIndex {
            registry: WorkerRegistry::new(max_workers),
            max_depth,
            tree: RwLock::new(tree),
            placements: AtomicI64::new(0),
        }
    }

    /// Drops `w`'s hold on `node` (honouring aliases); the caller prunes.
    fn release(tree: &mut Tree, w: &mut RadixWriter, node: NodeId) {
        if let Some(n) = w.aliases.get_mut(&node) {
            *n -= 1;
            if *n == 0 {
                w.aliases.remove(&node);
            }
            return;
        }
        let Tree { nodes, spill, .. } = tree;
        nodes[node as usize].set.remove_spilling(w.slot, spill);
    }
}

impl KvIndex for RadixIndex {
    type Writer = RadixWriter;

    fn name(&self) -> &'static str {
        "radix"
    }

    fn registry(&self) -> &WorkerRegistry {
        &self.registry
    }

    fn writer(&self, worker: WorkerId) -> Result<RadixWriter, IndexError> {
        let slot = self.registry.intern(worker)?;
        Ok(RadixWriter {
            id: worker,
            slot,
            blocks: SeededMap::default(),
            aliases: SeededMap::default(),
            beyond: Beyond::default(),
        })
    }

    fn worker_id(w: &RadixWriter) -> WorkerId {
        w.id
    }

    fn store(&self, w: &mut RadixWriter, parent: Option<BlockHash>, blocks: &[StoredBlock]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let mut node = match parent {
            None => ROOT,
            Some(h) => match w.blocks.get(&h.0) {
                Some(&n) => n,
                None if w.beyond.contains(h) => {
                    out.too_deep = w.beyond.add(blocks);
                    return out;
                }
                None => {
                    out.unplaceable = blocks.len() as u64;
                    return out;
                }
            },
        };
        let mut tree = self.tree.write();
        let mut released = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            if tree.nodes[node as usize].depth >= self.max_depth {
                out.too_deep += w.beyond.add(&blocks[i..]);
                break;
            }
            let child = tree.child_or_insert(node, b.tokens_hash.0);
            match w.blocks.get(&b.block_hash.0) {
                Some(&old) if old == child => {
                    out.duplicates += 1;
                    node = child;
                    continue;
                }
                Some(&old) => {
                    Self::release(&mut tree, w, old);
                    released.push(old);
                    out.replaced += 1;
                    self.placements.fetch_sub(1, Ordering::Relaxed);
                }
                None => {}
            }
            let Tree { nodes, spill, .. } = &mut *tree;
            if !nodes[child as usize].set.insert_spilling(w.slot, spill) {
                *w.aliases.entry(child).or_default() += 1;
            }
            w.blocks.insert(b.block_hash.0, child);
            out.stored += 1;
            node = child;
        }
        for n in released {
            tree.prune(n);
        }
        // A chain that stopped early may leave empty nodes behind.
        tree.prune(node);
        tree.trim();
        self.placements.fetch_add(out.stored as i64, Ordering::Relaxed);
        out
    }

    fn remove(&self, w: &mut RadixWriter, hashes: &[BlockHash]) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let mut tree = self.tree.write();
        for h in hashes {
            let was_beyond = w.beyond.forget(*h);
            match w.blocks.remove(&h.0) {
                Some(node) => {
                    Self::release(&mut tree, w, node);
                    tree.prune(node);
                    out.removed += 1;
                }
                None if was_beyond => {}
                None => out.unknown_removes += 1,
            }
        }
        tree.trim();
        drop(tree);
        if w.blocks.capacity() > 64 && w.blocks.len() < w.blocks.capacity() / 4 {
            w.blocks.shrink_to(w.blocks.len() * 2);
        }
        self.placements.fetch_sub(out.removed as i64, Ordering::Relaxed);
        out
    }

    fn clear(&self, w: &mut RadixWriter) -> ApplyOutcome {
        let mut tree = self.tree.write();
        w.aliases.clear();
        for (_, &node) in w.blocks.iter() {
            let Tree { nodes, spill, .. } = &mut *tree;
            nodes[node as usize].set.remove_spilling(w.slot, spill);
        }
        for (_, &node) in w.blocks.iter() {
            tree.prune(node);
        }
        tree.trim();
        let removed = w.blocks.len() as u64;
        w.blocks = SeededMap::default();
        w.aliases = SeededMap::default();
        w.beyond.clear();
        self.placements.fetch_sub(removed as i64, Ordering::Relaxed);
        ApplyOutcome { removed, ..Default::default() }
    }

    fn find_matches(&self, query: &[LocalHash], opts: &MatchOptions) -> Vec<WorkerMatch> {
        let n = opts.max_blocks.map_or(query.len(), |m| m.min(query.len()));
        if n == 0 {
            return Vec::new();
        }
        SCRATCH.with(|cell| {
            let s = &mut *cell.borrow_mut();
            let Scratch { alive, probe, depths } = s;
            depths.clear();
            candidate_slots(&self.registry, opts, alive);
            let tree = self.tree.read();
            let mut node = ROOT;
            for (i, q) in query[..n].iter().enumerate() {
                let Some(&child) = tree.children.get(&(node, q.0)) else {
                    if i > 0 {
                        depths.extend(alive.iter().map(|s| (s, i as u32)));
                    }
                    alive.clear();
                    break;
                };
                probe.copy_from(alive);
                tree.nodes[child as usize].set.and_into_spilling(&tree.spill, probe);
                if i > 0 && probe != alive {
                    alive.and_not(probe);
                    depths.extend(alive.iter().map(|s| (s, i as u32)));
                }
                std::mem::swap(alive, probe);
                if alive.is_empty() {
                    break;
                }
                node = child;
            }
            depths.extend(alive.iter().map(|s| (s, n as u32)));
            drop(tree);
            finish_matches(&self.registry, depths, opts.max_matches)
        })
    }

    fn save(&self, w: &RadixWriter) -> Saved {
        let tree = self.tree.read();
        // One engine hash per held node, to name a parent by.
        let held: SeededMap<NodeId, u64> = w.blocks.iter().map(|(&h, &n)| (n, h)).collect();
        let mut blocks: Vec<SavedBlock> = w
            .blocks
            .iter()
            .map(|(&hash, &node)| {
                let n = tree.nodes[node as usize];
                let parent = if n.parent == ROOT {
                    SavedParent::Root
                } else if let Some(&ph) = held.get(&n.parent) {
                    SavedParent::Block(ph)
                } else {
                    let mut path = Vec::new();
                    let mut at = n.parent;
                    while at != ROOT {
                        let a = tree.nodes[at as usize];
                        path.push(a.local);
                        at = a.parent;
                    }
                    path.reverse();
                    SavedParent::Place(path)
                };
                SavedBlock { hash, pos: n.depth - 1, key: n.local, parent }
            })
            .collect();
        blocks.sort_unstable_by_key(|b| (b.pos, b.hash));
        Saved { blocks, beyond: w.beyond.to_vec() }
    }

    fn restore(&self, w: &mut RadixWriter, saved: &Saved) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        let mut tree = self.tree.write();
        for b in &saved.blocks {
            if b.pos >= self.max_depth {
                out.too_deep += 1;
                continue;
            }
            if w.blocks.contains_key(&b.hash) {
                out.duplicates += 1;
                continue;
            }
            let parent = match &b.parent {
                SavedParent::Root => Some(ROOT),
                SavedParent::Block(ph) => w.blocks.get(ph).copied(),
                SavedParent::Place(path) if path.len() == b.pos as usize => {
                    Some(path.iter().fold(ROOT, |at, &local| tree.child_or_insert(at, local)))
                }
                _ => None,
            };
            let parent = match parent {
                Some(p) if tree.nodes[p as usize].depth == b.pos => p,
                other => {
                    if let Some(p) = other {
                        tree.prune(p);
                    }
                    out.unplaceable += 1;
                    continue;
                }
            };
            let child = tree.child_or_insert(parent, b.key);
            let Tree { nodes, spill, .. } = &mut *tree;
            if !nodes[child as usize].set.insert_spilling(w.slot, spill) {
                *w.aliases.entry(child).or_default() += 1;
            }
            w.blocks.insert(b.hash, child);
            out.stored += 1;
        }
        w.beyond.extend(&saved.beyond);
        self.placements.fetch_add(out.stored as i64, Ordering::Relaxed);
        out
    }

    fn stats(&self) -> IndexStats {
        let tree = self.tree.read();
        IndexStats {
            placements: self.placements.load(Ordering::Relaxed).max(0) as u64,
            entries: (tree.nodes.len() - 1 - tree.free.len()) as u64,
            workers: self.registry.len() as u64,
            ..Default::default()
        }
    }
}
