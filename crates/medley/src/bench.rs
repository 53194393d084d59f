//! `medley bench ...`: benchmarks that print tables.

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Planner speed on large clusters, and plan quality against the uniform baseline.
    Plan,
}

pub fn run(which: &BenchCommand) -> Result<()> {
    match which {
        BenchCommand::Plan => Ok(()),
    }
}
