//! A request to stop, by signal: SIGINT (Ctrl-C), SIGTERM (what `kill`, systemd and a Slurm
//! preemption send) and SIGUSR1/SIGUSR2 (what Slurm's `--signal` sends ahead of a time limit).
//! The first asks the run to stop at the end of the current step — the workers agree on that
//! step, write a checkpoint of it with `--checkpoint-on-signal`, and say how to resume; a second
//! SIGINT ends the process at once, as Ctrl-C otherwise would.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

const STOP_SIGNALS: [i32; 4] = [SIGINT, SIGTERM, SIGUSR1, SIGUSR2];

/// Whether, and by which signal, this process has been asked to stop.
#[derive(Clone, Debug)]
pub struct StopSignals {
    /// Set by the first stop signal.
    pub requested: Arc<AtomicBool>,
    /// The number of the last stop signal (0: none yet).
    signal: Arc<AtomicUsize>,
}

impl StopSignals {
    /// Takes over the stop signals for the rest of the process's life.
    pub fn register() -> Result<StopSignals> {
        let requested = Arc::new(AtomicBool::new(false));
        let signal = Arc::new(AtomicUsize::new(0));
        // Only a second Ctrl-C means "now", whatever came before it: a launcher passes SIGTERM on
        // to workers, which may reach them before the terminal's SIGINT does.
        let interrupted = Arc::new(AtomicBool::new(false));
        for number in STOP_SIGNALS {
            // The shutdown is registered before the flag it reads is set, so the first SIGINT
            // only sets it.
            let now_on_second = (number == SIGINT).then(|| {
                signal_hook::flag::register_conditional_shutdown(number, exit_code(number), Arc::clone(&interrupted))
                    .and_then(|_| signal_hook::flag::register(number, Arc::clone(&interrupted)))
            });
            let registered = now_on_second
                .transpose()
                .and_then(|_| signal_hook::flag::register_usize(number, Arc::clone(&signal), number as usize))
                .and_then(|_| signal_hook::flag::register(number, Arc::clone(&requested)));
            registered.with_context(|| format!("cannot handle signal {}", name(number)))?;
        }
        Ok(StopSignals { requested, signal })
    }

    /// The signal that asked to stop, if one has.
    pub fn received(&self) -> Option<i32> {
        match self.signal.load(Ordering::Acquire) {
            0 => None,
            number => Some(number as i32),
        }
    }
}

/// The shell's exit status for a process ended by signal `number`.
pub fn exit_code(number: i32) -> i32 {
    128 + number
}

/// SIGINT, SIGTERM, ...
pub fn name(number: i32) -> String {
    match number {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        SIGUSR1 => "SIGUSR1".into(),
        SIGUSR2 => "SIGUSR2".into(),
        other => format!("signal {other}"),
    }
}
