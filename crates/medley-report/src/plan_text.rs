//! `medley plan`'s result for people (tables and an account of the layout) and for scripts
//! (JSON): the ranked plans, how the simulator ranks them, the baselines and the memory.

use std::fmt::Write;

use comfy_table::{Cell, Table};
use medley_cost::memory::usable;
use medley_cost::params::total_params;
use medley_plan::baselines::NamedBaseline;
use medley_plan::{Candidate, GradientAlgorithm, Plan, Route};
use medley_sim::rank::{Ranked, SIMULATE_UP_TO_GPUS, SIMULATE_UP_TO_PASSES};
use serde_json::{Value, json};

use medley_spec::{Cluster, JobSpec, ModelSpec};

use crate::text::{count, count_words, percent, quantity, right, seconds, table, times};

/// What `medley plan` found, for one of its plans.
pub struct PlanReport<'a> {
    pub cluster: &'a Cluster,
    pub model: &'a ModelSpec,
    pub job: &'a JobSpec,
    pub candidates: &'a [Candidate],
    /// The candidate the report describes in full (`--pick`, 0 = the best).
    pub picked: usize,
    pub confirmed: &'a Ranked,
    pub baselines: &'a [NamedBaseline],
    /// Layouts the search priced, when it searched.
    pub layouts_priced: Option<usize>,
    pub search_s: f64,
}

/// The picked plan, its prediction and simulation, and the baselines, as one JSON object.
pub fn json(report: &PlanReport) -> Value {
    let best = &report.candidates[report.picked];
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
    let simulated = report.confirmed.simulated[report.picked].as_ref().map(|simulated| {
        json!({
            "step_time_s": simulated.step_time_s,
            "tokens_per_s": simulated.utilisation.tokens_per_s,
            "mfu": simulated.utilisation.mfu,
            "bubble_fraction": simulated.bubble_fraction,
            "peak_memory_gib": simulated.peak_memory_gib,
            "fits": simulated.fits,
            "cost_model_rank": report.confirmed.analytical_rank[report.picked] + 1,
        })
    });
    json!({
        "rank": report.picked + 1,
        "plan": best.plan,
        "prediction": best.prediction,
        "simulated": simulated,
        "baselines": baselines,
    })
}

/// Every table of the report and the account of the picked plan.
pub fn text(report: &PlanReport) -> String {
    let mut out = String::new();
    let best = &report.candidates[report.picked];
    let which = if report.picked == 0 { "the best plan".to_string() } else { format!("plan #{}", report.picked + 1) };
    let _ = writeln!(out, "{}", headline(report));
    if let Some(priced) = report.layouts_priced {
        let _ = writeln!(out, "priced {priced} pipelines and layouts in {:.2} s\n", report.search_s);
    }
    out += &candidates_table(report.candidates, report.confirmed).to_string();
    out += &agreement(report.confirmed);
    out += "\n\nBaselines (same cost model)\n";
    out += &baselines_table(best, &which, report.baselines).to_string();
    out += &format!(
        "\n\nPeak memory of {which}, {} of each device's memory left free (--memory-headroom)\n",
        percent(best.plan.memory_headroom())
    );
    out += &memory_table(best).to_string();
    out += &format!("\n\n{}{}\n", which[..1].to_uppercase(), &which[1..]);
    out += &explain(&best.plan);
    out
}

fn headline(report: &PlanReport) -> String {
    format!(
        "medley plan: {} on {}\njob: {}",
        model_summary(report.model),
        cluster_summary(report.cluster),
        job_summary(report.job)
    )
}

/// `llama3-70b (70.6B parameters)`.
pub fn model_summary(model: &ModelSpec) -> String {
    format!("{} ({} parameters)", model.name(), quantity(total_params(model) as f64))
}

/// `224 GPUs (64×H100-SXM, 128×A100-80GB, 32×MI300X)`.
pub fn cluster_summary(cluster: &Cluster) -> String {
    let groups: Vec<String> =
        cluster.groups().iter().map(|group| format!("{}×{}", group.n_gpus(), group.device.name)).collect();
    format!("{} ({})", count(cluster.n_gpus() as usize, "GPU"), groups.join(", "))
}

