//! The cache engine's bookkeeping, compiled: sequences, radix tree, block pool, tiers and
//! eviction, with no tensors.
//!
//! Twin of the Python engine in `kvpool_agent/cache/` (its `KVCacheManager` and the parts
//! it is made of): the same request-level operations with the same effects, down to the
//! order of victims, the block ids handed out, the counters and the events. What the
//! Python engine does to tensors (offload, onboard, copy-on-partial-reuse) comes back from
//! here as ordered copy instructions ([`CopyOp`]) that the Python side executes on its
//! storage, so this crate never touches KV memory.
//!
//! One `now` is passed to each public operation (the Python façade reads its clock once).
//!
//! Files: `store.rs` (node and block records, token arena), `pool.rs` (free ids and chunks
//! of a tier), `log.rs` (events, counters, ghost list), `requests.rs` (open, append,
//! commit, release, lookup, clear), `tree.rs` (match, store, join, drop, prune), `tiers.rs`
//! (evict, offload, onboard, take-over, partial copy, capacity).

pub mod log;
pub mod pool;
mod requests;
pub mod store;
mod tiers;
mod tree;

#[cfg(feature = "python")]
pub mod py;

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::curves::Curves;
use crate::eviction::EvictionQueue;
use log::{Counters, EventLog, GhostList};
use pool::{TierLayout, TierPool};
use store::{Store, NONE, PRIMARY, SECONDARY};

/// How the engine is laid out and configured (from `sizing.PoolPlan` and `KvCacheConfig`).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub tokens_per_block: usize,
    /// Attention window of each pool group (a full-attention group's is at least the
    /// longest sequence).
    pub windows: Vec<u64>,
    /// The full-attention group, if there is one.
    pub full: Option<usize>,
    pub tiers: [TierLayout; 2],
    /// Usable blocks of each group in each tier with the initial chunks (the eviction
    /// policies' capacities).
    pub group_blocks: [Vec<usize>; 2],
    pub eviction_policy: String,
    pub enable_block_reuse: bool,
    pub enable_partial_reuse: bool,
    pub copy_on_partial_reuse: bool,
    pub secondary_offload_min_priority: u8,
    pub event_buffer_max_size: usize,
}

/// The settings that may change at run time (`core.CoreSettings`).
#[derive(Clone, Debug)]
pub struct Settings {
    pub eviction_policy: String,
    pub enable_block_reuse: bool,
    pub enable_partial_reuse: bool,
    pub copy_on_partial_reuse: bool,
    pub secondary_offload_min_priority: u8,
    pub event_buffer_max_size: usize,
}

/// Copy `src` blocks of group `group` in tier `src_tier` to `dst` of `dst_tier`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub group: usize,
    pub src_tier: u8,
    pub dst_tier: u8,
    pub src: Vec<u32>,
    pub dst: Vec<u32>,
}

/// A request's retention policy (`retention.KvCacheRetentionConfig`).
#[derive(Clone, Debug, Default)]
pub struct Retention {
    /// (token_start, token_end or None: to the end of the prompt, priority, duration_ms)
    pub ranges: Vec<(u64, Option<u64>, u8, Option<u64>)>,
    pub decode_priority: u8,
    pub decode_duration_ms: Option<u64>,
    /// The engine's default policy object itself (the Python engine compares by identity:
    /// only a non-default policy raises priorities on release).
    pub is_default: bool,
}

impl Retention {
    pub fn default_policy() -> Self {
        Retention {
            ranges: Vec::new(),
            decode_priority: crate::eviction::DEFAULT_PRIORITY,
            decode_duration_ms: None,
            is_default: true,
        }
    }

