//! Follows `registry.py`: every policy by the name the engine's config takes.
//!
//! `lru` and `reuse-gap` are level queues; `mixture` (the default) is the guarded mixture
//! (`guarded.rs`); `mixture-v1` is the original mixture (`mixture.rs` with its own experts)
//! and `vote` the candidate of `vote.rs`, which `bench/replay_sweep.py` registers beside the
//! config names.

/// Names [`PolicyKind::parse`] accepts, sorted (as Python's error message lists them).
pub const POLICY_NAMES: [&str; 5] = ["lru", "mixture", "mixture-v1", "reuse-gap", "vote"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Lru,
    ReuseGap,
    /// `GuardedPolicy`.
    Mixture,
    /// `MixturePolicy` with `DEFAULT_EXPERTS`.
    MixtureV1,
    /// `VotePolicy`.
    Vote,
}

impl PolicyKind {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "lru" => Ok(PolicyKind::Lru),
            "reuse-gap" => Ok(PolicyKind::ReuseGap),
            "mixture" => Ok(PolicyKind::Mixture),
            "mixture-v1" => Ok(PolicyKind::MixtureV1),
            "vote" => Ok(PolicyKind::Vote),
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
            PolicyKind::MixtureV1 => "mixture-v1",
            PolicyKind::Vote => "vote",
        }
    }

    /// Whether the policy watches every request (a Python `SharedPolicy`).
    pub fn is_shared(self) -> bool {
        matches!(
            self,
            PolicyKind::Mixture | PolicyKind::MixtureV1 | PolicyKind::Vote
        )
    }
}
