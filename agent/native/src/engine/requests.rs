//! The request-level operations: open, append, commit, release, lookup, clear, and the
//! policy switch. Each follows the Python engine's method of the same name step for step.

use std::sync::Arc;

use super::log::Event;
use super::store::{NONE, PRIMARY, SECONDARY};
use super::{not_open, Engine, EngineError, Result, Retention, Seq};
use crate::eviction::Records;
use crate::pyhash::block_key;

impl Engine {
    /// `open_sequence`: reuse what the cache holds of `toks`, allocate the rest; returns the
    /// new sequence's id.
    pub fn open(
        &mut self,
        namespace: i64,
        toks: Vec<u64>,
        recompute_last_token: bool,
        retention: Arc<Retention>,
        now: f64,
    ) -> Result<u64> {
        if toks.is_empty() {
            return Err(EngineError::InvalidTokens(
                "tokens: a sequence needs at least one token".into(),
            ));
        }
        let tpb = self.tpb;
        let ng = self.num_groups;
        let n = toks.len();
        let nblocks = n.div_ceil(tpb);
        for g in 0..ng {
            let most = self.max_blocks[g];
            if nblocks > most {
                return Err(EngineError::RequestTooLarge(format!(
                    "tokens: {n} tokens need {nblocks} blocks but the pool holds {most} ({} tokens)",
                    most * tpb
                )));
            }
        }
        let limit = if recompute_last_token { n - 1 } else { n };
        let (path, partial, partial_len) = self.match_prefix(namespace, &toks, limit);
        let d = path.len();
        let ghost_blocks = self.ghost_hits(namespace, &toks, &path);
        let need_from: Vec<usize> = (0..ng).map(|g| self.need_from(g, d * tpb)).collect();

        // Pin what is reused, so that making room below cannot evict it.
        let mut pinned: Vec<u32> = Vec::new();
        for (j, &node) in path.iter().enumerate() {
            for g in 0..ng {
                if j >= need_from[g] {
                    let block = self.store.block_of(node, g);
                    debug_assert!(block != NONE);
                    self.pin(block);
                    pinned.push(block);
                }
            }
        }
        let mut partial_blocks: Vec<u32> = Vec::new();
        if partial != NONE {
            for g in 0..ng {
                let block = self.store.block_of(partial, g);
                self.pin(block);
                partial_blocks.push(block);
            }
        }
        let take_over = partial != NONE && !self.cfg.copy_on_partial_reuse;
        let has_host = self.pools[1].capacity.iter().any(|&c| c > 0);
        let mut needed = Vec::with_capacity(ng);
        for g in 0..ng {
            let mut onboard = if has_host {
                pinned
                    .iter()
                    .filter(|&&b| {
                        let r = &self.store.blocks[b as usize];
                        r.group as usize == g && r.tier == SECONDARY
                    })
                    .count()
            } else {
                0
            };
            let fresh = nblocks - d - usize::from(take_over);
            if take_over && self.store.blocks[partial_blocks[g] as usize].tier == SECONDARY {
                onboard += 1;
            }
            needed.push(onboard + fresh);
        }
        if let Some(why) = self.shortfall(&needed) {
            for &block in pinned.iter().chain(&partial_blocks) {
                self.unpin(block, now);
            }
            return Err(EngineError::OutOfBlocks(why));
        }

        let seq_id = self.next_seq;
        self.next_seq += 1;
        let mut seq = Seq {
            namespace,
            num_prompt: n,
            retention,
            nodes: path.clone(),
            held: vec![Vec::new(); ng],
            committed_blocks: 0,
            reused: 0,
            observed: 0,
            slide_from: 0,
            tokens: toks,
        };
        if self.cfg.enable_block_reuse && (!self.observers.is_empty() || self.wants_queries()) {
            let keys = self.block_keys(namespace, &seq.tokens, &path);
            if !self.observers.is_empty() {
                for &(tier, g) in &self.observers.clone() {
                    self.queues[tier as usize][g].observe(&keys, true, &mut self.store);
                }
                seq.observed = keys.len();
            }
            if self.wants_queries() {
                self.record_query(&keys);
            }
        }
        let from_host = if has_host {
            path.iter()
                .filter(|&&node| {
                    (0..ng).any(|g| {
                        let b = self.store.block_of(node, g);
                        b != NONE && self.store.blocks[b as usize].tier == SECONDARY
                    })
                })
                .count()
        } else {
            0
        };
        // One allocation per group for everything this request needs in the primary tier,
        // so that what it evicts is offloaded in one batched copy.
        let mut fresh_ids: Vec<Vec<u32>> = Vec::with_capacity(ng);
        for (g, &want) in needed.iter().enumerate() {
            fresh_ids.push(self.allocate(PRIMARY, g, want, now)?);
        }
        if has_host {
            self.onboard_path(&path, &need_from, &mut fresh_ids, now);
        }
        for g in 0..ng {
            let mut held = vec![NONE; need_from[g].min(d)];
            held.extend(
                path[need_from[g].min(d)..]
                    .iter()
                    .map(|&p| self.store.block_of(p, g)),
            );
            seq.held[g] = held;
        }
        if partial != NONE {
            if take_over {
                self.take_over(partial, &mut seq, &mut fresh_ids, now);
            } else {
                self.copy_partial(partial, &mut seq, &mut fresh_ids);
                for &block in &partial_blocks {
                    self.unpin(block, now);
                }
            }
        }
        for g in 0..ng {
            let missing = nblocks - seq.held[g].len();
            let ids = std::mem::take(&mut fresh_ids[g]);
            let privates = self.new_private(g, missing, ids);
            seq.held[g].extend(privates);
        }
        seq.reused = d * tpb + partial_len;
        seq.committed_blocks = d;
        seq.slide_from = seq.reused;
        self.touch(&path);
        for &node in &path {
            self.store.hold(node); // readable while the sequence lists it, even once dropped
        }
        self.sequences.insert(seq_id, seq);
        self.count_query(n, &path, from_host, partial_len, ghost_blocks);
        Ok(seq_id)
    }

