//! Follows `registry.py`: every policy by the name the engine's config takes.
//!
//! `lru` and `reuse-gap` are level queues; `mixture` (the default) is the experts' vote
//! (`vote.rs`). `guarded` (the previous default, `guarded.rs`) and `mixture-v1` (the original
//! mixture: `mixture.rs` with its own experts) are bench series, which `bench/series.py`
//! registers beside the config names.

/// Names [`PolicyKind::parse`] accepts, sorted (as Python's error message lists them).
pub const POLICY_NAMES: [&str; 5] = ["guarded", "lru", "mixture", "mixture-v1", "reuse-gap"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Lru,
    ReuseGap,
    /// `VotePolicy`.
    Mixture,
    /// `GuardedPolicy`.
    Guarded,
    /// `MixturePolicy` with `DEFAULT_EXPERTS`.
    MixtureV1,
}

impl PolicyKind {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "lru" => Ok(PolicyKind::Lru),
            "reuse-gap" => Ok(PolicyKind::ReuseGap),
            "mixture" => Ok(PolicyKind::Mixture),
            "guarded" => Ok(PolicyKind::Guarded),
            "mixture-v1" => Ok(PolicyKind::MixtureV1),
            _ => Err(format!(
                "unknown eviction policy {name:?}; one of {}",
                POLICY_NAMES.join(", ")
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::ReuseGap => "reuse-gap",
            PolicyKind::Mixture => "mixture",
            PolicyKind::Guarded => "guarded",
            PolicyKind::MixtureV1 => "mixture-v1",
        }
    }

    /// Whether the policy watches every request (a Python `SharedPolicy`).
    pub fn is_shared(self) -> bool {
        matches!(
            self,
            PolicyKind::Mixture | PolicyKind::Guarded | PolicyKind::MixtureV1
        )
    }
}
