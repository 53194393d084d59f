//! The fit recovers efficiencies that made the measurements, and says what it cannot tell apart.

use medley_cost::{Calibration, Overheads};
use medley_fit::{Fitted, Measured, MeasuredRun, cross_validate, fit, mean_abs_error, predict, spearman};
use medley_plan::baselines::{Degrees, fixed};
use medley_spec::{Bridge, Cluster, Fabric, JobParts, JobSpec, catalog_device, catalog_model};

/// Layouts of llama3-8b on `cluster` with micro-batches of one sequence, each "measured" as the
/// simulator predicts it under `truth`.
fn measured_under(truth: &Calibration, cluster: &str, layouts: &[(u32, u32, u32)]) -> Vec<MeasuredRun> {
    let with_micro_batch: Vec<_> = layouts.iter().map(|&(tp, pp, dp)| (tp, pp, dp, 1)).collect();
    measured_with_micro_batches(truth, cluster, &with_micro_batch)
}

/// The same for (tp, pp, dp, micro-batch) layouts.
fn measured_with_micro_batches(
    truth: &Calibration,
    cluster: &str,
    layouts: &[(u32, u32, u32, u32)],
) -> Vec<MeasuredRun> {
    let model = catalog_model("llama3-8b").unwrap();
    let fleet = Cluster::from_inline(cluster, Fabric::default(), Bridge::default()).unwrap();
    layouts
        .iter()
        .map(|&(tp, pp, dp, micro_batch)| {
            let parts =
                JobParts { seq_len: 2048, global_batch: 64, micro_batch: Some(micro_batch), ..JobParts::default() };
            let job = JobSpec::new(parts, "test").unwrap();
            let plan = fixed(&fleet, &model, &job, &Calibration::default(), Degrees::new(tp, pp, dp)).unwrap().plan;
            let label = format!("{cluster} tp{tp} pp{pp} dp{dp} mb{micro_batch}");
            let unmeasured =
                MeasuredRun::new(label.clone(), cluster.into(), plan.clone(), Measured::StepS(1.0)).unwrap();
            let step_s = unmeasured.predict(truth).unwrap().predicted_step_s;
            MeasuredRun::new(label, cluster.into(), plan, Measured::StepS(step_s)).unwrap()
        })
        .collect()
}

/// The default efficiencies of `device` scaled by `factor`, as a profile.
fn truth(factors: &[(&str, f64)]) -> Calibration {
    let mut calibration = Calibration::default();
    for &(name, factor) in factors {
        let device = catalog_device(name).unwrap();
        let mut efficiency = calibration.efficiency(&device);
        efficiency.matmul *= factor;
        efficiency.attention *= factor;
        calibration.set(&device, efficiency);
    }
    calibration
}

#[test]
fn the_fit_recovers_the_factors_that_made_mixed_and_single_type_runs() {
    let truth = truth(&[("h100", 0.8), ("a100", 1.15)]);
    let mut runs = measured_under(&truth, "8xh100", &[(1, 1, 8), (2, 2, 2)]);
    runs.extend(measured_under(&truth, "8xa100", &[(1, 2, 4), (4, 1, 2)]));
    runs.extend(measured_under(&truth, "8xh100,8xa100", &[(1, 2, 8), (2, 2, 4), (1, 4, 4), (2, 4, 2)]));
    let before = predict(&runs, &Calibration::default()).unwrap();
    assert!(mean_abs_error(&before) > 0.05, "the defaults already predict the runs: {before:?}");

    let fitted = fit(&runs, &Calibration::default(), Fitted::Efficiencies).unwrap();
    let factor = |name: &str| {
        let factor = fitted.factors.iter().find(|f| f.devices == [name]).unwrap_or_else(|| panic!("{name}"));
        factor.factor
    };
    assert!((factor("H100-SXM") - 0.8).abs() < 2e-3, "{:?}", fitted.factors);
    assert!((factor("A100-80GB") - 1.15).abs() < 2e-3, "{:?}", fitted.factors);
    let after = predict(&runs, &fitted.calibration).unwrap();
    assert!(mean_abs_error(&after) < 1e-3, "{after:?}");

    let held_out = cross_validate(&runs, &Calibration::default(), Fitted::Efficiencies, 4).unwrap();
    assert!(mean_abs_error(&held_out) < 5e-3, "{held_out:?}");
    let mixed: Vec<usize> = (4..runs.len()).collect();
    let measured: Vec<f64> = mixed.iter().map(|&idx| runs[idx].predict(&truth).unwrap().predicted_step_s).collect();
    let predicted: Vec<f64> = mixed.iter().map(|&idx| after[idx].predicted_step_s).collect();
    assert!(spearman(&predicted, &measured).is_some_and(|rho| rho > 0.999), "{predicted:?} {measured:?}");
}

