//! What medley's benchmarks rest on, apart from the tables the CLI prints: the statistics they
//! report with, and the published runs the cost model's default efficiencies are fitted on.

pub mod cited;
pub mod stats;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum BenchError {
    #[error("cited run {run}: {message}")]
    CitedRun { run: &'static str, message: String },
    #[error("fitting {device}'s efficiencies: {message}")]
    Fit { device: String, message: String },
    #[error("simulating a cited run: {0}")]
    Simulation(String),
}
