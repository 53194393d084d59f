//! `medley report` in a real browser: headless Chromium opens the page of a plan and of a short
//! training run, which must draw every picture (the page's own check, read from the DOM), log
//! nothing to the console, and give a screenshot that is not blank. The screenshots stay in
//! the target directory (`report-*.png`) for a person to look at.
//!
//! Without Chromium (`chromium` on PATH, or `MEDLEY_CHROMIUM`) the test says it is skipped;
//! with `MEDLEY_REQUIRE_BROWSER=1`, as CI sets, a missing browser fails it instead.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

fn medley(args: &[&str], dir: &Path) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_medley")).args(args).current_dir(dir).output().unwrap();
    assert!(output.status.success(), "medley {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    output
}

/// The browser to test with, or `None` (said on stderr) when there is none and none is required.
fn chromium() -> Option<PathBuf> {
    let named = std::env::var_os("MEDLEY_CHROMIUM").map(PathBuf::from);
    let found = named.or_else(|| {
        let path = std::env::var_os("PATH")?;
        let dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
        ["chromium", "chromium-browser", "google-chrome"]
            .iter()
            .find_map(|name| dirs.iter().map(|dir| dir.join(name)).find(|candidate| candidate.is_file()))
    });
    if found.is_none() {
        assert!(
            std::env::var("MEDLEY_REQUIRE_BROWSER").as_deref() != Ok("1"),
            "MEDLEY_REQUIRE_BROWSER=1 but no chromium on PATH (install Debian's `chromium`)"
        );
        eprintln!("SKIPPED: no chromium on PATH; the report's browser test did not run");
    }
    found
}

/// Runs headless Chromium on `page` with `mode` (`--dump-dom` or `--screenshot=FILE`), killed
/// after a minute; its stdout and stderr.
fn headless(browser: &Path, page: &Path, mode: &str) -> (String, String) {
    let mut child = Command::new(browser)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run"])
        .args(["--window-size=1280,2400", "--enable-logging=stderr", "--v=0", mode])
        .arg(format!("file://{}", page.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("chromium did not finish {mode} of {} in a minute", page.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = child.wait_with_output().unwrap();
    (String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Opens `page` in the browser: every picture in `pictures` drawn, no console message, and a
/// screenshot (kept as `name`) with enough ink and colours to be the report.
fn check_in_browser(browser: &Path, page: &Path, pictures: &[&str], name: &str) {
    let (dom, log) = headless(browser, page, "--dump-dom");
    assert!(
        dom.contains(r#"data-rendered="ok""#),
        "the page's self-check did not pass:\n{}",
        &dom[..dom.len().min(2000)]
    );
    for id in pictures {
        assert!(dom.contains(&format!(r#"id="{id}""#)), "no #{id} in the page");
    }
    let console: Vec<&str> = log.lines().filter(|line| line.contains("CONSOLE") || line.contains("Uncaught")).collect();
    assert!(console.is_empty(), "the page wrote to the console:\n{}", console.join("\n"));
    let shot = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    headless(browser, page, &format!("--screenshot={}", shot.display()));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut pixels).unwrap();
    assert_eq!((info.width, info.height), (1280, 2400));
    let channels = info.color_type.samples();
    let pixels: Vec<&[u8]> = pixels[..info.buffer_size()].chunks(channels).collect();
    let inked = pixels.iter().filter(|pixel| pixel[..3].iter().any(|&value| value < 200)).count();
    let mut colours: Vec<[u8; 3]> = pixels.iter().map(|pixel| [pixel[0], pixel[1], pixel[2]]).collect();
    colours.sort_unstable();
    colours.dedup();
    assert!(inked * 50 > pixels.len(), "{}: under 2% of the screenshot is drawn", shot.display());
    assert!(colours.len() > 50, "{}: only {} colours", shot.display(), colours.len());
    eprintln!(
        "{} rendered: {:.1}% inked, {} colours",
        shot.display(),
        inked as f64 * 100.0 / pixels.len() as f64,
        colours.len()
    );
}

#[test]
fn the_report_of_a_plan_and_of_a_run_renders_in_a_real_browser() {
    let Some(browser) = chromium() else { return };
    let dir = tempfile::tempdir().unwrap();
    let fleet = ["--cluster", "2xh100,2xmi300x", "--model", "tiny", "--seq-len", "128", "--global-batch", "16"];
    medley(&[&["plan", "-q"], &fleet[..], &["-o", "plan.json"]].concat(), dir.path());
    medley(&["report", "-q", "--plan", "plan.json", "-o", "plan.html"], dir.path());
    check_in_browser(
        &browser,
        &dir.path().join("plan.html"),
        &["plan", "timeline", "memory", "candidates"],
        "report-plan.png",
    );
    medley(&["train", "-q", "--out", "run", "--steps", "4"], dir.path());
    let pictures = ["plan", "timeline", "measured-timeline", "memory", "candidates", "loss", "step-times"];
    check_in_browser(&browser, &dir.path().join("run/report.html"), &pictures, "report-run.png");
}
