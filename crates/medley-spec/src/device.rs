//! Device types: the built-in catalog of datacenter GPUs and user-declared custom devices.
//!
//! Every number is a peak datasheet value (dense, no sparsity). What a device achieves is the cost
//! model's business, through efficiency factors or a calibration profile.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{SpecError, check_name, close_names};
use crate::job::Precision;

/// Which vendor's native collective library a device speaks: its communication domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    Nvidia,
    Amd,
}

impl Vendor {
    /// The vendor's native collective library, used inside its domain.
    pub fn native_library(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nccl",
            Vendor::Amd => "rccl",
        }
    }
}

impl fmt::Display for Vendor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Vendor::Nvidia => "nvidia",
            Vendor::Amd => "amd",
        })
    }
}

/// The kind of link between GPUs inside one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    Nvlink,
    /// AMD Infinity Fabric (xGMI).
    InfinityFabric,
    Pcie,
}

impl LinkKind {
    /// Per-message start-up latency, the α of the α–β model. Order of magnitude of small-message
    /// latencies that nccl-tests and rccl-tests report inside one node; calibrate for precision.
    pub fn latency_us(self) -> f64 {
        match self {
            LinkKind::Nvlink | LinkKind::InfinityFabric => 3.0,
            LinkKind::Pcie => 6.0,
        }
    }
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinkKind::Nvlink => "nvlink",
            LinkKind::InfinityFabric => "infinity-fabric",
            LinkKind::Pcie => "pcie",
        })
    }
}

/// A GPU architecture: where a custom device states one, the cost model takes that generation's
/// default efficiencies. Cluster files name them in lowercase (`turing`, `cdna4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Volta,
    /// T4.
    Turing,
    Ampere,
    Ada,
    Hopper,
    /// B200, GB200.
    Blackwell,
    /// MI100.
    Cdna1,
    Cdna2,
    Cdna3,
    /// MI350X, MI355X.
    Cdna4,
}

/// Achievable fractions of a device's peaks, each in (0, 1], as measured for it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatedEfficiency {
    /// Dense matrix multiplies, of the tensor peak.
    pub matmul: f64,
    /// The fused attention core, of the tensor peak.
    pub attention: f64,
    /// Memory-bound kernels, of HBM bandwidth.
    pub memory: f64,
}

/// The most streaming multiprocessors or compute units a device may state.
const MAX_COMPUTE_UNITS: u32 = 1 << 16;

/// One device type. Invariant: every rate and size is finite and positive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Canonical name, e.g. `H100-SXM`.
    pub name: String,
    pub vendor: Vendor,
    /// Peak dense bf16 tensor rate; `None` where the device has no bf16 (V100).
    #[serde(default)]
    pub bf16_tflops: Option<f64>,
    pub fp16_tflops: f64,
    /// Peak dense TF32 tensor rate; `None` where the device has no TF32 (V100, T4, MI250X).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tf32_tflops: Option<f64>,
    /// Dense fp32 matmul rate with TF32 off: CUDA cores on NVIDIA, matrix cores on AMD's CDNA
    /// (whose fp32 MFMA instructions rocBLAS uses).
    pub fp32_tflops: f64,
    pub hbm_gib: f64,
    pub hbm_tb_s: f64,
    pub intra_link: LinkKind,
    /// Per GPU, per direction.
    pub intra_link_gb_s: f64,
    /// NICs in a typical node of this device; the node's GPUs share them.
    pub nics_per_node: u32,
    pub nic_gbit_s: f64,
    /// A custom device's generation, whose default efficiencies it takes when it states none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<Architecture>,
    /// Streaming multiprocessors (NVIDIA) or compute units (AMD), over which GEMM tiles are
    /// quantised; a custom device without them is priced without tile quantisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_units: Option<u32>,
    /// What this device achieves, when measured; else its architecture's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<StatedEfficiency>,
    /// The package this device is one die of, where software sees each die as a device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<Package>,
}

