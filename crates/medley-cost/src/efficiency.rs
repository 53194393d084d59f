//! Achievable fractions of each device's peak, and calibration profiles that override them.
//!
//! On GPUs the matmul and attention fractions are the rates of well-shaped kernels; the cost
//! model lowers them for each GEMM's and attention's shape (`gemm`). Where the defaults come
//! from:
//! - A100 and H100 matmul and attention efficiencies are fitted, through the simulator, to
//!   published measured training runs (`medley bench calibration` shows the fit and the runs held
//!   out from it): A100 to Korthikanti et al. 2022 (arXiv 2205.05198) Table 4's 175B and 530B
//!   runs, H100 to NVIDIA's dgxc-benchmarking GPT-3 175B BF16 run on 128 GPUs. One factor scales
//!   the stated pair (A100 0.75/0.55, H100 0.70/0.50), which keeps their ratio.
//! - V100 takes A100's fit and H200 H100's (same architectures; no cited runs of their own), as
//!   do the other Ampere parts (A10, A40, RTX A6000: GA102 cards, likely below an A100's fit)
//!   and Hopper parts (H800, H20).
//! - The rest are stated assumptions, not measurements: Ada cards' large GEMMs at about 65% of
//!   peak, AMD's MI300-series at roughly half in public hipBLASLt measurements (MI250X less),
//!   fused attention at 35-55%. Streaming kernels reach ~80% of HBM bandwidth everywhere.
//! - The newest and oldest generations are assumptions too, with no run or measurement behind
//!   them: Blackwell (B200, GB200) takes Hopper's fitted pair and CDNA 4 (MI355X) CDNA 3's,
//!   until someone calibrates them; Turing (T4) is put lower, at 0.50/0.30, as a 70 W card held
//!   below its boost clock under sustained tensor load whose attention runs without
//!   FlashAttention-2 (which needs Ampere or newer); CDNA 1 (MI100) below CDNA 2, at 0.40/0.25.
//!
//! A calibration profile (`medley plan --calibration FILE`) replaces them with what a user
//! measured on their machines: of well-shaped kernels for a GPU profile, of the one model it was
//! measured on for an emulation profile (which the cost model applies as they are). A profile
//! may also state the training framework's fixed costs ([`Overheads`]), which the defaults put
//! at zero: `medley calibrate --measured` fits them to a framework's measured runs.

use std::collections::BTreeMap;
use std::fmt;

use medley_spec::{Architecture, DeviceSpec, Vendor, catalog_device, echo};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Fractions of peak, each in (0, 1].
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Efficiency {
    /// Dense matrix multiplies, of the 16-bit tensor peak.
    pub matmul: f64,
    /// The fused attention core, of the 16-bit tensor peak.
    pub attention: f64,
    /// Memory-bound kernels, of HBM bandwidth.
    pub memory: f64,
}

impl Efficiency {
    /// The stated default for a device type (see the module comment).
    pub fn default_for(device: &DeviceSpec) -> Efficiency {
        if let Some(stated) = device.efficiency {
            return Efficiency { matmul: stated.matmul, attention: stated.attention, memory: stated.memory };
        }
        let (matmul, attention) = match architecture(device).0 {
            // Assumed, not measured (see the module comment).
            Architecture::Cdna1 => (0.40, 0.25),
            Architecture::Cdna2 => (0.45, 0.30),
            Architecture::Cdna3 | Architecture::Cdna4 => (0.50, 0.35),
            // Assumed, not measured (see the module comment).
            Architecture::Turing => (0.50, 0.30),
            // Fitted: 1.009 × (0.75, 0.55).
            Architecture::Volta | Architecture::Ampere => (0.757, 0.555),
            Architecture::Ada => (0.65, 0.45),
            // Fitted on H100: 0.980 × (0.70, 0.50); Blackwell assumed to match.
            Architecture::Hopper | Architecture::Blackwell => (0.686, 0.490),
        };
        Efficiency { matmul, attention, memory: 0.8 }
    }
}

