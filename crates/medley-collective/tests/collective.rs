//! Every algorithm of every operation, executed by the reference executor and compared with a
//! locally computed result. Inputs are small integers, so sums and products are exact in any order
//! in f64 as in i64 (as nccl-tests does); only the average gets a tolerance.

use medley_collective::reference::{Element, execute, expected_results};
use medley_collective::{
    Algorithm, Chunking, CollectiveError, Counts, DomainId, Group, Op, RankSteps, ReduceOp, as_messages, choose,
    plan_steps,
};
use proptest::prelude::*;
use std::num::NonZeroUsize;

const REDUCE_OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod];

/// One collective to run: the operation, its group and counts, and a seed for the inputs.
#[derive(Clone, Debug)]
struct Case {
    op: Op,
    group: Group,
    counts: Counts,
    algorithm: Algorithm,
    chunking: Chunking,
    seed: i64,
}

/// Small integers in −3..=3: a product over 8 ranks stays below 2^13, exact in f64.
fn value(seed: i64, rank: usize, i: usize) -> i64 {
    (seed + 31 * rank as i64 + 17 * i as i64).rem_euclid(7) - 3
}

fn inputs(case: &Case, plans: &[RankSteps]) -> Vec<Vec<i64>> {
    plans.iter().map(|plan| (0..plan.input_len).map(|i| value(case.seed, plan.rank, i)).collect()).collect()
}

fn run_as<T: Element>(case: &Case, plans: &[RankSteps], close: impl Fn(T, T) -> bool, to_t: impl Fn(i64) -> T) {
    let inputs: Vec<Vec<T>> =
        inputs(case, plans).into_iter().map(|input| input.into_iter().map(&to_t).collect()).collect();
    let outputs = execute(plans, &inputs).unwrap_or_else(|err| panic!("{case:?}: {err}"));
    let expected = expected_results(case.op, &case.counts, &inputs, T::combine, T::divide);
    for (plan, (output, expected)) in plans.iter().zip(outputs.iter().zip(&expected)) {
        let expected = expected.as_deref().unwrap_or_default();
        let got = &output[plan.result.clone()];
        let ok = got.len() == expected.len() && got.iter().zip(expected).all(|(&g, &e)| close(g, e));
        assert!(ok, "{case:?}: rank {} holds {got:?}, expected {expected:?}", plan.rank);
    }
}

/// Plans `case`, executes it in f64 and i64, and checks every rank's result.
fn check(case: &Case) {
    let plans = plan_steps(case.op, &case.group, &case.counts, case.algorithm, case.chunking)
        .unwrap_or_else(|err| panic!("{case:?}: {err}"));
    let avg = case.op.reduce_op() == Some(ReduceOp::Avg);
    run_as::<i64>(case, &plans, |g, e| g == e, |v| v);
    // What a simulator times must compute the same.
    let lowered = as_messages(&plans).unwrap_or_else(|err| panic!("{case:?}: {err}"));
    assert!(lowered.iter().all(|plan| plan.window_len == 0), "{case:?}");
    run_as::<i64>(case, &lowered, |g, e| g == e, |v| v);
    run_as::<f64>(
        case,
        &plans,
        |g, e| if avg { (g - e).abs() <= 1e-12 * e.abs().max(1.0) } else { g == e },
        |v| v as f64,
    );
}

fn ops(n: usize, root: usize) -> Vec<Op> {
    let root = root % n;
    let mut ops = vec![Op::AllGather, Op::Broadcast { root }, Op::AllToAll, Op::Barrier];
    for op in REDUCE_OPS {
        ops.extend([Op::AllReduce { op }, Op::ReduceScatter { op }, Op::Reduce { op, root }]);
    }
    ops
}

/// Counts of the shape `op` needs, uneven, from `sizes` (at least n×n of them).
fn counts_for(op: Op, n: usize, sizes: &[usize]) -> Counts {
    match op {
        Op::AllReduce { .. } | Op::Broadcast { .. } | Op::Reduce { .. } => Counts::Same(sizes.iter().take(n).sum()),
        Op::ReduceScatter { .. } | Op::AllGather => Counts::PerRank(sizes[..n].to_vec()),
        Op::AllToAll => Counts::PerPair(sizes.chunks(n).take(n).map(<[usize]>::to_vec).collect()),
        Op::Barrier => Counts::Same(0),
    }
}

