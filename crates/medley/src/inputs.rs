//! Turns command-line arguments into validated specs: the only place that reads input files.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};
use clap::Args;
use medley_cost::{Calibration, ProfileKind};
use medley_plan::{Plan, PlanParts};
use medley_spec::{
    AttentionKernel, Bridge, Cluster, DEFAULT_MEMORY_HEADROOM, Fabric, GradReduce, JobParts, JobSpec, ModelSpec,
    Precision, Recompute, Schedule, catalog_model, echo,
};

/// The example mixed cluster `medley plan` uses when none is given.
pub const DEFAULT_CLUSTER: &str = "64xh100,128xa100,32xmi300x";
pub const DEFAULT_MODEL: &str = "llama3-70b";
/// Two NVIDIA GPUs and two AMD ones of another speed and memory: the smallest fleet that shows
/// the heterogeneity the runtime handles across vendors (speed, vendor domain, bridge). Not
/// MI250Xs: their GCDs, each 5× slower than an H100, leave the tiny job to the H100s alone.
pub const DEFAULT_FLEET: &str = "2xh100,2xmi300x";

pub use medley_spec::parse_gb_s;

/// A time dilation: a finite factor of at least 1.
pub fn parse_dilation(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(factor) if factor.is_finite() && (1.0..=1e6).contains(&factor) => Ok(factor),
        _ => Err(format!("{text:?} is not a factor from 1 to 1e6")),
    }
}

/// A learning rate AdamW can train with: finite, above 0 and at most 1 (each AdamW update moves a
/// weight by about the learning rate, and the initial weights are ~0.02).
pub fn parse_learning_rate(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(lr) if lr.is_finite() && lr > 0.0 && lr <= 1.0 => Ok(lr),
        _ => Err(format!("{text:?} is not a learning rate above 0 and at most 1")),
    }
}

/// The job's shape, declared once for every command that takes one. `plan` and `simulate`
/// leave unset values to a `--job` file, the job defaults or the planner; `train`, `calibrate`
/// and `bench train` give their own defaults with `#[command(mut_arg(..))]`, which their
/// `--help` shows, and read them through [`JobFlags::shape`].
#[derive(Args, Debug, Clone)]
pub struct JobFlags {
    /// Model: a catalog name (tiny, llama3-8b, llama3-70b, llama3-405b, qwen2-7b, gpt3-175b,
    /// mixtral-8x7b, ...) or a HuggingFace config.json (file or its folder).
    #[arg(long)]
    pub model: Option<String>,
    /// Tokens per sequence.
    #[arg(long)]
    pub seq_len: Option<u32>,
    /// Sequences per optimizer step.
    #[arg(long)]
    pub global_batch: Option<u32>,
    /// Sequences per micro-batch.
    #[arg(long)]
    pub micro_batch: Option<u32>,
    /// Number format: bf16-mixed (the default), fp16-mixed (fp16 with dynamic loss scaling, for
    /// devices without bf16 such as the V100), tf32 (fp32 tensors, matmuls on TF32 tensor cores)
    /// or fp32 (fp32 throughout).
    #[arg(long)]
    pub precision: Option<Precision>,
    /// The share of each device's memory plans leave free for what the cost model does not see
    /// (allocator fragmentation): 0.05 (the default) or 5%.
    #[arg(long, value_parser = parse_share)]
    pub memory_headroom: Option<f64>,
}

/// A share as a fraction (`0.05`) or a percentage (`5%`).
fn parse_share(text: &str) -> Result<f64, String> {
    let (number, scale) = match text.trim().strip_suffix('%') {
        Some(percent) => (percent, 0.01),
        None => (text.trim(), 1.0),
    };
    number.trim().parse::<f64>().map(|value| value * scale).map_err(|_| {
        format!("`{}` is not a share: write a fraction such as 0.05 or a percentage such as 5%", echo(text))
    })
}

/// A job's shape with every value known.
#[derive(Clone, Debug, PartialEq)]
pub struct JobShape {
    pub model: String,
    pub seq_len: u32,
    pub global_batch: u32,
    pub micro_batch: u32,
    pub precision: Precision,
    pub memory_headroom: f64,
}

impl JobFlags {
    /// Every value, as given or as the command's defaults set them.
    pub fn shape(&self) -> Result<JobShape> {
        let given = |value: Option<u32>, flag: &str| value.with_context(|| format!("this command needs {flag}"));
        Ok(JobShape {
            model: self.model.clone().context("this command needs --model")?,
            seq_len: given(self.seq_len, "--seq-len")?,
            global_batch: given(self.global_batch, "--global-batch")?,
            micro_batch: given(self.micro_batch, "--micro-batch")?,
            precision: self.precision.unwrap_or_default(),
            memory_headroom: self.memory_headroom.unwrap_or(DEFAULT_MEMORY_HEADROOM),
        })
    }
}

