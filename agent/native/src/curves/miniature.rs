//! Follows `miniature.py`: the engine's own eviction policy at several fractions of the
//! capacity, simulated on spatially sampled keys (miniature simulations).
//!
//! The engine queues the sampled keys of each query's full blocks as one chain, root first
//! (`access_chain`: a mask and a compare per block, bounded by `max_pending`, the oldest
//! chains dropped beyond it); `drain` replays the chains later through one [`MiniCache`] per
//! ratio, each the policy's whole queue in a shadow cache, stepped one chain at a time as
//! `_Mini.step` does. Counts, drops, warm-up and the sampling rate are the Python class's,
//! to the access.

use std::collections::VecDeque;

use crate::eviction::queue::MiniCache;
use crate::eviction::registry::PolicyKind;

/// Sizes simulated, as multiples of the capacity (`miniature.RATIOS`).
pub const RATIOS: [f64; 6] = [0.25, 0.5, 0.75, 1.0, 1.5, 2.0];
/// `miniature.MIN_BLOCKS`.
pub const MIN_BLOCKS: f64 = 64.0;
/// `miniature.MAX_PENDING`.
pub const MAX_PENDING: i64 = 16384;
/// The largest sampling shift a 64-bit key mask can express.
pub const MAX_SHIFT: u32 = 63;
/// Most blocks one miniature may hold: beyond it the parameters are a mistake.
const MAX_SIZE: f64 = (1u64 << 40) as f64;

/// `miniature.PolicyMiniature`.
#[derive(Debug, Clone)]
pub struct PolicyMiniature {
    policy: String,
    capacity: u64,
    ratios: Vec<f64>,
    min_blocks: f64,
    /// Keys waiting beyond which the oldest half are dropped (settable, as in Python).
    pub max_pending: i64,
    shift: u32,
    mask: u64,
    minis: Vec<MiniCache>,
    /// Sampled accesses replayed, warm-up included.
    seen: u64,
    warm_after: u64,
    hits: Vec<u64>,
    accesses: u64,
    dropped: u64,
    /// Sampled keys waiting for `drain`, oldest first: the chains end to end.
    pending: VecDeque<i64>,
    /// Length of each chain in `pending`, oldest first.
    chains: VecDeque<u32>,
}

/// `2 ** k` as a float (exact, for `k` up to 1023).
#[inline]
fn pow2(k: u32) -> f64 {
    f64::from_bits((1023 + k as u64) << 52)
}

