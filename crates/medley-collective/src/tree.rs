//! Binomial trees (Thakur, Rabenseifner & Gropp 2005): log₂ n rounds, for small messages.
//!
//! Relative rank v = (rank − root) mod n. In the reduction, v receives from v + 2^k for each k
//! below its lowest set bit, then sends to v − 2^(lowest set bit); broadcast runs the same tree
//! backwards. Each transfer is chunked, chunk-major, so a deep tree pipelines large messages.

use std::ops::Range;

use crate::{Buf, Builder};

/// Rank `v`'s neighbours in the binomial tree over `n` relative ranks: its parent (none for the
/// root) and its children, in the order a reduction receives from them.
fn tree(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let mut children = Vec::new();
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            return (Some(v - mask), children);
        }
        if v + mask < n {
            children.push(v + mask);
        }
        mask <<= 1;
    }
    (None, children)
}

/// Reduces `range` of every output buffer into the root's. With `token`, an empty range still
/// sends one zero-length message per edge (a barrier's arrival).
fn reduce_range(b: &mut Builder, root: usize, range: Range<usize>, token: bool) {
    let n = b.steps.len();
    let to_rank = |v: usize| (v + root) % n;
    for v in 0..n {
        let (parent, children) = tree(v, n);
        let chunks: Vec<Range<usize>> =
            if token && range.is_empty() { vec![range.clone()] } else { b.chunking.split(range.clone()).collect() };
        for chunk in chunks {
            for &child in &children {
                b.steps[to_rank(v)].push(crate::Step::Recv {
                    from: to_rank(child),
                    range: chunk.clone(),
                    reduce: true,
                });
            }
            if let Some(parent) = parent {
                b.steps[to_rank(v)].push(crate::Step::Send { to: to_rank(parent), buf: Buf::Output, range: chunk });
            }
        }
    }
}

/// Copies the root's `range` into every output buffer (with `token`, as for [`reduce_range`]).
fn broadcast_range(b: &mut Builder, root: usize, range: Range<usize>, token: bool) {
    let n = b.steps.len();
    let to_rank = |v: usize| (v + root) % n;
    for v in 0..n {
        let (parent, children) = tree(v, n);
        let chunks: Vec<Range<usize>> =
            if token && range.is_empty() { vec![range.clone()] } else { b.chunking.split(range.clone()).collect() };
        for chunk in chunks {
            if let Some(parent) = parent {
                b.steps[to_rank(v)].push(crate::Step::Recv {
                    from: to_rank(parent),
                    range: chunk.clone(),
                    reduce: false,
                });
            }
            // Farthest child first: its subtree is the deepest.
            for &child in children.iter().rev() {
                b.steps[to_rank(v)].push(crate::Step::Send {
                    to: to_rank(child),
                    buf: Buf::Output,
                    range: chunk.clone(),
                });
            }
        }
    }
}

fn copy_all(b: &mut Builder, len: usize) {
    for rank in 0..b.steps.len() {
        b.copy(rank, 0..len, 0..len);
    }
}

pub(crate) fn all_reduce(b: &mut Builder, len: usize) {
    copy_all(b, len);
    reduce_range(b, 0, 0..len, false);
    broadcast_range(b, 0, 0..len, false);
}

pub(crate) fn reduce(b: &mut Builder, root: usize, len: usize) {
    copy_all(b, len);
    reduce_range(b, root, 0..len, false);
}

pub(crate) fn broadcast(b: &mut Builder, root: usize, len: usize) {
    b.copy(root, 0..len, 0..len);
    broadcast_range(b, root, 0..len, false);
}

/// Reduce everything to rank 0, which sends each rank its block.
pub(crate) fn reduce_scatter(b: &mut Builder, blocks: &[Range<usize>]) {
    let total = blocks.last().map_or(0, |b| b.end);
    copy_all(b, total);
    reduce_range(b, 0, 0..total, false);
    for (rank, block) in blocks.iter().enumerate().skip(1) {
        b.send(0, rank, Buf::Output, block.clone());
        b.recv(rank, 0, block.clone(), false);
    }
}

/// Every rank sends its block to rank 0, which broadcasts the whole buffer.
pub(crate) fn all_gather(b: &mut Builder, blocks: &[Range<usize>]) {
    let total = blocks.last().map_or(0, |b| b.end);
    for (rank, block) in blocks.iter().enumerate() {
        b.copy(rank, 0..block.len(), block.clone());
        if rank > 0 {
            b.send(rank, 0, Buf::Output, block.clone());
            b.recv(0, rank, block.clone(), false);
        }
    }
    broadcast_range(b, 0, 0..total, false);
}

/// Arrivals up the tree to rank 0, departures down it.
pub(crate) fn barrier(b: &mut Builder) {
    reduce_range(b, 0, 0..0, true);
    broadcast_range(b, 0, 0..0, true);
}
