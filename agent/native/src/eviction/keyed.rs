//! An index from i64 keys to slots of a slab that already stores each slot's key.
//!
//! A `HashMap<i64, u32>` would store every key twice (in the map and in the slab) in 16-byte
//! buckets; this table stores only the 4-byte slot and reads the key back from the slab
//! (`key_of`), which makes the big per-key maps (a shadow's cache, the bounded histories)
//! about a third of the size.
//!
//! A table keeps the size it was reserved at. hashbrown leaves a tombstone where a removed
//! entry sat in a run of full slots, and once tombstones have used up the room left, it
//! doubles a table more than half full: a table at its reserved size whose keys keep
//! changing (a shadow's cache, full, one key in and one out per block) would double for
//! nothing. Here a table whose room went to tombstones is rebuilt at its reserved size
//! instead.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashTable;
use rustc_hash::FxBuildHasher;

#[inline]
fn hash(key: i64) -> u64 {
    let mut h = FxBuildHasher.build_hasher();
    h.write_i64(key);
    h.finish()
}

#[derive(Debug, Clone, Default)]
pub struct KeyIndex {
    table: HashTable<u32>,
    /// Entries the table was sized for: it is rebuilt, not grown, while it holds fewer.
    reserved: usize,
}

impl KeyIndex {
    pub fn with_capacity(capacity: usize) -> Self {
        KeyIndex {
            table: HashTable::with_capacity(capacity),
            reserved: capacity,
        }
    }

    /// Size the table for `capacity` entries (it grows past them as needed).
    pub fn reserve_to(&mut self, capacity: usize, key_of: impl Fn(u32) -> i64) {
        if capacity > self.reserved {
            self.reserved = capacity;
            let more = capacity.saturating_sub(self.table.len());
            self.table.reserve(more, |&s| hash(key_of(s)));
        }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.table.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The slot of `key`.
    #[inline]
    pub fn get(&self, key: i64, key_of: impl Fn(u32) -> i64) -> Option<u32> {
        self.table.find(hash(key), |&s| key_of(s) == key).copied()
    }

    /// Point `key` at `slot`; returns the slot it pointed at before.
    #[inline]
    pub fn insert(&mut self, key: i64, slot: u32, key_of: impl Fn(u32) -> i64) -> Option<u32> {
        let h = hash(key);
        if let Some(found) = self.table.find_mut(h, |&s| key_of(s) == key) {
            return Some(std::mem::replace(found, slot));
        }
        let len = self.table.len();
        if len == self.table.capacity() && len < self.reserved {
            // No room left, tombstones having taken it: rebuild the table at its size.
            let old = std::mem::replace(&mut self.table, HashTable::with_capacity(self.reserved));
            for s in old {
                self.table
                    .insert_unique(hash(key_of(s)), s, |_| unreachable!());
            }
        }
        self.table.insert_unique(h, slot, |&s| hash(key_of(s)));
        None
    }

    /// Forget `key`; returns its slot.
    #[inline]
    pub fn remove(&mut self, key: i64, key_of: impl Fn(u32) -> i64) -> Option<u32> {
        match self.table.find_entry(hash(key), |&s| key_of(s) == key) {
            Ok(entry) => Some(entry.remove().0),
            Err(_) => None,
        }
    }

    /// The slots, in no particular order.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter().copied()
    }

    pub fn clear(&mut self) {
        self.table.clear();
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_keys_to_slots() {
        let keys: Vec<i64> = (0..1000).map(|i| i * 7919 - 500_000).collect();
        let mut index = KeyIndex::default();
        for (slot, &key) in keys.iter().enumerate() {
            assert_eq!(index.insert(key, slot as u32, |s| keys[s as usize]), None);
        }
        assert_eq!(index.len(), 1000);
        assert_eq!(index.get(keys[17], |s| keys[s as usize]), Some(17));
        assert_eq!(index.remove(keys[17], |s| keys[s as usize]), Some(17));
        assert_eq!(index.get(keys[17], |s| keys[s as usize]), None);
        assert_eq!(index.insert(keys[3], 3, |s| keys[s as usize]), Some(3));
        assert_eq!(index.len(), 999);
    }
}
