//! kvpool's cache engine core, compiled: the twin of `kvpool_agent.cache` (see
//! `agent/kvpool_agent/cache/native.py` for how the Python engine uses it).
//!
//! The Python engine is the specification and the fallback; this crate reproduces it exactly
//! (same keys, same victims, same counters and events), only faster and with compact records.
//! `tests/cache` runs against both and compares them operation by operation.

pub mod eviction;
pub mod pyhash;

#[cfg(feature = "python")]
mod python;
