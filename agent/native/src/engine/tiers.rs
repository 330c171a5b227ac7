//! Capacity and the two tiers: allocation (free ids, then free chunks of other groups,
//! then evictions), offload of evicted blocks to the host tier, onboarding back, and the
//! partial-reuse copies. Every move of KV is recorded as a `CopyOp` for the Python side.

use super::log::Reason;
use super::store::{NONE, PRIMARY, SECONDARY};
use super::{CopyOp, Engine, EngineError, Result, Seq};
use crate::eviction::effective_priority;

const TIER_NAMES: [&str; 2] = ["primary", "secondary"];

impl Engine {
    /// `_shortfall`: why `needed` primary blocks per group cannot be had now, if so.
    pub(crate) fn shortfall(&self, needed: &[usize]) -> Option<String> {
        let pool = &self.pools[0];
        let spare: Vec<Vec<usize>> = (0..self.num_groups).map(|g| pool.free_chunks(g)).collect();
        for (g, &want) in needed.iter().enumerate() {
            if want == 0 {
                continue;
            }
            let want = want as i64;
            let mut have = pool.capacity[g] as i64 - self.pinned[0][g] as i64;
            if have >= want {
                continue;
            }
            for (h, chunks) in spare.iter().enumerate() {
                if h != g {
                    have += chunks
                        .iter()
                        .map(|&c| pool.ids_in_chunk(g, c).len())
                        .sum::<usize>() as i64;
                }
            }
            if have < want {
                return Some(format!(
                    "need {want} blocks in pool group {g} but only {have} are free or evictable; \
                     the rest are pinned by open sequences"
                ));
            }
        }
        None
    }

    /// `_new_private`: `count` pinned private blocks from `ids`.
    pub(crate) fn new_private(&mut self, g: usize, count: usize, ids: Vec<u32>) -> Vec<u32> {
        debug_assert_eq!(ids.len(), count);
        let mut out = Vec::with_capacity(count);
        for id in ids {
            let block = self.store.new_block(g, PRIMARY, id);
            self.store.blocks[block as usize].ref_count = 1;
            out.push(block);
        }
        self.pinned[0][g] += count;
        out
    }

    /// `_allocate`: `count` free ids of group `g` in `tier`.
    pub(crate) fn allocate(
        &mut self,
        tier: u8,
        g: usize,
        count: usize,
        now: f64,
    ) -> Result<Vec<u32>> {
        if count == 0 {
            return Ok(Vec::new());
        }
        let t = tier as usize;
        let mut ids = Vec::with_capacity(count);
        while ids.len() < count {
            if let Some(id) = self.pools[t].allocate(g) {
                ids.push(id);
                continue;
            }
            if self.steal_chunk(tier, g) {
                continue;
            }
            let victims = self.evict(tier, g, count - ids.len(), now);
            if victims.is_empty() && self.pools[t].num_free(g) == 0 {
                break;
            }
            ids.extend(victims); // still counted as in use: they pass straight to the caller
        }
        if ids.len() < count {
            for &id in &ids {
                self.pools[t].release(g, id);
            }
            return Err(EngineError::OutOfBlocks(format!(
                "tier {}: no block left for pool group {g}",
                TIER_NAMES[t]
            )));
        }
        Ok(ids)
    }

    /// `_steal_chunk`: move a wholly free chunk from the group with the most to `g`.
    fn steal_chunk(&mut self, tier: u8, g: usize) -> bool {
        let t = tier as usize;
        let mut best: Vec<usize> = Vec::new();
        for h in 0..self.num_groups {
            if h != g {
                let chunks = self.pools[t].free_chunks(h);
                if chunks.len() > best.len() {
                    best = chunks;
                }
            }
        }
        for chunk in best {
            if !self.pools[t].ids_in_chunk(g, chunk).is_empty() {
                self.pools[t].move_free_chunk(chunk, g);
                self.stats.chunk_moves += 1;
                return true;
            }
        }
        false
    }

