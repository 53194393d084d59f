//! Exact min-max splits: layers over a pipeline's uneven stages, micro-batches over uneven
//! replicas. Both minimise the slowest part, which bounds a pipelined step. And every partition
//! of a set of node groups into blocks.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::error::PlanError;
use crate::evaluate::PipelineTiming;

/// Slack, in units of one layer or micro-batch, so that a bound equal to a part's time (up to
/// float rounding) admits that part.
const ROUNDING: f64 = 1e-9;

/// A pipeline stage as the layer partitioner sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageLoad {
    /// Seconds one more layer adds to the stage's per-micro-batch cycle.
    pub per_layer_s: f64,
    /// Seconds the stage spends whatever its layers: the head, boundary transfers.
    pub fixed_s: f64,
    /// Most layers that fit the stage's memory.
    pub max_layers: u32,
    /// Parameters the stage holds beyond its layers (embedding, head), in layers' worth; equally
    /// fast stages are given layers so that they hold equal parameters.
    pub extra_layers: f64,
}

impl StageLoad {
    pub fn time_s(&self, n_layers: u32) -> f64 {
        self.fixed_s + f64::from(n_layers) * self.per_layer_s
    }

    /// Most layers the stage can take without exceeding `bound_s`.
    fn capacity(&self, bound_s: f64) -> u32 {
        let by_time = ((bound_s - self.fixed_s) / self.per_layer_s + ROUNDING).floor();
        if by_time < 0.0 { 0 } else { self.max_layers.min(by_time.min(f64::from(u32::MAX)) as u32) }
    }
}

/// Whether every stage can take a layer and together they take `n_layers` within `bound_s`.
fn feasible(stages: &[StageLoad], n_layers: u32, bound_s: f64) -> bool {
    let mut sum = 0u64;
    for stage in stages {
        let capacity = stage.capacity(bound_s);
        if capacity == 0 {
            return false;
        }
        sum += u64::from(capacity);
    }
    sum >= u64::from(n_layers)
}

/// The least bound on the slowest stage that some split of `n_layers` (each stage at least one,
/// within memory) meets; `None` when no split fits.
///
/// Layers are identical, so a bound is feasible exactly when the stages' capacities under it sum
/// to `n_layers`; bisection finds the least feasible bound to within float resolution, which is
/// below the gap between any two distinct stage times.
pub fn least_bound_s(stages: &[StageLoad], n_layers: u32) -> Option<f64> {
    let mut high = stages.iter().map(|stage| stage.time_s(stage.max_layers)).fold(0.0, f64::max);
    if stages.is_empty() || stages.len() > n_layers as usize || !feasible(stages, n_layers, high) {
        return None;
    }
    let mut low = stages.iter().map(|stage| stage.time_s(1)).fold(0.0, f64::max);
    if feasible(stages, n_layers, low) {
        return Some(low);
    }
    for _ in 0..100 {
        let mid = 0.5 * (low + high);
        if mid <= low || mid >= high {
            break;
        }
        if feasible(stages, n_layers, mid) { high = mid } else { low = mid }
    }
    // Snap to the stage time that sets the bound, so stages whose times equal it up to float
    // rounding are all admitted — unless rounding at extreme magnitudes makes the snapped bound
    // infeasible, when the bisection's own feasible bound stands.
    let snapped = stages.iter().map(|stage| stage.time_s(stage.capacity(high))).fold(0.0, f64::max);
    Some(if feasible(stages, n_layers, snapped) { snapped } else { high })
}

/// The next bound above `bound_s` at which some stage can take one more layer.
pub fn next_bound_s(stages: &[StageLoad], bound_s: f64) -> Option<f64> {
    stages
        .iter()
        .filter_map(|stage| {
            let next = stage.capacity(bound_s) + 1;
            (next <= stage.max_layers).then(|| stage.time_s(next))
        })
        .reduce(f64::min)
}

