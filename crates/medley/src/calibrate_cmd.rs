//! `medley calibrate`: measures this machine's pass time for a model and writes the emulation
//! profile that `medley train --calibration` takes; `medley plan` and `medley simulate` take it
//! only to price that model's emulated runs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use medley_spec::Cluster;

use crate::inputs::load_model;
use crate::train_cmd::{DEFAULT_FLEET, calibrate_here};

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// The emulated fleet the profile is for: COUNTxDEVICE,...
    #[arg(long, default_value = DEFAULT_FLEET)]
    pub fleet: String,
    #[arg(long, default_value = "tiny")]
    pub model: String,
    #[arg(long, default_value_t = 128)]
    pub seq_len: u32,
    #[arg(long, default_value_t = 2)]
    pub micro_batch: u32,
    /// Write the profile here instead of printing it.
    #[arg(short = 'o', long)]
    pub output: Option<PathBuf>,
}

pub fn run(args: &CalibrateArgs) -> Result<()> {
    let cluster = Cluster::from_fleet(&args.fleet)?;
    let model = load_model(&args.model)?;
    let calibration = calibrate_here(&cluster, &model, args.seq_len, args.micro_batch)?;
    let text = format!(
        "# medley calibrate --fleet {} --model {} --seq-len {} --micro-batch {}\n# Efficiencies under which the cost model runs the fleet at this machine's emulated speeds.\n{}",
        args.fleet,
        args.model,
        args.seq_len,
        args.micro_batch,
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