/// Several dies in one package that the driver, PyTorch and every launcher see as separate
/// devices (an MI250X is two GCDs of 64 GiB), joined by a link of their own. A node's devices
/// fill its packages in order: devices 0 and 1 share the first package, and so on.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Package {
    /// Devices per package.
    pub dies: u32,
    /// Between two dies of one package, per direction.
    pub die_link_gb_s: f64,
}

/// The most dies medley takes in one package.
const MAX_DIES: u32 = 8;

impl DeviceSpec {
    /// The dense matmul rate training in `precision` runs at; `None` where the device lacks the
    /// format (bf16 on a V100, TF32 on an MI250X).
    pub fn tensor_tflops(&self, precision: Precision) -> Option<f64> {
        match precision {
            Precision::Bf16Mixed => self.bf16_tflops,
            Precision::Fp16Mixed => Some(self.fp16_tflops),
            Precision::Tf32 => self.tf32_tflops,
            Precision::Fp32 => Some(self.fp32_tflops),
        }
    }

    /// Checks the invariant for a device declared by a user in `source`.
    pub(crate) fn validated(self, source: &str) -> Result<Self, SpecError> {
        self.check(source)?;
        Ok(self)
    }

    /// Every rate positive and finite, and a name.
    pub(crate) fn check(&self, source: &str) -> Result<(), SpecError> {
        let field = |name: &str| format!("device.{}.{name}", self.name);
        if self.name.trim().is_empty() {
            return Err(SpecError::field(source, "device.name", "must not be empty"));
        }
        check_name(source, "device.name", &self.name)?;
        let rates = [
            ("bf16_tflops", self.bf16_tflops.unwrap_or(1.0)),
            ("fp16_tflops", self.fp16_tflops),
            ("tf32_tflops", self.tf32_tflops.unwrap_or(1.0)),
            ("fp32_tflops", self.fp32_tflops),
            ("hbm_gib", self.hbm_gib),
            ("hbm_tb_s", self.hbm_tb_s),
            ("intra_link_gb_s", self.intra_link_gb_s),
            ("nic_gbit_s", self.nic_gbit_s),
            ("nics_per_node", f64::from(self.nics_per_node)),
        ];
        for (name, value) in rates {
            if !(value.is_finite() && value > 0.0) {
                return Err(SpecError::field(source, field(name), format!("must be a positive number, got {value}")));
            }
        }
        if let Some(units) = self.compute_units
            && !(1..=MAX_COMPUTE_UNITS).contains(&units)
        {
            return Err(SpecError::field(
                source,
                field("compute_units"),
                format!("must be from 1 to {MAX_COMPUTE_UNITS}, got {units}"),
            ));
        }
        if let Some(Package { dies, die_link_gb_s }) = self.package {
            if !(2..=MAX_DIES).contains(&dies) {
                return Err(SpecError::field(
                    source,
                    field("package.dies"),
                    format!("must be from 2 to {MAX_DIES}, got {dies}"),
                ));
            }
            if !(die_link_gb_s.is_finite() && die_link_gb_s > 0.0) {
                return Err(SpecError::field(
                    source,
                    field("package.die_link_gb_s"),
                    format!("must be a positive number, got {die_link_gb_s}"),
                ));
            }
        }
        if let Some(StatedEfficiency { matmul, attention, memory }) = self.efficiency {
            for (name, value) in
                [("efficiency.matmul", matmul), ("efficiency.attention", attention), ("efficiency.memory", memory)]
            {
                if !(value > 0.0 && value <= 1.0) {
                    return Err(SpecError::field(source, field(name), format!("must be in (0, 1], got {value}")));
                }
            }
        }
        Ok(())
    }
}

struct CatalogEntry {
    aliases: &'static [&'static str],
    spec: fn() -> DeviceSpec,
}

