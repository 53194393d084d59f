//! The communicator over real transports: ranks as threads of this process for correctness
//! (every operation, type and algorithm against a locally computed reference), and as real
//! processes for the failures a thread cannot show (a killed rank, a stranger with the wrong
//! token).
//!
//! Inputs are small integers whose sums and products are exact in every type and any order
//! (as nccl-tests chooses them), so even averages compare exactly: the sum is exact and divided
//! once.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use medley_collective::reference::expected_results;
use medley_comm::{
    Algorithm, CommError, Communicator, Config, Counts, DType, Element, LaunchEnv, Op, ReduceOp, TransportKind, bf16,
    f16,
};
use proptest::prelude::*;

const TOKEN: &str = "test-token";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn launch_vars(rank: usize, world: usize, port: u16, domain: &str, token: &str) -> Vec<(String, String)> {
    [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("MEDLEY_DOMAIN", domain.to_string()),
        ("MEDLEY_TOKEN", token.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Runs `body` on every rank of a job whose rank r is in `domains[r]`, each rank a thread.
fn job<R: Send>(domains: &[&str], config: &Config, body: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    let port = free_port();
    let world = domains.len();
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let (body, config) = (&body, config.clone());
                let vars = launch_vars(rank, world, port, domains[rank], TOKEN);
                scope.spawn(move || {
                    let mut comm = Communicator::init(&LaunchEnv::from_vars(vars).unwrap(), config).unwrap();
                    body(&mut comm)
                })
            })
            .collect();
        ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
    })
}

fn quick_config() -> Config {
    Config { timeout: Duration::from_secs(10), connect_timeout: Duration::from_secs(10), ..Config::default() }
}

/// The test values as each element type; integers in −2..=2 (0..=2 unsigned), so products over
/// 8 ranks are powers of two, exact even in bfloat16.
trait Small: Element {
    fn small(v: i64) -> Self;
}
macro_rules! small {
    ($($t:ty => $conv:expr),*) => { $(impl Small for $t { fn small(v: i64) -> $t { $conv(v) } })* };
}
small!(f32 => |v| v as f32, f64 => |v| v as f64, f16 => |v| f16::from_f64(v as f64), bf16 => |v| bf16::from_f64(v as f64),
       i32 => |v| v as i32, i64 => |v| v, u8 => |v: i64| v.rem_euclid(3) as u8);

fn value(seed: u64, rank: usize, i: usize) -> i64 {
    ((seed as usize + 31 * rank + 17 * i) % 5) as i64 - 2
}

/// One collective's data for every rank.
struct Case<T> {
    inputs: Vec<Vec<T>>,
    output_len: Vec<usize>,
    /// What each output must hold (`None`: unspecified).
    expected: Vec<Option<Vec<T>>>,
}

fn case<T: Small>(op: Op, counts: &Counts, n: usize, seed: u64) -> Case<T> {
    let input_len = |r: usize| match counts {
        Counts::Same(len) => *len,
        Counts::PerRank(sizes) if op == Op::AllGather => sizes[r],
        Counts::PerRank(sizes) => sizes.iter().sum(),
        Counts::PerPair(matrix) => matrix[r].iter().sum(),
    };
    let inputs: Vec<Vec<T>> =
        (0..n).map(|r| (0..input_len(r)).map(|i| T::small(value(seed, r, i))).collect()).collect();
    let expected = expected_results(op, counts, &inputs, T::combine, T::divide);
    let output_len = (0..n)
        .map(|r| match op {
            Op::Reduce { .. } => input_len(r),
            _ => expected[r].as_ref().map_or(0, Vec::len),
        })
        .collect();
    Case { inputs, output_len, expected }
}

/// One collective call with the seed of its inputs.
#[derive(Clone, Copy)]
struct Call<'a> {
    op: Op,
    counts: &'a Counts,
    algorithm: Algorithm,
    seed: u64,
}

