//! The radix tree: match, store, join, drop, prune, pin and unpin.
//!
//! Full-attention groups evict only leaves (a block whose node has no child in its tier);
//! window groups may evict interior blocks, and a node that misses a window block with no
//! child left is pruned.

use super::log::{Event, Reason};
use super::store::{NONE, PRIMARY, SECONDARY};
use super::{Engine, Seq};
use crate::eviction::{effective_priority, Records};
use crate::pyhash::block_key;

impl Engine {
    /// `_walk`: the tree nodes matching the leading full blocks of `toks[..limit]`.
    pub(crate) fn walk(&self, namespace: i64, toks: &[u64], limit: usize) -> Vec<u32> {
        let Some(&root) = self.roots.get(&namespace) else {
            return Vec::new();
        };
        if !self.cfg.enable_block_reuse {
            return Vec::new();
        }
        let tpb = self.tpb;
        let mut path = Vec::new();
        let mut node = root;
        let mut start = 0;
        while start + tpb <= limit {
            let key = block_key(
                self.store.nodes[node as usize].key,
                &toks[start..start + tpb],
            );
            let child = self.store.child(node, key);
            if child == NONE {
                break;
            }
            path.push(child);
            node = child;
            start += tpb;
        }
        // Keys only pick candidates: a block whose key collided is a miss, and so is
        // everything after it.
        let confirmed = path
            .iter()
            .enumerate()
            .take_while(|&(j, &n)| self.store.tokens_equal(n, &toks[j * tpb..(j + 1) * tpb]))
            .count();
        path.truncate(confirmed);
        path
    }

    /// `_match`: the usable matched path, and a partially matching next node (or NONE) with
    /// its token count.
    pub(crate) fn match_prefix(
        &self,
        namespace: i64,
        toks: &[u64],
        limit: usize,
    ) -> (Vec<u32>, u32, usize) {
        let path = self.walk(namespace, toks, limit);
        if path.is_empty() && !self.roots.contains_key(&namespace) {
            return (path, NONE, 0);
        }
        if !self.cfg.enable_block_reuse {
            return (Vec::new(), NONE, 0);
        }
        let tpb = self.tpb;
        let walked = path.len();
        let usable = self.usable_depth(&path);
        if usable < walked {
            let mut path = path;
            path.truncate(usable);
            return (path, NONE, 0);
        }
        let mut partial = NONE;
        let mut m = 0;
        if self.cfg.enable_partial_reuse && walked * tpb < limit {
            let node = match path.last() {
                Some(&n) => n,
                None => self.roots[&namespace],
            };
            let rest = &toks[walked * tpb..limit.min((walked + 1) * tpb)];
            (partial, m) = self.partial_match(node, rest);
        }
        (path, partial, m)
    }

