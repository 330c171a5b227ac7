//! The engine's records: tree nodes and blocks in slabs, and the tokens of full blocks.
//!
//! Twin of `kvpool_agent/cache/block.py`. A node is one reusable token block of a prefix; a
//! block is one slot of one pool group in one tier, attached to a node or private to the one
//! sequence that writes it. Both live in slabs indexed by `u32` and are recycled through
//! free lists, so the request path allocates nothing per block once the slabs have grown.
//!
//! A node's tokens are not a field of the node: they sit in one token arena, and the few
//! nodes holding a token past 32 bits keep theirs in a side table. The tree finds children by
//! key and reads the tokens only to confirm a match and to measure a partial one, as the
//! Python engine does with its packed tokens.
//!
//! The arena gives every node a head row of its first [`HEAD_TOKENS`] tokens (all of them
//! when a block is no longer), and a tail row for the rest only when some token there is not
//! 0. The blocks an engine stores by its own keys (the data plane's chains: 16 digest words,
//! then the filler 0, `dataplane/keys.py`) so cost 64 bytes of tokens at any block size,
//! where a row of 512 tokens took 2 KiB; blocks of real tokens keep them all, since a partial
//! match compares them token by token.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;
use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::eviction::keyed::make_room;
use crate::eviction::{Item, Node, Records, DEFAULT_PRIORITY};

pub const NONE: u32 = u32::MAX;
pub const PRIMARY: u8 = 0;
pub const SECONDARY: u8 = 1;

/// One full block of tokens in the radix tree (a namespace root is a node too).
#[derive(Clone, Debug)]
pub struct NodeRec {
    pub key: i64,
    pub parent: u32,
    pub first_child: u32,
    pub last_child: u32,
    pub prev_sibling: u32,
    pub next_sibling: u32,
    pub num_children: u32,
    pub depth: u32,
    pub priority: u8,
    /// Whether the priority expires (then at `Store::expiry[node]`: few nodes have one, so
    /// the time is kept beside the slab, not in every record).
    pub expiring: bool,
    pub stored_at: f64,
    pub last_used: u64,
    /// Requests that reused the block (saturates at `u32::MAX`).
    pub hits: u32,
    /// Children whose full-attention block sits in each tier (the leaf test for eviction).
    pub kids_in_tier: [u32; 2],
    /// Whether some token of the block needs more than 32 bits (then in `Store::wide`).
    pub wide: bool,
    /// Still in the tree (false: a tombstone kept readable for a policy's `hold`).
    pub alive: bool,
    /// Holds by eviction policies (`Records::hold`).
    pub holds: u32,
}

/// One slot of one group in one tier.
#[derive(Clone, Debug)]
pub struct BlockRec {
    pub group: u16,
    pub tier: u8,
    pub block_id: u32,
    pub ref_count: u32,
    pub node: u32,
    pub queue_level: i16,
    /// The slot's queue stamp: it only grows in a slot, across the records that reuse it, and
    /// wraps at 2**32 (why that is safe: `eviction/heap.rs`).
    pub queue_stamp: u32,
    /// `queue_stamp` when this record took the slot: the Python `Block`'s own stamp is
    /// `queue_stamp - stamp_base` (it counts from 0, here modulo 2**32), and reuse-gap sorts
    /// by it (only to break ties: a record requeued over 2**32 times would sort as new).
    pub stamp_base: u32,
    /// Bumped when the record is freed: tells a record from a later one in the same slot.
    pub gen: u32,
}

/// Slabs of nodes and blocks, the token arena and the children index.
pub struct Store {
    pub tpb: usize,
    pub num_groups: usize,
    pub nodes: Vec<NodeRec>,
    free_nodes: Vec<u32>,
    /// `node * num_groups + g` -> the node's block in group `g`, or NONE.
    pub node_blocks: Vec<u32>,
    /// `node * head ..` -> the node's first `head` tokens (nodes whose tokens all fit 32 bits).
    tokens: Vec<u32>,
    /// Tokens in a head row: `min(tpb, HEAD_TOKENS)`.
    head: usize,
    /// `slot * (tpb - head) ..` -> the rest of a node's tokens, where some is not 0.
    tails: Vec<u32>,
    /// Node -> its slot in `tails`, or NONE when the rest is all 0 (empty while `tpb <= head`).
    tail_of: Vec<u32>,
    free_tails: Vec<u32>,
    /// Tokens of the nodes with some token past 32 bits.
    wide: FxHashMap<u32, Box<[u64]>>,
    /// When the priority of an `expiring` node expires.
    expiry: FxHashMap<u32, f64>,
    pub blocks: Vec<BlockRec>,
    free_blocks: Vec<u32>,
    /// (parent node, child key) -> child node.
    children: ChildIndex,
    /// Nodes that became or stopped being single-child so far (`Records::shape_version`).
    shape: u64,
    /// Parents with many children: first token -> how many children start with it (the
    /// partial match skips parents where no child starts with the next token).
    heads: FxHashMap<u32, FxHashMap<u64, u32>>,
    pub live_nodes: usize,
}

