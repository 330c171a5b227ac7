//! Follows `mrc.py`: the miss-ratio curve, SHARDS-style sampled LRU reuse distances kept in
//! a Fenwick tree over access times.
//!
//! Same state, same steps, same float operations in the same order as the Python class, so
//! a snapshot is bit-identical: the engine feeds it the keys of every accessed block
//! (`access_keys`, what `MissRatioCurve.access_nodes` does with the nodes' keys) and the
//! agent reads `snapshot`. A key is sampled when its low `shift` bits are zero (`key & mask
//! == 0` on the key's two's-complement bits, as Python's `&` on a negative int).

use rustc_hash::FxHashMap;

/// Bucket upper bounds, as multiples of the capacity (`mrc.BOUNDS`).
pub const BOUNDS: [f64; 16] = [
    0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0,
];
/// `mrc.MAX_RATIO`: distances beyond it count as cold, whatever range the curve tracks.
pub const MAX_RATIO: f64 = BOUNDS[BOUNDS.len() - 1];
/// `mrc.MAX_SAMPLES`.
pub const MAX_SAMPLES: f64 = 2048.0;
/// `mrc.MIN_SHIFT`.
pub const MIN_SHIFT: u32 = 3;
/// The largest sampling shift a 64-bit key mask can express.
pub const MAX_SHIFT: u32 = 63;
/// Most keys a curve may track (`limit`): beyond it the parameters are a mistake.
const MAX_LIMIT: f64 = (1u64 << 30) as f64;

/// `mrc.CurveSnapshot`'s fields.
#[derive(Debug, Clone, PartialEq)]
pub struct CurveSnapshot {
    pub capacity: u64,
    pub rate: f64,
    /// Cumulative estimated accesses per bucket, `BOUNDS` order then `+Inf`.
    pub cumulative: Vec<f64>,
    pub distance_sum: f64,
}

/// `mrc.MissRatioCurve`.
#[derive(Debug, Clone)]
pub struct MissRatioCurve {
    capacity: u64,
    shift: u32,
    mask: u64,
    rate: f64,
    scale: f64,
    /// Most keys tracked (`_limit`).
    limit: usize,
    /// Access times before a renumbering (`_size`).
    size: usize,
    /// Fenwick tree over access times 1..=size: 1 where a tracked key was last accessed.
    tree: Vec<u32>,
    key_at: Vec<Option<i64>>,
    last: FxHashMap<i64, u32>,
    now: usize,
    counts: [u64; BOUNDS.len() + 1],
    /// Every access, sampled or not (SHARDS-adj's correction).
    seen: u64,
    distance_sum: f64,
}

/// `1 << shift` as a float (exact: a power of two).
#[inline]
fn pow2(shift: u32) -> f64 {
    (1u64 << shift) as f64
}

impl MissRatioCurve {
    /// `MissRatioCurve(capacity, max_samples=, min_shift=, max_ratio=)`: the lowest rate (at
    /// least `min_shift`) that tracks at most about `max_samples` keys over `max_ratio` x
    /// capacity. `capacity` below 1 counts as 1.
    pub fn new(
        capacity: u64,
        max_samples: f64,
        min_shift: u32,
        max_ratio: f64,
    ) -> Result<Self, String> {
        let capacity = capacity.max(1);
        let span = max_ratio * capacity as f64;
        let mut shift = min_shift;
        if shift > MAX_SHIFT {
            return Err(format!("min_shift: at most {MAX_SHIFT}, got {shift}"));
        }
        while span / pow2(shift) > max_samples {
            if shift == MAX_SHIFT {
                return Err(format!(
                    "max_samples {max_samples} needs a sampling shift beyond {MAX_SHIFT}"
                ));
            }
            shift += 1;
        }
        let tracked = span * (1.0 / pow2(shift));
        if !(0.0..MAX_LIMIT).contains(&tracked) {
            return Err(format!(
                "the curve would track {tracked} keys (max_ratio {max_ratio}, capacity {capacity})"
            ));
        }
        // `int(span * rate) + 1`: truncation toward zero of a non-negative float.
        Self::with_shape(capacity, shift, tracked as usize + 1)
    }

    /// A curve of the given derived shape: `shift` and `limit` as a Python curve holds them
    /// (`shift`, `_limit`), whatever parameters made them.
    pub fn with_shape(capacity: u64, shift: u32, limit: usize) -> Result<Self, String> {
        if shift > MAX_SHIFT {
            return Err(format!("shift: at most {MAX_SHIFT}, got {shift}"));
        }
        if limit as f64 > MAX_LIMIT {
            return Err(format!("limit: at most {MAX_LIMIT}, got {limit}"));
        }
        let capacity = capacity.max(1);
        let size = 2 * limit + 16;
        Ok(MissRatioCurve {
            capacity,
            shift,
            mask: (1u64 << shift) - 1,
            rate: 1.0 / pow2(shift),
            scale: pow2(shift),
            limit,
            size,
            tree: vec![0; size + 1],
            key_at: vec![None; size + 1],
            last: FxHashMap::default(),
            now: 0,
            counts: [0; BOUNDS.len() + 1],
            seen: 0,
            distance_sum: 0.0,
        })
    }

