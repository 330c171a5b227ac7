//! Follows `shadow.py`: a metadata-only prefix cache, what a cache of the same capacity
//! would hold under another order, fed the same requests.
//!
//! Like the engine's tree it is prefix-closed and evicts only leaves, so its hits for a
//! request are the request's cached prefix. Its nodes live in a slab ([`ShadowNodes`]) that
//! is also their queue record ([`Records`]: a shadow node is its own item and its own tree
//! node, at priority 0, never expiring). A node evicted while an order still holds it
//! (reuse-gap's chain heads) stays in its slot, frozen, until let go.
//!
//! Keys are path keys: each key names one prefix (one parent), as the engine's chained keys
//! and the traces' hash ids do. The Python shadow misbehaves on requests that break this
//! (a key under two parents); neither is meant for them.

use super::keyed::KeyIndex;
use super::{Item, Node, Records};

/// The slot of the root (key 0, never queued, never evicted).
pub const ROOT: Node = 0;
const NO_PARENT: u32 = u32::MAX;

/// One cached key: its tree links and its queue record (32 bytes: packed to 4-byte
/// alignment, the 64-bit fields read and written by value).
///
/// The stamp keeps its low 32 bits here. Orders that only test a heap entry's stamp for
/// equality (LRU, LRFU, ARC) read them alone and let them wrap (safe: see `heap.rs`); orders
/// that sort by the Python stamp (reuse-gap, which holds nodes) keep the high bits in
/// [`Held`].
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct ShadowNode {
    key: i64,
    last_used: u64,
    stamp_lo: u32,
    parent: u32,
    children: u32,
    queue_level: i8,
    /// [`PINNED`], [`ALIVE`], and ARC's list in [`ARC_LIST`].
    flags: u8,
}

const PINNED: u8 = 1;
/// In the tree; a dropped node stays while held, then its slot is reused.
const ALIVE: u8 = 2;
/// ARC's list of the node's key while cached (`ARCQueue._list_of`): 0 (none yet), 1 or 2.
const ARC_LIST: u8 = 0b1100;
const ARC_SHIFT: u32 = 2;

/// What only an order that holds nodes (reuse-gap) needs of a slot: kept beside the slab,
/// and only for such orders.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, packed(4))]
struct Held {
    /// The slot's `queue_stamp` when its node was made (its Python stamp counts from it).
    born: u64,
    /// Holds of the orders that remember it (`Records::hold`).
    holds: u32,
    /// The high 32 bits of the slot's `queue_stamp` (the low ones are the node's).
    stamp_hi: u32,
}

/// The shadow's nodes: a slab of `ShadowNode`s with a free list, and the births and holds
/// of its slots where the order holds nodes.
#[derive(Debug, Clone)]
pub struct ShadowNodes {
    nodes: Vec<ShadowNode>,
    /// Parallel to `nodes` where the order holds nodes, else empty.
    held: Vec<Held>,
    holding: bool,
    free: Vec<u32>,
    /// Nodes that became or stopped being single-child so far (`Records::shape_version`).
    shape: u64,
}

impl Default for ShadowNodes {
    fn default() -> Self {
        Self::with_capacity(0, true)
    }
}

impl ShadowNodes {
    /// Room for `capacity` nodes beside the root, allocated once (it grows by an eighth at a
    /// time where held nodes outlast the tree); `holding`: whether the order holds nodes
    /// and reads their Python stamps ([`Records::hold`], [`Records::order_stamp`]).
    pub fn with_capacity(capacity: usize, holding: bool) -> Self {
        let root = ShadowNode {
            key: 0,
            last_used: 0,
            stamp_lo: 0,
            parent: NO_PARENT,
            children: 0,
            queue_level: -1,
            flags: ALIVE,
        };
        let mut nodes = Vec::with_capacity(capacity + 1);
        nodes.push(root);
        let mut held = Vec::new();
        if holding {
            held.reserve_exact(capacity + 1);
            held.push(Held::default());
        }
        ShadowNodes {
            nodes,
            held,
            holding,
            free: Vec::new(),
            shape: 0,
        }
    }

