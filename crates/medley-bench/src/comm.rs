//! `medley bench comm`'s measurement, nccl-tests style: what every rank of a benchmark job runs
//! once it has joined. Sizes and bus-bandwidth factors follow nccl-tests (its PERFORMANCE.md):
//! all-reduce 2(n−1)/n, reduce-scatter, all-gather and all-to-all (n−1)/n, broadcast and reduce
//! one. Elements are f32, reductions sums; time is the slowest rank's mean over the timed
//! iterations. After the timed calls every rank checks its output element by element
//! (nccl-tests' `#wrong`), and the row says how many were wrong over every rank.

use std::time::{Duration, Instant};

use medley_collective::{Algorithm, Counts, Op, ReduceOp};
use medley_comm::{Communicator, Config, DType, TransportKind};
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// Which links the ranks use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CommSetup {
    /// One domain, single-copy shared memory.
    Shm,
    /// One domain, TCP over loopback.
    Tcp,
    /// Two vendor domains (half the ranks each): shared memory inside, TCP across the bridge.
    TwoDomain,
    /// Two domains whose bridge is shared memory too, as fast as the domains.
    TwoDomainShmBridge,
}

impl CommSetup {
    pub fn config(self, timeout: Duration, bridge_bytes_per_s: Option<u64>) -> Config {
        let (intra_domain, bridge) = match self {
            CommSetup::Shm | CommSetup::TwoDomainShmBridge => (TransportKind::Shm, TransportKind::Shm),
            CommSetup::Tcp => (TransportKind::Tcp, TransportKind::Tcp),
            CommSetup::TwoDomain => (TransportKind::Shm, TransportKind::Tcp),
        };
        Config { timeout, intra_domain, bridge, bridge_bytes_per_s, ..Config::default() }
    }

    pub fn domain(self, rank: usize, n_ranks: usize) -> &'static str {
        match self {
            CommSetup::TwoDomain | CommSetup::TwoDomainShmBridge if rank >= n_ranks / 2 => "amd",
            _ => "nvidia",
        }
    }

    pub fn two_domains(self) -> bool {
        matches!(self, CommSetup::TwoDomain | CommSetup::TwoDomainShmBridge)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
/// A collective operation, as nccl-tests names its tests.
#[serde(rename_all = "kebab-case")]
pub enum BenchOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
    AllToAll,
}

impl BenchOp {
    /// nccl-tests' bus bandwidth factor over n ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::ReduceScatter | BenchOp::AllGather | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::Reduce => 1.0,
        }
    }

    /// The operation on `count` f32 elements in all (nccl-tests' "size": the whole buffer, split
    /// evenly between ranks where the operation splits; all-to-all sends `count / n` to each
    /// rank), with its counts and each rank's input and output lengths.
    pub fn shape(self, count: usize, n: usize) -> (Op, Counts, usize, usize) {
        let per = count / n;
        match self {
            BenchOp::AllReduce => (Op::AllReduce { op: ReduceOp::Sum }, Counts::Same(count), count, count),
            BenchOp::ReduceScatter => {
                (Op::ReduceScatter { op: ReduceOp::Sum }, Counts::PerRank(vec![per; n]), per * n, per)
            }
            BenchOp::AllGather => (Op::AllGather, Counts::PerRank(vec![per; n]), per, per * n),
            BenchOp::Broadcast => (Op::Broadcast { root: 0 }, Counts::Same(count), count, count),
            BenchOp::Reduce => (Op::Reduce { op: ReduceOp::Sum, root: 0 }, Counts::Same(count), count, count),
            BenchOp::AllToAll => (Op::AllToAll, Counts::PerPair(vec![vec![per; n]; n]), per * n, per * n),
        }
    }

    /// Bytes the row reports: what nccl-tests calls the size for this operation.
    pub fn bytes(self, count: usize, n: usize) -> usize {
        let elems = match self {
            BenchOp::AllReduce | BenchOp::Broadcast | BenchOp::Reduce => count,
            BenchOp::ReduceScatter | BenchOp::AllGather | BenchOp::AllToAll => count / n * n,
        };
        elems * size_of::<f32>()
    }

    pub fn redop(self) -> &'static str {
        match self {
            BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::Reduce => "sum",
            _ => "none",
        }
    }
}

/// One measurement, as rank 0 prints it and `--json` reports it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub op: BenchOp,
    pub bytes: usize,
    pub count: usize,
    #[serde(rename = "type")]
    pub dtype: String,
    pub redop: String,
    pub ranks: usize,
    pub transport: CommSetup,
    pub algorithm: Algorithm,
    pub time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Output elements, over every rank, that did not hold the right result after the timed calls.
    pub wrong: u64,
    /// The bridge's cap per link, when `--bridge-gb-s` set one on a TCP bridge.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bridge_gbps: Option<f64>,
}