fn group(domains: &[u32]) -> Group {
    Group::new(domains.iter().copied().map(DomainId).collect()).unwrap()
}

fn chunks(max: usize) -> Chunking {
    NonZeroUsize::new(max).map_or(Chunking::Whole, Chunking::MaxElems)
}

#[test]
fn every_op_and_algorithm_on_one_and_two_domains() {
    let sizes: Vec<usize> = (0..64).map(|i| (i * 7 + 3) % 6).collect();
    for n in 1..=8 {
        let one_domain = vec![0; n];
        let two_domains: Vec<u32> = (0..n).map(|r| u32::from(r % 3 == 1)).collect();
        for domains in [one_domain, two_domains] {
            for op in ops(n, n / 2) {
                for algorithm in Algorithm::ALL.into_iter().filter(|a| a.supports(op)) {
                    for max in [0, 2] {
                        let counts = counts_for(op, n, &sizes);
                        check(&Case { op, group: group(&domains), counts, algorithm, chunking: chunks(max), seed: 5 });
                    }
                }
            }
        }
    }
}

#[test]
fn unsupported_algorithms_and_bad_counts_are_refused() {
    let two = group(&[0, 1]);
    let err = plan_steps(Op::AllToAll, &two, &Counts::PerPair(vec![vec![1; 2]; 2]), Algorithm::Ring, Chunking::Whole);
    assert_eq!(err, Err(CollectiveError::Unsupported { algorithm: Algorithm::Ring, op: Op::AllToAll }));
    let err = plan_steps(Op::AllGather, &two, &Counts::PerRank(vec![1; 3]), Algorithm::Ring, Chunking::Whole);
    assert!(matches!(err, Err(CollectiveError::CountsShape { n_ranks: 2, .. })));
    let err = plan_steps(Op::Broadcast { root: 2 }, &two, &Counts::Same(4), Algorithm::Tree, Chunking::Whole);
    assert_eq!(err, Err(CollectiveError::RootOutOfRange { root: 2, n_ranks: 2 }));
    assert_eq!(Group::new(Vec::new()), Err(CollectiveError::EmptyGroup));
}

/// Elements sent from one domain to another, over all ranks.
fn cross_domain_elems(plans: &[RankSteps], group: &Group) -> usize {
    plans
        .iter()
        .flat_map(|plan| plan.sends().map(move |(to, range)| (plan.rank, to, range.len())))
        .filter(|&(from, to, _)| group.domain_of(from) != group.domain_of(to))
        .map(|(_, _, len)| len)
        .sum()
}

/// Hierarchical collectives exist to cross the bridge less: each element crosses 2(g−1) times in an
/// all-reduce (a ring of g domains per piece) and g−1 times in a reduce-scatter, all-gather,
/// broadcast or reduce: fewer than the flat ring whenever every domain has at least two ranks
/// (and, for the rooted operations, than a flat chain that changes domain more than g−1 times).
#[test]
fn hierarchical_collectives_cross_domains_less_than_the_flat_ring() {
    let len = 1200;
    let sizes = [100, 300, 0, 250, 150, 200, 120, 80];
    for domains in [&[0, 0, 0, 0, 1, 1, 1, 1][..], &[0, 1, 0, 1, 0, 1], &[0, 0, 1, 1, 1], &[0, 0, 1, 1, 2, 2]] {
        let (group, n, g) = (group(domains), domains.len(), 1 + *domains.iter().max().unwrap() as usize);
        let rank_sizes = &sizes[..n];
        let per_rank_len: usize = rank_sizes.iter().sum();
        let cases = [
            (Op::AllReduce { op: ReduceOp::Sum }, Counts::Same(len), 2 * (g - 1) * len),
            (Op::ReduceScatter { op: ReduceOp::Sum }, Counts::PerRank(rank_sizes.to_vec()), (g - 1) * per_rank_len),
            (Op::AllGather, Counts::PerRank(rank_sizes.to_vec()), (g - 1) * per_rank_len),
            (Op::Broadcast { root: 1 }, Counts::Same(len), (g - 1) * len),
            (Op::Reduce { op: ReduceOp::Max, root: 1 }, Counts::Same(len), (g - 1) * len),
        ];
        for (op, counts, expected) in cases {
            let cross = |algorithm| {
                let plans = plan_steps(op, &group, &counts, algorithm, Chunking::Whole).unwrap();
                cross_domain_elems(&plans, &group)
            };
            let (flat, hierarchical) = (cross(Algorithm::Ring), cross(Algorithm::Hierarchical));
            assert_eq!(hierarchical, expected, "{op:?} {domains:?}");
            assert!(hierarchical < flat, "{op:?} {domains:?}: hierarchical {hierarchical} vs flat {flat}");
        }
    }
}