/// Children from which a node indexes its children's first tokens (`block.HEADS_FROM`).
pub const HEADS_FROM: u32 = 16;

/// The tokens of a node's head row: an engine key's digest words, after which the data
/// plane's blocks hold only the filler token 0.
pub const HEAD_TOKENS: usize = crate::keys::DIGEST_WORDS;
const _: () = assert!(crate::keys::FILLER_TOKEN == 0);

/// Grow `v` by at least `additional` slots and an eighth of its length, without the
/// doubling of `Vec` (the slabs are reserved at their expected size up front; growing past it
/// should not double the memory of the token arena).
fn grow<T>(v: &mut Vec<T>, additional: usize) {
    if v.capacity() - v.len() < additional {
        v.reserve_exact(additional.max(v.len() / 8));
    }
}

impl Store {
    /// Slabs reserved for `nodes` nodes and `blocks` block records: the blocks of every tier
    /// (each node holds one, but interior nodes of window groups and dropped ones still held
    /// by a policy or a sequence, which are few).
    pub fn with_capacity(tpb: usize, num_groups: usize, nodes: usize, blocks: usize) -> Self {
        let mut store = Store::new(tpb, num_groups);
        store.nodes.reserve_exact(nodes);
        store.node_blocks.reserve_exact(nodes * num_groups);
        store.tokens.reserve_exact(nodes * store.head);
        if tpb > store.head {
            store.tail_of.reserve_exact(nodes);
        }
        store.blocks.reserve_exact(blocks);
        store.children.reserve(nodes);
        store
    }

    pub fn new(tpb: usize, num_groups: usize) -> Self {
        Store {
            tpb,
            num_groups,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            node_blocks: Vec::new(),
            tokens: Vec::new(),
            head: tpb.min(HEAD_TOKENS),
            tails: Vec::new(),
            tail_of: Vec::new(),
            free_tails: Vec::new(),
            wide: FxHashMap::default(),
            expiry: FxHashMap::default(),
            blocks: Vec::new(),
            free_blocks: Vec::new(),
            children: ChildIndex::default(),
            shape: 0,
            heads: FxHashMap::default(),
            live_nodes: 0,
        }
    }

    // ------------------------------------------------------------------ nodes