    /// A new node `key` under `parent` (a reused slot keeps its stamp: stamps only grow).
    fn alloc(&mut self, key: i64, parent: Node) -> Node {
        let mut fresh = ShadowNode {
            key,
            last_used: 0,
            stamp_lo: 0,
            parent,
            children: 0,
            queue_level: -1,
            flags: ALIVE,
        };
        match self.free.pop() {
            Some(at) => {
                fresh.stamp_lo = self.nodes[at as usize].stamp_lo;
                self.nodes[at as usize] = fresh;
                if self.holding {
                    let born = self.queue_stamp(at);
                    let held = &mut self.held[at as usize];
                    held.born = born;
                    held.holds = 0;
                }
                at
            }
            None => {
                let len = self.nodes.len();
                if len == self.nodes.capacity() {
                    let more = (len / 8).max(8);
                    self.nodes.reserve_exact(more);
                    if self.holding {
                        self.held.reserve_exact(more);
                    }
                }
                self.nodes.push(fresh);
                if self.holding {
                    self.held.push(Held::default());
                }
                len as Node
            }
        }
    }

    /// `node` left the tree: its slot is free unless an order holds it.
    fn drop_node(&mut self, node: Node) {
        let slot = &mut self.nodes[node as usize];
        slot.flags &= !ALIVE;
        if !self.holding || self.held[node as usize].holds == 0 {
            self.free.push(node);
        }
    }

    #[inline]
    fn at(&self, node: Node) -> &ShadowNode {
        &self.nodes[node as usize]
    }

    #[inline]
    fn at_mut(&mut self, node: Node) -> &mut ShadowNode {
        &mut self.nodes[node as usize]
    }

    #[inline]
    fn set_pinned(&mut self, node: Node, pinned: bool) {
        let n = self.at_mut(node);
        n.flags = if pinned {
            n.flags | PINNED
        } else {
            n.flags & !PINNED
        };
    }

    /// ARC's list of the key of `node` (0: none; the node is new to ARC).
    #[inline]
    pub fn arc_list(&self, node: Node) -> u8 {
        (self.at(node).flags & ARC_LIST) >> ARC_SHIFT
    }

    #[inline]
    pub fn set_arc_list(&mut self, node: Node, list: u8) {
        let n = self.at_mut(node);
        n.flags = (n.flags & !ARC_LIST) | (list << ARC_SHIFT);
    }

    /// Slots held by an order after their node left the tree.
    pub fn held_dead(&self) -> usize {
        self.nodes
            .iter()
            .zip(&self.held)
            .filter(|(n, h)| n.flags & ALIVE == 0 && { h.holds } > 0)
            .count()
    }

    pub fn memory_bytes(&self) -> usize {
        self.nodes.capacity() * std::mem::size_of::<ShadowNode>()
            + self.held.capacity() * std::mem::size_of::<Held>()
            + self.free.capacity() * 4
    }
}

