//! Measured runs as users keep them: a CSV of layouts and step times (what Megatron-LM's logs
//! give), or a medley run directory (its `plan.json` and `metrics.jsonl`).

use std::path::{Path, PathBuf};

use medley_cost::Calibration;
use medley_plan::baselines::{Degrees, as_measured};
use medley_plan::{Plan, PlanParts};
use medley_spec::{
    AttentionKernel, Bridge, Cluster, Fabric, GradReduce, JobParts, JobSpec, ModelSpec, Precision, Recompute,
    catalog_model,
};
use serde::Deserialize;

use crate::{Measured, MeasuredRun};

/// Why measurements could not be read; each names its file, and its row where it has one.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{}: {message}", .path.display())]
    File { path: PathBuf, message: String },
    #[error("{}, row {row}: {message}", .path.display())]
    Row { path: PathBuf, row: u64, message: String },
}

/// The largest measurement or spec file read: far beyond any real one, so that a wrong path fails
/// at once instead of filling memory.
const MAX_FILE_BYTES: u64 = 64 << 20;

/// One row of a measurements CSV: a plan file, or a Megatron-style layout whose columns left out
/// take Megatron-LM's defaults.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    /// Names the run in reports [default: its layout, or its plan file].
    label: Option<String>,
    /// A medley plan (relative to the CSV), as `medley plan -o` writes it: the layout exactly,
    /// uneven stages and batch shares included. It states the cluster, the model and the job, so
    /// the columns below are left empty on its row.
    plan: Option<String>,
    /// A cluster TOML file (relative to the CSV) or an inline fleet, `COUNTxDEVICE,...`.
    cluster: Option<String>,
    /// A catalog model or a HuggingFace config.json (relative to the CSV).
    model: Option<String>,
    seq_len: Option<u32>,
    global_batch: Option<u32>,
    micro_batch: Option<u32>,
    tp: Option<u32>,
    pp: Option<u32>,
    dp: Option<u32>,
    vpp: Option<u32>,
    cp: Option<u32>,
    /// none, selective or full [default: none].
    recompute: Option<Recompute>,
    /// fused or unfused [default: fused].
    attention: Option<AttentionKernel>,
    /// bf16-mixed or fp16-mixed [default: bf16-mixed].
    precision: Option<Precision>,
    /// The gradient reduction's format: fp32 or 16-bit [default: Megatron-LM's for the
    /// precision, fp32 under bf16 and 16-bit under fp16].
    grad_reduce: Option<GradReduce>,
    /// Megatron's `--use-distributed-optimizer` [default: false].
    zero1: Option<bool>,
    /// Megatron's `--overlap-grad-reduce` [default: false].
    overlap_grad_reduce: Option<bool>,
    /// Seconds a step, measured.
    step_s: f64,
}

/// Every row of the CSV at `path` as a measured run, its plan read from the row's plan file or
/// built from its layout; files the rows name are read relative to the CSV.
pub fn read_csv(path: &Path) -> Result<Vec<MeasuredRun>, ReadError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    parse_csv(&read_capped(path)?, path, &|name| read_capped(&dir.join(name)).map_err(|err| err.to_string()))
}

/// The rows of a measurements CSV's `text`, named `path` in errors; `open` gives the text of a
/// cluster or model file a row names.
pub fn parse_csv(
    text: &str,
    path: &Path,
    open: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Vec<MeasuredRun>, ReadError> {
    let mut reader = csv::ReaderBuilder::new().trim(csv::Trim::All).comment(Some(b'#')).from_reader(text.as_bytes());
    let row_error = |row: u64, message: String| ReadError::Row { path: path.to_path_buf(), row, message };
    let headers = reader.headers().map_err(|err| row_error(1, err.to_string()))?.clone();
    let mut runs = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|err| row_error(err.position().map_or(0, |at| at.line()), err.to_string()))?;
        let line = record.position().map_or(0, |at| at.line());
        let row: Row = record.deserialize(Some(&headers)).map_err(|err| row_error(line, err.to_string()))?;
        runs.push(row.measured_run(open).map_err(|message| row_error(line, message))?);
    }
    if runs.is_empty() {
        return Err(ReadError::File { path: path.to_path_buf(), message: "holds no measured runs".into() });
    }
    Ok(runs)
}

impl Row {
    fn measured_run(self, open: &dyn Fn(&str) -> Result<String, String>) -> Result<MeasuredRun, String> {
        let (label, cluster, plan) = match &self.plan {
            Some(path) => self.planned(path, open)?,
            None => self.megatron_layout(open)?,
        };
        MeasuredRun::new(self.label.unwrap_or(label), cluster, plan, Measured::StepS(self.step_s))
            .map_err(|err| err.to_string())
    }

