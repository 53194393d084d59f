//! Hierarchical collectives across vendor domains (the HetCCL and NCCL hierarchical designs).
//!
//! Each domain of m ranks cuts the buffer into m balanced blocks, and the buffer is cut into
//! *pieces* at every domain's block boundaries (and, for reduce-scatter and all-gather, at the
//! ranks' own block boundaries), so each piece has exactly one owner per domain. The all-reduce:
//! 1. **reduce-scatter inside each domain**: the rank at position p ends with block p reduced
//!    over its domain;
//! 2. **exchange between domains**: the owners of each piece all-reduce it around a ring of the g
//!    domains, so every rank carries only its 1/m share across the bridge and every element
//!    crosses between domains 2(g−1) times in all, where a flat ring crosses each domain
//!    boundary on it with almost twice the whole buffer;
//! 3. **all-gather inside each domain**.
//!
//! Reduce-scatter and all-gather are the halves of that with a direct exchange in the middle;
//! broadcast and reduce run a chain that visits the domains one after another.
//!
//! Phases run one after another and pieces in buffer order, so every rank meets the units of work
//! in one global order; with asynchronous sends that makes every plan here deadlock-free.

use std::ops::Range;

use crate::{Buf, Builder, Group, balanced, ring};

/// The chain a hierarchical broadcast or reduce runs along: the root, the rest of its domain,
/// then every other domain in id order, so the data crosses between domains g−1 times (a flat
/// chain crosses at every change of domain along rank order). Pipelined like any chain.
pub(crate) fn chain(group: &Group, root: usize) -> Vec<usize> {
    let root_domain = group.domain_of(root);
    let mut chain = vec![root];
    chain.extend(group.domains()[&root_domain].iter().copied().filter(|&rank| rank != root));
    for (domain, ranks) in group.domains() {
        if domain != root_domain {
            chain.extend(ranks);
        }
    }
    chain
}

/// Each domain's ranks (ascending, domains in id order) and its balanced blocks of `len` elements.
struct Domains {
    ranks: Vec<Vec<usize>>,
    blocks: Vec<Vec<Range<usize>>>,
}

impl Domains {
    fn new(group: &Group, len: usize) -> Domains {
        let ranks: Vec<Vec<usize>> = group.domains().into_values().collect();
        let blocks = ranks.iter().map(|ranks| balanced(len, ranks.len())).collect();
        Domains { ranks, blocks }
    }

    /// The rank of domain `d` whose block holds element `at`.
    fn owner(&self, d: usize, at: usize) -> usize {
        self.ranks[d][self.blocks[d].iter().position(|block| block.contains(&at)).expect("blocks cover the buffer")]
    }

    /// The domain (index) of `rank`.
    fn domain_idx(&self, rank: usize) -> usize {
        self.ranks.iter().position(|ranks| ranks.contains(&rank)).expect("every rank has a domain")
    }

    /// The buffer cut at every domain block boundary and at `extra` boundaries: the non-empty
    /// pieces, in buffer order, each held by exactly one rank per domain.
    fn pieces(&self, extra: &[Range<usize>]) -> Vec<Range<usize>> {
        let mut cuts: Vec<usize> =
            self.blocks.iter().flatten().chain(extra).flat_map(|block| [block.start, block.end]).collect();
        cuts.sort_unstable();
        cuts.dedup();
        cuts.windows(2).map(|w| w[0]..w[1]).filter(|piece| !piece.is_empty()).collect()
    }
}

