//! Time-varying available bandwidth: a network shared with other jobs gives a link only a
//! fraction of its capacity, and that fraction changes over time.
//!
//! A [`BandwidthTrace`] describes the fraction over time; [`TraceCursor`] walks one link's
//! instance of it as a sequence of change points in simulated nanoseconds. Random traces draw
//! each link's periods from its own seeded stream, so links are preempted independently and the
//! same seed always gives the same periods.

use std::fmt;
use std::str::FromStr;

use medley_spec::echo;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A bandwidth trace that does not parse, naming where and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TraceError(pub String);

/// The least fraction of its bandwidth a trace may leave a link, other than 0 (a link that is
/// down): a millionth of a 400 Gb/s NIC is 50 kB/s, and anything slower stands for a link that
/// is down, which 0 says. Below it the simulated times of ordinary transfers run past any clock.
pub const MIN_FRACTION: f64 = 1e-6;

/// The latest time a trace may name, and its longest period, s (about 32 years): as far as the
/// simulator's nanosecond clock is let run.
pub const MAX_TIME_S: f64 = 1e9;

/// The fraction of a link's bandwidth that is available over time. Invariant (held by the
/// parsers, [`FromStr`] and [`BandwidthTrace::from_csv`]): every fraction is 0 or from
/// [`MIN_FRACTION`] to 1, every time and period at most [`MAX_TIME_S`].
#[derive(Clone, Debug, PartialEq)]
pub enum BandwidthTrace {
    /// Always `fraction`.
    Constant { fraction: f64 },
    /// Full bandwidth for `full_ns`, then `fraction` of it for `reduced_ns`, repeating.
    OnOff { full_ns: u64, reduced_ns: u64, fraction: f64 },
    /// Full and reduced periods of exponentially distributed lengths with the given means (a
    /// link preempted at random by other jobs), drawn per link from `seed`.
    Random { seed: u64, mean_full_ns: u64, mean_reduced_ns: u64, fraction: f64 },
    /// From each point's time on, its fraction; full bandwidth before the first point. Times
    /// ascend.
    Points(Vec<(u64, f64)>),
}

impl BandwidthTrace {
    /// A trace from CSV text: one `time_s,fraction` row per line, times ascending; a header row
    /// and blank lines are skipped, fields may be quoted (as spreadsheet and monitoring exports
    /// write them). `source` names the file in errors.
    pub fn from_csv(text: &str, source: &str) -> Result<Self, TraceError> {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .trim(csv::Trim::All)
            .from_reader(text.as_bytes());
        let mut points = Vec::new();
        let mut first_row = true;
        for (row_idx, row) in reader.records().enumerate() {
            let row = row.map_err(|err| TraceError(format!("{}: {}", echo(source), echo(&err.to_string()))))?;
            if row.iter().all(str::is_empty) {
                continue;
            }
            let line = row.position().map_or(row_idx as u64 + 1, csv::Position::line);
            let error = |message: String| TraceError(format!("{}:{line}: {message}", echo(source)));
            let is_header =
                std::mem::take(&mut first_row) && row.get(0).is_some_and(|first| first.parse::<f64>().is_err());
            if is_header {
                continue;
            }
            let (Some(time), Some(fraction), None) = (row.get(0), row.get(1), row.get(2)) else {
                let row = row.iter().collect::<Vec<_>>().join(",");
                return Err(error(format!("`{}`: expected time_s,fraction", echo(&row))));
            };
            let time_s: f64 = time.parse().map_err(|_| error(format!("`{}` is not a time in seconds", echo(time))))?;
            if !(time_s.is_finite() && time_s >= 0.0) {
                return Err(error(format!("time {time_s} must be a non-negative number of seconds")));
            }
            if time_s > MAX_TIME_S {
                return Err(error(format!(
                    "time {time_s:e} s is beyond {MAX_TIME_S:e} s, the latest a trace may name"
                )));
            }
            let fraction = parse_fraction(fraction).map_err(error)?;
            let time_ns = seconds_to_ns(time_s);
            if points.last().is_some_and(|&(last, _)| time_ns < last) {
                return Err(error(format!("time {time_s} s comes before the previous row's; times must ascend")));
            }
            points.push((time_ns, fraction));
        }
        if points.is_empty() {
            return Err(TraceError(format!("{}: no time_s,fraction rows", echo(source))));
        }
        Ok(BandwidthTrace::Points(points))
    }
}

