//! What the engine records for the agent: KV events, counters, and the ghost list.
//!
//! Twins of `kvpool_agent/cache/events.py` (a bounded FIFO, oldest dropped first) and
//! `stats.py` (`CacheStats`, `GhostList`). Events are kept as plain records here and become
//! Python objects only when the agent drains them, off the request path.

use std::collections::VecDeque;

use crate::eviction::ring::{Plain, RingMap};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Evicted,
    Replaced,
    Cleared,
    Pruned,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Evicted => "evicted",
            Reason::Replaced => "replaced",
            Reason::Cleared => "cleared",
            Reason::Pruned => "pruned",
        }
    }
}

#[derive(Clone, Debug)]
pub enum Event {
    Stored {
        key: i64,
        parent: Option<i64>,
        tokens: Box<[u64]>,
        tier: u8,
        priority: u8,
    },
    /// A change of tier (with the block's tokens, which a consumer storing it again under
    /// the new medium needs) or of priority (without).
    Updated {
        key: i64,
        tier: u8,
        priority: u8,
        tokens: Option<Box<[u64]>>,
    },
    Removed {
        key: i64,
        tier: u8,
        reason: Reason,
    },
    AllCleared,
}

pub struct EventLog {
    queue: VecDeque<Event>,
    max_size: usize,
    pub dropped: u64,
}

impl EventLog {
    pub fn new(max_size: usize) -> Self {
        EventLog {
            queue: VecDeque::new(),
            max_size,
            dropped: 0,
        }
    }

    #[inline]
    pub fn enabled(&self) -> bool {
        self.max_size > 0
    }

    pub fn push(&mut self, event: Event) {
        if self.max_size == 0 {
            return;
        }
        if self.queue.len() == self.max_size {
            self.queue.pop_front();
            self.dropped += 1;
        }
        self.queue.push_back(event);
    }

    pub fn drain(&mut self, limit: Option<usize>) -> Vec<Event> {
        let n = limit.map_or(self.queue.len(), |l| l.min(self.queue.len()));
        self.queue.drain(..n).collect()
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Change the bound (a live setting); keeps the newest events.
    pub fn resize(&mut self, max_size: usize) {
        while self.queue.len() > max_size {
            self.queue.pop_front();
        }
        self.max_size = max_size;
    }

    pub fn memory_bytes(&self) -> usize {
        self.queue.capacity() * std::mem::size_of::<Event>()
            + self
                .queue
                .iter()
                .map(|e| match e {
                    Event::Stored { tokens, .. }
                    | Event::Updated {
                        tokens: Some(tokens),
                        ..
                    } => tokens.len() * 8,
                    _ => 0,
                })
                .sum::<usize>()
    }
}

/// `CacheStats`: monotonic counters since start.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub queries_tokens: u64,
    pub queries_blocks: u64,
    pub hits_tokens: [u64; 2],
    pub hits_blocks: [u64; 2],
    pub partial_hit_tokens: u64,
    pub capacity_miss_tokens: u64,
    pub capacity_miss_blocks: u64,
    pub evictions: [u64; 2],
    pub offloads: u64,
    pub onboards: u64,
    pub chunk_moves: u64,
    pub sequences_opened: u64,
}

/// `GhostList`: keys of recently dropped blocks, bounded, oldest forgotten first: an
/// insertion-ordered set (a key added again moves to the end), kept in a ring
/// (`eviction::ring`: a key and a slot of the index per entry).
pub struct GhostList {
    pub capacity: usize,
    keys: RingMap<Plain<()>>,
}

impl GhostList {
    pub fn new(capacity: usize) -> Self {
        GhostList {
            capacity,
            keys: RingMap::with_limit(capacity),
        }
    }

    pub fn add(&mut self, key: i64) {
        if self.capacity == 0 {
            return;
        }
        self.keys.move_to_back(key, |_| ());
        if self.keys.len() > self.capacity {
            self.keys.pop_front();
        }
    }

    pub fn discard(&mut self, key: i64) {
        self.keys.remove(key);
    }

    #[inline]
    pub fn contains(&self, key: i64) -> bool {
        self.keys.contains_key(key)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The remembered keys, oldest first.
    pub fn keys(&self) -> Vec<i64> {
        self.keys.iter().map(|(k, ())| k).collect()
    }

    pub fn memory_bytes(&self) -> usize {
        self.keys.memory_bytes()
    }
}
