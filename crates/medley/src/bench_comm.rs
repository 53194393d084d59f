//! `medley bench comm`: nccl-tests-style bandwidth tables for the medley communicator.
//!
//! The parent starts one real process per rank (`medley bench-comm-worker`, hidden) for each
//! setup and rank count, with the torchrun-style environment the communicator reads; rank 0
//! prints one JSON row per measurement and the parent prints them as a table or as JSON. Sizes
//! and bus-bandwidth factors follow nccl-tests (its PERFORMANCE.md): all-reduce 2(n−1)/n,
//! reduce-scatter, all-gather and all-to-all (n−1)/n, broadcast and reduce 1. Elements are f32,
//! reductions sums; time is the slowest rank's mean over the timed iterations. After the timed
//! calls every rank checks its output element by element (nccl-tests' `#wrong`), and the run
//! fails if any is wrong.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use comfy_table::Cell;
use medley_collective::{Algorithm, Counts, Op, ReduceOp};
use medley_comm::{Communicator, Config, DType, LaunchEnv, TransportKind};
use medley_launch::{LocalJob, RankCommand};
use serde::{Deserialize, Serialize};

use crate::inputs::parse_gb_s;
use crate::render::{right, table};

/// Which links the ranks use.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Setup {
    /// One domain, single-copy shared memory.
    Shm,
    /// One domain, TCP over loopback.
    Tcp,
    /// Two vendor domains (half the ranks each): shared memory inside, TCP across the bridge.
    TwoDomain,
    /// Two domains whose bridge is shared memory too, as fast as the domains.
    TwoDomainShmBridge,
}

impl Setup {
    fn config(self, timeout: Duration, bridge_bytes_per_s: Option<u64>) -> Config {
        let (intra_domain, bridge) = match self {
            Setup::Shm | Setup::TwoDomainShmBridge => (TransportKind::Shm, TransportKind::Shm),
            Setup::Tcp => (TransportKind::Tcp, TransportKind::Tcp),
            Setup::TwoDomain => (TransportKind::Shm, TransportKind::Tcp),
        };
        Config { timeout, intra_domain, bridge, bridge_bytes_per_s, ..Config::default() }
    }

    fn domain(self, rank: usize, n_ranks: usize) -> &'static str {
        match self {
            Setup::TwoDomain | Setup::TwoDomainShmBridge if rank >= n_ranks / 2 => "amd",
            _ => "nvidia",
        }
    }

    fn two_domains(self) -> bool {
        matches!(self, Setup::TwoDomain | Setup::TwoDomainShmBridge)
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    fn bus_factor(self, n: usize) -> f64 {
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
    fn shape(self, count: usize, n: usize) -> (Op, Counts, usize, usize) {
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
    fn bytes(self, count: usize, n: usize) -> usize {
        let elems = match self {
            BenchOp::AllReduce | BenchOp::Broadcast | BenchOp::Reduce => count,
            BenchOp::ReduceScatter | BenchOp::AllGather | BenchOp::AllToAll => count / n * n,
        };
        elems * size_of::<f32>()
    }

    fn redop(self) -> &'static str {
        match self {
            BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::Reduce => "sum",
            _ => "none",
        }
    }
}

/// A byte count: plain, or with a K, M or G suffix (binary).
fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&text[..text.len() - 1], 10),
        Some('M') => (&text[..text.len() - 1], 20),
        Some('G') => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits
        .parse::<usize>()
        .map(|n| n << shift)
        .map_err(|_| format!("{text:?} is not a byte count like 4096, 4K or 256M"))
}

#[derive(Args, Debug)]
pub struct CommArgs {
    /// Print the rows as a JSON array instead of tables.
    #[arg(long)]
    json: bool,
    /// Rank counts to run.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    ranks: Vec<usize>,
    /// Setups to run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "shm,tcp,two-domain")]
    setups: Vec<Setup>,
    /// Operations to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "all-reduce,reduce-scatter,all-gather,broadcast,reduce,all-to-all"
    )]
    ops: Vec<BenchOp>,
    /// Smallest size (bytes, or with K/M/G); sizes grow ×4 from here.
    #[arg(long, value_parser = parse_bytes, default_value = "4K")]
    min_bytes: usize,
    /// Largest size.
    #[arg(long, value_parser = parse_bytes, default_value = "256M")]
    max_bytes: usize,
    /// Seconds a rank waits on a peer before failing the run.
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
    /// Caps each link of the two-domain setup's TCP bridge at this many GB/s, emulating a
    /// vendor-to-vendor path slower than the domains' own links.
    #[arg(long, value_parser = parse_gb_s)]
    bridge_gb_s: Option<f64>,
    /// Time these algorithms side by side (e.g. ring,recursive-doubling,direct) wherever one
    /// supports the operation, instead of the one medley chooses.
    #[arg(long, value_delimiter = ',', value_parser = parse_algorithm)]
    algorithms: Vec<Algorithm>,
}

