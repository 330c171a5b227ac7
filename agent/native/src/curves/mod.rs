//! The two curves the engine feeds on every request, compiled: the twin of
//! `kvpool_agent/cache/mrc.py` (the miss-ratio curve, [`MissRatioCurve`]) and
//! `kvpool_agent/cache/miniature.py` (the policy curve, [`PolicyMiniature`]).
//!
//! The Python classes are the specification: same parameters and defaults, same sampling
//! masks, same counts, drops and warm-up, and snapshots equal to the last bit of every float
//! (`tests/native/test_curves.py` holds each to its original on random and traced streams).
//!
//! The engine owns its curves ([`Curves`], `Engine::curves`) and feeds them itself, so a
//! request costs no Python for them: the miss-ratio curve where it records an access
//! (`Engine::record_accesses`: the blocks a request matched, then the blocks it stored), the
//! policy curve at each open with the keys of the prompt's full blocks as one chain
//! (`Engine::record_query`); the agent reads the curves and drains
//! the policy curve's queue through `py.rs`'s classes, which either own a curve or look at
//! the one an engine holds.

pub mod miniature;
pub mod mrc;

#[cfg(feature = "python")]
pub mod py;

pub use miniature::PolicyMiniature;
pub use mrc::MissRatioCurve;

/// The curves an engine feeds: each may be absent (the policy curve is off, or the agent
/// feeds a Python curve of its own from the keys the engine samples for it).
#[derive(Debug, Clone, Default)]
pub struct Curves {
    pub mrc: Option<MissRatioCurve>,
    pub miniature: Option<PolicyMiniature>,
}

impl Curves {
    /// One request's accesses to the blocks `keys`, in order (the miss-ratio curve's
    /// `access_nodes`).
    #[inline]
    pub fn access<I: ExactSizeIterator<Item = i64>>(&mut self, keys: I) {
        if let Some(mrc) = &mut self.mrc {
            mrc.access_keys(keys);
        }
    }

    /// One query's block keys, root first (the policy curve's `access_chain`).
    #[inline]
    pub fn query(&mut self, keys: &[i64]) {
        if let Some(mini) = &mut self.miniature {
            mini.access_chain(keys.iter().copied());
        }
    }

    /// Whether a query's chain of keys is wanted (the policy curve is on).
    pub fn wants_queries(&self) -> bool {
        self.miniature.is_some()
    }

    /// Heap bytes owned.
    pub fn memory_bytes(&self) -> usize {
        self.mrc.as_ref().map_or(0, MissRatioCurve::memory_bytes)
            + self
                .miniature
                .as_ref()
                .map_or(0, PolicyMiniature::memory_bytes)
    }
}