    /// `block_priority`: priority and duration of a block holding tokens `[start, end)`.
    pub fn block_priority(&self, start: u64, end: u64, num_prompt: u64) -> (u8, Option<u64>) {
        if end > num_prompt {
            return (self.decode_priority, self.decode_duration_ms);
        }
        let mut best = (crate::eviction::DEFAULT_PRIORITY, None);
        let mut found = false;
        for &(rs, re, priority, duration) in &self.ranges {
            let rend = re.unwrap_or(num_prompt);
            if rs < end && start < rend && (!found || priority > best.0) {
                best = (priority, duration);
                found = true;
            }
        }
        best
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    UnknownSequence(String),
    RequestTooLarge(String),
    OutOfBlocks(String),
    InvalidTokens(String),
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineError::UnknownSequence(m)
            | EngineError::RequestTooLarge(m)
            | EngineError::OutOfBlocks(m)
            | EngineError::InvalidTokens(m) => f.write_str(m),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// An open sequence.
pub(crate) struct Seq {
    pub namespace: i64,
    pub tokens: Vec<u64>,
    pub num_prompt: usize,
    pub retention: Arc<Retention>,
    /// Tree nodes of the sequence's leading full blocks (matched or stored).
    pub nodes: Vec<u32>,
    /// Per group, the block of each block index (NONE once released from a window).
    pub held: Vec<Vec<u32>>,
    pub committed_blocks: usize,
    pub reused: usize,
    /// Leading full blocks the eviction policy has been told about.
    pub observed: usize,
    pub slide_from: usize,
}

/// What a sequence's handle says (`SequenceHandle`, per group rather than per pool).
pub struct HandleData {
    pub seq_id: u64,
    pub num_tokens: usize,
    pub num_reused_tokens: usize,
    pub tables: Vec<Vec<u32>>,
    /// Each group's first block still held (non-zero once a window slid).
    pub first_block: Vec<usize>,
}

/// Keys sampled for curves fed from Python (`mrc.py`, `miniature.py` objects the agent
/// assigned in place of the engine's own): none collected while a mask is None.
#[derive(Default)]
pub struct Accesses {
    pub mrc_mask: Option<u64>,
    pub mini_mask: Option<u64>,
    /// Accesses the miss-ratio curve's keys were sampled from.
    pub count: u64,
    pub mrc_keys: Vec<i64>,
    /// Each query's sampled keys, root first (empty chains left out).
    pub mini_chains: Vec<Vec<i64>>,
    /// Opens are no policy-curve queries while set (`set_curve_queries`): the data plane's
    /// stores and leases, whose query `query_curves` feeds whole.
    pub muted: bool,
}

pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) tpb: usize,
    pub(crate) num_groups: usize,
    pub(crate) full: Option<usize>,
    pub(crate) store: Store,
    pub(crate) pools: [TierPool; 2],
    pub(crate) max_blocks: Vec<usize>,
    /// queues[tier][group]
    pub(crate) queues: [Vec<EvictionQueue>; 2],
    pub(crate) observers: Vec<(u8, usize)>,
    pub(crate) pinned: [Vec<usize>; 2],
    /// Namespace -> its root node, in the order the roots were made.
    pub(crate) roots: FxHashMap<i64, u32>,
    pub(crate) root_order: Vec<u32>,
    pub(crate) sequences: FxHashMap<u64, Seq>,
    pub(crate) next_seq: u64,
    pub(crate) tick: u64,
    pub stats: Counters,
    pub events: EventLog,
    pub ghost: GhostList,
    pub accesses: Accesses,
    /// The curves the engine feeds itself (`curves/`).
    pub curves: Curves,
    pub(crate) copies: Vec<CopyOp>,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> std::result::Result<Self, String> {
        let num_groups = cfg.windows.len();
        if num_groups == 0 {
            return Err("the engine needs at least one pool group".into());
        }
        let pools = [TierPool::new(&cfg.tiers[0]), TierPool::new(&cfg.tiers[1])];
        let max_blocks = (0..num_groups)
            .map(|g| {
                (0..pools[0].num_chunks)
                    .map(|c| pools[0].ids_in_chunk(g, c).len())
                    .sum()
            })
            .collect();
        let ghost_capacity = cfg.group_blocks[0].iter().sum();
        // A node holds one block of each group in some tier: about as many nodes as the
        // largest group holds blocks over both tiers, and a block record per block of every
        // group (with the initial chunks; the slabs grow if chunks move).
        let held = |g: usize| cfg.group_blocks[0][g] + cfg.group_blocks[1][g];
        let nodes = (0..num_groups).map(held).max().unwrap_or(0) + 1;
        let blocks = (0..num_groups).map(held).sum::<usize>();
        let mut engine = Engine {
            tpb: cfg.tokens_per_block,
            num_groups,
            full: cfg.full,
            store: Store::with_capacity(cfg.tokens_per_block, num_groups, nodes, blocks),
            pools,
            max_blocks,
            queues: [Vec::new(), Vec::new()],
            observers: Vec::new(),
            pinned: [vec![0; num_groups], vec![0; num_groups]],
            roots: FxHashMap::default(),
            root_order: Vec::new(),
            sequences: FxHashMap::default(),
            next_seq: 1,
            tick: 0,
            stats: Counters::default(),
            events: EventLog::new(cfg.event_buffer_max_size),
            ghost: GhostList::new(ghost_capacity),
            accesses: Accesses::default(),
            curves: Curves::default(),
            copies: Vec::new(),
            cfg,
        };
        engine.queues = engine.new_queues(&engine.cfg.eviction_policy.clone())?;
        engine.events.push(log::Event::AllCleared);
        Ok(engine)
    }

