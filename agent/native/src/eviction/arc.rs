//! Follows `arc.py`: ARC (Megiddo and Modha, 2003) over a cache's leaves, an expert of the
//! mixture, run only inside shadow caches (it must see every access).
//!
//! Keys seen once (T1) and seen again (T2) are two LRU lists whose split adapts to hits on
//! the ghosts of recently evicted keys (B1, B2). A queued leaf's current entry sits in the
//! heap of the list its key was in when last looked at; `top` moves entries whose key has
//! changed lists since. The key of a queued item is its node's (Python reads `block_id`,
//! which is the key for a shadow node, the only record ARC orders).
//!
//! ARC runs only in a shadow cache, whose nodes are its cached keys one to one: the list of
//! a cached key (`_list_of`) is kept in its node ([`ShadowNodes::arc_list`]), and the queued
//! leaves (`_queued`, whose values nothing reads) are counted.

use super::float::{py_max, py_min};
use super::heap::{Entry, LazyHeap, Stamped};
use super::ring::{Plain, RingMap};
use super::shadow::ShadowNodes;
use super::{Item, Node, Records};

/// Each ghost list remembers up to this many times the capacity in evicted keys.
pub const GHOST_FACTOR: usize = 4;

/// `(last_used, order, stamp, block)`.
#[derive(Debug, Clone, Copy)]
pub struct ArcEntry {
    last_used: u64,
    order: u64,
    stamp: u64,
    item: Item,
}

impl Entry for ArcEntry {
    #[inline]
    fn less(&self, other: &Self) -> bool {
        (self.last_used, self.order) < (other.last_used, other.order)
    }
}

impl Stamped for ArcEntry {
    #[inline]
    fn item(&self) -> Item {
        self.item
    }
    #[inline]
    fn stamp(&self) -> u64 {
        self.stamp
    }
}

#[derive(Debug, Clone)]
pub struct ArcQueue {
    capacity: usize,
    p: f64,
    /// Keys per list (index 1 and 2).
    sizes: [i64; 3],
    /// B1 and B2, oldest first.
    ghosts: [RingMap<Plain<()>>; 2],
    /// Queued leaves.
    live: usize,
    /// The heaps of T1 and T2.
    heaps: [LazyHeap<ArcEntry>; 2],
    order: u64,
}

impl ArcQueue {
    pub fn new(capacity: usize) -> Self {
        ArcQueue {
            capacity,
            p: 0.0,
            sizes: [0; 3],
            ghosts: [
                RingMap::with_limit(GHOST_FACTOR * capacity + 1),
                RingMap::with_limit(GHOST_FACTOR * capacity + 1),
            ],
            live: 0,
            heaps: [LazyHeap::default(), LazyHeap::default()],
            order: 0,
        }
    }

    /// A use of `node` (its key's list is kept in the node).
    pub fn on_access(&mut self, node: Node, nodes: &mut ShadowNodes) {
        match nodes.arc_list(node) {
            2 => return,
            1 => {
                nodes.set_arc_list(node, 2);
                self.sizes[1] -= 1;
                self.sizes[2] += 1;
                return;
            }
            _ => {}
        }
        let key = nodes.key(node);
        let (b1, b2) = (self.ghosts[0].len(), self.ghosts[1].len());
        // `key in b1` and `del b1[key]` in one look-up (the sizes are taken before).
        let target = if self.ghosts[0].remove(key).is_some() {
            let step = py_max(b2 as f64 / b1.max(1) as f64, 1.0);
            self.p = py_min(self.capacity as f64, self.p + step);
            2
        } else if self.ghosts[1].remove(key).is_some() {
            let step = py_max(b1 as f64 / b2.max(1) as f64, 1.0);
            self.p = py_max(0.0, self.p - step);
            2
        } else {
            1
        };
        nodes.set_arc_list(node, target);
        self.sizes[target as usize] += 1;
    }

    /// The list of a queued (so cached) item's key.
    #[inline]
    fn list_of(item: Item, nodes: &ShadowNodes) -> u8 {
        nodes.arc_list(item).max(1)
    }

    pub fn push(&mut self, item: Item, nodes: &mut ShadowNodes) {
        let which = Self::list_of(item, nodes);
        self.heaps[which as usize - 1].push(ArcEntry {
            last_used: nodes.last_used(item),
            order: self.order,
            stamp: nodes.queue_stamp(item),
            item,
        });
        self.order += 1;
        self.live += 1;
    }

    /// Stop ordering a queued `item`.
    pub fn discard(&mut self, item: Item, nodes: &mut ShadowNodes) {
        self.live -= 1;
        let live = self.live;
        self.heaps[0].compact(live, Some(item), nodes);
        self.heaps[1].compact(live, Some(item), nodes);
    }

    /// The least recent current entry of list `which`, moving those whose key changed lists
    /// since to the other list's heap.
    fn top(&mut self, which: u8, nodes: &ShadowNodes) -> Option<ArcEntry> {
        loop {
            let entry = self.heaps[which as usize - 1].peek(nodes)?;
            let actual = Self::list_of(entry.item, nodes);
            if actual == which {
                return Some(entry);
            }
            self.heaps[which as usize - 1].pop_top();
            self.heaps[actual as usize - 1].push(entry);
        }
    }

    pub fn pop(&mut self, nodes: &mut ShadowNodes) -> Option<Item> {
        let first = self.top(1, nodes);
        let second = self.top(2, nodes);
        let (which, entry) = match (first, second) {
            (None, None) => return None,
            (Some(first), None) => (1u8, first),
            (Some(first), Some(_)) if self.sizes[1] as f64 > self.p => (1, first),
            (_, Some(second)) => (2, second),
        };
        // Python pops the heap's top, the entry `top` returned.
        self.heaps[which as usize - 1].pop_top();
        let item = entry.item;
        self.live -= 1;
        let key = nodes.key(item);
        nodes.set_arc_list(item, 0); // the node leaves the cache
        self.sizes[which as usize] -= 1;
        let ghosts = &mut self.ghosts[which as usize - 1];
        ghosts.insert(key, ());
        while ghosts.len() > GHOST_FACTOR * self.capacity {
            ghosts.pop_front();
        }
        Some(item)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    pub fn memory_bytes(&self) -> usize {
        self.memory_parts().iter().map(|(_, b)| b).sum()
    }

    pub fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        vec![
            (
                "heaps",
                self.heaps[0].memory_bytes() + self.heaps[1].memory_bytes(),
            ),
            (
                "ghosts",
                self.ghosts[0].memory_parts()[0].1 + self.ghosts[1].memory_parts()[0].1,
            ),
            (
                "ghosts.index",
                self.ghosts[0].memory_parts()[2].1 + self.ghosts[1].memory_parts()[2].1,
            ),
        ]
    }

    /// `(p, |T1|, |T2|, |B1|, |B2|)` for the differential tests.
    pub fn state(&self) -> (f64, i64, i64, usize, usize) {
        (
            self.p,
            self.sizes[1],
            self.sizes[2],
            self.ghosts[0].len(),
            self.ghosts[1].len(),
        )
    }
}