/// The device's architecture, and whether it was assumed: stated by a custom device, known for
/// the catalog's families, else the vendor's current datacenter generation.
fn architecture(device: &DeviceSpec) -> (Architecture, bool) {
    if let Some(architecture) = device.architecture {
        return (architecture, false);
    }
    let family = |prefix: &str| device.name.get(..prefix.len()).is_some_and(|head| head.eq_ignore_ascii_case(prefix));
    let known = [
        ("mi100", Architecture::Cdna1),
        ("mi210", Architecture::Cdna2),
        ("mi250", Architecture::Cdna2),
        ("mi300", Architecture::Cdna3),
        ("mi325", Architecture::Cdna3),
        ("mi355", Architecture::Cdna4),
        ("v100", Architecture::Volta),
        ("t4", Architecture::Turing),
        ("a10", Architecture::Ampere),
        ("a100", Architecture::Ampere),
        ("a40", Architecture::Ampere),
        ("rtx-a6000", Architecture::Ampere),
        ("l4", Architecture::Ada),
        ("l40", Architecture::Ada),
        ("rtx-4090", Architecture::Ada),
        ("h100", Architecture::Hopper),
        ("h20", Architecture::Hopper),
        ("h200", Architecture::Hopper),
        ("h800", Architecture::Hopper),
        ("b200", Architecture::Blackwell),
        ("gb200", Architecture::Blackwell),
    ];
    match known.into_iter().find(|(prefix, _)| family(prefix)) {
        Some((_, architecture)) => (architecture, false),
        None => match device.vendor {
            Vendor::Nvidia => (Architecture::Hopper, true),
            Vendor::Amd => (Architecture::Cdna3, true),
        },
    }
}

/// What the cost model assumes about a custom device for want of its own numbers, one line each:
/// its efficiencies (when it states neither them nor an architecture) and its compute units.
pub fn assumptions(device: &DeviceSpec) -> Vec<String> {
    let mut lines = Vec::new();
    let (generation, assumed) = architecture(device);
    if device.efficiency.is_none() && assumed {
        let efficiency = Efficiency::default_for(device);
        lines.push(format!(
            "no `efficiency` or `architecture` given: priced at the {} defaults (matmul {}, attention {}, memory {})",
            format!("{generation:?}").to_lowercase(),
            efficiency.matmul,
            efficiency.attention,
            efficiency.memory
        ));
    }
    if crate::gemm::GemmGeometry::of(device).is_none() {
        lines.push("no `compute_units` given: its GEMMs are priced without tile quantisation".to_string());
    }
    lines
}

#[derive(Debug, Error, PartialEq)]
pub enum CalibrationError {
    /// `message` echoes user text through [`echo`] where it quotes any.
    #[error("{}: {message}", echo(.source_name))]
    Syntax { source_name: String, message: String },
    #[error("{}: device `{}`: efficiency `{field}` must be in (0, 1], got {value}", echo(.source_name), echo(.device))]
    OutOfRange { source_name: String, device: String, field: &'static str, value: f64 },
    #[error(
        "{}: overhead `{field}` must be between 0 and {} seconds, got {value}",
        echo(.source_name),
        Overheads::MAX_S
    )]
    OverheadOutOfRange { source_name: String, field: &'static str, value: f64 },
}

/// A training framework's fixed costs, in seconds added to each forward and to each backward
/// pass: per micro-batch on a pipeline stage (or model chunk) and per layer it holds. They are
/// the host's share of a step that no FLOP or byte count sees: kernel launches, the schedule's
/// bookkeeping, point-to-point set-up. Megatron-LM's large runs hide them behind their kernels;
/// small models, small micro-batches and Python pipeline engines do not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Overheads {
    #[serde(default)]
    pub per_micro_batch_s: f64,
    #[serde(default)]
    pub per_layer_s: f64,
}

