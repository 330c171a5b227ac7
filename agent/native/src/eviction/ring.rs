//! An i64-keyed map in insertion order, kept as a ring of entries: the big histories of the
//! shadows' orders (LRFU's keys, ARC's ghosts, reuse-gap's chains).
//!
//! It has the order rules of Python's `dict` and `OrderedDict` (assigning to a present key
//! keeps its place, a key removed and added again goes to the end, the oldest entry is
//! popped first), on which the policies depend where they iterate or drop the oldest: LRFU's
//! and ARC's bounded histories (`popitem(last=False)`), reuse-gap's `_forget` (a stable sort
//! of the chains), the mixture's re-bucketing on a change of leader (`_where`). Entries sit in a
//! circular array in order, the oldest at `head`; a removed entry leaves a hole (a bit in
//! `dead`) until the head passes it or the ring is compacted, which copies the live entries
//! in order into a new array and rewrites the index's slots. An entry costs its key, its
//! value, a bit, and its slot in the [`KeyIndex`].
//!
//! The ring grows by a quarter until its `limit` (the most entries its owner keeps, plus one:
//! a bounded history lands on its bound, not past it), and by an eighth past it. A full ring
//! whose holes are an eighth of it is compacted instead of grown: the holes of a history
//! whose keys come back cost at most about a seventh of its entries, and compaction about
//! eight copies (of an entry and of its index slot) per hole.
//!
//! Values live in a [`Payloads`] store: [`Plain`] keeps them as they are; LRFU's
//! [`TickCrf`] keeps a tick in 32 bits and a `C` of exactly 1.0 in none. (The tests check
//! every order against a plain linked map, `ordered.rs`.)

use rustc_hash::FxHashMap;

use super::keyed::map_bytes;
use super::keyed::KeyIndex;

/// Where a ring keeps its entries' values, by position.
pub trait Payloads {
    type Value: Copy;
    /// An empty store of `capacity` positions, configured like this one (what a compaction
    /// copies into).
    fn empty_like(&self, capacity: usize) -> Self;
    fn get(&self, pos: usize) -> Self::Value;
    fn put(&mut self, pos: usize, value: Self::Value);
    /// `put(to, src.get(from))`, into a store made by `src.empty_like` (a compaction).
    #[inline]
    fn copy_from(&mut self, to: usize, src: &Self, from: usize) {
        self.put(to, src.get(from));
    }
    /// Whether `value` can be put as the store stands; if not, [`Payloads::make_fit`] changes
    /// the store, keeping the values of the positions `live` accepts, so that it can.
    #[inline]
    fn fits(&self, _value: &Self::Value) -> bool {
        true
    }
    fn make_fit(&mut self, _value: &Self::Value, _live: &dyn Fn(usize) -> bool) {}
    fn memory_bytes(&self) -> usize;
}

/// Values kept as they are.
#[derive(Debug, Clone, Default)]
pub struct Plain<V>(Vec<V>);

impl<V: Copy + Default> Payloads for Plain<V> {
    type Value = V;

    fn empty_like(&self, capacity: usize) -> Self {
        Plain(vec![V::default(); capacity])
    }

    #[inline]
    fn get(&self, pos: usize) -> V {
        self.0[pos]
    }

    #[inline]
    fn put(&mut self, pos: usize, value: V) {
        self.0[pos] = value;
    }

    fn memory_bytes(&self) -> usize {
        self.0.capacity() * std::mem::size_of::<V>()
    }
}

/// Positions per chunk of `C` values in [`TickCrf`] (the keys seen again cluster: on the
/// synthetic trace 42% of LRFU's history has a `C` other than 1.0, in half the chunks of 16).
const CRF_CHUNK: usize = 64;
/// The offset that says "the tick is in `far`".
const FAR: u32 = u32::MAX;