    /// `_evict`: evict up to `count` blocks of group `g` from `tier`; returns their ids.
    /// Primary victims that qualify are offloaded: host slots are taken one by one and the
    /// data moves in one batch.
    pub(crate) fn evict(&mut self, tier: u8, g: usize, count: usize, now: f64) -> Vec<u32> {
        let t = tier as usize;
        let threshold = self.cfg.secondary_offload_min_priority;
        let has_host = tier == PRIMARY && self.pools[1].capacity[g] > 0;
        let mut freed = Vec::new();
        // (primary id, the host block it moves to, that block's generation)
        let mut moves: Vec<(u32, u32, u32)> = Vec::new();
        while freed.len() < count {
            let Some(victim) = self.queues[t][g].pop(now, &mut self.store) else {
                break;
            };
            let (node, gen) = {
                let r = &self.store.blocks[victim as usize];
                debug_assert_eq!(r.ref_count, 0);
                (r.node, r.gen)
            };
            debug_assert!(node != NONE);
            self.stats.evictions[t] += 1;
            let mut host_id = None;
            let priority = {
                let at = self.store.expires_at(node);
                effective_priority(self.store.nodes[node as usize].priority, at, now)
            };
            if has_host && priority >= threshold {
                host_id = self.take_host_slot(g, now);
                let r = &self.store.blocks[victim as usize];
                if r.gen != gen || r.node == NONE {
                    // Making room in the host tier pruned this node: its id is free again.
                    if let Some(id) = host_id {
                        self.pools[1].release(g, id);
                    }
                    continue;
                }
            }
            freed.push(self.store.blocks[victim as usize].block_id);
            match host_id {
                Some(id) => {
                    // Not evictable from the host tier until its data is there (after the batch).
                    let moved = self.store.new_block(g, SECONDARY, id);
                    let moved_gen = self.store.blocks[moved as usize].gen;
                    moves.push((
                        self.store.blocks[victim as usize].block_id,
                        moved,
                        moved_gen,
                    ));
                    self.move_tier(node, g, moved, now, false);
                }
                None => self.drop_group_block(node, g, Reason::Evicted, now),
            }
        }
        // A pending move whose node was pruned meanwhile gave its host slot back: skip it.
        moves.retain(|&(_, b, gen)| {
            let r = &self.store.blocks[b as usize];
            r.gen == gen && r.node != NONE
        });
        if !moves.is_empty() {
            self.copies.push(CopyOp {
                group: g,
                src_tier: PRIMARY,
                dst_tier: SECONDARY,
                src: moves.iter().map(|m| m.0).collect(),
                dst: moves
                    .iter()
                    .map(|m| self.store.blocks[m.1 as usize].block_id)
                    .collect(),
            });
            self.stats.offloads += moves.len() as u64;
            for &(_, moved, _) in &moves {
                if self.evictable(moved) && self.store.blocks[moved as usize].queue_level < 0 {
                    self.queues[1][g].push(moved, now, &mut self.store);
                }
            }
        }
        freed
    }

    fn take_host_slot(&mut self, g: usize, now: f64) -> Option<u32> {
        let mut id = self.pools[1].allocate(g);
        if id.is_none() && self.steal_chunk(SECONDARY, g) {
            id = self.pools[1].allocate(g);
        }
        if id.is_none() {
            let victims = self.evict(SECONDARY, g, 1, now);
            id = match victims.first() {
                Some(&v) => Some(v),
                None => self.pools[1].allocate(g),
            };
        }
        id
    }

    /// `_move_tier`: point `node`'s group-`g` block at `new` (another tier), keeping pins.
    pub(crate) fn move_tier(&mut self, node: u32, g: usize, new: u32, now: f64, enqueue: bool) {
        let old = self.store.block_of(node, g);
        debug_assert!(old != NONE);
        let (old_tier, refs) = {
            let r = &self.store.blocks[old as usize];
            (r.tier, r.ref_count)
        };
        let new_tier = self.store.blocks[new as usize].tier;
        self.store.blocks[new as usize].node = node;
        self.store.blocks[new as usize].ref_count = refs;
        if refs > 0 {
            self.pinned[old_tier as usize][g] -= 1;
            self.pinned[new_tier as usize][g] += 1;
        }
        self.queues[old_tier as usize][g].discard(old, &mut self.store);
        self.store.blocks[old as usize].node = NONE;
        self.store.free_block(old);
        self.store.set_block_of(node, g, new);
        let parent = self.store.nodes[node as usize].parent;
        if Some(g) == self.full && parent != NONE {
            let kids = &mut self.store.nodes[parent as usize].kids_in_tier;
            kids[old_tier as usize] -= 1;
            kids[new_tier as usize] += 1;
            self.recheck(parent, now);
        }
        if enqueue && refs == 0 && self.evictable(new) {
            self.queues[new_tier as usize][g].push(new, now, &mut self.store);
        }
        if (Some(g) == self.full || self.full.is_none()) && self.events.enabled() {
            let rec = &self.store.nodes[node as usize];
            let (key, priority) = (rec.key, rec.priority);
            self.events.push(super::log::Event::Updated {
                key,
                tier: new_tier,
                priority,
                tokens: Some(self.store.node_tokens(node).to_vec().into()),
            });
        }
    }