impl FromStr for BandwidthTrace {
    type Err = TraceError;

    /// `constant:F`, `on-off:full=T,reduced=T,fraction=F` or
    /// `random:seed=N,full=T,reduced=T,fraction=F`, with times like `2s`, `500ms`, `40us`.
    /// CSV traces come from [`BandwidthTrace::from_csv`].
    fn from_str(text: &str) -> Result<Self, TraceError> {
        let error = |message: String| TraceError(format!("network trace `{}`: {message}", echo(text)));
        let (kind, rest) = text.split_once(':').unwrap_or((text, ""));
        match kind.trim() {
            "constant" => Ok(BandwidthTrace::Constant { fraction: parse_fraction(rest.trim()).map_err(error)? }),
            "on-off" => {
                let fields = Fields::parse(rest, &["full", "reduced", "fraction"]).map_err(error)?;
                Ok(BandwidthTrace::OnOff {
                    full_ns: fields.duration_ns("full").map_err(error)?,
                    reduced_ns: fields.duration_ns("reduced").map_err(error)?,
                    fraction: fields.fraction().map_err(error)?,
                })
            }
            "random" => {
                let fields = Fields::parse(rest, &["seed", "full", "reduced", "fraction"]).map_err(error)?;
                let seed = fields.get("seed").map_err(error)?;
                Ok(BandwidthTrace::Random {
                    seed: seed.parse().map_err(|_| error(format!("seed `{}` is not a whole number", echo(seed))))?,
                    mean_full_ns: fields.duration_ns("full").map_err(error)?,
                    mean_reduced_ns: fields.duration_ns("reduced").map_err(error)?,
                    fraction: fields.fraction().map_err(error)?,
                })
            }
            other => Err(error(format!("unknown kind `{}`; expected constant, on-off, random or csv", echo(other)))),
        }
    }
}

impl fmt::Display for BandwidthTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BandwidthTrace::Constant { fraction } => write!(f, "constant:{fraction}"),
            BandwidthTrace::OnOff { full_ns, reduced_ns, fraction } => {
                write!(f, "on-off:full={}ms,reduced={}ms,fraction={fraction}", ms(*full_ns), ms(*reduced_ns))
            }
            BandwidthTrace::Random { seed, mean_full_ns, mean_reduced_ns, fraction } => write!(
                f,
                "random:seed={seed},full={}ms,reduced={}ms,fraction={fraction}",
                ms(*mean_full_ns),
                ms(*mean_reduced_ns)
            ),
            BandwidthTrace::Points(points) => write!(f, "csv ({} points)", points.len()),
        }
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// `key=value` pairs, each of the expected keys exactly once.
struct Fields<'a>(Vec<(&'a str, &'a str)>);

impl<'a> Fields<'a> {
    fn parse(text: &'a str, expected: &[&str]) -> Result<Self, String> {
        let mut pairs = Vec::new();
        for part in text.split(',').map(str::trim).filter(|part| !part.is_empty()) {
            let (key, value) = part.split_once('=').ok_or_else(|| format!("`{}`: expected KEY=VALUE", echo(part)))?;
            let key = key.trim();
            if !expected.contains(&key) {
                return Err(format!("unknown key `{}`; expected {}", echo(key), expected.join(", ")));
            }
            pairs.push((key, value.trim()));
        }
        for key in expected {
            if pairs.iter().filter(|(k, _)| k == key).count() != 1 {
                return Err(format!("give `{key}=` exactly once"));
            }
        }
        Ok(Fields(pairs))
    }