/// `4096 tokens × 1,024 sequences = 4.19M tokens per step, bf16-mixed (gradients reduced in fp32),
/// schedule 1f1b, ZeRO-1 on`.
pub fn job_summary(job: &JobSpec) -> String {
    let sharding = match (job.zero1(), job.shard_gradients()) {
        (_, true) => "ZeRO-2 on (optimizer states and gradients sharded)",
        (true, false) => "ZeRO-1 on",
        (false, false) => "ZeRO-1 off",
    };
    format!(
        "{} tokens × {} = {} tokens per step, {} (gradients reduced in {}), schedule {}, {sharding}",
        job.seq_len(),
        count(job.global_batch() as usize, "sequence"),
        quantity(job.tokens_per_step() as f64),
        job.precision(),
        job.grad_reduce(),
        job.schedule(),
    )
}

/// Whether the simulator confirms the cost model's ranking, and how far apart their times are.
fn agreement(confirmed: &Ranked) -> String {
    let gaps: Vec<f64> = confirmed
        .candidates
        .iter()
        .zip(&confirmed.simulated)
        .filter_map(|(candidate, simulated)| {
            simulated.as_ref().map(|simulated| simulated.step_time_s / candidate.prediction.step_time_s - 1.0)
        })
        .collect();
    let unsimulated = confirmed.simulated.len() - gaps.len();
    let skipped = match unsimulated {
        0 => String::new(),
        n => format!(
            "; {} on more than {} GPUs or of more than {} passes a step ranked by the cost model alone, not \
             simulated (a step of such a plan takes the simulator seconds: `medley simulate --plan` runs one)",
            count(n, "plan"),
            SIMULATE_UP_TO_GPUS,
            SIMULATE_UP_TO_PASSES
        ),
    };
    if gaps.is_empty() {
        return format!("\nthe cost model's ranking{skipped}\n");
    }
    let worst_gap = gaps.into_iter().fold(0.0, |worst: f64, gap| if gap.abs() > worst.abs() { gap } else { worst });
    let ranking = match confirmed.analytical_rank.iter().position(|&rank| rank == 0) {
        Some(0) | None => "the simulator confirms the cost model's first choice".to_string(),
        Some(position) => format!(
            "the simulator disagrees: the cost model's first choice is #{} when simulated; #1 above was its #{}",
            position + 1,
            confirmed.analytical_rank[0] + 1
        ),
    };
    format!(
        "\n{ranking}; simulated step times differ from the cost model's by up to {:+.1}%{skipped}\n",
        100.0 * worst_gap
    )
}

/// The ranked candidates: simulated step time with the throughput and utilisation of that same
/// simulation, then the cost model's step time; a column tells apart plans that look alike.
fn candidates_table(candidates: &[Candidate], confirmed: &Ranked) -> Table {
    let details = look_alike_details(candidates);
    let mut header = vec![
        "#",
        "simulated",
        "tokens/s",
        "MFU",
        "HFU",
        "cost model",
        "GPUs",
        "tp",
        "mb",
        "recompute",
        "replicas",
        "pipeline (stages of type)",
    ];
    if details.is_some() {
        header.push("differs in");
    }
    let mut table = table(&header);
    for (rank, (candidate, simulated)) in candidates.iter().zip(&confirmed.simulated).enumerate() {
        let plan = &candidate.plan;
        // Unsimulated: the cost model's throughput and utilisation.
        let (step, utilisation) = match simulated {
            Some(simulated) => (seconds(simulated.step_time_s), &simulated.utilisation),
            None => ("not simulated".to_string(), &candidate.prediction.utilisation),
        };
        let mut row = vec![
            right(rank + 1),
            right(step),
            right(format!("{:.0}", utilisation.tokens_per_s)),
            right(percent(utilisation.mfu)),
            right(percent(utilisation.hfu)),
            right(seconds(candidate.prediction.step_time_s)),
            right(candidate.prediction.n_gpus_used),
            right(plan.tp_label()),
            right(plan.micro_batch()),
            Cell::new(plan.recompute()),
            right(plan.replicas().len()),
            Cell::new(pipeline_summary(plan)),
        ];
        if let Some(details) = &details {
            row.push(Cell::new(&details[rank]));
        }
        table.add_row(row);
    }
    table
}

/// The columns of the candidates table a plan is told apart by.
fn summary_columns(plan: &Plan) -> (String, u32, String, usize, String) {
    (plan.tp_label(), plan.micro_batch(), plan.recompute().to_string(), plan.replicas().len(), pipeline_summary(plan))
}