    /// `_onboard_path`: copy the pinned host-tier blocks of a matched path back.
    pub(crate) fn onboard_path(
        &mut self,
        path: &[u32],
        need_from: &[usize],
        fresh_ids: &mut [Vec<u32>],
        now: f64,
    ) {
        for g in 0..self.num_groups {
            let nodes: Vec<u32> = path
                .iter()
                .enumerate()
                .filter(|&(j, &node)| {
                    let b = self.store.block_of(node, g);
                    j >= need_from[g]
                        && b != NONE
                        && self.store.blocks[b as usize].tier == SECONDARY
                })
                .map(|(_, &node)| node)
                .collect();
            if nodes.is_empty() {
                continue;
            }
            let ids: Vec<u32> = fresh_ids[g].drain(..nodes.len()).collect();
            let src: Vec<u32> = nodes
                .iter()
                .map(|&n| self.store.blocks[self.store.block_of(n, g) as usize].block_id)
                .collect();
            self.copies.push(CopyOp {
                group: g,
                src_tier: SECONDARY,
                dst_tier: PRIMARY,
                src: src.clone(),
                dst: ids.clone(),
            });
            for ((&node, &block_id), &host_id) in nodes.iter().zip(&ids).zip(&src) {
                let new = self.store.new_block(g, PRIMARY, block_id);
                self.move_tier(node, g, new, now, true);
                self.pools[1].release(g, host_id);
            }
            self.stats.onboards += nodes.len() as u64;
        }
    }

    /// `_copy_partial`: copy-on-partial-reuse, a new private block starts as a copy.
    pub(crate) fn copy_partial(&mut self, partial: u32, seq: &mut Seq, fresh_ids: &mut [Vec<u32>]) {
        for g in 0..self.num_groups {
            let src = self.store.block_of(partial, g);
            let (src_tier, src_id) = {
                let r = &self.store.blocks[src as usize];
                (r.tier, r.block_id)
            };
            let id = fresh_ids[g].remove(0);
            let block = self.new_private(g, 1, vec![id])[0];
            let dst = self.store.blocks[block as usize].block_id;
            self.copies.push(CopyOp {
                group: g,
                src_tier,
                dst_tier: PRIMARY,
                src: vec![src_id],
                dst: vec![dst],
            });
            seq.held[g].push(block);
        }
    }

    /// `_take_over`: partial reuse without copy; the unused leaf leaves the tree, ours.
    pub(crate) fn take_over(
        &mut self,
        partial: u32,
        seq: &mut Seq,
        fresh_ids: &mut [Vec<u32>],
        now: f64,
    ) {
        let parent = self.store.nodes[partial as usize].parent;
        for g in 0..self.num_groups {
            let mut block = self.store.block_of(partial, g);
            if self.store.blocks[block as usize].tier == SECONDARY {
                let new_id = fresh_ids[g].remove(0);
                let host_id = self.store.blocks[block as usize].block_id;
                self.copies.push(CopyOp {
                    group: g,
                    src_tier: SECONDARY,
                    dst_tier: PRIMARY,
                    src: vec![host_id],
                    dst: vec![new_id],
                });
                let new = self.store.new_block(g, PRIMARY, new_id);
                self.move_tier(partial, g, new, now, true);
                self.pools[1].release(g, host_id);
                self.stats.onboards += 1;
                block = self.store.block_of(partial, g);
            }
            self.store.blocks[block as usize].node = NONE;
            self.store.set_block_of(partial, g, NONE);
            seq.held[g].push(block);
        }
        self.store.unlink_child(parent, partial);
        if self.full.is_some() {
            self.store.nodes[parent as usize].kids_in_tier[PRIMARY as usize] -= 1;
            self.recheck(parent, now);
        }
        let key = self.store.nodes[partial as usize].key;
        self.store.free_node(partial);
        self.events.push(super::log::Event::Removed {
            key,
            tier: PRIMARY,
            reason: Reason::Replaced,
        });
    }
}
