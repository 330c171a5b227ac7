//! A record store driven by hand: tree nodes and items (blocks) in slabs, for the
//! differential tests (`EvictionQueueTwin`) and the benches, standing in for the engine.
//!
//! It keeps the contract the engine keeps: an item is discarded before it is freed and its
//! slot then reused with its stamp continuing; a node dropped from the tree while held stays
//! readable (frozen) until let go, and only then is its slot reused.

use super::{Item, Node, Records};

#[derive(Debug, Clone, Copy)]
struct ToyNode {
    key: i64,
    last_used: u64,
    expires_at: Option<f64>,
    parent: u32,
    children: u32,
    holds: u32,
    priority: u8,
    alive: bool,
}

#[derive(Debug, Clone, Copy)]
struct ToyItem {
    stamp: u64,
    node: u32,
    level: i16,
    alive: bool,
}

const NO_PARENT: u32 = u32::MAX;

#[derive(Debug, Clone, Default)]
pub struct ToyStore {
    nodes: Vec<ToyNode>,
    free_nodes: Vec<u32>,
    items: Vec<ToyItem>,
    free_items: Vec<u32>,
    /// Nodes that became or stopped being single-child, once `count_shape` is called
    /// (`Records::shape_version`).
    shape: Option<u64>,
}

impl ToyStore {
    /// Count the tree's shape changes from now on, so orders may remember walks.
    pub fn count_shape(&mut self) {
        self.shape = Some(0);
    }

    /// A node `key` under `parent` (None: a root).
    pub fn add_node(
        &mut self,
        key: i64,
        parent: Option<Node>,
        last_used: u64,
        priority: u8,
        expires_at: Option<f64>,
    ) -> Node {
        let node = ToyNode {
            key,
            last_used,
            expires_at,
            parent: parent.unwrap_or(NO_PARENT),
            children: 0,
            holds: 0,
            priority,
            alive: true,
        };
        if let Some(p) = parent {
            let p = &mut self.nodes[p as usize];
            assert!(p.alive, "the parent of {key} is not in the tree");
            p.children += 1;
            if let (Some(shape), 2) = (&mut self.shape, p.children) {
                *shape += 1;
            }
        }
        match self.free_nodes.pop() {
            Some(at) => {
                self.nodes[at as usize] = node;
                at
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as Node
            }
        }
    }

    /// Drop a leaf from the tree (its slot waits while held).
    pub fn drop_node(&mut self, node: Node) {
        let n = self.nodes[node as usize];
        assert!(
            n.alive && n.children == 0,
            "only a leaf in the tree can be dropped"
        );
        if n.parent != NO_PARENT {
            self.nodes[n.parent as usize].children -= 1;
            if let (Some(shape), 1) = (&mut self.shape, self.nodes[n.parent as usize].children) {
                *shape += 1;
            }
        }
        self.nodes[node as usize].alive = false;
        if n.holds == 0 {
            self.free_nodes.push(node);
        }
    }

    pub fn node_alive(&self, node: Node) -> bool {
        self.nodes.get(node as usize).is_some_and(|n| n.alive)
    }

    pub fn set_last_used(&mut self, node: Node, last_used: u64) {
        self.nodes[node as usize].last_used = last_used;
    }

    pub fn set_priority(&mut self, node: Node, priority: u8, expires_at: Option<f64>) {
        let n = &mut self.nodes[node as usize];
        n.priority = priority;
        n.expires_at = expires_at;
    }

    /// A block attached to `node`.
    pub fn add_item(&mut self, node: Node) -> Item {
        match self.free_items.pop() {
            Some(at) => {
                let slot = &mut self.items[at as usize];
                *slot = ToyItem {
                    stamp: slot.stamp,
                    node,
                    level: -1,
                    alive: true,
                };
                at
            }
            None => {
                self.items.push(ToyItem {
                    stamp: 0,
                    node,
                    level: -1,
                    alive: true,
                });
                (self.items.len() - 1) as Item
            }
        }
    }

    /// Free a block that is not queued.
    pub fn free_item(&mut self, item: Item) {
        let it = &mut self.items[item as usize];
        assert!(
            it.alive && it.level < 0,
            "only an unqueued block can be freed"
        );
        it.alive = false;
        self.free_items.push(item);
    }

    pub fn item_alive(&self, item: Item) -> bool {
        self.items.get(item as usize).is_some_and(|i| i.alive)
    }

    /// Nodes out of the tree but still held.
    pub fn held_dead(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| !n.alive && n.holds > 0)
            .count()
    }

    /// Holds on live nodes and dead ones together.
    pub fn total_holds(&self) -> u64 {
        self.nodes.iter().map(|n| n.holds as u64).sum()
    }
}

impl Records for ToyStore {
    #[inline]
    fn queue_level(&self, item: Item) -> i16 {
        self.items[item as usize].level
    }
    #[inline]
    fn set_queue_level(&mut self, item: Item, level: i16) {
        self.items[item as usize].level = level;
    }
    #[inline]
    fn queue_stamp(&self, item: Item) -> u64 {
        self.items[item as usize].stamp
    }
    #[inline]
    fn bump_stamp(&mut self, item: Item) {
        self.items[item as usize].stamp += 1;
    }
    #[inline]
    fn priority(&self, item: Item) -> u8 {
        self.nodes[self.items[item as usize].node as usize].priority
    }
    #[inline]
    fn expires_at(&self, item: Item) -> Option<f64> {
        self.nodes[self.items[item as usize].node as usize].expires_at
    }
    #[inline]
    fn last_used(&self, item: Item) -> u64 {
        self.nodes[self.items[item as usize].node as usize].last_used
    }
    #[inline]
    fn node(&self, item: Item) -> Node {
        self.items[item as usize].node
    }
    #[inline]
    fn key(&self, node: Node) -> i64 {
        self.nodes[node as usize].key
    }
    #[inline]
    fn node_last_used(&self, node: Node) -> u64 {
        self.nodes[node as usize].last_used
    }
    #[inline]
    fn parent(&self, node: Node) -> Option<Node> {
        let p = self.nodes[node as usize].parent;
        (p != NO_PARENT).then_some(p)
    }
    #[inline]
    fn num_children(&self, node: Node) -> usize {
        self.nodes[node as usize].children as usize
    }
    #[inline]
    fn hold(&mut self, node: Node) {
        self.nodes[node as usize].holds += 1;
    }
    #[inline]
    fn shape_version(&self) -> Option<u64> {
        self.shape
    }
    #[inline]
    fn unhold(&mut self, node: Node) {
        let n = &mut self.nodes[node as usize];
        assert!(n.holds > 0, "unhold without a hold");
        n.holds -= 1;
        if n.holds == 0 && !n.alive {
            self.free_nodes.push(node);
        }
    }
}