    /// A new node (not linked under its parent yet: `link_child` does that).
    pub fn new_node(&mut self, key: i64, parent: u32, tokens: &[u64]) -> u32 {
        let depth = if parent == NONE {
            0
        } else {
            self.nodes[parent as usize].depth + 1
        };
        let rec = NodeRec {
            key,
            parent,
            first_child: NONE,
            last_child: NONE,
            prev_sibling: NONE,
            next_sibling: NONE,
            num_children: 0,
            depth,
            priority: DEFAULT_PRIORITY,
            expiring: false,
            stored_at: 0.0,
            last_used: 0,
            hits: 0,
            kids_in_tier: [0, 0],
            wide: false,
            alive: true,
            holds: 0,
        };
        let g = self.num_groups;
        let head = self.head;
        let id = match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = rec;
                id
            }
            None => {
                let id = self.nodes.len() as u32;
                grow(&mut self.nodes, 1);
                grow(&mut self.node_blocks, g);
                grow(&mut self.tokens, head);
                self.nodes.push(rec);
                self.node_blocks.resize(self.node_blocks.len() + g, NONE);
                self.tokens.resize(self.tokens.len() + head, 0);
                if self.tpb > head {
                    grow(&mut self.tail_of, 1);
                    self.tail_of.push(NONE);
                }
                id
            }
        };
        let base = id as usize * g;
        self.node_blocks[base..base + g].fill(NONE);
        if !tokens.is_empty() {
            self.set_tokens(id, tokens);
        }
        self.live_nodes += 1;
        id
    }

    fn set_tokens(&mut self, node: u32, tokens: &[u64]) {
        let (tpb, head) = (self.tpb, self.head);
        debug_assert_eq!(tokens.len(), tpb);
        if tokens.iter().all(|&t| t <= u32::MAX as u64) {
            let row = &mut self.tokens[node as usize * head..(node as usize + 1) * head];
            for (slot, &t) in row.iter_mut().zip(tokens) {
                *slot = t as u32;
            }
            let rest = &tokens[head..];
            if rest.iter().any(|&t| t != 0) {
                let width = tpb - head;
                let slot = match self.free_tails.pop() {
                    Some(slot) => slot,
                    None => {
                        let slot = (self.tails.len() / width) as u32;
                        if self.tails.capacity() == 0 {
                            // The first tail row: blocks of real tokens have one each, so
                            // reserve for every node, as the head rows are.
                            self.tails
                                .reserve_exact(self.tail_of.capacity().max(1) * width);
                        }
                        grow(&mut self.tails, width);
                        self.tails.resize(self.tails.len() + width, 0);
                        slot
                    }
                };
                let row = &mut self.tails[slot as usize * width..(slot as usize + 1) * width];
                for (to, &t) in row.iter_mut().zip(rest) {
                    *to = t as u32;
                }
                self.tail_of[node as usize] = slot;
            }
        } else {
            self.nodes[node as usize].wide = true;
            self.wide.insert(node, tokens.into());
        }
    }

    /// Tail rows in use (tests).
    #[cfg(test)]
    pub fn tail_rows(&self) -> usize {
        match self.tpb - self.head {
            0 => 0,
            width => self.tails.len() / width - self.free_tails.len(),
        }
    }

    /// The node's tokens (a root has none).
    pub fn node_tokens(&self, node: u32) -> TokensOf<'_> {
        let rec = &self.nodes[node as usize];
        if rec.parent == NONE {
            return TokensOf::Narrow(&[], Tail::Zeros(0));
        }
        if rec.wide {
            return TokensOf::Wide(&self.wide[&node]);
        }
        let (tpb, head) = (self.tpb, self.head);
        let tail = match self.tail_of.get(node as usize) {
            Some(&slot) if slot != NONE => {
                let width = tpb - head;
                Tail::Tokens(&self.tails[slot as usize * width..(slot as usize + 1) * width])
            }
            _ => Tail::Zeros(tpb - head),
        };
        TokensOf::Narrow(
            &self.tokens[node as usize * head..(node as usize + 1) * head],
            tail,
        )
    }

    /// Whether the node holds exactly `tokens` (the packed compare of `packed.confirmed`).
    pub fn tokens_equal(&self, node: u32, tokens: &[u64]) -> bool {
        match self.node_tokens(node) {
            TokensOf::Narrow(own, tail) => {
                let n = own.len();
                tokens.len() == n + tail.len()
                    && own.iter().zip(tokens).all(|(&a, &b)| a as u64 == b)
                    && match tail {
                        Tail::Tokens(rest) => {
                            rest.iter().zip(&tokens[n..]).all(|(&a, &b)| a as u64 == b)
                        }
                        Tail::Zeros(_) => tokens[n..].iter().all(|&b| b == 0),
                    }
            }
            TokensOf::Wide(own) => own == tokens,
        }
    }

    /// How many leading tokens of `rest` the node's block starts with.
    pub fn shared_prefix(&self, node: u32, rest: &[u64]) -> usize {
        self.node_tokens(node)
            .iter()
            .zip(rest)
            .take_while(|&(a, &b)| a == b)
            .count()
    }

    pub fn first_token(&self, node: u32) -> u64 {
        match self.node_tokens(node) {
            TokensOf::Narrow(own, _) => own[0] as u64,
            TokensOf::Wide(own) => own[0],
        }
    }

    /// Link `child` as the last child of its parent (insertion order, as a dict keeps it).
    pub fn link_child(&mut self, parent: u32, child: u32) {
        let key = self.nodes[child as usize].key;
        self.children.insert(parent, key, child, &self.nodes);
        let last = self.nodes[parent as usize].last_child;
        self.nodes[child as usize].prev_sibling = last;
        self.nodes[child as usize].next_sibling = NONE;
        if last == NONE {
            self.nodes[parent as usize].first_child = child;
        } else {
            self.nodes[last as usize].next_sibling = child;
        }
        let p = &mut self.nodes[parent as usize];
        p.last_child = child;
        p.num_children += 1;
        if p.num_children == 2 {
            self.shape += 1;
        }
        // `head_added`: kept from HEADS_FROM children on.
        if self.heads.contains_key(&parent) {
            let first = self.first_token(child);
            *self
                .heads
                .get_mut(&parent)
                .unwrap()
                .entry(first)
                .or_insert(0) += 1;
        } else if self.nodes[parent as usize].num_children >= HEADS_FROM {
            let mut heads: FxHashMap<u64, u32> = FxHashMap::default();
            let mut c = self.nodes[parent as usize].first_child;
            while c != NONE {
                *heads.entry(self.first_token(c)).or_insert(0) += 1;
                c = self.nodes[c as usize].next_sibling;
            }
            self.heads.insert(parent, heads);
        }
    }

    /// Unlink `child` from its parent's children.
    pub fn unlink_child(&mut self, parent: u32, child: u32) {
        let key = self.nodes[child as usize].key;
        self.children.remove(parent, key, &self.nodes);
        let (prev, next) = {
            let c = &self.nodes[child as usize];
            (c.prev_sibling, c.next_sibling)
        };
        if prev == NONE {
            self.nodes[parent as usize].first_child = next;
        } else {
            self.nodes[prev as usize].next_sibling = next;
        }
        if next == NONE {
            self.nodes[parent as usize].last_child = prev;
        } else {
            self.nodes[next as usize].prev_sibling = prev;
        }
        self.nodes[parent as usize].num_children -= 1;
        if self.nodes[parent as usize].num_children == 1 {
            self.shape += 1;
        }
        if self.heads.contains_key(&parent) {
            let first = self.first_token(child);
            let heads = self.heads.get_mut(&parent).unwrap();
            let left = heads[&first] - 1;
            if left == 0 {
                heads.remove(&first);
            } else {
                heads.insert(first, left);
            }
        }
    }

    pub fn child(&self, parent: u32, key: i64) -> u32 {
        self.children.get(parent, key, &self.nodes)
    }

    /// Whether some child's tokens may start with `token` (`TreeNode.may_extend`).
    pub fn may_extend(&self, node: u32, token: u64) -> bool {
        match self.heads.get(&node) {
            Some(heads) => heads.contains_key(&token),
            None => self.nodes[node as usize].num_children > 0,
        }
    }

    /// The children of `node`, oldest first.
    pub fn children_of(&self, node: u32) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.nodes[node as usize].num_children as usize);
        let mut c = self.nodes[node as usize].first_child;
        while c != NONE {
            out.push(c);
            c = self.nodes[c as usize].next_sibling;
        }
        out
    }

    /// The node left the tree: free its slot, or keep it as a tombstone while held.
    pub fn free_node(&mut self, node: u32) {
        let rec = &mut self.nodes[node as usize];
        debug_assert!(rec.alive);
        rec.alive = false;
        self.live_nodes -= 1;
        self.heads.remove(&node);
        if rec.holds == 0 {
            self.recycle_node(node);
        }
    }

    fn recycle_node(&mut self, node: u32) {
        if self.nodes[node as usize].wide {
            self.wide.remove(&node);
            self.nodes[node as usize].wide = false;
        }
        if let Some(slot) = self.tail_of.get_mut(node as usize) {
            if *slot != NONE {
                self.free_tails.push(*slot);
                *slot = NONE;
            }
        }
        self.set_expires_at(node, None);
        self.free_nodes.push(node);
    }

    /// When the node's priority expires (None: it does not).
    #[inline]
    pub fn expires_at(&self, node: u32) -> Option<f64> {
        if self.nodes[node as usize].expiring {
            Some(self.expiry[&node])
        } else {
            None
        }
    }

    pub fn set_expires_at(&mut self, node: u32, at: Option<f64>) {
        let rec = &mut self.nodes[node as usize];
        match at {
            Some(at) => {
                rec.expiring = true;
                self.expiry.insert(node, at);
            }
            None if rec.expiring => {
                rec.expiring = false;
                self.expiry.remove(&node);
            }
            None => {}
        }
    }

    #[inline]
    pub fn block_of(&self, node: u32, g: usize) -> u32 {
        self.node_blocks[node as usize * self.num_groups + g]
    }

    #[inline]
    pub fn set_block_of(&mut self, node: u32, g: usize, block: u32) {
        self.node_blocks[node as usize * self.num_groups + g] = block;
    }

    // ------------------------------------------------------------------ blocks

    pub fn new_block(&mut self, group: usize, tier: u8, block_id: u32) -> u32 {
        match self.free_blocks.pop() {
            Some(b) => {
                let rec = &mut self.blocks[b as usize];
                rec.group = group as u16;
                rec.tier = tier;
                rec.block_id = block_id;
                rec.ref_count = 0;
                rec.node = NONE;
                rec.queue_level = -1;
                rec.stamp_base = rec.queue_stamp;
                b
            }
            None => {
                grow(&mut self.blocks, 1);
                self.blocks.push(BlockRec {
                    group: group as u16,
                    tier,
                    block_id,
                    ref_count: 0,
                    node: NONE,
                    queue_level: -1,
                    queue_stamp: 0,
                    stamp_base: 0,
                    gen: 0,
                });
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// The block record is gone (no node, no reference): its slot can be reused.
    pub fn free_block(&mut self, b: u32) {
        debug_assert!(self.blocks[b as usize].queue_level < 0);
        let rec = &mut self.blocks[b as usize];
        rec.node = NONE;
        rec.gen = rec.gen.wrapping_add(1);
        self.free_blocks.push(b);
    }

    /// `memory_bytes` by table.
    pub fn memory_breakdown(&self) -> Vec<(&'static str, usize)> {
        use std::mem::size_of;
        vec![
            ("nodes", self.nodes.capacity() * size_of::<NodeRec>()),
            ("node_blocks", self.node_blocks.capacity() * 4),
            (
                "tokens",
                (self.tokens.capacity()
                    + self.tails.capacity()
                    + self.tail_of.capacity()
                    + self.free_tails.capacity())
                    * 4,
            ),
            ("blocks", self.blocks.capacity() * size_of::<BlockRec>()),
            ("children", self.children.table.allocation_size()),
        ]
    }

    /// Heap bytes the records take (capacity of every table), for the memory benchmark.
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let map_entry = |k: usize, v: usize| k + v + 1; // hashbrown: one control byte a slot
        self.nodes.capacity() * size_of::<NodeRec>()
            + self.free_nodes.capacity() * 4
            + self.node_blocks.capacity() * 4
            + self.tokens.capacity() * 4
            + self.tails.capacity() * 4
            + self.tail_of.capacity() * 4
            + self.free_tails.capacity() * 4
            + self.wide.capacity() * map_entry(4, 16)
            + self.wide.values().map(|v| v.len() * 8).sum::<usize>()
            + self.expiry.capacity() * map_entry(4, 8)
            + self.blocks.capacity() * size_of::<BlockRec>()
            + self.free_blocks.capacity() * 4
            + self.children.table.allocation_size()
            + self.heads.capacity() * map_entry(4, 32)
            + self
                .heads
                .values()
                .map(|h| h.capacity() * map_entry(8, 4))
                .sum::<usize>()
    }
}

/// (parent node, key) -> child node, storing only the child's id: the key and the parent
/// are read back from the node slab, so each entry is 4 bytes instead of a 24-byte pair.
#[derive(Default)]
struct ChildIndex {
    table: HashTable<u32>,
    /// What the table holds with no tombstones ([`make_room`]): nodes come and go at a steady
    /// count, and hashbrown alone would double the table for its tombstones.
    room: usize,
}

#[inline]
fn child_hash(parent: u32, key: i64) -> u64 {
    let mut h = FxBuildHasher.build_hasher();
    h.write_i64(key);
    h.write_u32(parent);
    h.finish()
}

impl ChildIndex {
    fn reserve(&mut self, nodes: usize) {
        self.table.reserve(nodes, |_| 0);
        self.room = self.table.capacity();
    }

    #[inline]
    fn get(&self, parent: u32, key: i64, nodes: &[NodeRec]) -> u32 {
        let found = self.table.find(child_hash(parent, key), |&c| {
            let n = &nodes[c as usize];
            n.key == key && n.parent == parent
        });
        found.copied().unwrap_or(NONE)
    }

    fn insert(&mut self, parent: u32, key: i64, child: u32, nodes: &[NodeRec]) {
        let rehash = |&c: &u32| {
            let n = &nodes[c as usize];
            child_hash(n.parent, n.key)
        };
        make_room(&mut self.table, &mut self.room, rehash);
        self.table
            .insert_unique(child_hash(parent, key), child, rehash);
    }

    fn remove(&mut self, parent: u32, key: i64, nodes: &[NodeRec]) {
        let found = self.table.find_entry(child_hash(parent, key), |&c| {
            let n = &nodes[c as usize];
            n.key == key && n.parent == parent
        });
        if let Ok(entry) = found {
            entry.remove();
        }
    }
}

/// A node's tokens as stored: a head row and the rest, or (some token past 32 bits) all
/// of them in the side table.
pub enum TokensOf<'a> {
    Narrow(&'a [u32], Tail<'a>),
    Wide(&'a [u64]),
}

/// The tokens of a node after its head row.
#[derive(Clone, Copy)]
pub enum Tail<'a> {
    Tokens(&'a [u32]),
    /// This many tokens, all 0 (no tail row kept).
    Zeros(usize),
}

impl Tail<'_> {
    fn len(&self) -> usize {
        match self {
            Tail::Tokens(t) => t.len(),
            Tail::Zeros(n) => *n,
        }
    }
}

