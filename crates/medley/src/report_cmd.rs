//! `medley report`: one self-contained HTML page of a plan, and of a training run when given its
//! directory.

use std::fs;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use medley_runtime::RunDir;

use crate::report_page::page;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The plan file (`medley plan -o`) [default: the run's plan, with --run].
    #[arg(long, required_unless_present = "run")]
    pub plan: Option<String>,
    /// A training run's directory (`medley train --out`): its loss, step times and a measured
    /// step's timeline, priced with the run's own calibration.
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// Efficiency profile (TOML) for the cost model [default: the run's, or the built-in one].
    #[arg(long)]
    pub calibration: Option<String>,
    /// Where to write the page.
    #[arg(short = 'o', long, default_value = "report.html")]
    pub output: PathBuf,
}

pub fn run(args: &ReportArgs) -> Result<()> {
    let plan_path = match (&args.plan, &args.run) {
        (Some(plan), _) => plan.clone(),
        (None, Some(run)) => RunDir::at(run).plan().to_string_lossy().into_owned(),
        (None, None) => unreachable!("clap requires --plan without --run"),
    };
    let calibration = match (&args.calibration, &args.run) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(run)) => Some(RunDir::at(run).calibration().to_string_lossy().into_owned()),
        (None, None) => None,
    };
    let html = page(&plan_path, calibration.as_deref(), args.run.as_deref())?;
    fs::write(&args.output, html).with_context(|| format!("cannot write {}", args.output.display()))?;
    tracing::info!("{} written: open it in a browser", args.output.display());
    Ok(())
}