    /// `append_tokens`: decode steps or a further chunk.
    pub fn append(&mut self, seq_id: u64, toks: Vec<u64>, now: f64) -> Result<()> {
        let tpb = self.tpb;
        let ng = self.num_groups;
        let (old, have) = {
            let seq = self.seq(seq_id)?;
            (seq.tokens.len(), seq.held[0].len())
        };
        if toks.is_empty() {
            return Ok(());
        }
        let new_total = old + toks.len();
        let nblocks = new_total.div_ceil(tpb);
        let extra = nblocks as i64 - have as i64;
        for g in 0..ng {
            let most = self.max_blocks[g];
            if nblocks.saturating_sub(self.need_from(g, old)) > most {
                return Err(EngineError::RequestTooLarge(format!(
                    "tokens: the sequence would need more than the pool's {most} blocks"
                )));
            }
        }
        let mut fresh: Vec<Vec<u32>> = Vec::new();
        if extra > 0 {
            let extra = extra as usize;
            if let Some(why) = self.shortfall(&vec![extra; ng]) {
                return Err(EngineError::OutOfBlocks(why));
            }
            for g in 0..ng {
                match self.allocate(PRIMARY, g, extra, now) {
                    Ok(ids) => fresh.push(ids),
                    Err(err) => {
                        for (h, ids) in fresh.iter().enumerate() {
                            for &id in ids {
                                self.pools[0].release(h, id);
                            }
                        }
                        return Err(err);
                    }
                }
            }
        }
        let mut seq = self.sequences.remove(&seq_id).expect("checked above");
        self.commit_seq(&mut seq, now);
        seq.tokens.extend(toks);
        self.slide(&mut seq, old, now);
        for (g, ids) in fresh.into_iter().enumerate() {
            let count = ids.len();
            let privates = self.new_private(g, count, ids);
            seq.held[g].extend(privates);
        }
        self.sequences.insert(seq_id, seq);
        Ok(())
    }

    /// `commit`: the KV of every token is written; full blocks become reusable.
    pub fn commit(&mut self, seq_id: u64, now: f64) -> Result<()> {
        let mut seq = self
            .sequences
            .remove(&seq_id)
            .ok_or_else(|| not_open(seq_id))?;
        self.commit_seq(&mut seq, now);
        self.sequences.insert(seq_id, seq);
        Ok(())
    }

    /// `release`: close a sequence; `discard` drops the blocks not yet committed.
    pub fn release(&mut self, seq_id: u64, discard: bool, now: f64) -> Result<()> {
        let mut seq = self
            .sequences
            .remove(&seq_id)
            .ok_or_else(|| not_open(seq_id))?;
        if !discard {
            self.commit_seq(&mut seq, now);
        }
        self.apply_priorities(&seq, now);
        self.touch(&seq.nodes);
        for g in 0..self.num_groups {
            for j in 0..seq.held[g].len() {
                let block = seq.held[g][j];
                if block != NONE {
                    self.unpin(block, now);
                }
            }
        }
        for &node in &seq.nodes {
            self.store.unhold(node);
        }
        Ok(())
    }

