//! Each suite's tables as `medley bench` prints them, or its rows as JSON.

pub mod cited;
pub mod long_context;
pub mod planner;
pub mod schedules;