impl TokensOf<'_> {
    /// The tokens, first to last.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        let (narrow, tail, zeros, wide): (&[u32], &[u32], usize, &[u64]) = match *self {
            TokensOf::Narrow(own, Tail::Tokens(rest)) => (own, rest, 0, &[]),
            TokensOf::Narrow(own, Tail::Zeros(n)) => (own, &[], n, &[]),
            TokensOf::Wide(own) => (&[], &[], 0, own),
        };
        narrow
            .iter()
            .chain(tail)
            .map(|&t| t as u64)
            .chain(std::iter::repeat_n(0, zeros))
            .chain(wide.iter().copied())
    }

    pub fn to_vec(&self) -> Vec<u64> {
        self.iter().collect()
    }
}

impl Records for Store {
    #[inline]
    fn queue_level(&self, item: Item) -> i16 {
        self.blocks[item as usize].queue_level
    }
    #[inline]
    fn set_queue_level(&mut self, item: Item, level: i16) {
        self.blocks[item as usize].queue_level = level;
    }
    #[inline]
    fn queue_stamp(&self, item: Item) -> u64 {
        self.blocks[item as usize].queue_stamp as u64
    }
    #[inline]
    fn bump_stamp(&mut self, item: Item) {
        let rec = &mut self.blocks[item as usize];
        rec.queue_stamp = rec.queue_stamp.wrapping_add(1);
    }
    #[inline]
    fn order_stamp(&self, item: Item) -> u64 {
        let rec = &self.blocks[item as usize];
        rec.queue_stamp.wrapping_sub(rec.stamp_base) as u64
    }
    #[inline]
    fn priority(&self, item: Item) -> u8 {
        match self.blocks[item as usize].node {
            NONE => DEFAULT_PRIORITY,
            n => self.nodes[n as usize].priority,
        }
    }
    #[inline]
    fn expires_at(&self, item: Item) -> Option<f64> {
        match self.blocks[item as usize].node {
            NONE => None,
            n => self.expires_at(n),
        }
    }
    #[inline]
    fn last_used(&self, item: Item) -> u64 {
        match self.blocks[item as usize].node {
            NONE => 0,
            n => self.nodes[n as usize].last_used,
        }
    }
    #[inline]
    fn node(&self, item: Item) -> Node {
        self.blocks[item as usize].node
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
        match self.nodes[node as usize].parent {
            NONE => None,
            p => Some(p),
        }
    }
    #[inline]
    fn num_children(&self, node: Node) -> usize {
        self.nodes[node as usize].num_children as usize
    }
    fn hold(&mut self, node: Node) {
        self.nodes[node as usize].holds += 1;
    }
    #[inline]
    fn shape_version(&self) -> Option<u64> {
        Some(self.shape)
    }
    fn unhold(&mut self, node: Node) {
        let rec = &mut self.nodes[node as usize];
        rec.holds -= 1;
        if rec.holds == 0 && !rec.alive {
            self.recycle_node(node);
        }
    }
}
