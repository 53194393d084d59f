//! Tables and JSON for people and scripts.

use std::fmt::Write;

use comfy_table::presets::UTF8_BORDERS_ONLY;
use comfy_table::{Cell, CellAlignment, Table};
use medley_cost::params::total_params;
use medley_plan::{Algorithm, Candidate, Plan, Route};
use serde_json::{Value, json};

use crate::inputs::Specs;
use crate::plan_cmd::Confirmed;

/// A baseline layout, absent when it does not fit.
pub struct Baseline {
    pub name: String,
    /// Which device type, for the best homogeneous baseline.
    pub detail: Option<String>,
    pub candidate: Option<Candidate>,
}

pub struct Report<'a> {
    pub specs: &'a Specs,
    pub candidates: &'a [Candidate],
    pub confirmed: &'a Confirmed,
    pub baselines: &'a [Baseline],
    /// Layouts the search priced, when it searched.
    pub layouts_priced: Option<usize>,
    pub search_s: f64,
}

pub fn json(report: &Report) -> Value {
    let best = &report.candidates[0];
    let baselines: Vec<Value> = report
        .baselines
        .iter()
        .map(|baseline| match &baseline.candidate {
            Some(candidate) => json!({
                "name": baseline.name,
                "device": baseline.detail,
                "fits": true,
                "step_time_s": candidate.prediction.step_time_s,
                "tokens_per_s": candidate.prediction.utilisation.tokens_per_s,
                "mfu": candidate.prediction.utilisation.mfu,
            }),
            None => json!({
                "name": baseline.name, "device": null, "fits": false,
                "step_time_s": null, "tokens_per_s": null, "mfu": null,
            }),
        })
        .collect();
    let simulated = &report.confirmed.simulated[0];
    json!({
        "plan": best.plan,
        "prediction": best.prediction,
        "simulated": {
            "step_time_s": simulated.step_time_s,
            "tokens_per_s": simulated.utilisation.tokens_per_s,
            "mfu": simulated.utilisation.mfu,
            "bubble_fraction": simulated.bubble_fraction,
            "peak_memory_gib": simulated.peak_memory_gib,
            "fits": simulated.fits,
            "cost_model_rank": report.confirmed.analytical_rank[0] + 1,
        },
        "baselines": baselines,
    })
}

pub fn text(report: &Report) -> String {
    let mut out = String::new();
    let specs = report.specs;
    let best = &report.candidates[0];
    let _ = writeln!(out, "{}", headline(specs));
    if let Some(priced) = report.layouts_priced {
        let _ = writeln!(out, "priced {priced} pipelines and layouts in {:.2} s\n", report.search_s);
    }
    out += &candidates_table(report.candidates, report.confirmed).to_string();
    out += &agreement(report.confirmed);
    out += "\n\nBaselines (same cost model)\n";
    out += &baselines_table(best, report.baselines).to_string();
    out += "\n\nPeak memory of the best plan\n";
    out += &memory_table(best).to_string();
    out += "\n\nThe best plan\n";
    out += &explain(&best.plan);
    out
}

fn headline(specs: &Specs) -> String {
    let groups: Vec<String> =
        specs.cluster.groups().iter().map(|group| format!("{}×{}", group.n_gpus(), group.device.name)).collect();
    let job = &specs.job;
    format!(
        "medley plan: {} ({:.1}B parameters) on {} GPUs ({})\njob: {} tokens × {} sequences = {:.2}M tokens per step, schedule {}, ZeRO-1 {}",
        specs.model.name(),
        total_params(&specs.model) as f64 / 1e9,
        specs.cluster.n_gpus(),
        groups.join(", "),
        job.seq_len(),
        job.global_batch(),
        job.tokens_per_step() as f64 / 1e6,
        job.schedule(),
        if job.zero1() { "on" } else { "off" },
    )
}

pub(crate) fn table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header(header.iter().map(Cell::new));
    table
}

