//! The experts a shadow cache can run (`mixture.py`'s `ExpertFactory` entries and the level
//! queues of `tests/replay`): `lru`, `reuse-gap`, `lrfu`, `arc`, as one enum so that a
//! mixture's shadows dispatch without a vtable.

use super::arc::ArcQueue;
use super::lrfu::{self, LrfuQueue};
use super::lru::LruQueue;
use super::reuse_gap::{self, ReuseGapQueue};
use super::shadow::{ShadowNodes, ShadowOrder};
use super::{Item, Node, Records};

/// Constants a test may lower to reach code that real sizes reach only after hours.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    /// `history_floor` of reuse-gap (chains) and LRFU (keys); None: the Python defaults.
    pub history_floor: Option<usize>,
    /// Ticks LRFU's history keeps as offsets ([`TickCrf::with_span`]); None: 32 bits.
    ///
    /// [`TickCrf::with_span`]: super::ring::TickCrf::with_span
    pub tick_span: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertKind {
    Lru,
    ReuseGap,
    Lrfu,
    Arc,
}

impl ExpertKind {
    pub const ALL: [ExpertKind; 4] = [
        ExpertKind::Lru,
        ExpertKind::ReuseGap,
        ExpertKind::Lrfu,
        ExpertKind::Arc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ExpertKind::Lru => "lru",
            ExpertKind::ReuseGap => "reuse-gap",
            ExpertKind::Lrfu => "lrfu",
            ExpertKind::Arc => "arc",
        }
    }

    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| format!("unknown expert {name:?}; one of arc, lrfu, lru, reuse-gap"))
    }
}

/// One expert's level queue.
#[derive(Debug, Clone)]
pub enum Expert {
    Lru(LruQueue),
    ReuseGap(Box<ReuseGapQueue>),
    Lrfu(Box<LrfuQueue>),
    Arc(Box<ArcQueue>),
}

impl Expert {
    /// The expert's queue for a shadow of `capacity` blocks.
    pub fn new(kind: ExpertKind, capacity: usize, tuning: Tuning) -> Self {
        match kind {
            ExpertKind::Lru => Expert::Lru(LruQueue::new()),
            ExpertKind::ReuseGap => Expert::ReuseGap(Box::new(ReuseGapQueue::with_history_floor(
                tuning.history_floor.unwrap_or(reuse_gap::HISTORY_FLOOR),
            ))),
            ExpertKind::Lrfu => Expert::Lrfu(Box::new(LrfuQueue::tuned(
                capacity,
                tuning.history_floor.unwrap_or(lrfu::HISTORY_FLOOR),
                tuning.tick_span,
            ))),
            ExpertKind::Arc => Expert::Arc(Box::new(ArcQueue::new(capacity))),
        }
    }

    #[inline]
    pub fn push(&mut self, item: Item, recs: &mut ShadowNodes) {
        match self {
            Expert::Lru(q) => q.push(item, recs),
            Expert::ReuseGap(q) => q.push(item, recs),
            Expert::Lrfu(q) => q.push(item, recs),
            Expert::Arc(q) => q.push(item, recs),
        }
    }

    #[inline]
    pub fn discard(&mut self, item: Item, recs: &mut ShadowNodes) {
        match self {
            Expert::Lru(q) => q.discard(item, recs),
            Expert::ReuseGap(q) => q.discard(item, recs),
            Expert::Lrfu(q) => q.discard(item, recs),
            Expert::Arc(q) => q.discard(item, recs),
        }
    }

