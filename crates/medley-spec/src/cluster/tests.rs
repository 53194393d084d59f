//! Tests of [`super`].

use super::*;

#[test]
fn inline_form_fills_nodes_of_eight() {
    let cluster = Cluster::from_inline("64xh100, 4xmi300x", Fabric::default(), Bridge::default()).unwrap();
    let shapes: Vec<_> =
        cluster.groups().iter().map(|g| (g.device.name.as_str(), g.n_nodes, g.gpus_per_node)).collect();
    assert_eq!(shapes, [("H100-SXM", 8, 8), ("MI300X", 1, 4)]);
    assert_eq!(cluster.n_gpus(), 68);
    assert_eq!(cluster.vendors(), [Vendor::Nvidia, Vendor::Amd]);
    let devices = cluster.devices();
    assert_eq!(devices[64].node_idx, 8);
    assert_eq!(devices[64].group_idx, 1);
    assert_eq!(cluster.group_first_ids(), [0, 64]);
}

#[test]
fn fleet_form_has_one_gpu_per_node() {
    let cluster = Cluster::from_fleet("2xh100, 3xmi300x").unwrap();
    let shapes: Vec<_> = cluster.groups().iter().map(|g| (g.n_nodes, g.gpus_per_node)).collect();
    assert_eq!(shapes, [(2, 1), (3, 1)]);
    let err = Cluster::from_fleet("2xh1000").unwrap_err();
    assert!(err.to_string().contains("did you mean"), "{err}");
}

#[test]
fn inline_form_rejects_bad_entries() {
    for (text, wanted) in [
        ("12xh100", "multiple of 8"),
        ("h100", "COUNTxDEVICE"),
        ("0xh100", "at least 1"),
        ("8xh1000", "did you mean"),
        ("", "at least one node group"),
    ] {
        let err = Cluster::from_inline(text, Fabric::default(), Bridge::default()).unwrap_err();
        assert!(err.to_string().contains(wanted), "{text}: {err}");
    }
}

#[test]
fn clusters_beyond_what_the_planner_searches_in_seconds_are_refused() {
    // Issue 31: 1,048,576 GPUs were accepted and planned for minutes and 16.8 GB.
    assert!(Cluster::from_inline("32768xh100", Fabric::default(), Bridge::default()).is_ok());
    for text in ["32776xh100", "16384xh100,16392xmi300x", "1048576xh100"] {
        let err = Cluster::from_inline(text, Fabric::default(), Bridge::default()).unwrap_err().to_string();
        assert!(err.contains("medley plans at most 32768"), "{text}: {err}");
    }
}

/// Issue 31: escapes in inline clusters and cluster files reached the terminal raw, and
/// 100 KB names were echoed whole.
#[test]
fn errors_echo_names_escaped_and_cut() {
    let long = "a".repeat(100_000);
    let group = |device: &str| format!("[[group]]\ndevice = \"{device}\"\nnodes = 1\n");
    let errors = [
        Cluster::from_inline("2x\u{1b}[31mh100", Fabric::default(), Bridge::default()).unwrap_err(),
        Cluster::from_inline("\u{1b}[31mx8xh100", Fabric::default(), Bridge::default()).unwrap_err(),
        Cluster::from_inline(&format!("8x{long}"), Fabric::default(), Bridge::default()).unwrap_err(),
        Cluster::from_toml(&group("\\u001b[31mh100"), "c.toml").unwrap_err(),
        Cluster::from_toml(&group(&long), "c.toml").unwrap_err(),
        Cluster::from_toml(&group("h100").replace("nodes", "\"\\u001b[2J\""), "c.toml").unwrap_err(),
    ];
    for err in errors {
        let message = err.to_string();
        assert!(!message.chars().any(char::is_control), "{message:?}");
        assert!(message.len() < 1000, "{} bytes", message.len());
        assert!(message.contains("\\u{1b}") || message.contains("100000 characters"), "{message}");
    }
}

#[test]
fn toml_form_with_custom_device_and_overrides() {
    let text = r#"
[[device]]
name = "my-gpu"
vendor = "amd"
bf16_tflops = 500
fp16_tflops = 500
fp32_tflops = 60
hbm_gib = 96
hbm_tb_s = 4
intra_link = "pcie"
intra_link_gb_s = 32
nics_per_node = 2
nic_gbit_s = 200

[[group]]
device = "H100"
nodes = 2

[[group]]
device = "my-gpu"
nodes = 1
gpus_per_node = 4
nic_gbit_s = 100

[fabric]
latency_us = 8

[bridge]
device_direct = false
cpu_forward_gb_s = 6
"#;
    let cluster = Cluster::from_toml(text, "c.toml").unwrap();
    assert_eq!(cluster.n_gpus(), 20);
    assert_eq!(cluster.groups()[1].nic_gbit_s, 100.0);
    assert_eq!(cluster.groups()[1].device.vendor, Vendor::Amd);
    assert_eq!(cluster.fabric().latency_us, 8.0);
    assert_eq!(cluster.bridge().modes(), [BridgeMode::CpuForward]);
}

