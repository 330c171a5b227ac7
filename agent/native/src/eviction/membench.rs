//! The memory of an engine's eviction queues by part, on the distinct workload of
//! `bench/policy_memory.py` (64-block requests, all new, 16 tokens per block, ten capacities
//! of blocks). Run with
//! `cargo test --release membench -- --ignored --nocapture` (`KVPOOL_MEMBENCH_CAPACITY`
//! picks the capacities, comma-separated; 20000 and 4000 by default).

use std::sync::Arc;

use crate::engine::pool::TierLayout;
use crate::engine::{Engine, EngineConfig, Retention};

/// An engine like the bench's (`KVCacheManager.with_capacity` with the replay model).
fn engine(capacity: usize, policy: &str) -> Engine {
    let cfg = EngineConfig {
        tokens_per_block: 16,
        windows: vec![1 << 62],
        full: Some(0),
        tiers: [
            TierLayout {
                chunk_bytes: 256 * capacity as u64,
                num_chunks: 1,
                group_chunks: vec![1],
                block_bytes: vec![256],
            },
            TierLayout {
                chunk_bytes: 256,
                num_chunks: 0,
                group_chunks: vec![0],
                block_bytes: vec![256],
            },
        ],
        group_blocks: [vec![capacity], vec![0]],
        eviction_policy: policy.into(),
        enable_block_reuse: true,
        enable_partial_reuse: true,
        copy_on_partial_reuse: true,
        secondary_offload_min_priority: 35,
        event_buffer_max_size: 0,
    };
    Engine::new(cfg).expect("an engine")
}

/// The queue's parts after the distinct workload, in bytes per block of capacity.
pub fn distinct_parts(capacity: usize, policy: &str) -> Vec<(String, f64)> {
    let mut engine = engine(capacity, policy);
    let retention = Arc::new(Retention::default_policy());
    let n = 64u64;
    for r in 0..(10 * capacity as u64 / n) {
        // Tokens unique to each block, as `block_tokens` makes them.
        let toks: Vec<u64> = (r * n * 16..(r + 1) * n * 16).collect();
        let seq = engine
            .open(0, toks, false, retention.clone(), 0.0)
            .expect("open");
        engine.release(seq, false, 0.0).expect("release");
    }
    let queue = &engine.queues[0][0];
    queue
        .memory_parts()
        .into_iter()
        .map(|(name, bytes)| (name, bytes as f64 / capacity as f64))
        .collect()
}

#[test]
#[ignore]
fn membench() {
    let capacities = std::env::var("KVPOOL_MEMBENCH_CAPACITY").unwrap_or("20000,4000".into());
    for capacity in capacities
        .split(',')
        .map(|c| c.trim().parse::<usize>().unwrap())
    {
        let parts = distinct_parts(capacity, "mixture");
        let total: f64 = parts.iter().map(|(_, b)| b).sum();
        println!("distinct, capacity {capacity}: queue {total:.1} B/block");
        let mut by_owner: Vec<(String, f64)> = Vec::new();
        for (name, bytes) in &parts {
            let owner = name.split('.').next().unwrap().to_string();
            match by_owner.iter_mut().find(|(o, _)| *o == owner) {
                Some((_, b)) => *b += bytes,
                None => by_owner.push((owner, *bytes)),
            }
            if *bytes >= 0.05 {
                println!("  {name:24} {bytes:8.1}");
            }
        }
        for (owner, bytes) in by_owner {
            println!("  = {owner:22} {bytes:8.1}");
        }
    }
}