    #[inline]
    pub fn pop(&mut self, recs: &mut ShadowNodes) -> Option<Item> {
        match self {
            Expert::Lru(q) => q.pop(recs),
            Expert::ReuseGap(q) => q.pop(recs),
            Expert::Lrfu(q) => q.pop(recs),
            Expert::Arc(q) => q.pop(recs),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Expert::Lru(q) => q.len(),
            Expert::ReuseGap(q) => q.len(),
            Expert::Lrfu(q) => q.len(),
            Expert::Arc(q) => q.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A shadow's whole queue operations around the level queue (`ShadowCache._enqueue`,
/// `_unqueue`, and the stamp and level of a victim), at the shadow's one level, 0.
impl ShadowOrder for Expert {
    #[inline]
    fn enqueue(&mut self, node: Node, nodes: &mut ShadowNodes) {
        nodes.bump_stamp(node);
        nodes.set_queue_level(node, 0);
        self.push(node, nodes);
    }

    #[inline]
    fn unqueue(&mut self, node: Node, nodes: &mut ShadowNodes) {
        self.discard(node, nodes);
        nodes.set_queue_level(node, -1);
        nodes.bump_stamp(node);
    }

    #[inline]
    fn pop_victim(&mut self, nodes: &mut ShadowNodes) -> Option<Node> {
        let victim = self.pop(nodes)?;
        nodes.set_queue_level(victim, -1);
        nodes.bump_stamp(victim);
        Some(victim)
    }

    #[inline]
    fn observes(&self) -> bool {
        matches!(self, Expert::Lrfu(_) | Expert::Arc(_))
    }

    #[inline]
    fn on_access(&mut self, node: Node, nodes: &mut ShadowNodes) {
        match self {
            Expert::Lrfu(q) => q.on_access(nodes.key(node), nodes.last_used(node)),
            Expert::Arc(q) => q.on_access(node, nodes),
            _ => {}
        }
    }

    #[inline]
    fn holds_nodes(&self) -> bool {
        matches!(self, Expert::ReuseGap(_))
    }

    fn memory_bytes(&self) -> usize {
        self.memory_parts().iter().map(|(_, b)| b).sum()
    }

    fn memory_parts(&self) -> Vec<(&'static str, usize)> {
        match self {
            Expert::Lru(q) => q.memory_parts(),
            Expert::ReuseGap(q) => boxed::<ReuseGapQueue>(q.memory_parts()),
            Expert::Lrfu(q) => boxed::<LrfuQueue>(q.memory_parts()),
            Expert::Arc(q) => boxed::<ArcQueue>(q.memory_parts()),
        }
    }
}

/// A boxed order's parts, the box counted as `"box"`.
fn boxed<T>(mut parts: Vec<(&'static str, usize)>) -> Vec<(&'static str, usize)> {
    parts.push(("box", std::mem::size_of::<T>()));
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::shadow::ShadowCache;

    fn shadow(kind: ExpertKind, capacity: usize) -> ShadowCache<Expert> {
        ShadowCache::new(capacity, Expert::new(kind, capacity, Tuning::default())).unwrap()
    }

    /// `tests/replay/test_mixture.py`'s cases, on the compiled experts.
    #[test]
    fn lrfu_keeps_a_frequent_block_that_lru_drops_after_a_scan() {
        let kept = |kind| {
            let mut s = shadow(kind, 2);
            for keys in [[1], [1], [1], [1], [1], [1], [10], [11]] {
                s.step(&keys);
            }
            s.contains(1)
        };
        assert!(kept(ExpertKind::Lrfu));
        assert!(!kept(ExpertKind::Lru));
    }

    #[test]
    fn arc_protects_blocks_seen_twice_from_a_scan() {
        let mut s = shadow(ExpertKind::Arc, 4);
        for key in [1, 2, 1, 2] {
            s.step(&[key]);
        }
        for key in 10..20 {
            s.step(&[key]);
        }
        assert!(s.contains(1) && s.contains(2));
    }

    #[test]
    fn reuse_gap_lets_go_of_what_it_holds() {
        let mut s = shadow(ExpertKind::ReuseGap, 4);
        for r in 0..50i64 {
            s.step(&[r % 7, 100 + r % 3, 1000 + r]);
        }
        assert_eq!(s.nodes().held_dead(), 0);
        assert_eq!(ExpertKind::parse("arc"), Ok(ExpertKind::Arc));
        assert!(ExpertKind::parse("fifo").is_err());
    }
}
