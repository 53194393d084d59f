//! The plan as a picture: one row per replica, its stages in layer order as boxes as wide as
//! their layers, coloured by device type, joined by their pipeline routes (red and dashed where
//! a boundary crosses vendors).

use medley_plan::{Plan, Route, Stage};
use medley_spec::Vendor;

use crate::svg::Svg;

/// Rows drawn before the rest are summed up in one line.
const MAX_ROWS: usize = 16;

/// Fill colours per vendor, one per device type in the cluster's order.
fn palette(vendor: Vendor) -> &'static [&'static str] {
    match vendor {
        Vendor::Nvidia => &["#76b900", "#3f7f1a", "#a9d672", "#2b5d0e"],
        Vendor::Amd => &["#e2474d", "#a8242a", "#f08a8e", "#7a1418"],
    }
}

/// Each device type of the cluster and its colour: NVIDIA's greens, AMD's reds.
pub fn device_colours(plan: &Plan) -> Vec<(String, &'static str)> {
    let mut colours: Vec<(String, Vendor, &'static str)> = Vec::new();
    for device in plan.cluster().groups().iter().map(|group| &group.device) {
        if colours.iter().any(|(name, _, _)| *name == device.name) {
            continue;
        }
        let of_vendor = colours.iter().filter(|(_, vendor, _)| *vendor == device.vendor).count();
        let choices = palette(device.vendor);
        colours.push((device.name.clone(), device.vendor, choices[of_vendor % choices.len()]));
    }
    colours.into_iter().map(|(name, _, colour)| (name, colour)).collect()
}

fn range_text(devices: &[u32]) -> String {
    match devices {
        [] => String::new(),
        [one] => format!("device {one}"),
        [first, .., last] if (*last - *first) as usize + 1 == devices.len() => format!("devices {first}–{last}"),
        _ => format!("devices {}", devices.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")),
    }
}

/// The plan picture, `width` pixels wide.
pub fn plan_svg(plan: &Plan, width: f64) -> String {
    const LABEL: f64 = 190.0;
    const ROW: f64 = 50.0;
    const GAP: f64 = 8.0;
    let colours = device_colours(plan);
    let colour = |name: &str| colours.iter().find(|(known, _)| known == name).map_or("#999", |(_, colour)| colour);
    let rows = alike_runs(plan);
    let shown = rows.len().min(MAX_ROWS);
    let more: usize = rows[shown..].iter().map(|(_, count)| count).sum();
    let height = ROW * shown as f64 + if more > 0 { 22.0 } else { 0.0 } + 34.0;
    let mut svg = Svg::new("plan", width, height);
    let n_layers = f64::from(plan.model().n_layers());
    for (row, &(first, count)) in rows.iter().take(shown).enumerate() {
        let replica = &plan.replicas()[first];
        let top = ROW * row as f64 + 4.0;
        let gaps = GAP * (replica.stages.len() - 1) as f64;
        let plot = width - LABEL - 10.0 - gaps;
        let (name, shares) = match count {
            1 => (format!("replica {first}"), format!("{} micro-batches", replica.n_micro_batches)),
            _ => (
                format!("replicas {first}–{}", first + count - 1),
                format!("{count} alike, {} micro-batches each", replica.n_micro_batches),
            ),
        };
        svg.text((LABEL - 8.0, top + 17.0), &name, r#"text-anchor="end" font-weight="bold""#);
        svg.text((LABEL - 8.0, top + 31.0), &shares, r#"text-anchor="end""#);
        let mut x = LABEL;
        for (stage_idx, stage) in replica.stages.iter().enumerate() {
            let w = f64::from(stage.layers.len()) / n_layers * plot;
            let device = &plan.stage_group(stage).device.name;
            let tip = stage_tip(plan, stage);
            svg.rect((x, top, w.max(2.0), 36.0), &format!(r##"fill="{}" stroke="#fff""##, colour(device)), Some(&tip));
            let full = match (stage.context.is_some(), stage.devices.len()) {
                (true, _) | (false, 1) => plan.stage_label(stage),
                (false, n) => format!("{} ×{n}", plan.stage_label(stage)),
            };
            // Narrow boxes keep the device type's short name and the layer numbers.
            let (label, layers) = match w {
                w if w > 110.0 => (full, layers_text(stage)),
                w if w > 34.0 => (device.split('-').next().unwrap_or(device).to_string(), short_layers(stage)),
                _ => (String::new(), String::new()),
            };
            svg.text((x + 4.0, top + 15.0), &label, r##"fill="#fff" font-weight="bold""##);
            svg.text((x + 4.0, top + 29.0), &layers, r##"fill="#fff""##);
            x += w;
            if let Some(route) = replica.boundaries.get(stage_idx) {
                let bridge = matches!(route, Route::Bridge { .. });
                let style = match bridge {
                    true => r##"stroke="#c00" stroke-width="3" stroke-dasharray="3,2""##,
                    false => r##"stroke="#888" stroke-width="2""##,
                };
                svg.line((x + 1.0, top + 18.0), (x + GAP - 1.0, top + 18.0), style);
                let what = if bridge { "across vendors" } else { "inside a vendor" };
                svg.rect(
                    (x, top, GAP, 36.0),
                    r#"fill="transparent""#,
                    Some(&format!("pipeline boundary {what}: {route}")),
                );
                x += GAP;
            }
        }
    }
    let mut y = ROW * shown as f64 + 8.0;
    if more > 0 {
        svg.text((LABEL, y + 6.0), &format!("… and {more} more replicas"), r##"fill="#555""##);
        y += 22.0;
    }
    let mut legend_x = LABEL;
    for (name, colour) in &colours {
        svg.rect((legend_x, y, 12.0, 12.0), &format!(r#"fill="{colour}""#), None);
        svg.text((legend_x + 16.0, y + 10.0), name, "");
        legend_x += 30.0 + 7.0 * name.len() as f64;
    }
    svg.line(
        (legend_x, y + 6.0),
        (legend_x + 16.0, y + 6.0),
        r##"stroke="#c00" stroke-width="3" stroke-dasharray="3,2""##,
    );
    svg.text((legend_x + 20.0, y + 10.0), "boundary across vendors", "");
    svg.finish()
}

/// Consecutive replicas that look alike in the picture (same device types, layers, routes and
/// batch share) as (first, count).
fn alike_runs(plan: &Plan) -> Vec<(usize, usize)> {
    let look = |replica: &medley_plan::Replica| {
        let stages: Vec<(String, u32, u32)> = replica
            .stages
            .iter()
            .map(|stage| (plan.stage_label(stage), stage.layers.start, stage.layers.end))
            .collect();
        (replica.n_micro_batches, stages, replica.boundaries.clone())
    };
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (idx, replica) in plan.replicas().iter().enumerate() {
        match runs.last_mut() {
            Some((first, count)) if look(&plan.replicas()[*first]) == look(replica) => *count += 1,
            _ => runs.push((idx, 1)),
        }
    }
    runs
}

fn layers_text(stage: &Stage) -> String {
    match stage.layers.len() {
        0 => "no layers".into(),
        1 => format!("layer {}", stage.layers.start),
        _ => format!("layers {}–{}", stage.layers.start, stage.layers.end - 1),
    }
}

/// `24–42`: a stage's layers in a narrow box.
fn short_layers(stage: &Stage) -> String {
    match stage.layers.len() {
        0 => String::new(),
        1 => stage.layers.start.to_string(),
        _ => format!("{}–{}", stage.layers.start, stage.layers.end - 1),
    }
}

/// A stage's hover text: what it runs on, which layers, and how it splits sequences.
fn stage_tip(plan: &Plan, stage: &Stage) -> String {
    let mut tip = format!("{} · {} · {}", plan.stage_label(stage), layers_text(stage), range_text(&stage.devices));
    if let Some(context) = &stage.context {
        let shards: Vec<String> = context.groups.iter().map(|group| group.tokens.to_string()).collect();
        tip.push_str(&format!(" · sequence shards of {} tokens", shards.join("/")));
    }
    tip
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_ranges_read_as_people_write_them() {
        assert_eq!(range_text(&[3]), "device 3");
        assert_eq!(range_text(&[4, 5, 6, 7]), "devices 4–7");
        assert_eq!(range_text(&[0, 2]), "devices 0,2");
    }
}