pub(crate) fn all_reduce(b: &mut Builder, group: &Group, len: usize) {
    let domains = Domains::new(group, len);
    for rank in 0..group.n_ranks() {
        b.copy(rank, 0..len, 0..len);
    }

    // 1. Reduce-scatter inside each domain.
    for (ranks, blocks) in domains.ranks.iter().zip(&domains.blocks) {
        ring::reduce_scatter_pass(b, ranks, blocks);
    }

    // 2. Each piece all-reduced by its owners, around a ring of domains.
    if domains.ranks.len() > 1 {
        for piece in domains.pieces(&[]) {
            let owners: Vec<usize> = (0..domains.ranks.len()).map(|d| domains.owner(d, piece.start)).collect();
            let shares: Vec<Range<usize>> = balanced(piece.len(), owners.len())
                .into_iter()
                .map(|share| piece.start + share.start..piece.start + share.end)
                .collect();
            ring::all_reduce_pass(b, &owners, &shares);
        }
    }

    // 3. All-gather inside each domain.
    for (ranks, blocks) in domains.ranks.iter().zip(&domains.blocks) {
        ring::all_gather_pass(b, ranks, blocks);
    }
}

/// Reduce-scatter: reduce-scatter inside each domain; each piece reduced, across domains, into
/// its owner in the domain of the rank whose block it belongs to; that owner hands it to the rank.
/// Every element crosses between domains g−1 times.
pub(crate) fn reduce_scatter(b: &mut Builder, group: &Group, rank_blocks: &[Range<usize>]) {
    let len = rank_blocks.last().map_or(0, |block| block.end);
    let domains = Domains::new(group, len);
    for rank in 0..group.n_ranks() {
        b.copy(rank, 0..len, 0..len);
    }
    for (ranks, blocks) in domains.ranks.iter().zip(&domains.blocks) {
        ring::reduce_scatter_pass(b, ranks, blocks);
    }
    let pieces = domains.pieces(rank_blocks);
    let dest_of =
        |piece: &Range<usize>| rank_blocks.iter().position(|block| block.contains(&piece.start)).expect("cover");
    for piece in &pieces {
        let into = domains.owner(domains.domain_idx(dest_of(piece)), piece.start);
        for d in 0..domains.ranks.len() {
            let from = domains.owner(d, piece.start);
            if from != into {
                b.send(from, into, Buf::Output, piece.clone());
                b.recv(into, from, piece.clone(), true);
            }
        }
    }
    for piece in &pieces {
        let dest = dest_of(piece);
        let holder = domains.owner(domains.domain_idx(dest), piece.start);
        if holder != dest {
            b.send(holder, dest, Buf::Output, piece.clone());
            b.recv(dest, holder, piece.clone(), false);
        }
    }
}

/// All-gather, the mirror of [`reduce_scatter`]: each rank hands its block's pieces to their
/// owners in its domain, each owner sends them once to the owner in every other domain, and each
/// domain all-gathers. Every element crosses between domains g−1 times.
pub(crate) fn all_gather(b: &mut Builder, group: &Group, rank_blocks: &[Range<usize>]) {
    let len = rank_blocks.last().map_or(0, |block| block.end);
    let domains = Domains::new(group, len);
    for (rank, block) in rank_blocks.iter().enumerate() {
        b.copy(rank, 0..block.len(), block.clone());
    }
    let pieces = domains.pieces(rank_blocks);
    let source_of =
        |piece: &Range<usize>| rank_blocks.iter().position(|block| block.contains(&piece.start)).expect("cover");
    for piece in &pieces {
        let source = source_of(piece);
        let holder = domains.owner(domains.domain_idx(source), piece.start);
        if holder != source {
            b.send(source, holder, Buf::Output, piece.clone());
            b.recv(holder, source, piece.clone(), false);
        }
    }
    for piece in &pieces {
        let from = domains.owner(domains.domain_idx(source_of(piece)), piece.start);
        for d in 0..domains.ranks.len() {
            let to = domains.owner(d, piece.start);
            if to != from {
                b.send(from, to, Buf::Output, piece.clone());
                b.recv(to, from, piece.clone(), false);
            }
        }
    }
    for (ranks, blocks) in domains.ranks.iter().zip(&domains.blocks) {
        ring::all_gather_pass(b, ranks, blocks);
    }
}