    /// The default curve of a cache of `capacity` blocks.
    pub fn with_capacity(capacity: u64) -> Self {
        Self::new(capacity, MAX_SAMPLES, MIN_SHIFT, MAX_RATIO).expect("the default parameters")
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn shift(&self) -> u32 {
        self.shift
    }

    /// A key is sampled when `key & mask == 0`.
    pub fn mask(&self) -> u64 {
        self.mask
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    /// Most keys tracked (`_limit`).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Accesses counted, sampled or not.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Keys tracked now (`len(curve)`).
    pub fn len(&self) -> usize {
        self.last.len()
    }

    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }

    // ------------------------------------------------------------------ feeding

    /// `access_nodes`: an access to each of `keys`, in order.
    #[inline]
    pub fn access_keys<I: ExactSizeIterator<Item = i64>>(&mut self, keys: I) {
        self.seen += keys.len() as u64;
        let mask = self.mask;
        for key in keys {
            if (key as u64) & mask == 0 {
                self.sampled(key);
            }
        }
    }

    /// `access_sampled`: `count` accesses, of which `keys` (in order) are the sampled ones.
    pub fn access_sampled(&mut self, count: u64, keys: &[i64]) {
        self.seen += count;
        for &key in keys {
            self.sampled(key);
        }
    }

    /// `access`: one access.
    pub fn access(&mut self, key: i64) {
        self.seen += 1;
        if (key as u64) & self.mask == 0 {
            self.sampled(key);
        }
    }

    // ------------------------------------------------------------------ reading

    /// `snapshot(adjusted=...)`: the estimated histogram, SHARDS-adj's correction in the
    /// first bucket when `adjusted` (and the curve is sampled).
    pub fn snapshot(&self, adjusted: bool) -> CurveSnapshot {
        let scale = self.scale;
        let mut run = if self.shift != 0 && adjusted {
            let total: u64 = self.counts.iter().sum();
            self.seen as f64 - total as f64 * scale
        } else {
            0.0
        };
        let mut cumulative = Vec::with_capacity(self.counts.len());
        for &count in &self.counts {
            run += count as f64 * scale;
            // Python's max(run, 0.0): run unless 0.0 is greater.
            cumulative.push(if 0.0 > run { 0.0 } else { run });
        }
        CurveSnapshot {
            capacity: self.capacity,
            rate: self.rate,
            cumulative,
            distance_sum: self.distance_sum * self.scale,
        }
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.tree.capacity() * 4
            + self.key_at.capacity() * std::mem::size_of::<Option<i64>>()
            + self.last.capacity() * (std::mem::size_of::<(i64, u32)>() + 1)
    }

    // ------------------------------------------------------------------ internals

    fn sampled(&mut self, key: i64) {
        let size = self.size;
        if let Some(before) = self.last.remove(&key) {
            // Distinct keys touched since this one: the live marks after its own.
            let before = before as usize;
            let (mut i, mut seen) = (before, 0u64);
            while i > 0 {
                seen += self.tree[i] as u64;
                i &= i - 1;
            }
            let newer = (self.last.len() as u64 + 1) - seen;
            self.bucket((newer as f64 * self.scale + 1.0) / self.capacity as f64);
            let mut i = before;
            while i <= size {
                self.tree[i] -= 1;
                i += i & i.wrapping_neg();
            }
            self.key_at[before] = None;
        } else {
            self.counts[BOUNDS.len()] += 1;
        }
        if self.now >= size {
            self.compact();
        }
        self.now += 1;
        let t = self.now;
        self.last.insert(key, t as u32);
        self.key_at[t] = Some(key);
        self.add(t);
        if self.last.len() > self.limit {
            self.forget_oldest();
        }
    }

    fn bucket(&mut self, ratio: f64) {
        if ratio > MAX_RATIO {
            self.counts[BOUNDS.len()] += 1;
            return;
        }
        // The first bound >= ratio.
        let at = BOUNDS.partition_point(|&b| b < ratio);
        self.counts[at] += 1;
        self.distance_sum += ratio;
    }

    #[inline]
    fn add(&mut self, mut i: usize) {
        while i <= self.size {
            self.tree[i] += 1;
            i += i & i.wrapping_neg();
        }
    }

    fn forget_oldest(&mut self) {
        // The first time with a live mark: descend the Fenwick tree for prefix sum 1.
        let size = self.size;
        let mut pos = 0usize;
        let mut step = 1usize << (usize::BITS - size.leading_zeros());
        let mut remaining = 1u32;
        while step > 0 {
            let next = pos + step;
            if next <= size && self.tree[next] < remaining {
                pos = next;
                remaining -= self.tree[next];
            }
            step >>= 1;
        }
        let oldest = pos + 1;
        let key = self.key_at[oldest]
            .take()
            .expect("the oldest mark has a key");
        let mut i = oldest;
        while i <= size {
            self.tree[i] -= 1;
            i += i & i.wrapping_neg();
        }
        self.last.remove(&key);
    }

    /// Renumber the live access times 1..n in order (times ran out).
    fn compact(&mut self) {
        let order: Vec<i64> = self.key_at.iter().flatten().copied().collect();
        self.tree.iter_mut().for_each(|c| *c = 0);
        self.key_at.iter_mut().for_each(|k| *k = None);
        for (i, &key) in order.iter().enumerate() {
            let t = i + 1;
            self.last.insert(key, t as u32);
            self.key_at[t] = Some(key);
            self.add(t);
        }
        self.now = order.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exact LRU stack: the distance of each access (None: first).
    fn distances(trace: &[i64]) -> Vec<Option<usize>> {
        let mut stack: Vec<i64> = Vec::new();
        trace
            .iter()
            .map(|&key| {
                let found = stack.iter().rposition(|&k| k == key);
                if let Some(at) = found {
                    stack.remove(at);
                }
                stack.push(key);
                found.map(|at| stack.len() - 1 - at)
            })
            .collect()
    }

    #[test]
    fn unsampled_distances_are_exact() {
        let capacity = 10;
        let mut curve = MissRatioCurve::new(capacity, MAX_SAMPLES, 0, MAX_RATIO).unwrap();
        assert_eq!((curve.shift(), curve.mask(), curve.rate()), (0, 0, 1.0));
        let trace: Vec<i64> = (0..2000).map(|i| ((i * 7919) % 37) as i64 - 18).collect();
        for &key in &trace {
            curve.access(key);
        }
        let mut counts = [0u64; BOUNDS.len() + 1];
        for d in distances(&trace) {
            match d {
                Some(d) if (d as f64 + 1.0) / capacity as f64 <= MAX_RATIO => {
                    let ratio = (d as f64 + 1.0) / capacity as f64;
                    counts[BOUNDS.partition_point(|&b| b < ratio)] += 1;
                }
                _ => counts[BOUNDS.len()] += 1,
            }
        }
        let snap = curve.snapshot(true);
        let mut run = 0.0;
        let want: Vec<f64> = counts
            .iter()
            .map(|&c| {
                run += c as f64;
                run
            })
            .collect();
        assert_eq!(snap.cumulative, want);
        assert_eq!(snap.cumulative[BOUNDS.len()], trace.len() as f64);
    }

    #[test]
    fn tracked_keys_stay_bounded_through_renumbering() {
        let mut curve = MissRatioCurve::new(100, MAX_SAMPLES, 0, MAX_RATIO).unwrap();
        assert_eq!(curve.limit(), 401);
        for round in 0..3 {
            for key in 1..=2000i64 {
                curve.access(key * (round + 1));
            }
        }
        assert!(curve.len() <= 401);
        let snap = curve.snapshot(false);
        assert_eq!(snap.cumulative[BOUNDS.len() - 1], 0.0);
        assert_eq!(snap.cumulative[BOUNDS.len()], 6000.0);
    }

    #[test]
    fn the_rate_falls_with_the_capacity_and_sampled_keys_scale() {
        let curve = MissRatioCurve::with_capacity(100_000);
        // 400,000 keys over at most 2048 samples: 1 in 256.
        assert_eq!(curve.shift(), 8);
        assert_eq!(MissRatioCurve::with_capacity(16).shift(), MIN_SHIFT);
        assert_eq!(MissRatioCurve::with_capacity(0).capacity(), 1);
        let mut curve = MissRatioCurve::new(64, MAX_SAMPLES, 3, MAX_RATIO).unwrap();
        curve.access_keys([8i64, 1, 8, 2].into_iter());
        let snap = curve.snapshot(true);
        // Two sampled accesses (8 twice) stand for 16; the other two adjust the first bucket.
        assert_eq!(*snap.cumulative.last().unwrap(), 4.0);
        assert!(MissRatioCurve::new(64, 0.0, 3, MAX_RATIO).is_err());
        assert!(MissRatioCurve::new(64, MAX_SAMPLES, 64, MAX_RATIO).is_err());
    }
}
