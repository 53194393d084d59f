//! `medley bench comm`'s harness: nccl-tests-style bandwidth tables for the medley communicator.
//!
//! The parent starts one real process per rank (`medley bench-comm-worker`, hidden) for each
//! setup and rank count, with the torchrun-style environment the communicator reads; each worker
//! runs [`crate::comm::sweep`], rank 0 prints one JSON row per measurement, and the parent
//! prints them as a table or as JSON. The run fails if any output element was wrong.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::comm::{BenchOp, CommSetup, Row, Sweep};
use anyhow::{Context, Result, bail};
use clap::Args;
use comfy_table::Cell;
use medley_collective::Algorithm;
use medley_comm::{Communicator, LaunchEnv};
use medley_launch::{LocalJob, RankCommand};
use serde::Serialize;
use serde::de::DeserializeOwned;

use medley_report::text::{right, table};
use medley_spec::parse_gb_s;

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
    #[arg(long, value_parser = parse_setup, value_delimiter = ',', default_value = "shm,tcp,two-domain")]
    setups: Vec<CommSetup>,
    /// Operations to run.
    #[arg(
        long,
        value_parser = parse_op,
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

/// A value by its kebab-case serde name, as the library's enums are written in JSON rows.
fn parse_name<T: DeserializeOwned>(text: &str, expected: &str) -> Result<T, String> {
    serde_json::from_value(serde_json::Value::String(text.trim().to_string()))
        .map_err(|_| format!("{text:?} is not one of {expected}"))
}

/// A value's kebab-case serde name, for a worker's arguments.
fn name_of<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value).ok().and_then(|name| name.as_str().map(str::to_string)).expect("a unit variant")
}

fn parse_algorithm(text: &str) -> Result<Algorithm, String> {
    parse_name(text, "ring, tree, hierarchical, recursive-doubling, direct or pairwise")
}

fn parse_setup(text: &str) -> Result<CommSetup, String> {
    parse_name(text, "shm, tcp, two-domain or two-domain-shm-bridge")
}

fn parse_op(text: &str) -> Result<BenchOp, String> {
    parse_name(text, "all-reduce, reduce-scatter, all-gather, broadcast, reduce or all-to-all")
}

/// One rank of a benchmark run (started by `medley bench comm`, never by hand).
#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[arg(long, value_parser = parse_setup)]
    setup: CommSetup,
    #[arg(long, value_parser = parse_op, value_delimiter = ',')]
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

/// The largest message the benchmark sends: every rank holds two buffers of it.
const MAX_MESSAGE_BYTES: usize = 16 << 30;

/// `medley bench comm`, its workers started as `exe bench-comm-worker ...`.
pub fn run(args: &CommArgs, exe: &Path) -> Result<()> {
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        bail!("--min-bytes {} must be positive and at most --max-bytes {}", args.min_bytes, args.max_bytes);
    }
    if args.max_bytes > MAX_MESSAGE_BYTES {
        bail!(
            "--max-bytes {}: the benchmark sends at most {MAX_MESSAGE_BYTES} bytes (16 GiB) a message",
            args.max_bytes
        );
    }
    if let Some(n) = args.ranks.iter().find(|&&n| n == 0) {
        bail!("--ranks {n}: a run needs at least one rank");
    }
    let mut rows = Vec::new();
    for &setup in &args.setups {
        for &n_ranks in &args.ranks {
            let run =
                run_workers(args, exe, setup, n_ranks).with_context(|| format!("{setup:?} with {n_ranks} ranks"))?;
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
fn bridge_cap(args: &CommArgs, setup: CommSetup) -> Option<u64> {
    args.bridge_gb_s.filter(|_| setup == CommSetup::TwoDomain).map(|gb_s| (gb_s * 1e9) as u64)
}

/// Starts `n_ranks` workers, collects rank 0's rows, and fails with a worker's stderr if any fails.
fn run_workers(args: &CommArgs, exe: &Path, setup: CommSetup, n_ranks: usize) -> Result<Vec<Row>> {
    let ops: Vec<String> = args.ops.iter().map(name_of).collect();
    let setup_name = name_of(&setup);
    let mut worker: Vec<String> =
        ["bench-comm-worker", "--setup", &setup_name, "--ops", &ops.join(",")].into_iter().map(String::from).collect();
    worker.extend([format!("--min-bytes={}", args.min_bytes), format!("--max-bytes={}", args.max_bytes)]);
    worker.push(format!("--timeout-s={}", args.timeout_s));
    worker.extend(bridge_cap(args, setup).map(|cap| format!("--bridge-bytes-per-s={cap}")));
    if !args.algorithms.is_empty() {
        let names: Vec<String> = args.algorithms.iter().map(name_of).collect();
        worker.push(format!("--algorithms={}", names.join(",")));
    }
    let worker: Vec<OsString> = worker.into_iter().map(OsString::from).collect();
    let ranks: Vec<RankCommand> = (0..n_ranks)
        .map(|rank| RankCommand { args: worker.clone(), domain: setup.domain(rank, n_ranks).to_string() })
        .collect();
    let mut job = LocalJob::start(exe, &ranks, None)?;
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

/// A worker: joins the job from the environment and measures every operation and size; rank 0
/// prints each row as a line of JSON.
pub fn worker(args: &WorkerArgs) -> Result<()> {
    let env = LaunchEnv::from_vars(std::env::vars())?;
    let config = args.setup.config(Duration::from_secs(args.timeout_s), args.bridge_bytes_per_s);
    let mut comm = Communicator::init(&env, config)?;
    let sweep = Sweep {
        setup: args.setup,
        ops: args.ops.clone(),
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        algorithms: args.algorithms.clone(),
        bridge_bytes_per_s: args.bridge_bytes_per_s,
    };
    crate::comm::sweep(&mut comm, &sweep, |row| {
        println!("{}", serde_json::to_string(&row).expect("a row is plain data"));
        Ok(())
    })?;
    Ok(())
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
        assert_eq!(bridge_cap(&args, CommSetup::TwoDomain), Some(500_000_000));
        assert_eq!(bridge_cap(&args, CommSetup::TwoDomainShmBridge), None);
    }

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4K"), Ok(4096));
        assert_eq!(parse_bytes("256m"), Ok(256 << 20));
        assert!(parse_bytes("lots").is_err());
    }
}