/// For candidates whose table columns coincide with another's, what differs between them: their
/// layers per stage, batch shares, schedule or devices; `None` when every row is told apart.
fn look_alike_details(candidates: &[Candidate]) -> Option<Vec<String>> {
    let columns: Vec<_> = candidates.iter().map(|candidate| summary_columns(&candidate.plan)).collect();
    let alike: Vec<Vec<usize>> = (0..columns.len())
        .map(|idx| (0..columns.len()).filter(|&other| other != idx && columns[other] == columns[idx]).collect())
        .collect();
    if alike.iter().all(Vec::is_empty) {
        return None;
    }
    let aspects = |plan: &Plan| -> [(&'static str, String); 4] {
        let shapes = plan.replica_shapes();
        let layers: Vec<String> = shapes
            .iter()
            .map(|shape| shape.stages.iter().map(|(_, layers)| layers.to_string()).collect::<Vec<_>>().join("/"))
            .collect();
        let shares: Vec<String> = shapes
            .iter()
            .map(|shape| shape.micro_batches.iter().map(u32::to_string).collect::<Vec<_>>().join("/"))
            .collect();
        // Where the first replica's pipeline ranks sit tells the placements apart.
        let first = &plan.replicas()[0];
        let ranks = &first.stages[..plan.n_ranks(first)];
        let devices: Vec<String> = ranks.iter().map(|stage| stage.devices[0].to_string()).collect();
        [
            ("layers", layers.join(" + ")),
            ("micro-batches", shares.join(" + ")),
            ("schedule", plan.schedule().to_string()),
            ("replica 1 on devices", devices.join(",")),
        ]
    };
    let described: Vec<_> = candidates.iter().map(|candidate| aspects(&candidate.plan)).collect();
    let details = (0..candidates.len())
        .map(|idx| {
            let differing: Vec<String> = (0..4)
                .filter(|&aspect| {
                    alike[idx].iter().any(|&other| described[other][aspect].1 != described[idx][aspect].1)
                })
                .map(|aspect| format!("{} {}", described[idx][aspect].0, described[idx][aspect].1))
                .collect();
            differing.join("; ")
        })
        .collect();
    Some(details)
}

fn baselines_table(best: &Candidate, which: &str, baselines: &[NamedBaseline]) -> Table {
    let speedup = format!("{which}'s speedup");
    let mut table = table(&["baseline", "fits", "step time", "tokens/s", "MFU", &speedup]);
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
                    right(seconds(prediction.step_time_s)),
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
    let mut table = table(&["device type", "peak GiB", "usable GiB", "capacity GiB", "used"]);
    for (name, peak) in &best.prediction.peak_memory_by_device_gib {
        let capacity = best.prediction.capacity_gib[name];
        table.add_row(vec![
            Cell::new(name),
            right(format!("{peak:.1}")),
            right(format!("{:.1}", usable(capacity, best.plan.memory_headroom()))),
            right(format!("{capacity:.0}")),
            right(percent(peak / capacity)),
        ]);
    }
    table
}

/// `8× [H100-SXM:2, A100-80GB:4]`-style summary of the replica shapes: pipeline ranks per
/// device type (with ` ×2 chunks` when ranks hold several virtual stages).
pub fn pipeline_summary(plan: &Plan) -> String {
    let chunks = if plan.virtual_stages() > 1 { format!(" ×{} chunks", plan.virtual_stages()) } else { String::new() };
    plan.replica_shapes()
        .iter()
        .map(|shape| {
            let mut runs: Vec<(String, u32)> = Vec::new();
            let n_ranks = shape.stages.len() / plan.virtual_stages() as usize;
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
        let stages = if plan.virtual_stages() > 1 { "virtual stage" } else { "stage" };
        let _ = writeln!(
            out,
            "- {}, {} each (layers per stage: {}), {} of {} each",
            count(shape.n_replicas as usize, "replica"),
            count(shape.stages.len(), stages),
            layers.join(" "),
            count_words(&shares.join("/"), shape.micro_batches.iter().sum::<u32>() as usize, "micro-batch"),
            count(plan.micro_batch() as usize, "sequence"),
        );
    }
    out += &explain_context(plan);
    let boundaries: Vec<Route> =
        plan.replicas().iter().flat_map(|replica| replica.boundaries.iter().copied()).collect();
    let bridged = boundaries.iter().filter(|route| matches!(route, Route::Bridge { .. })).count();
    let _ = writeln!(
        out,
        "- tensor parallelism {} inside each node{}; {}, {bridged} of them across vendors{}",
        plan.tp_label(),
        if plan.uniform_tp().is_some() { "" } else { " (each stage its own)" },
        count(boundaries.len(), "pipeline boundary"),
        first_bridge(&boundaries).map(|route| format!(" over {route}")).unwrap_or_default()
    );
    let bridged_groups: Vec<_> =
        plan.dp_groups().iter().filter(|group| matches!(group.route, Route::Bridge { .. })).collect();
    if plan.replicas().len() > 1 {
        let hierarchical =
            bridged_groups.iter().filter(|group| group.algorithm == GradientAlgorithm::Hierarchical).count();
        let _ = writeln!(
            out,
            "- gradients: {} over {}, {} native, {} across vendors ({hierarchical} hierarchical)",
            count(plan.dp_groups().len(), "data-parallel group"),
            count(plan.replicas().len(), "replica"),
            plan.dp_groups().len() - bridged_groups.len(),
            bridged_groups.len(),
        );
    }
    let idle = plan.idle_devices();
    if !idle.is_empty() {
        let _ = writeln!(out, "- {} idle", count(idle.len(), "device"));
    }
    out
}

/// How the long-context stages split each sequence: per stage that splits them differently from
/// those before, per device type, its groups' shards, its devices' tokens and heads.
fn explain_context(plan: &Plan) -> String {
    let mut out = String::new();
    let mut seen: Vec<String> = Vec::new();
    for stage in plan.replicas().iter().flat_map(|replica| &replica.stages) {
        let Some(context) = &stage.context else { continue };
        let text = explain_stage_context(plan, stage, context);
        if !seen.contains(&text) {
            out.push_str(&text);
            seen.push(text);
        }
    }
    out
}

fn explain_stage_context(plan: &Plan, stage: &medley_plan::Stage, context: &medley_plan::StageContext) -> String {
    let mut out = format!(
        "- each sequence split over {} ({:?} exchange of keys and values, {}-token blocks, head–tail shards):\n",
        count(context.groups.len(), "head-parallel group"),
        context.kv_exchange,
        context.block
    );
    let mut kinds: Vec<(String, Vec<&medley_plan::HeadGroup>)> = Vec::new();
    for (idx, group) in context.groups.iter().enumerate() {
        let name = plan.device_group(context.group_devices(&stage.devices, idx)[0]).device.name.clone();
        match kinds.iter_mut().find(|(kind, _)| *kind == name) {
            Some((_, groups)) => groups.push(group),
            None => kinds.push((name, vec![group])),
        }
    }
    for (name, groups) in kinds {
        let range = |values: Vec<u32>| {
            let (low, high) = (values.iter().min().copied().unwrap_or(0), values.iter().max().copied().unwrap_or(0));
            if low == high { low.to_string() } else { format!("{low}–{high}") }
        };
        let shards = range(groups.iter().map(|group| group.tokens).collect());
        let tokens = range(groups.iter().flat_map(|group| group.device_tokens.iter().copied()).collect());
        let heads = range(groups.iter().flat_map(|group| group.heads.iter().copied()).collect());
        let sizes: Vec<u32> = groups.iter().map(|group| group.device_tokens.len() as u32).collect();
        let devices = match sizes.iter().all(|&size| size == 1) {
            true => "1 device".to_string(),
            false => format!("{} devices", range(sizes)),
        };
        let _ = writeln!(
            out,
            "  - {name}: {} of {devices}, {shards} tokens each; {tokens} tokens and {heads} query heads per device",
            count(groups.len(), "group"),
        );
    }
    out
}

fn first_bridge(routes: &[Route]) -> Option<Route> {
    routes.iter().copied().find(|route| matches!(route, Route::Bridge { .. }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_the_right_number() {
        assert_eq!(
            [count(1, "stage"), count(3, "stage"), count(2, "micro-batch"), count(4, "pipeline boundary")],
            ["1 stage", "3 stages", "2 micro-batches", "4 pipeline boundaries"]
        );
        assert_eq!(
            [count(0, "replica"), count(2, "day"), count_words("8/4", 12, "micro-batch")],
            ["0 replicas", "2 days", "8/4 micro-batches"]
        );
    }

    #[test]
    fn figures_read_at_every_scale() {
        assert_eq!(
            [seconds(48.16), seconds(1.2344), seconds(0.0123), seconds(4.56e-5)],
            ["48.2 s", "1.234 s", "12.3 ms", "45.6 µs"]
        );
        assert_eq!(
            [quantity(70.56e9), quantity(1.617e6), quantity(2048.0), quantity(512.0)],
            ["70.6B", "1.62M", "2,048", "512"]
        );
    }
}