#[allow(clippy::too_many_arguments)]
fn device(
    name: &str,
    vendor: Vendor,
    (bf16_tflops, fp16_tflops, tf32_tflops, fp32_tflops): (Option<f64>, f64, Option<f64>, f64),
    hbm_gib: f64,
    hbm_tb_s: f64,
    (intra_link, intra_link_bidir_gb_s): (LinkKind, f64),
    (nics_per_node, nic_gbit_s): (u32, f64),
) -> DeviceSpec {
    DeviceSpec {
        name: name.to_string(),
        vendor,
        bf16_tflops,
        fp16_tflops,
        tf32_tflops,
        fp32_tflops,
        hbm_gib,
        hbm_tb_s,
        intra_link,
        // Datasheets quote link bandwidth summed over both directions.
        intra_link_gb_s: intra_link_bidir_gb_s / 2.0,
        nics_per_node,
        nic_gbit_s,
        architecture: None,
        compute_units: None,
        efficiency: None,
        package: None,
    }
}

use LinkKind::{InfinityFabric, Nvlink, Pcie};
use Vendor::{Amd, Nvidia};

/// The built-in catalog. The first alias is the canonical lowercase name; the first entry that
/// claims a short alias (`a100`, `h100`) is the most common training part of that family.
const CATALOG: &[CatalogEntry] = &[
    CatalogEntry {
        aliases: &["v100-32gb", "v100", "v100-sxm2-32gb"],
        // NVIDIA V100 datasheet: 125 TFLOP/s fp16 tensor, 15.7 fp32, 32 GB HBM2 at 900 GB/s,
        // NVLink2 300 GB/s; no bf16, no TF32 (both came with Ampere). DGX-1 nodes: 4x 100 Gb/s InfiniBand EDR.
        spec: || device("V100-32GB", Nvidia, (None, 125.0, None, 15.7), 32.0, 0.9, (Nvlink, 300.0), (4, 100.0)),
    },
    CatalogEntry {
        aliases: &["a100-40gb", "a100-sxm4-40gb"],
        // NVIDIA A100 datasheet: 312 bf16/fp16, 156 TF32 (312 with sparsity), 19.5 fp32, 40 GB HBM2 at 1,555 GB/s, NVLink3
        // 600 GB/s. DGX A100: 8x 200 Gb/s HDR InfiniBand.
        spec: || {
            device(
                "A100-40GB",
                Nvidia,
                (Some(312.0), 312.0, Some(156.0), 19.5),
                40.0,
                1.555,
                (Nvlink, 600.0),
                (8, 200.0),
            )
        },
    },
    CatalogEntry {
        aliases: &["a100-80gb", "a100", "a100-sxm4-80gb"],
        // NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s, otherwise as the 40 GB part.
        spec: || {
            device(
                "A100-80GB",
                Nvidia,
                (Some(312.0), 312.0, Some(156.0), 19.5),
                80.0,
                2.039,
                (Nvlink, 600.0),
                (8, 200.0),
            )
        },
    },
    CatalogEntry {
        aliases: &["h100-sxm", "h100", "h100-sxm5", "h100-sxm5-80gb"],
        // NVIDIA H100 datasheet (SXM5): 989.4 dense bf16, 494.7 dense TF32, 67 fp32, 80 GB HBM3 at 3.35 TB/s, NVLink4
        // 900 GB/s. Llama 3 paper (Dubey et al. 2024): 400 Gb/s per GPU, 8 NICs per node.
        spec: || {
            device("H100-SXM", Nvidia, (Some(989.4), 989.4, Some(494.7), 67.0), 80.0, 3.35, (Nvlink, 900.0), (8, 400.0))
        },
    },
    CatalogEntry {
        aliases: &["h100-pcie", "h100-pcie-80gb"],
        // NVIDIA H100 PCIe datasheet: 756 dense bf16, 378 dense TF32, 51 fp32, 80 GB at 2.0 TB/s, PCIe Gen5 128 GB/s.
        // PCIe servers commonly carry one 400 Gb/s NIC per two GPUs.
        spec: || {
            device("H100-PCIe", Nvidia, (Some(756.0), 756.0, Some(378.0), 51.0), 80.0, 2.0, (Pcie, 128.0), (4, 400.0))
        },
    },
    CatalogEntry {
        aliases: &["h200", "h200-sxm", "h200-sxm-141gb"],
        // NVIDIA H200 datasheet: H100's compute (TF32 989 with sparsity, 494.7 dense) with 141 GB HBM3e at 4.8 TB/s, NVLink4 900 GB/s.
        spec: || {
            device("H200", Nvidia, (Some(989.4), 989.4, Some(494.7), 67.0), 141.0, 4.8, (Nvlink, 900.0), (8, 400.0))
        },
    },
    CatalogEntry {
        aliases: &["h800", "h800-sxm", "h800-sxm5"],
        // H100 SXM5 silicon with NVLink cut for export (secondary: third-party comparisons of the
        // NVIDIA H800 datasheet): 989.4 dense bf16 (1,979 sparse), 494.7 dense TF32, 67 fp32, 80 GB HBM3 at
        // 3.35 TB/s, NVLink 400 GB/s. DeepSeek-V3 report (arXiv 2412.19437, §3.2.2): 8-GPU
        // nodes, each GPU on its own InfiniBand rail at 50 GB/s (400 Gb/s).
        spec: || {
            device("H800", Nvidia, (Some(989.4), 989.4, Some(494.7), 67.0), 80.0, 3.35, (Nvlink, 400.0), (8, 400.0))
        },
    },
    CatalogEntry {
        aliases: &["h20"],
        // Secondary (third-party reproductions of NVIDIA's H20 sheet): 148 dense fp16/bf16, 74
        // TF32, 44 fp32, 96 GB HBM3 at 4.0 TB/s, NVLink4 900 GB/s. NICs are an assumption: HGX H100's
        // 8x 400 Gb/s.
        spec: || device("H20", Nvidia, (Some(148.0), 148.0, Some(74.0), 44.0), 96.0, 4.0, (Nvlink, 900.0), (8, 400.0)),
    },
    CatalogEntry {
        aliases: &["b200", "b200-sxm", "hgx-b200"],
        // NVIDIA HGX B200 spec table (per GPU): 4.5 PFLOP/s fp16/bf16 with sparsity, so 2,250
        // dense; TF32 2.25 PFLOP/s with sparsity, so 1,125 dense; 75 fp32; 180 GB HBM3e at 7.7 TB/s; NVLink5 1.8 TB/s. DGX B200 user guide: 8x
        // ConnectX-7 at 400 Gb/s for the compute fabric.
        spec: || {
            device("B200", Nvidia, (Some(2250.0), 2250.0, Some(1125.0), 75.0), 180.0, 7.7, (Nvlink, 1800.0), (8, 400.0))
        },
    },
    CatalogEntry {
        aliases: &["gb200", "gb200-nvl72"],
        // The B200-class GPU of a GB200 NVL72 rack. NVIDIA GB200 NVL72 spec table (per GPU): 5
        // PFLOP/s fp16/bf16 with sparsity, so 2,500 dense; TF32 2.5 with sparsity, so 1,250 dense; 80 fp32; 186 GB HBM3e at 8 TB/s;
        // NVLink5 1.8 TB/s reaching all 72 GPUs of the rack. DGX GB200 user guide: 4x
        // ConnectX-7 at 400 Gb/s per 4-GPU compute tray, one per GPU. The NVLink domain is the
        // node: inline fleets (`72xgb200`) build 8-GPU nodes, so a `--cluster` file should set
        // `gpus_per_node = 72` and, keeping one NIC per GPU, `nics_per_node = 72`.
        spec: || {
            device(
                "GB200",
                Nvidia,
                (Some(2500.0), 2500.0, Some(1250.0), 80.0),
                186.0,
                8.0,
                (Nvlink, 1800.0),
                (8, 400.0),
            )
        },
    },
    CatalogEntry {
        aliases: &["l40s"],
        // NVIDIA L40S datasheet: 362.05 dense bf16, 183 dense TF32 (366 sparse), 91.6 fp32, 48 GB GDDR6 at 864 GB/s, PCIe Gen4
        // x16 64 GB/s, no NVLink. Typical servers: 2x 200 Gb/s NICs.
        spec: || {
            device("L40S", Nvidia, (Some(362.05), 362.05, Some(183.0), 91.6), 48.0, 0.864, (Pcie, 64.0), (2, 200.0))
        },
    },
    CatalogEntry {
        aliases: &["rtx-4090", "4090", "rtx4090"],
        // Third-party spec tables (fp32-accumulate tensor rate 165.15, TF32 82.6 dense), 82.6 fp32, 24 GB GDDR6X at
        // 1,008 GB/s, PCIe Gen4 x16, no NVLink. Workstations: one 100 Gb/s NIC.
        spec: || {
            device("RTX-4090", Nvidia, (Some(165.15), 165.15, Some(82.6), 82.6), 24.0, 1.008, (Pcie, 64.0), (1, 100.0))
        },
    },
    CatalogEntry {
        aliases: &["l4"],
        // NVIDIA L4 datasheet (third-party reproduction): 242 fp16/bf16 with sparsity, so 121
        // dense; TF32 120 with sparsity, so 60 dense; 30.3 fp32; 24 GB GDDR6 at 300 GB/s; PCIe Gen4 x16, no NVLink. Google Cloud G2
        // machines (8x L4): up to 100 Gb/s.
        spec: || device("L4", Nvidia, (Some(121.0), 121.0, Some(60.0), 30.3), 24.0, 0.3, (Pcie, 64.0), (1, 100.0)),
    },
    CatalogEntry {
        aliases: &["a10", "a10-pcie"],
        // Secondary: 125 dense bf16/fp16 (NVIDIA A10 datasheet, 250 with sparsity; not retrieved,
        // but 72 SMs x 4 tensor cores x 256 FLOP at 1,695 MHz give 125), TF32 at half that (62.5)
        // as on every Ampere part, 31.2 fp32, 24 GB
        // GDDR6 at 600 GB/s (third-party spec tables), PCIe Gen4 x16, no NVLink. One 100 Gb/s
        // NIC per server is an assumption (cloud A10/A10G servers reach 100 Gb/s).
        spec: || device("A10", Nvidia, (Some(125.0), 125.0, Some(62.5), 31.2), 24.0, 0.6, (Pcie, 64.0), (1, 100.0)),
    },
    CatalogEntry {
        aliases: &["a40"],
        // NVIDIA A40 datasheet (third-party reproduction): 149.7 dense bf16/fp16 (299.4 sparse),
        // 74.8 dense TF32 (149.6 sparse), 37.4 fp32, 48 GB GDDR6 at 696 GB/s, PCIe Gen4 64 GB/s; its NVLink bridge (112.5 GB/s)
        // joins pairs only, so a node's collectives cross PCIe. NICs as the L40S's (assumption).
        spec: || device("A40", Nvidia, (Some(149.7), 149.7, Some(74.8), 37.4), 48.0, 0.696, (Pcie, 64.0), (2, 200.0)),
    },
    CatalogEntry {
        aliases: &["rtx-a6000", "a6000", "rtxa6000"],
        // Secondary (Microway, via third-party tables): 154.8 dense fp16/bf16 (309.7 sparse), TF32
        // 154.8 sparse so 77.4 dense;
        // NVIDIA RTX A6000 spec sheet (ServeTheHome): 48 GB GDDR6 at 768 GB/s, PCIe Gen4 x16,
        // NVLink bridge of 112.5 GB/s joining pairs only; 38.7 fp32 (third-party tables).
        // Workstations: one 100 Gb/s NIC (assumption, as the RTX-4090's).
        spec: || {
            device("RTX-A6000", Nvidia, (Some(154.8), 154.8, Some(77.4), 38.7), 48.0, 0.768, (Pcie, 64.0), (1, 100.0))
        },
    },
    CatalogEntry {
        aliases: &["t4", "tesla-t4"],
        // NVIDIA T4 launch specs (third-party reproductions): 65 fp16 tensor (mixed precision),
        // 8.1 fp32, 16 GB GDDR6 at 320 GB/s, PCIe Gen3 x16 (32 GB/s both ways); Turing has no
        // bf16 and no TF32. Google Cloud N1 machines with T4s: up to 100 Gb/s.
        spec: || device("T4", Nvidia, (None, 65.0, None, 8.1), 16.0, 0.32, (Pcie, 32.0), (1, 100.0)),
    },
    CatalogEntry {
        aliases: &["mi250x-gcd"],
        // AMD Instinct MI250X datasheet: one package of two GCDs with 383 bf16/fp16, 95.7 fp32
        // matrix (47.9 vector; CDNA 2 has no TF32) and 128 GB HBM2e at 3.2 TB/s in all, 220 CUs; ROCm and PyTorch see each GCD as a
        // device with half of each. Its 8 Infinity Fabric links of 50 GB/s each way (ROCm docs):
        // 4 join the two GCDs, 2 per GCD reach other packages. Frontier nodes: 4 packages, 8 GCDs,
        // 4x 200 Gb/s Slingshot NICs.
        spec: || DeviceSpec {
            compute_units: Some(110),
            package: Some(Package { dies: 2, die_link_gb_s: 200.0 }),
            ..device(
                "MI250X-GCD",
                Amd,
                (Some(191.5), 191.5, None, 47.85),
                64.0,
                1.6,
                (InfinityFabric, 200.0),
                (4, 200.0),
            )
        },
    },
    CatalogEntry {
        aliases: &["mi210"],
        // AMD Instinct MI210 (AnandTech's reproduction of AMD's table): one CDNA 2 GCD on a PCIe
        // card, not a package; 181 fp16 matrix (bf16 at the same rate, as on the MI250X), 45.3
        // fp32 matrix (22.6 vector), no TF32, 64 GB HBM2e at 1.6 TB/s, 104 CUs, 3 Infinity Fabric links of 50 GB/s each
        // way (ROCm docs' MI200 link rate). The bridge joins a hive of 4 cards, so an 8-GPU
        // node's collectives cross PCIe Gen4; a `--cluster` file may state 4-GPU nodes at
        // `intra_link = "infinity-fabric"`, `intra_link_gb_s = 150`. NICs: assumption.
        spec: || device("MI210", Amd, (Some(181.0), 181.0, None, 45.3), 64.0, 1.6, (Pcie, 64.0), (2, 200.0)),
    },
    CatalogEntry {
        aliases: &["mi100"],
        // AMD Instinct MI100 spec table (Notebookcheck's reproduction): 184.6 fp16 matrix but
        // bf16 at half that, 92.3; 46.1 fp32 matrix (23.1 vector), no TF32; 32 GB HBM2 at 1.23 TB/s; 120 CUs; 3 Infinity
        // Fabric links, 276 GB/s in all, joining a hive of 4 cards (ROCm docs), so 8-GPU nodes
        // cross PCIe Gen4 as the MI210's. NICs: assumption.
        spec: || device("MI100", Amd, (Some(92.3), 184.6, None, 46.1), 32.0, 1.23, (Pcie, 64.0), (2, 200.0)),
    },
    CatalogEntry {
        aliases: &["mi300x"],
        // AMD Instinct MI300X datasheet: 1,307.4 dense bf16, 653.7 dense TF32, 163.4 fp32 matrix, 192 GB HBM3 at 5.3 TB/s,
        // 7 Infinity Fabric links per GPU in an 8-GPU mesh (896 GB/s); 8x 400 Gb/s NICs per node.
        spec: || {
            device(
                "MI300X",
                Amd,
                (Some(1307.4), 1307.4, Some(653.7), 163.4),
                192.0,
                5.3,
                (InfinityFabric, 896.0),
                (8, 400.0),
            )
        },
    },
    CatalogEntry {
        aliases: &["mi325x"],
        // AMD Instinct MI325X datasheet: MI300X compute with 256 GB HBM3E at 6.0 TB/s.
        spec: || {
            device(
                "MI325X",
                Amd,
                (Some(1307.4), 1307.4, Some(653.7), 163.4),
                256.0,
                6.0,
                (InfinityFabric, 896.0),
                (8, 400.0),
            )
        },
    },
    CatalogEntry {
        aliases: &["mi355x"],
        // Secondary (third-party reproductions of AMD's MI355X table): 2,516.6 dense fp16/bf16
        // (2.5 PFLOP/s; 256 CUs x 4,096 FLOP per clock at 2.4 GHz), 157.3 fp32 matrix, no TF32
        // rate (those tables list none; CDNA 4 dropped CDNA 3's XF32 matrix instructions), 288 GB HBM3E
        // at 8 TB/s; 7 Infinity Fabric links of 153.6 GB/s (1,075 GB/s) in an 8-GPU mesh. NICs
        // assumed as the MI300X's.
        spec: || {
            device("MI355X", Amd, (Some(2516.6), 2516.6, None, 157.3), 288.0, 8.0, (InfinityFabric, 1075.2), (8, 400.0))
        },
    },
];