pub(crate) fn right(text: impl ToString) -> Cell {
    Cell::new(text.to_string()).set_alignment(CellAlignment::Right)
}

/// Whether the simulator confirms the cost model's ranking, and how far apart their times are.
fn agreement(confirmed: &Confirmed) -> String {
    let worst_gap = confirmed
        .candidates
        .iter()
        .zip(&confirmed.simulated)
        .map(|(candidate, simulated)| simulated.step_time_s / candidate.prediction.step_time_s - 1.0)
        .fold(0.0, |worst: f64, gap| if gap.abs() > worst.abs() { gap } else { worst });
    let ranking = match confirmed.analytical_rank.iter().position(|&rank| rank == 0) {
        Some(0) | None => "the simulator confirms the cost model's first choice".to_string(),
        Some(position) => format!(
            "the simulator disagrees: the cost model's first choice is #{} when simulated; #1 above was its #{}",
            position + 1,
            confirmed.analytical_rank[0] + 1
        ),
    };
    format!("\n{ranking}; simulated step times differ from the cost model's by up to {:+.1}%\n", 100.0 * worst_gap)
}

fn candidates_table(candidates: &[Candidate], confirmed: &Confirmed) -> Table {
    let mut table = table(&[
        "#",
        "simulated s",
        "model s",
        "tokens/s",
        "MFU",
        "HFU",
        "GPUs",
        "tp",
        "mb",
        "recompute",
        "replicas",
        "pipeline (stages of type)",
    ]);
    for (rank, (candidate, simulated)) in candidates.iter().zip(&confirmed.simulated).enumerate() {
        let (plan, prediction) = (&candidate.plan, &candidate.prediction);
        table.add_row(vec![
            right(rank + 1),
            right(format!("{:.3}", simulated.step_time_s)),
            right(format!("{:.3}", prediction.step_time_s)),
            right(format!("{:.0}", prediction.utilisation.tokens_per_s)),
            right(percent(prediction.utilisation.mfu)),
            right(percent(prediction.utilisation.hfu)),
            right(prediction.n_gpus_used),
            right(plan.tp),
            right(plan.micro_batch),
            Cell::new(plan.recompute),
            right(plan.replicas.len()),
            Cell::new(pipeline_summary(plan)),
        ]);
    }
    table
}

fn baselines_table(best: &Candidate, baselines: &[Baseline]) -> Table {
    let mut table = table(&["baseline", "fits", "step s", "tokens/s", "MFU", "best plan's speedup"]);
    for baseline in baselines {
        let name = match &baseline.detail {
            Some(detail) => format!("{} ({detail})", baseline.name),
            None => baseline.name.clone(),
        };
        match &baseline.candidate {
            Some(candidate) => {
                let prediction = &candidate.prediction;
                table.add_row(vec![
                    Cell::new(name),
                    Cell::new("yes"),
                    right(format!("{:.3}", prediction.step_time_s)),
                    right(format!("{:.0}", prediction.utilisation.tokens_per_s)),
                    right(percent(prediction.utilisation.mfu)),
                    right(times(prediction.step_time_s / best.prediction.step_time_s)),
                ]);
            }
            None => {
                table.add_row(vec![Cell::new(name), Cell::new("no"), right("-"), right("-"), right("-"), right("-")]);
            }
        }
    }
    table
}

fn memory_table(best: &Candidate) -> Table {
    let mut table = table(&["device type", "peak GiB", "capacity GiB", "used"]);
    for (name, peak) in &best.prediction.peak_memory_gib {
        let capacity = best.prediction.capacity_gib[name];
        table.add_row(vec![
            Cell::new(name),
            right(format!("{peak:.1}")),
            right(format!("{capacity:.0}")),
            right(percent(peak / capacity)),
        ]);
    }
    table
}