fn parse_algorithm(text: &str) -> Result<Algorithm, String> {
    serde_json::from_value(serde_json::Value::String(text.trim().to_string())).map_err(|_| {
        format!("{text:?} is not an algorithm: ring, tree, hierarchical, recursive-doubling, direct or pairwise")
    })
}

/// One rank of a benchmark run (started by `medley bench comm`, never by hand).
#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long, value_enum)]
    setup: Setup,
    #[arg(long, value_enum, value_delimiter = ',')]
    ops: Vec<BenchOp>,
    #[arg(long)]
    min_bytes: usize,
    #[arg(long)]
    max_bytes: usize,
    #[arg(long)]
    timeout_s: u64,
    #[arg(long)]
    bridge_bytes_per_s: Option<u64>,
    #[arg(long, value_delimiter = ',', value_parser = parse_algorithm)]
    algorithms: Vec<Algorithm>,
}

/// One measurement, as rank 0 prints it and `--json` reports it.
#[derive(Serialize, Deserialize, Debug)]
struct Row {
    op: BenchOp,
    bytes: usize,
    count: usize,
    #[serde(rename = "type")]
    dtype: String,
    redop: String,
    ranks: usize,
    transport: Setup,
    algorithm: Algorithm,
    time_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    /// Output elements, over every rank, that did not hold the right result after the timed calls.
    wrong: u64,
    /// The bridge's cap per link, when `--bridge-gb-s` set one on a TCP bridge.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    bridge_gbps: Option<f64>,
}

pub fn run(args: &CommArgs) -> Result<()> {
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        bail!("--min-bytes {} must be positive and at most --max-bytes {}", args.min_bytes, args.max_bytes);
    }
    if let Some(n) = args.ranks.iter().find(|&&n| n == 0) {
        bail!("--ranks {n}: a run needs at least one rank");
    }
    let mut rows = Vec::new();
    for &setup in &args.setups {
        for &n_ranks in &args.ranks {
            let run = run_workers(args, setup, n_ranks).with_context(|| format!("{setup:?} with {n_ranks} ranks"))?;
            if !args.json {
                println!("{}", render(&run));
            }
            rows.extend(run);
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    }
    let wrong: Vec<String> = rows
        .iter()
        .filter(|row| row.wrong > 0)
        .map(|row| {
            format!("{:?} of {} B on {} {:?} ranks ({} wrong)", row.op, row.bytes, row.ranks, row.transport, row.wrong)
        })
        .collect();
    if !wrong.is_empty() {
        bail!("wrong results: {}", wrong.join("; "));
    }
    Ok(())
}

fn render(rows: &[Row]) -> String {
    let Some(first) = rows.first() else { return String::new() };
    let mut out = table(&[
        "size (B)",
        "count",
        "type",
        "redop",
        "op",
        "algorithm",
        "time (us)",
        "algbw (GB/s)",
        "busbw (GB/s)",
        "#wrong",
    ]);
    for row in rows {
        out.add_row(vec![
            right(row.bytes),
            right(row.count),
            Cell::new(&row.dtype),
            Cell::new(&row.redop),
            Cell::new(format!("{:?}", row.op)),
            Cell::new(format!("{:?}", row.algorithm).to_lowercase()),
            right(format!("{:.1}", row.time_us)),
            right(format!("{:.2}", row.algbw_gbps)),
            right(format!("{:.2}", row.busbw_gbps)),
            right(row.wrong),
        ]);
    }
    let bridge = first.bridge_gbps.map(|gb_s| format!(", bridge capped at {gb_s} GB/s")).unwrap_or_default();
    format!("# {:?}, {} ranks{bridge}\n{out}\n", first.transport, first.ranks)
}

/// The bridge cap (bytes/s) a setup runs with: only a TCP bridge is capped.
fn bridge_cap(args: &CommArgs, setup: Setup) -> Option<u64> {
    args.bridge_gb_s.filter(|_| setup == Setup::TwoDomain).map(|gb_s| (gb_s * 1e9) as u64)
}

