//! `medley simulate`'s result for people (tables) and for scripts (JSON).

use comfy_table::Cell;
use medley_plan::Plan;
use medley_sim::RunReport;

use crate::text::{count, percent, right, seconds, table};

/// The last step's report with the run's means and every step, as one JSON object.
pub fn json(report: &RunReport) -> serde_json::Value {
    let mut object = serde_json::to_value(&report.last_step).expect("a report serialises");
    object["step_time_s"] = report.mean_step_time_s.into();
    object["tokens_per_s"] = report.tokens_per_s.into();
    object["fits"] = report.fits.into();
    object["steps"] = serde_json::to_value(&report.steps).expect("steps serialise");
    object
}

/// The run's tables: the summary, each step when there are several, and where the time went.
pub fn text(cluster_gpus: u32, plan: &Plan, report: &RunReport) -> String {
    let last = &report.last_step;
    let stages: Vec<usize> = plan.replicas().iter().map(|replica| replica.stages.len()).collect();
    let (fewest, most) = (stages.iter().min().copied().unwrap_or(0), stages.iter().max().copied().unwrap_or(0));
    let stages = match fewest == most {
        true => count(most, "stage"),
        false => format!("{fewest} to {most} stages"),
    };
    let mut out = format!(
        "medley simulate: {} on {} of {} GPUs, {} × {stages}, tp={}, {} per step\n\n",
        plan.model().name(),
        plan.used_devices().len(),
        cluster_gpus,
        count(plan.replicas().len(), "replica"),
        plan.tp_label(),
        count(plan.n_micro_batches() as usize, "micro-batch"),
    );
    let mut summary = table(&["step time", "tokens/s", "model TFLOP/s/GPU", "MFU", "HFU", "bubble", "comm wait"]);
    summary.add_row(vec![
        right(seconds(report.mean_step_time_s)),
        right(format!("{:.0}", report.tokens_per_s)),
        right(format!("{:.1}", last.utilisation.model_tflops_per_gpu)),
        right(percent(last.utilisation.mfu)),
        right(percent(last.utilisation.hfu)),
        right(percent(last.bubble_fraction)),
        right(percent(last.comm_wait_fraction)),
    ]);
    out += &summary.to_string();
    if report.steps.len() > 1 {
        out += "\n\nSteps\n";
        let mut steps = table(&["step", "schedule", "time", "comm wait"]);
        for step in &report.steps {
            steps.add_row(vec![
                right(step.step),
                Cell::new(&step.schedule),
                right(seconds(step.step_time_s)),
                right(percent(step.comm_wait_fraction)),
            ]);
        }
        out += &steps.to_string();
    }
    out += "\n\nWhere the time went (last step, mean per rank of each device type)\n";
    out += &breakdown(last).to_string();
    out
}

fn breakdown(report: &medley_sim::StepReport) -> comfy_table::Table {
    let mut by_device: std::collections::BTreeMap<&str, Vec<&medley_sim::RankReport>> = Default::default();
    for rank in &report.ranks {
        by_device.entry(rank.device.as_str()).or_default().push(rank);
    }
    let mut table = table(&["device", "ranks", "compute", "comm wait", "peer wait", "idle", "peak memory", "capacity"]);
    for (device, ranks) in by_device {
        let mean = |value: fn(&medley_sim::RankReport) -> f64| {
            ranks.iter().map(|r| value(r)).sum::<f64>() / ranks.len() as f64
        };
        table.add_row(vec![
            Cell::new(device),
            right(ranks.len()),
            right(seconds(mean(|r| r.times.compute_s))),
            right(seconds(mean(|r| r.times.comm_wait_s))),
            right(seconds(mean(|r| r.times.peer_wait_s))),
            right(seconds(mean(|r| r.times.idle_s))),
            right(format!("{:.1} GiB", report.peak_memory_by_device_gib[device])),
            right(format!("{:.0} GiB", report.capacity_gib[device])),
        ]);
    }
    table
}