impl Overheads {
    /// No framework spends a second of host time per pass: a larger value is a typo.
    pub const MAX_S: f64 = 1.0;

    fn fields(self) -> [(&'static str, f64); 2] {
        [("per_micro_batch_s", self.per_micro_batch_s), ("per_layer_s", self.per_layer_s)]
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CalibrationFile {
    kind: Option<String>,
    model: Option<String>,
    #[serde(default)]
    device: BTreeMap<String, Efficiency>,
    #[serde(default)]
    overhead: Overheads,
}

/// What a profile's efficiencies describe, which decides what it may price.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ProfileKind {
    /// Real GPUs: achievable fractions of their datasheet peaks (`kind = "gpu"`, the default).
    #[default]
    Gpu,
    /// This machine's CPU standing in for a fleet (`kind = "emulation"`, from `medley calibrate`
    /// or `medley train`): the fastest device type priced at the CPU's measured speed on one
    /// model, so it prices that model's emulated runs and nothing else.
    Emulation {
        /// The model the speed was measured on; unknown in profiles written before kinds existed.
        model: Option<String>,
    },
}

impl fmt::Display for ProfileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProfileKind::Gpu => f.write_str("a GPU efficiency profile"),
            ProfileKind::Emulation { model: Some(model) } => {
                write!(f, "an emulation profile (this machine's CPU speed, measured on model `{}`)", echo(model))
            }
            ProfileKind::Emulation { model: None } => f.write_str("an emulation profile (this machine's CPU speed)"),
        }
    }
}

/// Below this matmul efficiency no GPU trains: a profile without a `kind` that has one was
/// written by `medley calibrate` before profiles said their kind.
const LEGACY_EMULATION_BELOW: f64 = 0.01;

/// Per-device-type efficiencies measured by a user (device types not listed keep the defaults),
/// and the framework's overheads.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    kind: ProfileKind,
    by_device: BTreeMap<String, Efficiency>,
    overheads: Overheads,
}

impl Calibration {
    /// Parses a profile such as:
    /// ```toml
    /// [device.H100-SXM]
    /// matmul = 0.62
    /// attention = 0.45
    /// memory = 0.85
    ///
    /// [overhead]
    /// per_micro_batch_s = 0.002
    /// per_layer_s = 0.0001
    /// ```
    pub fn from_toml(text: &str, source: &str) -> Result<Self, CalibrationError> {
        // The parser's own message quotes the offending line whole: its message and line only.
        let file: CalibrationFile = toml::from_str(text).map_err(|err| {
            let line = err.span().map_or(1, |span| text[..span.start.min(text.len())].matches('\n').count() + 1);
            CalibrationError::Syntax {
                source_name: source.to_string(),
                message: format!("line {line}: {}", echo(err.message().trim())),
            }
        })?;
        for (device, efficiency) in &file.device {
            let fields =
                [("matmul", efficiency.matmul), ("attention", efficiency.attention), ("memory", efficiency.memory)];
            for (field, value) in fields {
                if !(value > 0.0 && value <= 1.0) {
                    return Err(CalibrationError::OutOfRange {
                        source_name: source.to_string(),
                        device: device.clone(),
                        field,
                        value,
                    });
                }
            }
        }
        for (field, value) in file.overhead.fields() {
            if !(0.0..=Overheads::MAX_S).contains(&value) {
                return Err(CalibrationError::OverheadOutOfRange { source_name: source.to_string(), field, value });
            }
        }
        let syntax = |message: String| CalibrationError::Syntax { source_name: source.to_string(), message };
        let kind = match (file.kind.as_deref(), file.model) {
            (Some("gpu"), None) => ProfileKind::Gpu,
            (Some("gpu"), Some(_)) => return Err(syntax("`model` belongs to emulation profiles only".into())),
            (Some("emulation"), model) => ProfileKind::Emulation { model },
            (Some(other), _) => {
                return Err(syntax(format!("kind `{}` is neither \"gpu\" nor \"emulation\"", echo(other))));
            }
            (None, Some(model)) => ProfileKind::Emulation { model: Some(model) },
            (None, None) if file.device.values().any(|e| e.matmul < LEGACY_EMULATION_BELOW) => {
                ProfileKind::Emulation { model: None }
            }
            (None, None) => ProfileKind::Gpu,
        };
        // Catalog aliases (`h100`) name the canonical device (`H100-SXM`).
        let by_device = file
            .device
            .into_iter()
            .map(|(name, efficiency)| (catalog_device(&name).map_or(name, |device| device.name), efficiency))
            .collect();
        Ok(Calibration { kind, by_device, overheads: file.overhead })
    }

