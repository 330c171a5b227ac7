//! What the engine records for the agent: KV events, counters, and the ghost list.
//!
//! Twins of `kvpool_agent/cache/events.py` (a bounded FIFO, oldest dropped first) and
//! `stats.py` (`CacheStats`, `GhostList`). Events are kept as plain records here and become
//! Python objects only when the agent drains them, off the request path.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

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
    Updated {
        key: i64,
        tier: u8,
        priority: u8,
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
                    Event::Stored { tokens, .. } => tokens.len() * 8,
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

/// `GhostList`: keys of recently dropped blocks, bounded, oldest forgotten first.
///
/// An insertion-ordered set as a deque of (key, stamp) with a map key -> its live stamp;
/// entries whose stamp is no longer the key's are skipped and compacted away.
pub struct GhostList {
    pub capacity: usize,
    order: VecDeque<(i64, u64)>,
    live: FxHashMap<i64, u64>,
    stamp: u64,
}

impl GhostList {
    pub fn new(capacity: usize) -> Self {
        GhostList {
            capacity,
            order: VecDeque::new(),
            live: FxHashMap::default(),
            stamp: 0,
        }
    }

    pub fn add(&mut self, key: i64) {
        if self.capacity == 0 {
            return;
        }
        self.stamp += 1;
        self.live.insert(key, self.stamp);
        self.order.push_back((key, self.stamp));
        if self.live.len() > self.capacity {
            while let Some((k, s)) = self.order.pop_front() {
                if self.live.get(&k) == Some(&s) {
                    self.live.remove(&k);
                    break;
                }
            }
        }
        self.compact();
    }

    pub fn discard(&mut self, key: i64) {
        if self.live.remove(&key).is_some() {
            self.compact();
        }
    }

    #[inline]
    pub fn contains(&self, key: i64) -> bool {
        self.live.contains_key(&key)
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The remembered keys, oldest first.
    pub fn keys(&self) -> Vec<i64> {
        self.order
            .iter()
            .filter(|(k, s)| self.live.get(k) == Some(s))
            .map(|&(k, _)| k)
            .collect()
    }

    fn compact(&mut self) {
        if self.order.len() > 64 && self.order.len() > 2 * self.live.len() {
            let live = &self.live;
            self.order.retain(|(k, s)| live.get(k) == Some(s));
        }
    }

    pub fn memory_bytes(&self) -> usize {
        self.order.capacity() * 16 + self.live.capacity() * 17
    }
}