    /// The plan file at `path`, on a row that leaves the layout's columns empty; its label is the
    /// file's name and its cluster its device counts (`12xv100,4xT4`).
    fn planned(
        &self,
        path: &str,
        open: &dyn Fn(&str) -> Result<String, String>,
    ) -> Result<(String, String, Plan), String> {
        let given = self.given();
        if !given.is_empty() {
            return Err(format!("`plan` states the layout and the job: leave {} empty on its row", given.join(", ")));
        }
        let parts: PlanParts =
            serde_json::from_str(&open(path)?).map_err(|err| format!("plan {path}: is not a medley plan: {err}"))?;
        let plan = Plan::new(parts).map_err(|err| format!("plan {path}: {err}"))?;
        let cluster = plan
            .cluster()
            .groups()
            .iter()
            .map(|group| format!("{}x{}", group.n_nodes * group.gpus_per_node, group.device.name))
            .collect::<Vec<_>>()
            .join(",");
        Ok((path.to_string(), cluster, plan))
    }

    /// The columns the row gives.
    fn given(&self) -> Vec<&'static str> {
        let columns = [
            ("cluster", self.cluster.is_some()),
            ("model", self.model.is_some()),
            ("seq_len", self.seq_len.is_some()),
            ("global_batch", self.global_batch.is_some()),
            ("micro_batch", self.micro_batch.is_some()),
            ("tp", self.tp.is_some()),
            ("pp", self.pp.is_some()),
            ("dp", self.dp.is_some()),
            ("vpp", self.vpp.is_some()),
            ("cp", self.cp.is_some()),
            ("recompute", self.recompute.is_some()),
            ("attention", self.attention.is_some()),
            ("precision", self.precision.is_some()),
            ("grad_reduce", self.grad_reduce.is_some()),
            ("zero1", self.zero1.is_some()),
            ("overlap_grad_reduce", self.overlap_grad_reduce.is_some()),
        ];
        columns.into_iter().filter(|(_, given)| *given).map(|(column, _)| column).collect()
    }

    /// The plan Megatron-LM runs for the row's layout ([`as_measured`]), labelled by it.
    fn megatron_layout(&self, open: &dyn Fn(&str) -> Result<String, String>) -> Result<(String, String, Plan), String> {
        let needed = |value: Option<u32>, column: &str| {
            value.ok_or_else(|| format!("`{column}` is needed on a row without a `plan`"))
        };
        let cluster_text = self.cluster.as_deref().ok_or("`cluster` is needed on a row without a `plan`")?;
        let model_text = self.model.as_deref().ok_or("`model` is needed on a row without a `plan`")?;
        let cluster = match looks_like_file(cluster_text) {
            true => Cluster::from_toml(&open(cluster_text)?, cluster_text),
            false => Cluster::from_inline(cluster_text, Fabric::default(), Bridge::default()),
        }
        .map_err(|err| format!("cluster: {err}"))?;
        let model = match looks_like_file(model_text) {
            true => ModelSpec::from_hf_config(&open(model_text)?, model_text),
            false => catalog_model(model_text),
        }
        .map_err(|err| format!("model: {err}"))?;
        let micro_batch = needed(self.micro_batch, "micro_batch")?;
        let parts = JobParts {
            seq_len: needed(self.seq_len, "seq_len")?,
            global_batch: needed(self.global_batch, "global_batch")?,
            micro_batch: Some(micro_batch),
            precision: self.precision.unwrap_or_default(),
            grad_reduce: self.grad_reduce,
            zero1: self.zero1.unwrap_or(false),
            attention: self.attention.unwrap_or_default(),
            overlap_grad_reduce: self.overlap_grad_reduce.unwrap_or(false),
            ..JobParts::default()
        };
        let job = JobSpec::new(parts, "the row").map_err(|err| err.to_string())?;
        let (tp, pp, dp) = (needed(self.tp, "tp")?, needed(self.pp, "pp")?, needed(self.dp, "dp")?);
        let degrees = Degrees { vpp: self.vpp.unwrap_or(1), cp: self.cp.unwrap_or(1), ..Degrees::new(tp, pp, dp) };
        let recompute = self.recompute.unwrap_or(Recompute::None);
        let plan = as_measured(&cluster, &model, &job, &Calibration::default(), degrees, recompute)
            .map_err(|err| err.to_string())?;
        let label = format!("{degrees}, micro-batch {micro_batch}, {recompute}");
        Ok((label, cluster_text.to_string(), plan))
    }
}

/// A medley run directory: the plan it trained and the median of its steps after the first,
/// which warms up. An emulated run is refused: its steps timed this machine's CPU, not the
/// devices of its plan.
pub fn read_run(dir: &Path) -> Result<MeasuredRun, ReadError> {
    let dir =
        if dir.file_name().is_some_and(|name| name == "metrics.jsonl") { dir.parent().unwrap_or(dir) } else { dir };
    let file_error = |path: &Path, message: String| ReadError::File { path: path.to_path_buf(), message };
    if dir.join("emulation.json").exists() {
        return Err(file_error(
            dir,
            "is an emulated run (it has emulation.json): its step times are this machine's CPU standing in for \
             the devices, not the devices; calibrate from runs on the devices themselves"
                .into(),
        ));
    }
    let plan_path = dir.join("plan.json");
    let parts: PlanParts = serde_json::from_str(&read_capped(&plan_path)?)
        .map_err(|err| file_error(&plan_path, format!("is not a medley plan: {err}")))?;
    let plan = Plan::new(parts).map_err(|err| file_error(&plan_path, err.to_string()))?;
    let metrics_path = dir.join("metrics.jsonl");
    let step_s = median_step_s(&read_capped(&metrics_path)?).map_err(|message| file_error(&metrics_path, message))?;
    let label = dir.display().to_string();
    MeasuredRun::new(label.clone(), label, plan, Measured::StepS(step_s))
        .map_err(|err| file_error(&metrics_path, err.to_string()))
}