/// Starts `n_ranks` workers, collects rank 0's rows, and fails with a worker's stderr if any fails.
fn run_workers(args: &CommArgs, setup: Setup, n_ranks: usize) -> Result<Vec<Row>> {
    let exe = std::env::current_exe().context("finding the medley binary to start workers")?;
    let ops: Vec<String> =
        args.ops.iter().map(|op| op.to_possible_value().expect("not skipped").get_name().to_string()).collect();
    let setup_name = setup.to_possible_value().expect("not skipped").get_name().to_string();
    let mut worker: Vec<String> =
        ["bench-comm-worker", "--setup", &setup_name, "--ops", &ops.join(",")].into_iter().map(String::from).collect();
    worker.extend([format!("--min-bytes={}", args.min_bytes), format!("--max-bytes={}", args.max_bytes)]);
    worker.push(format!("--timeout-s={}", args.timeout_s));
    worker.extend(bridge_cap(args, setup).map(|cap| format!("--bridge-bytes-per-s={cap}")));
    if !args.algorithms.is_empty() {
        let names: Vec<String> = args
            .algorithms
            .iter()
            .map(|a| serde_json::to_value(a).expect("a name"))
            .map(|v| v.as_str().expect("a string").to_string())
            .collect();
        worker.push(format!("--algorithms={}", names.join(",")));
    }
    let worker: Vec<OsString> = worker.into_iter().map(OsString::from).collect();
    let ranks: Vec<RankCommand> = (0..n_ranks)
        .map(|rank| RankCommand { args: worker.clone(), domain: setup.domain(rank, n_ranks).to_string() })
        .collect();
    let mut job = LocalJob::start(&exe, &ranks, None)?;
    let stdout = job.take_rank0_stdout().expect("rank 0's output is piped");
    let rows: Result<Vec<Row>> = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .map(|line| serde_json::from_str(&line).with_context(|| format!("a worker printed {line:?}")))
        .collect();
    // Rank 0 closed its output: every rank is at most one timeout from done.
    let timeout = Duration::from_secs(args.timeout_s + 10);
    let end = job.wait(timeout, Some(Instant::now() + timeout));
    if let Some(&rank) = end.failed_ranks().first() {
        bail!("worker {rank} {}: {}", end.describe(rank), end.stderr[rank].join("\n").trim());
    }
    rows
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

/// A worker: joins the job from the environment and measures every operation and size.
pub fn worker(args: &WorkerArgs) -> Result<()> {
    let env = LaunchEnv::from_vars(std::env::vars())?;
    let config = args.setup.config(Duration::from_secs(args.timeout_s), args.bridge_bytes_per_s);
    let mut comm = Communicator::init(&env, config)?;
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
                let calls = |comm: &mut Communicator, output: &mut [f32], n: usize| -> Result<f64> {
                    let start = Instant::now();
                    for _ in 0..n {
                        comm.collective(coll, &counts, Some(algorithm), &input, output)?;
                    }
                    Ok(slowest(comm, start.elapsed().as_secs_f64())? / n as f64)
                };
                let (mut batch, mut warmed, mut per_call) = (1, 0.0, 0.0);
                while (warmed < WARM_UP.as_secs_f64() || batch <= MIN_WARM_CALLS) && batch <= MAX_ITERS {
                    per_call = calls(&mut comm, &mut output, batch)?;
                    warmed += per_call * batch as f64;
                    batch *= 2;
                }
                let iters = ((TIME_PER_SIZE.as_secs_f64() / per_call.max(1e-9)) as usize).clamp(1, MAX_ITERS);
                // Poisoned, so a call that leaves any of it unwritten is counted wrong.
                output.fill(f32::NAN);
                comm.barrier()?;
                let time_s = calls(&mut comm, &mut output, iters)?;
                let wrong = count_wrong(op, &output, comm.rank(), n, count / n);
                let wrong = sum_over_ranks(&mut comm, wrong)?;
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
                    println!("{}", serde_json::to_string(&row)?);
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
fn sum_over_ranks(comm: &mut Communicator, count: u64) -> Result<u64> {
    let mut total = [0f64];
    comm.all_reduce(&[count as f64], &mut total, ReduceOp::Sum)?;
    Ok(total[0] as u64)
}

/// The largest of every rank's `seconds`.
fn slowest(comm: &mut Communicator, seconds: f64) -> Result<f64> {
    let mut max = [0f64];
    comm.all_reduce(&[seconds], &mut max, ReduceOp::Max)?;
    Ok(max[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bridge_cap_is_a_positive_number_and_only_caps_a_tcp_bridge() {
        assert_eq!(parse_gb_s("0.5"), Ok(0.5));
        for bad in ["0", "-1", "inf", "fast"] {
            assert!(parse_gb_s(bad).unwrap_err().contains(bad), "{bad}");
        }
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            comm: CommArgs,
        }
        let args = <Cli as clap::Parser>::try_parse_from(["comm", "--bridge-gb-s", "0.5"]).unwrap().comm;
        assert_eq!(bridge_cap(&args, Setup::TwoDomain), Some(500_000_000));
        assert_eq!(bridge_cap(&args, Setup::TwoDomainShmBridge), None);
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4K"), Ok(4096));
        assert_eq!(parse_bytes("256m"), Ok(256 << 20));
        assert!(parse_bytes("lots").is_err());
    }

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
