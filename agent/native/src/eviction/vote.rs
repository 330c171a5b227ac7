//! Follows `vote.py`: the default `mixture` policy, the guarded mixture's experts voting
//! with no leader.

use super::expert::{ExpertKind, Tuning};
use super::guarded::{GUARDED_EXPERTS, HORIZON};
use super::mixture::{MixturePolicy, Vote};

/// `VotePolicy.eta`.
pub const ETA: f64 = 4.0;
/// `VotePolicy.prior`.
pub const PRIOR: f64 = 0.0;

/// `VotePolicy(capacity)`.
pub fn vote_policy(capacity: usize) -> MixturePolicy {
    vote_with(capacity, &GUARDED_EXPERTS, Tuning::default()).expect("the guarded experts")
}

/// `VotePolicy(capacity, experts)`.
pub fn vote_with(
    capacity: usize,
    experts: &[ExpertKind],
    tuning: Tuning,
) -> Result<MixturePolicy, String> {
    MixturePolicy::voting(capacity, experts, Vote::new(ETA, PRIOR, HORIZON), tuning)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::shadow::ShadowNodes;

    #[test]
    fn no_expert_leads_and_blocks_are_bucketed_by_their_holders() {
        let mut m = vote_policy(2);
        let mut recs = ShadowNodes::default();
        m.observe(&[1, 2], true, &mut recs);
        assert_eq!(m.bucket(2), 0b1111);
        assert_eq!(m.bucket(3), 0);
        for key in 10..40 {
            m.observe(&[key], true, &mut recs);
        }
        assert_eq!((m.leader(), m.switches()), (0, 0));
    }

    #[test]
    fn the_order_runs_from_no_holder_to_every_holder() {
        let mut m = vote_policy(8);
        let order = m.eviction_order();
        assert_eq!(order.len(), 16);
        assert_eq!((order[0], order[15]), (0, 0b1111));
        // Equal scores: by the number of holders, LRU's among equals last.
        let holders: Vec<u32> = order.iter().map(|m| m.count_ones()).collect();
        let mut sorted = holders.clone();
        sorted.sort();
        assert_eq!(holders, sorted);
        assert_eq!(order[1..5], [0b0010, 0b0100, 0b1000, 0b0001]);
    }
}