    fn get(&self, key: &str) -> Result<&'a str, String> {
        self.0.iter().find(|(k, _)| *k == key).map(|(_, v)| *v).ok_or_else(|| format!("missing `{key}=`"))
    }

    fn duration_ns(&self, key: &str) -> Result<u64, String> {
        let text = self.get(key)?;
        let ns = parse_duration_ns(text)
            .ok_or_else(|| format!("`{key}={}`: expected a duration like 2s or 500ms", echo(text)))?;
        if ns > seconds_to_ns(MAX_TIME_S) {
            return Err(format!("`{key}={}`: periods are at most {MAX_TIME_S:e} s", echo(text)));
        }
        if ns < MIN_PERIOD_NS {
            return Err(format!(
                "`{key}={}`: periods are at least 10us (bandwidth other jobs take changes over microseconds or \
                 more, and each change is an event to simulate)",
                echo(text)
            ));
        }
        Ok(ns)
    }

    fn fraction(&self) -> Result<f64, String> {
        parse_fraction(self.get("fraction")?)
    }
}

fn parse_fraction(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(fraction) if fraction == 0.0 || (MIN_FRACTION..=1.0).contains(&fraction) => Ok(fraction),
        Ok(fraction) if fraction > 0.0 && fraction < MIN_FRACTION => Err(format!(
            "fraction `{}` is below the floor of {MIN_FRACTION:e}: give 0 for a link that is down, \
             or at least {MIN_FRACTION:e}",
            echo(text)
        )),
        _ => Err(format!("fraction `{}` must be a number from 0 to 1", echo(text))),
    }
}

/// The shortest period of an on-off or random trace.
const MIN_PERIOD_NS: u64 = 10_000;

/// `2s`, `1.5s`, `500ms`, `40us`, `100ns`: humantime's durations.
fn parse_duration_ns(text: &str) -> Option<u64> {
    humantime::parse_duration(text).ok().and_then(|duration| u64::try_from(duration.as_nanos()).ok())
}

fn seconds_to_ns(seconds: f64) -> u64 {
    (seconds * 1e9).round() as u64
}

/// One link's walk through a trace: the fraction at time 0, then each change in order.
pub struct TraceCursor {
    state: CursorState,
}

enum CursorState {
    Done,
    Periodic { next_ns: u64, full: bool, full_ns: u64, reduced_ns: u64, fraction: f64 },
    Random { next_ns: u64, full: bool, rng: Box<ChaCha8Rng>, mean_full_ns: f64, mean_reduced_ns: f64, fraction: f64 },
    Points { points: Vec<(u64, f64)>, next_idx: usize },
}

impl TraceCursor {
    /// The cursor for link number `link` of `trace`, and the fraction the link starts with.
    pub fn new(trace: &BandwidthTrace, link: u64) -> (f64, Self) {
        match *trace {
            BandwidthTrace::Constant { fraction } => (fraction, TraceCursor { state: CursorState::Done }),
            BandwidthTrace::OnOff { full_ns, reduced_ns, fraction } => (
                1.0,
                TraceCursor {
                    state: CursorState::Periodic { next_ns: full_ns, full: true, full_ns, reduced_ns, fraction },
                },
            ),
            BandwidthTrace::Random { seed, mean_full_ns, mean_reduced_ns, fraction } => {
                // One stream per link; the stream number keeps links independent under one seed.
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(link);
                let (mean_full, mean_reduced) = (mean_full_ns as f64, mean_reduced_ns as f64);
                // Start in each state with its long-run probability.
                let full = rng.random::<f64>() < mean_full / (mean_full + mean_reduced);
                let next_ns = exponential_ns(&mut rng, if full { mean_full } else { mean_reduced });
                let state = CursorState::Random {
                    next_ns,
                    full,
                    rng: Box::new(rng),
                    mean_full_ns: mean_full,
                    mean_reduced_ns: mean_reduced,
                    fraction,
                };
                (if full { 1.0 } else { fraction }, TraceCursor { state })
            }
            BandwidthTrace::Points(ref points) => {
                let starts_at_zero = points.first().is_some_and(|&(time, _)| time == 0);
                let initial = if starts_at_zero { points[0].1 } else { 1.0 };
                let next_idx = usize::from(starts_at_zero);
                (initial, TraceCursor { state: CursorState::Points { points: points.clone(), next_idx } })
            }
        }
    }

