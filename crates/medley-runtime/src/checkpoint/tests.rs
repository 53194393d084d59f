//! Tests of [`super`].

use super::*;

#[test]
fn retention_keeps_the_newest_up_to_latest() {
    let root = tempfile::tempdir().unwrap();
    for step in [2, 4, 6, 8, 10] {
        fs::create_dir(root.path().join(format!("step-{step:08}"))).unwrap();
    }
    fs::write(root.path().join(LATEST), "step-00000008").unwrap();
    remove_older(root.path(), 8, 2).unwrap();
    let mut left: Vec<String> =
        fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["latest", "step-00000006", "step-00000008"], "10 was never published");
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn a_resume_sweeps_what_an_interrupted_checkpoint_left() {
    let root = tempfile::tempdir().unwrap();
    for step in [4, 6, 8] {
        fs::create_dir(root.path().join(format!("step-{step:08}"))).unwrap();
    }
    fs::write(root.path().join(LATEST), "step-00000006").unwrap();
    fs::write(root.path().join(".latest.Ab12Cd"), "step-0000000").unwrap();
    fs::write(root.path().join("step-00000006").join(".rank-1.safetensors.x9Y8z7"), [0u8; 64]).unwrap();
    fs::write(root.path().join("step-00000006").join("rank-0.safetensors"), [1u8; 8]).unwrap();
    sweep_incomplete(root.path(), 6).unwrap();
    assert_eq!(names(root.path()), ["latest", "step-00000004", "step-00000006"]);
    assert_eq!(names(&root.path().join("step-00000006")), ["rank-0.safetensors"]);
}

/// A checkpoint directory as training writes it: tensor files holding `step`, the manifest,
/// `latest` pointing at it.
fn write_checkpoint_at(root: &Path, step: u64, plan: &Plan) -> PathBuf {
    let dir = root.join(step_dir_name(step));
    fs::create_dir_all(&dir).unwrap();
    let tensor = medley_model::HostTensor::new(vec![2], vec![1.0, step as f32]);
    let metadata = HashMap::from([("step".to_string(), step.to_string())]);
    let file = "rank-0.safetensors".to_string();
    save_tensors(&dir.join(&file), &[("w".into(), &tensor)], metadata).unwrap();
    let checksums = BTreeMap::from([(file.clone(), FileChecksum::of(&dir.join(&file)).unwrap())]);
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        step,
        samples_seen: step,
        optimizer_steps: step,
        seed: 0,
        plan: plan.clone(),
        files: vec![file],
        checksums,
    };
    fs::write(dir.join(MANIFEST), serde_json::to_string(&manifest).unwrap()).unwrap();
    fs::write(root.join(LATEST), step_dir_name(step)).unwrap();
    dir
}

fn tiny_plan() -> Plan {
    let cluster = medley_spec::Cluster::from_fleet("1xh100").unwrap();
    let model = medley_spec::catalog_model("tiny").unwrap();
    let job = medley_spec::JobSpec::from_toml("seq_len = 32\nglobal_batch = 2\n", "job.toml").unwrap();
    let options = medley_plan::SearchOptions { top: 1, ..Default::default() };
    let calibration = medley_cost::Calibration::default();
    medley_plan::search(&cluster, &model, &job, &calibration, &options).unwrap().candidates.remove(0).plan
}

/// Steps 2, 4 and 6, `latest` at 6, as `--checkpoint-every 2` leaves them.
fn three_checkpoints() -> (tempfile::TempDir, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let plan = tiny_plan();
    let newest = [2, 4, 6].map(|step| write_checkpoint_at(root.path(), step, &plan))[2].clone();
    (root, newest)
}

/// Reads, verifies and sweeps `root` as a resume in place does; what it refused.
fn resume_in_place(root: &Path) -> Result<u64, RuntimeError> {
    let (dir, manifest) = read_latest(root)?;
    verify_checkpoint(&dir, &manifest)?;
    sweep_incomplete(root, manifest.step)?;
    Ok(manifest.step)
}

#[test]
fn a_manifest_lying_about_its_step_is_refused_and_nothing_is_deleted() {
    for lie in [0, 4, 5, 7] {
        let (root, newest) = three_checkpoints();
        let path = newest.join(MANIFEST);
        let text = fs::read_to_string(&path).unwrap().replace("\"step\":6", &format!("\"step\":{lie}"));
        fs::write(&path, text).unwrap();
        let err = resume_in_place(root.path()).unwrap_err().to_string();
        assert!(err.contains("manifest.json") && err.contains(&format!("says step {lie}")), "{err}");
        assert_eq!(names(root.path()), ["latest", "step-00000002", "step-00000004", "step-00000006"], "lie {lie}");
    }
}

