//! An index from i64 keys to slots of a slab that already stores each slot's key.
//!
//! A `HashMap<i64, u32>` would store every key twice (in the map and in the slab) in 16-byte
//! buckets; this table stores only the 4-byte slot and reads the key back from the slab
//! (`key_of`), which makes the big per-key maps (a shadow's cache, the bounded histories)
//! about a third of the size.
//!
//! A table does not double for tombstones. hashbrown leaves a tombstone where a removed
//! entry sat in a run of full slots, and once tombstones have used up the room left, it
//! doubles any table more than half full: a table whose keys keep changing at a steady
//! size (a full shadow cache, one key in and one out per block; a history at its bound)
//! would double for nothing. Here a table whose room went to tombstones while it holds at
//! most three quarters of what it can hold is rebuilt at its size instead (a new allocation
//! without tombstones, at least a quarter of its room free again); a fuller one grows.

use std::hash::{BuildHasher, Hasher};

use hashbrown::hash_table::Entry;
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
    /// Entries the table holds with no tombstones (hashbrown's `capacity` when new).
    room: usize,
}

impl KeyIndex {
    pub fn with_capacity(capacity: usize) -> Self {
        let table = HashTable::with_capacity(capacity);
        KeyIndex {
            room: table.capacity(),
            table,
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

    /// Before an insert: make room (see [`make_room`]).
    #[inline]
    fn make_room(&mut self, key_of: &impl Fn(u32) -> i64) {
        make_room(&mut self.table, &mut self.room, |&s| hash(key_of(s)));
    }

    /// Point `key` at `slot`; returns the slot it pointed at before.
    #[inline]
    pub fn insert(&mut self, key: i64, slot: u32, key_of: impl Fn(u32) -> i64) -> Option<u32> {
        self.make_room(&key_of);
        match self.table.entry(
            hash(key),
            |&s| key_of(s) == key,
            |_| unreachable!("room made"),
        ) {
            Entry::Occupied(mut found) => Some(std::mem::replace(found.get_mut(), slot)),
            Entry::Vacant(place) => {
                place.insert(slot);
                None
            }
        }
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

    /// Rewrite every slot (the slab was compacted).
    pub fn remap(&mut self, mut f: impl FnMut(u32) -> u32) {
        for s in self.table.iter_mut() {
            *s = f(*s);
        }
    }

    pub fn clear(&mut self) {
        self.table.clear();
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}

/// Before an insert into `table`: rebuild it where its room went to tombstones, grow it where
/// it is full (the rule of the module docstring). `room` is what the table held with no
/// tombstones when last made; `rehash` gives an entry's hash.
#[inline]
pub fn make_room<T>(table: &mut HashTable<T>, room: &mut usize, rehash: impl Fn(&T) -> u64) {
    let len = table.len();
    if len < table.capacity() {
        return;
    }
    let size = if len < *room / 4 * 3 {
        *room
    } else {
        len.max(*room) + 1 // the next size up
    };
    let old = std::mem::replace(table, HashTable::with_capacity(size));
    for entry in old {
        let h = rehash(&entry);
        table.insert_unique(h, entry, |_| unreachable!("sized to fit"));
    }
    *room = table.capacity();
}

/// Heap bytes of a hash map: its buckets (key, value and one control byte each).
pub fn map_bytes<K, V, S>(map: &std::collections::HashMap<K, V, S>) -> usize {
    table_bytes(map.capacity(), std::mem::size_of::<(K, V)>())
}

/// [`map_bytes`] of a set.
pub fn set_bytes<K, S>(set: &std::collections::HashSet<K, S>) -> usize {
    table_bytes(set.capacity(), std::mem::size_of::<K>())
}

/// Bytes of a hashbrown table with room for `cap` entries of `entry` bytes each.
fn table_bytes(cap: usize, entry: usize) -> usize {
    if cap == 0 {
        return 0;
    }
    // hashbrown keeps at most 7/8 of its (power of two) buckets full.
    let buckets = if cap < 8 {
        (cap + 1).next_power_of_two()
    } else {
        (cap * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1) + 16
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

    /// A table at a steady size whose keys keep changing keeps its size.
    #[test]
    fn churn_does_not_grow_the_table() {
        let mut keys: Vec<i64> = Vec::new();
        let mut index = KeyIndex::with_capacity(20_000);
        let bytes = index.memory_bytes();
        let mut x = 88172645463325252u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 1) as i64
        };
        for _ in 0..20_000 {
            keys.push(next());
            let slot = keys.len() as u32 - 1;
            index.insert(keys[slot as usize], slot, |s| keys[s as usize]);
        }
        for i in 0..300_000 {
            let old = keys[i % 20_000];
            index.remove(old, |s| keys[s as usize]);
            keys[i % 20_000] = next();
            let slot = (i % 20_000) as u32;
            index.insert(keys[slot as usize], slot, |s| keys[s as usize]);
        }
        assert_eq!(index.len(), 20_000);
        assert_eq!(index.memory_bytes(), bytes);
        for (slot, &key) in keys.iter().enumerate() {
            assert_eq!(index.get(key, |s| keys[s as usize]), Some(slot as u32));
        }
    }
}
