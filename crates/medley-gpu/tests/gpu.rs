//! The CPU-forwarding bridge between vendor domains, with host memory standing in for device
//! buffers, over real medley communicators (ranks as threads on loopback); and the device paths,
//! which need a GPU: those are ignored here and run with `--ignored` where one is.

use std::net::TcpListener;
use std::time::Duration;

use medley_comm::{Communicator, Config, LaunchEnv};
use medley_gpu::{DeviceMemory, Gpu, GpuError, HostStandIn, NativeComm, Vendor, forward_all_reduce};
use proptest::prelude::*;

/// Runs `body` on every rank of a job whose rank r is in vendor domain `domains[r]`, each rank a
/// thread of this process.
fn job<R: Send>(domains: &[&str], body: impl Fn(&mut Communicator) -> R + Sync) -> Vec<R> {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let world = domains.len();
    let config =
        Config { timeout: Duration::from_secs(20), connect_timeout: Duration::from_secs(20), ..Config::default() };
    std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let vars = [
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("LOCAL_WORLD_SIZE", world.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.to_string()),
                    ("MEDLEY_DOMAIN", domains[rank].to_string()),
                    ("MEDLEY_TOKEN", "gpu-test".into()),
                ]
                .map(|(key, value)| (key.to_string(), value));
                let (body, config) = (&body, config.clone());
                scope.spawn(move || {
                    let mut comm = Communicator::init(&LaunchEnv::from_vars(vars.to_vec()).unwrap(), config).unwrap();
                    body(&mut comm)
                })
            })
            .collect();
        ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
    })
}

/// Small integers: their float sums are exact in any order.
fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 7 + rank * 3) % 9) as f32 - 4.0).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Any rank count and vendor mix, any length, any chunk size (a partial last chunk, one
    /// chunk, more chunks than elements would allow): every rank ends with the exact sum.
    #[test]
    fn forwarding_sums_exactly_across_domains(
        vendors in proptest::collection::vec(prop_oneof![Just("nvidia"), Just("amd")], 1..=4),
        len in 0usize..3000,
        chunk_bytes in 1usize..5000,
    ) {
        let expected: Vec<f32> =
            (0..len).map(|i| (0..vendors.len()).map(|rank| input(rank, len)[i]).sum()).collect();
        let results = job(&vendors, |comm| {
            let buffer = HostStandIn::new(&input(comm.rank(), len));
            forward_all_reduce(comm, &buffer, chunk_bytes).map(|()| buffer.floats())
        });
        for (rank, result) in results.into_iter().enumerate() {
            prop_assert_eq!(result.unwrap(), expected.clone(), "rank {}", rank);
        }
    }
}

#[test]
fn forwarding_refuses_a_buffer_of_partial_floats() {
    struct Odd;
    impl DeviceMemory for Odd {
        fn len_bytes(&self) -> usize {
            6
        }
        fn copy_to_host(&self, _: usize, _: &mut [u8]) -> Result<(), GpuError> {
            unreachable!("refused before any copy")
        }
        fn copy_from_host(&self, _: usize, _: &[u8]) -> Result<(), GpuError> {
            unreachable!("refused before any copy")
        }
    }
    let results = job(&["nvidia"], |comm| forward_all_reduce(comm, &Odd, 1024).unwrap_err().to_string());
    assert!(results[0].contains("6 bytes are not whole 4-byte floats"), "{}", results[0]);
}

#[test]
fn a_machine_without_the_driver_says_so() {
    // Where a GPU is, this only checks that counting works.
    for vendor in [Vendor::Nvidia, Vendor::Amd] {
        match Gpu::count(vendor) {
            Ok(_) => {}
            Err(err) => assert!(err.to_string().contains("is not installed here"), "{err}"),
        }
    }
}

/// On a GPU machine: `cargo test -p medley-gpu -- --ignored` (or the test binary with `--ignored`).
#[test]
#[ignore = "needs an NVIDIA GPU with NCCL"]
fn a_one_rank_nccl_all_reduce_keeps_the_values() {
    let values = input(0, 1 << 20);
    let results = job(&["nvidia"], |comm| -> Result<(Vec<f32>, i32), GpuError> {
        let gpu = Gpu::open(Vendor::Nvidia, 0)?;
        let mut buffer = gpu.alloc(values.len() * 4)?;
        buffer.copy_from_host(0, bytemuck::cast_slice(&values))?;
        let mut nccl = NativeComm::init(comm, &gpu, "test")?;
        nccl.all_reduce_sum_f32(&mut buffer)?;
        let mut back = vec![0u8; values.len() * 4];
        buffer.copy_to_host(0, &mut back)?;
        Ok((back.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(), nccl.version()?))
    });
    let (back, version) = results.into_iter().next().unwrap().unwrap();
    println!("NCCL {version}: one-rank all-reduce of {} floats", values.len());
    assert_eq!(back, values);
}

/// The forwarding bridge with real device buffers on both ranks (both on GPU 0 here).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn forwarding_between_device_buffers() {
    let len = 300_000;
    let expected: Vec<f32> = (0..len).map(|i| input(0, len)[i] + input(1, len)[i]).collect();
    let results = job(&["nvidia", "amd"], |comm| -> Result<Vec<f32>, GpuError> {
        let gpu = Gpu::open(Vendor::Nvidia, 0)?;
        let buffer = gpu.alloc(len * 4)?;
        buffer.copy_from_host(0, bytemuck::cast_slice(&input(comm.rank(), len)))?;
        forward_all_reduce(comm, &buffer, 256 << 10)?;
        let mut back = vec![0u8; len * 4];
        buffer.copy_to_host(0, &mut back)?;
        Ok(back.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    });
    for result in results {
        assert_eq!(result.unwrap(), expected);
    }
}