/// Where the cluster, model and job come from.
#[derive(Args, Debug, Clone)]
#[command(mut_arg("model", |arg| arg.default_value(DEFAULT_MODEL)))]
pub struct SpecArgs {
    /// Cluster: a TOML file, or inline `COUNTxDEVICE,...` (8 GPUs per node unless fewer).
    #[arg(long, default_value = DEFAULT_CLUSTER)]
    pub cluster: String,
    #[command(flatten)]
    pub shape: JobFlags,
    /// A job TOML file (seq_len, global_batch, micro_batch, zero1, recompute, attention, schedule); flags
    /// given on the command line override it. Without either, sequences of 4096 tokens, 1024 per
    /// step, and the micro-batch and recompute the planner chooses.
    #[arg(long)]
    pub job: Option<String>,
    /// Activation recompute: none, selective or full [default: the planner chooses].
    #[arg(long)]
    pub recompute: Option<Recompute>,
    /// Attention kernel: fused (FlashAttention-style, keeps no s × s scores) or unfused
    /// [default: fused].
    #[arg(long)]
    pub attention: Option<AttentionKernel>,
    /// Pipeline schedule: 1f1b, gpipe, interleaved (needs --fix with vpp > 1), kfkb:K, zb-h1 or
    /// adaptive [default: 1f1b].
    #[arg(long)]
    pub schedule: Option<Schedule>,
    /// The format gradients are accumulated and reduced in over data-parallel replicas: fp32 or
    /// 16-bit [default: Megatron-LM's, fp32 under bf16-mixed and 16-bit under fp16-mixed].
    #[arg(long)]
    pub grad_reduce: Option<GradReduce>,
    /// Keep optimizer states whole on every replica instead of ZeRO-1 sharding.
    #[arg(long)]
    pub no_zero1: bool,
    /// Shard gradients over the replicas with the optimizer states (ZeRO-2, as the Llama 3
    /// paper's FSDP does): a device keeps its share of them instead of all of its stage's.
    #[arg(long)]
    pub shard_gradients: bool,
    /// Reduce gradients after the whole backward instead of bucket by bucket during each model
    /// chunk's last backward pass (Megatron-LM without `--overlap-grad-reduce`).
    #[arg(long)]
    pub no_overlap_grad_reduce: bool,
    /// Efficiency profile (TOML) overriding the cost model's defaults per device type.
    #[arg(long)]
    pub calibration: Option<String>,
    #[command(flatten)]
    pub network: NetworkArgs,
}

/// Fabric and bridge settings for an inline cluster.
#[derive(Args, Debug, Clone)]
pub struct NetworkArgs {
    /// Inter-node message latency, µs (inline clusters).
    #[arg(long)]
    pub fabric_latency_us: Option<f64>,
    /// Fabric oversubscription, ≥ 1 (inline clusters).
    #[arg(long)]
    pub oversubscription: Option<f64>,
    /// Disable device-direct RDMA between vendors: cross-vendor traffic is CPU-forwarded.
    #[arg(long)]
    pub no_device_direct: bool,
    /// Device-direct bridge bandwidth per GPU, GB/s [default: the NIC share].
    #[arg(long)]
    pub bridge_gb_s: Option<f64>,
    /// CPU-forwarded bridge bandwidth per GPU, GB/s [default: 12.5].
    #[arg(long)]
    pub cpu_forward_gb_s: Option<f64>,
}

/// The validated inputs of a planning run.
pub struct Specs {
    pub cluster: Cluster,
    pub model: ModelSpec,
    pub job: JobSpec,
    pub calibration: Calibration,
}

impl SpecArgs {
    pub fn resolve(&self) -> Result<Specs> {
        let cluster = self.cluster()?;
        let model = load_model(self.shape.model.as_deref().unwrap_or(DEFAULT_MODEL))?;
        let calibration = self.resolve_calibration(&model)?;
        check_calibration_names(&calibration, &cluster)?;
        let job = self.job_spec()?;
        cluster.check_precision(job.precision())?;
        say_assumptions(&cluster);
        Ok(Specs { cluster, model, job, calibration })
    }

