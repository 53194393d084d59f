//! A step's timeline as a picture: one lane per rank, read from the Perfetto trace events the
//! simulator and the runtime both write (medley-trace's layout), forward, backward, optimizer,
//! waits and communication in their colours, idle time left blank so that bubbles show.

use serde_json::Value;

use crate::seconds;
use crate::svg::{Svg, seconds_tick, ticks};

/// What a slice of a lane is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Forward,
    Backward,
    /// A zero-bubble schedule's deferred weight-gradient pass.
    WeightGrad,
    Optimizer,
    /// Blocked on a message or a peer.
    Wait,
    Collective,
    Transfer,
}

impl Kind {
    /// Which kind a trace slice is, by its category and name; `None` for slices the picture
    /// leaves out.
    fn of(category: &str, name: &str) -> Option<Kind> {
        let starts = |prefixes: &[&str]| prefixes.iter().any(|prefix| name.starts_with(prefix));
        match category {
            "compute" if starts(&["F ", "forward"]) => Some(Kind::Forward),
            "compute" if starts(&["W ", "backward-weight"]) => Some(Kind::WeightGrad),
            "compute" if starts(&["B ", "backward"]) => Some(Kind::Backward),
            "compute" | "optimizer" if name.contains("optimizer") || category == "optimizer" => Some(Kind::Optimizer),
            "wait" => Some(Kind::Wait),
            "collective" => Some(Kind::Collective),
            "transfer" | "send" => Some(Kind::Transfer),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Forward => "forward",
            Kind::Backward => "backward",
            Kind::WeightGrad => "weight gradients",
            Kind::Optimizer => "optimizer",
            Kind::Wait => "waiting on data or a peer",
            Kind::Collective => "collective",
            Kind::Transfer => "transfer",
        }
    }

    fn colour(self) -> &'static str {
        match self {
            Kind::Forward => "#4c78a8",
            Kind::Backward => "#59a14f",
            Kind::WeightGrad => "#76b7b2",
            Kind::Optimizer => "#b07aa1",
            Kind::Wait => "#e15759",
            Kind::Collective => "#f28e2b",
            Kind::Transfer => "#d4a800",
        }
    }

    /// Communication is drawn in a thin row under the compute row.
    fn is_communication(self) -> bool {
        matches!(self, Kind::Collective | Kind::Transfer)
    }

    const ALL: [Kind; 7] = [
        Kind::Forward,
        Kind::Backward,
        Kind::WeightGrad,
        Kind::Optimizer,
        Kind::Wait,
        Kind::Collective,
        Kind::Transfer,
    ];
}

#[derive(Clone, Debug, PartialEq)]
pub struct Slice {
    pub start_us: f64,
    pub dur_us: f64,
    pub kind: Kind,
    pub label: String,
}

/// One rank's slices.
#[derive(Clone, Debug, PartialEq)]
pub struct Lane {
    pub name: String,
    pub slices: Vec<Slice>,
}

/// The lanes of one step, time from the step's first slice.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Lanes {
    pub lanes: Vec<Lane>,
    /// Ranks in the trace: more than `lanes.len()` when the picture shows only the first.
    pub ranks: usize,
    pub span_us: f64,
}

/// The lane drawn for the simulator's per-layer phase thread of a long-context stage (medley-trace's
/// `LAYER_TID`), which repeats what the compute lane shows.
const LAYER_TID: u64 = 3;