/// Runs `call` with `T` on this rank and compares with the reference.
fn check<T: Small>(comm: &mut Communicator, call: Call<'_>) -> Result<(), String> {
    let Call { op, counts, algorithm, seed } = call;
    let Case { inputs, output_len, expected } = case::<T>(op, counts, comm.n_ranks(), seed);
    let r = comm.rank();
    let mut output = vec![T::small(0); output_len[r]];
    comm.collective(op, counts, Some(algorithm), &inputs[r], &mut output)
        .map_err(|err| format!("{op:?} {:?} {algorithm:?}: {err}", T::DTYPE))?;
    match &expected[r] {
        Some(expected) if *expected != output => Err(format!(
            "{op:?} {:?} {algorithm:?} {counts:?} rank {r}: got {output:?}, expected {expected:?}",
            T::DTYPE
        )),
        _ => Ok(()),
    }
}

fn check_every_type(comm: &mut Communicator, call: Call<'_>) -> Result<(), String> {
    check::<f32>(comm, call)?;
    check::<f64>(comm, call)?;
    check::<f16>(comm, call)?;
    check::<bf16>(comm, call)?;
    check::<i32>(comm, call)?;
    check::<i64>(comm, call)?;
    check::<u8>(comm, call)
}

/// The algorithms `comm` can run `op` with: those that read peers' windows need ranks that share them.
fn runnable(comm: &Communicator, op: Op) -> Vec<Algorithm> {
    Algorithm::ALL.into_iter().filter(|a| a.supports(op) && (!a.needs_windows() || comm.shares_windows())).collect()
}

const REDUCE_OPS: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod];

/// Every operation with the counts it takes: `len` elements, `sizes` per rank, `matrix` per pair.
fn every_op(n: usize, len: usize, sizes: &[usize], matrix: &[Vec<usize>], root: usize) -> Vec<(Op, Counts)> {
    let mut ops = Vec::new();
    for op in REDUCE_OPS {
        ops.push((Op::AllReduce { op }, Counts::Same(len)));
        ops.push((Op::ReduceScatter { op }, Counts::PerRank(sizes.to_vec())));
        ops.push((Op::Reduce { op, root: root % n }, Counts::Same(len)));
    }
    ops.push((Op::AllGather, Counts::PerRank(sizes.to_vec())));
    ops.push((Op::Broadcast { root: root % n }, Counts::Same(len)));
    ops.push((Op::AllToAll, Counts::PerPair(matrix.to_vec())));
    ops.push((Op::Barrier, Counts::Same(0)));
    ops
}

#[derive(Clone, Debug)]
struct JobCase {
    domains: Vec<&'static str>,
    len: usize,
    sizes: Vec<usize>,
    matrix: Vec<Vec<usize>>,
    root: usize,
    seed: u64,
    intra_domain: TransportKind,
    bridge: TransportKind,
    chunk_bytes: usize,
    tcp_streams: usize,
}