    fn cluster(&self) -> Result<Cluster> {
        if looks_like_file(&self.cluster) {
            let text = read(&self.cluster)?;
            return Ok(Cluster::from_toml(&text, &self.cluster)?);
        }
        let network = &self.network;
        let defaults = (Fabric::default(), Bridge::default());
        let fabric = Fabric {
            latency_us: network.fabric_latency_us.unwrap_or(defaults.0.latency_us),
            oversubscription: network.oversubscription.unwrap_or(defaults.0.oversubscription),
        };
        let bridge = Bridge {
            device_direct: !network.no_device_direct,
            device_direct_gb_s: network.bridge_gb_s,
            cpu_forward_gb_s: network.cpu_forward_gb_s.unwrap_or(defaults.1.cpu_forward_gb_s),
            ..defaults.1
        };
        Ok(Cluster::from_inline(&self.cluster, fabric, bridge)?)
    }

    fn job_spec(&self) -> Result<JobSpec> {
        let (mut parts, source) = match &self.job {
            Some(path) => (JobParts::from_toml(&read(path)?, path)?, path.as_str()),
            None => (JobParts::default(), "command line"),
        };
        parts.seq_len = self.shape.seq_len.unwrap_or(parts.seq_len);
        parts.global_batch = self.shape.global_batch.unwrap_or(parts.global_batch);
        parts.micro_batch = self.shape.micro_batch.or(parts.micro_batch);
        parts.precision = self.shape.precision.unwrap_or(parts.precision);
        parts.grad_reduce = self.grad_reduce.or(parts.grad_reduce);
        parts.memory_headroom = self.shape.memory_headroom.unwrap_or(parts.memory_headroom);
        parts.recompute = self.recompute.or(parts.recompute);
        parts.attention = self.attention.unwrap_or(parts.attention);
        parts.schedule = self.schedule.unwrap_or(parts.schedule);
        parts.zero1 &= !self.no_zero1;
        parts.shard_gradients |= self.shard_gradients;
        parts.overlap_grad_reduce &= !self.no_overlap_grad_reduce;
        Ok(JobSpec::new(parts, source)?)
    }

    /// The `--calibration` profile for pricing `model` on GPUs (see [`check_gpu_pricing`]).
    pub fn resolve_calibration(&self, model: &ModelSpec) -> Result<Calibration> {
        let Some(path) = &self.calibration else { return Ok(Calibration::default()) };
        let calibration = Calibration::from_toml(&read(path)?, path)?;
        check_gpu_pricing(&calibration, model, path)?;
        Ok(calibration)
    }
}

/// Says, once per custom device type, what the cost model assumes for want of its numbers.
fn say_assumptions(cluster: &Cluster) {
    let mut said = BTreeSet::new();
    for device in cluster.groups().iter().map(|group| &group.device) {
        if said.insert(device.name.as_str()) {
            for line in medley_cost::assumptions(device) {
                tracing::warn!("device {}: {line}", echo(&device.name));
            }
        }
    }
}

/// Plans and simulations price GPUs. An emulation profile (this machine's CPU standing in for a
/// fleet) prices only the emulated runs of the model it was measured on; anything else it would
/// predict at CPU speed, days a step.
pub fn check_gpu_pricing(calibration: &Calibration, model: &ModelSpec, path: &str) -> Result<()> {
    match calibration.kind() {
        ProfileKind::Gpu => Ok(()),
        ProfileKind::Emulation { model: Some(measured) } if measured == model.name() => Ok(()),
        kind => bail!(
            "{path} is {kind}, which would price {} at this machine's CPU speed rather than on GPUs; give a GPU \
             efficiency profile (kind = \"gpu\", see examples/calibration.toml) or none. An emulation profile prices \
             only the emulated runs of its own model (`medley simulate --plan RUN/plan.json --calibration \
             RUN/calibration.toml`)",
            model.name()
        ),
    }
}

/// `medley train` emulates a fleet: its profile must be an emulation profile measured on the
/// model it trains.
pub fn read_emulation_profile(path: &str, model: &ModelSpec) -> Result<Calibration> {
    let calibration = Calibration::from_toml(&read(path)?, path)?;
    match calibration.kind() {
        // From before profiles named their model: the run it is given to names it from now on.
        ProfileKind::Emulation { model: None } => Ok(calibration.measured_on(model.name())),
        ProfileKind::Emulation { model: Some(measured) } if measured == model.name() => Ok(calibration),
        ProfileKind::Emulation { model: Some(measured) } => bail!(
            "{} is an emulation profile measured on model `{}`, but this run trains `{}`; write one for it \
             with `medley calibrate --model ...`, or leave out --calibration to measure this machine now",
            echo(path),
            echo(measured),
            model.name()
        ),
        kind => bail!(
            "{} is {kind}; medley train emulates its fleet on this machine and takes an emulation profile \
             (`medley calibrate -o FILE`), or none to measure this machine now",
            echo(path)
        ),
    }
}

