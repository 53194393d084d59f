//! A training run's progress: indicatif's bar on a terminal; without one (Slurm, nohup, CI) a
//! plain line every few seconds, since a bar is invisible in a log.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often a log gets a progress line.
const LINE_EVERY: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub enum Progress {
    Bar(ProgressBar),
    Lines(Arc<Mutex<Lines>>),
    /// No progress, only the workers' own lines (for runs a benchmark times).
    Quiet,
}

pub struct Lines {
    total_steps: u64,
    started: Instant,
    /// The first step this run reported (a resumed run starts past 1) and when.
    first: Option<(u64, Instant)>,
    last_line: Option<Instant>,
}

impl Progress {
    /// A bar when standard error is a terminal, lines otherwise; none under `-q`.
    pub fn new(total_steps: u64) -> Progress {
        if !tracing::enabled!(tracing::Level::INFO) {
            return Progress::Quiet;
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total_steps);
            let style = ProgressStyle::with_template("step {pos}/{len} [{bar:30}] {msg} · ETA {eta}")
                .expect("a valid template")
                .progress_chars("=> ");
            bar.set_style(style);
            return Progress::Bar(bar);
        }
        let lines = Lines { total_steps, started: Instant::now(), first: None, last_line: None };
        Progress::Lines(Arc::new(Mutex::new(lines)))
    }

    /// Step `step` finished with this loss and throughput.
    pub fn step(&self, step: u64, loss: f64, tokens_per_s: f64) {
        let figures = format!("loss {loss:.3} · {tokens_per_s:.0} tokens/s");
        match self {
            Progress::Bar(bar) => {
                bar.set_position(step);
                bar.set_message(figures);
            }
            Progress::Lines(lines) => {
                let mut lines = lines.lock().expect("progress lock");
                if let Some(line) = lines.line(step, &figures, Instant::now()) {
                    println!("{line}");
                }
            }
            Progress::Quiet => {}
        }
    }

    /// A line of a worker's own output, kept above the bar.
    pub fn println(&self, line: &str) {
        match self {
            Progress::Bar(bar) => bar.println(line),
            Progress::Lines(_) | Progress::Quiet => eprintln!("{line}"),
        }
    }

    pub fn finish(&self) {
        if let Progress::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

impl Lines {
    /// The line to print for `step` at `now`: the first step, the last, and one every
    /// [`LINE_EVERY`] between.
    fn line(&mut self, step: u64, figures: &str, now: Instant) -> Option<String> {
        let (first_step, first_at) = *self.first.get_or_insert((step, now));
        let due = self.last_line.is_none_or(|at| now - at >= LINE_EVERY) || step >= self.total_steps;
        if !due {
            return None;
        }
        self.last_line = Some(now);
        let eta = match step.checked_sub(first_step) {
            Some(done) if done > 0 && step < self.total_steps => {
                let per_step = (now - first_at).as_secs_f64() / done as f64;
                format!(" · ETA {}", duration((self.total_steps - step) as f64 * per_step))
            }
            _ => String::new(),
        };
        let elapsed = duration((now - self.started).as_secs_f64());
        Some(format!("step {step}/{} · {figures} · {elapsed} elapsed{eta}", self.total_steps))
    }
}

/// `42s`, `3m07s`, `2h05m`.
fn duration(seconds: f64) -> String {
    let seconds = seconds.round() as u64;
    match seconds {
        0..60 => format!("{seconds}s"),
        60..3600 => format!("{}m{:02}s", seconds / 60, seconds % 60),
        _ => format!("{}h{:02}m", seconds / 3600, seconds / 60 % 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_come_at_the_first_and_last_step_and_every_few_seconds() {
        let start = Instant::now();
        let mut lines = Lines { total_steps: 100, started: start, first: None, last_line: None };
        let at = |s: u64| start + Duration::from_secs(s);
        let printed: Vec<u64> = (1..=100).filter(|&step| lines.line(step, "x", at(step)).is_some()).collect();
        assert_eq!(printed, [1, 6, 11, 16, 21, 26, 31, 36, 41, 46, 51, 56, 61, 66, 71, 76, 81, 86, 91, 96, 100]);
        let mut lines = Lines { total_steps: 100, started: start, first: None, last_line: None };
        lines.line(41, "x", at(0));
        let line = lines.line(51, "loss 1.000", at(10)).unwrap();
        assert_eq!(line, "step 51/100 · loss 1.000 · 10s elapsed · ETA 49s");
    }

    #[test]
    fn durations_read_as_a_person_writes_them() {
        assert_eq!([duration(42.4), duration(187.0), duration(7500.0)], ["42s", "3m07s", "2h05m"]);
    }
}
