//! What people read: one self-contained HTML page of a plan — and of a training run, when there
//! is one — that opens offline (no script or style from anywhere else, every picture inline SVG),
//! and the terminal's tables.
//!
//! - [`picture`]: the plan (replicas, stages as wide as their layers, device types, routes).
//! - [`timeline`]: a step as lanes per rank from the Perfetto events the simulator and the
//!   runtime write, so a measured step and a simulated one are drawn alike.
//! - [`charts`]: memory against capacity, candidates and baselines, loss and step times.
//! - [`plan_text`], [`sim_text`]: `medley plan`'s and `medley simulate`'s tables and JSON; [`text`]: the tables' words and figures.
//!
//! The page checks itself once drawn: every picture must have a size, or it says which did not
//! (`data-rendered` on the root element, and a console error) — what the browser test reads.

pub mod charts;
pub mod picture;
pub mod plan_text;
pub mod sim_text;
pub mod svg;
pub mod text;
pub mod timeline;

use std::fmt::Write;

use medley_plan::Plan;

use crate::charts::Series;
use crate::svg::escape;
use crate::timeline::Lanes;

/// A duration as a person reads it: `48.2 s`, `1.234 s`, `12.3 ms`, `45.6 µs`.
pub fn seconds(s: f64) -> String {
    match s {
        s if s >= 10.0 => format!("{s:.1} s"),
        s if s >= 1.0 => format!("{s:.3} s"),
        s if s >= 1e-3 => format!("{:.1} ms", s * 1e3),
        s => format!("{:.1} µs", s * 1e6),
    }
}

/// Peak memory of one device type.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryBar {
    pub device_type: String,
    /// The cost model's peak.
    pub predicted_gib: f64,
    pub simulated_gib: Option<f64>,
    pub capacity_gib: f64,
    /// What the plan may use of it: the capacity less the headroom it leaves free.
    pub usable_gib: f64,
}

/// A plan the report compares: the chosen one, another candidate, or a baseline.
#[derive(Clone, Debug, PartialEq)]
pub struct Compared {
    pub name: String,
    /// The layout in a few words.
    pub layout: String,
    /// `None` when it does not fit.
    pub step_time_s: Option<f64>,
    pub tokens_per_s: Option<f64>,
    pub mfu: Option<f64>,
    pub chosen: bool,
    pub baseline: bool,
}

/// One step of a training run's metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunStep {
    pub step: u64,
    pub loss: f64,
    pub step_time_s: f64,
}

/// What a training run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    pub steps: Vec<RunStep>,
    /// The simulator's step time for the run's plan on this machine.
    pub predicted_step_s: f64,
    /// The step whose timeline is drawn, and its lanes.
    pub measured_step: Option<u64>,
    pub measured: Lanes,
}

/// Everything the page shows.
pub struct Report<'a> {
    pub title: String,
    /// Facts shown under the title as a table: what, value.
    pub facts: Vec<(String, String)>,
    pub plan: &'a Plan,
    /// The plan in words (one line each), under its picture.
    pub explanation: String,
    pub simulated: Lanes,
    pub memory: Vec<MemoryBar>,
    pub compared: Vec<Compared>,
    pub run: Option<RunRecord>,
}

/// The page's width for pictures, pixels.
const WIDTH: f64 = 1180.0;

/// The report as one HTML document.
pub fn html(report: &Report) -> String {
    let mut page = String::new();
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body>\n\
         <h1>{}</h1>\n",
        escape(&report.title),
        escape(&report.title)
    );
    page.push_str("<table class=\"facts\">");
    for (what, value) in &report.facts {
        let _ = write!(page, "<tr><th>{}</th><td>{}</td></tr>", escape(what), escape(value));
    }
    page.push_str("</table>\n");
    section(&mut page, "The plan", &picture::plan_svg(report.plan, WIDTH));
    page.push_str("<ul class=\"explain\">");
    for line in report.explanation.lines().filter(|line| !line.trim().is_empty()) {
        let _ = write!(page, "<li>{}</li>", escape(line.trim_start_matches("- ")));
    }
    page.push_str("</ul>\n");
    timelines(&mut page, report);
    section(&mut page, "Peak memory per device type", &charts::memory_svg(&report.memory, WIDTH));
    section(
        &mut page,
        "Candidates and baselines (simulated step time)",
        &charts::compared_svg(&report.compared, WIDTH),
    );
    page.push_str(&compared_table(&report.compared));
    if let Some(run) = &report.run {
        run_sections(&mut page, run);
    }
    let _ = write!(
        page,
        "<footer>medley {}</footer>\n<script>{SELF_CHECK}</script>\n</body></html>\n",
        env!("CARGO_PKG_VERSION")
    );
    page
}