impl Records for ShadowNodes {
    #[inline]
    fn queue_level(&self, item: Item) -> i16 {
        self.at(item).queue_level as i16
    }
    #[inline]
    fn set_queue_level(&mut self, item: Item, level: i16) {
        self.at_mut(item).queue_level = level as i8;
    }
    #[inline]
    fn queue_stamp(&self, item: Item) -> u64 {
        let lo = self.at(item).stamp_lo as u64;
        if self.holding {
            (self.held[item as usize].stamp_hi as u64) << 32 | lo
        } else {
            lo
        }
    }
    #[inline]
    fn bump_stamp(&mut self, item: Item) {
        let n = self.at_mut(item);
        n.stamp_lo = n.stamp_lo.wrapping_add(1);
        if n.stamp_lo == 0 && self.holding {
            self.held[item as usize].stamp_hi += 1;
        }
    }
    #[inline]
    fn order_stamp(&self, item: Item) -> u64 {
        assert!(
            self.holding,
            "a shadow that keeps no births has no Python stamps"
        );
        self.queue_stamp(item) - self.held[item as usize].born
    }
    #[inline]
    fn priority(&self, _item: Item) -> u8 {
        0
    }
    #[inline]
    fn expires_at(&self, _item: Item) -> Option<f64> {
        None
    }
    #[inline]
    fn last_used(&self, item: Item) -> u64 {
        self.at(item).last_used
    }
    #[inline]
    fn node(&self, item: Item) -> Node {
        item
    }
    #[inline]
    fn key(&self, node: Node) -> i64 {
        self.at(node).key
    }
    #[inline]
    fn node_last_used(&self, node: Node) -> u64 {
        self.at(node).last_used
    }
    #[inline]
    fn parent(&self, node: Node) -> Option<Node> {
        let parent = self.at(node).parent;
        (parent != NO_PARENT).then_some(parent)
    }
    #[inline]
    fn num_children(&self, node: Node) -> usize {
        self.at(node).children as usize
    }
    #[inline]
    fn hold(&mut self, node: Node) {
        assert!(
            self.holding,
            "a shadow that keeps no holds was asked to hold"
        );
        self.held[node as usize].holds += 1;
    }
    #[inline]
    fn shape_version(&self) -> Option<u64> {
        Some(self.shape)
    }
    #[inline]
    fn unhold(&mut self, node: Node) {
        let slot = &mut self.held[node as usize];
        slot.holds -= 1;
        if slot.holds == 0 && self.nodes[node as usize].flags & ALIVE == 0 {
            self.free.push(node);
        }
    }
}

/// The order a shadow runs: a whole queue operation, stamp and level included (what
/// `ShadowCache._enqueue`, `_unqueue` and its pops do around a level queue).
pub trait ShadowOrder {
    fn enqueue(&mut self, node: Node, nodes: &mut ShadowNodes);
    fn unqueue(&mut self, node: Node, nodes: &mut ShadowNodes);
    fn pop_victim(&mut self, nodes: &mut ShadowNodes) -> Option<Node>;
    /// Whether the order must see every access (`on_access`).
    fn observes(&self) -> bool {
        false
    }
    /// A use of `node` (its key, at its `last_used` tick: `AccessObserver.on_access`).
    fn on_access(&mut self, _node: Node, _nodes: &mut ShadowNodes) {}
    /// Whether the order holds nodes and reads their Python stamps (the shadow then keeps
    /// births and holds beside its nodes).
    fn holds_nodes(&self) -> bool {
        true
    }
    fn memory_bytes(&self) -> usize;
    /// `memory_bytes` by part.
    fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        vec![("order", self.memory_bytes())]
    }
}

/// `capacity` keys under the order `Q`; `step` replays one request.
#[derive(Debug, Clone)]
pub struct ShadowCache<Q> {
    capacity: usize,
    queue: Q,
    nodes: ShadowNodes,
    /// Cached key -> its node.
    cache: KeyIndex,
    tick: u64,
    path: Vec<Node>,
}