#[test]
fn toml_errors_name_file_line_and_field() {
    let err = Cluster::from_toml("[[group]]\ndevice = \"h100\"\nnodes = 1\ncolour = 3\n", "c.toml").unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("c.toml:4:"), "{text}");
    assert!(text.contains("colour"), "{text}");
    let err = Cluster::from_toml("[[group]]\ndevice = \"h1000\"\nnodes = 1\n", "c.toml").unwrap_err();
    assert!(err.to_string().contains("group[0].device"), "{err}");
    let err = Cluster::from_toml("[[group]]\ndevice = \"h100\"\nnodes = 0\n", "c.toml").unwrap_err();
    assert!(err.to_string().contains("group[0].n_nodes"), "{err}");
    for (text, wanted) in [
        ("[[group]]\ndevice = \"h100\"\nnodes = 1\n[fabric]\nlatency_us = -0.5\n", "fabric.latency_us"),
        ("[[group]]\ndevice = \"h100\"\nnodes = 4000000000\n", "at most"),
        (
            "[[device]]\nname = \"H100\"\nvendor = \"amd\"\nfp16_tflops = 1\nfp32_tflops = 1\nhbm_gib = 1\nhbm_tb_s = 1\nintra_link = \"pcie\"\nintra_link_gb_s = 1\nnics_per_node = 1\nnic_gbit_s = 1\n[[group]]\ndevice = \"h100\"\nnodes = 1\n",
            "catalog device",
        ),
    ] {
        let err = Cluster::from_toml(text, "c.toml").unwrap_err().to_string();
        assert!(err.contains(wanted), "{wanted}: {err}");
    }
}

mod json_round_trip {
    use super::*;

    #[test]
    fn cluster_round_trips_through_json_and_revalidates() {
        let cluster = Cluster::from_inline("16xh100,8xmi300x", Fabric::default(), Bridge::default()).unwrap();
        let json = serde_json::to_string(&cluster).unwrap();
        assert_eq!(serde_json::from_str::<Cluster>(&json).unwrap(), cluster);
        let broken = json.replace("\"n_nodes\":2", "\"n_nodes\":0");
        let err = serde_json::from_str::<Cluster>(&broken).unwrap_err().to_string();
        assert!(err.contains("n_nodes"), "{err}");
        let no_memory = json.replacen("\"hbm_tb_s\":3.35", "\"hbm_tb_s\":0.0", 1);
        assert_ne!(no_memory, json, "the H100's bandwidth is in the file");
        let err = serde_json::from_str::<Cluster>(&no_memory).unwrap_err().to_string();
        assert!(err.contains("device.H100-SXM.hbm_tb_s") && err.contains("positive"), "{err}");
    }
}

/// Issue 33: a device without bf16 was priced at its fp16 rate inside a bf16 job.
#[test]
fn a_custom_device_without_bf16_is_refused_in_a_bf16_job_and_taken_in_fp16() {
    let text = r#"
[[device]]
name = "old-gpu"
vendor = "nvidia"
fp16_tflops = 100
fp32_tflops = 14
hbm_gib = 32
hbm_tb_s = 0.9
intra_link = "nvlink"
intra_link_gb_s = 150
nics_per_node = 4
nic_gbit_s = 100

[[group]]
device = "old-gpu"
nodes = 2

[[group]]
device = "h100"
nodes = 1
"#;
    let cluster = Cluster::from_toml(text, "c.toml").unwrap();
    let err = cluster.check_precision(Precision::Bf16Mixed).unwrap_err().to_string();
    assert!(err.contains("old-gpu has none") && err.contains("train in fp16-mixed or fp32 (--precision)"), "{err}");
    cluster.check_precision(Precision::Fp16Mixed).unwrap();
    cluster.check_precision(Precision::Fp32).unwrap();
    // A custom device without a stated TF32 rate has none: refused, saying how to state it.
    let err = cluster.check_precision(Precision::Tf32).unwrap_err().to_string();
    assert!(
        err.contains("tf32 needs tf32") && err.contains("old-gpu has none") && err.contains("tf32_tflops"),
        "{err}"
    );
    let old = &cluster.groups()[0].device;
    assert_eq!((old.tensor_tflops(Precision::Bf16Mixed), old.tensor_tflops(Precision::Fp16Mixed)), (None, Some(100.0)));
    assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::Fp16Mixed);
    assert_eq!("BF16-mixed".parse::<Precision>().unwrap(), Precision::Bf16Mixed);
    assert_eq!(["tf32", " FP32 "].map(|name| name.parse::<Precision>().unwrap()), [Precision::Tf32, Precision::Fp32]);
    assert!("fp8".parse::<Precision>().unwrap_err().contains("bf16-mixed, fp16-mixed, tf32 or fp32"));
    assert!("tf32-mixed".parse::<Precision>().is_err());
}

