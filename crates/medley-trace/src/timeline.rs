//! A Chrome/Perfetto trace (the JSON "Trace Event Format"), written event by event as the
//! simulation runs so that a long run never holds its timeline in memory.
//!
//! The runtime writes its real runs with this same writer, so a simulated and a measured step
//! open side by side.
//!
//! Layout: one process per pipeline rank (a tensor-parallel group, whose devices run in lock
//! step), one thread per stream: compute (with the waits that stall it), collectives, and one
//! lane per concurrent outgoing transfer, so slices on a track never overlap. Point-to-point
//! transfers carry flow arrows from sender to receiver; memory is a counter per rank.
//! Timestamps are microseconds with nanosecond decimals.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::{Value, json};

/// Thread ids: fixed streams first, transfer lanes after.
pub const COMPUTE_TID: u32 = 1;
pub const COLLECTIVE_TID: u32 = 2;
/// A long-context stage's first layer of each pass, phase by phase, on its slowest device.
pub const LAYER_TID: u32 = 3;
const FIRST_LANE_TID: u32 = 10;

pub fn lane_tid(lane: u32) -> u32 {
    FIRST_LANE_TID + lane
}

/// Writes trace events to `out`; the first I/O error is kept and reported by [`Timeline::finish`]
/// so the simulation loop need not handle it at every event.
pub struct Timeline<'w> {
    out: &'w mut dyn Write,
    /// Each event is written here first, then to `out` in one piece.
    buffer: Vec<u8>,
    wrote_event: bool,
    error: Option<io::Error>,
    next_flow_id: u64,
}

/// A complete slice, its keys in the order `serde_json::Value` writes them (sorted), so that it
/// reads as every other event does.
#[derive(Serialize)]
struct Slice<'a, A: Serialize> {
    args: &'a A,
    cat: &'a str,
    dur: f64,
    name: &'a str,
    ph: &'static str,
    pid: u32,
    tid: u32,
    ts: f64,
}

/// One end of a flow arrow, its keys sorted as [`Slice`]'s.
#[derive(Serialize)]
struct FlowEnd<'a> {
    cat: &'static str,
    id: u64,
    name: &'a str,
    ph: &'static str,
    pid: u32,
    tid: u32,
    ts: f64,
}

/// The pause drawn between the segments of a merged trace, µs.
const SEGMENT_GAP_US: f64 = 1_000.0;

impl<'w> Timeline<'w> {
    pub fn new(out: &'w mut dyn Write) -> Self {
        let mut timeline = Timeline { out, buffer: Vec::new(), wrote_event: false, error: None, next_flow_id: 0 };
        timeline.raw(br#"{"displayTimeUnit":"ns","traceEvents":["#);
        timeline
    }

    /// Names a rank's process and its fixed threads; `sort` orders processes in the viewer.
    pub fn process(&mut self, pid: u32, name: &str, sort: u32) {
        self.event(&json!({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}));
        self.event(&json!({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": sort}}));
        self.thread(pid, COMPUTE_TID, "compute");
        self.thread(pid, COLLECTIVE_TID, "collectives");
    }

    /// Names a thread; threads sort by id.
    pub fn thread(&mut self, pid: u32, tid: u32, name: &str) {
        self.event(&json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}));
        self.event(
            &json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}),
        );
    }

    /// A complete slice from `start_ns` to `end_ns`.
    pub fn slice(&mut self, track: (u32, u32), name: &str, category: &str, span_ns: (u64, u64), args: &impl Serialize) {
        let (pid, tid) = track;
        let (start_ns, end_ns) = span_ns;
        let (ts, dur) = (micros(start_ns), micros(end_ns - start_ns));
        self.event(&Slice { args, cat: category, dur, name, ph: "X", pid, tid, ts });
    }

    /// A flow arrow from the slice on `from` that encloses `from_ns` to the next slice on `to`
    /// that starts at or after `to_ns` (the pass that consumes the message).
    pub fn arrow(&mut self, name: &str, from: (u32, u32), from_ns: u64, to: (u32, u32), to_ns: u64) {
        let id = self.next_flow_id;
        self.next_flow_id += 1;
        let (pid, tid, ts) = (from.0, from.1, micros(from_ns));
        self.event(&FlowEnd { cat: "transfer", id, name, ph: "s", pid, tid, ts });
        let (pid, tid, ts) = (to.0, to.1, micros(to_ns));
        self.event(&FlowEnd { cat: "transfer", id, name, ph: "f", pid, tid, ts });
    }

    pub fn counter(&mut self, pid: u32, name: &str, at_ns: u64, value: f64) {
        self.event(&json!({"ph": "C", "name": name, "pid": pid, "ts": micros(at_ns), "args": {name: value}}));
    }

