//! A data-parallel group's gradient reduction: a member's gradients of the group's layers
//! flattened, summed over the group bucket by bucket, and put back — whole on every member, or
//! under ZeRO-1 each member's run of the sum.
//!
//! Without the plan's `overlap_grad_reduce` the worker runs it at its `AllReduceGradients`. With
//! it, a thread of its own runs the buckets while the worker goes on with its program, started
//! right after the backward pass that completes the group's gradients (Megatron-LM's
//! `--overlap-grad-reduce`), and the optimizer step waits for it: where the simulator starts it.
//! The buckets are the simulator's too, as many as [`gradient_buckets`] cuts the group's gradient
//! bytes into, last layers first. The runtime's stages complete a pass's gradients together, so
//! every bucket starts at the pass's end, where the simulator readies bucket b of B at
//! (b + 1)/B of the pass: the same for a group of one bucket (below 40M parameters).

use std::ops::Range;
use std::thread::JoinHandle;

use medley_comm::{Algorithm, CommError, Communicator, Counts, Op, ReduceOp};
use medley_cost::comm::gradient_buckets;
use medley_model::tensor_parallel::even_run;
use medley_model::{ParamSpec, StageState};

/// What a member keeps of the sum.
#[derive(Clone, Debug)]
pub(crate) enum Keep {
    /// The whole sum, as every member does.
    Whole,
    /// Its run of the flattened gradients under ZeRO-1, into `buffer` (of the run's length, the
    /// last sum's, reused rather than held beside a new one): `runs` holds every member's, in
    /// member order, covering them once.
    Run { runs: Vec<Range<usize>>, member: usize, buffer: Vec<f32> },
}

/// One member's part of a group's reduction, ready to run.
pub(crate) struct Reduction {
    flat: Vec<f32>,
    keep: Keep,
    /// Ranges of `flat`, in the order they are reduced.
    buckets: Vec<Range<usize>>,
    algorithm: Option<Algorithm>,
}

/// When a bucket's collective ran, µs of the job clock.
pub(crate) type BucketSpan = (u64, u64);

/// What a reduction gives: the sum a member keeps, and when each bucket ran.
pub(crate) type Reduced = Result<(Vec<f32>, Vec<BucketSpan>), CommError>;

impl Reduction {
    /// The reduction of `flat` (a member's flattened gradients of the group) over `members` in
    /// `algorithm`, in one bucket, or, `overlapped`, in the simulator's buckets.
    pub fn new(
        flat: Vec<f32>,
        keep: Keep,
        algorithm: Option<Algorithm>,
        overlapped: bool,
        members: usize,
    ) -> Reduction {
        let buckets = buckets(flat.len(), overlapped, members);
        Reduction { flat, keep, buckets, algorithm }
    }

    /// Runs the buckets over `comm`, each timed by `now_us`: the sum this member keeps, and when
    /// each bucket ran.
    pub fn run(mut self, comm: &mut Communicator, now_us: impl Fn() -> u64) -> Reduced {
        let mut kept = match &mut self.keep {
            Keep::Whole => Vec::new(),
            Keep::Run { buffer, .. } => std::mem::take(buffer),
        };
        let mut spans = Vec::with_capacity(self.buckets.len());
        for bucket in &self.buckets {
            let started = now_us();
            // The bucket's whole working buffer, dropped after it: handed only this member's
            // part, the communicator would reduce in a scratch buffer of that size that it keeps.
            let mut summed = vec![0f32; bucket.len()];
            let input = &self.flat[bucket.clone()];
            match &self.keep {
                Keep::Whole => {
                    let op = Op::AllReduce { op: ReduceOp::Sum };
                    comm.collective(op, &Counts::Same(bucket.len()), self.algorithm, input, &mut summed)?;
                    self.flat[bucket.clone()].copy_from_slice(&summed);
                }
                Keep::Run { runs, member, .. } => {
                    let in_bucket = |run| overlap(run, bucket.start, bucket.len());
                    let counts = runs.iter().map(|run| in_bucket(run).map_or(0, |(part, _)| part.len())).collect();
                    let op = Op::ReduceScatter { op: ReduceOp::Sum };
                    comm.collective(op, &Counts::PerRank(counts), self.algorithm, input, &mut summed)?;
                    // A bucket may hold none of this member's run.
                    if let Some((part, in_run)) = in_bucket(&runs[*member]) {
                        kept[in_run].copy_from_slice(&summed[part]);
                    }
                }
            }
            spans.push((started, now_us()));
        }
        Ok((if matches!(self.keep, Keep::Whole) { self.flat } else { kept }, spans))
    }

    /// Runs the buckets over `comm` on a thread of their own, which hands `comm` back when done.
    pub fn start(self, mut comm: Communicator, now_us: impl Fn() -> u64 + Send + 'static) -> InFlight {
        InFlight(std::thread::spawn(move || {
            let result = self.run(&mut comm, now_us);
            (comm, result)
        }))
    }
}

/// A reduction running on its own thread.
pub(crate) struct InFlight(JoinHandle<(Communicator, Reduced)>);

impl InFlight {
    /// Waits for the reduction: the communicator back, with what [`Reduction::run`] gave; `None`
    /// if its thread panicked.
    pub fn wait(self) -> Option<(Communicator, Reduced)> {
        self.0.join().ok()
    }
}

/// `len` elements cut into one bucket, or, `overlapped`, into the simulator's buckets of
/// gradients reduced over `members`: ranges, last first.
fn buckets(len: usize, overlapped: bool, members: usize) -> Vec<Range<usize>> {
    let n_buckets = match overlapped {
        true => gradient_buckets(len as f64, members) as usize,
        false => 1,
    };
    (0..n_buckets).rev().map(|bucket| even_run(len, bucket, n_buckets)).collect()
}