    /// `_usable_depth`: deepest prefix whose needed blocks are all present in some tier.
    pub(crate) fn usable_depth(&self, path: &[u32]) -> usize {
        let mut d = path.len();
        if let Some(full) = self.full {
            if let Some(j) = path
                .iter()
                .position(|&n| self.store.block_of(n, full) == NONE)
            {
                d = j;
            }
        }
        'outer: while d > 0 {
            for g in 0..self.num_groups {
                if Some(g) == self.full {
                    continue;
                }
                let lo = self.need_from(g, d * self.tpb);
                for j in (lo..d).rev() {
                    if self.store.block_of(path[j], g) == NONE {
                        d = j;
                        continue 'outer;
                    }
                }
            }
            return d;
        }
        0
    }

    /// `_partial_match`: the child sharing the longest leading run of `rest` (at least one).
    fn partial_match(&self, parent: u32, rest: &[u64]) -> (u32, usize) {
        if !self.store.may_extend(parent, rest[0]) {
            return (NONE, 0);
        }
        let take_over = !self.cfg.copy_on_partial_reuse;
        let (mut best, mut best_len) = (NONE, 0);
        let mut child = self.store.nodes[parent as usize].first_child;
        while child != NONE {
            let next = self.store.nodes[child as usize].next_sibling;
            let m = self.store.shared_prefix(child, rest);
            let blocks: Vec<u32> = (0..self.num_groups)
                .map(|g| self.store.block_of(child, g))
                .collect();
            if m <= best_len || blocks.contains(&NONE) {
                child = next;
                continue;
            }
            if take_over
                && (self.store.nodes[child as usize].num_children > 0
                    || blocks
                        .iter()
                        .any(|&b| self.store.blocks[b as usize].ref_count > 0))
            {
                child = next;
                continue; // taking a block over is only possible while nobody uses it
            }
            best = child;
            best_len = m;
            child = next;
        }
        (best, best_len)
    }

    // ------------------------------------------------------------------ stores

    /// `_commit`: store every full, written block of `seq` not in the tree yet.
    pub(crate) fn commit_seq(&mut self, seq: &mut Seq, now: f64) {
        if !self.cfg.enable_block_reuse {
            return;
        }
        let tpb = self.tpb;
        let full = seq.tokens.len() / tpb;
        if seq.nodes.len() >= full {
            return;
        }
        let root = match self.roots.get(&seq.namespace) {
            Some(&r) => r,
            None => {
                let r = self.store.new_node(seq.namespace, NONE, &[]);
                self.roots.insert(seq.namespace, r);
                self.root_order.push(r);
                r
            }
        };
        let mut parent = seq.nodes.last().copied().unwrap_or(root);
        let first = seq.nodes.len();
        // The sequence's last stored block left the tree (with window groups only, its
        // window blocks were released and then evicted): nothing to hang the rest under, so
        // it stays private to the sequence, as after a key collision.
        let stop = if self.store.nodes[parent as usize].alive {
            full
        } else {
            first
        };
        let slid = seq.slide_from > 0 && self.windowed();
        for j in first..stop {
            if slid && seq.held.iter().any(|held| held[j] == NONE) {
                // A window released this block before it was stored (block reuse was off
                // then): its KV is gone there, so it and the rest stay private.
                break;
            }
            let tokens = &seq.tokens[j * tpb..(j + 1) * tpb];
            let key = block_key(self.store.nodes[parent as usize].key, tokens);
            let found = self.store.child(parent, key);
            let node = if found == NONE {
                let tokens = tokens.to_vec();
                self.store_block(parent, key, &tokens, seq, j, now)
            } else if self.store.tokens_equal(found, tokens) {
                self.join_existing(found, seq, j, now);
                found
            } else {
                // Another block has this key: this one and those after it stay private to
                // the sequence (freed on release), as if they were never reusable.
                break;
            };
            seq.nodes.push(node);
            self.store.hold(node); // readable while the sequence lists it, even once dropped
            parent = node;
        }
        seq.committed_blocks = seq.nodes.len();
        let stored = seq.nodes[first..].to_vec();
        self.record_accesses(&stored);
        if !self.observers.is_empty() && full > seq.observed {
            let keys: Vec<i64> = seq
                .nodes
                .iter()
                .map(|&n| self.store.nodes[n as usize].key)
                .collect();
            for &(tier, g) in &self.observers.clone() {
                self.queues[tier as usize][g].observe(&keys, false, &mut self.store);
            }
            seq.observed = full;
        }
    }

    /// `_store`: a new node for block `j` of `seq`, below `parent`.
    fn store_block(
        &mut self,
        parent: u32,
        key: i64,
        tokens: &[u64],
        seq: &Seq,
        j: usize,
        now: f64,
    ) -> u32 {
        let node = self.store.new_node(key, parent, tokens);
        self.store.link_child(parent, node);
        let (priority, duration) = if seq.retention.is_default {
            (crate::eviction::DEFAULT_PRIORITY, None)
        } else {
            let tpb = self.tpb as u64;
            seq.retention.block_priority(
                j as u64 * tpb,
                (j as u64 + 1) * tpb,
                seq.num_prompt as u64,
            )
        };
        self.tick += 1;
        {
            let rec = &mut self.store.nodes[node as usize];
            rec.priority = priority;
            rec.stored_at = now;
            rec.last_used = self.tick;
        }
        self.store
            .set_expires_at(node, duration.map(|ms| now + ms as f64 / 1000.0));
        for g in 0..self.num_groups {
            let block = seq.held[g][j];
            assert!(block != NONE && self.store.blocks[block as usize].node == NONE);
            self.store.blocks[block as usize].node = node;
            self.store.set_block_of(node, g, block);
        }
        if let Some(full) = self.full {
            self.store.nodes[parent as usize].kids_in_tier[PRIMARY as usize] += 1;
            // Mostly the parent is the sequence's previous block, pinned: nothing to recheck.
            let above = self.store.block_of(parent, full);
            if above != NONE && self.store.blocks[above as usize].ref_count == 0 {
                self.recheck(parent, now);
            }
        }
        if !self.ghost.is_empty() {
            self.ghost.discard(key);
        }
        if self.events.enabled() {
            let parent_rec = &self.store.nodes[parent as usize];
            let parent_key = if parent_rec.parent != NONE {
                Some(parent_rec.key)
            } else {
                None
            };
            self.events.push(Event::Stored {
                key,
                parent: parent_key,
                tokens: tokens.into(),
                tier: PRIMARY,
                priority,
            });
        }
        node
    }

    /// `_join_existing`: another sequence stored this block first; keep one copy in the
    /// tree and make sure `seq` pins it.
    fn join_existing(&mut self, node: u32, seq: &mut Seq, j: usize, now: f64) {
        let parent = self.store.nodes[node as usize].parent;
        for g in 0..self.num_groups {
            let mine = seq.held[g][j];
            let theirs = self.store.block_of(node, g);
            if mine == NONE || theirs == mine {
                continue;
            }
            if theirs != NONE && self.store.blocks[theirs as usize].ref_count > 0 {
                self.pin(theirs);
                seq.held[g][j] = theirs;
                self.unpin(mine, now); // private: its id goes back to the free list
                continue;
            }
            if theirs != NONE {
                let (tier, id) = {
                    let r = &self.store.blocks[theirs as usize];
                    (r.tier, r.block_id)
                };
                self.queues[tier as usize][g].discard(theirs, &mut self.store);
                self.pools[tier as usize].release(g, id);
                self.store.free_block(theirs);
                if Some(g) == self.full && parent != NONE {
                    self.store.nodes[parent as usize].kids_in_tier[tier as usize] -= 1;
                }
            }
            self.store.blocks[mine as usize].node = node;
            self.store.set_block_of(node, g, mine);
            if Some(g) == self.full && parent != NONE {
                self.store.nodes[parent as usize].kids_in_tier[PRIMARY as usize] += 1;
                self.recheck(parent, now);
            }
        }
    }

    /// `_apply_priorities`: a released sequence raises the priority of its blocks to what
    /// its retention policy asks, if that is higher than their effective priority.
    pub(crate) fn apply_priorities(&mut self, seq: &Seq, now: f64) {
        if seq.retention.is_default {
            return;
        }
        let tpb = self.tpb as u64;
        for (j, &node) in seq.nodes.iter().enumerate() {
            let j = j as u64;
            let (priority, duration) =
                seq.retention
                    .block_priority(j * tpb, (j + 1) * tpb, seq.num_prompt as u64);
            let (current, stored_at) = {
                let r = &self.store.nodes[node as usize];
                (r.priority, r.stored_at)
            };
            let expires = self.store.expires_at(node);
            if priority > effective_priority(current, expires, now) {
                self.store.nodes[node as usize].priority = priority;
                self.store
                    .set_expires_at(node, duration.map(|ms| stored_at + ms as f64 / 1000.0));
                for g in 0..self.num_groups {
                    let block = self.store.block_of(node, g);
                    if block != NONE {
                        let tier = self.store.blocks[block as usize].tier as usize;
                        self.queues[tier][g].requeue(block, now, &mut self.store);
                    }
                }
                let key = self.store.nodes[node as usize].key;
                let tier = self.tier_of(node);
                self.events.push(Event::Updated {
                    key,
                    tier,
                    priority,
                    tokens: None,
                });
            }
        }
    }

    /// `_tier_name`: the tier of the node's first block present (primary if none).
    pub(crate) fn tier_of(&self, node: u32) -> u8 {
        (0..self.num_groups)
            .map(|g| self.store.block_of(node, g))
            .find(|&b| b != NONE)
            .map_or(PRIMARY, |b| self.store.blocks[b as usize].tier)
    }

    /// `_slide`: release the blocks of window groups no query from `old_len` on can see.
    pub(crate) fn slide(&mut self, seq: &mut Seq, old_len: usize, now: f64) {
        seq.slide_from = old_len;
        for g in 0..self.num_groups {
            if Some(g) == self.full {
                continue;
            }
            let stop = self.need_from(g, old_len).min(seq.held[g].len());
            for j in 0..stop {
                let block = seq.held[g][j];
                if block != NONE {
                    seq.held[g][j] = NONE;
                    self.unpin(block, now);
                    let node = self.store.blocks[block as usize].node;
                    if node != NONE {
                        self.prune(node, now);
                    }
                }
            }
        }
    }

    // ------------------------------------------------------------------ drops

    /// `_drop_group_block`: the group's copy of `node` is gone (its id already handed on).
    pub(crate) fn drop_group_block(&mut self, node: u32, g: usize, reason: Reason, now: f64) {
        let block = self.store.block_of(node, g);
        debug_assert!(block != NONE);
        self.store.set_block_of(node, g, NONE);
        self.store.blocks[block as usize].node = NONE;
        if Some(g) == self.full {
            let tier = self.store.blocks[block as usize].tier;
            self.store.free_block(block);
            self.drop_node(node, reason, Some(tier), now);
            return;
        }
        let tier = self.store.blocks[block as usize].tier as usize;
        self.queues[tier][g].discard(block, &mut self.store);
        self.store.free_block(block);
        self.prune(node, now);
    }

    /// `_drop_node`: remove `node` and everything below it, freeing their blocks. Children
    /// go first, oldest first, as the recursion of the Python engine does (here with an
    /// explicit stack, so that no chain is too deep).
    pub(crate) fn drop_node(&mut self, node: u32, reason: Reason, skip_tier: Option<u8>, now: f64) {
        // (node, the tier of a full block already taken off it by the caller)
        let mut stack: Vec<(u32, Option<u8>, bool)> = vec![(node, skip_tier, false)];
        while let Some((n, skip, expanded)) = stack.pop() {
            if !expanded {
                stack.push((n, skip, true));
                let kids = self.store.children_of(n);
                for &c in kids.iter().rev() {
                    stack.push((c, None, false));
                }
                continue;
            }
            self.drop_one(n, reason, skip, now);
        }
    }

    fn drop_one(&mut self, node: u32, reason: Reason, skip_tier: Option<u8>, now: f64) {
        let mut tier_of_full = skip_tier;
        for g in 0..self.num_groups {
            let block = self.store.block_of(node, g);
            if block == NONE {
                continue;
            }
            let (tier, id) = {
                let r = &self.store.blocks[block as usize];
                debug_assert_eq!(r.ref_count, 0, "a block in use is never dropped");
                (r.tier, r.block_id)
            };
            if Some(g) == self.full {
                tier_of_full = Some(tier);
            }
            self.queues[tier as usize][g].discard(block, &mut self.store);
            self.pools[tier as usize].release(g, id);
            self.store.free_block(block);
            self.store.set_block_of(node, g, NONE);
        }
        let parent = self.store.nodes[node as usize].parent;
        debug_assert!(parent != NONE);
        self.store.unlink_child(parent, node);
        if let (Some(tier), Some(_)) = (tier_of_full, self.full) {
            self.store.nodes[parent as usize].kids_in_tier[tier as usize] -= 1;
            self.recheck(parent, now);
        }
        let key = self.store.nodes[node as usize].key;
        self.store.free_node(node);
        if self.events.enabled() {
            self.events.push(Event::Removed {
                key,
                tier: tier_of_full.unwrap_or(PRIMARY),
                reason,
            });
        }
        if reason == Reason::Evicted {
            self.ghost.add(key);
        }
    }

    /// `_prune`: drop leaves that miss a window block (no prefix can end there) and that
    /// no one uses, walking up.
    pub(crate) fn prune(&mut self, mut node: u32, now: f64) {
        loop {
            let rec = &self.store.nodes[node as usize];
            if rec.parent == NONE || rec.num_children > 0 {
                return;
            }
            let mut missing = false;
            let mut used = false;
            for g in 0..self.num_groups {
                let b = self.store.block_of(node, g);
                if b == NONE {
                    missing = true;
                } else if self.store.blocks[b as usize].ref_count > 0 {
                    used = true;
                }
            }
            if !missing || used {
                return;
            }
            let parent = rec.parent;
            self.drop_node(node, Reason::Pruned, None, now);
            node = parent;
        }
    }

    /// `_clear_subtree`: drop the unused leaves below `node`, bottom up.
    pub(crate) fn clear_subtree(&mut self, node: u32, now: f64) {
        let mut stack: Vec<(u32, bool)> = vec![(node, false)];
        while let Some((n, expanded)) = stack.pop() {
            if !expanded {
                stack.push((n, true));
                for &c in self.store.children_of(n).iter().rev() {
                    stack.push((c, false));
                }
                continue;
            }
            let used = (0..self.num_groups).any(|g| {
                let b = self.store.block_of(n, g);
                b != NONE && self.store.blocks[b as usize].ref_count > 0
            });
            if self.store.nodes[n as usize].num_children == 0 && !used {
                self.drop_node(n, Reason::Cleared, None, now);
            }
        }
    }

    // ------------------------------------------------------------------ eviction order

    /// `_evictable`: unpinned, in the tree, and (full attention) a leaf in its tier.
    pub(crate) fn evictable(&self, block: u32) -> bool {
        let r = &self.store.blocks[block as usize];
        if r.ref_count > 0 || r.node == NONE {
            return false;
        }
        if Some(r.group as usize) != self.full {
            return true;
        }
        let kids = self.store.nodes[r.node as usize].kids_in_tier;
        if r.tier == PRIMARY {
            kids[PRIMARY as usize] == 0
        } else {
            kids[PRIMARY as usize] + kids[SECONDARY as usize] == 0
        }
    }

    /// `_recheck`: re-test whether `node`'s full-attention block is a leaf it may evict.
    pub(crate) fn recheck(&mut self, node: u32, now: f64) {
        let Some(full) = self.full else { return };
        if self.store.nodes[node as usize].parent == NONE {
            return;
        }
        let block = self.store.block_of(node, full);
        if block == NONE || self.store.blocks[block as usize].ref_count > 0 {
            return;
        }
        let tier = self.store.blocks[block as usize].tier as usize;
        if self.evictable(block) {
            if self.store.queue_level(block) < 0 {
                self.queues[tier][full].push(block, now, &mut self.store);
            }
        } else {
            self.queues[tier][full].discard(block, &mut self.store);
        }
    }

    pub(crate) fn pin(&mut self, block: u32) {
        let (tier, group, refs) = {
            let r = &self.store.blocks[block as usize];
            (r.tier as usize, r.group as usize, r.ref_count)
        };
        if refs == 0 {
            self.queues[tier][group].discard(block, &mut self.store);
            self.pinned[tier][group] += 1;
        }
        self.store.blocks[block as usize].ref_count += 1;
    }

    pub(crate) fn unpin(&mut self, block: u32, now: f64) {
        let r = &mut self.store.blocks[block as usize];
        r.ref_count -= 1;
        if r.ref_count > 0 {
            return;
        }
        let (tier, group, node, id) = (r.tier as usize, r.group as usize, r.node, r.block_id);
        self.pinned[tier][group] -= 1;
        if node == NONE {
            self.pools[tier].release(group, id);
            self.store.free_block(block);
        } else if self.evictable(block) {
            self.queues[tier][group].push(block, now, &mut self.store);
        }
    }
}