fn section(page: &mut String, heading: &str, body: &str) {
    let _ = write!(page, "<h2>{}</h2>\n<div class=\"figure\">{body}</div>\n", escape(heading));
}

/// The simulated step, and the measured one on the same time scale when the run has one.
fn timelines(page: &mut String, report: &Report) {
    let measured = report.run.as_ref().filter(|run| !run.measured.lanes.is_empty());
    let span_us = report.simulated.span_us.max(measured.map_or(0.0, |run| run.measured.span_us));
    let shown = |lanes: &Lanes| match lanes.lanes.len() < lanes.ranks {
        true => format!(" — the first {} of {} ranks", lanes.lanes.len(), lanes.ranks),
        false => String::new(),
    };
    let heading = format!("One simulated step{}", shown(&report.simulated));
    section(page, &heading, &report.simulated.svg("timeline", WIDTH, span_us));
    if let Some(run) = measured {
        let step = run.measured_step.map_or_else(String::new, |step| format!(" (step {step})"));
        let heading = format!("One measured step{step}{}, on the same time scale", shown(&run.measured));
        section(page, &heading, &run.measured.svg("measured-timeline", WIDTH, span_us));
    }
}

fn compared_table(rows: &[Compared]) -> String {
    let mut table = String::from(
        "<table class=\"compared\"><tr><th>plan</th><th>layout</th><th>step time</th><th>tokens/s</th><th>MFU</th></tr>",
    );
    for row in rows {
        let class = if row.chosen { " class=\"chosen\"" } else { "" };
        let _ = write!(
            table,
            "<tr{class}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&row.name),
            escape(&row.layout),
            row.step_time_s.map_or("does not fit".into(), seconds),
            row.tokens_per_s.map_or(String::new(), |tokens| format!("{tokens:.0}")),
            row.mfu.map_or(String::new(), mfu_text),
        );
    }
    table.push_str("</table>\n");
    table
}

/// MFU against the GPUs' peak: an emulated fleet's is far below a tenth of a percent.
fn mfu_text(mfu: f64) -> String {
    match mfu {
        mfu if mfu < 1e-3 => "<0.1%".into(),
        mfu => format!("{:.1}%", mfu * 100.0),
    }
}

fn run_sections(page: &mut String, run: &RunRecord) {
    let loss = Series {
        name: "loss",
        colour: "#4c78a8",
        points: run.steps.iter().map(|step| (step.step as f64, step.loss)).collect(),
        dashed: false,
    };
    section(page, "Training loss", &charts::line_svg("loss", &[loss], WIDTH, svg::number_tick));
    let measured = Series {
        name: "measured",
        colour: "#59a14f",
        points: run.steps.iter().map(|step| (step.step as f64, step.step_time_s)).collect(),
        dashed: false,
    };
    let last = run.steps.last().map_or(1.0, |step| step.step as f64);
    let predicted = Series {
        name: "simulated",
        colour: "#e15759",
        points: vec![(0.0, run.predicted_step_s), (last, run.predicted_step_s)],
        dashed: true,
    };
    section(
        page,
        "Step time: measured against the simulator",
        &charts::line_svg("step-times", &[measured, predicted], WIDTH, svg::seconds_tick),
    );
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px auto;max-width:1200px;color:#222}\
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}\
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;text-align:left;border-bottom:1px solid #eee}\
table.facts th{color:#555;font-weight:normal}tr.chosen{font-weight:bold;background:#eef4fb}\
ul.explain{font-size:13px;color:#333}.figure{overflow-x:auto}footer{margin-top:32px;color:#888;font-size:12px}";

/// Marks the page rendered, or names the pictures that drew nothing.
const SELF_CHECK: &str = "(function(){var missing=[];\
document.querySelectorAll('[data-check]').forEach(function(el){var box=el.getBoundingClientRect();\
if(!(box.width>0&&box.height>0)||el.childElementCount===0){missing.push(el.id);}});\
document.documentElement.dataset.rendered=missing.length?'missing:'+missing.join(','):'ok';\
if(missing.length){console.error('medley report: nothing drawn for '+missing.join(', '));}})();";
