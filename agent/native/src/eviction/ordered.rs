//! An i64-keyed map in insertion order, with the order rules of Python's `dict` and
//! `OrderedDict`: assigning to a present key keeps its place, a removed key that comes back
//! goes to the end.
//!
//! The Python policies depend on that order where they iterate or drop the oldest: LRFU's
//! and ARC's bounded histories (`popitem(last=False)`), reuse-gap's `_forget` (a stable sort
//! of the chains), the mixture's re-bucketing on a change of leader (`_where`). Entries sit
//! in a vector in order, removed ones leave a hole; the holes are squeezed out (order kept)
//! once they outnumber the entries.

use rustc_hash::FxHashMap;

#[derive(Debug, Clone)]
pub struct OrderedMap<V> {
    slots: Vec<Option<(i64, V)>>,
    /// Key -> its slot.
    index: FxHashMap<i64, u32>,
    /// Slots before this one are all holes (where `pop_front` starts looking).
    head: usize,
}

impl<V> Default for OrderedMap<V> {
    fn default() -> Self {
        OrderedMap {
            slots: Vec::new(),
            index: FxHashMap::default(),
            head: 0,
        }
    }
}

impl<V> OrderedMap<V> {
    #[inline]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    #[inline]
    pub fn contains_key(&self, key: i64) -> bool {
        self.index.contains_key(&key)
    }

    #[inline]
    pub fn get(&self, key: i64) -> Option<&V> {
        let at = *self.index.get(&key)?;
        self.slots[at as usize].as_ref().map(|(_, v)| v)
    }

    #[inline]
    pub fn get_mut(&mut self, key: i64) -> Option<&mut V> {
        let at = *self.index.get(&key)?;
        self.slots[at as usize].as_mut().map(|(_, v)| v)
    }

    /// `d[key] = value`: in place when present, else at the end.
    #[inline]
    pub fn insert(&mut self, key: i64, value: V) {
        if let Some(&at) = self.index.get(&key) {
            self.slots[at as usize] = Some((key, value));
            return;
        }
        self.index.insert(key, self.slots.len() as u32);
        self.slots.push(Some((key, value)));
    }

    /// `d.pop(key, None)`.
    #[inline]
    pub fn remove(&mut self, key: i64) -> Option<V> {
        let at = self.index.remove(&key)? as usize;
        let (_, value) = self.slots[at].take()?;
        self.squeeze();
        Some(value)
    }

    /// `d.popitem(last=False)`: the oldest entry.
    #[inline]
    pub fn pop_front(&mut self) -> Option<(i64, V)> {
        while self.head < self.slots.len() {
            let at = self.head;
            self.head += 1;
            if let Some((key, value)) = self.slots[at].take() {
                self.index.remove(&key);
                self.squeeze();
                return Some((key, value));
            }
        }
        None
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (i64, &V)> + '_ {
        self.slots[self.head.min(self.slots.len())..]
            .iter()
            .filter_map(|s| s.as_ref().map(|(k, v)| (*k, v)))
    }

    /// Keep the entries `keep` accepts, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(i64, &V) -> bool) {
        for slot in self.slots.iter_mut() {
            if let Some((k, v)) = slot {
                if !keep(*k, v) {
                    self.index.remove(k);
                    *slot = None;
                }
            }
        }
        self.squeeze();
    }

    /// Drop the holes once they outnumber the entries.
    #[inline]
    fn squeeze(&mut self) {
        let live = self.index.len();
        if self.slots.len() < 32 || self.slots.len() <= 2 * live {
            return;
        }
        self.slots.retain(Option::is_some);
        self.head = 0;
        for (at, slot) in self.slots.iter().enumerate() {
            if let Some((k, _)) = slot {
                self.index.insert(*k, at as u32);
            }
        }
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Option<(i64, V)>>() + map_bytes(&self.index)
    }
}

/// Heap bytes of a hash map: its buckets (key, value and one control byte each).
pub fn map_bytes<K, V, S>(map: &std::collections::HashMap<K, V, S>) -> usize {
    let cap = map.capacity();
    if cap == 0 {
        return 0;
    }
    // hashbrown keeps at most 7/8 of its (power of two) buckets full.
    let buckets = if cap < 8 {
        (cap + 1).next_power_of_two()
    } else {
        (cap * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<(K, V)>() + 1) + 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_python_dict_order() {
        let mut m = OrderedMap::default();
        for k in 0..100 {
            m.insert(k, k * 10);
        }
        m.insert(5, 0); // stays in place
        for k in 10..90 {
            m.remove(k);
        }
        m.insert(12, 1); // back at the end
        let order: Vec<i64> = m.iter().map(|(k, _)| k).collect();
        let mut want: Vec<i64> = (0..10).chain(90..100).collect();
        want.push(12);
        assert_eq!(order, want);
        assert_eq!(m.get(5), Some(&0));
        assert_eq!(m.pop_front(), Some((0, 0)));
        assert_eq!(m.pop_front(), Some((1, 10)));
        m.retain(|k, _| k % 2 == 0);
        let order: Vec<i64> = m.iter().map(|(k, _)| k).collect();
        assert_eq!(order, vec![2, 4, 6, 8, 90, 92, 94, 96, 98, 12]);
        assert_eq!(m.len(), 10);
    }
}
