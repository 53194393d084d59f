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
use medley_model::{AdamW, HostTensor, MicroBatch, ModelConfig, StageOutput, StageState, save_tensors, stage_compute};
use medley_runtime::DeviceChoice;
use serde::{Deserialize, Serialize};
use statrs::statistics::{Data, OrderStatistics};

use crate::inputs::load_model;
use crate::render::{right, table};

/// Steps before timing starts (allocator, caches, lazily built kernels), as the script does.
const WARM_UP: usize = 2;

/// The first-step losses of medley and PyTorch agree within this relative difference, or the
/// comparison is refused: different numbers mean different models.
const LOSS_TOLERANCE: f64 = 1e-3;

#[derive(Args, Debug)]
pub struct ComputeBenchArgs {
    /// Model to train (a catalog name or a config.json).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Samples per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 128)]
    seq_len: u32,
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

pub fn run(args: &ComputeBenchArgs) -> Result<()> {
    let model = load_model(&args.model)?;
    let config = ModelConfig::from_spec(&model, args.seq_len)?;
    let dataset = Dataset::shakespeare(config.seq_len, 0)?;
    let batch = dataset.micro_batch(0, args.batch, loss_scale(args.batch as u64, config.seq_len));
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
            let medley = || medley_steps(&config, &batch, n, args.steps, device);
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
        args.batch,
        args.seq_len,
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

/// medley's first-step loss and its timed step times on `threads` compute threads.
fn medley_steps(
    config: &ModelConfig,
    batch: &MicroBatch,
    threads: usize,
    steps: usize,
    device: medley_model::ComputeDevice,
) -> Result<(f64, Vec<f64>)> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build()?;
    pool.install(|| {
        let layers = 0..config.n_layers;
        let compute = stage_compute(config, layers.clone(), device)?;
        let mut stage = StageState::new(config, layers, 0, compute)?;
        let (mut first_loss, mut times) = (None, Vec::new());
        for step in 0..WARM_UP + steps {
            let started = Instant::now();
            let StageOutput::Loss(loss) = stage.forward(0, batch, None)? else {
                bail!("the whole model's stage returned activations, not a loss")
            };
            stage.backward(0, None)?;
            stage.optimizer_step(&AdamW::default())?;
            first_loss.get_or_insert(loss);
            if step >= WARM_UP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok((first_loss.unwrap_or(f64::NAN), times))
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

fn median(values: Vec<f64>) -> f64 {
    Data::new(values).median()
}