/// LRFU's `(tick, C)` per position, in 4 bytes where `C` is exactly 1.0 (a key seen once,
/// or whose uses have all decayed away).
///
/// A tick is kept as its offset from `base`, below `span` (`u32::MAX`); a tick that falls
/// outside (one that stayed in the history while more than `span / 2` ticks passed) is kept
/// whole in `far`, by position. When a new tick does not fit, `base` moves up to `span / 2`
/// below it and every offset is rewritten: once every `2**31` ticks at most. `C` is kept per
/// chunk of [`CRF_CHUNK`] positions, a chunk allocated once one of its positions holds a `C`
/// other than 1.0 (a compaction allocates only the chunks its entries need).
#[derive(Debug, Clone)]
pub struct TickCrf {
    base: u64,
    span: u64,
    offsets: Vec<u32>,
    far: FxHashMap<u32, u64>,
    crf: Vec<Option<Box<[f64; CRF_CHUNK]>>>,
}

impl TickCrf {
    /// Ticks kept in 32 bits.
    pub fn new() -> Self {
        Self::with_span(FAR as u64)
    }

    /// Ticks kept as offsets below `span` (tests lower it to reach the rebasing).
    pub fn with_span(span: u64) -> Self {
        assert!((2..=FAR as u64).contains(&span));
        TickCrf {
            base: 0,
            span,
            offsets: Vec::new(),
            far: FxHashMap::default(),
            crf: Vec::new(),
        }
    }

    /// Positions whose tick is kept whole.
    pub fn far_len(&self) -> usize {
        self.far.len()
    }
}

impl Default for TickCrf {
    fn default() -> Self {
        Self::new()
    }
}

impl Payloads for TickCrf {
    type Value = (u64, f64);

    fn empty_like(&self, capacity: usize) -> Self {
        TickCrf {
            base: self.base,
            span: self.span,
            offsets: vec![0; capacity],
            far: FxHashMap::default(),
            crf: vec![None; capacity.div_ceil(CRF_CHUNK)],
        }
    }

    #[inline]
    fn get(&self, pos: usize) -> (u64, f64) {
        let off = self.offsets[pos];
        let tick = if off == FAR {
            self.far[&(pos as u32)]
        } else {
            self.base + off as u64
        };
        let crf = match &self.crf[pos / CRF_CHUNK] {
            Some(chunk) => chunk[pos % CRF_CHUNK],
            None => 1.0,
        };
        (tick, crf)
    }

    #[inline]
    fn put(&mut self, pos: usize, (tick, crf): (u64, f64)) {
        if self.offsets[pos] == FAR {
            self.far.remove(&(pos as u32));
        }
        if tick >= self.base && tick - self.base < self.span {
            self.offsets[pos] = (tick - self.base) as u32;
        } else {
            self.offsets[pos] = FAR;
            self.far.insert(pos as u32, tick);
        }
        let chunk = &mut self.crf[pos / CRF_CHUNK];
        if crf.to_bits() == 1.0f64.to_bits() {
            if let Some(chunk) = chunk {
                chunk[pos % CRF_CHUNK] = 1.0;
            }
        } else {
            chunk.get_or_insert_with(|| Box::new([1.0; CRF_CHUNK]))[pos % CRF_CHUNK] = crf;
        }
    }

    #[inline]
    fn copy_from(&mut self, to: usize, src: &Self, from: usize) {
        // Same base: the offset as it is (a tick kept whole stays whole).
        let off = src.offsets[from];
        self.offsets[to] = off;
        if off == FAR {
            self.far.insert(to as u32, src.far[&(from as u32)]);
        }
        if let Some(chunk) = &src.crf[from / CRF_CHUNK] {
            let crf = chunk[from % CRF_CHUNK];
            if crf.to_bits() != 1.0f64.to_bits() {
                self.crf[to / CRF_CHUNK].get_or_insert_with(|| Box::new([1.0; CRF_CHUNK]))
                    [to % CRF_CHUNK] = crf;
            }
        }
    }

    #[inline]
    fn fits(&self, &(tick, _): &(u64, f64)) -> bool {
        tick < self.base.saturating_add(self.span)
    }

    fn make_fit(&mut self, &(tick, _): &(u64, f64), live: &dyn Fn(usize) -> bool) {
        let base = tick - self.span / 2;
        for (pos, off) in self.offsets.iter_mut().enumerate() {
            if *off == FAR || !live(pos) {
                continue;
            }
            let was = self.base + *off as u64;
            if was < base {
                self.far.insert(pos as u32, was);
                *off = FAR;
            } else {
                *off = (was - base) as u32;
            }
        }
        self.base = base;
    }