/// A device far slower than its profile's third of it: the fit stops at its bound and says so,
/// where one inside the bounds does not.
#[test]
fn a_factor_the_runs_push_past_the_bounds_is_said_to_be_at_one() {
    let runs = measured_under(&truth(&[("h100", 0.1)]), "8xh100", &[(1, 1, 8), (2, 2, 2), (1, 2, 4)]);
    let fitted = fit(&runs, &Calibration::default(), Fitted::Efficiencies).unwrap();
    let [factor] = &fitted.factors[..] else { panic!("{:?}", fitted.factors) };
    assert!(factor.at_bound() && factor.describe() == "0.300 (bound)", "{factor:?}");
    let runs = measured_under(&truth(&[("h100", 0.9)]), "8xh100", &[(1, 1, 8), (2, 2, 2), (1, 2, 4)]);
    let fitted = fit(&runs, &Calibration::default(), Fitted::Efficiencies).unwrap();
    assert!(!fitted.factors[0].at_bound() && fitted.factors[0].describe() == "0.900", "{:?}", fitted.factors);
}

/// Issue 33: a framework's fixed costs per micro-batch and per layer are fitted beside the
/// efficiencies, and found where they made the runs.
#[test]
fn the_fit_recovers_the_framework_overheads_that_made_the_runs() {
    let mut truth = truth(&[("h100", 0.9)]);
    let overheads = Overheads { per_micro_batch_s: 4e-3, per_layer_s: 3e-4 };
    truth.set_overheads(overheads);
    let layouts = [(1, 1, 8, 1), (1, 2, 4, 2), (1, 4, 2, 1), (1, 4, 2, 4), (2, 4, 1, 2), (1, 8, 1, 1)];
    let runs = measured_with_micro_batches(&truth, "8xh100", &layouts);
    let efficiencies_only = fit(&runs, &Calibration::default(), Fitted::Efficiencies).unwrap();
    assert_eq!(efficiencies_only.overheads, None);
    let misfit = mean_abs_error(&predict(&runs, &efficiencies_only.calibration).unwrap());
    assert!(misfit > 0.01, "the factor alone explains the overheads: {misfit}");

    let fitted = fit(&runs, &Calibration::default(), Fitted::EfficienciesAndOverheads).unwrap();
    let found = fitted.overheads.expect("overheads fitted");
    assert!((found.per_micro_batch_s - 4e-3).abs() < 4e-4, "{found:?}");
    assert!((found.per_layer_s - 3e-4).abs() < 3e-5, "{found:?}");
    assert!((fitted.factors[0].factor - 0.9).abs() < 0.02, "{:?}", fitted.factors);
    assert!(mean_abs_error(&predict(&runs, &fitted.calibration).unwrap()) < 2e-3);
    assert_eq!(fitted.calibration.overheads(), found, "the profile carries what the fit found");
}

#[test]
fn device_types_that_only_ran_together_share_one_factor() {
    let truth = truth(&[("h100", 0.9), ("a100", 0.9)]);
    let runs = measured_under(&truth, "8xh100,8xa100", &[(1, 2, 8), (2, 2, 4)]);
    let fitted = fit(&runs, &Calibration::default(), Fitted::Efficiencies).unwrap();
    assert_eq!(fitted.factors.len(), 1, "{:?}", fitted.factors);
    assert_eq!(fitted.factors[0].devices, ["H100-SXM", "A100-80GB"]);
    assert!((fitted.factors[0].factor - 0.9).abs() < 2e-3, "{:?}", fitted.factors);
}

#[test]
fn a_measurement_that_is_not_a_positive_number_is_refused_with_its_run() {
    let runs = measured_under(&Calibration::default(), "8xh100", &[(1, 1, 8)]);
    let plan = runs[0].plan.clone();
    for value in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let err = MeasuredRun::new("row 3".into(), "8xh100".into(), plan.clone(), Measured::StepS(value)).unwrap_err();
        assert!(err.to_string().contains("row 3"), "{err}");
    }
    let emulation = Calibration::emulation("tiny");
    assert!(fit(&runs, &emulation, Fitted::Efficiencies).unwrap_err().to_string().contains("GPU profile"));
}