    /// An empty emulation profile for `model`, for [`Calibration::set`] to fill.
    pub fn emulation(model: &str) -> Self {
        Calibration {
            kind: ProfileKind::Emulation { model: Some(model.to_string()) },
            by_device: BTreeMap::new(),
            overheads: Overheads::default(),
        }
    }

    pub fn kind(&self) -> &ProfileKind {
        &self.kind
    }

    /// An emulation profile that did not name its model (written before profiles did), naming
    /// `model`, on which it is known to have been measured; any other profile as it is.
    pub fn measured_on(mut self, model: &str) -> Self {
        if self.kind == (ProfileKind::Emulation { model: None }) {
            self.kind = ProfileKind::Emulation { model: Some(model.to_string()) };
        }
        self
    }

    /// The device types the profile names (catalog names where an alias was given).
    pub fn device_names(&self) -> impl Iterator<Item = &str> {
        self.by_device.keys().map(String::as_str)
    }

    pub fn overheads(&self) -> Overheads {
        self.overheads
    }

    /// Sets the framework's overheads, as a fit found them.
    pub fn set_overheads(&mut self, overheads: Overheads) {
        self.overheads = overheads;
    }

    /// Sets a device type's efficiencies, as a measurement found them.
    pub fn set(&mut self, device: &DeviceSpec, efficiency: Efficiency) {
        self.by_device.insert(device.name.clone(), efficiency);
    }

    /// The profile with each device type of `devices` `factor` times slower: every efficiency
    /// divided by it, so that compute and memory time both stretch by `factor`. An emulated
    /// fleet whose time is dilated to fit its host's cores is priced this way.
    pub fn dilated<'d>(&self, devices: impl IntoIterator<Item = &'d DeviceSpec>, factor: f64) -> Calibration {
        let mut dilated = self.clone();
        for device in devices {
            let e = self.efficiency(device);
            let efficiency =
                Efficiency { matmul: e.matmul / factor, attention: e.attention / factor, memory: e.memory / factor };
            dilated.set(device, efficiency);
        }
        dilated
    }

    /// The profile as `from_toml` reads it.
    pub fn to_toml(&self) -> String {
        let head = match &self.kind {
            ProfileKind::Gpu => "kind = \"gpu\"\n".to_string(),
            ProfileKind::Emulation { model: Some(model) } => {
                format!("kind = \"emulation\"\nmodel = {}\n", toml::Value::from(model.as_str()))
            }
            ProfileKind::Emulation { model: None } => "kind = \"emulation\"\n".to_string(),
        };
        let devices = self.by_device.iter().map(|(name, e)| {
            format!(
                "\n[device.{}]\nmatmul = {:e}\nattention = {:e}\nmemory = {:e}\n",
                toml_key(name),
                e.matmul,
                e.attention,
                e.memory
            )
        });
        let overheads = (self.overheads != Overheads::default()).then(|| {
            let fields = self.overheads.fields().map(|(field, value)| format!("{field} = {value:e}\n"));
            format!("\n[overhead]\n{}", fields.concat())
        });
        std::iter::once(head).chain(devices).chain(overheads).collect()
    }

    pub fn efficiency(&self, device: &DeviceSpec) -> Efficiency {
        self.by_device
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(&device.name))
            .map(|(_, efficiency)| *efficiency)
            .unwrap_or_else(|| Efficiency::default_for(device))
    }
}

