use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use crate::CollectiveError;

/// A vendor domain: ranks in one domain talk through a native backend, ranks in different
/// domains through the bridge.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DomainId(pub u32);

/// The ranks of a collective, 0..n, each in a domain.
///
/// Invariant: at least one rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<DomainId>", into = "Vec<DomainId>")]
pub struct Group {
    domain_of: Vec<DomainId>,
    /// Distinct domains, counted once: the default algorithm asks on every call.
    n_domains: usize,
}

impl Group {
    /// A group whose rank r is in `domain_of[r]`.
    pub fn new(domain_of: Vec<DomainId>) -> Result<Group, CollectiveError> {
        if domain_of.is_empty() {
            return Err(CollectiveError::EmptyGroup);
        }
        let mut distinct = domain_of.clone();
        distinct.sort_unstable();
        distinct.dedup();
        Ok(Group { n_domains: distinct.len(), domain_of })
    }

    /// `n_ranks` ranks in one domain.
    pub fn single_domain(n_ranks: usize) -> Result<Group, CollectiveError> {
        Group::new(vec![DomainId(0); n_ranks])
    }

    pub fn n_ranks(&self) -> usize {
        self.domain_of.len()
    }

    pub fn domain_of(&self, rank: usize) -> DomainId {
        self.domain_of[rank]
    }

    /// Each domain's ranks, ascending, domains in id order.
    pub fn domains(&self) -> BTreeMap<DomainId, Vec<usize>> {
        let mut domains: BTreeMap<DomainId, Vec<usize>> = BTreeMap::new();
        for (rank, &domain) in self.domain_of.iter().enumerate() {
            domains.entry(domain).or_default().push(rank);
        }
        domains
    }

    pub fn n_domains(&self) -> usize {
        self.n_domains
    }
}

impl TryFrom<Vec<DomainId>> for Group {
    type Error = CollectiveError;
    fn try_from(domain_of: Vec<DomainId>) -> Result<Group, CollectiveError> {
        Group::new(domain_of)
    }
}

impl From<Group> for Vec<DomainId> {
    fn from(group: Group) -> Vec<DomainId> {
        group.domain_of
    }
}
