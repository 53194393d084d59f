//! A long-context stage's collectives over the job's communicators: the head group's
//! all-to-all-v and the lane's ring all-gather-v and reduce-scatter-v, each with the operation
//! and algorithm `medley_schedule::long_context_layer` gives it, whose step lists the simulator
//! prices, paced to the emulated device ([`crate::emulation::Pacer`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use medley_comm::{CommError, Communicator, Counts};
use medley_model::ModelError;
use medley_model::long_context::ContextCollectives;
use medley_schedule::long_context_layer::LayerCollective;

use crate::emulation::Pacer;

/// One worker's two communicators of its long-context stage.
pub(crate) struct CommCollectives {
    /// The devices of this worker's head-parallel group, in member order.
    pub group: Communicator,
    /// The devices holding this worker's heads in every group, in group order.
    pub lane: Communicator,
    pub pacer: Pacer,
    /// Bytes both communicators have sent, for the worker to report.
    pub sent: Arc<AtomicU64>,
}

impl CommCollectives {
    /// Runs `collective` over its communicator, as a pause in computing.
    fn run(
        &mut self,
        collective: LayerCollective,
        counts: Counts,
        input: &[f32],
        output: &mut [f32],
    ) -> Result<(), CommError> {
        let communicator = match collective {
            LayerCollective::GroupAllToAll => &mut self.group,
            LayerCollective::LaneAllGather | LayerCollective::LaneReduceScatter => &mut self.lane,
        };
        let (op, algorithm) = (collective.op(), collective.algorithm());
        let result = self.pacer.around(|| communicator.collective(op, &counts, Some(algorithm), input, output));
        self.count_sent();
        result
    }

    fn count_sent(&self) {
        self.sent.store(self.group.bytes_sent() + self.lane.bytes_sent(), Ordering::Relaxed);
    }
}

fn failed(what: &'static str) -> impl FnOnce(CommError) -> ModelError {
    move |error| ModelError::Collective { what: what.into(), source: Box::new(error) }
}

impl ContextCollectives for CommCollectives {
    fn group_all_to_all(&mut self, input: &[f32], counts: &[Vec<usize>]) -> Result<Vec<f32>, ModelError> {
        let me = self.group.rank();
        let mut output = vec![0f32; counts.iter().map(|row| row[me]).sum()];
        let counts = Counts::PerPair(counts.to_vec());
        self.run(LayerCollective::GroupAllToAll, counts, input, &mut output)
            .map_err(failed("the head group's all-to-all"))?;
        Ok(output)
    }

    fn lane_all_gather(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts.iter().sum()];
        self.run(LayerCollective::LaneAllGather, Counts::PerRank(counts.to_vec()), input, &mut output)
            .map_err(failed("the lane's all-gather of keys and values"))?;
        Ok(output)
    }

    fn lane_reduce_scatter(&mut self, input: &[f32], counts: &[usize]) -> Result<Vec<f32>, ModelError> {
        let mut output = vec![0f32; counts[self.lane.rank()]];
        self.run(LayerCollective::LaneReduceScatter, Counts::PerRank(counts.to_vec()), input, &mut output)
            .map_err(failed("the lane's reduce-scatter of the keys' and values' gradients"))?;
        Ok(output)
    }
}