/// The split within `bound_s` with the shortest fill: every layer beyond the first of each stage
/// goes to the fastest-per-layer stage with room, and among equally fast ones to the stage
/// holding the fewest parameters. `None` when the bound admits no split.
pub fn fill_within(stages: &[StageLoad], n_layers: u32, bound_s: f64) -> Option<Vec<u32>> {
    if stages.len() > n_layers as usize || !feasible(stages, n_layers, bound_s) {
        return None;
    }
    let capacities: Vec<u32> = stages.iter().map(|stage| stage.capacity(bound_s)).collect();
    let mut counts = vec![1u32; stages.len()];
    let mut by_speed: Vec<usize> = (0..stages.len()).collect();
    by_speed.sort_by(|&a, &b| stages[a].per_layer_s.total_cmp(&stages[b].per_layer_s).then(a.cmp(&b)));
    let mut left = n_layers - stages.len() as u32;
    for tie in by_speed.chunk_by(|&a, &b| stages[a].per_layer_s == stages[b].per_layer_s) {
        // Among equally fast stages, the next layer goes to the one holding the least.
        let mut queue: BinaryHeap<Reverse<Held>> = tie
            .iter()
            .filter(|&&idx| capacities[idx] > 1)
            .map(|&idx| Reverse(Held { params: stages[idx].extra_layers + 1.0, idx }))
            .collect();
        while left > 0 {
            let Some(Reverse(Held { params, idx })) = queue.pop() else { break };
            counts[idx] += 1;
            left -= 1;
            if counts[idx] < capacities[idx] {
                queue.push(Reverse(Held { params: params + 1.0, idx }));
            }
        }
    }
    Some(counts)
}

/// A stage's parameters in layers' worth, ordered for the fill queue (ties by stage index).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Held {
    params: f64,
    idx: usize,
}

impl Eq for Held {}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Held {
    fn cmp(&self, other: &Self) -> Ordering {
        self.params.total_cmp(&other.params).then(self.idx.cmp(&other.idx))
    }
}

/// Layer counts per stage (each at least one, summing to `n_layers`, within memory) that
/// minimise the slowest stage, with the shortest fill among those; `None` when no split fits.
pub fn min_max_layers(stages: &[StageLoad], n_layers: u32) -> Option<Vec<u32>> {
    fill_within(stages, n_layers, least_bound_s(stages, n_layers)?)
}

/// `count` identical replicas with the same pipeline timing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaClass {
    pub timing: PipelineTiming,
    pub count: u32,
}

/// How one class's replicas share micro-batches: the first `n_more` run `more`, the rest one fewer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassShare {
    pub more: u32,
    pub n_more: u32,
    pub count: u32,
}

impl ClassShare {
    /// Micro-batches of each replica of the class, in order.
    pub fn per_replica(self) -> impl Iterator<Item = u32> {
        (0..self.count).map(move |idx| if idx < self.n_more { self.more } else { self.more - 1 })
    }
}

/// Micro-batches per replica (each at least one, summing to `total`) that minimise the slowest
/// replica's pipeline time, with that time; `None` when there are more replicas than
/// micro-batches. Each replica's time grows with its micro-batches, so the least bound whose
/// per-replica allowances cover `total` is optimal (found by bisection as for layers).
pub fn split_micro_batches(classes: &[ReplicaClass], total: u32) -> Option<(f64, Vec<ClassShare>)> {
    let n_replicas: u64 = classes.iter().map(|class| u64::from(class.count)).sum();
    if n_replicas == 0 || n_replicas > u64::from(total) {
        return None;
    }
    let allowance = |class: &ReplicaClass, bound_s: f64| -> u64 {
        if bound_s < class.timing.fill_s {
            return 0;
        }
        let extra = ((bound_s - class.timing.fill_s) / class.timing.cycle_s + ROUNDING).floor();
        1 + extra.min(f64::from(total)) as u64
    };
    let covered = |bound_s: f64| -> bool {
        let sum: u64 = classes.iter().map(|class| u64::from(class.count) * allowance(class, bound_s)).sum();
        classes.iter().all(|class| allowance(class, bound_s) >= 1) && sum >= u64::from(total)
    };
    let mut low = classes.iter().map(|class| class.timing.fill_s).fold(0.0, f64::max);
    let mut high = classes.iter().map(|class| class.timing.time_s(total)).fold(0.0, f64::max);
    if covered(low) {
        high = low;
    }
    for _ in 0..100 {
        let mid = 0.5 * (low + high);
        if mid <= low || mid >= high {
            break;
        }
        if covered(mid) { high = mid } else { low = mid }
    }
    let mut shares: Vec<ClassShare> = classes
        .iter()
        .map(|class| ClassShare {
            more: allowance(class, high).min(u64::from(total)) as u32,
            n_more: class.count,
            count: class.count,
        })
        .collect();
    let mut surplus =
        shares.iter().map(|share| u64::from(share.more) * u64::from(share.count)).sum::<u64>() - u64::from(total);
    // Take the surplus back from the replicas that finish last, a class level at a time. Each
    // class keeps `n_more > 0` so its slowest replicas run `more`.
    while surplus > 0 {
        let class_idx = (0..shares.len())
            .filter(|&idx| shares[idx].more > 1)
            .max_by(|&a, &b| {
                let time = |idx: usize| classes[idx].timing.time_s(shares[idx].more);
                time(a).total_cmp(&time(b)).then(b.cmp(&a))
            })
            .expect("surplus implies a replica with more than one micro-batch");
        let share = &mut shares[class_idx];
        let take = surplus.min(u64::from(share.n_more));
        share.n_more -= take as u32;
        surplus -= take;
        if share.n_more == 0 {
            share.more -= 1;
            share.n_more = share.count;
        }
    }
    let slowest = shares.iter().zip(classes).map(|(share, class)| class.timing.time_s(share.more)).fold(0.0, f64::max);
    Some((slowest, shares))
}

