//! A stand-in for `eviction::queue::EvictionQueue` while the policies are being ported: the
//! priority levels and expiry of `queue.py` over plain LRU (`lru.py`) only.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::eviction::{effective_priority, Item, Records, DEFAULT_PRIORITY, MAX_PRIORITY};

#[derive(Clone, Copy)]
struct LruEntry {
    last_used: u64,
    order: u64,
    stamp: u64,
    item: Item,
}

impl PartialEq for LruEntry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for LruEntry {}
impl PartialOrd for LruEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for LruEntry {
    // reversed: BinaryHeap is a max-heap, the queue wants the smallest (last_used, order)
    fn cmp(&self, other: &Self) -> Ordering {
        (other.last_used, other.order).cmp(&(self.last_used, self.order))
    }
}

#[derive(Clone, Copy)]
struct ExpiryEntry {
    expires: f64,
    order: u64,
    stamp: u64,
    item: Item,
}
impl PartialEq for ExpiryEntry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for ExpiryEntry {}
impl PartialOrd for ExpiryEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for ExpiryEntry {
    fn cmp(&self, other: &Self) -> Ordering {
        match other.expires.partial_cmp(&self.expires).unwrap() {
            Ordering::Equal => other.order.cmp(&self.order),
            o => o,
        }
    }
}

#[derive(Default)]
struct LruLevel {
    heap: BinaryHeap<LruEntry>,
    live: usize,
    order: u64,
}

pub struct EvictionQueue {
    levels: Vec<Option<LruLevel>>,
    nonempty: u128,
    size: usize,
    expiry: BinaryHeap<ExpiryEntry>,
    order: u64,
}

impl EvictionQueue {
    pub fn new(policy: &str, _capacity: usize) -> Result<Self, String> {
        if policy != "lru" && policy != "reuse-gap" && policy != "mixture" {
            return Err(format!("unknown eviction policy {policy:?}"));
        }
        Ok(EvictionQueue {
            levels: (0..=MAX_PRIORITY).map(|_| None).collect(),
            nonempty: 0,
            size: 0,
            expiry: BinaryHeap::new(),
            order: 0,
        })
    }

    pub fn push(&mut self, item: Item, now: f64, recs: &mut dyn Records) {
        assert!(recs.queue_level(item) < 0, "block is already evictable");
        let level = effective_priority(recs.priority(item), recs.expires_at(item), now);
        recs.bump_stamp(item);
        recs.set_queue_level(item, level as i16);
        let q = self.levels[level as usize].get_or_insert_with(LruLevel::default);
        q.order += 1;
        q.heap.push(LruEntry {
            last_used: recs.last_used(item),
            order: q.order,
            stamp: recs.queue_stamp(item),
            item,
        });
        q.live += 1;
        self.nonempty |= 1u128 << level;
        self.size += 1;
        if let Some(expires) = recs.expires_at(item) {
            if level != DEFAULT_PRIORITY && expires > now {
                self.order += 1;
                self.expiry.push(ExpiryEntry {
                    expires,
                    order: self.order,
                    stamp: recs.queue_stamp(item),
                    item,
                });
            }
        }
    }

    pub fn discard(&mut self, item: Item, recs: &mut dyn Records) {
        let level = recs.queue_level(item);
        if level < 0 {
            return;
        }
        let q = self.levels[level as usize].as_mut().unwrap();
        q.live -= 1;
        recs.set_queue_level(item, -1);
        recs.bump_stamp(item);
        self.size -= 1;
        if q.heap.len() > 64 && q.heap.len() > 2 * q.live {
            let heap = std::mem::take(&mut q.heap);
            q.heap = heap
                .into_iter()
                .filter(|e| recs.queue_stamp(e.item) == e.stamp && recs.queue_level(e.item) >= 0)
                .collect();
        }
    }

    pub fn pop(&mut self, now: f64, recs: &mut dyn Records) -> Option<Item> {
        self.expire(now, recs);
        while self.nonempty != 0 {
            let level = self.nonempty.trailing_zeros() as usize;
            let q = self.levels[level].as_mut().unwrap();
            while let Some(e) = q.heap.pop() {
                if recs.queue_stamp(e.item) == e.stamp && recs.queue_level(e.item) >= 0 {
                    q.live -= 1;
                    recs.set_queue_level(e.item, -1);
                    recs.bump_stamp(e.item);
                    self.size -= 1;
                    return Some(e.item);
                }
            }
            self.nonempty &= !(1u128 << level);
        }
        None
    }

    pub fn requeue(&mut self, item: Item, now: f64, recs: &mut dyn Records) {
        if recs.queue_level(item) >= 0 {
            self.discard(item, recs);
            self.push(item, now, recs);
        }
    }

    pub fn observe(&mut self, _keys: &[i64], _scored: bool) {}

    pub fn watches_requests(&self) -> bool {
        false
    }

    pub fn memory_bytes(&self) -> usize {
        self.levels
            .iter()
            .flatten()
            .map(|q| q.heap.capacity() * 32)
            .sum::<usize>()
            + self.expiry.capacity() * 32
    }

    fn expire(&mut self, now: f64, recs: &mut dyn Records) {
        while let Some(&e) = self.expiry.peek() {
            if recs.queue_stamp(e.item) != e.stamp || recs.queue_level(e.item) < 0 {
                self.expiry.pop();
                continue;
            }
            if e.expires > now {
                break;
            }
            self.expiry.pop();
            self.discard(e.item, recs);
            self.push(e.item, now, recs);
        }
    }
}
