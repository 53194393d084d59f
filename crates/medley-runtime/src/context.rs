//! A long-context stage's collectives over the job's communicators: the head group's
//! all-to-all-v and the lane's ring all-gather-v and reduce-scatter-v, the step lists the
//! simulator prices.

use medley_comm::{Algorithm, CommError, Communicator, Counts, Op, ReduceOp};
use medley_model::ModelError;
use medley_model::context::ContextCollectives;

/// One worker's two communicators of its long-context stage.
pub(crate) struct CommCollectives {
    /// The devices of this worker's head-parallel group, in member order.
    pub group: Communicator,
    /// The devices holding this worker's heads in every group, in group order.
    pub lane: Communicator,
}

fn failed(what: &'static str) -> impl FnOnce(CommError) -> ModelError {
    move |error| ModelError::Collective { what: what.into(), source: Box::new(error) }
}

impl ContextCollectives for CommCollectives {
    fn group_all_to_all(&mut self, input: &[f32], counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError> {
        let me = self.group.rank();
        let mut output = vec![0f32; counts.iter().map(|row| row[me]).sum()];
        let counts = Counts::PerPair(counts.to_vec());
        self.group
            .collective(Op::AllToAll, &counts, Some(Algorithm::Pairwise), input, &mut output)
            .map_err(failed("the head group's all-to-all"))?;
        Ok(output)
    }

    fn lane_all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts.iter().sum()];
        let counts = Counts::PerRank(counts.to_vec());
        self.lane
            .collective(Op::AllGather, &counts, Some(Algorithm::Ring), input, &mut output)
            .map_err(failed("the lane's all-gather of keys and values"))?;
        Ok(output)
    }

    fn lane_reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts[self.lane.rank()]];
        let op = Op::ReduceScatter { op: ReduceOp::Sum };
        self.lane
            .collective(op, &Counts::PerRank(counts.to_vec()), Some(Algorithm::Ring), input, &mut output)
            .map_err(failed("the lane's reduce-scatter of the keys' and values' gradients"))?;
        Ok(output)
    }
}
