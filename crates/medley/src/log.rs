//! What medley says about its work, apart from its results: notes, warnings and errors as tracing
//! events on standard error, while tables, JSON and progress lines go to standard output. On a
//! terminal a note reads as a plain line and a warning starts with `warning:`; without one (a
//! log file, Slurm, CI) each line also starts with the time and carries no colour codes.

use std::fmt;
use std::io::IsTerminal;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The environment variable that adds filter directives after `-v`/`-q`'s, as in
/// `MEDLEY_LOG=debug` or `MEDLEY_LOG=medley_comm=trace` (what it does not name keeps the flags'
/// level, so errors and notes still show); workers inherit it from the launcher.
pub const LOG_VAR: &str = "MEDLEY_LOG";

/// medley's own crates, whose events `-v` and `-q` govern; every other crate's show only when they
/// warn.
const CRATES: [&str; 18] = [
    "medley",
    "medley_bench",
    "medley_collective",
    "medley_comm",
    "medley_cost",
    "medley_export",
    "medley_fit",
    "medley_fuzz",
    "medley_gpu",
    "medley_launch",
    "medley_model",
    "medley_plan",
    "medley_report",
    "medley_runtime",
    "medley_schedule",
    "medley_sim",
    "medley_spec",
    "medley_trace",
];

/// The level `-v` (repeated) and `-q` ask for: notes by default, warnings and errors only with
/// `-q`, debug events with `-v`, everything with `-vv`.
pub fn level(verbose: u8, quiet: bool) -> Level {
    match (quiet, verbose) {
        (true, _) => Level::WARN,
        (false, 0) => Level::INFO,
        (false, 1) => Level::DEBUG,
        (false, _) => Level::TRACE,
    }
}

/// The filter for `level`, then [`LOG_VAR`]'s directives, which win where they name the same
/// target; a malformed one is ignored, with a warning once the subscriber runs.
fn filter(level: Level, extra: Option<&str>) -> (EnvFilter, Option<String>) {
    let ours: Vec<String> = CRATES.iter().map(|krate| format!("{krate}={level}")).collect();
    let base = format!("warn,{}", ours.join(","));
    match extra.filter(|extra| !extra.trim().is_empty()) {
        None => (EnvFilter::new(base), None),
        Some(extra) => match EnvFilter::try_new(format!("{base},{extra}")) {
            Ok(filter) => (filter, None),
            Err(error) => (EnvFilter::new(base), Some(format!("{LOG_VAR}={extra:?} ignored: {error}"))),
        },
    }
}

/// Starts writing events at `level` and above to standard error.
pub fn init(level: Level) {
    let terminal = std::io::stderr().is_terminal();
    let (filter, ignored) = filter(level, std::env::var(LOG_VAR).ok().as_deref());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .with_ansi(terminal)
        .event_format(Lines { timed: !terminal })
        .init();
    if let Some(ignored) = ignored {
        tracing::warn!("{ignored}");
    }
}

/// One line per event: `[time ]`, then `warning: ` or `error: ` (debug and trace events name
/// their level and crate), then the message and any fields.
struct Lines {
    timed: bool,
}

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        if self.timed {
            SystemTime.format_time(&mut writer)?;
            writer.write_char(' ')?;
        }
        let metadata = event.metadata();
        match *metadata.level() {
            Level::ERROR => writer.write_str("error: ")?,
            Level::WARN => writer.write_str("warning: ")?,
            Level::INFO => {}
            level => write!(writer, "{} {}: ", level.as_str().to_lowercase(), metadata.target())?,
        }
        ctx.format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_choose_the_level() {
        assert_eq!(level(0, false), Level::INFO);
        assert_eq!(level(1, false), Level::DEBUG);
        assert_eq!(level(3, false), Level::TRACE);
        assert_eq!(level(0, true), Level::WARN);
    }

    #[test]
    fn medley_log_adds_to_the_flags_level() {
        use tracing::level_filters::LevelFilter;
        let (with_debug, ignored) = filter(Level::INFO, Some("medley_launch=debug"));
        assert_eq!((with_debug.max_level_hint(), ignored), (Some(LevelFilter::DEBUG), None));
        // What it does not name keeps the flags' level: notes and errors still show.
        let text = with_debug.to_string();
        assert!(text.contains("medley=info") && text.contains("medley_launch=debug"), "{text}");
        let (malformed, ignored) = filter(Level::WARN, Some("medley=[{"));
        assert_eq!(malformed.max_level_hint(), Some(LevelFilter::WARN));
        assert!(ignored.unwrap().contains("MEDLEY_LOG"));
    }

    #[test]
    fn the_filter_names_every_crate_of_the_workspace() {
        let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Cargo.toml")).unwrap();
        for line in manifest.lines().filter(|line| line.starts_with("medley-") && line.contains("path")) {
            let krate = line.split_whitespace().next().unwrap().replace('-', "_");
            assert!(CRATES.contains(&krate.as_str()), "{krate} is missing from log::CRATES");
        }
    }
}
