//! Follows `kvpool_agent/server/events.py`: the engine's events as vLLM's wire events, and a
//! batch of them as the msgpack bytes the agent publishes.
//!
//! The Python `WireEncoder` turns each engine event into dicts and msgpack packs them; with
//! hundreds of events per stored chain that was most of a data-plane PUT's time in the agent.
//! This encoder keeps the same state (each live block's wire name, parent, tokens and medium;
//! engine-key names waiting for their block's BlockStored; removals by reason) and writes the
//! bytes `encode_batch` writes, byte for byte, straight from the engine's event records.

pub mod msgpack;

use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::HashTable;
use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use crate::engine::log::{Event, Reason};
use msgpack::Writer;

/// `MAX_PENDING_NAMES`: names waiting for their block's BlockStored; beyond it the oldest go.
pub const MAX_PENDING_NAMES: usize = 100_000;

/// A block hash on the wire: an engine key (i64) or an engine-key name (u64), as Python ints.
pub type Wire = i128;

/// `_Known`: what a later event of a live block needs (24 bytes). Not its tokens: a tier
/// move carries them. Keeping every live block's tokens here took more memory than the
/// engine's own records of the block (256 B a block of 16 tokens, 4 KiB one of 512).
#[derive(Debug, Clone, Copy)]
struct Known {
    /// The 64 bits of the wire hash (see [`split`]).
    wire: u64,
    parent: u64,
    /// [`WIRE_SIGNED`], [`HAS_PARENT`], [`PARENT_SIGNED`].
    flags: u8,
    /// Index into `WireEncoder::mediums`.
    medium: u8,
}

/// `Known::wire` is negative: its bits are an i64's.
const WIRE_SIGNED: u8 = 1;
const HAS_PARENT: u8 = 2;
/// `Known::parent` is negative.
const PARENT_SIGNED: u8 = 4;

/// A wire hash, in `[-2**63, 2**64)` (an engine key, an i64, or a name, a u64), as 64 bits
/// and whether it is negative (then the bits are an i64's); [`join`] is the inverse.
fn split(wire: Wire) -> (u64, bool) {
    if wire < 0 {
        (wire as i64 as u64, true)
    } else {
        (wire as u64, false)
    }
}

fn join(bits: u64, signed: bool) -> Wire {
    if signed {
        bits as i64 as Wire
    } else {
        bits as Wire
    }
}

impl Known {
    fn new(wire: Wire, parent: Option<Wire>, medium: u8) -> Self {
        let (wire, signed) = split(wire);
        let mut flags = if signed { WIRE_SIGNED } else { 0 };
        let parent = match parent {
            Some(p) => {
                let (bits, signed) = split(p);
                flags |= HAS_PARENT | if signed { PARENT_SIGNED } else { 0 };
                bits
            }
            None => 0,
        };
        Known {
            wire,
            parent,
            flags,
            medium,
        }
    }

    fn wire(&self) -> Wire {
        join(self.wire, self.flags & WIRE_SIGNED != 0)
    }

    fn parent(&self) -> Option<Wire> {
        (self.flags & HAS_PARENT != 0).then(|| join(self.parent, self.flags & PARENT_SIGNED != 0))
    }
}

/// Engine-key names by their block's tokens, oldest first (`dict` insertion order: a name
/// given again for the same tokens keeps its place; a taken one leaves a stale entry in
/// `order`, skipped when the oldest goes). A name costs one allocation (its tokens): the
/// order keeps the entry's hash and number, by which it finds the entry again.
#[derive(Debug, Default)]
struct Names {
    table: HashTable<Name>,
    /// `(number, hash)` of each name given, oldest first.
    order: VecDeque<(u64, u64)>,
    next: u64,
}

#[derive(Debug)]
struct Name {
    tokens: Box<[u64]>,
    wire: Wire,
    seq: u64,
}

fn tokens_hash(tokens: &[u64]) -> u64 {
    FxBuildHasher.hash_one(tokens)
}

impl Names {
    fn len(&self) -> usize {
        self.table.len()
    }

    fn insert(&mut self, tokens: &[u64], wire: Wire) {
        if self.table.len() >= MAX_PENDING_NAMES {
            self.pop_oldest();
        }
        let hash = tokens_hash(tokens);
        if let Some(name) = self.table.find_mut(hash, |n| *n.tokens == *tokens) {
            name.wire = wire;
            return;
        }
        let seq = self.next;
        self.next += 1;
        self.order.push_back((seq, hash));
        let name = Name {
            tokens: tokens.into(),
            wire,
            seq,
        };
        self.table
            .insert_unique(hash, name, |n| tokens_hash(&n.tokens));
    }

