//! Enumerations the search walks: type orders, stages-per-type vectors, set partitions, layer
//! compositions and block combinations.

use itertools::Itertools;
use medley_spec::NodeGroup;

use crate::partition::StageLoad;

/// Orders of a block's node groups along the pipeline: every permutation for up to four groups;
/// beyond that, vendors kept contiguous (one bridge crossing) largest memory first, and reversed.
pub(super) fn type_orders(groups: &[NodeGroup], block: &[usize]) -> Vec<Vec<usize>> {
    if block.len() <= 4 {
        return block.iter().copied().permutations(block.len()).collect();
    }
    let mut order = block.to_vec();
    order.sort_by(|&a, &b| {
        let (ga, gb) = (&groups[a], &groups[b]);
        ga.device.vendor.cmp(&gb.device.vendor).then(gb.device.hbm_gib.total_cmp(&ga.device.hbm_gib)).then(a.cmp(&b))
    });
    let reversed = order.iter().rev().copied().collect();
    vec![order, reversed]
}

/// Distinct stages-per-group vectors `units[g] / d` for replica counts `d`, each with the largest
/// `d` that gives it, keeping replicas no more than the micro-batches. A pipeline would be deeper
/// than the layers (a big cluster, a small batch) is cut to the layers, each group keeping its
/// share, and the devices left over stay idle.
pub(super) fn stage_vectors(units: &[u32], n_layers: u32, n_micro_batches: u32) -> Vec<(u32, Vec<u32>)> {
    let max_replicas = units.iter().copied().min().unwrap_or(0).min(n_micro_batches);
    let mut vectors: Vec<(u32, Vec<u32>)> = Vec::new();
    for n_replicas in 1..=max_replicas {
        let mut stages: Vec<u32> = units.iter().map(|&u| u / n_replicas).collect();
        let total: u64 = stages.iter().map(|&s| u64::from(s)).sum();
        if total > u64::from(n_layers) {
            stages = stages.iter().map(|&s| (u64::from(s) * u64::from(n_layers) / total) as u32).collect();
        }
        if stages.iter().all(|&s| s == 0) {
            continue;
        }
        match vectors.last_mut() {
            Some(last) if last.1 == stages => last.0 = n_replicas,
            _ => vectors.push((n_replicas, stages)),
        }
    }
    vectors
}

/// Every split of `n_layers` over the stages within their memory caps (exhaustive mode).
pub(super) fn compositions_within(loads: &[StageLoad], n_layers: u32) -> Vec<Vec<u32>> {
    fn extend(loads: &[StageLoad], left: u32, prefix: &mut Vec<u32>, out: &mut Vec<Vec<u32>>) {
        let idx = prefix.len();
        if idx + 1 == loads.len() {
            if left >= 1 && left <= loads[idx].max_layers {
                prefix.push(left);
                out.push(prefix.clone());
                prefix.pop();
            }
            return;
        }
        let rest = (loads.len() - idx - 1) as u32;
        for count in 1..=loads[idx].max_layers.min(left.saturating_sub(rest)) {
            prefix.push(count);
            extend(loads, left - count, prefix, out);
            prefix.pop();
        }
    }
    let mut out = Vec::new();
    extend(loads, n_layers, &mut Vec::new(), &mut out);
    out
}

/// Calls `visit` with every choice of one option per block (a configuration per block, in the
/// search).
pub(super) fn for_each_combination<'c, T>(options: &[&'c [T]], visit: &mut impl FnMut(&[&'c T])) {
    fn recurse<'c, T>(options: &[&'c [T]], chosen: &mut Vec<&'c T>, visit: &mut impl FnMut(&[&'c T])) {
        match options.split_first() {
            None => visit(chosen),
            Some((first, rest)) => {
                for config in *first {
                    chosen.push(config);
                    recurse(rest, chosen, visit);
                    chosen.pop();
                }
            }
        }
    }
    recurse(options, &mut Vec::with_capacity(options.len()), visit);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_vectors_keep_the_most_replicas_per_shape() {
        assert_eq!(stage_vectors(&[8], 80, 1000), [(1, vec![8]), (2, vec![4]), (4, vec![2]), (8, vec![1])]);
        // Deeper than 4 layers is pruned; more replicas than micro-batches too.
        assert_eq!(stage_vectors(&[8, 4], 4, 1000), [(4, vec![2, 1])]);
        assert_eq!(stage_vectors(&[8], 80, 2), [(1, vec![8]), (2, vec![4])]);
        // 32,768 GPUs at tp 8 for 8 sequences: pipelines as deep as the layers, the rest idle.
        assert_eq!(stage_vectors(&[4096], 80, 8), [(8, vec![80])]);
        assert_eq!(stage_vectors(&[3000, 1000], 80, 1), [(1, vec![60, 20])]);
    }
}
