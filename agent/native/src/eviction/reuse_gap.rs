//! Follows `reuse_gap.py`: evict the leaf whose chain is expected back last.
//!
//! A leaf is judged by the single-child chain above it, whose head carries the chain's
//! history (first and last use, reuses). The expected time to the next use is
//! `max(m, k * (age - m))` for a chain with mean gap `m` (the rate term shrunk towards the
//! mean first-reuse gap of all chains), kept in two heaps with static keys. See the Python
//! module for the reasoning; this file reproduces its arithmetic and its dictionaries'
//! order (the chain history is forgotten oldest-last-use first, ties in insertion order).
//!
//! Chain heads are remembered per queued leaf (`_head_of`) beyond the tree's life of the
//! head: each remembered head is held ([`Records::hold`]) so its key and `last_used` stay
//! readable, and let go when the shortcut is dropped.

use rustc_hash::FxHashMap;

use super::float::py_max;
use super::heap::{Entry, LazyHeap, Stamped};
use super::keyed::map_bytes;
use super::ring::{Plain, RingMap};
use super::{Item, Node, Records};

/// `k`: how fast an overdue chain's expected next use recedes.
pub const OVERDUE_WEIGHT: f64 = 3.25;
/// `w`: pseudo-reuses at the mean first-reuse gap added to a chain's own gaps.
pub const PRIOR_WEIGHT: f64 = 2.0;
/// Weight of a new sample in the running mean of first-reuse gaps.
pub const FRESH_WEIGHT: f64 = 0.01;
/// Chain heads remembered beyond the queued blocks before old ones are forgotten.
pub const HISTORY_FLOOR: usize = 65_536;

/// `(term, stamp, sequence, block)`: the stamp sorts before the sequence number. It sorts
/// by the record's Python stamp (`order`, see [`Records::order_stamp`]) and goes stale by
/// the slot's (`stamp`).
#[derive(Debug, Clone, Copy)]
pub struct GapEntry {
    term: f64,
    order: u64,
    seq: u64,
    stamp: u64,
    item: Item,
}

impl Entry for GapEntry {
    #[inline]
    fn less(&self, other: &Self) -> bool {
        if self.term != other.term {
            return self.term < other.term;
        }
        (self.order, self.seq) < (other.order, other.seq)
    }
}

impl Stamped for GapEntry {
    #[inline]
    fn item(&self) -> Item {
        self.item
    }
    #[inline]
    fn stamp(&self) -> u64 {
        self.stamp
    }
}

/// What a chain head's history says (`_Chain`).
#[derive(Debug, Clone, Copy, Default)]
struct Chain {
    first: u64,
    last: u64,
    reuses: u64,
}

/// A node's estimate: mean gap, shrunk mean gap, and the `last_used` they were made at.
#[derive(Debug, Clone, Copy)]
struct Estimate {
    mean: f64,
    rate: f64,
    used: u64,
}

#[derive(Debug, Clone)]
pub struct ReuseGapQueue {
    by_overdue: LazyHeap<GapEntry>,
    by_rate: LazyHeap<GapEntry>,
    live: usize,
    seq: u64,
    estimates: FxHashMap<i64, Estimate>,
    /// Leaf key -> its chain's head (held).
    head_of: FxHashMap<i64, Node>,
    chains: RingMap<Plain<Chain>>,
    now: u64,
    fresh_gap: f64,
    new_heads: u64,
    reused_heads: u64,
    history_floor: usize,
}

impl Default for ReuseGapQueue {
    fn default() -> Self {
        Self::new()
    }
}

impl ReuseGapQueue {
    pub fn new() -> Self {
        Self::with_history_floor(HISTORY_FLOOR)
    }

    /// A queue that forgets chains beyond `history_floor` (tests lower it to reach `_forget`).
    pub fn with_history_floor(history_floor: usize) -> Self {
        ReuseGapQueue {
            by_overdue: LazyHeap::default(),
            by_rate: LazyHeap::default(),
            live: 0,
            seq: 0,
            estimates: FxHashMap::default(),
            head_of: FxHashMap::default(),
            chains: RingMap::default(),
            now: 0,
            fresh_gap: 0.0,
            new_heads: 1,
            reused_heads: 1,
            history_floor,
        }
    }