    fn memory_bytes(&self) -> usize {
        self.offsets.capacity() * 4
            + map_bytes(&self.far)
            + self.crf.capacity() * std::mem::size_of::<Option<Box<[f64; CRF_CHUNK]>>>()
            + self.crf.iter().flatten().count() * std::mem::size_of::<[f64; CRF_CHUNK]>()
    }
}

#[derive(Debug, Clone)]
pub struct RingMap<P> {
    /// The ring's keys (its length is the ring's capacity).
    keys: Vec<i64>,
    values: P,
    /// One bit per position: a removed entry not yet passed by the head or compacted away.
    dead: Vec<u64>,
    /// Key -> position.
    index: KeyIndex,
    head: usize,
    /// Positions in use from `head` on, holes included.
    used: usize,
    live: usize,
    /// Most entries the owner keeps (0: no bound).
    limit: usize,
}

impl<P: Payloads + Default> Default for RingMap<P> {
    fn default() -> Self {
        Self::with_limit(0)
    }
}

impl<P: Payloads + Default> RingMap<P> {
    /// A map its owner keeps to at most `limit` entries (0: no bound).
    pub fn with_limit(limit: usize) -> Self {
        Self::with_values(P::default(), limit)
    }
}

impl<P: Payloads> RingMap<P> {
    /// A map over the (empty) value store `values`.
    pub fn with_values(values: P, limit: usize) -> Self {
        RingMap {
            keys: Vec::new(),
            values: values.empty_like(0),
            dead: Vec::new(),
            index: KeyIndex::default(),
            head: 0,
            used: 0,
            live: 0,
            limit,
        }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.live
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The physical position of the `i`-th position from the head.
    #[inline]
    fn at(&self, i: usize) -> usize {
        let p = self.head + i;
        if p >= self.keys.len() {
            p - self.keys.len()
        } else {
            p
        }
    }

    #[inline]
    fn is_dead(&self, p: usize) -> bool {
        self.dead[p / 64] & (1 << (p % 64)) != 0
    }

    #[inline]
    fn find(&self, key: i64) -> Option<usize> {
        let keys = &self.keys;
        self.index
            .get(key, |s| keys[s as usize])
            .map(|s| s as usize)
    }

    #[inline]
    pub fn contains_key(&self, key: i64) -> bool {
        self.find(key).is_some()
    }

    #[inline]
    pub fn get(&self, key: i64) -> Option<P::Value> {
        self.find(key).map(|p| self.values.get(p))
    }

    /// Put `value` at the free position `p` (the tail), for `key`.
    #[inline]
    fn write(&mut self, p: usize, key: i64, value: P::Value) {
        self.keys[p] = key;
        self.put(p, value);
    }

    /// Put `value` at position `p`, first making the store fit it (the live positions' values
    /// kept).
    #[inline]
    fn put(&mut self, p: usize, value: P::Value) {
        if !self.values.fits(&value) {
            let (head, used, cap, dead) = (self.head, self.used, self.keys.len(), &self.dead);
            let live = |q: usize| {
                let i = if q >= head { q - head } else { q + cap - head };
                i < used && dead[q / 64] & (1 << (q % 64)) == 0
            };
            self.values.make_fit(&value, &live);
        }
        self.values.put(p, value);
    }

    /// Room for one more entry at the tail.
    #[inline]
    fn make_room(&mut self) {
        let cap = self.keys.len();
        if self.used < cap {
            return;
        }
        let holes = self.used - self.live;
        let new_cap = if holes > 0 && holes >= cap / 8 {
            cap
        } else if self.limit > cap {
            (cap + cap / 4).max(16).min(self.limit)
        } else if self.limit > 0 {
            cap + (cap / 8).max(16)
        } else {
            cap + (cap / 4).max(16)
        };
        self.rebuild(new_cap);
    }

    /// Copy the live entries in order to the start of a ring of `capacity` positions.
    fn rebuild(&mut self, capacity: usize) {
        debug_assert!(capacity >= self.live && capacity < u32::MAX as usize);
        let mut keys = Vec::with_capacity(capacity);
        let mut values = self.values.empty_like(capacity);
        // Where each live position goes (only those are read back, by the index).
        let mut moved = vec![0u32; self.keys.len()];
        for i in 0..self.used {
            let p = self.at(i);
            if !self.is_dead(p) {
                moved[p] = keys.len() as u32;
                values.copy_from(keys.len(), &self.values, p);
                keys.push(self.keys[p]);
            }
        }
        let to = keys.len();
        debug_assert_eq!(to, self.live);
        keys.resize(capacity, 0);
        self.index.remap(|s| moved[s as usize]);
        self.keys = keys;
        self.values = values;
        self.dead = vec![0; capacity.div_ceil(64)];
        self.head = 0;
        self.used = to;
    }

    /// No entries left: the ring starts over at position 0 with no holes.
    fn reset(&mut self) {
        for i in 0..self.used {
            let p = self.at(i);
            self.dead[p / 64] = 0;
        }
        self.head = 0;
        self.used = 0;
    }

    /// `d[key] = value`: in place when present, else at the end.
    #[inline]
    pub fn insert(&mut self, key: i64, value: P::Value) {
        if let Some(p) = self.find(key) {
            self.put(p, value);
            return;
        }
        self.make_room();
        let p = self.at(self.used);
        self.write(p, key, value);
        let keys = &self.keys;
        self.index.insert(key, p as u32, |s| keys[s as usize]);
        self.used += 1;
        self.live += 1;
    }

    /// `value = f(d.pop(key, None)); d[key] = value`: `key` to the end, with a value made
    /// from its old one.
    #[inline]
    pub fn move_to_back(&mut self, key: i64, f: impl FnOnce(Option<P::Value>) -> P::Value) {
        self.make_room();
        let p = self.at(self.used);
        let keys = &self.keys;
        let old = self.index.insert(key, p as u32, |s| keys[s as usize]);
        let value = f(old.map(|o| self.values.get(o as usize)));
        match old {
            Some(o) => self.dead[o as usize / 64] |= 1 << (o % 64),
            None => self.live += 1,
        }
        self.write(p, key, value);
        self.used += 1;
    }

    /// `d.pop(key, None)`.
    #[inline]
    pub fn remove(&mut self, key: i64) -> Option<P::Value> {
        let keys = &self.keys;
        let p = self.index.remove(key, |s| keys[s as usize])? as usize;
        let value = self.values.get(p);
        self.dead[p / 64] |= 1 << (p % 64);
        self.live -= 1;
        if self.live == 0 {
            self.reset();
        }
        Some(value)
    }

    /// `d.popitem(last=False)`: the oldest entry.
    #[inline]
    pub fn pop_front(&mut self) -> Option<(i64, P::Value)> {
        if self.live == 0 {
            return None;
        }
        while self.is_dead(self.head) {
            self.dead[self.head / 64] &= !(1 << (self.head % 64));
            self.head = self.at(1);
            self.used -= 1;
        }
        let p = self.head;
        let key = self.keys[p];
        let keys = &self.keys;
        self.index.remove(key, |s| keys[s as usize]);
        let value = self.values.get(p);
        self.head = self.at(1);
        self.used -= 1;
        self.live -= 1;
        if self.live == 0 {
            self.reset();
        }
        Some((key, value))
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (i64, P::Value)> + '_ {
        (0..self.used)
            .map(|i| self.at(i))
            .filter(|&p| !self.is_dead(p))
            .map(|p| (self.keys[p], self.values.get(p)))
    }

    pub fn values(&self) -> &P {
        &self.values
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.memory_parts().iter().map(|(_, b)| b).sum()
    }

    /// `memory_bytes` by part: the ring (keys and hole bits), the values, the index.
    pub fn memory_parts(&self) -> [(&'static str, usize); 3] {
        [
            ("ring", self.keys.capacity() * 8 + self.dead.capacity() * 8),
            ("values", self.values.memory_bytes()),
            ("index", self.index.memory_bytes()),
        ]
    }

    /// Positions in the ring (entries, holes and free positions).
    pub fn capacity(&self) -> usize {
        self.keys.len()
    }
}

impl<V: Copy + Default> RingMap<Plain<V>> {
    #[inline]
    pub fn get_mut(&mut self, key: i64) -> Option<&mut V> {
        let p = self.find(key)?;
        Some(&mut self.values.0[p])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::ordered::OrderedMap;

    /// A small random generator (xorshift).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Random operations on a ring and on the linked `OrderedMap`: same answers, same order.
    fn against_ordered_map<P: Payloads<Value = (u64, f64)>>(ring: &mut RingMap<P>, seed: u64) {
        let mut reference: OrderedMap<(u64, f64)> = OrderedMap::default();
        let mut rng = Rng(seed);
        let mut tick = 0u64;
        for step in 0..200_000 {
            let key = (rng.next() % 3000) as i64 - 1500;
            tick += 1 + rng.next() % 3;
            match rng.next() % 10 {
                0..=4 => {
                    let f = |seen: Option<(u64, f64)>| match seen {
                        None => (tick, 1.0),
                        Some((then, crf)) => (tick, crf * 0.5 + (tick - then) as f64),
                    };
                    let was = reference.remove(key);
                    reference.insert(key, f(was));
                    ring.move_to_back(key, f);
                }
                5 => {
                    let value = (tick, if step % 3 == 0 { 1.0 } else { 0.25 });
                    reference.insert(key, value);
                    ring.insert(key, value);
                }
                6 => assert_eq!(ring.remove(key), reference.remove(key)),
                7 => assert_eq!(ring.pop_front(), reference.pop_front()),
                _ => assert_eq!(ring.get(key), reference.get(key).copied()),
            }
            while reference.len() > 1200 {
                assert_eq!(ring.pop_front(), reference.pop_front());
            }
            assert_eq!(ring.len(), reference.len());
            if step % 10_000 == 0 {
                let got: Vec<_> = ring.iter().collect();
                let want: Vec<_> = reference.iter().map(|(k, v)| (k, *v)).collect();
                assert_eq!(got, want);
            }
        }
        let got: Vec<_> = ring.iter().collect();
        let want: Vec<_> = reference.iter().map(|(k, v)| (k, *v)).collect();
        assert_eq!(got, want);
        while let Some(entry) = reference.pop_front() {
            assert_eq!(ring.pop_front(), Some(entry));
        }
        assert!(ring.is_empty() && ring.pop_front().is_none());
    }

    #[test]
    fn keeps_python_dict_order() {
        let mut ring: RingMap<Plain<(u64, f64)>> = RingMap::with_limit(1201);
        against_ordered_map(&mut ring, 7);
        let mut unbounded: RingMap<Plain<(u64, f64)>> = RingMap::default();
        against_ordered_map(&mut unbounded, 11);
    }

    #[test]
    fn ticks_and_crfs_come_back_exact() {
        let mut ring = RingMap::with_values(TickCrf::new(), 1201);
        against_ordered_map(&mut ring, 13);
        // Offsets below 64: `base` moves often, and keys the ring keeps long go far.
        let mut narrow = RingMap::with_values(TickCrf::with_span(64), 1201);
        against_ordered_map(&mut narrow, 17);
    }

    #[test]
    fn far_ticks_survive_compaction() {
        let mut ring = RingMap::with_values(TickCrf::with_span(16), 0);
        ring.insert(1, (0, 1.0));
        ring.insert(2, (3, 0.5));
        for t in 10..2000u64 {
            ring.move_to_back(100 + (t % 7) as i64, |_| (t, 1.5));
        }
        assert!(ring.values().far_len() >= 2);
        assert_eq!(ring.get(1), Some((0, 1.0)));
        assert_eq!(ring.get(2), Some((3, 0.5)));
        assert_eq!(ring.pop_front(), Some((1, (0, 1.0))));
        assert_eq!(ring.pop_front(), Some((2, (3, 0.5))));
        assert_eq!(ring.len(), 7);
    }

    #[test]
    fn a_bounded_ring_lands_on_its_limit() {
        let mut ring: RingMap<Plain<()>> = RingMap::with_limit(1001);
        for key in 0..100_000 {
            ring.insert(key, ());
            if ring.len() > 1000 {
                ring.pop_front();
            }
        }
        assert_eq!(ring.len(), 1000);
        assert_eq!(ring.keys.capacity(), 1001);
        assert_eq!(ring.iter().next(), Some((99_000, ())));
    }
}