/// Names that count packages of several devices, and the alias of one of their devices.
const PACKAGE_ALIASES: &[(&str, &str)] = &[("mi250x", "mi250x-gcd")];

/// How many devices one counted `name` is: a package's dies where `name` names the package
/// (`mi250x`), else 1 (`mi250x-gcd`, `h100`).
pub fn devices_per_counted(name: &str) -> u32 {
    let wanted = normalize(name);
    match PACKAGE_ALIASES.iter().find(|(package, _)| *package == wanted) {
        Some(_) => catalog_device(name).ok().and_then(|device| device.package).map_or(1, |package| package.dies),
        None => 1,
    }
}

fn normalize(name: &str) -> String {
    name.trim().to_ascii_lowercase().replace(['_', ' '], "-")
}

/// Looks a device up by any alias, case-insensitively; an unknown name lists the close ones.
pub fn catalog_device(name: &str) -> Result<DeviceSpec, SpecError> {
    let wanted = normalize(name);
    let wanted =
        PACKAGE_ALIASES.iter().find(|(package, _)| *package == wanted).map_or(wanted, |(_, die)| die.to_string());
    CATALOG.iter().find(|entry| entry.aliases.contains(&wanted.as_str())).map(|entry| (entry.spec)()).ok_or_else(|| {
        SpecError::Unknown {
            kind: "device",
            name: name.to_string(),
            close: close_names(&wanted, CATALOG.iter().flat_map(|entry| entry.aliases.iter().copied())),
        }
    })
}

