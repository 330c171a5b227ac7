//! Follows `lrfu.py`: LRFU (Lee et al., 2001), an expert of the mixture, run only inside
//! shadow caches (it must see every access: [`LrfuQueue::on_access`]).
//!
//! Each key's `C = sum over its uses of 2 ** (-decay * age)`; the leaf with the smallest `C`
//! goes first, ranked by `decay * used + log2 C(used)` so the key never goes stale. The
//! history of keys (bounded, oldest dropped first) outlives their eviction. The key of a
//! queued item is its node's (Python reads `block_id`, the key of a shadow node).
//!
//! The history is the biggest table of the default policy (two keys per block of capacity,
//! at least [`HISTORY_FLOOR`]): a [`RingMap`] whose ticks take 4 bytes and whose `C` takes
//! none while it is exactly 1.0 ([`TickCrf`]).

use super::float::{log2, pow};
use super::heap::{Entry, LazyHeap, Stamped};
use super::ring::{RingMap, TickCrf};
use super::{Item, Records};

/// `lambda`: the weight of one use halves every `1 / DECAY` accesses.
pub const DECAY: f64 = 1e-5;
/// Keys remembered: this many times the capacity (at least `HISTORY_FLOOR`); `lrfu.py` says
/// why 2 (it was 8).
pub const HISTORY_FACTOR: usize = 2;
pub const HISTORY_FLOOR: usize = 65_536;

/// `(value, last_used, order, stamp, block)`.
#[derive(Debug, Clone, Copy)]
pub struct LrfuEntry {
    value: f64,
    last_used: u64,
    order: u64,
    stamp: u64,
    item: Item,
}

impl Entry for LrfuEntry {
    #[inline]
    fn less(&self, other: &Self) -> bool {
        if self.value != other.value {
            return self.value < other.value;
        }
        (self.last_used, self.order) < (other.last_used, other.order)
    }
}

impl Stamped for LrfuEntry {
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
pub struct LrfuQueue {
    heap: LazyHeap<LrfuEntry>,
    live: usize,
    order: u64,
    capacity: usize,
    /// Key -> (tick of its last use, `C` at that tick).
    history: RingMap<TickCrf>,
    history_floor: usize,
}

impl LrfuQueue {
    pub fn new(capacity: usize) -> Self {
        Self::with_history_floor(capacity, HISTORY_FLOOR)
    }

    pub fn with_history_floor(capacity: usize, history_floor: usize) -> Self {
        Self::tuned(capacity, history_floor, None)
    }

    /// With the ticks of the history kept below `tick_span` (tests lower it to move the
    /// history's tick base often: see [`TickCrf`]).
    pub fn tuned(capacity: usize, history_floor: usize, tick_span: Option<u64>) -> Self {
        LrfuQueue {
            heap: LazyHeap::default(),
            live: 0,
            order: 0,
            capacity,
            // One past the bound: a new key is added before the oldest goes.
            history: RingMap::with_values(
                tick_span.map_or_else(TickCrf::new, TickCrf::with_span),
                history_floor.max(HISTORY_FACTOR * capacity) + 1,
            ),
            history_floor,
        }
    }

    /// A use of `key` at tick `now` (the shadow node's `last_used`).
    pub fn on_access(&mut self, key: i64, now: u64) {
        self.history.move_to_back(key, |seen| match seen {
            None => (now, 1.0),
            Some((then, crf)) => {
                let age = (now as i64 - then as i64) as f64;
                (now, 1.0 + crf * pow(2.0, -DECAY * age))
            }
        });
        let bound = self.history_floor.max(HISTORY_FACTOR * self.capacity);
        if self.history.len() > bound {
            self.history.pop_front();
        }
    }

    pub fn push<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        let key = recs.key(recs.node(item));
        let last_used = recs.last_used(item);
        let (used, crf) = self.history.get(key).unwrap_or((last_used, 1.0));
        // log2 C(now) = log2 C(used) - decay * (now - used): ranking by decay*used + log2 C
        // is the same at every "now".
        let value = DECAY * used as f64 + log2(crf);
        self.heap.push(LrfuEntry {
            value,
            last_used,
            order: self.order,
            stamp: recs.queue_stamp(item),
            item,
        });
        self.order += 1;
        self.live += 1;
    }

    pub fn discard<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        self.live -= 1;
        self.heap.compact(self.live, Some(item), recs);
    }

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
        self.memory_parts().iter().map(|(_, b)| b).sum()
    }

    pub fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        let [ring, values, index] = self.history.memory_parts();
        vec![
            ("heap", self.heap.memory_bytes()),
            ("history", ring.1),
            ("history.values", values.1),
            ("history.index", index.1),
        ]
    }

    /// `C` and tick remembered for `key` (for the differential tests).
    pub fn history_of(&self, key: i64) -> Option<(u64, f64)> {
        self.history.get(key)
    }

    pub fn history_len(&self) -> usize {
        self.history.len()
    }

    /// The history's keys, oldest first.
    pub fn history_keys(&self) -> Vec<i64> {
        self.history.iter().map(|(key, _)| key).collect()
    }

    /// Keys of the history whose tick is kept whole (see [`TickCrf`]).
    pub fn history_far(&self) -> usize {
        self.history.values().far_len()
    }
}