    pub fn push<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        let node = recs.node(item);
        let used = recs.node_last_used(node);
        if used > self.now {
            self.now = used;
        }
        let key = recs.key(node);
        let (mean, rate) = match self.estimates.get(&key) {
            Some(known) if known.used == used => (known.mean, known.rate),
            _ => {
                let (mean, rate) = self.estimate(node, recs);
                self.estimates.insert(key, Estimate { mean, rate, used });
                (mean, rate)
            }
        };
        let stamp = recs.queue_stamp(item);
        let order = recs.order_stamp(item);
        self.seq += 1;
        let seq = self.seq;
        self.by_overdue.push(GapEntry {
            term: used as f64 + mean,
            order,
            seq,
            stamp,
            item,
        });
        self.by_rate.push(GapEntry {
            term: -rate,
            order,
            seq,
            stamp,
            item,
        });
        self.live += 1;
    }

    pub fn discard<R: Records + ?Sized>(&mut self, item: Item, recs: &mut R) {
        self.live -= 1;
        self.by_overdue.compact(self.live, Some(item), recs);
        self.by_rate.compact(self.live, Some(item), recs);
    }

    /// The item with the latest expected next use: the larger of the two terms' maxima
    /// (the overdue heap wins a tie, as it is looked at first).
    pub fn pop<R: Records + ?Sized>(&mut self, recs: &mut R) -> Option<Item> {
        let now = self.now as f64;
        let mut best: Option<(bool, f64)> = None; // (overdue heap?, value)
        if let Some(top) = self.by_overdue.peek(recs) {
            best = Some((true, OVERDUE_WEIGHT * (now - top.term)));
        }
        if let Some(top) = self.by_rate.peek(recs) {
            let value = -top.term;
            match best {
                Some((_, best_value)) if value > best_value => best = Some((false, value)),
                None => best = Some((false, value)),
                _ => {}
            }
        }
        let (overdue, _) = best?;
        let (heap, other) = if overdue {
            (&mut self.by_overdue, &mut self.by_rate)
        } else {
            (&mut self.by_rate, &mut self.by_overdue)
        };
        let item = heap.pop_top().expect("the live top just peeked").item;
        self.live -= 1;
        // The victim's entry in the other heap is stale now. Python compacts only on
        // discard, so a queue that only pops piles them up; compacting here too changes
        // the memory held, never the order (see heap.rs).
        other.compact(self.live, Some(item), recs);
        let key = recs.key(recs.node(item));
        self.estimates.remove(&key);
        if let Some(head) = self.head_of.remove(&key) {
            recs.unhold(head);
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

    /// The mean reuse gap of `node`'s chain (or the fresh-chain estimate), and the same mean
    /// shrunk towards the mean first-reuse gap for the rate term.
    fn estimate<R: Records + ?Sized>(&mut self, node: Node, recs: &mut R) -> (f64, f64) {
        let head = self.head(node, recs);
        let key = recs.key(head);
        let head_used = recs.node_last_used(head);
        let (count, span) = match self.chains.get_mut(key) {
            None => {
                self.new_heads += 1;
                self.chains.insert(
                    key,
                    Chain {
                        first: head_used,
                        last: head_used,
                        reuses: 0,
                    },
                );
                (0, 0i64)
            }
            Some(chain) => {
                if head_used > chain.last {
                    chain.reuses += 1;
                    if chain.reuses == 1 {
                        // First reuse: a sample of the fresh-chain gap.
                        self.reused_heads += 1;
                        let sample = (head_used - chain.last) as f64;
                        let fresh = self.fresh_gap;
                        self.fresh_gap = if fresh == 0.0 {
                            sample
                        } else {
                            fresh + FRESH_WEIGHT * (sample - fresh)
                        };
                    }
                    chain.last = head_used;
                }
                (chain.reuses, head_used as i64 - chain.first as i64)
            }
        };
        if self.chains.len() > self.history_floor + 4 * self.estimates.len() {
            self.forget(recs);
        }
        let fresh = if self.fresh_gap == 0.0 {
            1.0
        } else {
            self.fresh_gap
        };
        if count == 0 {
            let reuse_share = self.reused_heads as f64 / self.new_heads as f64;
            let unseen = fresh / py_max(reuse_share, 1e-3);
            return (unseen, unseen);
        }
        let span = span as f64;
        let count = count as f64;
        (
            span / count,
            (span + PRIOR_WEIGHT * fresh) / (count + PRIOR_WEIGHT),
        )
    }

    /// The top of the single-child chain `node` hangs from (remembered per queued leaf).
    fn head<R: Records + ?Sized>(&mut self, node: Node, recs: &mut R) -> Node {
        let mut cur = node;
        while let Some(parent) = recs.parent(cur) {
            if recs.parent(parent).is_none() || recs.num_children(parent) != 1 {
                break;
            }
            if let Some(&known) = self.head_of.get(&recs.key(parent)) {
                cur = known;
                break;
            }
            cur = parent;
        }
        recs.hold(cur); // before letting the old one go: it may be the same node
        if let Some(old) = self.head_of.insert(recs.key(node), cur) {
            recs.unhold(old);
        }
        cur
    }

    /// Drop the older half of the chain history (and the chain-head shortcuts of leaves
    /// with no estimate).
    fn forget<R: Records + ?Sized>(&mut self, recs: &mut R) {
        let mut seen: Vec<(u64, i64)> = self.chains.iter().map(|(k, c)| (c.last, k)).collect();
        seen.sort_by_key(|&(last, _)| last); // stable: ties keep the history's order
        for &(_, key) in &seen[..seen.len() / 2] {
            self.chains.remove(key);
        }
        let estimates = &self.estimates;
        self.head_of.retain(|key, head| {
            let keep = estimates.contains_key(key);
            if !keep {
                recs.unhold(*head);
            }
            keep
        });
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.memory_parts().iter().map(|(_, b)| b).sum()
    }

    pub fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        vec![
            (
                "heaps",
                self.by_overdue.memory_bytes() + self.by_rate.memory_bytes(),
            ),
            ("estimates", map_bytes(&self.estimates)),
            ("head_of", map_bytes(&self.head_of)),
            ("chains", self.chains.memory_bytes()),
        ]
    }

    /// Internal figures for the differential tests: `(fresh_gap, new_heads, reused_heads,
    /// chains, estimates, head shortcuts, now)`.
    pub fn state(&self) -> (f64, u64, u64, usize, usize, usize, u64) {
        (
            self.fresh_gap,
            self.new_heads,
            self.reused_heads,
            self.chains.len(),
            self.estimates.len(),
            self.head_of.len(),
            self.now,
        )
    }
}