    /// One queue per (tier, group), sized for policies that model the tier: the host tier's
    /// queue gets the device and host capacity together.
    fn new_queues(&mut self, policy: &str) -> std::result::Result<[Vec<EvictionQueue>; 2], String> {
        let device = &self.cfg.group_blocks[0];
        let host = &self.cfg.group_blocks[1];
        let mut primary = Vec::with_capacity(self.num_groups);
        let mut secondary = Vec::with_capacity(self.num_groups);
        for g in 0..self.num_groups {
            primary.push(EvictionQueue::new(policy, device[g])?);
            let host_policy = if host[g] > 0 { policy } else { "lru" };
            secondary.push(EvictionQueue::new(host_policy, device[g] + host[g])?);
        }
        self.observers.clear();
        for (tier, queues) in [&primary, &secondary].iter().enumerate() {
            for (g, q) in queues.iter().enumerate() {
                if q.watches_requests() {
                    self.observers.push((tier as u8, g));
                }
            }
        }
        Ok([primary, secondary])
    }

    pub fn tokens_per_block(&self) -> usize {
        self.tpb
    }

    pub fn num_nodes(&self) -> usize {
        self.store.live_nodes - self.roots.len()
    }

    pub fn num_open_sequences(&self) -> usize {
        self.sequences.len()
    }

    pub fn group_capacity(&self) -> &[usize] {
        &self.max_blocks
    }

    /// (capacity, free, pinned, evictable) of each group in each tier.
    pub fn usage(&self) -> Vec<[(usize, usize, usize, usize); 2]> {
        (0..self.num_groups)
            .map(|g| {
                [PRIMARY, SECONDARY].map(|t| {
                    let t = t as usize;
                    let pool = &self.pools[t];
                    (
                        pool.capacity[g],
                        pool.num_free(g),
                        self.pinned[t][g],
                        self.queues[t][g].len(),
                    )
                })
            })
            .collect()
    }

    pub fn handle(&self, seq_id: u64) -> Result<HandleData> {
        let seq = self.seq(seq_id)?;
        let mut tables = Vec::with_capacity(self.num_groups);
        let mut firsts = Vec::with_capacity(self.num_groups);
        for held in &seq.held {
            let first = held.iter().take_while(|&&b| b == NONE).count();
            tables.push(
                held[first..]
                    .iter()
                    .filter(|&&b| b != NONE)
                    .map(|&b| self.store.blocks[b as usize].block_id)
                    .collect(),
            );
            firsts.push(first);
        }
        Ok(HandleData {
            seq_id,
            num_tokens: seq.tokens.len(),
            num_reused_tokens: seq.reused,
            tables,
            first_block: firsts,
        })
    }

    /// New live settings (`CacheCore.configure`): a new eviction policy rebuilds the queues,
    /// a new event bound resizes the event buffer.
    pub fn configure(&mut self, settings: Settings, now: f64) -> std::result::Result<(), String> {
        if settings.eviction_policy != self.cfg.eviction_policy {
            self.switch_policy(&settings.eviction_policy, now)?;
        }
        if settings.event_buffer_max_size != self.cfg.event_buffer_max_size {
            self.events.resize(settings.event_buffer_max_size);
        }
        self.cfg.enable_block_reuse = settings.enable_block_reuse;
        self.cfg.enable_partial_reuse = settings.enable_partial_reuse;
        self.cfg.copy_on_partial_reuse = settings.copy_on_partial_reuse;
        self.cfg.secondary_offload_min_priority = settings.secondary_offload_min_priority;
        self.cfg.event_buffer_max_size = settings.event_buffer_max_size;
        Ok(())
    }

    pub fn take_copies(&mut self) -> Vec<CopyOp> {
        std::mem::take(&mut self.copies)
    }

