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
/// default efficiencies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    Volta,
    Ampere,
    Ada,
    Hopper,
    Cdna2,
    Cdna3,
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
    /// The dense tensor rate training in `precision` runs at; `None` where the device lacks the
    /// format (bf16 on a V100).
    pub fn tensor_tflops(&self, precision: Precision) -> Option<f64> {
        match precision {
            Precision::Bf16Mixed => self.bf16_tflops,
            Precision::Fp16Mixed => Some(self.fp16_tflops),
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
    bf16_tflops: Option<f64>,
    fp16_tflops: f64,
    fp32_tflops: f64,
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
        // NVLink2 300 GB/s; no bf16. DGX-1 nodes: 4x 100 Gb/s InfiniBand EDR.
        spec: || device("V100-32GB", Nvidia, None, 125.0, 15.7, 32.0, 0.9, (Nvlink, 300.0), (4, 100.0)),
    },
    CatalogEntry {
        aliases: &["a100-40gb", "a100-sxm4-40gb"],
        // NVIDIA A100 datasheet: 312 bf16/fp16, 19.5 fp32, 40 GB HBM2 at 1,555 GB/s, NVLink3
        // 600 GB/s. DGX A100: 8x 200 Gb/s HDR InfiniBand.
        spec: || device("A100-40GB", Nvidia, Some(312.0), 312.0, 19.5, 40.0, 1.555, (Nvlink, 600.0), (8, 200.0)),
    },
    CatalogEntry {
        aliases: &["a100-80gb", "a100", "a100-sxm4-80gb"],
        // NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s, otherwise as the 40 GB part.
        spec: || device("A100-80GB", Nvidia, Some(312.0), 312.0, 19.5, 80.0, 2.039, (Nvlink, 600.0), (8, 200.0)),
    },
    CatalogEntry {
        aliases: &["h100-sxm", "h100", "h100-sxm5", "h100-sxm5-80gb"],
        // NVIDIA H100 datasheet (SXM5): 989.4 dense bf16, 67 fp32, 80 GB HBM3 at 3.35 TB/s, NVLink4
        // 900 GB/s. Llama 3 paper (Dubey et al. 2024): 400 Gb/s per GPU, 8 NICs per node.
        spec: || device("H100-SXM", Nvidia, Some(989.4), 989.4, 67.0, 80.0, 3.35, (Nvlink, 900.0), (8, 400.0)),
    },
    CatalogEntry {
        aliases: &["h100-pcie", "h100-pcie-80gb"],
        // NVIDIA H100 PCIe datasheet: 756 dense bf16, 51 fp32, 80 GB at 2.0 TB/s, PCIe Gen5 128 GB/s.
        // PCIe servers commonly carry one 400 Gb/s NIC per two GPUs.
        spec: || device("H100-PCIe", Nvidia, Some(756.0), 756.0, 51.0, 80.0, 2.0, (Pcie, 128.0), (4, 400.0)),
    },
    CatalogEntry {
        aliases: &["h200", "h200-sxm", "h200-sxm-141gb"],
        // NVIDIA H200 datasheet: H100's compute with 141 GB HBM3e at 4.8 TB/s, NVLink4 900 GB/s.
        spec: || device("H200", Nvidia, Some(989.4), 989.4, 67.0, 141.0, 4.8, (Nvlink, 900.0), (8, 400.0)),
    },
    CatalogEntry {
        aliases: &["l40s"],
        // NVIDIA L40S datasheet: 362.05 dense bf16, 91.6 fp32, 48 GB GDDR6 at 864 GB/s, PCIe Gen4
        // x16 64 GB/s, no NVLink. Typical servers: 2x 200 Gb/s NICs.
        spec: || device("L40S", Nvidia, Some(362.05), 362.05, 91.6, 48.0, 0.864, (Pcie, 64.0), (2, 200.0)),
    },
    CatalogEntry {
        aliases: &["rtx-4090", "4090", "rtx4090"],
        // Third-party spec tables (fp32-accumulate tensor rate 165.15), 82.6 fp32, 24 GB GDDR6X at
        // 1,008 GB/s, PCIe Gen4 x16, no NVLink. Workstations: one 100 Gb/s NIC.
        spec: || device("RTX-4090", Nvidia, Some(165.15), 165.15, 82.6, 24.0, 1.008, (Pcie, 64.0), (1, 100.0)),
    },
    CatalogEntry {
        aliases: &["mi250x-gcd"],
        // AMD Instinct MI250X datasheet: one package of two GCDs with 383 bf16/fp16, 47.9 fp32
        // and 128 GB HBM2e at 3.2 TB/s in all, 220 CUs; ROCm and PyTorch see each GCD as a
        // device with half of each. Its 8 Infinity Fabric links of 50 GB/s each way (ROCm docs):
        // 4 join the two GCDs, 2 per GCD reach other packages. Frontier nodes: 4 packages, 8 GCDs,
        // 4x 200 Gb/s Slingshot NICs.
        spec: || DeviceSpec {
            compute_units: Some(110),
            package: Some(Package { dies: 2, die_link_gb_s: 200.0 }),
            ..device("MI250X-GCD", Amd, Some(191.5), 191.5, 23.95, 64.0, 1.6, (InfinityFabric, 200.0), (4, 200.0))
        },
    },
    CatalogEntry {
        aliases: &["mi300x"],
        // AMD Instinct MI300X datasheet: 1,307.4 dense bf16, 163.4 fp32, 192 GB HBM3 at 5.3 TB/s,
        // 7 Infinity Fabric links per GPU in an 8-GPU mesh (896 GB/s); 8x 400 Gb/s NICs per node.
        spec: || device("MI300X", Amd, Some(1307.4), 1307.4, 163.4, 192.0, 5.3, (InfinityFabric, 896.0), (8, 400.0)),
    },
    CatalogEntry {
        aliases: &["mi325x"],
        // AMD Instinct MI325X datasheet: MI300X compute with 256 GB HBM3E at 6.0 TB/s.
        spec: || device("MI325X", Amd, Some(1307.4), 1307.4, 163.4, 256.0, 6.0, (InfinityFabric, 896.0), (8, 400.0)),
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

    #[test]
    fn unknown_device_lists_close_names() {
        let err = catalog_device("h1000").unwrap_err();
        let SpecError::Unknown { close, .. } = &err else { panic!("{err}") };
        assert!(close.iter().any(|name| name.starts_with("h100")), "{close:?}");
    }

    #[test]
    fn catalog_entries_are_valid_and_uniquely_named() {
        let devices = catalog_devices();
        assert!(devices.len() >= 11);
        for device in &devices {
            device.clone().validated("catalog").unwrap();
        }
        let mut aliases: Vec<_> = CATALOG.iter().flat_map(|entry| entry.aliases.iter()).collect();
        let total = aliases.len();
        aliases.sort();
        aliases.dedup();
        assert_eq!(aliases.len(), total, "an alias names two devices");
    }
}
