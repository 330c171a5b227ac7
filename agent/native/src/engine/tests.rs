//! The engine's own tests: what the Python differential harness cannot reach (a forced key
//! collision, a chain too deep to recurse, slots kept while held). Everything observable is
//! compared with the Python engine by `tests/cache/test_differential.py`.

use std::sync::Arc;

use super::pool::TierLayout;
use super::store::{BlockRec, NodeRec, Store, HEAD_TOKENS, NONE};
use super::{Engine, EngineConfig, Retention};
use crate::pyhash::block_key;

const TPB: usize = 4;

fn engine(blocks: usize, policy: &str) -> Engine {
    let tier = |n: usize| TierLayout {
        chunk_bytes: 64 * n as u64,
        num_chunks: usize::from(n > 0),
        group_chunks: vec![usize::from(n > 0)],
        block_bytes: vec![64],
    };
    Engine::new(EngineConfig {
        tokens_per_block: TPB,
        windows: vec![1 << 40],
        full: Some(0),
        tiers: [tier(blocks), tier(0)],
        group_blocks: [vec![blocks], vec![0]],
        eviction_policy: policy.to_string(),
        enable_block_reuse: true,
        enable_partial_reuse: false,
        copy_on_partial_reuse: true,
        secondary_offload_min_priority: 35,
        event_buffer_max_size: 0,
    })
    .unwrap()
}

fn store(e: &mut Engine, tokens: &[u64]) -> u64 {
    let seq = e
        .open(
            0,
            tokens.to_vec(),
            true,
            Arc::new(Retention::default_policy()),
            0.0,
        )
        .unwrap();
    e.release(seq, false, 0.0).unwrap();
    seq
}

/// Give the node holding `tokens` (below the root) the key `tokens_of_key` would have: the
/// two blocks now collide, as 64-bit keys can.
fn collide(e: &mut Engine, tokens: &[u64], tokens_of_key: &[u64]) {
    let root = e.roots[&0];
    let node = e.store.child(root, block_key(0, tokens));
    assert_ne!(node, NONE);
    e.store.unlink_child(root, node);
    e.store.nodes[node as usize].key = block_key(0, tokens_of_key);
    e.store.link_child(root, node);
}

#[test]
fn a_key_collision_is_a_miss_never_another_blocks_kv() {
    let mut e = engine(8, "lru");
    store(&mut e, &[1, 2, 3, 4, 9]);
    collide(&mut e, &[1, 2, 3, 4], &[5, 6, 7, 8]);
    // Found by key, refused by its tokens.
    assert_eq!(e.lookup(0, &[5, 6, 7, 8]), Vec::<u8>::new());
    assert_eq!(e.lookup(0, &[1, 2, 3, 4]), Vec::<u8>::new()); // its own key moved away
    let seq = e.open(
        0,
        vec![5, 6, 7, 8, 0],
        true,
        Arc::new(Retention::default_policy()),
        0.0,
    );
    let h = e.handle(seq.unwrap()).unwrap();
    assert_eq!(h.num_reused_tokens, 0);
}

#[test]
fn a_block_whose_key_collides_is_not_stored_over_the_other() {
    let mut e = engine(8, "lru");
    store(&mut e, &[1, 2, 3, 4, 9]);
    collide(&mut e, &[1, 2, 3, 4], &[5, 6, 7, 8]);
    let nodes = e.num_nodes();
    store(&mut e, &[5, 6, 7, 8, 1, 1, 1, 1, 0]);
    // The colliding block and the one after it stayed private: the tree did not grow.
    assert_eq!(e.num_nodes(), nodes);
}

#[test]
fn a_chain_deeper_than_any_stack_drops_without_recursion() {
    let depth = 100_000;
    let mut e = engine(depth + 1, "lru");
    let tokens: Vec<u64> = (0..(depth * TPB) as u64).collect();
    store(&mut e, &tokens);
    assert_eq!(e.num_nodes(), depth);
    // Clearing drops it leaf by leaf (clear walks it with an explicit stack).
    assert_eq!(e.clear(0.0), depth);
    // A drop of the top node takes the whole chain below it (drop_node's own stack).
    store(&mut e, &tokens);
    let root = e.roots[&0];
    let top = e.store.nodes[root as usize].first_child;
    let block = e.store.block_of(top, 0);
    e.store.set_block_of(top, 0, NONE);
    e.store.blocks[block as usize].node = NONE;
    e.pools[0].release(0, e.store.blocks[block as usize].block_id);
    e.queues[0][0].discard(block, &mut e.store);
    e.store.free_block(block);
    e.drop_node(top, super::log::Reason::Evicted, Some(0), 0.0);
    assert_eq!(e.num_nodes(), 0);
    assert_eq!(e.pools[0].num_free(0), depth + 1);
}

