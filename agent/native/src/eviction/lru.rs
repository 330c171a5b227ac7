//! Follows `lru.py` (and `heap.py`'s `HeapQueue`): least recently used first, the
//! reference's order within a priority level.
//!
//! A heap keyed on the item's last-use tick rather than a linked list, so that an item whose
//! priority expires re-enters the default level at its true recency.

use super::heap::{Entry, LazyHeap, Stamped};
use super::{Item, Records};

/// `(last_used, order, stamp, block)`.
#[derive(Debug, Clone, Copy)]
pub struct LruEntry {
    last_used: u64,
    order: u64,
    stamp: u64,
    item: Item,
}

impl Entry for LruEntry {
    #[inline]
    fn less(&self, other: &Self) -> bool {
        (self.last_used, self.order) < (other.last_used, other.order)
    }
}

impl Stamped for LruEntry {
    #[inline]
    fn item(&self) -> Item {
        self.item
    }
    #[inline]
    fn stamp(&self) -> u64 {
        self.stamp
    }
}

#[derive(Debug, Clone, Default)]
pub struct LruQueue {
    heap: LazyHeap<LruEntry>,
    live: usize,
    order: u64,
}

impl LruQueue {
    pub fn new() -> Self {
        Self::default()
    }

    #[inline]
    pub fn push<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        let entry = LruEntry {
            last_used: recs.last_used(item),
            order: self.order,
            stamp: recs.queue_stamp(item),
            item,
        };
        self.order += 1;
        self.heap.push(entry);
        self.live += 1;
    }

    #[inline]
    pub fn discard<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        self.live -= 1;
        self.heap.compact(self.live, Some(item), recs);
    }

    #[inline]
    pub fn pop<R: Records + ?Sized>(&mut self, recs: &mut R) -> Option<Item> {
        let entry = self.heap.pop(recs)?;
        self.live -= 1;
        Some(entry.item)
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
        self.heap.memory_bytes()
    }

    pub fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        vec![("heap", self.heap.memory_bytes())]
    }
}
