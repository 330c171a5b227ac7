//! Follows `heap.py`: the lazy heaps every eviction order keeps its entries in.
//!
//! An entry is never removed from the middle of a heap: it carries what it was made from
//! (the item's `queue_stamp`, or a queue's own sequence number) and is skipped once that no
//! longer matches (it is *stale*). Stale entries are dropped all at once by [`compact`] when
//! they outnumber the live ones.
//!
//! That bound is why records may keep their stamps in 32 bits and let them wrap (the
//! engine's `BlockRec`, the shadows' nodes): a stamp is only compared for equality, every
//! bump comes with a push or a discard, and compaction drops a stale entry within about
//! twice the live count of bumps of its slot, far from 2**32, so a wrapped stamp never meets
//! an entry made 2**32 bumps before.
//!
//! Entries stand for Python tuples and compare like them, field by field (IEEE `<` and `==`
//! on floats). Every heap's entries carry a unique sequence number before the item, so two
//! entries never compare equal: the minimum is unique, and which entry a pop returns does
//! not depend on the heap's layout, nor on when it was compacted. That is why these heaps
//! need not copy `heapq`'s sift loops to pop what Python pops.

use super::{Item, Records};

/// Heaps this small are never compacted: skipping their stale entries costs less.
pub const COMPACT_FLOOR: usize = 64;

/// A heap entry: a small `Copy` record ordered like the Python tuple it stands for.
pub trait Entry: Copy {
    /// `self < other` as Python compares the two tuples.
    fn less(&self, other: &Self) -> bool;
}

/// An entry that stands for an item while the item's `queue_stamp` is the one it holds.
pub trait Stamped: Entry {
    fn item(&self) -> Item;
    fn stamp(&self) -> u64;
}

/// `heapq.heappush`.
#[inline]
pub fn heap_push<E: Entry>(heap: &mut Vec<E>, entry: E) {
    heap.push(entry);
    let last = heap.len() - 1;
    sift_up(heap, last);
}

/// `heapq.heappop`: remove and return the smallest entry.
#[inline]
pub fn heap_pop<E: Entry>(heap: &mut Vec<E>) -> Option<E> {
    let last = heap.pop()?;
    if heap.is_empty() {
        return Some(last);
    }
    let top = std::mem::replace(&mut heap[0], last);
    sift_down(heap, 0);
    Some(top)
}

/// `heapq.heapify`.
pub fn heapify<E: Entry>(heap: &mut [E]) {
    for i in (0..heap.len() / 2).rev() {
        sift_down(heap, i);
    }
}

fn sift_up<E: Entry>(heap: &mut [E], mut pos: usize) {
    let entry = heap[pos];
    while pos > 0 {
        let parent = (pos - 1) / 2;
        if !entry.less(&heap[parent]) {
            break;
        }
        heap[pos] = heap[parent];
        pos = parent;
    }
    heap[pos] = entry;
}

fn sift_down<E: Entry>(heap: &mut [E], mut pos: usize) {
    let len = heap.len();
    let entry = heap[pos];
    loop {
        let mut child = 2 * pos + 1;
        if child >= len {
            break;
        }
        if child + 1 < len && heap[child + 1].less(&heap[child]) {
            child += 1;
        }
        if !heap[child].less(&entry) {
            break;
        }
        heap[pos] = heap[child];
        pos = child;
    }
    heap[pos] = entry;
}

/// `heap.compact`: drop the entries `keep` rejects once the heap holds more than twice the
/// `live` entries (and more than [`COMPACT_FLOOR`]).
#[inline]
pub fn compact<E: Entry>(heap: &mut Vec<E>, live: usize, keep: impl FnMut(&E) -> bool) {
    if heap.len() > COMPACT_FLOOR && heap.len() > 2 * live {
        heap.retain(keep);
        heapify(heap);
    }
}

/// Whether `entry` still stands for its item: the item was neither dequeued nor queued
/// again since the entry was made (`LazyHeap.current`).
#[inline]
pub fn current<E: Stamped, R: Records + ?Sized>(entry: &E, recs: &R) -> bool {
    let item = entry.item();
    recs.queue_stamp(item) == entry.stamp() && recs.queue_level(item) >= 0
}

/// `LazyHeap`: a heap of entries holding their item's `queue_stamp`.
#[derive(Debug, Clone)]
pub struct LazyHeap<E> {
    pub entries: Vec<E>,
}

impl<E> Default for LazyHeap<E> {
    fn default() -> Self {
        LazyHeap {
            entries: Vec::new(),
        }
    }
}

impl<E: Stamped> LazyHeap<E> {
    /// Entries held, stale ones included.
    #[inline]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    #[inline]
    pub fn push(&mut self, entry: E) {
        heap_push(&mut self.entries, entry);
    }

    /// The smallest live entry, dropping the stale ones above it.
    #[inline]
    pub fn peek<R: Records + ?Sized>(&mut self, recs: &R) -> Option<E> {
        while let Some(top) = self.entries.first() {
            if current(top, recs) {
                return Some(*top);
            }
            heap_pop(&mut self.entries);
        }
        None
    }

    /// Remove and return the smallest live entry.
    #[inline]
    pub fn pop<R: Records + ?Sized>(&mut self, recs: &R) -> Option<E> {
        while let Some(entry) = heap_pop(&mut self.entries) {
            if current(&entry, recs) {
                return Some(entry);
            }
        }
        None
    }

    /// `heapq.heappop(heap.entries)`: remove the top entry, whatever it is (the live top
    /// a `peek` just returned).
    #[inline]
    pub fn pop_top(&mut self) -> Option<E> {
        heap_pop(&mut self.entries)
    }

    /// `LazyHeap.compact`. `leaving` is an item being discarded whose stamp is not bumped
    /// yet: its entries count as stale too.
    #[inline]
    pub fn compact<R: Records + ?Sized>(&mut self, live: usize, leaving: Option<Item>, recs: &R) {
        compact(&mut self.entries, live, |e| {
            Some(e.item()) != leaving && current(e, recs)
        });
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<E>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct E(f64, u64);

    impl Entry for E {
        fn less(&self, other: &Self) -> bool {
            self.0 < other.0 || (self.0 == other.0 && self.1 < other.1)
        }
    }

    #[test]
    fn pops_in_tuple_order() {
        let mut heap = Vec::new();
        let mut seed = 12345u64;
        let mut all = Vec::new();
        for i in 0..500 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((seed >> 40) % 50) as f64 - 25.0;
            let v = if v == 0.0 && i % 2 == 0 { -0.0 } else { v };
            heap_push(&mut heap, E(v, i));
            all.push(E(v, i));
        }
        heapify(&mut heap);
        all.sort_by(|a, b| {
            if a.less(b) {
                std::cmp::Ordering::Less
            } else {
                std::cmp::Ordering::Greater
            }
        });
        let popped: Vec<E> = std::iter::from_fn(|| heap_pop(&mut heap)).collect();
        assert_eq!(popped, all);
    }
}