/// The part of `run` that a tensor (or a bucket) at `offset` of `len` elements holds: its
/// indices in the tensor and in the run.
pub(crate) fn overlap(run: &Range<usize>, offset: usize, len: usize) -> Option<(Range<usize>, Range<usize>)> {
    let (start, end) = (run.start.max(offset), run.end.min(offset + len));
    (start < end).then(|| (start - offset..end - offset, start - run.start..end - run.start))
}

/// The gradients of the parameters of `stages` that `pick` picks, flattened in canonical
/// order; `whole`, each a whole tensor with this member's shard placed among zeros (for
/// members whose shards differ).
pub(crate) fn flatten_gradients(
    stages: &mut [StageState],
    pick: impl Fn(&ParamSpec) -> bool + Copy,
    whole: bool,
) -> Vec<f32> {
    let mut flat = Vec::new();
    for stage in stages.iter_mut() {
        for (spec, grad) in stage.grads_with_specs_mut(pick) {
            match (&spec.shard, whole) {
                (Some(shard), true) => {
                    let at = flat.len();
                    flat.resize(at + spec.full_numel(), 0.0);
                    shard.place(&grad.data, &mut flat[at..]);
                }
                _ => flat.extend_from_slice(&grad.data),
            }
        }
    }
    flat
}

/// Puts `flat`, laid out as [`flatten_gradients`] lays it out, back into the gradients.
pub(crate) fn unflatten_gradients(
    stages: &mut [StageState],
    pick: impl Fn(&ParamSpec) -> bool + Copy,
    whole: bool,
    flat: &[f32],
) {
    let mut rest = flat;
    for stage in stages.iter_mut() {
        for (spec, grad) in stage.grads_with_specs_mut(pick) {
            let len = if whole { spec.full_numel() } else { grad.data.len() };
            let (mine, tail) = rest.split_at(len);
            match (&spec.shard, whole) {
                (Some(shard), true) => grad.data = shard.slice(mine),
                _ => grad.data.copy_from_slice(mine),
            }
            rest = tail;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_gradients_once_last_layers_first() {
        let len = 100_000_000;
        let overlapped = buckets(len, true, 2);
        assert!(overlapped.len() > 1);
        assert_eq!(overlapped.first().unwrap().end, len, "the last layers' bucket goes first");
        assert!(overlapped.windows(2).all(|pair| pair[1].end == pair[0].start));
        assert_eq!(overlapped.last().unwrap().start, 0);
        assert_eq!(buckets(len, false, 2), vec![0..len]);
        assert_eq!(buckets(1_000, true, 2), vec![0..1_000], "a small group is one bucket");
    }

    /// Three members over loopback each reduce `flat(member)` in `buckets`, keeping `keep(member)`.
    fn reduce_among_three(
        buckets: Vec<Range<usize>>,
        flat: impl Fn(usize) -> Vec<f32> + Sync,
        keep: impl Fn(usize) -> Keep + Sync,
    ) -> Vec<Vec<f32>> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        std::thread::scope(|scope| {
            let members: Vec<_> = (0..3)
                .map(|rank| {
                    let (buckets, flat, keep) = (buckets.clone(), &flat, &keep);
                    scope.spawn(move || {
                        let env = medley_comm::LaunchEnv::from_vars([
                            ("RANK", rank.to_string()),
                            ("WORLD_SIZE", "3".into()),
                            ("MASTER_ADDR", "127.0.0.1".into()),
                            ("MASTER_PORT", port.to_string()),
                            ("MEDLEY_TOKEN", "t".into()),
                        ])
                        .unwrap();
                        let mut comm = Communicator::init(&env, medley_comm::Config::default()).unwrap();
                        let reduction = Reduction { flat: flat(rank), keep: keep(rank), buckets, algorithm: None };
                        let (sum, spans) = reduction.run(&mut comm, || 0).unwrap();
                        assert_eq!(spans.len(), 3);
                        sum
                    })
                })
                .collect();
            members.into_iter().map(|member| member.join().unwrap()).collect()
        })
    }

    /// Buckets that split members' runs, and a bucket in which a member keeps nothing, sum as
    /// one collective over the whole would.
    #[test]
    fn bucketed_sums_equal_the_whole_sum_for_every_member() {
        let buckets = vec![8..10, 2..8, 0..2];
        let flat = |member: usize| (0..10).map(|i| (i * 10 + member) as f32).collect::<Vec<_>>();
        let whole: Vec<f32> = (0..10).map(|i| (30 * i + 3) as f32).collect();
        let sums = reduce_among_three(buckets.clone(), flat, |_| Keep::Whole);
        assert!(sums.iter().all(|sum| *sum == whole), "{sums:?}");
        let runs = vec![0..3, 3..7, 7..10];
        let sums = reduce_among_three(buckets, flat, |member| Keep::Run {
            runs: runs.clone(),
            member,
            buffer: vec![0.0; runs[member].len()],
        });
        for (member, sum) in sums.iter().enumerate() {
            assert_eq!(*sum, whole[runs[member].clone()], "member {member}");
        }
    }

    #[test]
    fn a_member_keeps_its_run_of_each_bucket() {
        assert_eq!(overlap(&(0..5), 3, 6), Some((0..2, 3..5)));
        assert_eq!(overlap(&(0..5), 6, 3), None);
        assert_eq!(overlap(&(6..9), 0, 5), None);
    }
}
