//! Eviction orders: the compiled twin of `kvpool_agent/cache/eviction/`.
//!
//! Every order here reproduces its Python original exactly (same victims in the same order,
//! same float arithmetic), so that the engine's replay figures do not depend on which
//! implementation runs. The Python modules are the specification; each Rust file names the
//! module it follows.
//!
//! # The contract with the engine
//!
//! A queue orders *items*: in the engine an item is a block (one slot of one pool group in
//! one tier, attached to a tree node); in a shadow cache an item is the shadow node itself.
//! The queues never own those records. They read and write them through [`Records`], which
//! the engine (and each shadow cache) implements over its own storage, so the same policy
//! code serves both.
//!
//! Items and nodes are `u32` indices into their owner's slabs. A slab slot is reused once
//! its record is gone, which is safe for the queues because:
//! - an item is always discarded from its queue (or popped) before its owner frees it, and
//!   `queue_stamp` only ever grows in a slot (a reused slot continues from the old stamp), so
//!   a stale heap entry never matches a later record in the same slot;
//! - a node a policy remembers beyond its life (`reuse-gap`'s chain heads) is held with
//!   [`Records::hold`]: its slot keeps the node's key and `last_used` readable, and is not
//!   reused, until the policy lets it go with [`Records::unhold`].
//!
//! Exactness also needs the engine's stamps to be the Python engine's: reuse-gap sorts ties
//! by `(stamp, sequence)`, and a Python `Block` keeps its `queue_stamp` for the life of its
//! pool slot, so an engine item must be that slot, counting from 0 like the `Block` did
//! ([`Records::order_stamp`] is how a shadow, whose Python nodes are new objects, differs).
//!
//! [`EvictionQueue`] is the engine's entry point: one per (tier, pool group), its methods
//! generic over `R: Records + ?Sized` (so `&mut dyn Records` works, and a concrete store is
//! monomorphized). `observe` takes the records too: a change of leader re-buckets queued
//! blocks by their `last_used`.

pub mod arc;
pub mod expert;
pub mod float;
pub mod guarded;
pub mod heap;
pub mod keyed;
pub mod lrfu;
pub mod lru;
#[cfg(test)]
mod membench;
pub mod mixture;
#[cfg(test)]
mod ordered;
pub mod queue;
pub mod registry;
pub mod reuse_gap;
pub mod ring;
pub mod shadow;
pub mod toy;
pub mod vote;

#[cfg(feature = "python")]
pub mod py;

pub use queue::EvictionQueue;

pub type Item = u32;
pub type Node = u32;

/// The reference's priority levels: 0 (evicted first) ..= 100.
pub const MAX_PRIORITY: u8 = 100;
/// The default priority, and the one an expired priority reverts to.
pub const DEFAULT_PRIORITY: u8 = 35;

/// What the eviction orders read and write of the records they order.
pub trait Records {
    /// Priority level the item sits in while queued, -1 while not queued.
    fn queue_level(&self, item: Item) -> i16;
    fn set_queue_level(&mut self, item: Item, level: i16);
    /// Bumped on every enqueue and dequeue; heap entries with an older stamp are stale.
    fn queue_stamp(&self, item: Item) -> u64;
    fn bump_stamp(&mut self, item: Item);
    /// The stamp as the Python record counts it, where an entry sorts by it (reuse-gap's
    /// `(term, stamp, sequence)`): a Python `Block` or shadow node is a new object, counting
    /// from 0, each time a slot is reused, while the slot's `queue_stamp` goes on from the
    /// slot's earlier records (so stale entries never match).
    fn order_stamp(&self, item: Item) -> u64 {
        self.queue_stamp(item)
    }
    /// The item's node's priority and expiry (a shadow node: level 0, never expires).
    fn priority(&self, item: Item) -> u8;
    fn expires_at(&self, item: Item) -> Option<f64>;
    /// The item's node's last-use tick.
    fn last_used(&self, item: Item) -> u64;
    /// The tree node the item hangs from (a shadow node is its own).
    fn node(&self, item: Item) -> Node;
    /// A node's chained key (the Python engine's `TreeNode.key`).
    fn key(&self, node: Node) -> i64;
    fn node_last_used(&self, node: Node) -> u64;
    /// None for a root (a namespace's root in the engine, the shadow's root).
    fn parent(&self, node: Node) -> Option<Node>;
    fn num_children(&self, node: Node) -> usize;
    /// Keep `node` readable (key, `last_used`, frozen at their last values) after the tree
    /// drops it, until a matching `unhold`. Holds nest.
    fn hold(&mut self, node: Node);
    fn unhold(&mut self, node: Node);
    /// A count that changes whenever a node gets its second child or is left with one: the
    /// single-child chains an order walked are still as it found them while it stands (None:
    /// not counted, so nothing may be remembered).
    fn shape_version(&self) -> Option<u64> {
        None
    }
}

/// `effective_priority` of `queue.py`: the priority, or the default once its duration passed.
#[inline]
pub fn effective_priority(priority: u8, expires_at: Option<f64>, now: f64) -> u8 {
    match expires_at {
        Some(at) if now >= at => DEFAULT_PRIORITY,
        _ => priority,
    }
}
