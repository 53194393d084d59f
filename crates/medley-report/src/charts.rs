//! Bars and curves: memory against capacity, the candidates' step times, and a training run's
//! loss and step times against the prediction.

use crate::svg::{Svg, ticks};
use crate::{Compared, MemoryBar, seconds};

const LABEL: f64 = 220.0;

/// Peak memory per device type as bars against its capacity: the cost model's peak filled
/// (amber in the headroom the plan leaves free, red past capacity), the simulator's as a black
/// mark, what the plan may use as a dashed line.
pub fn memory_svg(bars: &[MemoryBar], width: f64) -> String {
    const ROW: f64 = 30.0;
    let plot = width - LABEL - 180.0;
    let max = bars.iter().map(|bar| bar.capacity_gib.max(bar.predicted_gib)).fold(1.0, f64::max);
    let x = |gib: f64| LABEL + gib / max * plot;
    let mut svg = Svg::new("memory", width, ROW * bars.len() as f64 + 30.0);
    for (idx, bar) in bars.iter().enumerate() {
        let top = ROW * idx as f64 + 6.0;
        svg.text((LABEL - 8.0, top + 14.0), &bar.device_type, r#"text-anchor="end""#);
        let fill = match bar.predicted_gib {
            peak if peak > bar.capacity_gib => "#e15759",
            peak if peak > bar.usable_gib => "#f28e2b",
            _ => "#59a14f",
        };
        let tip = format!("{}: peak {:.1} GiB of {:.0} GiB", bar.device_type, bar.predicted_gib, bar.capacity_gib);
        svg.rect((LABEL, top, x(bar.capacity_gib) - LABEL, 20.0), r##"fill="#f1f1f1" stroke="#999""##, None);
        svg.rect((LABEL, top, x(bar.predicted_gib) - LABEL, 20.0), &format!(r#"fill="{fill}""#), Some(&tip));
        let usable = x(bar.usable_gib);
        let tip = format!("usable: {:.1} GiB, the rest left free", bar.usable_gib);
        svg.rect((usable - 0.5, top - 3.0, 1.0, 26.0), r##"fill="#555" stroke-dasharray="3 2""##, Some(&tip));
        if let Some(simulated) = bar.simulated_gib {
            let at = x(simulated);
            let tip = format!("simulated peak {simulated:.1} GiB");
            svg.rect((at - 1.5, top - 3.0, 3.0, 26.0), r##"fill="#222""##, Some(&tip));
        }
        let used = bar.predicted_gib / bar.capacity_gib * 100.0;
        let text = format!("{:.1} / {:.0} GiB ({used:.0}%)", bar.predicted_gib, bar.capacity_gib);
        svg.text((x(max) + 8.0, top + 14.0), &text, "");
    }
    let legend = ROW * bars.len() as f64 + 20.0;
    svg.text(
        (LABEL, legend),
        "bar: the cost model's peak (amber: in the headroom) · black mark: the simulator's · thin line: usable · outline: capacity",
        r##"fill="#555""##,
    );
    svg.finish()
}

/// The chosen plan, the other candidates and the baselines by step time, fastest first.
pub fn compared_svg(rows: &[Compared], width: f64) -> String {
    const ROW: f64 = 24.0;
    let plot = width - LABEL - 150.0;
    let max = rows.iter().filter_map(|row| row.step_time_s).fold(0.0, f64::max).max(1e-12);
    let mut svg = Svg::new("candidates", width, ROW * rows.len() as f64 + 10.0);
    for (idx, row) in rows.iter().enumerate() {
        let top = ROW * idx as f64 + 4.0;
        let weight = if row.chosen { r#" font-weight="bold""# } else { "" };
        svg.text((LABEL - 8.0, top + 13.0), &row.name, &format!(r#"text-anchor="end"{weight}"#));
        let Some(step_s) = row.step_time_s else {
            svg.text((LABEL, top + 13.0), "does not fit", r##"fill="#c00""##);
            continue;
        };
        let fill = match (row.chosen, row.baseline) {
            (true, _) => "#4c78a8",
            (false, true) => "#bab0ac",
            (false, false) => "#9ecae9",
        };
        let w = step_s / max * plot;
        svg.rect((LABEL, top, w, 17.0), &format!(r#"fill="{fill}""#), Some(&format!("{}: {}", row.name, row.layout)));
        svg.text((LABEL + w + 6.0, top + 13.0), &seconds(step_s), "");
    }
    svg.finish()
}

/// One curve of a line chart.
pub struct Series<'a> {
    pub name: &'a str,
    pub colour: &'a str,
    pub points: Vec<(f64, f64)>,
    pub dashed: bool,
}

/// Curves over a shared x axis from 0 (steps), y from 0, with round ticks and a legend.
/// `y_text` writes a y tick given the ticks' step.
pub fn line_svg(id: &'static str, series: &[Series], width: f64, y_text: impl Fn(f64, f64) -> String) -> String {
    const HEIGHT: f64 = 240.0;
    const LEFT: f64 = 70.0;
    let (plot_w, plot_h) = (width - LEFT - 20.0, HEIGHT - 60.0);
    let points = series.iter().flat_map(|series| &series.points);
    let (x_max, y_max) = points.fold((1.0f64, 0.0f64), |(x, y), &(px, py)| (x.max(px), y.max(py)));
    let y_max = if y_max > 0.0 { y_max * 1.05 } else { 1.0 };
    let at = |(x, y): (f64, f64)| (LEFT + x / x_max * plot_w, 10.0 + plot_h - y / y_max * plot_h);
    let mut svg = Svg::new(id, width, HEIGHT);
    let y_ticks = ticks(y_max, 5);
    let y_step = y_ticks.get(1).copied().unwrap_or(1.0);
    for tick in y_ticks {
        let (_, y) = at((0.0, tick));
        svg.line((LEFT, y), (LEFT + plot_w, y), r##"stroke="#e4e4e4""##);
        svg.text((LEFT - 6.0, y + 4.0), &y_text(tick, y_step), r##"text-anchor="end" fill="#555""##);
    }
    // Steps are whole numbers.
    for tick in ticks(x_max, 8).into_iter().filter(|tick| tick.fract() == 0.0) {
        let (x, y) = at((tick, 0.0));
        svg.text((x, y + 16.0), &format!("{tick}"), r##"text-anchor="middle" fill="#555""##);
    }
    let (_, axis_y) = at((0.0, 0.0));
    svg.text((LEFT + plot_w / 2.0, axis_y + 32.0), "step", r##"text-anchor="middle" fill="#555""##);
    let mut legend_x = LEFT;
    for series in series {
        let dash = if series.dashed { r#" stroke-dasharray="6,4""# } else { "" };
        let style = format!(r#"stroke="{}" stroke-width="2"{dash}"#, series.colour);
        let scaled: Vec<(f64, f64)> = series.points.iter().map(|&point| at(point)).collect();
        match scaled.as_slice() {
            [(x, y)] => svg.rect((x - 2.0, y - 2.0, 4.0, 4.0), &format!(r#"fill="{}""#, series.colour), None),
            _ => svg.polyline(&scaled, &style),
        }
        svg.line((legend_x, HEIGHT - 8.0), (legend_x + 22.0, HEIGHT - 8.0), &style);
        svg.text((legend_x + 28.0, HEIGHT - 4.0), series.name, "");
        legend_x += 50.0 + 6.5 * series.name.len() as f64;
    }
    svg.finish()
}
