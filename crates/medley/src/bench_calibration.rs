//! `medley bench calibration`: the simulator's predictions against published, measured training
//! runs, and the efficiency factor that fits each device type's tuning runs.
//!
//! Each device type's runs are split in two: the tuning runs are the only data the default
//! efficiencies (`medley_cost::Efficiency::default_for`) were fitted on; the check runs were held
//! out and show how far the fitted model is from measurements it never saw. The fit scales the
//! matmul and attention efficiencies together by one factor (their ratio stays as stated), so that
//! the geometric mean of predicted over measured step time on the tuning runs is 1.

use std::fmt::Write as _;

use anyhow::{Context, Result};
use comfy_table::Cell;
use medley_cost::{Calibration, CostModel, Efficiency, Setting};
use medley_plan::Plan;
use medley_plan::baselines::{Degrees, megatron_plan};
use medley_sim::{SchedulePolicy, SimConfig, StepReport, simulate_steps};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, ModelSpec, Recompute, catalog_device, catalog_model};
use serde::Serialize;

use crate::render::{right, table};

/// What a source reports.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
enum Measured {
    StepS(f64),
    /// Counting recomputation, as Megatron's papers do.
    HardwareTflopsPerGpu(f64),
    /// Model FLOPs only.
    ModelTflopsPerGpu(f64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Role {
    Tune,
    Check,
}

/// One published measurement and the layout it was taken on.
struct CitedRun {
    source: &'static str,
    label: &'static str,
    /// A catalog name or a HuggingFace config.json's text.
    model: &'static str,
    cluster: &'static str,
    seq_len: u32,
    global_batch: u32,
    micro_batch: u32,
    degrees: Degrees,
    recompute: Recompute,
    zero1: bool,
    measured: Measured,
    role: Role,
}

const KORTHIKANTI: &str = "Korthikanti et al. 2022, arXiv 2205.05198, Table 4 (times via calculon's validation data)";
const NARAYANAN: &str = "Narayanan et al. 2021, arXiv 2104.04473, Table 2";
const DGXC: &str = "NVIDIA dgxc-benchmarking, NeMo 24.09, GPT-3 175B BF16 README";
const LLAMA3: &str = "Llama 3 paper, arXiv 2407.21783, Table 4";

/// Megatron's GPT-3-style models with its padded 51,200-token vocabulary.
const GPT_22B: &str = r#"{"model_type": "gpt2", "n_embd": 6144, "n_layer": 48, "n_head": 64, "vocab_size": 51200}"#;
const GPT_175B: &str = r#"{"model_type": "gpt2", "n_embd": 12288, "n_layer": 96, "n_head": 96, "vocab_size": 51200}"#;
const GPT_530B: &str = r#"{"model_type": "gpt2", "n_embd": 20480, "n_layer": 105, "n_head": 128, "vocab_size": 51200}"#;
const GPT_1T: &str = r#"{"model_type": "gpt2", "n_embd": 25600, "n_layer": 128, "n_head": 160, "vocab_size": 51200}"#;

const fn degrees(tp: u32, pp: u32, dp: u32, vpp: u32) -> Degrees {
    Degrees { tp, pp, dp, vpp }
}

/// Korthikanti et al.'s runs: one model-parallel group (dp = 1), sequence 2048; calculon's
/// validation configs give the 175B and 530B runs three virtual stages per rank.
const fn korthikanti(
    (label, model): (&'static str, &'static str),
    cluster: &'static str,
    (global_batch, micro_batch): (u32, u32),
    degrees: Degrees,
    recompute: Recompute,
    step_s: f64,
    role: Role,
) -> CitedRun {
    CitedRun {
        source: KORTHIKANTI,
        label,
        model,
        cluster,
        seq_len: 2048,
        global_batch,
        micro_batch,
        degrees,
        recompute,
        zero1: false,
        measured: Measured::StepS(step_s),
        role,
    }
}

const fn narayanan(cluster: &'static str, dp: u32, tflops: f64) -> CitedRun {
    CitedRun {
        source: NARAYANAN,
        label: "GPT-3 175B, full recompute",
        model: GPT_175B,
        cluster,
        seq_len: 2048,
        global_batch: 1536,
        micro_batch: 1,
        degrees: degrees(8, 12, dp, 1),
        recompute: Recompute::Full,
        zero1: false,
        measured: Measured::HardwareTflopsPerGpu(tflops),
        role: Role::Check,
    }
}

const fn llama3(cluster: &'static str, dp: u32, tflops: f64) -> CitedRun {
    CitedRun {
        source: LLAMA3,
        label: "Llama 3 405B, 8K sequences",
        model: "llama3-405b",
        cluster,
        seq_len: 8192,
        global_batch: 2048,
        micro_batch: 1,
        degrees: degrees(8, 16, dp, 1),
        recompute: Recompute::Selective,
        zero1: true,
        measured: Measured::ModelTflopsPerGpu(tflops),
        role: Role::Check,
    }
}

const RUNS: [CitedRun; 14] = [
    korthikanti(
        ("GPT 175B, selective", GPT_175B),
        "64xa100",
        (64, 1),
        degrees(8, 8, 1, 3),
        Recompute::Selective,
        13.75,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 175B, full", GPT_175B),
        "64xa100",
        (64, 1),
        degrees(8, 8, 1, 3),
        Recompute::Full,
        18.13,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 530B, selective", GPT_530B),
        "280xa100",
        (280, 1),
        degrees(8, 35, 1, 3),
        Recompute::Selective,
        37.83,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 530B, full", GPT_530B),
        "280xa100",
        (280, 1),
        degrees(8, 35, 1, 3),
        Recompute::Full,
        49.05,
        Role::Tune,
    ),
    korthikanti(
        ("GPT 22B, selective", GPT_22B),
        "8xa100",
        (4, 4),
        degrees(8, 1, 1, 1),
        Recompute::Selective,
        1.10,
        Role::Check,
    ),
    korthikanti(("GPT 22B, full", GPT_22B), "8xa100", (4, 4), degrees(8, 1, 1, 1), Recompute::Full, 1.42, Role::Check),
    korthikanti(
        ("GPT 1T, selective", GPT_1T),
        "512xa100",
        (512, 1),
        degrees(8, 64, 1, 1),
        Recompute::Selective,
        71.49,
        Role::Check,
    ),
    korthikanti(
        ("GPT 1T, full", GPT_1T),
        "512xa100",
        (512, 1),
        degrees(8, 64, 1, 1),
        Recompute::Full,
        94.42,
        Role::Check,
    ),
    narayanan("384xa100", 4, 153.0),
    narayanan("768xa100", 8, 149.0),
    narayanan("1536xa100", 16, 141.0),
    // NeMo's recompute and optimizer settings are not in the README; selective recompute and a
    // distributed optimizer are what fits this layout in 80 GiB.
    CitedRun {
        source: DGXC,
        label: "GPT 175B, 128 GPUs, interleaved v=12",
        model: GPT_175B,
        cluster: "128xh100",
        seq_len: 2048,
        global_batch: 256,
        micro_batch: 1,
        degrees: degrees(4, 8, 4, 12),
        recompute: Recompute::Selective,
        zero1: true,
        measured: Measured::StepS(8.309),
        role: Role::Tune,
    },
    llama3("8192xh100", 64, 430.0),
    llama3("16384xh100", 128, 400.0),
];

#[derive(Serialize)]
struct Row {
    source: &'static str,
    run: &'static str,
    cluster: &'static str,
    layout: String,
    role: Role,
    measured: Measured,
    predicted_step_s: f64,
    /// Predicted over measured step time: above 1, the model is pessimistic.
    time_ratio: f64,
}

#[derive(Serialize)]
struct Fit {
    device: String,
    /// The factor on the stated efficiencies that fits the tuning runs.
    factor: f64,
    matmul: f64,
    attention: f64,
}

impl CitedRun {
    fn plan(&self) -> Result<Plan> {
        let model = if self.model.starts_with('{') {
            ModelSpec::from_hf_config(self.model, self.label)?
        } else {
            catalog_model(self.model)?
        };
        let cluster = Cluster::from_inline(self.cluster, Fabric::default(), Bridge::default())?;
        let parts = JobParts {
            seq_len: self.seq_len,
            global_batch: self.global_batch,
            micro_batch: Some(self.micro_batch),
            zero1: self.zero1,
            ..JobParts::default()
        };
        let job = JobSpec::new(parts, self.source)?;
        let calibration = Calibration::default();
        let cost = CostModel::new(&model, self.seq_len, &calibration);
        let setting = Setting { micro_batch: self.micro_batch, tp: self.degrees.tp, recompute: self.recompute };
        megatron_plan(&cluster, &cost, &job, setting, self.degrees)
            .with_context(|| format!("{}: {}", self.source, self.label))
    }

    /// Predicted over measured step time.
    fn time_ratio(&self, report: &StepReport) -> f64 {
        match self.measured {
            Measured::StepS(step_s) => report.step_time_s / step_s,
            Measured::HardwareTflopsPerGpu(tflops) => tflops / report.utilisation.hardware_tflops_per_gpu,
            Measured::ModelTflopsPerGpu(tflops) => tflops / report.utilisation.model_tflops_per_gpu,
        }
    }

    fn device(&self, plan: &Plan) -> String {
        plan.cluster().groups()[0].device.name.clone()
    }
}

fn simulate_one(plan: &Plan, calibration: &Calibration) -> Result<StepReport> {
    let policy = SchedulePolicy::from(plan.schedule());
    Ok(simulate_steps(plan, calibration, &SimConfig::default(), policy, 1, None)?.last_step)
}

/// A calibration that scales `device`'s stated matmul and attention efficiencies by `factor`.
fn scaled(device: &str, factor: f64) -> Result<(Calibration, Efficiency)> {
    let stated = Efficiency::default_for(&catalog_device(device)?);
    let efficiency = Efficiency {
        matmul: (stated.matmul * factor).min(1.0),
        attention: (stated.attention * factor).min(1.0),
        memory: stated.memory,
    };
    let text = format!(
        "[device.\"{device}\"]\nmatmul = {}\nattention = {}\nmemory = {}\n",
        efficiency.matmul, efficiency.attention, efficiency.memory
    );
    Ok((Calibration::from_toml(&text, "fit")?, efficiency))
}

/// The factor whose tuning runs' geometric-mean time ratio is 1, by bisection (the ratio falls
/// as the factor grows).
fn fit(device: &str, plans: &[(&CitedRun, Plan)]) -> Result<Fit> {
    let log_ratio = |factor: f64| -> Result<f64> {
        let (calibration, _) = scaled(device, factor)?;
        let mut sum = 0.0;
        for (run, plan) in plans {
            sum += run.time_ratio(&simulate_one(plan, &calibration)?).ln();
        }
        Ok(sum / plans.len() as f64)
    };
    let (mut low, mut high) = (0.3, 1.5);
    for _ in 0..30 {
        let middle = 0.5 * (low + high);
        if log_ratio(middle)? > 0.0 { low = middle } else { high = middle }
    }
    let factor = 0.5 * (low + high);
    let (_, efficiency) = scaled(device, factor)?;
    Ok(Fit { device: device.to_string(), factor, matmul: efficiency.matmul, attention: efficiency.attention })
}

pub fn bench_calibration(json: bool) -> Result<()> {
    let calibration = Calibration::default();
    let plans: Vec<(&CitedRun, Plan)> = RUNS.iter().map(|run| Ok((run, run.plan()?))).collect::<Result<_>>()?;
    let mut rows = Vec::new();
    for (run, plan) in &plans {
        let report = simulate_one(plan, &calibration)?;
        let time_ratio = run.time_ratio(&report);
        rows.push(Row {
            source: run.source,
            run: run.label,
            cluster: run.cluster,
            layout: format!("{}, {}", run.degrees, plan.recompute()),
            role: run.role,
            measured: run.measured,
            predicted_step_s: report.step_time_s,
            time_ratio,
        });
    }
    let mut devices: Vec<String> = plans.iter().map(|(run, plan)| run.device(plan)).collect();
    devices.dedup();
    let fits: Vec<Fit> = devices
        .iter()
        .map(|device| {
            let tuning: Vec<(&CitedRun, Plan)> = plans
                .iter()
                .filter(|(run, plan)| run.role == Role::Tune && &run.device(plan) == device)
                .map(|(run, plan)| (*run, plan.clone()))
                .collect();
            fit(device, &tuning)
        })
        .collect::<Result<_>>()?;
    if json {
        #[derive(Serialize)]
        struct Out<'a> {
            runs: &'a [Row],
            fits: &'a [Fit],
        }
        println!("{}", serde_json::to_string_pretty(&Out { runs: &rows, fits: &fits })?);
        return Ok(());
    }
    println!("{}", text(&rows, &fits));
    Ok(())
}

fn text(rows: &[Row], fits: &[Fit]) -> String {
    let mut out = String::from(
        "Simulated steps against published measurements, with the default efficiencies\n\
         (time ratio = predicted / measured step time; above 1 the model is pessimistic)\n",
    );
    let mut runs = table(&["run", "cluster", "layout", "role", "measured", "predicted step", "time ratio"]);
    for row in rows {
        let measured = match row.measured {
            Measured::StepS(step_s) => format!("{step_s:.2} s"),
            Measured::HardwareTflopsPerGpu(tflops) => format!("{tflops:.0} TFLOP/s (hw)"),
            Measured::ModelTflopsPerGpu(tflops) => format!("{tflops:.0} TFLOP/s (model)"),
        };
        runs.add_row(vec![
            Cell::new(row.run),
            Cell::new(row.cluster),
            Cell::new(&row.layout),
            Cell::new(format!("{:?}", row.role).to_lowercase()),
            right(measured),
            right(format!("{:.2} s", row.predicted_step_s)),
            right(format!("{:.2}", row.time_ratio)),
        ]);
    }
    out += &runs.to_string();
    for role in [Role::Tune, Role::Check] {
        let ratios: Vec<f64> = rows.iter().filter(|row| row.role == role).map(|row| row.time_ratio).collect();
        let geomean = (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp();
        let worst = ratios.iter().map(|r| (r.ln()).abs()).fold(0.0, f64::max).exp();
        let _ = write!(
            out,
            "\n{role:?} runs: geometric-mean time ratio {geomean:.3}, worst off by {:.1}%",
            100.0 * (worst - 1.0)
        );
    }
    out += "\n\nFits on the tuning runs (one factor on the stated matmul and attention efficiencies)\n";
    let mut fitted = table(&["device", "factor", "matmul", "attention"]);
    for fit in fits {
        fitted.add_row(vec![
            Cell::new(&fit.device),
            right(format!("{:.3}", fit.factor)),
            right(format!("{:.3}", fit.matmul)),
            right(format!("{:.3}", fit.attention)),
        ]);
    }
    out += &fitted.to_string();
    out += "\nSources:\n";
    for source in [KORTHIKANTI, NARAYANAN, DGXC, LLAMA3] {
        let _ = writeln!(out, "  {source}");
    }
    out
}