fn job_case() -> impl Strategy<Value = JobCase> {
    (1usize..=8, 0usize..3)
        .prop_flat_map(|(n, n_amd)| {
            let route = prop_oneof![Just(TransportKind::Shm), Just(TransportKind::Tcp)];
            (
                Just(n),
                Just(n_amd.min(n - 1)),
                0usize..40,
                prop::collection::vec(0usize..9, n),
                prop::collection::vec(prop::collection::vec(0usize..6, n), n),
                (0usize..8, any::<u64>()),
                (route.clone(), route),
                (prop_oneof![Just(8usize), Just(24), Just(1 << 20)], 1usize..=3),
            )
        })
        .prop_map(|(n, n_amd, len, sizes, matrix, (root, seed), (intra_domain, bridge), (chunk_bytes, tcp_streams))| {
            // The amd ranks sit in the middle, so domains are not contiguous in rank order.
            let domains = (0..n).map(|r| if r >= n / 2 && r < n / 2 + n_amd { "amd" } else { "nvidia" }).collect();
            JobCase {
                domains,
                len,
                sizes,
                matrix,
                root,
                seed: seed % 1000,
                intra_domain,
                bridge,
                chunk_bytes,
                tcp_streams,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]

    /// Every operation, element type and algorithm, in and across domains, over shared memory
    /// and TCP, with uneven counts and chunks down to one element, equals the reference.
    #[test]
    fn every_op_type_and_algorithm_matches_the_reference(case in job_case()) {
        let config = Config {
            intra_domain: case.intra_domain,
            bridge: case.bridge,
            chunk_bytes: case.chunk_bytes,
            tcp_streams: case.tcp_streams,
            ..quick_config()
        };
        let n = case.domains.len();
        let ops = every_op(n, case.len, &case.sizes, &case.matrix, case.root);
        let results = job(&case.domains, &config, |comm| -> Result<(), String> {
            for (op, counts) in &ops {
                for algorithm in runnable(comm, *op) {
                    check_every_type(comm, Call { op: *op, counts, algorithm, seed: case.seed })?;
                }
            }
            Ok(())
        });
        for result in results {
            prop_assert!(result.is_ok(), "{}", result.unwrap_err());
        }
    }
}

/// Messages large enough to be striped over several TCP streams and pipelined in many chunks
/// over shared memory, across two domains with the hierarchical algorithm and flat.
#[test]
fn large_messages_stripe_and_pipeline() {
    let sizes = [300_001usize, 0, 170_000];
    let matrix = vec![vec![70_000, 1, 90_000]; 3];
    for bridge in [TransportKind::Tcp, TransportKind::Shm] {
        let config = Config { bridge, tcp_streams: 3, chunk_bytes: 256 << 10, ..quick_config() };
        let results = job(&["nvidia", "amd", "nvidia"], &config, |comm| -> Result<(), String> {
            let ops = [
                (Op::AllReduce { op: ReduceOp::Sum }, Counts::Same(500_000)),
                (Op::ReduceScatter { op: ReduceOp::Max }, Counts::PerRank(sizes.to_vec())),
                (Op::AllGather, Counts::PerRank(sizes.to_vec())),
                (Op::AllToAll, Counts::PerPair(matrix.clone())),
            ];
            for (op, counts) in &ops {
                for algorithm in runnable(comm, *op) {
                    check::<f32>(comm, Call { op: *op, counts, algorithm, seed: 5 })?;
                }
            }
            Ok(())
        });
        assert!(results.iter().all(Result::is_ok), "{bridge:?}: {results:?}");
    }
}

/// All-reduces through windows, over several segments (so both window slots) and within one,
/// every type and reduction; and the refusal where ranks cannot share windows.
/// Ranks whose inputs lie on both sides of a size threshold still choose one algorithm: the
/// choice is made on what every rank knows (the counts), not on each rank's own input.
#[test]
fn an_uneven_all_gather_across_the_small_message_threshold_runs_with_the_default_algorithm() {
    let small = medley_collective::SMALL_BYTES / 4;
    let sizes = [small / 8, small * 2, 3];
    let results = job(&["nvidia"; 3], &quick_config(), |comm| -> Result<Vec<f32>, String> {
        let rank = comm.rank();
        let input: Vec<f32> = (0..sizes[rank]).map(|i| (rank * 1000 + i % 1000) as f32).collect();
        let mut output = vec![0f32; sizes.iter().sum()];
        comm.all_gather(&input, &mut output, &sizes).map_err(|err| err.to_string())?;
        Ok(output)
    });
    let expected: Vec<f32> =
        (0..3).flat_map(|rank| (0..sizes[rank]).map(move |i| (rank * 1000 + i % 1000) as f32)).collect();
    for result in results {
        assert!(result.as_ref().is_ok_and(|output| *output == expected), "{:?}", result.map(|output| output.len()));
    }
}

#[test]
fn window_all_reduces_match_the_reference() {
    let results = job(&["nvidia"; 3], &quick_config(), |comm| -> Result<(), String> {
        assert!(comm.shares_windows());
        for len in [0, 1, 5, 300_001] {
            for op in REDUCE_OPS {
                let call = Call {
                    op: Op::AllReduce { op },
                    counts: &Counts::Same(len),
                    algorithm: Algorithm::Direct,
                    seed: 7,
                };
                check_every_type(comm, call)?;
            }
        }
        let (op, floats) = (Op::AllReduce { op: ReduceOp::Sum }, Counts::Same((64 << 20) / 4));
        assert_eq!(comm.choice(op, &floats, None, DType::F32).algorithm, Algorithm::Direct);
        Ok(())
    });
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    for (domains, intra_domain) in [(["nvidia", "nvidia"], TransportKind::Tcp), (["nvidia", "amd"], TransportKind::Shm)]
    {
        let config = Config { intra_domain, bridge: TransportKind::Shm, ..quick_config() };
        let results = job(&domains, &config, |comm| {
            let counts = Counts::Same(4);
            let mut out = [0f32; 4];
            let refused = comm.collective(
                Op::AllReduce { op: ReduceOp::Sum },
                &counts,
                Some(Algorithm::Direct),
                &[1f32; 4],
                &mut out,
            );
            (comm.shares_windows(), refused)
        });
        for (shares, refused) in results {
            assert!(!shares, "{domains:?} {intra_domain:?}");
            assert!(matches!(refused, Err(CommError::NeedsWindows { .. })), "{refused:?}");
        }
    }
}

/// A capped bridge carries no more than its cap, and still delivers every byte: 1 MiB each way
/// across a 10 MB/s bridge (2 ranks' ring: half the buffer in each phase) takes at least 0.1 s.
#[test]
fn a_capped_bridge_is_slow_but_exact() {
    let config = Config { bridge_bytes_per_s: Some(10_000_000), ..quick_config() };
    let elems = 1 << 18;
    let results = job(&["nvidia", "amd"], &config, |comm| {
        let input: Vec<f32> = (0..elems).map(|i| (comm.rank() + i % 7) as f32).collect();
        let mut output = vec![0f32; elems];
        let start = Instant::now();
        let counts = Counts::Same(elems);
        comm.collective(Op::AllReduce { op: ReduceOp::Sum }, &counts, Some(Algorithm::Ring), &input, &mut output)
            .unwrap();
        let exact = output.iter().enumerate().all(|(i, &v)| v == (1 + 2 * (i % 7)) as f32);
        (exact, start.elapsed())
    });
    for (rank, (exact, took)) in results.into_iter().enumerate() {
        assert!(exact, "rank {rank}: wrong sum");
        assert!(took >= Duration::from_millis(100), "rank {rank}: {took:?} for 1 MiB over 10 MB/s");
    }
}

/// Recursive doubling over 4 ranks: in the second round both partners send a buffer they then
/// receive into, zero-copy (far above the eager size): each must receive before its own send is
/// taken, or both wait on each other until the timeout.
#[test]
fn large_exchanges_do_not_wait_on_each_other() {
    for intra_domain in [TransportKind::Shm, TransportKind::Tcp] {
        let config = Config { intra_domain, chunk_bytes: 64 << 10, ..quick_config() };
        let results = job(&["nvidia"; 4], &config, |comm| -> Result<(), String> {
            for len in [1, 3_000, 200_001] {
                let (op, counts) = (Op::AllReduce { op: ReduceOp::Sum }, Counts::Same(len));
                check::<f32>(comm, Call { op, counts: &counts, algorithm: Algorithm::RecursiveDoubling, seed: 3 })?;
            }
            Ok(())
        });
        assert!(results.iter().all(Result::is_ok), "{intra_domain:?}: {results:?}");
    }
}

#[test]
fn asynchronous_sends_let_every_rank_send_before_it_receives() {
    // Messages above the eager size go single-copy, where a blocking send would wait for the
    // receiver: with every rank sending first, only asynchronous sends finish.
    const LEN: usize = 50_000;
    for intra_domain in [TransportKind::Shm, TransportKind::Tcp] {
        let config = Config { intra_domain, ..quick_config() };
        let results = job(&["nvidia", "nvidia", "amd"], &config, |comm| {
            let (rank, n) = (comm.rank(), comm.n_ranks());
            let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
            for round in 0..3 {
                comm.isend(vec![(10 * rank + round) as f32; LEN], next)?;
                comm.isend(vec![-((10 * rank + round) as f32); LEN], prev)?;
            }
            let mut sums = Vec::new();
            for _ in 0..3 {
                let (mut from_prev, mut from_next) = (vec![0f32; LEN], vec![0f32; LEN]);
                comm.recv(&mut from_prev, prev)?;
                comm.recv(&mut from_next, next)?;
                sums.push((from_prev[LEN - 1], from_next[0]));
            }
            comm.wait_sends()?;
            Ok::<_, CommError>(sums)
        });
        for (rank, sums) in results.into_iter().enumerate() {
            let (prev, next) = ((rank + 2) % 3, (rank + 1) % 3);
            let expected: Vec<_> =
                (0..3).map(|round| ((10 * prev + round) as f32, -((10 * next + round) as f32))).collect();
            assert_eq!(sums, Ok(expected), "{intra_domain:?} rank {rank}");
        }
    }
}

#[test]
fn point_to_point_and_split() {
    let results = job(&["nvidia", "nvidia", "amd", "amd", "nvidia"], &quick_config(), |comm| {
        let (rank, n) = (comm.rank(), comm.n_ranks());
        // A ring of sends: even ranks send first, odd ranks receive first, so over shared memory
        // (where a send returns once received) nobody waits on a waiting peer for long.
        let mut got = [0i64; 3];
        let mine = [rank as i64; 3];
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        if rank % 2 == 0 {
            comm.send(&mine, next).unwrap();
            comm.recv(&mut got, prev).unwrap();
        } else {
            comm.recv(&mut got, prev).unwrap();
            comm.send(&mine, next).unwrap();
        }
        // Odd ranks form one communicator in reverse order; rank 4 joins none.
        let color = match rank {
            4 => None,
            r => Some((r % 2) as u32),
        };
        let sub = comm.split(color, -(rank as i64)).unwrap();
        let sub_view = sub.map(|mut sub| {
            let mut sum = [0i64];
            sub.all_reduce(&[rank as i64], &mut sum, ReduceOp::Sum).unwrap();
            (sub.rank(), sub.job_ranks().to_vec(), sum[0])
        });
        comm.barrier().unwrap();
        (got[0], sub_view)
    });
    assert_eq!(results[0].0, 4);
    assert_eq!(results[3].0, 2);
    assert_eq!(results[0].1, Some((1, vec![2, 0], 2)));
    assert_eq!(results[2].1, Some((0, vec![2, 0], 2)));
    assert_eq!(results[1].1, Some((1, vec![3, 1], 4)));
    assert_eq!(results[4].1, None);
}

#[test]
fn bad_buffers_are_errors_that_leave_the_communicator_usable() {
    let results = job(&["a", "a"], &quick_config(), |comm| {
        let mut short = [0f32; 3];
        let err = comm.all_reduce(&[1f32; 4], &mut short, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, CommError::BufferLength { what: "output", expected: 4, got: 3 }), "{err}");
        let err = comm.send(&[1u8], 7).unwrap_err();
        assert!(matches!(err, CommError::NoSuchRank { peer: 7, .. }), "{err}");
        let mut out = [0f32; 4];
        comm.all_reduce(&[1f32; 4], &mut out, ReduceOp::Sum).unwrap();
        out
    });
    assert_eq!(results, vec![[2.0; 4]; 2]);
}

/// Every result must be an error blaming `blamed`, returned within `within`.
fn assert_all_blame(results: &[(Result<(), CommError>, Duration)], blamed: usize, within: Duration) {
    for (result, took) in results {
        let err = result.as_ref().expect_err("the operation failed");
        assert_eq!(err.blamed_rank(), Some(blamed), "{err}");
        assert!(err.to_string().contains(&format!("rank {blamed}")), "{err}");
        assert!(*took < within, "failed only after {took:?}: {err}");
    }
}

#[test]
fn mismatched_calls_are_reported_on_every_rank() {
    let setups =
        [(TransportKind::Shm, None), (TransportKind::Tcp, None), (TransportKind::Shm, Some(Algorithm::Direct))];
    for (intra_domain, algorithm) in setups {
        let config = Config { intra_domain, timeout: Duration::from_secs(5), ..quick_config() };
        let results = job(&["a", "a", "a"], &config, |comm| {
            let len = if comm.rank() == 1 { 9 } else { 8 };
            let mut out = vec![0f32; len];
            let (op, counts) = (Op::AllReduce { op: ReduceOp::Sum }, Counts::Same(len));
            let first = comm.collective(op, &counts, algorithm, &vec![1f32; len], &mut out).unwrap_err();
            // The communicator stays failed: the next call fails at once with the same blame.
            let next = comm.barrier().unwrap_err();
            (first, next)
        });
        for (first, next) in &results {
            assert!(first.blamed_rank().is_some(), "{first}");
            assert!(next.blamed_rank().is_some(), "{next}");
        }
        let mismatch = results.iter().find(|(first, _)| matches!(first, CommError::Mismatch { .. }));
        assert!(mismatch.is_some(), "{intra_domain:?} {algorithm:?}: no rank saw the mismatch: {results:?}");
    }
}

#[test]
fn a_silent_peer_is_blamed_within_the_timeout() {
    for intra_domain in [TransportKind::Shm, TransportKind::Tcp] {
        let timeout = Duration::from_millis(800);
        let config = Config { intra_domain, timeout, ..quick_config() };
        let results = job(&["a", "a", "a"], &config, |comm| {
            let start = Instant::now();
            if comm.rank() == 2 {
                std::thread::sleep(timeout * 2);
                return (Ok(()), start.elapsed());
            }
            let mut out = [0f64; 1000];
            (comm.all_reduce(&[1.0; 1000], &mut out, ReduceOp::Sum), start.elapsed())
        });
        assert_all_blame(&results[..2], 2, timeout * 3);
    }
}

/// Starts the test rank binary as rank `rank` of a `world`-rank job.
fn spawn_rank(rank: usize, world: usize, port: u16, token: &str, args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_medley-comm-test-rank"))
        .args(args)
        .env_clear()
        .envs(launch_vars(rank, world, port, "nvidia", token))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the test rank starts")
}

/// Waits for `child` at most `limit`, killing it (and failing) past that; returns its stderr.
fn finish(mut child: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().ok();
            panic!("a test rank ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().unwrap();
    (output.status, String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Reads `child`'s stdout until it printed `line`.
fn wait_for_line(child: &mut Child, line: &str, limit: Duration) {
    use std::io::BufRead;
    let stdout = child.stdout.take().unwrap();
    let wanted = line.to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for text in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if text == wanted {
                tx.send(()).ok();
            }
        }
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("the rank did not print {line:?} within {limit:?}"));
}

/// With 1 MiB per rank the ranks all-reduce through their windows, with 64 KiB by messages.
#[test]
fn killing_a_rank_mid_collective_fails_every_other_rank_naming_it() {
    for elems in ["262144", "16384"] {
        kill_a_rank_mid_collective(elems);
    }
}

fn kill_a_rank_mid_collective(elems: &str) {
    let port = free_port();
    let args = ["--iterations", "1000000", "--elems", elems, "--timeout-ms", "4000"];
    let mut ranks: Vec<Child> = (0..4).map(|r| spawn_rank(r, 4, port, TOKEN, &args)).collect();
    wait_for_line(&mut ranks[2], "ok 3", Duration::from_secs(30));
    let started = Instant::now();
    ranks[2].kill().unwrap();
    for (rank, child) in ranks.into_iter().enumerate() {
        let (status, stderr) = finish(child, Duration::from_secs(20));
        if rank == 2 {
            continue;
        }
        assert_eq!(status.code(), Some(1), "rank {rank}: {stderr}");
        assert!(stderr.contains("rank 2"), "rank {rank} does not name rank 2: {stderr}");
    }
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}

#[test]
fn a_process_without_the_job_token_is_refused() {
    let port = free_port();
    let honest = spawn_rank(0, 2, port, TOKEN, &["--timeout-ms", "2000"]);
    let stranger = spawn_rank(1, 2, port, "not-the-token", &[]);
    let (status, stderr) = finish(stranger, Duration::from_secs(30));
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("refused") && stderr.contains("token"), "{stderr}");
    // Rank 0 never meets its peer: it gives up after its connect timeout instead of hanging.
    let mut honest = honest;
    honest.kill().ok();
    finish(honest, Duration::from_secs(5));
}

#[test]
fn a_rank_that_never_joins_is_named_within_the_join_budget_by_every_other() {
    // Rank 2 of 3 never starts (as a rank stopped at start-up): the others wait one budget for
    // it, all their waits together, and name it; they do not wait one budget per wait.
    let config =
        Config { timeout: Duration::from_secs(10), connect_timeout: Duration::from_secs(2), ..Config::default() };
    let port = free_port();
    let started = Instant::now();
    let errors: Vec<CommError> = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (config, vars) = (config.clone(), launch_vars(rank, 3, port, "nvidia", TOKEN));
                scope.spawn(move || Communicator::init(&LaunchEnv::from_vars(vars).unwrap(), config).err().unwrap())
            })
            .collect();
        ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
    });
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(6), "the join took {waited:?} on a 2 s budget");
    for err in errors {
        assert_eq!(err.blamed_rank(), Some(2), "{err}");
        assert!(err.to_string().contains("rank 2 did not answer within 2s"), "{err}");
    }
}