/// `1 step`, `3 steps`, `2 micro-batches`: a count with its noun in the right number.
pub(crate) fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        return format!("1 {noun}");
    }
    let suffix = if ["s", "x", "ch", "sh"].iter().any(|end| noun.ends_with(end)) { "es" } else { "s" };
    format!("{n} {noun}{suffix}")
}

pub(crate) fn percent(fraction: f64) -> String {
    format!("{:.1}%", 100.0 * fraction)
}

/// `1.25×`: how many times one quantity is another.
pub(crate) fn times(ratio: f64) -> String {
    format!("{ratio:.2}×")
}

/// `8× [H100-SXM:2, A100-80GB:4]`-style summary of the replica shapes: pipeline ranks per
/// device type (with ` ×2 chunks` when ranks hold several virtual stages).
fn pipeline_summary(plan: &Plan) -> String {
    let chunks = if plan.virtual_stages > 1 { format!(" ×{} chunks", plan.virtual_stages) } else { String::new() };
    plan.replica_shapes()
        .iter()
        .map(|shape| {
            let mut runs: Vec<(String, u32)> = Vec::new();
            let n_ranks = shape.stages.len() / plan.virtual_stages as usize;
            for (device, _) in &shape.stages[..n_ranks] {
                match runs.last_mut() {
                    Some((last, count)) if last == device => *count += 1,
                    _ => runs.push((device.clone(), 1)),
                }
            }
            let stages: Vec<String> = runs.iter().map(|(device, count)| format!("{device}:{count}")).collect();
            format!("{}× [{}]{chunks}", shape.n_replicas, stages.join(" → "))
        })
        .collect::<Vec<_>>()
        .join(" + ")
}

/// A short account of the layout: replica shapes, layer splits, batch shares, routes.
pub fn explain(plan: &Plan) -> String {
    let mut out = String::new();
    for shape in plan.replica_shapes() {
        let layers: Vec<String> = shape.stages.iter().map(|(device, layers)| format!("{device}:{layers}")).collect();
        let shares: Vec<String> = shape.micro_batches.iter().map(u32::to_string).collect();
        let _ = writeln!(
            out,
            "- {} replica(s), {} {}stages each (layers per stage: {}), {} micro-batches of {} each",
            shape.n_replicas,
            shape.stages.len(),
            if plan.virtual_stages > 1 { "virtual " } else { "" },
            layers.join(" "),
            shares.join("/"),
            plan.micro_batch,
        );
    }
    let boundaries: Vec<Route> = plan.replicas.iter().flat_map(|replica| replica.boundaries.iter().copied()).collect();
    let bridged = boundaries.iter().filter(|route| matches!(route, Route::Bridge { .. })).count();
    let _ = writeln!(
        out,
        "- tensor parallelism {} inside each node; {} pipeline boundaries, {bridged} of them across vendors{}",
        plan.tp,
        boundaries.len(),
        first_bridge(&boundaries).map(|route| format!(" over {route}")).unwrap_or_default()
    );
    let bridged_groups: Vec<_> =
        plan.dp_groups.iter().filter(|group| matches!(group.route, Route::Bridge { .. })).collect();
    if plan.replicas.len() > 1 {
        let hierarchical = bridged_groups.iter().filter(|group| group.algorithm == Algorithm::Hierarchical).count();
        let _ = writeln!(
            out,
            "- gradients: {} data-parallel groups over {} replicas, {} native, {} across vendors ({hierarchical} hierarchical)",
            plan.dp_groups.len(),
            plan.replicas.len(),
            plan.dp_groups.len() - bridged_groups.len(),
            bridged_groups.len(),
        );
    }
    let idle = plan.idle_devices();
    if !idle.is_empty() {
        let _ = writeln!(out, "- {} devices idle", idle.len());
    }
    out
}

fn first_bridge(routes: &[Route]) -> Option<Route> {
    routes.iter().copied().find(|route| matches!(route, Route::Bridge { .. }))
}
