//! A set of i64 keys that iterates in the order a CPython `set` of those ints would.
//!
//! `MixturePolicy.flush` re-buckets the blocks of the keys in `_dirty` (a `set`) in the
//! set's iteration order, and each re-bucketed block gets the next sequence number of its
//! level queue. In the engine no two queued blocks share a `last_used` tick, so the order
//! never decides a victim there; but a record store may give two blocks the same tick, and
//! then the block re-bucketed first is evicted first. To stay exact for every store, this
//! set reproduces CPython's table (`Objects/setobject.c`, 3.11: linear probes of 9 then
//! perturbed open addressing, growth at 3/5 full to 4x the used entries) for the only
//! operations `_dirty` sees, `add` and `clear`; iteration walks the table in slot order.
//! `tests/native` checks the order against the running interpreter's own sets.

use crate::pyhash::hash_int;

const MIN_SIZE: usize = 8;
/// Tables up to this many slots are kept by `clear` (CPython frees any table beyond the
/// minimum; a small one is kept here so that a set cleared often does not reallocate).
const KEPT_SLOTS: usize = 1024;
const LINEAR_PROBES: usize = 9;
const PERTURB_SHIFT: u32 = 5;

/// A table slot; `hash == EMPTY` marks a free one (CPython never hashes an int to -1).
#[derive(Debug, Clone, Copy)]
struct Slot {
    key: i64,
    hash: i64,
}

const EMPTY: i64 = -1;

impl Slot {
    const FREE: Slot = Slot {
        key: 0,
        hash: EMPTY,
    };

    #[inline]
    fn full(&self) -> bool {
        self.hash != EMPTY
    }
}

#[derive(Debug, Clone)]
pub struct PySet {
    table: Vec<Slot>,
    mask: usize,
    /// Slots ever filled since the last resize or clear (no deletions: equal to `used`).
    fill: usize,
    used: usize,
}

impl Default for PySet {
    fn default() -> Self {
        PySet {
            table: vec![Slot::FREE; MIN_SIZE],
            mask: MIN_SIZE - 1,
            fill: 0,
            used: 0,
        }
    }
}

impl PySet {
    #[inline]
    pub fn len(&self) -> usize {
        self.used
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.used == 0
    }

    /// `set.add(key)`.
    pub fn add(&mut self, key: i64) {
        let hash = hash_int(key);
        let mask = self.mask;
        let mut i = hash as u64 as usize & mask;
        let mut perturb = hash as u64;
        loop {
            let probes = if i + LINEAR_PROBES <= mask {
                LINEAR_PROBES
            } else {
                0
            };
            for at in i..=i + probes {
                let slot = self.table[at];
                if !slot.full() {
                    self.table[at] = Slot { key, hash };
                    self.fill += 1;
                    self.used += 1;
                    if self.fill * 5 >= mask * 3 {
                        let used = self.used;
                        self.resize(if used > 50_000 { used * 2 } else { used * 4 });
                    }
                    return;
                }
                if slot.hash == hash && slot.key == key {
                    return;
                }
            }
            perturb >>= PERTURB_SHIFT;
            i = (i
                .wrapping_mul(5)
                .wrapping_add(1)
                .wrapping_add(perturb as usize))
                & mask;
        }
    }

    /// `set.clear()`: back to the empty minimum table, the memory of a large one freed.
    pub fn clear(&mut self) {
        if self.used == 0 && self.mask == MIN_SIZE - 1 {
            return;
        }
        if self.table.capacity() > KEPT_SLOTS {
            self.table = vec![Slot::FREE; MIN_SIZE];
        } else {
            self.table.clear();
            self.table.resize(MIN_SIZE, Slot::FREE);
        }
        self.mask = MIN_SIZE - 1;
        self.fill = 0;
        self.used = 0;
    }

    /// Keys in the order `for key in set` gives them.
    pub fn iter(&self) -> impl Iterator<Item = i64> + '_ {
        self.table.iter().filter(|s| s.full()).map(|s| s.key)
    }

    fn resize(&mut self, min_used: usize) {
        let mut size = MIN_SIZE;
        while size <= min_used {
            size <<= 1;
        }
        let old = std::mem::replace(&mut self.table, vec![Slot::FREE; size]);
        self.mask = size - 1;
        for slot in old.into_iter().filter(Slot::full) {
            self.insert_clean(slot);
        }
        self.fill = self.used;
    }

    /// `set_insert_clean`: place a key known to be absent (after a resize).
    fn insert_clean(&mut self, slot: Slot) {
        let mask = self.mask;
        let mut i = slot.hash as u64 as usize & mask;
        let mut perturb = slot.hash as u64;
        loop {
            let probes = if i + LINEAR_PROBES <= mask {
                LINEAR_PROBES
            } else {
                0
            };
            for at in i..=i + probes {
                if !self.table[at].full() {
                    self.table[at] = slot;
                    return;
                }
            }
            perturb >>= PERTURB_SHIFT;
            i = (i
                .wrapping_mul(5)
                .wrapping_add(1)
                .wrapping_add(perturb as usize))
                & mask;
        }
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.table.capacity() * std::mem::size_of::<Slot>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // `list(s)` in CPython 3.11 after `s = set(); [s.add(k) for k in (17, 9, 1, -3, 2**40, 8, 0, 25, 33)]`
    // is [2**40, 1, 0, 33, 8, 9, 17, 25, -3] (see tests/native for the differential check).
    #[test]
    fn iterates_like_cpython() {
        let mut s = PySet::default();
        for k in [17, 9, 1, -3, 1 << 40, 8, 0, 25, 33] {
            s.add(k);
        }
        s.add(9);
        let order: Vec<i64> = s.iter().collect();
        assert_eq!(order, vec![1 << 40, 1, 0, 33, 8, 9, 17, 25, -3]);
        s.clear();
        assert!(s.is_empty());
        assert_eq!(s.iter().count(), 0);
        for k in 0..10_000 {
            s.add(k);
        }
        s.clear();
        assert!(
            s.memory_bytes() <= KEPT_SLOTS * 16,
            "a cleared set frees its table"
        );
    }
}