/// Every catalog device, in catalog order.
pub fn catalog_devices() -> Vec<DeviceSpec> {
    CATALOG.iter().map(|entry| (entry.spec)()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_are_case_insensitive() {
        assert_eq!(catalog_device("H100").unwrap().name, "H100-SXM");
        assert_eq!(catalog_device("mi300X").unwrap().vendor, Vendor::Amd);
        assert_eq!(catalog_device("a100").unwrap().hbm_gib, 80.0);
        assert_eq!(catalog_device("A100_40GB").unwrap().hbm_gib, 40.0);
    }

    /// Issue 33: devices labs and clouds run were missing from the catalog.
    #[test]
    fn issue_33_devices_resolve_by_every_alias() {
        let check = |aliases: &[&str], name: &str| {
            for alias in aliases {
                assert_eq!(catalog_device(alias).unwrap().name, name, "{alias}");
            }
        };
        check(&["b200", "B200-SXM", "hgx-b200"], "B200");
        check(&["gb200", "GB200-NVL72"], "GB200");
        check(&["h800", "h800-sxm", "H800_SXM5"], "H800");
        check(&["h20", "H20"], "H20");
        check(&["a10", "a10-pcie"], "A10");
        check(&["a40"], "A40");
        check(&["l4"], "L4");
        check(&["rtx-a6000", "a6000", "RTX A6000", "rtxa6000"], "RTX-A6000");
        check(&["t4", "Tesla-T4"], "T4");
        check(&["mi210"], "MI210");
        check(&["mi100"], "MI100");
        check(&["mi355x", "MI355X"], "MI355X");
        // Short aliases that prefix longer ones still name their own device.
        assert_eq!(catalog_device("h200").unwrap().name, "H200");
        assert_eq!(catalog_device("a100").unwrap().name, "A100-80GB");
        assert_eq!(catalog_device("l40s").unwrap().name, "L40S");
        // Turing has no bf16; the MI100 runs bf16 at half its fp16 rate; the MI210 is one die.
        let t4 = catalog_device("t4").unwrap();
        assert_eq!(
            (t4.tensor_tflops(Precision::Bf16Mixed), t4.tensor_tflops(Precision::Fp16Mixed)),
            (None, Some(65.0))
        );
        let mi100 = catalog_device("mi100").unwrap();
        assert_eq!((mi100.bf16_tflops, mi100.fp16_tflops), (Some(92.3), 184.6));
        assert_eq!((catalog_device("mi210").unwrap().package, devices_per_counted("mi210")), (None, 1));
        // Datasheets quote links both ways summed; the catalog keeps one direction.
        assert_eq!(catalog_device("gb200").unwrap().intra_link_gb_s, 900.0);
        assert_eq!(catalog_device("h800").unwrap().intra_link_gb_s, 200.0);
    }

    /// TF32 came with Ampere (NVIDIA) and CDNA 3 (AMD), at half the 16-bit rate; fp32 matmuls
    /// run on CDNA's matrix cores, at twice its vector rate.
    #[test]
    fn tf32_and_fp32_rates_follow_the_datasheets() {
        let rate = |name: &str, precision| catalog_device(name).unwrap().tensor_tflops(precision);
        for (name, tf32) in [("a100", Some(156.0)), ("h100", Some(494.7)), ("mi300x", Some(653.7))] {
            assert_eq!(rate(name, Precision::Tf32), tf32, "{name}");
        }
        for name in ["v100", "t4", "mi250x", "mi210", "mi100"] {
            assert_eq!(rate(name, Precision::Tf32), None, "{name}");
        }
        for device in catalog_devices().into_iter().filter(|device| device.tf32_tflops.is_some()) {
            let ratio = device.tf32_tflops.unwrap() / device.fp16_tflops;
            // The RTX 4090's fp16 rate is its fp32-accumulate one, which GeForce halves too.
            assert!((0.49..=0.51).contains(&ratio) || device.name == "RTX-4090", "{}: {ratio}", device.name);
        }
        assert_eq!(rate("mi250x", Precision::Fp32), Some(95.7 / 2.0));
        assert_eq!(rate("h100", Precision::Fp32), Some(67.0));
    }

    #[test]
    fn unknown_device_lists_close_names() {
        let err = catalog_device("h1000").unwrap_err();
        let SpecError::Unknown { close, .. } = &err else { panic!("{err}") };
        assert!(close.iter().any(|name| name.starts_with("h100")), "{close:?}");
    }

    #[test]
    fn catalog_entries_are_valid_and_uniquely_named() {
        let devices = catalog_devices();
        assert!(devices.len() >= 22);
        for (entry, device) in CATALOG.iter().zip(&devices) {
            device.clone().validated("catalog").unwrap();
            assert_eq!(entry.aliases[0], normalize(&device.name), "the first alias is the canonical name");
        }
        let mut aliases: Vec<_> = CATALOG.iter().flat_map(|entry| entry.aliases.iter()).collect();
        let total = aliases.len();
        aliases.sort();
        aliases.dedup();
        assert_eq!(aliases.len(), total, "an alias names two devices");
    }
}