#[test]
fn plans_are_deterministic_and_chunked() {
    let group = group(&[0, 1, 0, 1, 1]);
    let op = Op::AllReduce { op: ReduceOp::Sum };
    let plan = |chunking| plan_steps(op, &group, &Counts::Same(100), Algorithm::Hierarchical, chunking).unwrap();
    assert_eq!(plan(chunks(7)), plan(chunks(7)));
    let max_message = |plans: Vec<RankSteps>| plans.iter().flat_map(|p| p.sends().map(|(_, r)| r.len())).max();
    assert_eq!(max_message(plan(chunks(7))), Some(7));
    assert!(max_message(plan(Chunking::Whole)).unwrap() > 7);
}

#[test]
fn the_chosen_algorithm_runs() {
    let group = group(&[0, 0, 1, 1]);
    for op in ops(4, 1) {
        for bytes in [64, 1 << 20] {
            let counts = counts_for(op, 4, &[bytes / 8 / 4; 16]);
            let algorithm = choose(op, &group, bytes);
            check(&Case { op, group: group.clone(), counts, algorithm, chunking: chunks(4096), seed: 1 });
        }
    }
}

/// Data-parallel replicas must not drift apart: with arbitrary floats, where the order of a sum
/// changes its bits, every rank still ends an all-reduce with the same bits, because each element
/// is reduced once, by one rank (or, pairwise, commutatively), and copied from there.
fn all_ranks_agree_bitwise(group: &Group, values: &[f64], algorithm: Algorithm, op: ReduceOp, chunking: Chunking) {
    let n = group.n_ranks();
    let len = values.len() / n;
    let plans = plan_steps(Op::AllReduce { op }, group, &Counts::Same(len), algorithm, chunking).unwrap();
    let inputs: Vec<Vec<f64>> = (0..n).map(|r| values[r * len..(r + 1) * len].to_vec()).collect();
    let outputs = execute(&plans, &inputs).unwrap();
    let bits = |output: &Vec<f64>| output.iter().map(|v| v.to_bits()).collect::<Vec<u64>>();
    for output in &outputs[1..] {
        assert_eq!(bits(output), bits(&outputs[0]), "{algorithm:?} {op:?} {group:?}");
    }
}

fn case() -> impl Strategy<Value = Case> {
    (1..=8usize).prop_flat_map(|n| {
        (
            prop::collection::vec(0u32..2, n),
            any::<bool>(),
            0..ops(1, 0).len(),
            0..n,
            0..6usize,
            0..6usize,
            prop::collection::vec(0..12usize, n * n),
            any::<i64>().prop_map(|seed| seed % 1000),
        )
            .prop_map(move |(domains, two_domains, op_idx, root, algorithm_idx, max, sizes, seed)| {
                let domains = if two_domains { domains } else { vec![0; n] };
                let op = ops(n, root)[op_idx];
                let supported: Vec<Algorithm> = Algorithm::ALL.into_iter().filter(|a| a.supports(op)).collect();
                let algorithm = supported[algorithm_idx % supported.len()];
                Case {
                    op,
                    group: group(&domains),
                    counts: counts_for(op, n, &sizes),
                    algorithm,
                    chunking: chunks(max),
                    seed,
                }
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_collective_matches_the_reference(case in case()) {
        check(&case);
    }

    #[test]
    fn all_reduce_results_are_bitwise_identical_on_every_rank(
        domains in prop::collection::vec(0u32..2, 1..=8),
        len in 0..30usize,
        algorithm_idx in 0..5usize,
        sum in any::<bool>(),
        max in 0..4usize,
        values in prop::collection::vec(-1e6f64..1e6, 8 * 30),
    ) {
        let algorithm =
            [Algorithm::Ring, Algorithm::Tree, Algorithm::Hierarchical, Algorithm::RecursiveDoubling, Algorithm::Direct]
                [algorithm_idx];
        let op = if sum { ReduceOp::Sum } else { ReduceOp::Avg };
        let group = group(&domains);
        all_ranks_agree_bitwise(&group, &values[..len * domains.len()], algorithm, op, chunks(max));
    }
}