/// A device name as a TOML key: bare when it can be, quoted otherwise.
fn toml_key(name: &str) -> String {
    let bare = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if bare { name.to_string() } else { toml::Value::from(name).to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use medley_spec::catalog_device;

    #[test]
    fn set_profile_round_trips_through_toml() {
        let mut calibration = Calibration::emulation("tiny");
        let h100 = catalog_device("h100").unwrap();
        calibration.set(&h100, Efficiency { matmul: 1.5e-4, attention: 1e-4, memory: 0.25 });
        let text = calibration.to_toml();
        assert_eq!(Calibration::from_toml(&text, "x.toml").unwrap(), calibration, "{text}");
        let mut gpu = Calibration::default();
        gpu.set(&h100, Efficiency { matmul: 0.6, attention: 0.4, memory: 0.9 });
        assert_eq!(Calibration::from_toml(&gpu.to_toml(), "g.toml").unwrap(), gpu);
        gpu.set_overheads(Overheads { per_micro_batch_s: 0.0125, per_layer_s: 3e-4 });
        assert_eq!(Calibration::from_toml(&gpu.to_toml(), "g.toml").unwrap(), gpu);
    }

    #[test]
    fn overheads_default_to_zero_and_are_refused_out_of_range_by_name() {
        let only_one = Calibration::from_toml("[overhead]\nper_layer_s = 2e-4\n", "o.toml").unwrap();
        assert_eq!(only_one.overheads(), Overheads { per_micro_batch_s: 0.0, per_layer_s: 2e-4 });
        for (text, field) in [("per_micro_batch_s = -0.1", "per_micro_batch_s"), ("per_layer_s = 5", "per_layer_s")] {
            let err = Calibration::from_toml(&format!("[overhead]\n{text}\n"), "o.toml").unwrap_err().to_string();
            assert!(err.contains("o.toml") && err.contains(field), "{err}");
        }
        assert!(Calibration::from_toml("[overhead]\nper_step_s = 1\n", "o.toml").is_err());
    }

    /// Issue 31: a profile's `kind` reached the terminal raw, escapes and all.
    #[test]
    fn errors_echo_profile_text_escaped_and_cut() {
        let long = "k".repeat(100_000);
        for kind in ["\\u001b[31mgpu", long.as_str()] {
            let err = Calibration::from_toml(&format!("kind = \"{kind}\"\n"), "k.toml").unwrap_err().to_string();
            assert!(!err.chars().any(char::is_control) && err.len() < 1000, "{err:?}");
        }
    }

    #[test]
    fn profiles_say_their_kind_and_old_emulation_profiles_are_recognised() {
        let gpu = "[device.h100]\nmatmul = 0.6\nattention = 0.4\nmemory = 0.9\n";
        assert_eq!(Calibration::from_toml(gpu, "g.toml").unwrap().kind(), &ProfileKind::Gpu);
        let old_emulation = "[device.H100-SXM]\nmatmul = 1.5e-4\nattention = 1e-4\nmemory = 0.25\n";
        let kind = Calibration::from_toml(old_emulation, "e.toml").unwrap().kind().clone();
        assert_eq!(kind, ProfileKind::Emulation { model: None });
        let err = Calibration::from_toml("kind = \"cpu\"\n", "k.toml").unwrap_err().to_string();
        assert!(err.contains("neither"), "{err}");
    }

    #[test]
    fn profile_overrides_listed_devices_only() {
        let text = "[device.h100]\nmatmul = 0.6\nattention = 0.4\nmemory = 0.9\n";
        let calibration = Calibration::from_toml(text, "cal.toml").unwrap();
        let h100 = catalog_device("h100").unwrap();
        assert_eq!(calibration.efficiency(&h100).matmul, 0.6);
        let mi300x = catalog_device("mi300x").unwrap();
        assert_eq!(calibration.efficiency(&mi300x), Efficiency::default_for(&mi300x));
    }

    #[test]
    fn profile_rejects_out_of_range_and_unknown_fields() {
        let err = Calibration::from_toml("[device.x]\nmatmul = 1.5\nattention = 0.4\nmemory = 0.9\n", "c.toml");
        assert!(err.unwrap_err().to_string().contains("(0, 1]"));
        assert!(Calibration::from_toml("[device.x]\nspeed = 1\n", "c.toml").is_err());
    }

    /// Issue 33: a device outside the catalog silently took H100's fitted efficiency and no tile
    /// quantisation. It now states its own, or its architecture's, and what is assumed is said.
    #[test]
    fn custom_devices_state_their_efficiency_or_architecture_and_assumptions_are_said() {
        let mut custom = catalog_device("h100").unwrap();
        custom.name = "lab-gpu".into();
        let lines = assumptions(&custom);
        assert!(lines.len() == 2 && lines[0].contains("the hopper defaults"), "{lines:?}");
        custom.architecture = Some(Architecture::Ada);
        assert_eq!(Efficiency::default_for(&custom).matmul, 0.65);
        custom.compute_units = Some(84);
        assert!(assumptions(&custom).is_empty());
        assert_eq!(crate::gemm::GemmGeometry::of(&custom).map(|geometry| geometry.units), Some(84));
        let stated = medley_spec::StatedEfficiency { matmul: 0.61, attention: 0.42, memory: 0.7 };
        custom.efficiency = Some(stated);
        assert_eq!(Efficiency::default_for(&custom), Efficiency { matmul: 0.61, attention: 0.42, memory: 0.7 });
        assert!(assumptions(&catalog_device("mi250x").unwrap()).is_empty());
    }

    /// Issue 33: every catalog device knows its generation and compute units, so none is priced
    /// at another vendor generation's defaults or without tile quantisation.
    #[test]
    fn every_catalog_device_has_its_architecture_and_compute_units() {
        for device in medley_spec::catalog_devices() {
            assert!(assumptions(&device).is_empty(), "{}: {:?}", device.name, assumptions(&device));
        }
        let generation = |name: &str| architecture(&catalog_device(name).unwrap()).0;
        let expected = [
            ("t4", Architecture::Turing),
            ("a10", Architecture::Ampere),
            ("a40", Architecture::Ampere),
            ("rtx-a6000", Architecture::Ampere),
            ("l4", Architecture::Ada),
            ("h800", Architecture::Hopper),
            ("h20", Architecture::Hopper),
            ("b200", Architecture::Blackwell),
            ("gb200", Architecture::Blackwell),
            ("mi100", Architecture::Cdna1),
            ("mi210", Architecture::Cdna2),
            ("mi355x", Architecture::Cdna4),
        ];
        for (name, architecture) in expected {
            assert_eq!(generation(name), architecture, "{name}");
        }
        // Architectures are named in cluster files in lowercase.
        for (text, architecture) in [
            ("turing", Architecture::Turing),
            ("blackwell", Architecture::Blackwell),
            ("cdna1", Architecture::Cdna1),
            ("cdna4", Architecture::Cdna4),
        ] {
            assert_eq!(toml::Value::from(text).try_into::<Architecture>().unwrap(), architecture);
        }
        // The assumed generations sit where the module comment puts them.
        let matmul = |name: &str| Efficiency::default_for(&catalog_device(name).unwrap()).matmul;
        assert_eq!(matmul("b200"), matmul("h100"));
        assert_eq!(matmul("mi355x"), matmul("mi300x"));
        assert!(matmul("t4") < matmul("v100") && matmul("mi100") < matmul("mi250x"));
    }
}
