//! `medley bench compute`: one worker's training step (forward, cross-entropy, backward, AdamW) on
//! the whole model, at each thread count, side by side with PyTorch running the same model from the
//! same weights on the same tokens (`bench/torch_step.py`, when `TORCH_PYTHON` names an
//! interpreter that imports torch). The first step's losses must agree before a time is compared.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use comfy_table::Cell;
use medley_model::data::{Dataset, loss_scale};
use medley_model::params::stage_params;
use medley_model::{
    AdamW, ComputeDevice, HostTensor, MicroBatch, ModelConfig, StageOutput, StageState, matmul_seconds, save_tensors,
    stage_compute,
};
use medley_runtime::DeviceChoice;
use medley_spec::ModelSpec;
use serde::{Deserialize, Serialize};

use medley_report::text::{right, table};

use crate::stats::median;

/// Steps before timing starts (allocator, caches, lazily built kernels), as the script does.
const WARM_UP: usize = 2;

/// The first-step losses of medley and PyTorch agree within this relative difference, or the
/// comparison is refused: different numbers mean different models.
const LOSS_TOLERANCE: f64 = 1e-3;

/// What both benches train.
#[derive(Args, Debug)]
pub struct TrainedShape {
    /// Model to train (a catalog name or a config.json).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Samples per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq_len: u32,
}

