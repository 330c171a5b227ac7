//! Follows `queue.py`: the evictable blocks of one (pool group, tier), by effective priority
//! and then by the policy within a level.
//!
//! Priorities are 0..=100: every evictable block of the lowest effective priority goes
//! before any block of the next, and a priority set with a duration reverts to the default
//! once it has passed (`pop` first moves expired blocks, from a lazy heap of expiry times).
//! A block is in at most one level, recorded in its `queue_level`; `queue_stamp`
//! invalidates old heap entries.

use super::expert::Tuning;
use super::guarded::guarded_with;
use super::heap::{Entry, LazyHeap, Stamped};
use super::lru::LruQueue;
use super::mixture::{self, MixturePolicy};
use super::registry::PolicyKind;
use super::reuse_gap::{self, ReuseGapQueue};
use super::shadow::{ShadowCache, ShadowNodes, ShadowOrder};
use super::vote::vote_with;
use super::{effective_priority, Item, Node, Records, DEFAULT_PRIORITY, MAX_PRIORITY};

const LEVELS: usize = MAX_PRIORITY as usize + 1;

/// `(expires_at, order, stamp, block)` of a queued block above the default priority.
#[derive(Debug, Clone, Copy)]
struct ExpiryEntry {
    expires: f64,
    order: u64,
    stamp: u64,
    item: Item,
}

impl Entry for ExpiryEntry {
    #[inline]
    fn less(&self, other: &Self) -> bool {
        if self.expires != other.expires {
            return self.expires < other.expires;
        }
        self.order < other.order
    }
}

impl Stamped for ExpiryEntry {
    #[inline]
    fn item(&self) -> Item {
        self.item
    }
    #[inline]
    fn stamp(&self) -> u64 {
        self.stamp
    }
}

/// The level queues: one order per level, or a shared policy that owns its levels.
#[derive(Debug, Clone)]
enum Levels {
    Lru(Vec<Option<LruQueue>>),
    ReuseGap(Vec<Option<Box<ReuseGapQueue>>>, usize),
    Mixture(Box<MixturePolicy>),
}

#[derive(Debug, Clone)]
pub struct EvictionQueue {
    levels: Levels,
    /// Bit p set while level p may hold blocks.
    nonempty: u128,
    size: usize,
    expiry: LazyHeap<ExpiryEntry>,
    order: u64,
}

impl EvictionQueue {
    /// `new_eviction_queue(policy, capacity)`: the queue of one (group, tier) holding
    /// `capacity` blocks. An unknown name is an error naming the allowed ones.
    pub fn new(policy: &str, capacity: usize) -> Result<Self, String> {
        Self::with_tuning(policy, capacity, Tuning::default())
    }

    /// `new` with lowered constants (tests).
    pub fn with_tuning(policy: &str, capacity: usize, tuning: Tuning) -> Result<Self, String> {
        let levels = match PolicyKind::parse(policy)? {
            PolicyKind::Lru => Levels::Lru(vec![None; LEVELS]),
            PolicyKind::ReuseGap => Levels::ReuseGap(
                vec![None; LEVELS],
                tuning.history_floor.unwrap_or(reuse_gap::HISTORY_FLOOR),
            ),
            PolicyKind::Mixture => Levels::Mixture(Box::new(vote_with(
                capacity,
                &super::guarded::GUARDED_EXPERTS,
                tuning,
            )?)),
            PolicyKind::Guarded => Levels::Mixture(Box::new(guarded_with(
                capacity,
                &super::guarded::GUARDED_EXPERTS,
                tuning,
            )?)),
            PolicyKind::MixtureV1 => Levels::Mixture(Box::new(MixturePolicy::with_experts(
                capacity,
                &mixture::DEFAULT_EXPERTS,
                mixture::HORIZON,
                None,
                tuning,
            )?)),
        };
        Ok(Self::over(levels))
    }

    /// A queue following a mixture built by the caller (custom experts, in tests).
    pub fn with_mixture(policy: MixturePolicy) -> Self {
        Self::over(Levels::Mixture(Box::new(policy)))
    }