#[test]
fn a_dropped_node_a_sequence_lists_keeps_its_slot_until_the_sequence_is_released() {
    // With window groups only, a node an open sequence lists can leave the tree (its window
    // blocks released, then evicted); the sequence still touches it on release, as the
    // Python engine touches its stale object, so the slot must not hold another node by then.
    let mut e = engine(4, "lru");
    store(&mut e, &[1, 2, 3, 4, 9]);
    let seq = e.open(
        0,
        vec![1, 2, 3, 4, 5],
        true,
        Arc::new(Retention::default_policy()),
        0.0,
    );
    let seq = seq.unwrap();
    let node = e.sequences[&seq].nodes[0];
    let key = e.store.nodes[node as usize].key;
    e.store.unlink_child(e.roots[&0], node); // the tree drops it
    e.store.free_node(node);
    let other = e.store.new_node(7, e.roots[&0], &[7, 7, 7, 7]);
    assert_ne!(other, node, "a slot a sequence lists is not reused");
    assert_eq!(e.store.nodes[node as usize].key, key);
    let block = e.sequences[&seq].held[0][0];
    e.store.blocks[block as usize].node = NONE; // its block became the sequence's own
    e.release(seq, true, 0.0).unwrap();
    assert_eq!(
        e.store.new_node(8, e.roots[&0], &[8, 8, 8, 8]),
        node,
        "now it is reused"
    );
}

#[test]
fn a_node_record_keeps_its_rare_expiry_beside_the_slab() {
    // 72 bytes: an expiry time in every record and a 64-bit hit count would make it 88 (of
    // the about 570 bytes a 16-token block costs the default engine in all).
    assert_eq!(std::mem::size_of::<NodeRec>(), 72);
    // And a block record 32 (its stamps in 32 bits: `BlockRec::queue_stamp` says why).
    assert_eq!(std::mem::size_of::<BlockRec>(), 32);
    let mut e = engine(8, "lru");
    store(&mut e, &(0..32).collect::<Vec<u64>>());
    let node = e
        .iter_nodes()
        .into_iter()
        .find(|&n| e.store.nodes[n as usize].parent != NONE);
    let node = node.expect("a stored node");
    assert_eq!(e.store.expires_at(node), None);
    e.store.set_expires_at(node, Some(12.5));
    assert_eq!(e.store.expires_at(node), Some(12.5));
    e.store.set_expires_at(node, None);
    assert_eq!(e.store.expires_at(node), None);
    assert!(!e.store.nodes[node as usize].expiring);
}

/// A full cache whose blocks keep changing (one in, one out) keeps its child index at the size
/// it was reserved at: hashbrown alone doubled it for the tombstones the removals leave.
#[test]
fn churn_does_not_grow_the_child_index() {
    // 4,901 nodes in 8,192 buckets (60%, as the memory bench's 20,001 in 32,768): enough
    // full slots that removals leave tombstones, few enough (under three quarters of the
    // 7,168 hashbrown fills) that a rebuild at this size leaves room; a fuller table grows.
    let blocks = 4_900;
    let mut e = engine(blocks, "lru");
    let children = |e: &Engine| {
        let parts = e.store.memory_breakdown();
        parts
            .iter()
            .find(|(name, _)| *name == "children")
            .unwrap()
            .1
    };
    let before = children(&e);
    assert!(before > 0);
    // Ten capacities of new blocks, 16 per request: every one evicts an old one.
    for r in 0..(10 * blocks as u64 / 16) {
        let tokens: Vec<u64> = (r * 16 * TPB as u64..(r + 1) * 16 * TPB as u64).collect();
        store(&mut e, &tokens);
    }
    assert!(e.store.live_nodes > blocks / 2);
    assert_eq!(children(&e), before);
}

