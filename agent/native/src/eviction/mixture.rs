//! Follows `mixture.py`: follow whichever of several orders is hitting most.
//!
//! One shadow cache per expert, each of the tier's capacity and fed every request, scored by
//! its own hits; scores decay by the spread of the experts' hits on a request (clocked by
//! disagreement). The real cache evicts first the evictable leaves the leader does not hold
//! (LRU among them), then the rest: per priority level a [`MixQueue`] of two heaps.
//!
//! With a [`Vote`] (`vote.py`) no expert leads: a queued block's bucket is the set of experts
//! whose shadow holds its key, and the buckets are emptied in the order of their summed
//! weights.
//!
//! In Python each `MixQueue` refers back to its policy, and the policy re-buckets blocks of
//! every level; here the policy owns its level queues (`levels`), and `queue.rs` asks it
//! per level. A block keeps its place among blocks of its tick (the order it was queued in)
//! when it changes bucket, so the order in which the changed keys (`dirty`) and the queued
//! keys (`where_`) are re-bucketed decides nothing.

use rustc_hash::{FxHashMap, FxHashSet};

use super::expert::{Expert, ExpertKind, Tuning};
use super::float::{exp, pow, py_max};
use super::heap::{compact, heap_pop, heap_push, Entry};
use super::keyed::{map_bytes, set_bytes};
use super::ring::{Plain, RingMap};
use super::shadow::ShadowCache;
use super::{Item, Records, MAX_PRIORITY};

/// `DEFAULT_EXPERTS`: in the order that breaks ties in score (the first leads at start).
pub const DEFAULT_EXPERTS: [ExpertKind; 3] =
    [ExpertKind::ReuseGap, ExpertKind::Lrfu, ExpertKind::Arc];
/// `MixturePolicy.horizon`: half-life of a score, in capacities of disagreement.
pub const HORIZON: f64 = 0.25;

/// `(last_used, order, sequence, block)`: `order` is when the block was queued, `seq`
/// (32 bits, compared for equality only, see `heap.rs`) names its current entry.
#[derive(Debug, Clone, Copy)]
struct MixEntry {
    last_used: u64,
    order: u64,
    seq: u32,
    item: Item,
}

impl Entry for MixEntry {
    #[inline]
    fn less(&self, other: &Self) -> bool {
        (self.last_used, self.order, self.seq) < (other.last_used, other.order, other.seq)
    }
}

/// A queued block's key, when it was queued, the sequence number of its current entry, and
/// its bucket.
#[derive(Debug, Clone, Copy)]
struct MixRec {
    key: i64,
    order: u64,
    seq: u32,
    heap: u8,
}

/// One priority level's blocks in LRU heaps, one per bucket: for the follower rule those the
/// leader lacks (0, evicted first) and those it holds (1); for a vote, one per holder mask.
/// A block moves between them without a new `queue_stamp`, so an entry is current while its
/// sequence number is the one `entries` records for the block; it keeps its `order`.
#[derive(Debug, Clone)]
pub struct MixQueue {
    heaps: Vec<Vec<MixEntry>>,
    entries: FxHashMap<Item, MixRec>,
    /// Numbers both the blocks queued (`order`) and the entries made (`seq`).
    count: u64,
}

impl MixQueue {
    fn new(buckets: usize) -> Self {
        MixQueue {
            heaps: vec![Vec::new(); buckets],
            entries: FxHashMap::default(),
            count: 0,
        }
    }

    /// Queue `item` (stored under `key`) in `heap`.
    fn push<R: Records + ?Sized>(&mut self, item: Item, key: i64, heap: u8, recs: &R) {
        let order = self.count; // its first entry's sequence number too
        self.place(item, key, heap, order, recs);
    }

    fn place<R: Records + ?Sized>(&mut self, item: Item, key: i64, heap: u8, order: u64, recs: &R) {
        let seq = self.count as u32;
        self.count += 1;
        heap_push(
            &mut self.heaps[heap as usize],
            MixEntry {
                last_used: recs.last_used(item),
                order,
                seq,
                item,
            },
        );
        self.entries.insert(
            item,
            MixRec {
                key,
                order,
                seq,
                heap,
            },
        );
    }

