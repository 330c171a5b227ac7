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
//!
//! One thing Python does not do: a walk to a chain's head is handed from a block that leaves
//! the queue to its parent (`heir`, `head`), while nothing it read has changed. Python
//! walks again, up the whole chain for each block of it, so evicting a chain of n blocks
//! took n^2/2 steps (a third of the default policy's time with 256-block sequences); both
//! find the same heads (the differential tests and `tests` below compare them).

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

/// A queued leaf's chain head (`_head_of`), with what its walk needs to be reused: `steps`
/// plain steps up (no shortcut taken on them), the tree's shape and the queue's shortcut
/// epoch when it was made (`UNTRACKED`: records that do not count their shape).
#[derive(Debug, Clone, Copy)]
struct HeadOf {
    head: Node,
    steps: u32,
    shape: u64,
    epoch: u64,
}

const UNTRACKED: u64 = u64::MAX;

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
    head_of: FxHashMap<i64, HeadOf>,
    chains: RingMap<Plain<Chain>>,
    now: u64,
    fresh_gap: f64,
    new_heads: u64,
    reused_heads: u64,
    history_floor: usize,
    /// Changes of the shortcuts a walk may take (`head_of` entries of nodes with children,
    /// and forgetting): a remembered walk is reused only within the epoch it was made in.
    epoch: u64,
    /// The head of the block that left the queue last, for its parent (by key) if the
    /// parent is pushed next; it holds its head.
    inherited: Option<(i64, HeadOf)>,
    /// Steps taken up chains so far (what remembering walks saves).
    walk_steps: u64,
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
            epoch: 0,
            inherited: None,
            walk_steps: 0,
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
        // Another order's victim (a mixture's leader evicts it) leaves its parent as a pop
        // does; its own entry stays, as on every discard.
        self.drop_inherited(recs);
        let node = recs.node(item);
        if let Some(&entry) = self.head_of.get(&recs.key(node)) {
            if let Some(heir) = self.heir(node, entry, recs) {
                recs.hold(entry.head); // the entry keeps its own
                self.inherited = Some(heir);
            }
        }
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
        let victim = recs.node(item);
        let key = recs.key(victim);
        self.estimates.remove(&key);
        self.drop_inherited(recs);
        if let Some(entry) = self.head_of.remove(&key) {
            if recs.num_children(victim) > 0 {
                self.epoch += 1; // a shortcut on the walks from below it is gone
            }
            match self.heir(victim, entry, recs) {
                Some(heir) => self.inherited = Some(heir), // with the entry's hold
                None => recs.unhold(entry.head),
            }
        }
        Some(item)
    }

    /// What `node`'s parent inherits when `node` (with chain head `entry`) leaves the
    /// queue. The parent, whose only child it was, may turn leaf and be pushed next, and its
    /// walk is `node`'s without the first step, to the same head, while nothing a walk reads
    /// has changed since `node`'s walk: no node became or stopped being single-child (the
    /// records' shape version) and no shortcut came or went (the epoch). [`Self::head`] takes
    /// it then (checking that the parent is a leaf). Evicting a chain leaf by leaf walks it
    /// once, not once per block.
    fn heir<R: Records + ?Sized>(
        &self,
        node: Node,
        entry: HeadOf,
        recs: &R,
    ) -> Option<(i64, HeadOf)> {
        let parent = recs.parent(node)?;
        let unchanged = entry.epoch == self.epoch && recs.shape_version() == Some(entry.shape);
        (entry.steps > 0 && unchanged).then(|| {
            let steps = entry.steps - 1;
            (recs.key(parent), HeadOf { steps, ..entry })
        })
    }

    /// Let go of a walk no parent took.
    fn drop_inherited<R: Records + ?Sized>(&mut self, recs: &mut R) {
        if let Some((_, stale)) = self.inherited.take() {
            recs.unhold(stale.head);
        }
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
        let key = recs.key(node);
        let shape = recs.shape_version().unwrap_or(UNTRACKED);
        let mut entry = None;
        if let Some((heir, walk)) = self.inherited.take() {
            // The child's walk, still true (`heir`) if nothing changed since it left.
            if heir == key
                && walk.shape == shape
                && walk.epoch == self.epoch
                && recs.num_children(node) == 0
            {
                entry = Some(walk); // with the child's hold
            } else {
                recs.unhold(walk.head);
            }
        }
        let entry = entry.unwrap_or_else(|| {
            let mut cur = node;
            let mut steps = 0u32;
            while let Some(parent) = recs.parent(cur) {
                if recs.parent(parent).is_none() || recs.num_children(parent) != 1 {
                    break;
                }
                if let Some(known) = self.head_of.get(&recs.key(parent)) {
                    cur = known.head;
                    break;
                }
                cur = parent;
                steps += 1;
            }
            self.walk_steps += u64::from(steps);
            recs.hold(cur); // before letting the old one go: it may be the same node
            HeadOf {
                head: cur,
                steps,
                shape,
                epoch: self.epoch,
            }
        });
        if recs.num_children(node) > 0 {
            // Its entry is a shortcut for the walks from below it (a block evictable with
            // children: a window's, or a primary one whose children are all offloaded).
            self.epoch += 1;
        }
        let entry = HeadOf {
            epoch: self.epoch,
            ..entry
        };
        if let Some(old) = self.head_of.insert(key, entry) {
            recs.unhold(old.head);
        }
        entry.head
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
        self.head_of.retain(|key, entry| {
            let keep = estimates.contains_key(key);
            if !keep {
                recs.unhold(entry.head);
            }
            keep
        });
        self.epoch += 1; // the shortcuts dropped may have been on remembered walks
    }

    /// Steps taken up chains to find their heads so far.
    pub fn walk_steps(&self) -> u64 {
        self.walk_steps
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::toy::ToyStore;

    // What the level queue (queue.rs) does around an order's push, discard and pop.
    fn push(q: &mut ReuseGapQueue, item: Item, store: &mut ToyStore) {
        store.bump_stamp(item);
        store.set_queue_level(item, 0);
        q.push(item, store);
    }

    fn discard(q: &mut ReuseGapQueue, item: Item, store: &mut ToyStore) {
        q.discard(item, store);
        store.set_queue_level(item, -1);
        store.bump_stamp(item);
    }

    fn pop(q: &mut ReuseGapQueue, store: &mut ToyStore) -> Option<Item> {
        let item = q.pop(store)?;
        store.set_queue_level(item, -1);
        store.bump_stamp(item);
        Some(item)
    }

    /// A script of tree changes and evictions on a toy tree: chains added under random
    /// nodes, pushed at once or later (as a sequence's blocks are when it is released, the
    /// tree changing meanwhile with no operation on the queue), leaves touched, and bursts
    /// of evictions (a parent left without children is pushed, as the engine does). Returns
    /// the keys in the order they were evicted and the queue's walk steps; `count_shape`
    /// lets the queue remember walks.
    fn play(count_shape: bool, ops: usize) -> (Vec<i64>, u64) {
        let mut store = ToyStore::default();
        if count_shape {
            store.count_shape();
        }
        let root = store.add_node(0, None, 0, 35, None);
        let mut q = ReuseGapQueue::new();
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        let (mut tick, mut key) = (0u64, 0i64);
        let mut live: Vec<Node> = vec![root];
        let mut item_of: Vec<Option<Item>> = vec![None];
        let mut queued: Vec<bool> = vec![false];
        let mut pending: Vec<Node> = Vec::new();
        let mut evicted = Vec::new();
        for _ in 0..ops {
            match next(5) {
                0 | 3 => {
                    // A chain of 1 to 64 blocks under a live node (a leaf no more).
                    let mut at = live[next(live.len())];
                    if queued[at as usize] {
                        discard(&mut q, item_of[at as usize].unwrap(), &mut store);
                        queued[at as usize] = false;
                    }
                    for _ in 0..=next(64) {
                        tick += 1;
                        key += 1;
                        let node = store.add_node(key, Some(at), tick, 35, None);
                        let item = store.add_item(node);
                        let slot = node as usize;
                        if item_of.len() <= slot {
                            item_of.resize(slot + 1, None);
                            queued.resize(slot + 1, false);
                        }
                        item_of[slot] = Some(item);
                        live.push(node);
                        at = node;
                    }
                    pending.push(at);
                }
                1 => {
                    // A queued leaf used again.
                    let leaves: Vec<Node> = live
                        .iter()
                        .copied()
                        .filter(|&n| queued[n as usize])
                        .collect();
                    if let Some(&leaf) = leaves.get(next(leaves.len().max(1))) {
                        let item = item_of[leaf as usize].unwrap();
                        discard(&mut q, item, &mut store);
                        tick += 1;
                        store.set_last_used(leaf, tick);
                        push(&mut q, item, &mut store);
                    }
                }
                2 => {
                    for _ in 0..=next(64) {
                        let Some(item) = pop(&mut q, &mut store) else {
                            break;
                        };
                        let node = store.node(item);
                        let parent = store.parent(node).unwrap();
                        evicted.push(store.key(node));
                        queued[node as usize] = false;
                        item_of[node as usize] = None;
                        live.retain(|&n| n != node);
                        store.free_item(item);
                        store.drop_node(node);
                        if parent != root && store.num_children(parent) == 0 {
                            push(&mut q, item_of[parent as usize].unwrap(), &mut store);
                            queued[parent as usize] = true;
                        }
                    }
                }
                _ => {
                    // The chains added since the last release become evictable.
                    for leaf in pending.drain(..) {
                        if store.num_children(leaf) == 0 && !queued[leaf as usize] {
                            push(&mut q, item_of[leaf as usize].unwrap(), &mut store);
                            queued[leaf as usize] = true;
                        }
                    }
                }
            }
        }
        while let Some(item) = pop(&mut q, &mut store) {
            evicted.push(store.key(store.node(item)));
        }
        (evicted, q.walk_steps())
    }

    #[test]
    fn remembered_walks_change_no_eviction_and_save_most_steps() {
        let (order, steps) = play(true, 3_000);
        let (plain_order, plain_steps) = play(false, 3_000);
        assert!(
            order.len() > 10_000,
            "a script that evicts: {}",
            order.len()
        );
        assert_eq!(order, plain_order);
        assert!(
            steps * 2 < plain_steps,
            "{steps} steps with remembered walks, {plain_steps} without"
        );
    }

    #[test]
    fn a_chain_evicted_leaf_by_leaf_is_walked_once() {
        for count_shape in [true, false] {
            let mut store = ToyStore::default();
            if count_shape {
                store.count_shape();
            }
            let root = store.add_node(0, None, 0, 35, None);
            let mut at = root;
            let mut items = Vec::new();
            for key in 1..=256 {
                at = store.add_node(key, Some(at), key as u64, 35, None);
                items.push(store.add_item(at));
            }
            let mut q = ReuseGapQueue::new();
            push(&mut q, *items.last().unwrap(), &mut store);
            let mut evicted = 0;
            while let Some(item) = pop(&mut q, &mut store) {
                let node = store.node(item);
                let parent = store.parent(node).unwrap();
                store.free_item(item);
                store.drop_node(node);
                evicted += 1;
                if parent != root {
                    push(&mut q, items[store.key(parent) as usize - 1], &mut store);
                }
            }
            assert_eq!(evicted, 256);
            let expected = if count_shape { 255 } else { 255 * 256 / 2 };
            assert_eq!(q.walk_steps(), expected, "count_shape {count_shape}");
        }
    }

    #[test]
    fn a_walk_is_not_reused_once_the_tree_changed_under_it() {
        // A chain of 10, its leaf queued; a branch grows under the 5th block while nothing
        // happens to the queue (a sequence being written); the leaf goes. Its parent's chain
        // now starts at the 6th block: a new chain, as a walk from scratch finds.
        let states: Vec<_> = [true, false]
            .into_iter()
            .map(|count_shape| {
                let mut store = ToyStore::default();
                if count_shape {
                    store.count_shape();
                }
                let root = store.add_node(0, None, 0, 35, None);
                let mut chain = Vec::new();
                let mut at = root;
                for key in 1..=10 {
                    at = store.add_node(key, Some(at), key as u64, 35, None);
                    chain.push((at, store.add_item(at)));
                }
                let mut q = ReuseGapQueue::new();
                push(&mut q, chain[9].1, &mut store);
                store.add_node(11, Some(chain[4].0), 11, 35, None);
                let victim = pop(&mut q, &mut store).unwrap();
                assert_eq!(victim, chain[9].1);
                store.free_item(victim);
                store.drop_node(chain[9].0);
                push(&mut q, chain[8].1, &mut store);
                let (_, new_heads, _, chains, ..) = q.state();
                (new_heads, chains)
            })
            .collect();
        assert_eq!(states[0], states[1]);
        assert_eq!(
            states[0],
            (3, 2),
            "(new heads, chains): the 1st block's and the 6th's"
        );
    }
}