#[test]
fn a_custom_devices_compute_units_and_efficiency_are_checked() {
    let device = |extra: &str| {
        let text = format!(
            "[[device]]\nname = \"x\"\nvendor = \"nvidia\"\nbf16_tflops = 100\nfp16_tflops = 100\nfp32_tflops = 10\n\
             hbm_gib = 24\nhbm_tb_s = 1\nintra_link = \"pcie\"\nintra_link_gb_s = 32\nnics_per_node = 1\n\
             nic_gbit_s = 100\n{extra}\n[[group]]\ndevice = \"x\"\nnodes = 1\n"
        );
        Cluster::from_toml(&text, "c.toml")
    };
    let cluster = device(
        "architecture = \"ada\"\ncompute_units = 58\nefficiency = { matmul = 0.6, attention = 0.4, memory = 0.8 }",
    )
    .unwrap();
    assert_eq!(cluster.groups()[0].device.compute_units, Some(58));
    let err = device("compute_units = 0").unwrap_err().to_string();
    assert!(err.contains("compute_units"), "{err}");
    let err = device("efficiency = { matmul = 1.5, attention = 0.4, memory = 0.8 }").unwrap_err().to_string();
    assert!(err.contains("efficiency.matmul") && err.contains("(0, 1]"), "{err}");
}

/// Issue 33: a cluster file could not say that one group reaches another over a slower link.
#[test]
fn links_between_groups_are_read_checked_and_kept_in_plans() {
    let groups = "[[group]]\ndevice = \"a100\"\nnodes = 2\n[[group]]\ndevice = \"v100\"\nnodes = 1\n[[group]]\ndevice = \"h100\"\nnodes = 1\n";
    let text = format!(
        "{groups}[[link]]\ngroups = [0, 1]\ngbit_s = 10\n[[link]]\ngroups = [2, 0]\ngbit_s = 1\nlatency_us = 40\n"
    );
    let cluster = Cluster::from_toml(&text, "c.toml").unwrap();
    assert_eq!(cluster.link_between_groups(1, 0).map(GroupLink::gb_s), Some(1.25));
    assert_eq!(cluster.link_between_groups(0, 2).and_then(|link| link.latency_us), Some(40.0));
    assert!(cluster.link_between_groups(1, 2).is_none(), "groups without a link meet over the fabric");
    let json = serde_json::to_string(&cluster).unwrap();
    assert_eq!(serde_json::from_str::<Cluster>(&json).unwrap(), cluster);
    for (link, wanted) in [
        ("groups = [0, 3]\ngbit_s = 10", "field `link[0].groups`: there is no group 3"),
        ("groups = [1, 1]\ngbit_s = 10", "two different groups"),
        ("groups = [0, 1]\ngbit_s = 0", "`link[0].gbit_s`: must be a positive number"),
        ("groups = [0, 1]\ngbit_s = 10\n[[link]]\ngroups = [1, 0]\ngbit_s = 5", "groups 1 and 0 are linked twice"),
        ("groups = [0, 1]\ngbit_s = 10\nlatency_us = -1", "link[0].latency_us"),
    ] {
        let err = Cluster::from_toml(&format!("{groups}[[link]]\n{link}\n"), "c.toml").unwrap_err().to_string();
        assert!(err.contains("c.toml") && err.contains(wanted), "{wanted}: {err}");
    }
}

#[test]
fn nic_ports_are_shared_where_a_node_has_fewer_nics_than_gpus() {
    let mut group = NodeGroup::with_defaults(catalog_device("a100").unwrap(), 1, 8);
    (group.nics_per_node, group.nic_gbit_s) = (2, 100.0);
    assert_eq!((group.nic_ports(), group.nic_port_gb_s()), (2, 12.5));
    assert_eq!((0..8).map(|gpu| group.nic_port_of(gpu)).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 1, 1, 1]);
    // More NICs than GPUs: each GPU's port is all of its NICs.
    (group.gpus_per_node, group.nics_per_node) = (1, 4);
    assert_eq!((group.nic_ports(), group.nic_port_gb_s(), group.nic_port_of(0)), (1, 50.0, 0));
}

#[test]
fn packages_count_as_their_dies_and_fill_whole_nodes() {
    let inline = Cluster::from_inline("2xmi250x,2xmi250x-gcd", Fabric::default(), Bridge::default()).unwrap();
    let shapes: Vec<_> = inline.groups().iter().map(|group| (group.n_nodes, group.gpus_per_node)).collect();
    assert_eq!(shapes, [(1, 4), (1, 2)]);
    // A fleet puts each package in a node of its own, its GCDs side by side.
    let fleet = Cluster::from_fleet("2xh100,1xmi250x").unwrap();
    let shapes: Vec<_> = fleet.groups().iter().map(|group| (group.n_nodes, group.gpus_per_node)).collect();
    assert_eq!(shapes, [(2, 1), (1, 2)]);
    let gcds = &fleet.groups()[1];
    assert!(gcds.same_package(0, 1) && !NodeGroup { gpus_per_node: 4, ..gcds.clone() }.same_package(1, 2));
    let err = Cluster::from_fleet("3xmi250x-gcd").unwrap_err().to_string();
    assert!(err.contains("come 2 to a package"), "{err}");
    let err = Cluster::from_toml("[[group]]\ndevice = \"mi250x\"\nnodes = 1\ngpus_per_node = 3\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("group[0].gpus_per_node") && err.contains("multiple of 2"), "{err}");
}