    /// Move `item` to the bucket the policy now says, in its place among its tick's blocks.
    fn rebucket<R: Records + ?Sized>(&mut self, item: Item, key: i64, heap: u8, recs: &R) {
        if let Some(rec) = self.entries.get(&item) {
            if rec.heap != heap {
                let order = rec.order;
                self.place(item, key, heap, order, recs);
                self.compact();
            }
        }
    }

    fn compact(&mut self) {
        let entries = &self.entries;
        let live = entries.len();
        for heap in self.heaps.iter_mut() {
            compact(heap, live, |e| {
                entries.get(&e.item).is_some_and(|r| r.seq == e.seq)
            });
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn memory_bytes(&self) -> usize {
        self.heaps.iter().map(Vec::capacity).sum::<usize>() * std::mem::size_of::<MixEntry>()
            + self.heaps.capacity() * std::mem::size_of::<Vec<MixEntry>>()
            + map_bytes(&self.entries)
    }
}

/// `VotePolicy`'s constants (`vote.py`): the weights' sharpness and LRU's head start, and
/// the buckets' eviction order while the scores stay as they are.
#[derive(Debug, Clone)]
pub struct Vote {
    pub eta: f64,
    pub prior: f64,
    horizon: f64,
    ranking: Option<Vec<u8>>,
}

impl Vote {
    pub fn new(eta: f64, prior: f64, horizon: f64) -> Self {
        Vote {
            eta,
            prior,
            horizon,
            ranking: None,
        }
    }
}

/// Shadow experts, their scores, and the level queues that follow the leader (or the vote).
#[derive(Debug, Clone)]
pub struct MixturePolicy {
    capacity: usize,
    /// `1 + hysteresis` of `GuardedPolicy.takes_lead`; None: the plain `challenger > leader`.
    lead_factor: Option<f64>,
    kinds: Vec<ExpertKind>,
    shadows: Vec<ShadowCache<Expert>>,
    scores: Vec<f64>,
    hits: Vec<usize>,
    leader: usize,
    switches: u64,
    next_leader: usize,
    decay: f64,
    /// Queued keys whose bucket may have changed since the last `flush` (a subset of the
    /// keys of `where_`: a key leaves both together).
    dirty: FxHashSet<i64>,
    /// Key of every queued block -> its level and the block.
    where_: RingMap<Plain<(u8, Item)>>,
    levels: Vec<Option<MixQueue>>,
    /// Some: no leader; the experts vote (`VotePolicy`).
    vote: Option<Vote>,
}

impl MixturePolicy {
    /// `MixturePolicy(capacity)`: reuse-gap, LRFU and ARC, no hysteresis.
    pub fn new(capacity: usize) -> Self {
        Self::with_experts(capacity, &DEFAULT_EXPERTS, HORIZON, None, Tuning::default())
            .expect("the default experts")
    }

    /// A mixture of `experts` with the score half-life `horizon`; `hysteresis` makes a
    /// challenger lead only above `(1 + hysteresis)` times the leader's score.
    pub fn with_experts(
        capacity: usize,
        experts: &[ExpertKind],
        horizon: f64,
        hysteresis: Option<f64>,
        tuning: Tuning,
    ) -> Result<Self, String> {
        if experts.is_empty() {
            return Err("a mixture needs at least one expert".into());
        }
        let size = capacity.max(1);
        let shadows = experts
            .iter()
            .map(|&kind| ShadowCache::new(size, Expert::new(kind, size, tuning)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MixturePolicy {
            capacity,
            lead_factor: hysteresis.map(|h| 1.0 + h),
            kinds: experts.to_vec(),
            shadows,
            scores: vec![0.0; experts.len()],
            hits: vec![0; experts.len()],
            leader: 0,
            switches: 0,
            next_leader: 0,
            decay: pow(0.5, 1.0 / (horizon * size as f64)),
            dirty: FxHashSet::default(),
            where_: RingMap::default(),
            levels: vec![None; MAX_PRIORITY as usize + 1],
            vote: None,
        })
    }

    /// `VotePolicy`: these experts voting with the weights' constants of `vote` (whose
    /// horizon is the scores' half-life too). At most 8 experts (a holder mask is a byte).
    pub fn voting(
        capacity: usize,
        experts: &[ExpertKind],
        vote: Vote,
        tuning: Tuning,
    ) -> Result<Self, String> {
        if experts.len() > 8 {
            return Err("a vote takes at most 8 experts".into());
        }
        let mut policy = Self::with_experts(capacity, experts, vote.horizon, None, tuning)?;
        policy.vote = Some(vote);
        Ok(policy)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.kinds.iter().map(|k| k.name()).collect()
    }

    pub fn scores(&self) -> &[f64] {
        &self.scores
    }

    pub fn leader(&self) -> usize {
        self.leader
    }

    pub fn switches(&self) -> u64 {
        self.switches
    }

    pub fn shadows(&self) -> &[ShadowCache<Expert>] {
        &self.shadows
    }

    /// Whether the leader's shadow holds `key`.
    #[inline]
    pub fn leader_holds(&self, key: i64) -> bool {
        self.shadows[self.leader].contains(key)
    }

    /// `MixturePolicy.bucket`: whether the leader holds `key`, or under a vote the mask of
    /// the experts whose shadow holds it.
    #[inline]
    pub fn bucket(&self, key: i64) -> u8 {
        bucket_of(&self.shadows, self.leader, self.vote.is_some(), key)
    }

    fn buckets(&self) -> usize {
        if self.vote.is_some() {
            1 << self.shadows.len()
        } else {
            2
        }
    }

    /// `VotePolicy.weights`.
    pub fn weights(&self) -> Vec<f64> {
        let vote = self.vote.as_ref().expect("weights are a vote's");
        let mut scores = self.scores.clone();
        scores[0] *= 1.0 + vote.prior;
        let mut best = scores[0];
        for &s in &scores[1..] {
            best = py_max(best, s);
        }
        let sharpness = vote.eta / py_max(1.0, vote.horizon * self.capacity as f64);
        scores
            .iter()
            .map(|&s| exp(sharpness * (s - best)))
            .collect()
    }

    /// `MixturePolicy.eviction_order`: the buckets, emptied first to last.
    pub fn eviction_order(&mut self) -> Vec<u8> {
        self.rank();
        match &self.vote {
            Some(vote) => vote.ranking.clone().expect("ranked"),
            None => LACKS_FIRST.to_vec(),
        }
    }

    /// Under a vote, rank the buckets for the scores as they are (once per request).
    fn rank(&mut self) {
        if self.vote.as_ref().is_none_or(|v| v.ranking.is_some()) {
            return;
        }
        let weights = self.weights();
        let worth: Vec<f64> = (0..1usize << weights.len())
            .map(|mask| {
                let mut sum = 0.0;
                for (index, w) in weights.iter().enumerate() {
                    if mask >> index & 1 == 1 {
                        sum += w;
                    }
                }
                sum
            })
            .collect();
        let mut ranking: Vec<u8> = (0..worth.len()).map(|m| m as u8).collect();
        ranking.sort_by(|&a, &b| {
            worth[a as usize]
                .partial_cmp(&worth[b as usize])
                .expect("weights are finite")
                .then((a & 1).cmp(&(b & 1)))
                .then(a.cmp(&b))
        });
        if let Some(vote) = self.vote.as_mut() {
            vote.ranking = Some(ranking);
        }
    }

    /// A request for the blocks `keys` (`SharedPolicy.observe`); `scored` is false when a
    /// sequence only grew. `recs` is read when a change of leader re-buckets queued blocks.
    pub fn observe<R: Records + ?Sized>(&mut self, keys: &[i64], scored: bool, recs: &mut R) {
        if let Some(vote) = self.vote.as_mut() {
            vote.ranking = None;
        }
        if keys.is_empty() {
            return;
        }
        if self.next_leader != self.leader {
            self.leader = self.next_leader;
            self.switches += 1;
            self.dirty.clear();
            let leader = &self.shadows[self.leader];
            for (key, (level, item)) in self.where_.iter() {
                if let Some(queue) = self.levels[level as usize].as_mut() {
                    queue.rebucket(item, key, leader.contains(key) as u8, recs);
                }
            }
        }
        let leader = self.leader;
        let every = self.vote.is_some(); // a vote watches every expert's cache
        let (dirty, where_) = (&mut self.dirty, &self.where_);
        for (index, shadow) in self.shadows.iter_mut().enumerate() {
            self.hits[index] = if every || index == leader {
                shadow.step_with(keys, |key| {
                    if where_.contains_key(key) {
                        dirty.insert(key); // a key queued later is bucketed as it is then
                    }
                })
            } else {
                shadow.step(keys)
            };
        }
        if !scored {
            return;
        }
        let hits = &self.hits;
        let spread = hits.iter().max().unwrap() - hits.iter().min().unwrap();
        let decay = pow(self.decay, spread as f64);
        for (score, &got) in self.scores.iter_mut().zip(hits) {
            *score = *score * decay + got as f64;
        }
        let mut best = 0;
        for index in 1..self.scores.len() {
            if self.scores[index] > self.scores[best] {
                best = index; // the first maximum wins, as Python's max
            }
        }
        if self.vote.is_none() && self.takes_lead(self.scores[best], self.scores[self.leader]) {
            self.next_leader = best;
        }
    }

    /// Whether the best-scoring expert takes the lead (from the next request on).
    #[inline]
    fn takes_lead(&self, challenger: f64, leader: f64) -> bool {
        match self.lead_factor {
            None => challenger > leader,
            Some(factor) => challenger > factor * leader,
        }
    }

    /// `MixQueue.push` at `level`.
    pub fn push<R: Records + ?Sized>(&mut self, level: usize, item: Item, recs: &mut R) {
        let key = recs.key(recs.node(item));
        let bucket = self.bucket(key);
        let buckets = self.buckets();
        self.levels[level]
            .get_or_insert_with(|| MixQueue::new(buckets))
            .push(item, key, bucket, recs);
        self.where_.insert(key, (level as u8, item));
    }

    /// `MixQueue.discard` at `level`.
    pub fn discard<R: Records + ?Sized>(&mut self, level: usize, item: Item, _recs: &mut R) {
        let queue = self.levels[level]
            .as_mut()
            .expect("a queued block's level has a queue");
        if let Some(rec) = queue.entries.remove(&item) {
            untrack(&mut self.where_, &mut self.dirty, rec.key, item);
        }
        queue.compact();
    }

    /// `MixQueue.pop` at `level`: first the blocks the leader lacks (under a vote, those of
    /// least worth), least recent first.
    pub fn pop<R: Records + ?Sized>(&mut self, level: usize, recs: &mut R) -> Option<Item> {
        self.flush(recs);
        self.levels[level].as_ref()?;
        self.rank();
        let order: &[u8] = match &self.vote {
            Some(vote) => vote.ranking.as_deref().expect("ranked"),
            None => &LACKS_FIRST,
        };
        let queue = self.levels[level].as_mut()?;
        for &bucket in order {
            let heap = &mut queue.heaps[bucket as usize];
            while let Some(entry) = heap_pop(heap) {
                let Some(rec) = queue.entries.get(&entry.item) else {
                    continue;
                };
                if rec.seq == entry.seq {
                    let key = rec.key;
                    queue.entries.remove(&entry.item);
                    untrack(&mut self.where_, &mut self.dirty, key, entry.item);
                    return Some(entry.item);
                }
            }
        }
        None
    }

    /// Blocks queued at `level`.
    pub fn level_len(&self, level: usize) -> usize {
        self.levels[level].as_ref().map_or(0, MixQueue::len)
    }

    /// Re-bucket the queued blocks whose key entered or left the leader's cache (under a
    /// vote, any expert's).
    fn flush<R: Records + ?Sized>(&mut self, recs: &R) {
        if self.dirty.is_empty() {
            return;
        }
        let voting = self.vote.is_some();
        for &key in self.dirty.iter() {
            if let Some((level, item)) = self.where_.get(key) {
                let bucket = bucket_of(&self.shadows, self.leader, voting, key);
                if let Some(queue) = self.levels[level as usize].as_mut() {
                    queue.rebucket(item, key, bucket, recs);
                }
            }
        }
        if self.dirty.capacity() > KEPT_DIRTY {
            self.dirty = FxHashSet::default(); // a burst of changes does not keep its table
        } else {
            self.dirty.clear();
        }
    }

    /// Heap bytes owned: the shadows, their orders, and the level queues.
    pub fn memory_bytes(&self) -> usize {
        self.memory_parts().iter().map(|(_, b)| b).sum()
    }

    /// `memory_bytes` by part: each shadow's (`"<expert>.<part>"`), then the mixture's own.
    pub fn memory_parts(&self) -> Vec<(String, usize)> {
        use std::mem::size_of;
        let mut parts = Vec::new();
        for (kind, shadow) in self.kinds.iter().zip(&self.shadows) {
            parts.push((
                format!("{}.struct", kind.name()),
                size_of::<ShadowCache<Expert>>(),
            ));
            for (part, bytes) in shadow.memory_parts() {
                parts.push((format!("{}.{part}", kind.name()), bytes));
            }
        }
        parts.push((
            "mixture.fixed".into(),
            self.scores.capacity() * 8
                + self.hits.capacity() * size_of::<usize>()
                + self.kinds.capacity() * size_of::<ExpertKind>()
                + self.levels.capacity() * size_of::<Option<MixQueue>>(),
        ));
        parts.push(("mixture.dirty".into(), set_bytes(&self.dirty)));
        parts.push(("mixture.where".into(), self.where_.memory_bytes()));
        parts.push((
            "mixture.levels".into(),
            self.levels
                .iter()
                .flatten()
                .map(MixQueue::memory_bytes)
                .sum::<usize>(),
        ));
        parts
    }
}

/// Changed keys whose table a flush keeps for the next ones.
const KEPT_DIRTY: usize = 1024;

/// `MixturePolicy.eviction_order` of the follower rule: what the leader lacks goes first.
const LACKS_FIRST: [u8; 2] = [0, 1];

/// `MixturePolicy.bucket` of `key` (`voting`: `VotePolicy.bucket`).
#[inline]
fn bucket_of(shadows: &[ShadowCache<Expert>], leader: usize, voting: bool, key: i64) -> u8 {
    if !voting {
        return shadows[leader].contains(key) as u8;
    }
    let mut mask = 0u8;
    for (index, shadow) in shadows.iter().enumerate() {
        if shadow.contains(key) {
            mask |= 1 << index;
        }
    }
    mask
}

/// `MixturePolicy.untrack`: `item` left its queue (a newer block under the same key may
/// have replaced it in `where_`).
#[inline]
fn untrack(
    where_: &mut RingMap<Plain<(u8, Item)>>,
    dirty: &mut FxHashSet<i64>,
    key: i64,
    item: Item,
) {
    if let Some((_, found)) = where_.get(key) {
        if found == item {
            where_.remove(key);
            dirty.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::guarded::guarded_policy;
    use crate::eviction::shadow::ShadowNodes;

    /// `test_only_queued_keys_are_kept_as_changed`, compiled.
    #[test]
    fn only_queued_keys_are_kept_as_changed() {
        let mut m = crate::eviction::vote::vote_policy(8);
        let mut recs = ShadowNodes::default();
        for key in 0..1000 {
            m.observe(&[key], true, &mut recs); // each key enters, an older one leaves
        }
        assert!(m.dirty.is_empty()); // nothing is queued: nothing to re-bucket
    }

    /// `test_only_requests_the_experts_disagree_on_age_the_scores`, compiled.
    #[test]
    fn only_disagreement_ages_the_scores() {
        let experts = [ExpertKind::Lru, ExpertKind::Lrfu];
        let mut m =
            MixturePolicy::with_experts(2, &experts, HORIZON, None, Tuning::default()).unwrap();
        let mut recs = ShadowNodes::default();
        for keys in [[1], [1], [1], [10], [11]] {
            m.observe(&keys, true, &mut recs);
        }
        assert_eq!(m.scores(), &[2.0, 2.0]);
        m.observe(&[1], true, &mut recs);
        let decay = pow(0.5, 1.0 / (HORIZON * 2.0));
        assert_eq!(m.scores(), &[2.0 * decay, 2.0 * decay + 1.0]);
        for key in 100..150 {
            m.observe(&[key], true, &mut recs);
        }
        assert_eq!(m.scores(), &[2.0 * decay, 2.0 * decay + 1.0]);
        assert_eq!(m.names()[m.leader()], "lrfu");
        assert_eq!(m.switches(), 1);
    }

    #[test]
    fn the_guarded_mixture_starts_with_lru_and_holds_it_on_a_tie() {
        let mut m = guarded_policy(8);
        let mut recs = ShadowNodes::default();
        assert_eq!(m.names(), vec!["lru", "reuse-gap", "lrfu", "arc"]);
        m.observe(&[], true, &mut recs);
        m.observe(&[1, 2], true, &mut recs);
        m.observe(&[3], true, &mut recs);
        assert_eq!((m.leader(), m.switches()), (0, 0));
        assert!(m.leader_holds(1) && m.leader_holds(3));
        assert!(MixturePolicy::with_experts(8, &[], HORIZON, None, Tuning::default()).is_err());
    }
}
