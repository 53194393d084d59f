//! The stages on burn 0.22's CPU backend.

#[path = "backend_cpu.rs"]
mod backend;
#[path = "burn_stage/mod.rs"]
pub(crate) mod stage;