/// Node groups one search takes: blocks are every partition of every subset of groups, which
/// grows as the Bell numbers (877 sets of blocks for 6 groups).
pub const MAX_GROUPS: usize = 6;

/// Refuses more node groups than a search enumerates.
pub(crate) fn check_group_count(groups: usize) -> Result<(), PlanError> {
    match groups > MAX_GROUPS {
        true => Err(PlanError::TooManyGroups { groups, max: MAX_GROUPS }),
        false => Ok(()),
    }
}

/// Every partition of the set bits of `mask` into blocks (as bit masks).
pub(crate) fn set_partitions(mask: u32) -> Vec<Vec<u32>> {
    if mask == 0 {
        return vec![Vec::new()];
    }
    let lowest = mask & mask.wrapping_neg();
    let rest = mask & !lowest;
    let mut partitions = Vec::new();
    // Every subset of `rest` joins the lowest element's block.
    let mut sub = rest;
    loop {
        let block = lowest | sub;
        for mut tail in set_partitions(rest & !sub) {
            tail.insert(0, block);
            partitions.push(tail);
        }
        if sub == 0 {
            break;
        }
        sub = (sub - 1) & rest;
    }
    partitions
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn set_partitions_counts_are_bell_numbers() {
        assert_eq!(set_partitions(0b1).len(), 1);
        assert_eq!(set_partitions(0b11).len(), 2);
        assert_eq!(set_partitions(0b111).len(), 5);
        assert_eq!(set_partitions(0b1111).len(), 15);
        assert_eq!(set_partitions(0b1010).len(), 2);
    }

    /// The slowest stage's cycle under `counts`.
    fn bottleneck_s(stages: &[StageLoad], counts: &[u32]) -> f64 {
        stages.iter().zip(counts).map(|(stage, &count)| stage.time_s(count)).fold(0.0, f64::max)
    }

    /// Every split of `n` into `parts` positive counts.
    fn compositions(n: u32, parts: usize) -> Vec<Vec<u32>> {
        if parts == 1 {
            return vec![vec![n]];
        }
        (1..=n.saturating_sub(parts as u32 - 1))
            .flat_map(|first| {
                compositions(n - first, parts - 1).into_iter().map(move |mut rest| {
                    rest.insert(0, first);
                    rest
                })
            })
            .collect()
    }

    fn stage_strategy() -> impl Strategy<Value = StageLoad> {
        (1u32..6, 0u32..40, 1u32..12, 0u32..3).prop_map(|(per_layer, fixed, max_layers, extra)| StageLoad {
            per_layer_s: f64::from(per_layer) * 0.1,
            fixed_s: f64::from(fixed) * 0.05,
            max_layers,
            extra_layers: f64::from(extra),
        })
    }

    proptest! {
        #[test]
        fn layer_split_is_optimal(stages in prop::collection::vec(stage_strategy(), 1..5), n_layers in 1u32..14) {
            let best = compositions(n_layers, stages.len())
                .into_iter()
                .filter(|counts| counts.iter().zip(&stages).all(|(&c, s)| c <= s.max_layers))
                .map(|counts| bottleneck_s(&stages, &counts))
                .fold(None, |best: Option<f64>, t| Some(best.map_or(t, |b| b.min(t))));
            let ours = min_max_layers(&stages, n_layers);
            match (best, ours) {
                (None, None) => {}
                (Some(best), Some(counts)) => {
                    prop_assert_eq!(counts.iter().sum::<u32>(), n_layers);
                    prop_assert!(counts.iter().zip(&stages).all(|(&c, s)| c >= 1 && c <= s.max_layers));
                    prop_assert!((bottleneck_s(&stages, &counts) - best).abs() < 1e-9, "{:?} vs {}", counts, best);
                }
                (best, ours) => prop_assert!(false, "brute force {:?} vs ours {:?}", best, ours),
            }
        }

        #[test]
        fn fill_within_a_bound_is_shortest(
            stages in prop::collection::vec(stage_strategy(), 1..5),
            n_layers in 1u32..14,
            slack in 0u32..6,
        ) {
            let fill = |counts: &[u32]| counts.iter().zip(&stages).map(|(&c, s)| s.time_s(c)).sum::<f64>();
            let Some(least) = least_bound_s(&stages, n_layers) else { return Ok(()) };
            let mut bound = least;
            for _ in 0..slack {
                bound = next_bound_s(&stages, bound).unwrap_or(bound);
            }
            let counts = fill_within(&stages, n_layers, bound).expect("a feasible bound");
            prop_assert_eq!(counts.iter().sum::<u32>(), n_layers);
            prop_assert!(bottleneck_s(&stages, &counts) <= bound + 1e-9);
            let best = compositions(n_layers, stages.len())
                .into_iter()
                .filter(|c| c.iter().zip(&stages).all(|(&n, s)| n <= s.max_layers))
                .filter(|c| bottleneck_s(&stages, c) <= bound + 1e-9)
                .map(|c| fill(&c))
                .fold(f64::INFINITY, f64::min);
            prop_assert!((fill(&counts) - best).abs() < 1e-9, "{:?}: {} vs {}", counts, fill(&counts), best);
        }

        #[test]
        fn batch_split_is_optimal(
            timings in prop::collection::vec((1u32..30, 1u32..10, 1u32..3), 1..4),
            total in 1u32..16,
        ) {
            let classes: Vec<ReplicaClass> = timings
                .iter()
                .map(|&(fill, cycle, count)| ReplicaClass {
                    timing: PipelineTiming { fill_s: f64::from(fill), cycle_s: f64::from(cycle) * 0.7 },
                    count,
                })
                .collect();
            let flat: Vec<PipelineTiming> =
                classes.iter().flat_map(|class| std::iter::repeat_n(class.timing, class.count as usize)).collect();
            let best = if flat.len() as u32 > total {
                None
            } else {
                compositions(total, flat.len())
                    .into_iter()
                    .map(|shares| shares.iter().zip(&flat).map(|(&m, t)| t.time_s(m)).fold(0.0, f64::max))
                    .reduce(f64::min)
            };
            match (best, split_micro_batches(&classes, total)) {
                (None, None) => {}
                (Some(best), Some((slowest, shares))) => {
                    let shares: Vec<u32> = shares.iter().flat_map(|share| share.per_replica()).collect();
                    prop_assert_eq!(shares.iter().sum::<u32>(), total);
                    prop_assert!(shares.iter().all(|&m| m >= 1));
                    let recomputed = shares.iter().zip(&flat).map(|(&m, t)| t.time_s(m)).fold(0.0, f64::max);
                    prop_assert!((recomputed - slowest).abs() < 1e-9);
                    prop_assert!((slowest - best).abs() < 1e-9, "{} vs {}", slowest, best);
                }
                (best, ours) => prop_assert!(false, "brute force {:?} vs ours {:?}", best, ours),
            }
        }
    }
}