impl Lanes {
    /// The lanes of `events` (a trace's events), of `step` only when given (the runtime's slices
    /// carry their step), the first `max_lanes` ranks in the trace's own order.
    pub fn from_events(events: &[Value], step: Option<u64>, max_lanes: usize) -> Lanes {
        let mut ranks: Vec<(u64, u64, String)> = Vec::new(); // (sort index, pid, name)
        let rank = |ranks: &mut Vec<(u64, u64, String)>, pid: u64| match ranks
            .iter()
            .position(|(_, known, _)| *known == pid)
        {
            Some(idx) => idx,
            None => {
                ranks.push((pid, pid, format!("rank {pid}")));
                ranks.len() - 1
            }
        };
        let mut slices: Vec<(usize, Slice)> = Vec::new();
        for event in events {
            let Some(pid) = event["pid"].as_u64() else { continue };
            let idx = rank(&mut ranks, pid);
            match (event["ph"].as_str(), event["name"].as_str()) {
                (Some("M"), Some("process_name")) => {
                    if let Some(name) = event.pointer("/args/name").and_then(Value::as_str) {
                        ranks[idx].2 = name.to_string();
                    }
                }
                (Some("M"), Some("process_sort_index")) => {
                    if let Some(sort) = event.pointer("/args/sort_index").and_then(Value::as_u64) {
                        ranks[idx].0 = sort;
                    }
                }
                (Some("X"), Some(name)) => {
                    let in_step =
                        step.is_none_or(|step| event.pointer("/args/step").and_then(Value::as_u64) == Some(step));
                    let kind = Kind::of(event["cat"].as_str().unwrap_or(""), name);
                    let (Some(kind), Some(start_us), Some(dur_us)) =
                        (kind, event["ts"].as_f64(), event["dur"].as_f64())
                    else {
                        continue;
                    };
                    if in_step && event["tid"].as_u64() != Some(LAYER_TID) {
                        slices.push((idx, Slice { start_us, dur_us, kind, label: name.to_string() }));
                    }
                }
                _ => {}
            }
        }
        let origin = slices.iter().map(|(_, slice)| slice.start_us).fold(f64::INFINITY, f64::min);
        let mut order: Vec<usize> = (0..ranks.len()).collect();
        order.sort_by_key(|&idx| (ranks[idx].0, ranks[idx].1));
        let mut lanes: Vec<Lane> =
            order.iter().map(|&idx| Lane { name: ranks[idx].2.clone(), slices: Vec::new() }).collect();
        let mut span_us = 0.0f64;
        for (idx, mut slice) in slices {
            slice.start_us -= origin;
            span_us = span_us.max(slice.start_us + slice.dur_us);
            let lane = order.iter().position(|&rank| rank == idx).expect("every rank has a lane");
            lanes[lane].slices.push(slice);
        }
        lanes.retain(|lane| !lane.slices.is_empty());
        let ranks = lanes.len();
        lanes.truncate(max_lanes);
        Lanes { lanes, ranks, span_us }
    }