    fn pop_oldest(&mut self) {
        while let Some((seq, hash)) = self.order.pop_front() {
            if let Ok(found) = self.table.find_entry(hash, |n| n.seq == seq) {
                found.remove();
                return;
            }
        }
    }

    fn take(&mut self, tokens: &[u64]) -> Option<Wire> {
        let found = self
            .table
            .find_entry(tokens_hash(tokens), |n| *n.tokens == *tokens)
            .ok()?;
        let (name, _) = found.remove();
        if self.order.len() > 2 * self.table.len() + 64 {
            // Stale entries outnumber live ones: drop them (order is kept).
            let table = &self.table;
            self.order
                .retain(|&(seq, hash)| table.find(hash, |n| n.seq == seq).is_some());
        }
        Some(name.wire)
    }

    fn memory_bytes(&self) -> usize {
        let tokens: usize = self.table.iter().map(|n| n.tokens.len() * 8).sum();
        self.table.allocation_size() + self.order.capacity() * 16 + tokens
    }
}

/// The wire encoder of one agent: `WireEncoder` in `events.py`.
#[derive(Debug)]
pub struct WireEncoder {
    block_size: u64,
    /// Medium names; a tier's medium is `mediums[medium_of[tier]]` (equal names share one
    /// index, so a move between tiers of the same medium is no change on the wire).
    mediums: Vec<String>,
    medium_of: [u8; 2],
    known: FxHashMap<i64, Known>,
    names: Names,
    /// Blocks whose last copy went, by `Reason` (the order of `REASONS`).
    pub removed: [u64; 4],
    /// `watch`ed block keys (the engine's, as its events carry them), until the block goes.
    watched: FxHashSet<i64>,
    /// Watched keys whose block went, for `take_gone`.
    gone: Vec<i64>,
}

/// Every removal reason, in the order of `WireEncoder::removed`.
pub const REASONS: [Reason; 4] = [
    Reason::Evicted,
    Reason::Replaced,
    Reason::Cleared,
    Reason::Pruned,
];

fn reason_index(reason: Reason) -> usize {
    REASONS.iter().position(|&r| r == reason).unwrap_or(0)
}

/// `wire_hash`: the low 64 bits of an engine key's bytes read big-endian.
pub fn wire_hash(key: &[u8]) -> Wire {
    let mut low = [0u8; 8];
    let n = key.len().min(8);
    low[8 - n..].copy_from_slice(&key[key.len() - n..]);
    u64::from_be_bytes(low) as Wire
}

impl WireEncoder {
    pub fn new(block_size: u64, primary_medium: &str) -> Self {
        let mut mediums = vec![primary_medium.to_string()];
        let secondary = if primary_medium == "CPU" {
            0
        } else {
            mediums.push("CPU".to_string());
            1
        };
        WireEncoder {
            block_size,
            mediums,
            medium_of: [0, secondary],
            known: FxHashMap::default(),
            names: Names::default(),
            removed: [0; 4],
            watched: FxHashSet::default(),
            gone: Vec::new(),
        }
    }

    /// `watch`: report the block whose key (the engine's) is `key` through `take_gone` once
    /// an encoded event says its last copy went (BlockRemoved, AllBlocksCleared).
    pub fn watch(&mut self, key: i64) {
        self.watched.insert(key);
    }

    /// `take_gone`: the watched keys whose blocks went since the last call (no longer
    /// watched).
    pub fn take_gone(&mut self) -> Vec<i64> {
        std::mem::take(&mut self.gone)
    }

    pub fn watched_len(&self) -> usize {
        self.watched.len()
    }

    /// `name`: the block whose tokens are `tokens` goes out under `wire` when stored.
    pub fn name(&mut self, tokens: &[u64], wire: Wire) {
        self.names.insert(tokens, wire);
    }

    pub fn pending_names(&self) -> usize {
        self.names.len()
    }

    pub fn live_blocks(&self) -> usize {
        self.known.len()
    }

    fn medium(&self, tier: u8) -> u8 {
        self.medium_of[tier.min(1) as usize]
    }