    /// Every node of the tree, parents before children (`iter_nodes`' order).
    pub fn iter_nodes(&self) -> Vec<u32> {
        let mut stack: Vec<u32> = Vec::new();
        for &root in &self.root_order {
            stack.extend(self.store.children_of(root));
        }
        let mut out = Vec::with_capacity(self.num_nodes());
        while let Some(node) = stack.pop() {
            out.push(node);
            stack.extend(self.store.children_of(node));
        }
        out
    }

    /// Heap bytes of everything the engine keeps per block (records, tokens, queues, the
    /// ghost list, the event buffer), for the memory benchmark.
    pub fn memory_bytes(&self) -> usize {
        self.store.memory_bytes()
            + self.pools.iter().map(|p| p.memory_bytes()).sum::<usize>()
            + self
                .queues
                .iter()
                .flatten()
                .map(|q| q.memory_bytes())
                .sum::<usize>()
            + self.ghost.memory_bytes()
            + self.events.memory_bytes()
            + self.roots.capacity() * 13
            + self.curves.memory_bytes()
    }

    /// `memory_bytes` by part.
    pub fn memory_breakdown(&self) -> Vec<(&'static str, usize)> {
        let mut out = self.store.memory_breakdown();
        out.push(("pools", self.pools.iter().map(|p| p.memory_bytes()).sum()));
        out.push((
            "queues",
            self.queues.iter().flatten().map(|q| q.memory_bytes()).sum(),
        ));
        out.push(("ghost", self.ghost.memory_bytes()));
        out.push(("events", self.events.memory_bytes()));
        out.push(("curves", self.curves.memory_bytes()));
        out
    }

    pub(crate) fn seq(&self, seq_id: u64) -> Result<&Seq> {
        self.sequences.get(&seq_id).ok_or_else(|| not_open(seq_id))
    }

    /// Whether some group releases blocks that leave a sequence's window.
    pub(crate) fn windowed(&self) -> bool {
        self.full.is_none() || self.num_groups > 1
    }

    /// First block index a query at `position` needs in group `g`.
    #[inline]
    pub(crate) fn need_from(&self, g: usize, position: usize) -> usize {
        let window = self.cfg.windows[g];
        (position as u64 + 1).saturating_sub(window) as usize / self.tpb
    }

    /// An access to each node, for the miss-ratio curve: the engine's own is fed here, and
    /// keys are sampled for one fed from Python.
    pub(crate) fn record_accesses(&mut self, nodes: &[u32]) {
        let store = &self.store;
        self.curves
            .access(nodes.iter().map(|&n| store.nodes[n as usize].key));
        let acc = &mut self.accesses;
        let Some(mask) = acc.mrc_mask else {
            return;
        };
        acc.count += nodes.len() as u64;
        for &n in nodes {
            let key = self.store.nodes[n as usize].key;
            if (key as u64) & mask == 0 {
                acc.mrc_keys.push(key);
            }
        }
    }

    /// Whether an open is a policy-curve query: a policy curve is on, and opens are not
    /// muted.
    pub(crate) fn wants_queries(&self) -> bool {
        !self.accesses.muted && self.feeds_queries()
    }

    fn feeds_queries(&self) -> bool {
        self.curves.wants_queries() || self.accesses.mini_mask.is_some()
    }

    /// `query_curves`: a query of the policy curve with every full block of `toks`, with no
    /// open (muted or not): what the data plane's lease asks, for the whole chain it leases
    /// a prefix of.
    pub fn query_curves(&mut self, namespace: i64, toks: &[u64]) {
        if self.cfg.enable_block_reuse && self.feeds_queries() {
            let keys = self.block_keys(namespace, toks, &[]);
            self.record_query(&keys);
        }
    }

    /// One query's block keys, root first, for the policy curve: the engine's own is fed
    /// here, and the sampled ones are kept as one chain for one fed from Python.
    pub(crate) fn record_query(&mut self, keys: &[i64]) {
        self.curves.query(keys);
        if let Some(mask) = self.accesses.mini_mask {
            let chain: Vec<i64> = keys
                .iter()
                .copied()
                .filter(|&key| (key as u64) & mask == 0)
                .collect();
            if !chain.is_empty() {
                self.accesses.mini_chains.push(chain);
            }
        }
    }
}

pub(crate) fn not_open(seq_id: u64) -> EngineError {
    EngineError::UnknownSequence(format!(
        "sequence {seq_id} is not open (unknown or released)"
    ))
}

#[cfg(test)]
mod tests;
