//! medley's benchmark suites: what each suite runs and measures ([`planner`], [`long_context`], [`schedules`], [`comm`]), the statistics they report with, and the
//! published runs the cost model's default efficiencies are fitted on ([`cited`]), and the tables
//! `medley bench` prints ([`tables`]).

pub mod cited;
pub mod comm;
pub mod comm_harness;
pub mod compute;
pub mod heterogeneous;
pub mod long_context;
pub mod planner;
pub mod schedules;
pub mod stats;
pub mod tables;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum BenchError {
    #[error("cited run {run}: {message}")]
    CitedRun { run: &'static str, message: String },
    #[error(transparent)]
    Fit(#[from] medley_fit::FitError),
    #[error(transparent)]
    Measurements(#[from] medley_fit::measurements::ReadError),
    #[error("bench case {case}: {message}")]
    Case { case: String, message: String },
    #[error("simulating: {0}")]
    Simulation(#[from] medley_sim::SimError),
    #[error(transparent)]
    Comm(#[from] medley_comm::CommError),
    #[error("network trace: {0}")]
    Trace(#[from] medley_trace::TraceError),
    #[error("{context}: {source}")]
    Io { context: &'static str, source: std::io::Error },
}
