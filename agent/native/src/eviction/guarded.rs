//! Follows `guarded.py`: the previous default (the `guarded` bench series; `vote.rs` keeps
//! its experts and horizon), the mixture with plain LRU as its
//! first expert (it leads at start and wins ties) and a selector with hysteresis (a
//! challenger leads only once its score exceeds the leader's by the factor
//! `1 + HYSTERESIS`).

use super::expert::{ExpertKind, Tuning};
use super::mixture::MixturePolicy;

/// `GUARDED_EXPERTS`: LRU first.
pub const GUARDED_EXPERTS: [ExpertKind; 4] = [
    ExpertKind::Lru,
    ExpertKind::ReuseGap,
    ExpertKind::Lrfu,
    ExpertKind::Arc,
];
/// `GuardedPolicy.horizon` (0.25 in the base mixture).
pub const HORIZON: f64 = 1.0;
/// `GuardedPolicy.hysteresis`.
pub const HYSTERESIS: f64 = 0.02;

/// `GuardedPolicy(capacity)`.
pub fn guarded_policy(capacity: usize) -> MixturePolicy {
    guarded_with(capacity, &GUARDED_EXPERTS, Tuning::default()).expect("the guarded experts")
}

/// `GuardedPolicy(capacity, experts)`.
pub fn guarded_with(
    capacity: usize,
    experts: &[ExpertKind],
    tuning: Tuning,
) -> Result<MixturePolicy, String> {
    MixturePolicy::with_experts(capacity, experts, HORIZON, Some(HYSTERESIS), tuning)
}