/// The median step time of a `metrics.jsonl` after its first step.
fn median_step_s(text: &str) -> Result<f64, String> {
    #[derive(Deserialize)]
    struct StepLine {
        step: u64,
        step_time_s: f64,
    }
    let mut times = Vec::new();
    for (idx, line) in text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty()) {
        let step: StepLine = serde_json::from_str(line).map_err(|err| format!("line {}: {err}", idx + 1))?;
        if step.step > 1 {
            times.push(step.step_time_s);
        }
    }
    if times.is_empty() {
        return Err("has no step after the first, which warms up: run more steps".into());
    }
    times.sort_by(f64::total_cmp);
    let middle = times.len() / 2;
    Ok(if times.len() % 2 == 1 { times[middle] } else { 0.5 * (times[middle - 1] + times[middle]) })
}

fn looks_like_file(text: &str) -> bool {
    text.ends_with(".toml") || text.ends_with(".json") || text.contains('/')
}

fn read_capped(path: &Path) -> Result<String, ReadError> {
    use std::io::Read;
    let error = |message: String| ReadError::File { path: path.to_path_buf(), message };
    let file = std::fs::File::open(path).map_err(|err| error(format!("cannot read it: {err}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(|err| error(format!("cannot read it: {err}")))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(error(format!("is larger than {} MiB: is it the right file?", MAX_FILE_BYTES >> 20)));
    }
    String::from_utf8(bytes).map_err(|_| error("is not UTF-8 text".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 33: a measured uneven layout (Sailor's, medley's own) is given as its plan file.
    #[test]
    fn a_row_gives_its_plan_file_or_its_layout_and_not_both() {
        let cluster = Cluster::from_inline("4xh100,4xa100", Fabric::default(), Bridge::default()).unwrap();
        let model = catalog_model("llama3-8b").unwrap();
        let parts = JobParts { seq_len: 2048, global_batch: 32, micro_batch: Some(1), ..JobParts::default() };
        let job = JobSpec::new(parts, "test").unwrap();
        let plan =
            medley_plan::baselines::fixed(&cluster, &model, &job, &Calibration::default(), Degrees::new(1, 2, 4))
                .unwrap()
                .plan;
        let plan_json = serde_json::to_string(&plan).unwrap();
        let open = |name: &str| match name {
            "measured.json" => Ok(plan_json.clone()),
            other => Err(format!("no file {other}")),
        };
        let csv = "label,plan,tp,pp,dp,cluster,model,seq_len,global_batch,micro_batch,step_s\n\
                   uneven,measured.json,,,,,,,,,1.5\n\
                   even,,1,2,4,8xh100,llama3-8b,2048,32,1,1.6\n";
        let runs = parse_csv(csv, Path::new("m.csv"), &open).unwrap();
        assert_eq!(runs[0].plan, plan);
        assert_eq!((runs[0].label.as_str(), runs[0].cluster.as_str()), ("uneven", "4xH100-SXM,4xA100-80GB"));
        assert_eq!(runs[1].cluster, "8xh100");
        let both = "plan,tp,step_s\nmeasured.json,2,1.5\n";
        let err = parse_csv(both, Path::new("m.csv"), &open).unwrap_err().to_string();
        assert!(err.contains("m.csv, row 2") && err.contains("leave tp empty"), "{err}");
        let neither =
            "cluster,model,seq_len,global_batch,micro_batch,pp,dp,step_s\n4xh100,llama3-8b,2048,32,1,2,2,1.5\n";
        let err = parse_csv(neither, Path::new("m.csv"), &open).unwrap_err().to_string();
        assert!(err.contains("`tp` is needed"), "{err}");
    }

    #[test]
    fn the_median_skips_the_warm_up_step_and_bad_lines_are_named() {
        let metrics = "{\"step\":1,\"step_time_s\":9.0}\n{\"step\":2,\"step_time_s\":1.0}\n\n{\"step\":3,\"step_time_s\":3.0}\n{\"step\":4,\"step_time_s\":2.0,\"loss\":1.5}\n";
        assert_eq!(median_step_s(metrics), Ok(2.0));
        assert!(median_step_s("{\"step\":1,\"step_time_s\":9.0}\n").unwrap_err().contains("after the first"));
        assert!(median_step_s("{\"step\":1}\n").unwrap_err().starts_with("line 1"));
    }
}