/// Warm-up runs batches of 1, 2, 4, ... calls until this much time is spent and at least
/// [`MIN_WARM_CALLS`] calls are made: the first calls of a job run slow (pages faulted in, ranks
/// still settling on cores), and timing those would measure the start, not the library.
const WARM_UP: Duration = Duration::from_millis(50);
/// nccl-tests' default warm-up count: a 64 MiB all-reduce spends the 50 ms in its first call.
const MIN_WARM_CALLS: usize = 5;
/// Timed calls aim at this much time per size, estimated from the last warm-up batch (at least
/// one call, at most [`MAX_ITERS`]), as OSU's micro-benchmarks time 10,000 small-message calls.
const TIME_PER_SIZE: Duration = Duration::from_millis(300);
const MAX_ITERS: usize = 10_000;

/// What one run of the benchmark measures, on every rank alike.
#[derive(Clone, Debug, PartialEq)]
pub struct Sweep {
    pub setup: CommSetup,
    pub ops: Vec<BenchOp>,
    /// Sizes grow ×4 from `min_bytes` up to `max_bytes`.
    pub min_bytes: usize,
    pub max_bytes: usize,
    /// Time these algorithms wherever one supports the operation; empty: the one the
    /// communicator chooses (and, across two domains, the ring beside the hierarchy).
    pub algorithms: Vec<Algorithm>,
    /// The bridge's cap per link the communicator was configured with, reported in each row.
    pub bridge_bytes_per_s: Option<u64>,
}

/// Every rank of the job calls this with the same sweep: each operation and size is warmed up,
/// timed (the slowest rank's mean) and checked element by element; rank 0 gets each [`Row`]
/// through `emit`, the others none.
pub fn sweep(
    comm: &mut Communicator,
    args: &Sweep,
    mut emit: impl FnMut(Row) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let n = comm.n_ranks();
    let sizes = std::iter::successors(Some(args.min_bytes), |&b| b.checked_mul(4)).take_while(|&b| b <= args.max_bytes);
    for bytes in sizes {
        let count = bytes / size_of::<f32>();
        for &op in &args.ops {
            let (coll, counts, input_len, output_len) = op.shape(count, n);
            let input: Vec<f32> = (0..input_len).map(|i| pattern(comm.rank(), i)).collect();
            let mut output = vec![0f32; output_len];
            let runnable = |algorithm: &&Algorithm| {
                algorithm.supports(coll) && (!algorithm.needs_windows() || comm.shares_windows())
            };
            let asked: Vec<Algorithm> = args.algorithms.iter().filter(runnable).copied().collect();
            let hierarchy_against_ring = args.setup.two_domains()
                && matches!(op, BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::AllGather);
            let algorithms = if !asked.is_empty() {
                asked
            } else if hierarchy_against_ring {
                vec![Algorithm::Hierarchical, Algorithm::Ring]
            } else {
                vec![comm.choice(coll, &counts, None, DType::F32).algorithm]
            };
            for algorithm in algorithms {
                let calls = |comm: &mut Communicator, output: &mut [f32], n: usize| -> Result<f64, BenchError> {
                    let start = Instant::now();
                    for _ in 0..n {
                        comm.collective(coll, &counts, Some(algorithm), &input, output)?;
                    }
                    Ok(slowest(comm, start.elapsed().as_secs_f64())? / n as f64)
                };
                let (mut batch, mut warmed, mut per_call) = (1, 0.0, 0.0);
                while (warmed < WARM_UP.as_secs_f64() || batch <= MIN_WARM_CALLS) && batch <= MAX_ITERS {
                    per_call = calls(comm, &mut output, batch)?;
                    warmed += per_call * batch as f64;
                    batch *= 2;
                }
                let iters = ((TIME_PER_SIZE.as_secs_f64() / per_call.max(1e-9)) as usize).clamp(1, MAX_ITERS);
                // Poisoned, so a call that leaves any of it unwritten is counted wrong.
                output.fill(f32::NAN);
                comm.barrier()?;
                let time_s = calls(comm, &mut output, iters)?;
                let wrong = count_wrong(op, &output, comm.rank(), n, count / n);
                let wrong = sum_over_ranks(comm, wrong)?;
                if comm.rank() == 0 {
                    let bytes = op.bytes(count, n);
                    let algbw_gbps = bytes as f64 / time_s / 1e9;
                    let row = Row {
                        op,
                        bytes,
                        count: bytes / size_of::<f32>(),
                        dtype: "float".into(),
                        redop: op.redop().into(),
                        ranks: n,
                        transport: args.setup,
                        algorithm,
                        time_us: time_s * 1e6,
                        algbw_gbps,
                        busbw_gbps: algbw_gbps * op.bus_factor(n),
                        wrong,
                        bridge_gbps: args.bridge_bytes_per_s.map(|cap| cap as f64 / 1e9),
                    };
                    emit(row)?;
                }
            }
        }
    }
    Ok(())
}