    fn over(levels: Levels) -> Self {
        EvictionQueue {
            levels,
            nonempty: 0,
            size: 0,
            expiry: LazyHeap::default(),
            order: 0,
        }
    }

    /// Blocks queued.
    #[inline]
    pub fn len(&self) -> usize {
        self.size
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Whether the policy watches requests (Python: `queue.shared is not None`).
    pub fn watches_requests(&self) -> bool {
        matches!(self.levels, Levels::Mixture(_))
    }

    /// The mixture this queue follows, if its policy is one.
    pub fn mixture(&self) -> Option<&MixturePolicy> {
        match &self.levels {
            Levels::Mixture(m) => Some(m),
            _ => None,
        }
    }

    /// Make `item` evictable at its effective priority. Panics if it is already queued
    /// (Python raises `RuntimeError`).
    pub fn push<R: Records + ?Sized>(&mut self, item: Item, now: f64, recs: &mut R) {
        assert!(
            recs.queue_level(item) < 0,
            "block {item} is already evictable"
        );
        let expires = recs.expires_at(item);
        let level = effective_priority(recs.priority(item), expires, now) as usize;
        recs.bump_stamp(item);
        recs.set_queue_level(item, level as i16);
        match &mut self.levels {
            Levels::Lru(levels) => levels[level]
                .get_or_insert_with(LruQueue::new)
                .push(item, recs),
            Levels::ReuseGap(levels, floor) => levels[level]
                .get_or_insert_with(|| Box::new(ReuseGapQueue::with_history_floor(*floor)))
                .push(item, recs),
            Levels::Mixture(m) => m.push(level, item, recs),
        }
        self.nonempty |= 1 << level;
        self.size += 1;
        if let Some(expires) = expires {
            if level != DEFAULT_PRIORITY as usize && expires > now {
                self.expiry.compact(self.size, None, recs);
                self.expiry.push(ExpiryEntry {
                    expires,
                    order: self.order,
                    stamp: recs.queue_stamp(item),
                    item,
                });
                self.order += 1;
            }
        }
    }

    /// Stop `item` being evictable (no-op when it is not queued).
    pub fn discard<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        let level = recs.queue_level(item);
        if level < 0 {
            return;
        }
        let level = level as usize;
        match &mut self.levels {
            Levels::Lru(levels) => levels[level]
                .as_mut()
                .expect("a queued block's level has a queue")
                .discard(item, recs),
            Levels::ReuseGap(levels, _) => levels[level]
                .as_mut()
                .expect("a queued block's level has a queue")
                .discard(item, recs),
            Levels::Mixture(m) => m.discard(level, item, recs),
        }
        recs.set_queue_level(item, -1);
        recs.bump_stamp(item);
        self.size -= 1;
    }

    /// Remove and return the next victim, or None when nothing is evictable.
    pub fn pop<R: Records + ?Sized>(&mut self, now: f64, recs: &mut R) -> Option<Item> {
        self.expire(now, recs);
        let mut bits = self.nonempty;
        while bits != 0 {
            let level = bits.trailing_zeros() as usize;
            let victim = match &mut self.levels {
                Levels::Lru(levels) => levels[level].as_mut().and_then(|q| q.pop(recs)),
                Levels::ReuseGap(levels, _) => levels[level].as_mut().and_then(|q| q.pop(recs)),
                Levels::Mixture(m) => m.pop(level, recs),
            };
            if let Some(item) = victim {
                recs.set_queue_level(item, -1);
                recs.bump_stamp(item);
                self.size -= 1;
                return Some(item);
            }
            bits &= !(1u128 << level);
            self.nonempty = bits;
        }
        None
    }

    /// Tell a policy that watches requests about one (`SharedPolicy.observe`); a no-op for
    /// the others. `recs` is read when the mixture re-buckets queued blocks.
    pub fn observe<R: Records + ?Sized>(&mut self, keys: &[i64], scored: bool, recs: &mut R) {
        if let Levels::Mixture(m) = &mut self.levels {
            m.observe(keys, scored, recs);
        }
    }

    /// Re-sort a queued block after its priority or expiry changed.
    pub fn requeue<R: Records + ?Sized>(&mut self, item: Item, now: f64, recs: &mut R) {
        if recs.queue_level(item) >= 0 {
            self.discard(item, recs);
            self.push(item, now, recs);
        }
    }