/// A slot's stamp wraps at 2**32; a record's Python stamp (what reuse-gap sorts by) still
/// counts its own bumps.
#[test]
fn a_block_stamp_wraps_and_its_python_stamp_counts_on() {
    use crate::eviction::Records;
    let mut e = engine(8, "reuse-gap");
    let b = e.store.new_block(0, 0, 0);
    e.store.blocks[b as usize].queue_stamp = u32::MAX;
    e.store.free_block(b);
    let c = e.store.new_block(0, 0, 0);
    assert_eq!(c, b); // the slot is reused, and keeps its stamp
    assert_eq!(
        (e.store.queue_stamp(c), e.store.order_stamp(c)),
        (u32::MAX as u64, 0)
    );
    e.store.bump_stamp(c);
    e.store.bump_stamp(c);
    assert_eq!((e.store.queue_stamp(c), e.store.order_stamp(c)), (1, 2));
}

/// Past the head row, a block whose tokens are all 0 (the data plane's blocks) keeps no tail
/// row; a block with a token there keeps one, which goes to the next such block when its node
/// leaves, and a node reusing the slot of one that had a tail row does not read it.
#[test]
fn a_block_ending_in_zeros_keeps_no_tail_row() {
    let tpb = 64;
    let mut st = Store::new(tpb, 1);
    let root = st.new_node(0, NONE, &[]);
    let mut keyed = vec![0u64; tpb];
    for (i, t) in keyed[..HEAD_TOKENS].iter_mut().enumerate() {
        *t = 1000 + i as u64;
    }
    let a = st.new_node(1, root, &keyed);
    assert_eq!(st.tail_rows(), 0);
    let real: Vec<u64> = (1..=tpb as u64).collect();
    let b = st.new_node(2, root, &real);
    assert_eq!(st.tail_rows(), 1);
    assert_eq!(st.node_tokens(a).to_vec(), keyed);
    assert_eq!(st.node_tokens(b).to_vec(), real);
    assert_eq!(st.first_token(a), 1000);
    assert!(st.tokens_equal(a, &keyed) && st.tokens_equal(b, &real));
    // The same head with a token in the tail is another block (what a collision would ask).
    let mut other = keyed.clone();
    other[40] = 7;
    assert!(!st.tokens_equal(a, &other));
    assert!(!st.tokens_equal(a, &keyed[..tpb - 1]));
    assert_eq!(st.shared_prefix(a, &other), 40);
    assert_eq!(st.shared_prefix(b, &real[..20]), 20);
    let mut late = real.clone();
    late[50] = 0;
    assert_eq!(st.shared_prefix(b, &late), 50);
    // b leaves: its tail row is c's.
    st.free_node(b);
    assert_eq!(st.tail_rows(), 0);
    let c_tokens: Vec<u64> = (101..=100 + tpb as u64).collect();
    let c = st.new_node(3, root, &c_tokens);
    assert_eq!(st.tail_rows(), 1);
    assert_eq!(st.node_tokens(c).to_vec(), c_tokens);
    st.free_node(c);
    let d = st.new_node(4, root, &keyed);
    assert_eq!(d, c); // the slot of a node that had a tail row
    assert_eq!(st.node_tokens(d).to_vec(), keyed);
    assert!(st.tokens_equal(d, &keyed) && !st.tokens_equal(d, &c_tokens));
    assert_eq!(st.tail_rows(), 0);
}

/// At 16 tokens per block or fewer the head row is the whole block.
#[test]
fn a_block_no_longer_than_a_head_row_has_no_tail() {
    let mut st = Store::new(HEAD_TOKENS, 1);
    let root = st.new_node(0, NONE, &[]);
    let toks: Vec<u64> = (0..HEAD_TOKENS as u64).collect();
    let a = st.new_node(1, root, &toks);
    assert_eq!(st.node_tokens(a).to_vec(), toks);
    let mut last = toks.clone();
    last[HEAD_TOKENS - 1] += 1;
    assert!(st.tokens_equal(a, &toks) && !st.tokens_equal(a, &last));
    assert_eq!(st.shared_prefix(a, &last), HEAD_TOKENS - 1);
}
