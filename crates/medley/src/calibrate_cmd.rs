//! `medley calibrate`: measures this machine's pass time for a model and writes the emulation
//! profile that `medley train --calibration` takes; `medley plan` and `medley simulate` take it
//! only to price that model's emulated runs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use medley_runtime::DeviceChoice;
use medley_spec::Cluster;

use crate::inputs::DEFAULT_FLEET;
use crate::inputs::{JobFlags, load_model};
use crate::job::calibrate_here;

/// Takes train's job flags and defaults, so that train's command line makes its profile.
#[derive(Args, Debug)]
#[command(
    mut_arg("model", |arg| arg.default_value("tiny")),
    mut_arg("seq_len", |arg| arg.default_value("128")),
    mut_arg("global_batch", |arg| arg.default_value("16").help("Sequences per optimizer step: accepted as train takes it; a profile does not depend on it")),
    mut_arg("micro_batch", |arg| arg.default_value("2"))
)]
pub struct CalibrateArgs {
    /// The emulated fleet the profile is for: COUNTxDEVICE,...
    #[arg(long, default_value = DEFAULT_FLEET)]
    pub fleet: String,
    /// The model and the job's shape.
    #[command(flatten)]
    pub shape: JobFlags,
    /// Write the profile here instead of printing it.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    let cluster = Cluster::from_fleet(&args.fleet)?;
    let shape = args.shape.shape()?;
    let model = load_model(&shape.model)?;
    let calibration =
        calibrate_here(&cluster, &model, shape.seq_len, shape.micro_batch, shape.precision, DeviceChoice::Cpu)?;
    let text = format!(
        "# medley calibrate --fleet {} --model {} --seq-len {} --micro-batch {}\n# Efficiencies under which the cost model runs the fleet at this machine's emulated speeds.\n{}",
        args.fleet,
        shape.model,
        shape.seq_len,
        shape.micro_batch,
        calibration.to_toml()
    );
    match &args.output {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display())),
        None => {
            print!("{text}");
            Ok(())
        }
    }
}