    /// The next change: when it happens and the fraction from then on.
    pub fn next_change(&mut self) -> Option<(u64, f64)> {
        match &mut self.state {
            CursorState::Done => None,
            CursorState::Periodic { next_ns, full, full_ns, reduced_ns, fraction } => {
                let at_ns = *next_ns;
                *full = !*full;
                *next_ns = at_ns.saturating_add(if *full { *full_ns } else { *reduced_ns });
                Some((at_ns, if *full { 1.0 } else { *fraction }))
            }
            CursorState::Random { next_ns, full, rng, mean_full_ns, mean_reduced_ns, fraction } => {
                let at_ns = *next_ns;
                *full = !*full;
                let mean = if *full { *mean_full_ns } else { *mean_reduced_ns };
                *next_ns = at_ns.saturating_add(exponential_ns(rng, mean));
                Some((at_ns, if *full { 1.0 } else { *fraction }))
            }
            CursorState::Points { points, next_idx } => {
                let point = points.get(*next_idx).copied();
                *next_idx += 1;
                point
            }
        }
    }
}

/// One link's bandwidth over time, asked in time order: how the runtime throttles a real link
/// with the same traces the simulator reads.
pub struct TraceWalker {
    fraction: f64,
    next: Option<(u64, f64)>,
    cursor: TraceCursor,
}

impl TraceWalker {
    /// The walk of link number `link` (links draw independent random periods) through `trace`.
    pub fn new(trace: &BandwidthTrace, link: u64) -> Self {
        let (fraction, mut cursor) = TraceCursor::new(trace, link);
        let next = cursor.next_change();
        TraceWalker { fraction, next, cursor }
    }

    /// When `bytes` that start at `start_ns` finish at `full_bytes_per_s` times the trace's
    /// fraction, which may change on the way. Calls must not go back in time.
    pub fn finish_ns(&mut self, start_ns: u64, bytes: f64, full_bytes_per_s: f64) -> u64 {
        let (mut now_ns, mut left) = (start_ns, bytes);
        loop {
            while let Some((_, fraction)) = self.next.filter(|&(at_ns, _)| at_ns <= now_ns) {
                self.fraction = fraction;
                self.next = self.cursor.next_change();
            }
            // A link that is down still moves at the floor: a trace at 0 would stall it forever.
            let rate_per_ns = full_bytes_per_s * self.fraction.max(MIN_FRACTION) / 1e9;
            let done_ns = now_ns as f64 + left / rate_per_ns;
            match self.next {
                Some((at_ns, _)) if (at_ns as f64) < done_ns => {
                    left -= (at_ns - now_ns) as f64 * rate_per_ns;
                    now_ns = at_ns;
                }
                _ => return done_ns.ceil() as u64,
            }
        }
    }
}

