//! A small SVG writer: every text escaped, numbers rounded to what a screen can show.

use std::fmt::Write;

/// Text made safe inside HTML and SVG: markup characters escaped, control characters (terminal
/// escape sequences from an input file's names) dropped.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// An SVG element being written: its size and its children's markup.
pub struct Svg {
    width: f64,
    height: f64,
    id: &'static str,
    body: String,
}

impl Svg {
    /// An SVG of `width` × `height` pixels whose root carries `id` (the page's self-check finds it
    /// by that id).
    pub fn new(id: &'static str, width: f64, height: f64) -> Svg {
        Svg { width, height, id, body: String::new() }
    }

    /// A rectangle; `tip` becomes its hover text.
    pub fn rect(&mut self, (x, y, w, h): (f64, f64, f64, f64), style: &str, tip: Option<&str>) {
        let _ = write!(self.body, r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.2}" height="{h:.1}" {style}"#);
        match tip {
            Some(tip) => {
                let _ = write!(self.body, "><title>{}</title></rect>", escape(tip));
            }
            None => self.body.push_str("/>"),
        }
    }

    /// Text at (`x`, `y`); `attrs` adds attributes such as `text-anchor="end"`.
    pub fn text(&mut self, (x, y): (f64, f64), text: &str, attrs: &str) {
        let _ = write!(self.body, r#"<text x="{x:.1}" y="{y:.1}" {attrs}>{}</text>"#, escape(text));
    }

    pub fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), style: &str) {
        let _ = write!(self.body, r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" {style}/>"#);
    }

    /// A line through `points`.
    pub fn polyline(&mut self, points: &[(f64, f64)], style: &str) {
        let points: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = write!(self.body, r#"<polyline points="{}" fill="none" {style}/>"#, points.join(" "));
    }

    /// Markup written as it is: definitions such as patterns and markers.
    pub fn raw(&mut self, markup: &str) {
        self.body.push_str(markup);
    }

    pub fn finish(self) -> String {
        format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" id="{}" data-check="" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="11">{}</svg>"#,
            self.id,
            self.body,
            w = self.width,
            h = self.height,
        )
    }
}

/// Round tick values for an axis from 0 to `max`: steps of 1, 2 or 5 times a power of ten, at
/// most about `count` of them.
pub fn ticks(max: f64, count: usize) -> Vec<f64> {
    if !(max > 0.0 && max.is_finite()) {
        return vec![0.0];
    }
    let rough = max / count.max(1) as f64;
    let power = 10f64.powf(rough.log10().floor());
    let step =
        [1.0, 2.0, 5.0, 10.0].into_iter().map(|factor| factor * power).find(|&step| step >= rough).unwrap_or(power);
    (0..).map(|idx| idx as f64 * step).take_while(|&tick| tick <= max * (1.0 + 1e-9)).collect()
}

/// A time axis tick: in the unit its step reads best in, with the decimals the step needs.
pub fn seconds_tick(tick_s: f64, step_s: f64) -> String {
    let (scale, unit) = match step_s {
        s if s >= 0.1 => (1.0, "s"),
        s if s >= 1e-4 => (1e3, "ms"),
        _ => (1e6, "µs"),
    };
    let decimals = (-(step_s * scale).log10().floor()).max(0.0) as usize;
    match tick_s {
        0.0 => "0".into(),
        _ => format!("{:.decimals$} {unit}", tick_s * scale),
    }
}

/// A plain number tick with the decimals its step needs.
pub fn number_tick(tick: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{tick:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_leaves_no_markup_and_no_control_characters() {
        assert_eq!(escape("<b>\"x\" & 'y'</b>\u{1b}[31m"), "&lt;b&gt;&quot;x&quot; &amp; &#39;y&#39;&lt;/b&gt;[31m");
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(10.0, 5), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(0.37, 4), [0.0, 0.1, 0.2, 0.30000000000000004]);
        assert_eq!(ticks(0.0, 4), [0.0]);
        assert!(ticks(123_456.0, 6).len() <= 7);
    }
    #[test]
    fn ticks_read_in_the_unit_of_their_step() {
        assert_eq!(seconds_tick(0.0, 5.0), "0");
        assert_eq!(seconds_tick(25.0, 5.0), "25 s");
        assert_eq!(seconds_tick(0.004, 0.002), "4 ms");
        assert_eq!(seconds_tick(0.0015, 0.0005), "1.5 ms");
        assert_eq!(seconds_tick(40e-6, 20e-6), "40 µs");
    }

    #[test]
    fn plain_ticks_keep_the_decimals_of_their_step() {
        assert_eq!(number_tick(4.0, 2.0), "4");
        assert_eq!(number_tick(0.5, 0.5), "0.5");
        assert_eq!(number_tick(0.25, 0.05), "0.25");
    }
}