impl PolicyMiniature {
    /// `PolicyMiniature(policy, capacity, ratios=, min_blocks=, max_pending=, shift=)`.
    /// `capacity` below 1 counts as 1; `ratios` are sorted here; `shift` None: the lowest
    /// rate that keeps `min_blocks` in the smallest miniature.
    pub fn new(
        policy: &str,
        capacity: u64,
        ratios: &[f64],
        min_blocks: f64,
        max_pending: i64,
        shift: Option<i64>,
    ) -> Result<Self, String> {
        let kind = PolicyKind::parse(policy)?;
        let capacity = capacity.max(1);
        let mut ratios = ratios.to_vec();
        ratios.sort_by(f64::total_cmp);
        // (Python fails on a ratio that is not finite too, when it sizes the miniatures.)
        if ratios.is_empty() || !ratios.iter().all(|r| r.is_finite()) || ratios[0] <= 0.0 {
            return Err(format!(
                "ratios must be positive and finite, got {ratios:?}"
            ));
        }
        let shift = match shift {
            Some(s) => s.max(0),
            None => {
                // `capacity * ratios[0] / (2 << shift) >= min_blocks`
                let mut s: u32 = 0;
                while capacity as f64 * ratios[0] / pow2(s + 1) >= min_blocks {
                    s += 1;
                    if s > MAX_SHIFT {
                        return Err(format!(
                            "min_blocks {min_blocks} needs a sampling shift beyond {MAX_SHIFT}"
                        ));
                    }
                }
                s as i64
            }
        };
        if shift > MAX_SHIFT as i64 {
            return Err(format!("shift: at most {MAX_SHIFT}, got {shift}"));
        }
        let shift = shift as u32;
        let sizes = sizes(capacity, &ratios, shift)?;
        let minis = sizes
            .iter()
            .map(|&size| MiniCache::mini(kind.name(), size as usize))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PolicyMiniature {
            policy: policy.to_string(),
            capacity,
            hits: vec![0; ratios.len()],
            ratios,
            min_blocks,
            max_pending,
            shift,
            mask: (1u64 << shift) - 1,
            minis,
            seen: 0,
            warm_after: sizes[0],
            accesses: 0,
            dropped: 0,
            pending: VecDeque::new(),
            chains: VecDeque::new(),
        })
    }

    /// The default miniature of `policy` for a cache of `capacity` blocks.
    pub fn with_capacity(policy: &str, capacity: u64) -> Result<Self, String> {
        Self::new(policy, capacity, &RATIOS, MIN_BLOCKS, MAX_PENDING, None)
    }

    pub fn policy(&self) -> &str {
        &self.policy
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The ratios, sorted.
    pub fn ratios(&self) -> &[f64] {
        &self.ratios
    }

    pub fn min_blocks(&self) -> f64 {
        self.min_blocks
    }

    pub fn shift(&self) -> u32 {
        self.shift
    }

    /// A key is sampled when `key & mask == 0`.
    pub fn mask(&self) -> u64 {
        self.mask
    }

    pub fn rate(&self) -> f64 {
        1.0 / pow2(self.shift)
    }

    /// Blocks in each miniature.
    pub fn sizes(&self) -> Vec<u64> {
        sizes(self.capacity, &self.ratios, self.shift).expect("checked when made")
    }

    /// Hits per ratio, counted after the warm-up.
    pub fn hits(&self) -> &[u64] {
        &self.hits
    }

    /// Sampled accesses counted (after the warm-up).
    pub fn accesses(&self) -> u64 {
        self.accesses
    }

    /// Sampled keys dropped unreplayed (the queue overflowed).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Keys waiting for `drain`, oldest first.
    pub fn pending(&self) -> &VecDeque<i64> {
        &self.pending
    }

    // ------------------------------------------------------------------ feeding

    /// `access_chain`: one query's block keys, root first; the sampled ones are queued as
    /// one chain.
    #[inline]
    pub fn access_chain<I: Iterator<Item = i64>>(&mut self, keys: I) {
        let mask = self.mask;
        let before = self.pending.len();
        self.pending
            .extend(keys.filter(|&key| (key as u64) & mask == 0));
        self.close_chain(before);
    }

    /// `queue_chain`: one query's sampled keys, root first.
    pub fn queue_chain(&mut self, sampled: &[i64]) {
        let before = self.pending.len();
        self.pending.extend(sampled.iter().copied());
        self.close_chain(before);
    }

    /// `access`: a query of one block.
    pub fn access(&mut self, key: i64) {
        self.access_chain(std::iter::once(key));
    }

    /// Record the keys queued since `before` as one chain (none when empty), then bound the
    /// queue.
    fn close_chain(&mut self, before: usize) {
        let n = self.pending.len() - before;
        if n == 0 {
            return;
        }
        self.chains.push_back(n as u32);
        if self.pending.len() as i128 > self.max_pending as i128 {
            self.overflow();
        }
    }

    // ------------------------------------------------------------------ simulation

    /// `drain(limit)`: replay pending chains, oldest first, through every miniature: all
    /// when `limit` is None, else until `limit` keys were (the last chain whole). Returns
    /// the keys replayed.
    pub fn drain(&mut self, limit: Option<i64>) -> u64 {
        let len = self.pending.len() as i64;
        let want = limit.map_or(len, |l| l.min(len));
        let warm = self.warm_after;
        let mut done: i64 = 0;
        let mut chain: Vec<i64> = Vec::new();
        while done < want {
            let n = self.chains.pop_front().expect("counted") as usize;
            chain.clear();
            chain.extend(self.pending.drain(..n));
            done += n as i64;
            self.seen += n as u64;
            let counted = self.seen > warm;
            if counted {
                self.accesses += n as u64;
            }
            for (mini, hits) in self.minis.iter_mut().zip(self.hits.iter_mut()) {
                let hit = mini.observe_and_step(&chain, |_| {});
                if counted {
                    *hits += hit as u64;
                }
            }
        }
        done as u64
    }

    /// Heap bytes owned (the miniatures, their orders, the queue of keys).
    pub fn memory_bytes(&self) -> usize {
        self.minis
            .iter()
            .map(MiniCache::memory_bytes)
            .sum::<usize>()
            + self.minis.capacity() * std::mem::size_of::<MiniCache>()
            + self.pending.capacity() * 8
            + self.chains.capacity() * 4
            + (self.hits.capacity() + self.ratios.capacity()) * 8
    }

    /// Too many keys wait: drop the oldest chains until at most `max_pending // 2` (floor
    /// division, as Python's) wait.
    fn overflow(&mut self) {
        let keep = (self.max_pending as i128).div_euclid(2);
        let mut cut = 0usize;
        while (self.pending.len() - cut) as i128 > keep {
            let Some(n) = self.chains.pop_front() else {
                break;
            };
            cut += n as usize;
        }
        self.dropped += cut as u64;
        self.pending.drain(..cut);
    }
}