    /// Closes the JSON document; the first write error, if any.
    pub fn finish(mut self) -> io::Result<()> {
        self.raw(b"]}\n");
        if self.error.is_none()
            && let Err(err) = self.out.flush()
        {
            self.error = Some(err);
        }
        self.error.map_or(Ok(()), Err)
    }

    fn event(&mut self, event: &impl Serialize) {
        if self.error.is_some() {
            return;
        }
        self.buffer.clear();
        self.buffer.extend_from_slice(if self.wrote_event { b",\n" } else { b"\n" });
        self.wrote_event = true;
        let result = serde_json::to_writer(&mut self.buffer, event)
            .map_err(io::Error::from)
            .and_then(|()| self.out.write_all(&self.buffer));
        if let Err(err) = result {
            self.error = Some(err);
        }
    }

    fn raw(&mut self, bytes: &[u8]) {
        if self.error.is_none()
            && let Err(err) = self.out.write_all(bytes)
        {
            self.error = Some(err);
        }
    }
}

/// The events of a trace this writer wrote (one event per line), as far as they are whole: a
/// trace cut short (its process killed while writing) keeps every event written in full.
pub fn trace_events(text: &str) -> Vec<Value> {
    text.lines()
        .skip(1)
        .map(|line| {
            let line = line.trim_end();
            let line = line.strip_suffix("]}").unwrap_or(line);
            line.strip_suffix(',').unwrap_or(line)
        })
        .map_while(|line| serde_json::from_str::<Value>(line).ok())
        .filter(Value::is_object)
        .collect()
}

/// One trace of `segments` (each the events of one clock, such as a run and its resumptions),
/// each segment shifted to begin after the previous ones end; flow ids are renumbered apart.
pub fn merge_segments(segments: Vec<Vec<Value>>) -> Value {
    let mut events = Vec::new();
    let (mut end_us, mut flow_base) = (0.0f64, 0u64);
    for segment in segments {
        let offset_us = if events.is_empty() { 0.0 } else { end_us + SEGMENT_GAP_US };
        let mut flows = 0;
        for mut event in segment {
            if let Some(ts) = event.get("ts").and_then(Value::as_f64) {
                let shifted = ts + offset_us;
                end_us = end_us.max(shifted + event.get("dur").and_then(Value::as_f64).unwrap_or(0.0));
                event["ts"] = shifted.into();
            }
            if let Some(id) = event.get("id").and_then(Value::as_u64) {
                flows = flows.max(id + 1);
                event["id"] = (flow_base + id).into();
            }
            events.push(event);
        }
        flow_base += flows;
    }
    json!({"displayTimeUnit": "ns", "traceEvents": events})
}

/// Nanoseconds as microseconds; an f64 holds every nanosecond of a run shorter than 104 days.
fn micros(ns: u64) -> f64 {
    ns as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(build: impl FnOnce(&mut Timeline)) -> Vec<u8> {
        let mut bytes = Vec::new();
        let mut timeline = Timeline::new(&mut bytes);
        build(&mut timeline);
        timeline.finish().unwrap();
        bytes
    }

    #[test]
    fn merged_segments_follow_one_another_and_keep_their_flows_apart() {
        let segment = |name: &str| {
            let bytes = write(|t| {
                t.slice((1, COMPUTE_TID), name, "compute", (1_000, 5_000), &json!({}));
                t.arrow("act", (1, COMPUTE_TID), 2_000, (2, COMPUTE_TID), 3_000);
            });
            trace_events(std::str::from_utf8(&bytes).unwrap())
        };
        let merged = merge_segments(vec![segment("first"), segment("resumed")]);
        let events = merged["traceEvents"].as_array().unwrap();
        let slices: Vec<(&str, f64)> = events
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| (e["name"].as_str().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        assert_eq!(slices, [("first", 1.0), ("resumed", 5.0 + SEGMENT_GAP_US + 1.0)]);
        let flow_ids: Vec<u64> = events.iter().filter(|e| e["ph"] == "s").map(|e| e["id"].as_u64().unwrap()).collect();
        assert_eq!(flow_ids, [0, 1]);
    }

    #[test]
    fn a_trace_cut_short_keeps_its_whole_events() {
        let whole = write(|t| {
            t.slice((1, COMPUTE_TID), "F0", "compute", (0, 1_000), &json!({}));
            t.slice((1, COMPUTE_TID), "F1", "compute", (1_000, 2_000), &json!({}));
        });
        let names = |bytes: &[u8]| -> Vec<Value> {
            trace_events(&String::from_utf8_lossy(bytes)).iter().map(|e| e["name"].clone()).collect()
        };
        assert_eq!(names(&whole), [json!("F0"), json!("F1")]);
        assert_eq!(names(&whole[..whole.len() - 20]), [json!("F0")]);
    }
}