    /// Move the blocks whose priority duration has passed to the default level.
    fn expire<R: Records + ?Sized>(&mut self, now: f64, recs: &mut R) {
        while !self.expiry.is_empty() {
            let Some(entry) = self.expiry.peek(recs) else {
                break;
            };
            if entry.expires > now || entry.expires.is_nan() {
                break;
            }
            self.expiry.pop_top();
            self.discard(entry.item, recs);
            self.push(entry.item, now, recs);
        }
    }

    /// `memory_bytes` by part: a mixture's parts (`MixturePolicy::memory_parts`), or the
    /// level queues as one; then `"expiry"`.
    pub fn memory_parts(&self) -> Vec<(String, usize)> {
        let mut parts = match &self.levels {
            Levels::Mixture(m) => {
                let mut parts = m.memory_parts();
                parts.push((
                    "mixture.struct".into(),
                    std::mem::size_of::<MixturePolicy>(),
                ));
                parts
            }
            _ => vec![(
                "levels".into(),
                self.memory_bytes() - self.expiry.memory_bytes(),
            )],
        };
        parts.push(("expiry".into(), self.expiry.memory_bytes()));
        parts
    }

    /// Heap bytes owned (every `Vec`'s and map's capacity), for the memory bench.
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let levels = match &self.levels {
            Levels::Lru(levels) => {
                levels.capacity() * size_of::<Option<LruQueue>>()
                    + levels
                        .iter()
                        .flatten()
                        .map(LruQueue::memory_bytes)
                        .sum::<usize>()
            }
            Levels::ReuseGap(levels, _) => {
                levels.capacity() * size_of::<Option<Box<ReuseGapQueue>>>()
                    + levels
                        .iter()
                        .flatten()
                        .map(|q| size_of::<ReuseGapQueue>() + q.memory_bytes())
                        .sum::<usize>()
            }
            Levels::Mixture(m) => size_of::<MixturePolicy>() + m.memory_bytes(),
        };
        levels + self.expiry.memory_bytes()
    }
}

/// A whole queue run inside a shadow cache (the miniature's `_Mini`): shadow nodes have
/// priority 0 and never expire, so this is the policy's level-0 queue, and the queue does
/// the stamp and level bookkeeping the shadow does around a bare level queue.
impl ShadowOrder for EvictionQueue {
    #[inline]
    fn enqueue(&mut self, node: Node, nodes: &mut ShadowNodes) {
        self.push(node, 0.0, nodes);
    }

    #[inline]
    fn unqueue(&mut self, node: Node, nodes: &mut ShadowNodes) {
        self.discard(node, nodes);
    }

    #[inline]
    fn pop_victim(&mut self, nodes: &mut ShadowNodes) -> Option<Node> {
        self.pop(0.0, nodes)
    }

    fn memory_bytes(&self) -> usize {
        EvictionQueue::memory_bytes(self)
    }
}

/// `miniature._Mini`: a registry policy's whole queue in a shadow cache.
pub type MiniCache = ShadowCache<EvictionQueue>;

impl ShadowCache<EvictionQueue> {
    /// A miniature of `policy` holding `capacity` blocks.
    pub fn mini(policy: &str, capacity: usize) -> Result<Self, String> {
        ShadowCache::new(capacity, EvictionQueue::new(policy, capacity)?)
    }

