//! One rank of a test job, run as a real process by the integration tests: joins the job from
//! torchrun-style environment variables and all-reduces in a loop, printing `ok N` after each
//! checked result, until `--iterations` are done or an operation fails (printed on stderr,
//! exit code 1).

use std::process::ExitCode;
use std::time::Duration;

use medley_comm::{Communicator, Config, LaunchEnv, ReduceOp};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str, default: u64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (iterations, elems, timeout_ms) =
        (flag("--iterations", 1), flag("--elems", 1024) as usize, flag("--timeout-ms", 5000));
    let config = Config {
        timeout: Duration::from_millis(timeout_ms),
        connect_timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let run = || -> Result<(), medley_comm::CommError> {
        let env = LaunchEnv::from_vars(std::env::vars())?;
        let mut comm = Communicator::init(&env, config)?;
        let n = comm.n_ranks() as f32;
        let input: Vec<f32> = (0..elems).map(|i| (comm.rank() + i % 3) as f32).collect();
        let mut output = vec![0f32; elems];
        for iteration in 0..iterations {
            comm.all_reduce(&input, &mut output, ReduceOp::Sum)?;
            let expected = |i: usize| n * (n - 1.0) / 2.0 + n * (i % 3) as f32;
            if let Some(i) = (0..elems).find(|&i| output[i] != expected(i)) {
                eprintln!("wrong result at {i}: {} instead of {}", output[i], expected(i));
                std::process::exit(3);
            }
            println!("ok {iteration}");
        }
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
