//! kvpool's cache engine core, compiled: the twin of `kvpool_agent.cache` (see
//! `agent/kvpool_agent/cache/native.py` for how the Python engine uses it).
//!
//! The Python engine is the specification and the fallback; this crate reproduces it exactly
//! (same keys, same victims, same counters and events), only faster and with compact records.
//! `tests/cache` runs against both and compares them operation by operation.
//!
//! Beside the engine, [`copy`] holds the data plane's byte movers (`kvpool_agent/dataplane`):
//! scatter/gather copies and socket receives over the arena's pieces; [`wire`] encodes the
//! engine's events as the msgpack batches the agent publishes; [`keys`] turns the data plane's
//! engine keys into their blocks' synthetic tokens; [`shm`] is the same-node client's PUT.

// The engine walks several per-group arrays in step (blocks, pins, windows, queues), as the
// Python engine it follows does; index loops say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

pub mod copy;
pub mod curves;
pub mod engine;
pub mod eviction;
pub mod keys;
pub mod pyhash;
pub mod shm;
pub mod wire;

#[cfg(feature = "python")]
mod python;