    /// `_Mini.step`: the policy observes the request, then the cache serves it; `changed`
    /// gets the keys that leave and enter. Returns the request's hits.
    pub fn observe_and_step(&mut self, keys: &[i64], changed: impl FnMut(i64)) -> usize {
        let (queue, nodes) = self.parts_mut();
        queue.observe(keys, true, nodes);
        self.step_with(keys, changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::toy::ToyStore;

    /// A root and `n` leaves under it, one block each, used at ticks 1..=n.
    fn flat(n: u32) -> (ToyStore, Vec<Item>) {
        let mut store = ToyStore::default();
        let root = store.add_node(0, None, 0, DEFAULT_PRIORITY, None);
        let items = (0..n)
            .map(|i| {
                let node = store.add_node(i as i64 + 1, Some(root), i as u64 + 1, 35, None);
                store.add_item(node)
            })
            .collect();
        (store, items)
    }

    #[test]
    fn lower_priorities_go_first_then_least_recent() {
        let (mut store, items) = flat(4);
        store.set_priority(store.node(items[0]), 80, None);
        store.set_priority(store.node(items[3]), 10, None);
        let mut queue = EvictionQueue::new("lru", 4).unwrap();
        for &item in &items {
            queue.push(item, 0.0, &mut store);
        }
        assert_eq!(queue.len(), 4);
        let order: Vec<Item> = std::iter::from_fn(|| queue.pop(0.0, &mut store)).collect();
        assert_eq!(order, vec![items[3], items[1], items[2], items[0]]);
        assert!(queue.is_empty());
    }

    #[test]
    fn an_expired_priority_protects_nothing() {
        let (mut store, items) = flat(2);
        store.set_priority(store.node(items[0]), 90, Some(5.0));
        let mut queue = EvictionQueue::new("lru", 2).unwrap();
        queue.push(items[0], 0.0, &mut store);
        queue.push(items[1], 0.0, &mut store);
        assert_eq!(store.queue_level(items[0]), 90);
        assert_eq!(queue.pop(1.0, &mut store), Some(items[1]));
        queue.push(items[1], 1.0, &mut store);
        // At 5.0 the first block is back at the default level, and older.
        assert_eq!(queue.pop(5.0, &mut store), Some(items[0]));
    }

    #[test]
    fn discard_requeue_and_unknown_names() {
        let (mut store, items) = flat(3);
        let mut queue = EvictionQueue::new("reuse-gap", 3).unwrap();
        for &item in &items {
            queue.push(item, 0.0, &mut store);
        }
        queue.discard(items[1], &mut store);
        queue.discard(items[1], &mut store); // not queued: a no-op
        assert_eq!(queue.len(), 2);
        store.set_priority(store.node(items[0]), 0, None);
        queue.requeue(items[0], 0.0, &mut store);
        assert_eq!(queue.pop(0.0, &mut store), Some(items[0]));
        queue.requeue(items[1], 0.0, &mut store); // not queued: stays out
        assert_eq!(queue.pop(0.0, &mut store), Some(items[2]));
        assert_eq!(queue.pop(0.0, &mut store), None);
        let err = EvictionQueue::new("fifo", 3).unwrap_err();
        assert!(
            err.contains("guarded, lru, mixture, mixture-v1, reuse-gap"),
            "{err}"
        );
        assert!(EvictionQueue::new("mixture", 3).unwrap().watches_requests());
        assert!(!EvictionQueue::new("lru", 3).unwrap().watches_requests());
    }

    #[test]
    fn serves_an_engine_through_a_trait_object() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<EvictionQueue>();
        let (mut store, items) = flat(2);
        let recs: &mut dyn Records = &mut store;
        let mut queue = EvictionQueue::new("mixture", 2).unwrap();
        queue.observe(&[2], true, recs);
        queue.push(items[0], 0.0, recs);
        queue.push(items[1], 0.0, recs);
        queue.requeue(items[1], 0.0, recs);
        assert_eq!(queue.pop(0.0, recs), Some(items[0]));
        queue.discard(items[1], recs);
        assert_eq!(queue.pop(0.0, recs), None);
    }

    #[test]
    fn the_guarded_mixture_evicts_first_what_its_leader_lacks() {
        let (mut store, items) = flat(3);
        let mut queue = EvictionQueue::new("guarded", 2).unwrap();
        queue.observe(&[1], true, &mut store);
        queue.observe(&[3], true, &mut store); // the leader (LRU) holds keys 1 and 3
        for &item in &items {
            queue.push(item, 0.0, &mut store);
        }
        assert_eq!(queue.pop(0.0, &mut store), Some(items[1])); // key 2: lacking
        assert_eq!(queue.pop(0.0, &mut store), Some(items[0]));
        assert!(queue.memory_bytes() > 0);
        let parts: usize = queue.memory_parts().iter().map(|(_, b)| b).sum();
        assert_eq!(parts, queue.memory_bytes());
    }
}
