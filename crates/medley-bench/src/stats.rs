//! The statistics every benchmark reports with: one median rule, the means for times and for
//! ratios, and the process's peak memory.

use std::time::Instant;

use statrs::statistics::{Data, OrderStatistics, Statistics};

/// Runs of each timed case in the speed suites; the median is reported.
pub const TIMED_RUNS: usize = 3;

/// Runs `run` [`TIMED_RUNS`] times: the median wall time in seconds, and the last run's result.
pub fn timed_median<T, E>(mut run: impl FnMut() -> Result<T, E>) -> Result<(f64, T), E> {
    let mut runs_s = Vec::with_capacity(TIMED_RUNS);
    let mut last = None;
    for _ in 0..TIMED_RUNS {
        let started = Instant::now();
        last = Some(run()?);
        runs_s.push(started.elapsed().as_secs_f64());
    }
    Ok((median(runs_s), last.expect("at least one run")))
}

/// The middle value, or the mean of the two middle ones for an even count (NaN for none): the
/// one rule for every repeated measurement medley reports.
pub fn median(values: Vec<f64>) -> f64 {
    Data::new(values).median()
}

pub fn arithmetic_mean(values: &[f64]) -> f64 {
    values.mean()
}

/// The mean for ratios: a 2× gain and a 2× loss average to 1×.
pub fn geometric_mean(values: &[f64]) -> f64 {
    values.geometric_mean()
}

/// The process's peak resident memory so far, MiB: the runtime reads it for its metrics.
pub use medley_runtime::peak_rss_mib;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_median_runs_each_case_and_stops_at_an_error() {
        let mut calls = 0;
        let (median_s, last) = timed_median(|| -> Result<u32, ()> {
            calls += 1;
            Ok(calls)
        })
        .unwrap();
        assert_eq!((calls, last), (TIMED_RUNS as u32, TIMED_RUNS as u32));
        assert!((0.0..1.0).contains(&median_s), "{median_s}");
        let mut calls = 0;
        let failed = timed_median(|| -> Result<(), &str> {
            calls += 1;
            Err("boom")
        });
        assert_eq!((failed, calls), (Err("boom"), 1));
    }

    #[test]
    fn median_takes_the_middle_or_the_mean_of_the_two_middles() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn geometric_mean_of_reciprocals_is_one() {
        assert!((geometric_mean(&[2.0, 0.5]) - 1.0).abs() < 1e-12);
        assert_eq!(arithmetic_mean(&[2.0, 0.5]), 1.25);
    }
}