/// A profile entry for a device the cluster does not have is almost always a typo: refuse it
/// rather than silently keep the defaults.
pub fn check_calibration_names(calibration: &Calibration, cluster: &Cluster) -> Result<()> {
    let names: Vec<&str> = cluster.groups().iter().map(|group| group.device.name.as_str()).collect();
    for profiled in calibration.device_names() {
        if !names.iter().any(|name| name.eq_ignore_ascii_case(profiled)) {
            bail!(
                "the calibration profile names device `{}`, which the cluster does not have ({})",
                echo(profiled),
                names.join(", ")
            );
        }
    }
    Ok(())
}

/// The cluster `train` and `calibrate` emulate: a cluster TOML file, or an inline fleet whose
/// GPUs are each a node of their own (a package's dies share one).
pub fn emulated_cluster(text: &str) -> Result<Cluster> {
    match looks_like_file(text) {
        true => Ok(Cluster::from_toml(&read(text)?, text)?),
        false => Ok(Cluster::from_fleet(text)?),
    }
}

/// A catalog name, or a HuggingFace config.json (or the folder holding one).
pub fn load_model(name_or_path: &str) -> Result<ModelSpec> {
    let path = Path::new(name_or_path);
    if path.is_dir() {
        let config = path.join("config.json");
        let text = read(&config.to_string_lossy())?;
        return Ok(ModelSpec::from_hf_config(&text, &config.to_string_lossy())?);
    }
    if looks_like_file(name_or_path) {
        let text = read(name_or_path)?;
        return Ok(ModelSpec::from_hf_config(&text, name_or_path)?);
    }
    Ok(catalog_model(name_or_path)?)
}

fn looks_like_file(text: &str) -> bool {
    Path::new(text).is_file() || text.ends_with(".toml") || text.ends_with(".json") || text.contains('/')
}

/// The largest input file medley reads (a spec, plan, profile or trace): far beyond any real one,
/// so that a wrong path (`/dev/zero`, a dataset) fails at once instead of filling memory.
const MAX_INPUT_BYTES: u64 = 64 << 20;

pub fn read(path: &str) -> Result<String> {
    use std::io::Read;
    let file = fs::File::open(path).with_context(|| format!("cannot read {}", echo(path)))?;
    let mut bytes = Vec::new();
    file.take(MAX_INPUT_BYTES + 1).read_to_end(&mut bytes).with_context(|| format!("cannot read {}", echo(path)))?;
    if bytes.len() as u64 > MAX_INPUT_BYTES {
        bail!(
            "{} is larger than {} MiB, more than any input medley reads: is it the right file?",
            echo(path),
            MAX_INPUT_BYTES >> 20
        );
    }
    String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8 text", echo(path)))
}

/// The specs a plan file carries, with the calibration the flags name.
pub fn specs_of_plan(args: &SpecArgs, path: &str, plan: &Plan) -> Result<Specs> {
    let calibration = args.resolve_calibration(plan.model())?;
    check_calibration_names(&calibration, plan.cluster())?;
    specs_with_calibration(path, plan, calibration)
}

/// The specs a plan file carries, priced with `calibration`.
pub fn specs_with_calibration(path: &str, plan: &Plan, calibration: Calibration) -> Result<Specs> {
    let parts = JobParts {
        seq_len: plan.seq_len(),
        global_batch: plan.global_batch(),
        micro_batch: None,
        precision: plan.precision(),
        grad_reduce: Some(plan.grad_reduce()),
        zero1: plan.zero1(),
        shard_gradients: plan.shard_gradients(),
        recompute: None,
        attention: plan.attention(),
        overlap_grad_reduce: plan.overlap_grad_reduce(),
        schedule: plan.schedule(),
        memory_headroom: plan.memory_headroom(),
    };
    Ok(Specs {
        job: JobSpec::new(parts, path)?,
        cluster: plan.cluster().clone(),
        model: plan.model().clone(),
        calibration,
    })
}

/// A plan file: its parts read, then checked, so a hand edit that breaks the plan is named.
pub fn load_plan(path: &str) -> Result<Plan> {
    let parts: PlanParts =
        serde_json::from_str(&read(path)?).with_context(|| format!("{path} is not a medley plan"))?;
    Plan::new(parts).with_context(|| format!("in {path}"))
}

/// A bandwidth trace: a CSV file's (time_s,fraction) or one of the named generators.
pub fn network_trace(text: &str) -> Result<medley_sim::BandwidthTrace> {
    if text.ends_with(".csv") || std::path::Path::new(text).is_file() {
        return Ok(medley_sim::BandwidthTrace::from_csv(&read(text)?, text)?);
    }
    Ok(text.parse()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_input_is_refused_after_the_cap_not_read_to_the_end() {
        let err = read("/dev/zero").unwrap_err().to_string();
        assert!(err.contains("larger than 64 MiB"), "{err}");
    }
}