#[test]
fn only_later_checkpoints_proven_unfinished_are_swept() {
    let (root, _) = three_checkpoints();
    fs::write(root.path().join(LATEST), "step-00000004").unwrap();
    // Step 6 holds a manifest: perhaps complete, so the resume is refused and it is kept.
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("step-00000006") && err.contains("holds a manifest"), "{err}");
    assert_eq!(names(root.path()), ["latest", "step-00000002", "step-00000004", "step-00000006"]);
    // Without it, step 6 is what a checkpoint stopped before its manifest leaves.
    fs::remove_file(root.path().join("step-00000006").join(MANIFEST)).unwrap();
    fs::write(root.path().join("step-00000006/.rank-1.safetensors.Xy12Zw"), b"half").unwrap();
    assert_eq!(resume_in_place(root.path()).unwrap(), 4);
    assert_eq!(names(root.path()), ["latest", "step-00000002", "step-00000004"]);
    // A later directory holding anything else is nobody's to delete.
    let later = root.path().join("step-00000008");
    fs::create_dir(&later).unwrap();
    fs::write(later.join("notes.txt"), b"mine").unwrap();
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("notes.txt"), "{err}");
    assert!(later.join("notes.txt").is_file());
}

#[test]
fn fifos_links_and_devices_are_refused_without_waiting_or_following() {
    let (root, newest) = three_checkpoints();
    let rank_file = newest.join("rank-0.safetensors");
    let outside = tempfile::tempdir().unwrap();
    let kept = outside.path().join("elsewhere.safetensors");
    fs::rename(&rank_file, &kept).unwrap();

    std::os::unix::fs::symlink(&kept, &rank_file).unwrap();
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("rank-0.safetensors") && err.contains("symbolic link"), "{err}");

    fs::remove_file(&rank_file).unwrap();
    let made = std::process::Command::new("mkfifo").arg(&rank_file).status().unwrap();
    assert!(made.success());
    let started = std::time::Instant::now();
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("a FIFO"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "it waited on the FIFO");

    fs::remove_file(&rank_file).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &rank_file).unwrap();
    assert!(resume_in_place(root.path()).unwrap_err().to_string().contains("symbolic link"));

    // A step directory that is a link out of the run directory is not followed either.
    fs::remove_file(&rank_file).unwrap();
    fs::rename(&kept, &rank_file).unwrap();
    let moved = outside.path().join("step-00000006");
    fs::rename(&newest, &moved).unwrap();
    std::os::unix::fs::symlink(&moved, &newest).unwrap();
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("step-00000006") && err.contains("not a directory"), "{err}");
    assert!(moved.join("rank-0.safetensors").is_file());
    // And `latest` itself must be a file of the run's.
    fs::remove_file(&newest).unwrap();
    fs::rename(&moved, &newest).unwrap();
    resume_in_place(root.path()).unwrap();
    let pointer = outside.path().join("pointer");
    fs::write(&pointer, "step-00000006").unwrap();
    fs::remove_file(root.path().join(LATEST)).unwrap();
    std::os::unix::fs::symlink(&pointer, root.path().join(LATEST)).unwrap();
    assert!(resume_in_place(root.path()).unwrap_err().to_string().contains("symbolic link"));
}

#[test]
fn a_format_1_manifest_is_refused_since_nothing_in_it_can_be_verified() {
    let (root, newest) = three_checkpoints();
    let path = newest.join(MANIFEST);
    let mut manifest: serde_json::Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    manifest["format"] = 1.into();
    manifest.as_object_mut().unwrap().remove("checksums");
    fs::write(&path, manifest.to_string()).unwrap();
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("format 1 records no checksums"), "{err}");
}

#[test]
fn a_file_of_another_size_is_refused_before_it_is_read() {
    let (root, newest) = three_checkpoints();
    let file = fs::OpenOptions::new().append(true).open(newest.join("rank-0.safetensors")).unwrap();
    file.set_len(1 << 40).unwrap();
    let started = std::time::Instant::now();
    let err = resume_in_place(root.path()).unwrap_err().to_string();
    assert!(err.contains("1099511627776 bytes") && err.contains("truncated or from another checkpoint"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "it hashed a terabyte of holes");
}

#[test]
fn files_are_checked_against_their_recorded_size_and_hash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rank-0.safetensors");
    fs::write(&path, b"the weights of step six").unwrap();
    let checksum = FileChecksum::of(&path).unwrap();
    assert_eq!(checksum.bytes, 23);
    matches_recorded(&path, Some(&checksum)).unwrap();
    fs::write(&path, b"the weights of step sIx").unwrap();
    let err = matches_recorded(&path, Some(&checksum)).unwrap_err().to_string();
    assert!(err.contains("rank-0.safetensors") && err.contains("not what was written"), "{err}");
    assert!(matches_recorded(&path, None).is_err(), "a file the manifest does not record is refused");
}
