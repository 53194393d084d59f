//! What the timeline and the errors call things: slices, waits, messages, deadlocks.

use serde::Serialize;

use super::*;

/// A slice with nothing to say beyond its name (`{}`, as the viewer expects).
#[derive(Serialize)]
pub(super) struct NoArgs {}

/// A transfer's slice: what it carries.
#[derive(Serialize)]
pub(super) struct TransferArgs {
    pub bytes: f64,
}

/// A collective's slice: what it reduces and over how many members (keys in `serde_json`'s
/// sorted order, as every other event's).
#[derive(Serialize)]
pub(super) struct CollectiveArgs {
    pub bytes: f64,
    pub members: usize,
}

impl StepRun<'_, '_, '_> {
    pub(super) fn timeline_slice(
        &mut self,
        rank: usize,
        tid: u32,
        name: &str,
        category: &str,
        span_ns: (u64, u64),
        args: &impl serde::Serialize,
    ) {
        if let Some(timeline) = self.sim.timeline.as_mut() {
            timeline.slice((rank as u32 + 1, tid), name, category, span_ns, args);
        }
    }

    pub(super) fn wait_label(&self, rank: usize, wait: Wait) -> String {
        match wait {
            Wait::Message(key) => format!("wait {}", self.key_label(key)),
            Wait::CollectiveStart(group) => format!("wait all-reduce dp{group} members"),
            Wait::Sends => format!("wait {} sends", self.ranks[rank].pending_sends),
            Wait::Reductions => format!("wait {} gradient buckets", self.ranks[rank].open_reductions),
        }
    }

    pub(super) fn transfer_label(&self, transfer: &Transfer) -> String {
        self.key_label(transfer.key)
    }

    pub(super) fn key_label(&self, key: MessageKey) -> String {
        let name = |rank: u32| self.sim.setup.ranks[rank as usize].id.to_string();
        match key {
            MessageKey::Activation { from, to, micro_batch, chunk } => {
                format!("activation mb{micro_batch}{} {}→{}", chunk_suffix(chunk), name(from), name(to))
            }
            MessageKey::Gradient { from, to, micro_batch, chunk } => {
                format!("gradient mb{micro_batch}{} {}→{}", chunk_suffix(chunk), name(from), name(to))
            }
            MessageKey::Collective { group, bucket, from, to, seq } => {
                let members = &self.collectives[group as usize][0].members;
                let bucket = if self.collectives[group as usize].len() > 1 {
                    format!(" bucket {bucket}")
                } else {
                    String::new()
                };
                format!(
                    "dp{group}{bucket} #{seq} {}→{}",
                    name(members[from as usize] as u32),
                    name(members[to as usize] as u32)
                )
            }
        }
    }

    /// The error for a step that cannot finish: every stuck rank and what it waits for, and the
    /// transfers stalled on links whose bandwidth never comes back.
    pub(super) fn deadlock(&self) -> SimError {
        let stuck = self.unfinished();
        match self.sim.network.n_flows() {
            0 => SimError::Deadlock { stuck },
            stalled_transfers => SimError::Stalled { stuck, stalled_transfers },
        }
    }

    /// Every rank that has not finished, at which instruction.
    pub(super) fn unfinished(&self) -> Vec<String> {
        self.ranks
            .iter()
            .enumerate()
            .filter(|(_, state)| state.done_ns.is_none())
            .map(|(rank, state)| {
                let instruction =
                    self.programs[rank].instructions.get(state.pc).map_or("end".into(), |i| i.to_string());
                format!("{} at instruction {} ({instruction})", self.sim.setup.ranks[rank].id, state.pc)
            })
            .collect()
    }
}

pub(super) fn chunk_suffix(chunk: u32) -> String {
    if chunk == 0 { String::new() } else { format!(" c{chunk}") }
}
