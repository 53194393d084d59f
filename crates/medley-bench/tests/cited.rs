//! The cost model's default efficiencies are what the fit of the tuning runs says.

use medley_bench::cited::{Role, planned_runs, predict};
use medley_bench::stats::geometric_mean;
use medley_cost::Calibration;

/// How far from 1 a device type's tuning runs may predict on average under the defaults: the
/// defaults are rounded to three digits from the fit's factor.
const TOLERANCE: f64 = 0.02;

#[test]
fn the_default_efficiencies_fit_each_device_types_tuning_runs() {
    let runs = planned_runs().unwrap();
    let tuning: Vec<_> = runs.into_iter().filter(|(run, _)| run.role == Role::Tune).collect();
    let predictions = predict(&tuning, &Calibration::default()).unwrap();
    let mut devices: Vec<String> = tuning.iter().map(|(run, plan)| run.device(plan)).collect();
    devices.dedup();
    assert!(devices.len() >= 2, "{devices:?}");
    for device in devices {
        let ratios: Vec<f64> = tuning
            .iter()
            .zip(&predictions)
            .filter(|((run, plan), _)| run.device(plan) == device)
            .map(|(_, prediction)| prediction.time_ratio)
            .collect();
        let mean = geometric_mean(&ratios);
        assert!((mean - 1.0).abs() < TOLERANCE, "{device}: tuning runs predict {mean:.3}× their measured time");
    }
}
