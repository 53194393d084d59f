//! Pipeline schedules as per-rank programs.
//!
//! A [`Plan`](medley_plan::Plan) says who holds which layers; this crate says what each of them
//! executes, in order, in one training step. [`generate`] turns a validated plan and a
//! [`ScheduleKind`] into [`Programs`]: one [`Program`] per pipeline rank ([`RankId`]: replica and
//! pipeline rank, which runs all of its model chunks when the plan has several), a list of
//! [`Instruction`]s. [`check`] proves a step's programs correct, and [`CheckedPrograms`] are
//! the only programs the engines take, so neither proves them again. The simulator
//! executes the programs in simulated time and the runtime executes the very same programs for
//! real; neither reorders them.
//!
//! # The instruction set
//!
//! - Compute: `Forward`, `Backward` (input and weight gradients together), or the zero-bubble
//!   split `BackwardInput` / `BackwardWeight`, each of one micro-batch on one model chunk (chunk c
//!   of rank i of p is the plan's virtual stage c·p + i). Tensor
//!   parallelism lives inside compute: every TP rank of a stage runs the stage's program, and the
//!   TP collectives of a pass belong to that pass.
//! - Point to point: `SendActivation` / `RecvActivation` between a virtual stage and the next
//!   (the last rank's chunk c feeds rank 0's chunk c + 1), `SendGradient` / `RecvGradient` back,
//!   each naming micro-batch, chunk and peer; the chunk is the *sender's* on both ends, so a send
//!   and its receive are equal messages. Transfer k of a TP group goes between the two stages'
//!   TP rank k.
//! - Gradient synchronisation: `AllReduceGradients` on `plan.dp_groups[dp_group]`, one per group
//!   whose layers the rank holds in any chunk, last layers first; the members are the group's holder stage
//!   in every replica (a group of one replica is a no-op the engines may skip). With the plan's
//!   `overlap_grad_reduce`, each comes right after the last pass computing its chunk's weight
//!   gradients, and the simulator runs it bucket by bucket alongside that pass (Megatron-LM's
//!   `--overlap-grad-reduce`); without, all come after the last pass.
//! - `OptimizerStep`, the last instruction.
//!
//! # Execution semantics
//!
//! Both engines obey the same rules, and [`check`] proves the programs cannot deadlock under them:
//! - an instruction starts only after the rank's previous instruction has started, in order;
//! - compute passes never wait on other ranks (their inputs were received by earlier
//!   instructions);
//! - a send never blocks: it hands its message to the transport, which delivers it eventually
//!   (the runtime posts an asynchronous send and waits for it before the step ends or the buffer
//!   is reused; the simulator starts a transfer);
//! - a receive blocks until the matching send has been issued (the runtime may post it earlier
//!   as long as it completes before the next instruction);
//! - an all-reduce blocks until every member of its group has reached it (the simulator lets an
//!   overlapped one run beside the rank's later instructions; programs that cannot deadlock when
//!   it blocks cannot when it does not).
//!
//! Rendezvous sends (a send that blocks until its receive is posted) are not assumed: under
//! them 1F1B's steady state needs the send and the receive of neighbouring stages fused into one
//! exchange, as Megatron-LM batches them.
//!
//! # Schedules
//!
//! GPipe, 1F1B, kFkB (Ada-Grouper) and ZB-H1, each for uneven stages and for replicas with
//! different micro-batch counts (every replica runs its own pipeline; they meet only in the
//! gradient all-reduces), on plans with one chunk per rank; interleaved 1F1B (Megatron-LM's
//! order) on plans with `virtual_stages` > 1, for micro-batch counts that are a multiple of the
//! replica's ranks or below it. [`generate`] refuses other combinations with a typed error.
//! `adaptive` ([`medley_spec::Schedule::Adaptive`]) is no kind but a choice of kFkB's k before
//! each step: [`StepSchedules`].

pub mod adaptive;
mod check;
mod error;
mod generate;
mod geometry;
pub mod long_context_layer;
mod program;
mod schedules;
mod times;

pub use adaptive::{AdaptiveK, StepObservation, StepSchedules};
pub use check::check;
pub use error::ScheduleError;
pub use generate::{ProgramsByKind, generate};
pub use medley_spec::{Schedule, ScheduleKind};
pub use program::{CheckedPrograms, Instruction, Program, Programs, RankId};
pub use times::RankTimes;