/// An exponentially distributed duration with mean `mean_ns`, at least 1 ns so time advances.
/// By the inverse of the distribution function, not `rand_distr::Exp`: its ziggurat draws
/// other numbers from the same seed, and every seeded trace (and the figures measured on one)
/// would change.
fn exponential_ns(rng: &mut ChaCha8Rng, mean_ns: f64) -> u64 {
    let uniform: f64 = rng.random();
    ((-(1.0 - uniform).ln() * mean_ns).round() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(trace: &BandwidthTrace, link: u64, n: usize) -> (f64, Vec<(u64, f64)>) {
        let (initial, mut cursor) = TraceCursor::new(trace, link);
        (initial, std::iter::from_fn(|| cursor.next_change()).take(n).collect())
    }

    #[test]
    fn a_walker_integrates_the_rate_over_changes() {
        // Full for 1 ms, a quarter for 1 ms, repeating; 1 GB/s full, so 1 byte per ns.
        let trace = BandwidthTrace::OnOff { full_ns: 1_000_000, reduced_ns: 1_000_000, fraction: 0.25 };
        let mut walker = TraceWalker::new(&trace, 0);
        assert_eq!(walker.finish_ns(0, 500_000.0, 1e9), 500_000);
        // 500 µs at full rate, then 1 ms at a quarter (250 000 bytes), then the rest at full.
        assert_eq!(walker.finish_ns(500_000, 1_000_000.0, 1e9), 2_250_000);
        assert_eq!(walker.finish_ns(3_000_000, 1000.0, 1e9), 3_004_000);
    }

    #[test]
    fn parses_every_form_and_refuses_nonsense() {
        assert_eq!("constant:0.5".parse::<BandwidthTrace>().unwrap(), BandwidthTrace::Constant { fraction: 0.5 });
        assert_eq!(
            "on-off:full=2s,reduced=500ms,fraction=0.1".parse::<BandwidthTrace>().unwrap(),
            BandwidthTrace::OnOff { full_ns: 2_000_000_000, reduced_ns: 500_000_000, fraction: 0.1 }
        );
        assert_eq!(
            "random:seed=7,full=1s,reduced=40us,fraction=0".parse::<BandwidthTrace>().unwrap(),
            BandwidthTrace::Random { seed: 7, mean_full_ns: 1_000_000_000, mean_reduced_ns: 40_000, fraction: 0.0 }
        );
        for bad in [
            "constant:1.5",
            "on-off:full=2s,fraction=0.1",
            "on-off:full=2s,reduced=0s,fraction=0.1",
            "on-off:full=1ns,reduced=1ns,fraction=0.1",
            "random:seed=x,full=1s,reduced=1s,fraction=0.1",
            "on-off:full=2parsecs,reduced=1s,fraction=0.1",
            "sometimes",
        ] {
            let err = bad.parse::<BandwidthTrace>().unwrap_err().to_string();
            assert!(err.contains(bad), "{err}");
        }
    }

    #[test]
    fn fractions_below_the_floor_and_times_past_the_clock_are_refused() {
        // Issue 31: 1e-12 to 1e-300 of the bandwidth were accepted and simulated wrong.
        for tiny in ["1e-7", "1e-12", "1e-300", "5e-324"] {
            for text in [format!("constant:{tiny}"), format!("on-off:full=1s,reduced=1s,fraction={tiny}")] {
                let err = text.parse::<BandwidthTrace>().unwrap_err().to_string();
                assert!(err.contains(&text) && err.contains("below the floor of 1e-6"), "{err}");
            }
            let err = BandwidthTrace::from_csv(&format!("time_s,fraction\n0,1\n1,{tiny}\n"), "t.csv").unwrap_err();
            let err = err.to_string();
            assert!(err.contains("t.csv:3") && err.contains("fraction") && err.contains("1e-6"), "{err}");
        }
        // A link that is down, and the floor itself, still read.
        assert_eq!("constant:0".parse::<BandwidthTrace>().unwrap(), BandwidthTrace::Constant { fraction: 0.0 });
        assert_eq!("constant:1e-6".parse::<BandwidthTrace>().unwrap(), BandwidthTrace::Constant { fraction: 1e-6 });
        let err = BandwidthTrace::from_csv("0,1\n1e300,0.5\n", "t.csv").unwrap_err().to_string();
        assert!(err.contains("t.csv:2") && err.contains("1e9 s"), "{err}");
        let err = "on-off:full=100years,reduced=1s,fraction=0.5".parse::<BandwidthTrace>().unwrap_err().to_string();
        assert!(err.contains("full=100years") && err.contains("1e9 s"), "{err}");
    }

    /// Issue 31: user text in a trace's errors goes through medley-spec's one echo.
    #[test]
    fn errors_echo_trace_text_escaped_and_cut() {
        let long = "9".repeat(100_000);
        let inline = ["constant:\u{1b}[31m", "\u{1b}[2J:1", "on-off:full=1s,reduced=1s,fraction=0.5,\u{1b}=1"];
        let mut errors: Vec<String> =
            inline.iter().map(|text| text.parse::<BandwidthTrace>().unwrap_err().to_string()).collect();
        errors.push(format!("constant:{long}").parse::<BandwidthTrace>().unwrap_err().to_string());
        errors.push(BandwidthTrace::from_csv("0,1\n\u{1b}[31m,1\n", "t.csv").unwrap_err().to_string());
        errors.push(BandwidthTrace::from_csv(&format!("0,1\n1,{long}\n"), "t.csv").unwrap_err().to_string());
        errors.push(BandwidthTrace::from_csv("0,1\n1,2\n", "\u{1b}[31m.csv").unwrap_err().to_string());
        for err in errors {
            assert!(!err.chars().any(char::is_control) && err.len() < 1000, "{err:?}");
        }
    }

    #[test]
    fn on_off_alternates() {
        let trace = BandwidthTrace::OnOff { full_ns: 10, reduced_ns: 5, fraction: 0.2 };
        assert_eq!(changes(&trace, 0, 4), (1.0, vec![(10, 0.2), (15, 1.0), (25, 0.2), (30, 1.0)]));
    }

    #[test]
    fn random_traces_repeat_per_seed_and_differ_per_link() {
        let trace = BandwidthTrace::Random { seed: 3, mean_full_ns: 1000, mean_reduced_ns: 1000, fraction: 0.1 };
        assert_eq!(changes(&trace, 0, 50), changes(&trace, 0, 50));
        assert_ne!(changes(&trace, 0, 50), changes(&trace, 1, 50));
        let (_, points) = changes(&trace, 0, 2000);
        assert!(points.windows(2).all(|pair| pair[0].0 < pair[1].0));
        // Equal means: the link spends about half its time reduced.
        let reduced_ns: u64 = points.windows(2).filter(|pair| pair[0].1 < 1.0).map(|pair| pair[1].0 - pair[0].0).sum();
        let share = reduced_ns as f64 / (points.last().unwrap().0 - points[0].0) as f64;
        assert!((0.4..0.6).contains(&share), "{share}");
    }

    #[test]
    fn csv_rows_become_points() {
        let trace = BandwidthTrace::from_csv("time_s,fraction\n0,0.5\n0.25,1\n\n1.5,0.1\n", "t.csv").unwrap();
        assert_eq!(trace, BandwidthTrace::Points(vec![(0, 0.5), (250_000_000, 1.0), (1_500_000_000, 0.1)]));
        assert_eq!(changes(&trace, 9, 5), (0.5, vec![(250_000_000, 1.0), (1_500_000_000, 0.1)]));
        let err = BandwidthTrace::from_csv("0,0.5\n1,2\n", "t.csv").unwrap_err().to_string();
        assert!(err.contains("t.csv:2") && err.contains("from 0 to 1"), "{err}");
        let err = BandwidthTrace::from_csv("1,0.5\n0.5,1\n", "t.csv").unwrap_err().to_string();
        assert!(err.contains("ascend"), "{err}");
    }

    #[test]
    fn csv_exports_with_quotes_and_crlf_read_and_extra_columns_are_refused() {
        let exported = "  \n\"time_s\",\"fraction\"\r\n\"0\",\"0.5\"\r\n   \r\n\"2\",\"1\"\r\n";
        let trace = BandwidthTrace::from_csv(exported, "t.csv").unwrap();
        assert_eq!(trace, BandwidthTrace::Points(vec![(0, 0.5), (2_000_000_000, 1.0)]));
        let err = BandwidthTrace::from_csv("0,0.5\n1,0.5,9\n", "t.csv").unwrap_err().to_string();
        assert!(err.contains("t.csv:2") && err.contains("expected time_s,fraction"), "{err}");
        let err = BandwidthTrace::from_csv("0\n", "t.csv").unwrap_err().to_string();
        assert!(err.contains("t.csv:1") && err.contains("expected time_s,fraction"), "{err}");
    }
}
