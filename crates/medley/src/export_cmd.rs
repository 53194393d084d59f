//! `medley export megatron|torchtitan`: a plan as the framework runs it — its launch script, or
//! the arguments and placement as JSON — or the exact reason it cannot.

use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use medley_export::ExportError;

use crate::inputs::load_plan;

#[derive(Subcommand, Debug)]
pub enum ExportCommand {
    /// Megatron-LM: a torchrun launch script of `pretrain_gpt.py` with the plan's arguments,
    /// each rank on the device the plan chose.
    Megatron(ExportArgs),
    /// torchtitan: a torchrun launch script of `torchtitan.train` from the llama3 recipe of the
    /// plan's model, with the plan's parallelism and batch as CLI overrides and its activation
    /// checkpointing in a recipe module the script writes, each rank on the device the plan chose.
    Torchtitan(ExportArgs),
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The plan file (`medley plan -o`).
    #[arg(long)]
    pub plan: String,
    /// Print the arguments, world size and rank placement (and torchtitan's recipe) as JSON
    /// instead of the script.
    #[arg(long)]
    pub json: bool,
    /// Write the launch script to this file (made executable) instead of standard output.
    #[arg(long, short)]
    pub output: Option<String>,
}

/// Exit code when the framework cannot run the plan: the plan is fine, the framework is not.
const NOT_EXPRESSIBLE: u8 = 1;

pub fn run(which: &ExportCommand) -> Result<ExitCode> {
    let (ExportCommand::Megatron(args) | ExportCommand::Torchtitan(args)) = which;
    let plan = load_plan(&args.plan)?;
    let exported = match which {
        ExportCommand::Megatron(_) => {
            medley_export::megatron::megatron(&plan).map(|export| (to_json(&export), export.launch_script()))
        }
        ExportCommand::Torchtitan(_) => {
            medley_export::torchtitan::torchtitan(&plan).map(|export| (to_json(&export), export.launch_script()))
        }
    };
    let (json, script) = match exported {
        Ok(exported) => exported,
        Err(error @ ExportError::NotExpressible { .. }) => {
            eprintln!("error: {error}");
            return Ok(ExitCode::from(NOT_EXPRESSIBLE));
        }
    };
    let text = match args.json {
        true => json?,
        false => script,
    };
    match &args.output {
        None => crate::emit(&text)?,
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("cannot write {path}"))?;
            if !args.json {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
                    .with_context(|| format!("cannot make {path} executable"))?;
            }
            tracing::info!("{path} written");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn to_json(export: &impl serde::Serialize) -> Result<String> {
    Ok(serde_json::to_string_pretty(export)? + "\n")
}