    /// `lookup`: the tier of each leading full block an open would reuse now; no effects.
    pub fn lookup(&self, namespace: i64, toks: &[u64]) -> Vec<u8> {
        let path = self.walk(namespace, toks, toks.len());
        let d = self.usable_depth(&path);
        if d == 0 {
            return Vec::new();
        }
        let mut out = vec![PRIMARY; d];
        if !self.pools[1].capacity.iter().any(|&c| c > 0) {
            return out;
        }
        for g in 0..self.num_groups {
            for j in self.need_from(g, d * self.tpb)..d {
                let b = self.store.block_of(path[j], g);
                if b != NONE && self.store.blocks[b as usize].tier == SECONDARY {
                    out[j] = SECONDARY;
                }
            }
        }
        out
    }

    /// `clear`: drop every reusable block no open sequence uses; returns how many nodes went.
    pub fn clear(&mut self, now: f64) -> usize {
        let before = self.num_nodes();
        for root in self.root_order.clone() {
            for child in self.store.children_of(root) {
                self.clear_subtree(child, now);
            }
        }
        if self.num_nodes() == 0 {
            self.events.push(Event::AllCleared);
        }
        before - self.num_nodes()
    }

    /// A new eviction policy: every queued block moves to the new queues.
    pub fn switch_policy(&mut self, policy: &str, now: f64) -> std::result::Result<(), String> {
        let new = self.new_queues(policy)?;
        let mut old = std::mem::replace(&mut self.queues, new);
        self.cfg.eviction_policy = policy.to_string();
        for tier in 0..2 {
            for g in 0..self.num_groups {
                let mut queued = Vec::new();
                while let Some(block) = old[tier][g].pop(now, &mut self.store) {
                    queued.push(block);
                }
                for block in queued {
                    self.queues[tier][g].push(block, now, &mut self.store);
                }
            }
        }
        Ok(())
    }

    /// Blocks a client asked for that no open matched (a lease past what the pool holds):
    /// queried and missed.
    pub fn count_missed(&mut self, blocks: u64) {
        self.stats.queries_tokens += blocks * self.tpb as u64;
        self.stats.queries_blocks += blocks;
    }

    pub fn resize_events(&mut self, max_size: usize) {
        self.events.resize(max_size);
    }

    /// `_block_keys`: keys of every full block of `toks`, matched ones then the rest.
    pub(crate) fn block_keys(&self, namespace: i64, toks: &[u64], path: &[u32]) -> Vec<i64> {
        let tpb = self.tpb;
        let mut keys: Vec<i64> = path
            .iter()
            .map(|&n| self.store.nodes[n as usize].key)
            .collect();
        let mut key = keys.last().copied().unwrap_or(namespace);
        for j in path.len()..toks.len() / tpb {
            key = block_key(key, &toks[j * tpb..(j + 1) * tpb]);
            keys.push(key);
        }
        keys
    }

    /// `_ghost_hits`: missed blocks right after the match that the ghost list remembers.
    fn ghost_hits(&self, namespace: i64, toks: &[u64], path: &[u32]) -> usize {
        if self.ghost.is_empty() || !self.cfg.enable_block_reuse {
            return 0;
        }
        let tpb = self.tpb;
        let mut key = match path.last() {
            Some(&n) => self.store.nodes[n as usize].key,
            None => namespace,
        };
        let mut j = path.len();
        while (j + 1) * tpb <= toks.len() {
            key = block_key(key, &toks[j * tpb..(j + 1) * tpb]);
            if !self.ghost.contains(key) {
                break;
            }
            j += 1;
        }
        j - path.len()
    }

    fn count_query(
        &mut self,
        n: usize,
        path: &[u32],
        from_host: usize,
        partial_len: usize,
        ghost_blocks: usize,
    ) {
        let tpb = self.tpb as u64;
        let s = &mut self.stats;
        let hits = path.len() as u64;
        let from_host = from_host as u64;
        s.sequences_opened += 1;
        s.queries_tokens += n as u64;
        s.queries_blocks += (n as u64).div_ceil(tpb);
        s.hits_blocks[1] += from_host;
        s.hits_blocks[0] += hits - from_host;
        s.hits_tokens[1] += from_host * tpb;
        s.hits_tokens[0] += (hits - from_host) * tpb + partial_len as u64;
        s.partial_hit_tokens += partial_len as u64;
        s.capacity_miss_blocks += ghost_blocks as u64;
        s.capacity_miss_tokens += ghost_blocks as u64 * tpb;
        for &node in path {
            let rec = &mut self.store.nodes[node as usize];
            rec.hits = rec.hits.saturating_add(1);
        }
        if self.cfg.enable_block_reuse {
            self.record_accesses(path);
        }
    }

    pub(crate) fn touch(&mut self, nodes: &[u32]) {
        for &node in nodes {
            self.tick += 1;
            self.store.nodes[node as usize].last_used = self.tick;
        }
    }
}