    /// The wire events of one engine event, appended to `out`; returns how many.
    pub fn encode(&mut self, event: &Event, out: &mut Writer) -> usize {
        match event {
            Event::Stored {
                key,
                parent,
                tokens,
                tier,
                ..
            } => {
                let medium = self.medium(*tier);
                let wire = if self.names.len() > 0 {
                    self.names.take(tokens).unwrap_or(*key as Wire)
                } else {
                    *key as Wire
                };
                let parent = parent.map(|p| match self.known.get(&p) {
                    Some(up) => up.wire(),
                    None => p as Wire,
                });
                self.stored(out, wire, parent, tokens, medium);
                self.known.insert(*key, Known::new(wire, parent, medium));
                1
            }
            Event::Updated {
                key, tier, tokens, ..
            } => {
                let medium = self.medium(*tier);
                let Some(known) = self.known.get_mut(key) else {
                    return 0;
                };
                if known.medium == medium {
                    return 0; // a priority change, or a move a consumer cannot see
                }
                let left = known.medium;
                let Some(tokens) = tokens else {
                    // A move without its tokens: only the copy that went.
                    let wire = known.wire();
                    self.known.remove(key);
                    self.removed_event(out, wire, left);
                    return 1;
                };
                known.medium = medium;
                let (wire, parent) = (known.wire(), known.parent());
                self.removed_event(out, wire, left);
                self.stored(out, wire, parent, tokens, medium);
                2
            }
            Event::Removed { key, tier, reason } => {
                self.removed[reason_index(*reason)] += 1;
                if self.watched.remove(key) {
                    self.gone.push(*key);
                }
                match self.known.remove(key) {
                    Some(gone) => self.removed_event(out, gone.wire(), gone.medium),
                    None => {
                        let medium = self.medium(*tier);
                        self.removed_event(out, *key as Wire, medium)
                    }
                }
                1
            }
            Event::AllCleared => {
                self.known.clear();
                self.gone.extend(self.watched.drain());
                out.map(1);
                out.str("type");
                out.str("AllBlocksCleared");
                1
            }
        }
    }

    fn stored(
        &self,
        out: &mut Writer,
        wire: Wire,
        parent: Option<Wire>,
        tokens: &[u64],
        medium: u8,
    ) {
        out.map(8);
        out.str("type");
        out.str("BlockStored");
        out.str("block_hashes");
        out.array(1);
        out.int(wire);
        out.str("parent_block_hash");
        match parent {
            Some(p) => out.int(p),
            None => out.nil(),
        }
        out.str("token_ids");
        out.array(tokens.len());
        for &t in tokens {
            out.int(t as Wire);
        }
        out.str("block_size");
        out.int(self.block_size as Wire);
        out.str("lora_id");
        out.nil();
        out.str("medium");
        out.str(&self.mediums[medium as usize]);
        out.str("lora_name");
        out.nil();
    }

    fn removed_event(&self, out: &mut Writer, wire: Wire, medium: u8) {
        out.map(3);
        out.str("type");
        out.str("BlockRemoved");
        out.str("block_hashes");
        out.array(1);
        out.int(wire);
        out.str("medium");
        out.str(&self.mediums[medium as usize]);
    }

    /// `encode_batch(ts, [wire events of events], rank)`, or None when there are none; and
    /// how many wire events it holds.
    pub fn encode_batch<'a>(
        &mut self,
        events: impl IntoIterator<Item = &'a Event>,
        ts: f64,
        rank: i64,
    ) -> Option<(Vec<u8>, usize)> {
        let mut body = Writer::default();
        let mut count = 0;
        for event in events {
            count += self.encode(event, &mut body);
        }
        if count == 0 {
            return None;
        }
        let mut out = Writer::with_capacity(body.len() + 32);
        out.array(3);
        out.float(ts);
        out.array(count);
        out.raw(body.bytes());
        out.int(rank as Wire);
        Some((out.into_bytes(), count))
    }

    /// Heap bytes the encoder's state takes (the live blocks' names and tokens, the names).
    pub fn memory_bytes(&self) -> usize {
        self.known.capacity() * (8 + std::mem::size_of::<Known>() + 1)
            + self.names.memory_bytes()
            + self.watched.capacity() * 9
            + self.gone.capacity() * 8
    }
}

#[cfg(feature = "python")]
pub mod py;

#[cfg(test)]
mod tests;