impl<Q: ShadowOrder> ShadowCache<Q> {
    pub fn new(capacity: usize, queue: Q) -> Result<Self, String> {
        if capacity < 1 {
            return Err(format!(
                "a shadow cache needs at least one block, got {capacity}"
            ));
        }
        let holding = queue.holds_nodes();
        Ok(ShadowCache {
            capacity,
            queue,
            nodes: ShadowNodes::with_capacity(capacity, holding),
            cache: KeyIndex::with_capacity(capacity),
            tick: 0,
            path: Vec::new(),
        })
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// The node cached under `key`.
    #[inline]
    fn lookup(&self, key: i64) -> Option<Node> {
        let nodes = &self.nodes;
        self.cache.get(key, |n| nodes.at(n).key)
    }

    #[inline]
    pub fn contains(&self, key: i64) -> bool {
        self.lookup(key).is_some()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn keys(&self) -> impl Iterator<Item = i64> + '_ {
        self.cache.slots().map(|n| self.nodes.at(n).key)
    }

    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// The order and the nodes it orders (a miniature tells its order about requests).
    pub fn parts_mut(&mut self) -> (&mut Q, &mut ShadowNodes) {
        (&mut self.queue, &mut self.nodes)
    }

    pub fn nodes(&self) -> &ShadowNodes {
        &self.nodes
    }

    /// `step` without watching the changes.
    pub fn step(&mut self, keys: &[i64]) -> usize {
        self.step_with(keys, |_| {})
    }

    /// Serve a request for the blocks `keys` (a path from the root); returns how many
    /// leading blocks were cached. `changed` gets every key that leaves (victims, in
    /// eviction order) and enters (in request order) the cache (`ShadowCache.on_change`).
    /// Blocks that do not fit even after evicting every unpinned leaf are not cached.
    pub fn step_with(&mut self, keys: &[i64], mut changed: impl FnMut(i64)) -> usize {
        let mut path = std::mem::take(&mut self.path);
        path.clear();
        for &key in keys {
            match self.lookup(key) {
                Some(node) => path.push(node),
                None => break,
            }
        }
        let hits = path.len();
        for &node in &path {
            self.nodes.set_pinned(node, true);
        }
        if let Some(&last) = path.last() {
            if self.nodes.at(last).queue_level >= 0 {
                self.queue.unqueue(last, &mut self.nodes);
            }
        }
        let mut need = keys.len() - hits;
        while self.cache.len() + need > self.capacity {
            let Some(victim) = self.queue.pop_victim(&mut self.nodes) else {
                need = self.capacity.saturating_sub(self.cache.len());
                break;
            };
            let (key, parent) = {
                let v = self.nodes.at(victim);
                (v.key, v.parent)
            };
            let nodes = &self.nodes;
            self.cache.remove(key, |n| nodes.at(n).key);
            let p = self.nodes.at_mut(parent);
            p.children -= 1;
            let single = p.children == 1;
            let orphan = parent != ROOT && p.children == 0 && p.flags & PINNED == 0;
            self.nodes.shape += u64::from(single);
            self.nodes.drop_node(victim);
            if orphan {
                self.queue.enqueue(parent, &mut self.nodes);
            }
            changed(key);
        }
        let observes = self.queue.observes();
        let mut tick = self.tick;
        for &node in &path {
            tick += 1;
            self.nodes.at_mut(node).last_used = tick;
            if observes {
                self.queue.on_access(node, &mut self.nodes);
            }
        }
        let mut parent = path.last().copied().unwrap_or(ROOT);
        for &key in &keys[hits..hits + need] {
            let node = self.nodes.alloc(key, parent);
            tick += 1;
            self.nodes.at_mut(node).last_used = tick;
            if observes {
                self.queue.on_access(node, &mut self.nodes);
            }
            let p = self.nodes.at_mut(parent);
            p.children += 1;
            let branched = p.children == 2;
            self.nodes.shape += u64::from(branched);
            let nodes = &self.nodes;
            self.cache.insert(key, node, |n| nodes.at(n).key);
            parent = node;
            changed(key);
        }
        self.tick = tick;
        for &node in &path {
            self.nodes.set_pinned(node, false);
        }
        if parent != ROOT && self.nodes.at(parent).children == 0 {
            self.queue.enqueue(parent, &mut self.nodes);
        }
        self.path = path;
        hits
    }

    /// Heap bytes owned, the order's included.
    pub fn memory_bytes(&self) -> usize {
        self.nodes.memory_bytes()
            + self.cache.memory_bytes()
            + self.path.capacity() * 4
            + self.queue.memory_bytes()
    }

    /// `memory_bytes` by part: the node slab, the key index, the path buffer, then the
    /// order's parts.
    pub fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        let mut parts = vec![
            ("nodes", self.nodes.memory_bytes()),
            ("index", self.cache.memory_bytes()),
            ("path", self.path.capacity() * 4),
        ];
        parts.extend(self.queue.memory_parts());
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::expert::{Expert, ExpertKind, Tuning};

    fn lru(capacity: usize) -> ShadowCache<Expert> {
        ShadowCache::new(
            capacity,
            Expert::new(ExpertKind::Lru, capacity, Tuning::default()),
        )
        .unwrap()
    }

    #[test]
    fn serves_prefixes_and_evicts_leaves() {
        let mut shadow = lru(3);
        assert_eq!(shadow.step(&[1, 2]), 0);
        assert_eq!(shadow.step(&[1, 2, 3]), 2);
        let mut changed = Vec::new();
        // Room for 4 and 5 takes 3, then 2 (a leaf once 3 is gone): 1 stays, as the path.
        assert_eq!(shadow.step_with(&[1, 4, 5], |k| changed.push(k)), 1);
        assert_eq!(changed, vec![3, 2, 4, 5]);
        let mut keys: Vec<i64> = shadow.keys().collect();
        keys.sort();
        assert_eq!(keys, vec![1, 4, 5]);
        assert!(ShadowCache::new(0, Expert::new(ExpertKind::Lru, 0, Tuning::default())).is_err());
    }

    #[test]
    fn caches_only_what_fits() {
        let mut shadow = lru(2);
        assert_eq!(shadow.step(&[1, 2, 3]), 0);
        assert_eq!(shadow.len(), 2);
        assert!(shadow.contains(1) && shadow.contains(2) && !shadow.contains(3));
    }

    #[test]
    fn a_held_node_keeps_its_slot_after_eviction() {
        let mut nodes = ShadowNodes::default();
        let a = nodes.alloc(7, ROOT);
        nodes.at_mut(a).last_used = 3;
        nodes.hold(a);
        nodes.drop_node(a);
        let b = nodes.alloc(8, ROOT);
        assert_ne!(a, b);
        assert_eq!((nodes.key(a), nodes.node_last_used(a)), (7, 3));
        assert_eq!(nodes.held_dead(), 1);
        nodes.bump_stamp(a);
        nodes.unhold(a);
        let c = nodes.alloc(9, ROOT);
        assert_eq!(c, a); // reused once let go, its stamp going on, its Python stamp at 0
        assert_eq!((nodes.queue_stamp(c), nodes.order_stamp(c)), (1, 0));
    }

    #[test]
    fn stamps_take_32_bits_unless_the_order_sorts_by_them() {
        assert_eq!(std::mem::size_of::<ShadowNode>(), 32);
        assert_eq!(std::mem::size_of::<Held>(), 16);
        // An order that only compares stamps for equality: the stamp wraps, and still tells
        // the node's current entry from the one before.
        let mut plain = ShadowNodes::with_capacity(4, false);
        let a = plain.alloc(7, ROOT);
        plain.at_mut(a).stamp_lo = u32::MAX;
        let before = plain.queue_stamp(a);
        plain.bump_stamp(a);
        assert_eq!(plain.queue_stamp(a), 0);
        assert_ne!(plain.queue_stamp(a), before);
        // reuse-gap's shadow keeps the high bits: its Python stamps count on past 2**32.
        let mut holding = ShadowNodes::with_capacity(4, true);
        let b = holding.alloc(7, ROOT);
        holding.at_mut(b).stamp_lo = u32::MAX;
        assert_eq!(holding.order_stamp(b), u32::MAX as u64);
        holding.bump_stamp(b);
        assert_eq!(holding.queue_stamp(b), 1 << 32);
        assert_eq!(holding.order_stamp(b), 1 << 32);
        holding.drop_node(b);
        let c = holding.alloc(8, ROOT);
        assert_eq!(c, b);
        assert_eq!(
            (holding.queue_stamp(c), holding.order_stamp(c)),
            (1 << 32, 0)
        );
    }
}
