//! Plans of known shape on llama3-8b, and a launch script run with a stand-in torchrun.

#![allow(dead_code)] // each test binary uses its own part

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use medley_cost::{Calibration, CostModel, Setting};
use medley_export::{Arg, ExportError};
use medley_plan::baselines::{Degrees, megatron_plan};
use medley_plan::{Plan, ReplicaLayout, assemble, stages_from_counts};
use medley_spec::{
    Cluster, JobParts, JobSpec, ModelParts, ModelSpec, Recompute, Schedule, ScheduleKind, catalog_model,
};

/// Whether the job shards the optimizer state over data-parallel replicas.
#[derive(Clone, Copy)]
pub enum Zero1 {
    On,
    Off,
}

pub fn cluster(text: &str) -> Cluster {
    Cluster::from_inline(text, Default::default(), Default::default()).unwrap()
}

pub fn job(seq_len: u32, global_batch: u32, zero1: Zero1) -> JobSpec {
    let zero1 = matches!(zero1, Zero1::On);
    let parts = JobParts { seq_len, global_batch, micro_batch: Some(1), zero1, ..JobParts::default() };
    JobSpec::new(parts, "test").unwrap()
}

fn setting(tp: u32) -> Setting {
    Setting { micro_batch: 1, tp, recompute: Recompute::Selective }
}

/// Megatron's layout of `degrees` over the first devices of `text`, llama3-8b, 32 sequences.
pub fn uniform(text: &str, degrees: Degrees, zero1: Zero1) -> Plan {
    uniform_of("llama3-8b", text, degrees, zero1)
}

/// Megatron's layout of `degrees` of the catalog's `model`, 32 sequences of 4096 tokens.
pub fn uniform_of(model: &str, text: &str, degrees: Degrees, zero1: Zero1) -> Plan {
    let model = catalog_model(model).unwrap();
    let calibration = Calibration::default();
    let cost = CostModel::new(&model, 4096, &calibration);
    megatron_plan(&cluster(text), &cost, &job(4096, 32, zero1), setting(degrees.tp), degrees).unwrap()
}

/// Replicas of `(micro-batches, layers per stage)` on `text`'s devices in order, tp = 1.
pub fn assembled(text: &str, replicas: &[(u32, &[u32])], zero1: Zero1) -> Plan {
    let (cluster, model, calibration) = (cluster(text), catalog_model("llama3-8b").unwrap(), Calibration::default());
    let cost = CostModel::new(&model, 4096, &calibration);
    let global_batch = replicas.iter().map(|(m, _)| m).sum();
    let mut next = 0;
    let layouts = replicas
        .iter()
        .map(|&(n_micro_batches, counts)| {
            let devices = (0..counts.len() as u32).map(|j| vec![next + j]).collect();
            next += counts.len() as u32;
            ReplicaLayout { n_micro_batches, stages: stages_from_counts(devices, counts) }
        })
        .collect();
    let schedule = Schedule::Fixed(ScheduleKind::OneFOneB);
    let job = job(4096, global_batch, zero1);
    Plan::new(assemble(&cluster, &cost, &job, setting(1), schedule, 1, layouts)).unwrap()
}

/// `plan` with its model changed by `edit`.
pub fn with_model(plan: Plan, edit: impl FnOnce(&mut ModelParts)) -> Plan {
    let mut parts = plan.into_parts();
    let mut model = ModelParts::from(parts.model);
    edit(&mut model);
    parts.model = ModelSpec::new(model, "test").unwrap();
    Plan::try_from(parts).unwrap()
}

/// What a launch script started: torchrun's arguments and the environment it set.
pub struct Launched {
    pub argv: Vec<String>,
    pub cuda_visible_devices: String,
    /// The recipe module on `PYTHONPATH`, if the script wrote one.
    pub recipe: Option<String>,
    /// The environment torchrun started in.
    pub env: HashMap<String, String>,
}

/// Runs `script` under bash as host `node_rank` with a stand-in `torchrun` that records what it
/// was given, and `extra` as the script's own arguments.
pub fn launch(script: &str, node_rank: u32, extra: &[&str]) -> Launched {
    let dir = tempfile::tempdir().unwrap();
    let record = dir.path().join("record");
    let torchrun = dir.path().join("torchrun");
    std::fs::write(
        &torchrun,
        format!(
            "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" > {argv}\nprintf '%s' \"$CUDA_VISIBLE_DEVICES\" > {gpus}\nenv -0 > {env}\n\
             for dir in ${{PYTHONPATH//:/ }}; do [ -f \"$dir/medley_recipe.py\" ] && cp \"$dir/medley_recipe.py\" {recipe}; done; true\n",
            argv = record.with_extension("argv").display(),
            gpus = record.with_extension("gpus").display(),
            env = record.with_extension("env").display(),
            recipe = record.with_extension("py").display(),
        ),
    )
    .unwrap();
    make_executable(&torchrun);
    let script_path = dir.path().join("launch.sh");
    std::fs::write(&script_path, script).unwrap();
    let path = format!("{}:{}", dir.path().display(), std::env::var("PATH").unwrap_or_default());
    let status = Command::new("bash")
        .arg(&script_path)
        .args(extra)
        .env("PATH", path)
        .env("NODE_RANK", node_rank.to_string())
        .env("MASTER_ADDR", "host0")
        .env_remove("PYTHONPATH")
        .env_remove("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
        .env_remove("NVIDIA_TF32_OVERRIDE")
        .env_remove("HIPBLASLT_ALLOW_TF32")
        .status()
        .unwrap();
    assert!(status.success(), "the launch script failed: {script}");
    let read = |extension: &str| std::fs::read_to_string(record.with_extension(extension));
    Launched {
        argv: read("argv").unwrap().lines().map(String::from).collect(),
        cuda_visible_devices: read("gpus").unwrap(),
        recipe: read("py").ok(),
        env: read("env")
            .unwrap()
            .split('\0')
            .filter_map(|line| line.split_once('='))
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect(),
    }
}

fn make_executable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The arguments `args` stand for on a command line: each flag, then its value's words.
pub fn words(args: &[Arg]) -> Vec<String> {
    let mut words = Vec::new();
    for arg in args {
        words.push(arg.flag.clone());
        words.extend(arg.value.iter().flat_map(|value| value.split(' ').map(String::from)));
    }
    words
}

/// The value of `flag` in `args` ("" for a flag without one).
pub fn value<'a>(args: &'a [Arg], flag: &str) -> Option<&'a str> {
    args.iter().find(|arg| arg.flag == flag).map(|arg| arg.value.as_deref().unwrap_or(""))
}

/// The reason `framework` refused a plan; `exported` is the command line it gave instead.
pub fn refusal(exported: Result<String, ExportError>, framework: &str) -> String {
    match exported {
        Err(ExportError::NotExpressible { framework: refused_by, reason }) => {
            assert_eq!(refused_by, framework);
            reason
        }
        Ok(command_line) => panic!("exported what {framework} cannot run: {command_line}"),
    }
}
