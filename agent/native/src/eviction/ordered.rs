//! An i64-keyed map in insertion order, with the order rules of Python's `dict` and
//! `OrderedDict`: assigning to a present key keeps its place, a removed key that comes back
//! goes to the end.
//!
//! Entries are a doubly linked list in a slab (freed slots reused), indexed by key with
//! [`KeyIndex`]: every operation is O(1) and an entry costs its key, its value and two
//! links. The policies keep their ordered maps in [`RingMap`]s (no links), and this map is
//! kept for the tests, as the plain reference a ring's order is checked against.
//!
//! [`RingMap`]: super::ring::RingMap

use super::keyed::KeyIndex;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Slot<V> {
    key: i64,
    prev: u32,
    next: u32,
    value: V,
}

#[derive(Debug, Clone)]
pub struct OrderedMap<V> {
    slots: Vec<Slot<V>>,
    index: KeyIndex,
    /// Freed slots, reused before the slab grows.
    free: Vec<u32>,
    head: u32,
    tail: u32,
    /// Most entries the owner ever keeps (0: no bound): the slab grows to it, not past it.
    limit: usize,
}

impl<V> Default for OrderedMap<V> {
    fn default() -> Self {
        Self::with_limit(0)
    }
}

impl<V> OrderedMap<V> {
    /// A map its owner keeps to at most `limit` entries (a bounded history), so that the
    /// slab's last doubling stops at the bound.
    pub fn with_limit(limit: usize) -> Self {
        OrderedMap {
            slots: Vec::new(),
            index: KeyIndex::default(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            limit,
        }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.index.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    #[inline]
    fn find(&self, key: i64) -> Option<u32> {
        let slots = &self.slots;
        self.index.get(key, |s| slots[s as usize].key)
    }

    #[inline]
    pub fn get(&self, key: i64) -> Option<&V> {
        self.find(key).map(|s| &self.slots[s as usize].value)
    }

    /// `d[key] = value`: in place when present, else at the end.
    #[inline]
    pub fn insert(&mut self, key: i64, value: V) {
        if let Some(at) = self.find(key) {
            self.slots[at as usize].value = value;
            return;
        }
        let slot = Slot {
            key,
            prev: self.tail,
            next: NIL,
            value,
        };
        let at = match self.free.pop() {
            Some(at) => {
                self.slots[at as usize] = slot;
                at
            }
            None => {
                let len = self.slots.len();
                if len == self.slots.capacity() && self.limit > len {
                    let want = (2 * len).max(8).min(self.limit);
                    self.slots.reserve_exact(want - len);
                }
                self.slots.push(slot);
                len as u32
            }
        };
        match self.tail {
            NIL => self.head = at,
            tail => self.slots[tail as usize].next = at,
        }
        self.tail = at;
        let slots = &self.slots;
        self.index.insert(key, at, |s| slots[s as usize].key);
    }

    /// `d.pop(key, None)`.
    #[inline]
    pub fn remove(&mut self, key: i64) -> Option<V>
    where
        V: Copy,
    {
        let slots = &self.slots;
        let at = self.index.remove(key, |s| slots[s as usize].key)?;
        Some(self.unlink(at))
    }

    /// `d.popitem(last=False)`: the oldest entry.
    #[inline]
    pub fn pop_front(&mut self) -> Option<(i64, V)>
    where
        V: Copy,
    {
        let at = self.head;
        if at == NIL {
            return None;
        }
        let key = self.slots[at as usize].key;
        let slots = &self.slots;
        self.index.remove(key, |s| slots[s as usize].key);
        Some((key, self.unlink(at)))
    }

    fn unlink(&mut self, at: u32) -> V
    where
        V: Copy,
    {
        let Slot {
            prev, next, value, ..
        } = self.slots[at as usize];
        match prev {
            NIL => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
        self.free.push(at);
        if self.index.is_empty() {
            // Empty: let the slab start over (keeps `free` from outgrowing the entries).
            self.slots.clear();
            self.free.clear();
        }
        value
    }

    /// Entries in order.
    pub fn iter(&self) -> Iter<'_, V> {
        Iter {
            map: self,
            at: self.head,
        }
    }

    /// Keep the entries `keep` accepts, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(i64, &V) -> bool)
    where
        V: Copy,
    {
        let mut at = self.head;
        while at != NIL {
            let slot = &self.slots[at as usize];
            let (key, next) = (slot.key, slot.next);
            if !keep(key, &slot.value) {
                self.remove(key);
            }
            at = next;
        }
    }
}

pub struct Iter<'a, V> {
    map: &'a OrderedMap<V>,
    at: u32,
}

impl<'a, V> Iterator for Iter<'a, V> {
    type Item = (i64, &'a V);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.at == NIL {
            return None;
        }
        let slot = &self.map.slots[self.at as usize];
        self.at = slot.next;
        Some((slot.key, &slot.value))
    }
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
        while m.pop_front().is_some() {}
        assert!(m.is_empty() && m.iter().next().is_none());
        m.insert(7, 70);
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![(7, &70)]);
    }
}
