//! The spec formats as users write them: the shipped examples stay valid, and any inline
//! cluster either parses into the GPUs it names or is refused with a message.

use medley_spec::{Bridge, Cluster, Fabric, JobSpec, Precision, Vendor, catalog_devices};
use proptest::prelude::*;

fn example(name: &str) -> String {
    let path = format!("{}/../../examples/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path}: {err}"))
}

#[test]
fn shipped_examples_parse() {
    let cluster = Cluster::from_toml(&example("cluster.toml"), "examples/cluster.toml").unwrap();
    assert_eq!(cluster.n_gpus(), 64 + 128 + 32 + 4);
    assert_eq!(cluster.vendors(), [Vendor::Nvidia, Vendor::Amd]);
    assert_eq!(cluster.groups()[3].device.name, "lab-gpu");
    let job = JobSpec::from_toml(&example("job.toml"), "examples/job.toml").unwrap();
    assert_eq!((job.seq_len(), job.global_batch()), (8192, 512));
}

/// Every catalog device makes a fleet, which trains in fp16 and fp32, and in bf16 and tf32 where
/// the device has them (issue 33: the V100 and T4 have neither, and a job in either is refused
/// naming them).
#[test]
fn every_catalog_device_is_a_valid_inline_cluster() {
    for device in catalog_devices() {
        let cluster =
            Cluster::from_inline(&format!("16x{}", device.name), Fabric::default(), Bridge::default()).unwrap();
        assert_eq!(cluster.groups()[0].device, device);
        cluster.check_precision(Precision::Fp16Mixed).unwrap();
        cluster.check_precision(Precision::Fp32).unwrap();
        for (rate, precision) in [(device.bf16_tflops, Precision::Bf16Mixed), (device.tf32_tflops, Precision::Tf32)] {
            match (rate, cluster.check_precision(precision)) {
                (Some(_), result) => result.unwrap(),
                (None, result) => {
                    let err = result.unwrap_err().to_string();
                    assert!(err.contains(&format!("{} has none", device.name)), "{err}");
                }
            }
        }
    }
    let mixed = Cluster::from_inline("8xh100,8xt4", Fabric::default(), Bridge::default()).unwrap();
    let err = mixed.check_precision(Precision::Bf16Mixed).unwrap_err().to_string();
    assert!(err.contains("T4 has none") && err.contains("train in fp16-mixed or fp32 (--precision)"), "{err}");
    mixed.check_precision(Precision::Fp16Mixed).unwrap();
}

proptest! {
    #[test]
    fn inline_clusters_have_the_gpus_they_name(counts in prop::collection::vec((0usize..6, 1u32..40), 1..4)) {
        let names = ["h100", "a100", "mi300x", "l40s", "v100", "mi250x"];
        let text: Vec<String> = counts.iter().map(|&(device, count)| format!("{count}x{}", names[device])).collect();
        let text = text.join(",");
        match Cluster::from_inline(&text, Fabric::default(), Bridge::default()) {
            Ok(cluster) => {
                // An MI250X is a package of two devices, its GCDs.
                let devices_of = |device: usize, count: u32| if names[device] == "mi250x" { 2 * count } else { count };
                prop_assert_eq!(cluster.n_gpus(), counts.iter().map(|&(device, count)| devices_of(device, count)).sum::<u32>());
                let devices = cluster.devices();
                prop_assert!(devices.iter().enumerate().all(|(idx, slot)| slot.id as usize == idx));
                prop_assert!(devices.windows(2).all(|pair| pair[0].node_idx <= pair[1].node_idx));
            }
            Err(err) => prop_assert!(err.to_string().contains("whole"), "{}", err),
        }
    }
}