#[derive(Args, Debug)]
pub struct ComputeBenchArgs {
    #[command(flatten)]
    pub shape: TrainedShape,
    /// Timed steps per run, after 2 warm-up steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Thread counts to compare at [default: 1 and every core this process may use].
    #[arg(long, value_delimiter = ',')]
    threads: Vec<usize>,
    /// Alternating rounds of medley and PyTorch per thread count (a shared machine's bursts land
    /// on both).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Where medley computes (PyTorch always on the CPU).
    #[arg(long, default_value_t = DeviceChoice::Cpu)]
    device: DeviceChoice,
    /// Print the rows as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// One thread count's figures.
#[derive(Serialize)]
struct ComputeRow {
    threads: usize,
    device: String,
    medley_step_ms: f64,
    medley_first_loss: f64,
    torch_step_ms: Option<f64>,
    torch_first_loss: Option<f64>,
    /// medley's step time over PyTorch's: below 1 is faster.
    medley_over_torch: Option<f64>,
}

/// What the PyTorch script prints.
#[derive(Deserialize)]
struct TorchRun {
    first_loss: f64,
    step_s: Vec<f64>,
}

/// `medley bench compute` on `model` (the one `args` names).
pub fn run(args: &ComputeBenchArgs, model: &ModelSpec) -> Result<()> {
    let config = ModelConfig::from_spec(model, args.shape.seq_len)?;
    let dataset = Dataset::shakespeare(config.seq_len, 0)?;
    let batch = dataset.micro_batch(0, args.shape.batch, loss_scale(args.shape.batch as u64, config.seq_len));
    let torch = std::env::var_os("TORCH_PYTHON").map(PathBuf::from);
    let dir = tempfile::tempdir()?;
    let inputs = dir.path().join("inputs.safetensors");
    write_torch_inputs(&inputs, &config, &batch)?;
    if torch.is_none() {
        tracing::warn!("TORCH_PYTHON is not set: medley's times only (set it to a python that imports torch)");
    }
    let device = args.device.resolve(0)?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = if args.threads.is_empty() { vec![1, cores] } else { args.threads.clone() };
    let mut rows = Vec::new();
    for &n in threads.iter().collect::<std::collections::BTreeSet<_>>() {
        let (mut medley_s, mut torch_s, mut losses) = (Vec::new(), Vec::new(), (0.0, None));
        for round in 0..args.rounds.max(1) {
            let same_batch = vec![batch.clone(); WARM_UP + args.steps];
            let medley = || medley_steps(&config, &same_batch, n, device).map(|(losses, times)| (losses[0], times));
            let pytorch = || torch.as_deref().map(|python| torch_steps(python, &inputs, n, args.steps)).transpose();
            // Alternate which goes first, so neither always runs after the other's heat.
            let (ours, theirs) = if round % 2 == 0 {
                let ours = medley()?;
                (ours, pytorch()?)
            } else {
                let theirs = pytorch()?;
                (medley()?, theirs)
            };
            losses.0 = ours.0;
            medley_s.extend(ours.1);
            if let Some(run) = theirs {
                losses.1 = Some(run.first_loss);
                torch_s.extend(run.step_s);
            }
        }
        if let Some(theirs) = losses.1
            && ((losses.0 - theirs) / theirs).abs() > LOSS_TOLERANCE
        {
            bail!(
                "first-step losses differ: medley {:.6}, PyTorch {theirs:.6} (more than {LOSS_TOLERANCE} relative): the two \
                 models are not the same, so their times do not compare",
                losses.0
            );
        }
        let medley_step_ms = median(medley_s) * 1e3;
        let torch_step_ms = (!torch_s.is_empty()).then(|| median(torch_s) * 1e3);
        rows.push(ComputeRow {
            threads: n,
            device: device.to_string(),
            medley_step_ms,
            medley_first_loss: losses.0,
            torch_step_ms,
            torch_first_loss: losses.1,
            medley_over_torch: torch_step_ms.map(|torch| medley_step_ms / torch),
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{} on {}×{} tokens: one training step (forward, cross-entropy, backward, AdamW), median of {} rounds × {} steps",
        model.name(),
        args.shape.batch,
        args.shape.seq_len,
        args.rounds,
        args.steps
    );
    let mut out =
        table(&["threads", "device", "medley ms", "PyTorch ms", "medley / PyTorch", "first loss medley", "PyTorch"]);
    for row in &rows {
        let or_dash = |value: Option<String>| value.unwrap_or_else(|| "–".into());
        out.add_row(vec![
            right(row.threads.to_string()),
            Cell::new(&row.device),
            right(format!("{:.1}", row.medley_step_ms)),
            right(or_dash(row.torch_step_ms.map(|ms| format!("{ms:.1}")))),
            right(or_dash(row.medley_over_torch.map(|ratio| format!("{ratio:.2}×")))),
            right(format!("{:.6}", row.medley_first_loss)),
            right(or_dash(row.torch_first_loss.map(|loss| format!("{loss:.6}")))),
        ]);
    }
    println!("{out}");
    Ok(())
}

/// The initial weights, the batch's tokens and the model's shape, for the PyTorch script.
fn write_torch_inputs(path: &Path, config: &ModelConfig, batch: &MicroBatch) -> Result<()> {
    let specs = stage_params(config, 0..config.n_layers);
    let params: Vec<HostTensor> = specs.iter().map(|spec| spec.initial_value(0)).collect();
    let as_floats =
        |ids: &[u32]| HostTensor::new(vec![batch.batch, batch.seq], ids.iter().map(|&t| t as f32).collect());
    let (tokens, targets) = (as_floats(&batch.tokens), as_floats(&batch.targets));
    let mut tensors: Vec<(String, &HostTensor)> = specs.iter().map(|spec| spec.name.clone()).zip(&params).collect();
    tensors.push(("tokens".into(), &tokens));
    tensors.push(("targets".into(), &targets));
    let metadata = HashMap::from([
        ("config".to_string(), serde_json::to_string(config)?),
        ("adamw".to_string(), serde_json::to_string(&AdamW::default())?),
    ]);
    Ok(save_tensors(path, &tensors, metadata)?)
}

/// One training step per batch of `batches` (the first [`WARM_UP`] untimed) on `threads` compute
/// threads: every step's loss, and the timed steps' seconds.
fn medley_steps(
    config: &ModelConfig,
    batches: &[MicroBatch],
    threads: usize,
    device: ComputeDevice,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    pool.install(|| {
        let layers = 0..config.n_layers;
        let mut stage = StageState::new(config, layers.clone(), 0, stage_compute(config, layers, device)?)?;
        let (mut losses, mut times) = (Vec::new(), Vec::new());
        for (step, batch) in batches.iter().enumerate() {
            let started = Instant::now();
            let StageOutput::Loss(loss) = stage.forward(0, batch, None)? else {
                bail!("the whole model's stage returned activations, not a loss")
            };
            stage.backward(0, None)?;
            stage.optimizer_step(&AdamW::default())?;
            losses.push(loss);
            if step >= WARM_UP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok((losses, times))
    })
}

fn torch_steps(python: &Path, inputs: &Path, threads: usize, steps: usize) -> Result<TorchRun> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/torch_step.py");
    let output = Command::new(python)
        .arg(&script)
        .arg(inputs)
        .arg(threads.to_string())
        .arg(steps.to_string())
        .output()
        .with_context(|| format!("running {} {}", python.display(), script.display()))?;
    if !output.status.success() {
        bail!("{} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    }
    serde_json::from_slice(&output.stdout).with_context(|| format!("reading {}'s output", script.display()))
}

#[derive(Args, Debug)]
pub struct DeviceBenchArgs {
    /// The device to measure: auto (a GPU when this build and machine have one), cuda, rocm or cpu.
    #[arg(long, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    #[command(flatten)]
    pub shape: TrainedShape,
    /// Training steps on each, a new batch each step (the first 2 untimed).
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Sizes of the square matrix multiplies timed on the device.
    #[arg(long, value_delimiter = ',', default_value = "4096,8192")]
    gemm_sizes: Vec<usize>,
    /// Print the rows as JSON instead of tables.
    #[arg(long)]
    json: bool,
}

/// One matrix multiply's rate on the device.
#[derive(Serialize)]
struct GemmRow {
    device: String,
    dtype: &'static str,
    n: usize,
    ms: f64,
    tflops: f64,
    /// The catalog's datasheet peak for the device's name, dense.
    datasheet_tflops: Option<f64>,
}

/// The same training on the CPU and the device.
#[derive(Serialize)]
struct AgreementRow {
    device: String,
    steps: usize,
    cpu_step_ms: f64,
    device_step_ms: f64,
    first_loss_cpu: f64,
    first_loss_device: f64,
    first_loss_relative_difference: f64,
    /// The largest relative difference between the two loss curves, step by step.
    curve_relative_difference: f64,
}

/// First-step losses must agree within this, and the curves within [`CURVE_TOLERANCE`].
const FIRST_LOSS_TOLERANCE: f64 = 1e-3;
const CURVE_TOLERANCE: f64 = 0.01;

/// `medley bench device`: the device's matmul rate against its datasheet, and the tiny model
/// trained on the CPU and on the device from the same weights and batches, losses compared step by
/// step and step times side by side.
pub fn run_device(args: &DeviceBenchArgs, model: &ModelSpec) -> Result<()> {
    let device = args.device.resolve(0)?;
    let name = medley_gpu_name(device);
    let datasheet = name.as_deref().and_then(datasheet_peaks);
    let mut gemms = Vec::new();
    for &n in &args.gemm_sizes {
        for (dtype, bf16) in [("bf16", true), ("f32", false)] {
            let seconds = matmul_seconds(device, n, bf16, 10)?;
            let peak = datasheet.map(|(bf16_peak, f32_peak)| if bf16 { bf16_peak } else { f32_peak });
            let tflops = 2.0 * (n as f64).powi(3) / seconds / 1e12;
            gemms.push(GemmRow {
                device: device.to_string(),
                dtype,
                n,
                ms: seconds * 1e3,
                tflops,
                datasheet_tflops: peak,
            });
        }
    }
    let config = ModelConfig::from_spec(model, args.shape.seq_len)?;
    let dataset = Dataset::shakespeare(config.seq_len, 0)?;
    let scale = loss_scale(args.shape.batch as u64, config.seq_len);
    let batches: Vec<MicroBatch> = (0..args.steps as u64)
        .map(|step| dataset.micro_batch(step * args.shape.batch as u64, args.shape.batch, scale))
        .collect();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let (cpu_losses, cpu_times) = medley_steps(&config, &batches, cores, ComputeDevice::Cpu)?;
    let (device_losses, device_times) = medley_steps(&config, &batches, cores, device)?;
    let relative = |a: f64, b: f64| ((a - b) / b).abs();
    let agreement = AgreementRow {
        device: device.to_string(),
        steps: args.steps,
        cpu_step_ms: median(cpu_times) * 1e3,
        device_step_ms: median(device_times) * 1e3,
        first_loss_cpu: cpu_losses[0],
        first_loss_device: device_losses[0],
        first_loss_relative_difference: relative(device_losses[0], cpu_losses[0]),
        curve_relative_difference: device_losses
            .iter()
            .zip(&cpu_losses)
            .map(|(&on_device, &on_cpu)| relative(on_device, on_cpu))
            .fold(0.0, f64::max),
    };
    if args.json {
        let rows = serde_json::json!({"gemm": gemms, "training": agreement});
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_device_tables(name.as_deref(), &gemms, &agreement, args);
    }
    if agreement.first_loss_relative_difference > FIRST_LOSS_TOLERANCE
        || agreement.curve_relative_difference > CURVE_TOLERANCE
    {
        bail!(
            "{device} does not train as the CPU does: first-step losses {:.3e} apart (at most {FIRST_LOSS_TOLERANCE:e}), \
             curves {:.2}% apart (at most {}%)",
            agreement.first_loss_relative_difference,
            agreement.curve_relative_difference * 100.0,
            CURVE_TOLERANCE * 100.0
        );
    }
    Ok(())
}

fn print_device_tables(name: Option<&str>, gemms: &[GemmRow], agreement: &AgreementRow, args: &DeviceBenchArgs) {
    println!("{}: square matrix multiplies, median of 10", name.unwrap_or("this machine's CPU"));
    let mut out = table(&["device", "dtype", "n", "ms", "TFLOP/s", "datasheet", "of peak"]);
    for row in gemms {
        let or_dash = |value: Option<String>| value.unwrap_or_else(|| "–".into());
        out.add_row(vec![
            Cell::new(&row.device),
            Cell::new(row.dtype),
            right(row.n.to_string()),
            right(format!("{:.2}", row.ms)),
            right(format!("{:.1}", row.tflops)),
            right(or_dash(row.datasheet_tflops.map(|peak| format!("{peak:.0}")))),
            right(or_dash(row.datasheet_tflops.map(|peak| format!("{:.0}%", 100.0 * row.tflops / peak)))),
        ]);
    }
    println!("{out}");
    println!(
        "{} trained {} steps on {}×{} tokens from the same weights and batches, on the CPU and on {}",
        args.shape.model, agreement.steps, args.shape.batch, args.shape.seq_len, agreement.device
    );
    let mut out = table(&["", "CPU", "device", "relative difference"]);
    out.add_row(vec![
        Cell::new("first-step loss"),
        right(format!("{:.6}", agreement.first_loss_cpu)),
        right(format!("{:.6}", agreement.first_loss_device)),
        right(format!("{:.2e}", agreement.first_loss_relative_difference)),
    ]);
    out.add_row(vec![
        Cell::new("loss curve, worst step"),
        Cell::new(""),
        Cell::new(""),
        right(format!("{:.3}%", agreement.curve_relative_difference * 100.0)),
    ]);
    out.add_row(vec![
        Cell::new("step, median ms"),
        right(format!("{:.1}", agreement.cpu_step_ms)),
        right(format!("{:.1}", agreement.device_step_ms)),
        right(format!("{:.2}× faster", agreement.cpu_step_ms / agreement.device_step_ms)),
    ]);
    println!("{out}");
}

/// The device's name as its driver reports it, for GPUs.
fn medley_gpu_name(device: ComputeDevice) -> Option<String> {
    let (vendor, index) = match device {
        ComputeDevice::Cpu => return None,
        ComputeDevice::Cuda(index) => (medley_gpu::Vendor::Nvidia, index),
        ComputeDevice::Rocm(index) => (medley_gpu::Vendor::Amd, index),
    };
    medley_gpu::Gpu::open(vendor, index).ok().map(|gpu| gpu.name().to_string())
}

/// The catalog's dense bf16 and fp32 peaks for a driver's device name ("NVIDIA H200" is `h200`);
/// none for a device without bf16.
fn datasheet_peaks(name: &str) -> Option<(f64, f64)> {
    let lower = name.to_lowercase();
    let spec = lower.split([' ', '-']).find_map(|word| medley_spec::catalog_device(word).ok())?;
    Some((spec.tensor_tflops(medley_spec::Precision::Bf16Mixed)?, spec.fp32_tflops))
}