/// `max(int(capacity * r) >> shift, 1)` for each ratio.
fn sizes(capacity: u64, ratios: &[f64], shift: u32) -> Result<Vec<u64>, String> {
    ratios
        .iter()
        .map(|&r| {
            let blocks = (capacity as f64 * r).trunc();
            if !(0.0..MAX_SIZE).contains(&blocks) {
                return Err(format!("a miniature of {blocks} blocks (ratio {r})"));
            }
            Ok(((blocks as u64) >> shift).max(1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_keeps_the_smallest_miniature_at_min_blocks() {
        let small = PolicyMiniature::with_capacity("lru", 256).unwrap();
        assert_eq!(small.rate(), 1.0);
        let big = PolicyMiniature::with_capacity("lru", 1 << 20).unwrap();
        assert_eq!(big.rate(), 1.0 / 4096.0);
        assert_eq!(*big.sizes().iter().min().unwrap(), 64);
        let at_10k = PolicyMiniature::with_capacity("mixture", 10_000).unwrap();
        assert_eq!(at_10k.shift(), 5);
        assert!(PolicyMiniature::with_capacity("nope", 100).is_err());
        assert!(PolicyMiniature::new("lru", 100, &[], 64.0, 10, None).is_err());
        assert!(PolicyMiniature::new("lru", 100, &[0.0, 1.0], 64.0, 10, None).is_err());
    }

    #[test]
    fn a_full_queue_drops_its_oldest_chains_and_counts_them() {
        let mut mini = PolicyMiniature::new("lru", 100, &[1.0], 64.0, 1000, Some(0)).unwrap();
        for start in (0..5000).step_by(5) {
            mini.access_chain(start..start + 5);
        }
        assert!(mini.pending().len() <= 1000);
        assert_eq!(mini.pending().len() % 5, 0); // whole chains only
        assert_eq!(mini.dropped() as usize + mini.pending().len(), 5000);
        assert_eq!(*mini.pending().back().unwrap(), 4999);
        assert_eq!(mini.drain(Some(12)), 15); // the last chain whole
        assert_eq!(mini.accesses(), 0); // within the warm-up of 100
        let left = mini.pending().len() as u64;
        assert_eq!(mini.drain(Some(0)), 0);
        assert_eq!(mini.drain(Some(-3)), 0);
        assert_eq!(mini.drain(None), left);
        assert_eq!(mini.drain(None), 0);
        assert_eq!(mini.accesses(), left + 15 - 100);
    }

    #[test]
    fn a_chain_hits_its_cached_prefix_and_evicts_leaves_first() {
        let mut mini =
            PolicyMiniature::new("lru", 3, &[1.0], MIN_BLOCKS, MAX_PENDING, Some(0)).unwrap();
        for chain in [&[1i64, 2][..], &[5], &[7], &[1, 2]] {
            mini.access_chain(chain.iter().copied());
        }
        assert_eq!(mini.drain(None), 6);
        // 7 evicts the least recent leaf, 2, not the older prefix 1 (fed one key at a time,
        // 1 would go): counted after the warm-up of 3 keys, 7 misses and [1, 2] hits 1.
        assert_eq!((mini.accesses(), mini.hits()), (3, &[1u64][..]));
    }

    #[test]
    fn counts_hits_after_the_warm_up_at_every_ratio() {
        let mut mini =
            PolicyMiniature::new("lru", 16, &[1.0, 0.25], MIN_BLOCKS, MAX_PENDING, Some(0))
                .unwrap();
        assert_eq!(mini.ratios(), &[0.25, 1.0]);
        assert_eq!(mini.sizes(), vec![4, 16]);
        for _ in 0..3 {
            mini.access_chain([1i64, 2, 3, 4].into_iter());
        }
        assert_eq!(mini.drain(None), 12);
        assert_eq!((mini.accesses(), mini.hits()), (8, &[8u64, 8][..]));
    }
}