    /// The lanes as an SVG `width` pixels wide, `span_us` across (one scale for timelines shown
    /// side by side).
    pub fn svg(&self, id: &'static str, width: f64, span_us: f64) -> String {
        const LABEL: f64 = 250.0;
        const LANE: f64 = 24.0;
        const TOP: f64 = 22.0;
        let plot = width - LABEL - 10.0;
        let span_us = span_us.max(1e-9);
        let x = |us: f64| LABEL + us / span_us * plot;
        let height = TOP + LANE * self.lanes.len() as f64 + 34.0;
        let mut svg = Svg::new(id, width, height);
        let ticks = ticks(span_us / 1e6, 8);
        let step = ticks.get(1).copied().unwrap_or(1.0);
        for tick in ticks {
            let at = x(tick * 1e6);
            svg.line((at, TOP - 4.0), (at, height - 34.0), r##"stroke="#ddd""##);
            svg.text((at, TOP - 8.0), &seconds_tick(tick, step), r##"text-anchor="middle" fill="#555""##);
        }
        for (idx, lane) in self.lanes.iter().enumerate() {
            let top = TOP + LANE * idx as f64;
            svg.rect((LABEL, top + 2.0, plot, 16.0), r##"fill="#f1f1f1""##, Some("idle: the rank has nothing to do"));
            svg.text((LABEL - 6.0, top + 14.0), &lane.name, r#"text-anchor="end""#);
            for (kind, rects) in merged(&lane.slices, x) {
                let (y, h) = if kind.is_communication() { (top + 19.0, 4.0) } else { (top + 2.0, 16.0) };
                let style = format!(
                    r#"fill="{}"{}"#,
                    kind.colour(),
                    if kind == Kind::Wait { r#" opacity="0.45""# } else { "" }
                );
                for (start, end, tip) in rects {
                    svg.rect((start, y, (end - start).max(0.6), h), &style, tip.as_deref());
                }
            }
        }
        let legend_y = height - 12.0;
        let mut legend_x = LABEL;
        for kind in Kind::ALL {
            svg.rect((legend_x, legend_y - 9.0, 10.0, 10.0), &format!(r#"fill="{}""#, kind.colour()), None);
            svg.text((legend_x + 14.0, legend_y), kind.name(), "");
            legend_x += 24.0 + 6.5 * kind.name().len() as f64;
        }
        svg.rect((legend_x, legend_y - 9.0, 10.0, 10.0), r##"fill="#f1f1f1" stroke="#ccc""##, None);
        svg.text((legend_x + 14.0, legend_y), "idle (bubble)", "");
        svg.finish()
    }
}

/// A drawn rectangle: from and to, pixels, and its hover text.
type Rect = (f64, f64, Option<String>);

/// A lane's slices as rectangles in pixels, per kind: neighbours of one kind less than half a
/// pixel apart are drawn as one, so a long step stays a picture of bounded size. A rectangle that
/// is one slice keeps its name and duration as hover text.
fn merged(slices: &[Slice], x: impl Fn(f64) -> f64) -> Vec<(Kind, Vec<Rect>)> {
    let mut out: Vec<(Kind, Vec<Rect>)> = Vec::new();
    for kind in Kind::ALL {
        let mut of_kind: Vec<&Slice> = slices.iter().filter(|slice| slice.kind == kind).collect();
        if of_kind.is_empty() {
            continue;
        }
        of_kind.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
        let mut rects: Vec<Rect> = Vec::new();
        for slice in of_kind {
            let (start, end) = (x(slice.start_us), x(slice.start_us + slice.dur_us));
            match rects.last_mut() {
                Some(last) if start - last.1 < 0.5 => {
                    last.1 = last.1.max(end);
                    last.2 = None;
                }
                _ => rects.push((start, end, Some(format!("{} · {}", slice.label, seconds(slice.dur_us / 1e6))))),
            }
        }
        out.push((kind, rects));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn slice(pid: u64, name: &str, cat: &str, ts: f64, dur: f64, step: u64) -> Value {
        json!({"ph": "X", "pid": pid, "tid": 1, "name": name, "cat": cat, "ts": ts, "dur": dur, "args": {"step": step}})
    }

    #[test]
    fn lanes_follow_the_traces_order_and_keep_one_step() {
        let events = vec![
            json!({"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "second"}}),
            json!({"ph": "M", "name": "process_sort_index", "pid": 2, "args": {"sort_index": 1}}),
            json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "first"}}),
            json!({"ph": "M", "name": "process_sort_index", "pid": 1, "args": {"sort_index": 0}}),
            slice(1, "forward mb0 c0", "compute", 100.0, 10.0, 1),
            slice(2, "backward mb0 c0", "compute", 130.0, 20.0, 1),
            slice(2, "recv-gradient mb0 c0 <- 1", "wait", 110.0, 20.0, 1),
            slice(1, "forward mb0 c0", "compute", 500.0, 10.0, 2),
        ];
        let lanes = Lanes::from_events(&events, Some(1), 8);
        assert_eq!(lanes.lanes.iter().map(|lane| lane.name.as_str()).collect::<Vec<_>>(), ["first", "second"]);
        assert_eq!((lanes.ranks, lanes.span_us), (2, 50.0), "step 2 left out, time from the step's start");
        assert_eq!(lanes.lanes[1].slices[0].kind, Kind::Backward);
        assert_eq!(lanes.lanes[1].slices[1].kind, Kind::Wait);
        assert_eq!(Lanes::from_events(&events, None, 1).lanes.len(), 1);
    }

    #[test]
    fn slices_closer_than_half_a_pixel_merge_and_lose_their_names() {
        let slices: Vec<Slice> = (0..1000)
            .map(|idx| Slice { start_us: idx as f64, dur_us: 1.0, kind: Kind::Forward, label: "F".into() })
            .collect();
        let rects = merged(&slices, |us| us / 1000.0 * 100.0);
        assert_eq!(rects.len(), 1);
        assert_eq!(rects[0].1.len(), 1, "1000 slices on 100 px are one rectangle");
        assert_eq!(rects[0].1[0].2, None);
        let apart = merged(&slices[..2], |us| us * 10.0);
        assert_eq!(apart[0].1.len(), 1, "touching slices merge");
        let far = [slices[0].clone(), Slice { start_us: 50.0, ..slices[0].clone() }];
        let far = merged(&far, |us| us);
        assert_eq!(far[0].1.len(), 2);
        assert_eq!(far[0].1[1].2.as_deref(), Some("F · 1.0 µs"));
    }

    #[test]
    fn every_trace_slice_kind_the_engines_write_is_known() {
        for (cat, name, kind) in [
            ("compute", "F mb0", Kind::Forward),
            ("compute", "B mb0", Kind::Backward),
            ("compute", "W mb0", Kind::WeightGrad),
            ("compute", "backward-weight mb0 c0", Kind::WeightGrad),
            ("compute", "backward-input mb0 c0", Kind::Backward),
            ("optimizer", "optimizer step", Kind::Optimizer),
            ("compute", "optimizer-step", Kind::Optimizer),
            ("wait", "wait activation", Kind::Wait),
            ("collective", "all-reduce-gradients dp0 layers 0..8", Kind::Collective),
            ("send", "send-activation mb0 c0 -> 1", Kind::Transfer),
            ("transfer", "activation mb0 r0s0→r0s1", Kind::Transfer),
        ] {
            assert_eq!(Kind::of(cat, name), Some(kind), "{cat} {name}");
        }
    }
}
