//! Free block ids of one tier, per group, and the chunks each group owns.
//!
//! Twin of `kvpool_agent/cache/allocator.py` (`TierAllocator`): a tier's arena is cut into
//! equal chunks, each owned by one group, which hands out the ids of its blocks lying wholly
//! inside it, lowest first; `move_free_chunk` gives a wholly free chunk to a group that runs
//! short. The pool allocates and frees; it never evicts (the engine decides that).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// One tier's layout, as `sizing.TierPlan` and the groups' block sizes describe it.
#[derive(Clone, Debug)]
pub struct TierLayout {
    pub chunk_bytes: u64,
    pub num_chunks: usize,
    /// Chunks each group starts with (in group order, laid out from chunk 0 up).
    pub group_chunks: Vec<usize>,
    pub block_bytes: Vec<u64>,
}

pub struct TierPool {
    chunk_bytes: u64,
    block_bytes: Vec<u64>,
    pub num_chunks: usize,
    pub owner: Vec<usize>,
    used_in_chunk: Vec<u32>,
    free: Vec<BinaryHeap<Reverse<u32>>>,
    pub capacity: Vec<usize>,
}

impl TierPool {
    pub fn new(layout: &TierLayout) -> Self {
        let n = layout.block_bytes.len();
        let mut owner = Vec::with_capacity(layout.num_chunks);
        for (group, &count) in layout.group_chunks.iter().enumerate() {
            owner.extend(std::iter::repeat_n(group, count));
        }
        let mut pool = TierPool {
            chunk_bytes: layout.chunk_bytes,
            block_bytes: layout.block_bytes.clone(),
            num_chunks: layout.num_chunks,
            used_in_chunk: vec![0; layout.num_chunks],
            owner,
            free: (0..n).map(|_| BinaryHeap::new()).collect(),
            capacity: vec![0; n],
        };
        for chunk in 0..pool.owner.len() {
            let group = pool.owner[chunk];
            let ids = pool.ids_in_chunk(group, chunk);
            pool.capacity[group] += ids.len();
            pool.free[group].extend(ids.map(Reverse));
        }
        pool
    }

    /// `sizing.block_ids_in_chunk`: ids of the group's blocks lying wholly inside the chunk.
    pub fn ids_in_chunk(&self, group: usize, chunk: usize) -> std::ops::Range<u32> {
        let bb = self.block_bytes[group];
        let start = (chunk as u64 * self.chunk_bytes).div_ceil(bb);
        let stop = ((chunk as u64 + 1) * self.chunk_bytes) / bb;
        start as u32..stop.max(start) as u32
    }

    fn chunk_of(&self, group: usize, block_id: u32) -> usize {
        ((block_id as u64 * self.block_bytes[group]) / self.chunk_bytes) as usize
    }

    pub fn num_free(&self, group: usize) -> usize {
        self.free[group].len()
    }

    /// The lowest free id of `group`, or None.
    pub fn allocate(&mut self, group: usize) -> Option<u32> {
        let Reverse(id) = self.free[group].pop()?;
        let chunk = self.chunk_of(group, id);
        self.used_in_chunk[chunk] += 1;
        Some(id)
    }

    pub fn release(&mut self, group: usize, block_id: u32) {
        let chunk = self.chunk_of(group, block_id);
        self.used_in_chunk[chunk] -= 1;
        self.free[group].push(Reverse(block_id));
    }

    /// Chunks of `group` with no id in use, highest first.
    pub fn free_chunks(&self, group: usize) -> Vec<usize> {
        (0..self.num_chunks)
            .rev()
            .filter(|&c| self.owner[c] == group && self.used_in_chunk[c] == 0)
            .collect()
    }

    /// Give a wholly free chunk to another group; returns how many ids it gained.
    pub fn move_free_chunk(&mut self, chunk: usize, to_group: usize) -> usize {
        let src = self.owner[chunk];
        assert_eq!(
            self.used_in_chunk[chunk], 0,
            "chunk {chunk} still has blocks in use"
        );
        let lost = self.ids_in_chunk(src, chunk);
        let kept: Vec<Reverse<u32>> = self.free[src]
            .drain()
            .filter(|Reverse(i)| !lost.contains(i))
            .collect();
        self.free[src] = BinaryHeap::from(kept);
        self.capacity[src] -= lost.len();
        self.owner[chunk] = to_group;
        let gained = self.ids_in_chunk(to_group, chunk);
        let count = gained.len();
        self.free[to_group].extend(gained.map(Reverse));
        self.capacity[to_group] += count;
        count
    }

    pub fn memory_bytes(&self) -> usize {
        self.free.iter().map(|h| h.capacity() * 4).sum::<usize>()
            + self.used_in_chunk.capacity() * 4
            + self.owner.capacity() * 8
    }
}