/// Input element `index` of `rank`: small integers, so that every sum of up to a million ranks
/// is exact in f32 whatever order an algorithm adds in, and no two neighbouring ranks or
/// elements agree everywhere.
fn pattern(rank: usize, index: usize) -> f32 {
    ((rank * 31 + index) % 17) as f32 - 8.0
}

/// Output elements of this rank that differ from what `op` must leave there after a call on
/// [`pattern`] inputs (`per`: elements per rank where the operation splits), as nccl-tests'
/// `#wrong` counts them. Outputs the operation leaves unspecified (a reduce's off the root)
/// are not counted.
fn count_wrong(op: BenchOp, output: &[f32], rank: usize, n: usize, per: usize) -> u64 {
    let sum = |index: usize| (0..n).map(|r| pattern(r, index)).sum::<f32>();
    let expected = |i: usize| match op {
        BenchOp::AllReduce => Some(sum(i)),
        BenchOp::Reduce => (rank == 0).then(|| sum(i)),
        BenchOp::Broadcast => Some(pattern(0, i)),
        BenchOp::ReduceScatter => Some(sum(rank * per + i)),
        BenchOp::AllGather => Some(pattern(i / per, i % per)),
        BenchOp::AllToAll => Some(pattern(i / per, rank * per + i % per)),
    };
    let wrong = output.iter().enumerate().filter(|&(i, &got)| expected(i).is_some_and(|want| got != want));
    wrong.count() as u64
}

/// The sum of every rank's `count`.
fn sum_over_ranks(comm: &mut Communicator, count: u64) -> Result<u64, BenchError> {
    let mut total = [0f64];
    comm.all_reduce(&[count as f64], &mut total, ReduceOp::Sum)?;
    Ok(total[0] as u64)
}

/// The largest of every rank's `seconds`.
fn slowest(comm: &mut Communicator, seconds: f64) -> Result<f64, BenchError> {
    let mut max = [0f64];
    comm.all_reduce(&[seconds], &mut max, ReduceOp::Max)?;
    Ok(max[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_reports_the_size_it_was_asked_for() {
        for op in [BenchOp::AllReduce, BenchOp::ReduceScatter, BenchOp::AllGather, BenchOp::AllToAll] {
            assert_eq!(op.bytes(1024, 4), 4096, "{op:?}");
            let (_, _, input, output) = op.shape(1024, 4);
            assert_eq!(input.max(output) * size_of::<f32>(), 4096, "{op:?}");
        }
    }

    /// What each rank's output must hold, worked out from every rank's whole input buffer
    /// (not from `count_wrong`'s index formulas).
    fn reference_outputs(op: BenchOp, n: usize, count: usize) -> Vec<Vec<f32>> {
        let (_, _, input_len, _) = op.shape(count, n);
        let inputs: Vec<Vec<f32>> = (0..n).map(|r| (0..input_len).map(|i| pattern(r, i)).collect()).collect();
        let per = count / n;
        let sum = |range: std::ops::Range<usize>| -> Vec<f32> {
            range.map(|i| inputs.iter().map(|input| input[i]).sum()).collect()
        };
        (0..n)
            .map(|me| match op {
                BenchOp::AllReduce => sum(0..count),
                BenchOp::Reduce => {
                    if me == 0 {
                        sum(0..count)
                    } else {
                        vec![f32::NAN; count]
                    }
                }
                BenchOp::Broadcast => inputs[0].clone(),
                BenchOp::ReduceScatter => sum(me * per..(me + 1) * per),
                BenchOp::AllGather => inputs.concat(),
                BenchOp::AllToAll => inputs.iter().flat_map(|input| input[me * per..(me + 1) * per].to_vec()).collect(),
            })
            .collect()
    }

    #[test]
    fn right_results_count_no_wrong_element_and_each_wrong_one_counts() {
        let all = [
            BenchOp::AllReduce,
            BenchOp::ReduceScatter,
            BenchOp::AllGather,
            BenchOp::Broadcast,
            BenchOp::Reduce,
            BenchOp::AllToAll,
        ];
        for op in all {
            for n in [1, 2, 3, 5] {
                let count = 12 * n;
                for (rank, mut output) in reference_outputs(op, n, count).into_iter().enumerate() {
                    assert_eq!(count_wrong(op, &output, rank, n, count / n), 0, "{op:?} rank {rank} of {n}");
                    let last = output.len() - 1;
                    output[last] += 1.0;
                    let counted = if op == BenchOp::Reduce && rank != 0 { 0 } else { 1 };
                    assert_eq!(count_wrong(op, &output, rank, n, count / n), counted, "{op:?} rank {rank} of {n}");
                }
            }
        }
    }

    #[test]
    fn bus_factors_are_nccl_tests_ones() {
        assert_eq!(BenchOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(BenchOp::AllGather.bus_factor(4), 0.75);
        assert_eq!(BenchOp::Broadcast.bus_factor(4), 1.0);
    }
}
