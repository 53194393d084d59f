//! One layer of a long-context stage as data: the steps every device of the stage takes, in
//! order, and each device's operations for them.
//!
//! A device computes its tokens' projections and MLP, joins its group's Ulysses all-to-all (an
//! all-to-all-v: Q, K and V of its tokens to the devices holding their heads), exchanges keys and
//! values with the devices holding the same heads in the other groups (its *lane*: a ring
//! all-gather-v, as ring attention passes blocks; attention runs on each block as it arrives, or,
//! for an all-gather, once every block is in), and sends its heads' outputs back by a second
//! all-to-all. The backward does the same in reverse with the gradients; around a ring the keys
//! and values travel again with their gradients, after an all-gather their gradients
//! reduce-scatter to their owners. Recomputation adds the forward's attention (selective) or the
//! whole forward (full) to the backward.
//!
//! [`layer_steps`] is that order, defined once: the runtime's long-context stage (medley-model)
//! runs its steps with real tensors, and [`device_programs`] lowers them, for a layer's
//! [`LayerShape`], into each device's operations — compute, and the sends and receives of
//! medley-collective's step lists — which the simulator times. No costs here: the simulator
//! prices each [`Work`], the runtime computes it.

mod lower;
#[cfg(test)]
mod tests;

use medley_collective::{Algorithm, CollectiveError, Op, ReduceOp};
pub use medley_cost::long_context::{HeadShare, KvExchange};
pub use medley_spec::Recompute;
use thiserror::Error;

pub use lower::{DeviceStreams, Keys, LayerOp, LayerShape, Member, Tag, Waiting, Work, device_programs};

/// The pass of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerPass {
    Forward,
    Backward,
}

/// Matmuls outside attention, on a device's own tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Matmuls {
    /// The norm and the Q, K and V projections.
    QkvForward,
    /// The output projection and the MLP.
    OutputMlpForward,
    /// The MLP's and the output projection's backward.
    MlpOutputBackward,
    /// The Q, K and V projections' backward.
    QkvBackward,
}

impl Matmuls {
    /// Its name on a timeline.
    pub fn name(self) -> &'static str {
        match self {
            Matmuls::QkvForward | Matmuls::QkvBackward => "Q/K/V projections",
            Matmuls::OutputMlpForward => "output projection, MLP",
            Matmuls::MlpOutputBackward => "MLP, output projection",
        }
    }

    pub fn is_backward(self) -> bool {
        matches!(self, Matmuls::MlpOutputBackward | Matmuls::QkvBackward)
    }

    /// Whether these are the layer's matmuls before attention (the Q, K, V projections).
    pub fn before_attention(self) -> bool {
        matches!(self, Matmuls::QkvForward | Matmuls::QkvBackward)
    }
}

/// The head group's all-to-all-v, by what it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllToAll {
    /// Q, K and V of every device's tokens to the devices holding their heads.
    QkvToHeads,
    /// Each device's heads' attention outputs back to the tokens' devices.
    OutputToTokens,
    /// The outputs' gradients to the heads: `OutputToTokens` the other way.
    OutputGradToHeads,
    /// The Q, K and V gradients back to the tokens: `QkvToHeads` the other way.
    QkvGradToTokens,
}

impl AllToAll {
    /// Whether it carries Q, K and V (or their gradients) rather than attention's output.
    pub fn carries_qkv(self) -> bool {
        matches!(self, AllToAll::QkvToHeads | AllToAll::QkvGradToTokens)
    }

    /// Whether it is the backward's, which sends the forward's message matrix transposed.
    pub fn is_backward(self) -> bool {
        matches!(self, AllToAll::OutputGradToHeads | AllToAll::QkvGradToTokens)
    }
}

/// How much attention a step computes on the keys at hand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionWork {
    /// None: the keys and values are gathered again for a backward's attention that follows.
    None,
    Forward,
    /// FlashAttention's backward, after the forward's attention again when `recomputed`.
    Backward {
        recomputed: bool,
    },
}

/// One step of a long-context layer, taken by every device of the stage in turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerStep {
    Matmuls(Matmuls),
    AllToAll(AllToAll),
    /// The lane's keys and values, `copies` K/V-sized blocks per token (2 when their gradients
    /// travel with them), all-gathered over the lane, and `attention` on them: block by block
    /// as they arrive around a ring, once all are in for an all-gather.
    KeysValues {
        copies: u32,
        attention: AttentionWork,
    },
    /// Attention over every group's keys and values, already gathered.
    Attention(AttentionWork),
    /// The keys' and values' gradients summed over the lane and scattered to their owners.
    KvGradients,
}

/// The collectives a layer's steps run, each over its devices as medley-collective plans it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerCollective {
    /// The head group's all-to-all-v.
    GroupAllToAll,
    /// The lane's all-gather-v of keys and values.
    LaneAllGather,
    /// The lane's reduce-scatter-v (sum) of their gradients.
    LaneReduceScatter,
}

impl LayerCollective {
    pub fn op(self) -> Op {
        match self {
            LayerCollective::GroupAllToAll => Op::AllToAll,
            LayerCollective::LaneAllGather => Op::AllGather,
            LayerCollective::LaneReduceScatter => Op::ReduceScatter { op: ReduceOp::Sum },
        }
    }

    /// Pairwise exchanges inside a group; rings over a lane, whose devices are in other groups.
    pub fn algorithm(self) -> Algorithm {
        match self {
            LayerCollective::GroupAllToAll => Algorithm::Pairwise,
            LayerCollective::LaneAllGather | LayerCollective::LaneReduceScatter => Algorithm::Ring,
        }
    }
}

impl LayerStep {
    /// The collective the step runs, if any.
    pub fn collective(self) -> Option<LayerCollective> {
        match self {
            LayerStep::AllToAll(_) => Some(LayerCollective::GroupAllToAll),
            LayerStep::KeysValues { .. } => Some(LayerCollective::LaneAllGather),
            LayerStep::KvGradients => Some(LayerCollective::LaneReduceScatter),
            LayerStep::Matmuls(_) | LayerStep::Attention(_) => None,
        }
    }
}

/// The steps of one pass of a layer whose lane exchanges keys and values by `kv_exchange`,
/// under `recompute`.
pub fn layer_steps(pass: LayerPass, kv_exchange: KvExchange, recompute: Recompute) -> Vec<LayerStep> {
    use LayerStep as S;
    let forward = [
        S::Matmuls(Matmuls::QkvForward),
        S::AllToAll(AllToAll::QkvToHeads),
        S::KeysValues { copies: 1, attention: AttentionWork::Forward },
        S::AllToAll(AllToAll::OutputToTokens),
        S::Matmuls(Matmuls::OutputMlpForward),
    ];
    if pass == LayerPass::Forward {
        return forward.to_vec();
    }
    // Recomputation: the whole forward first (full), or its attention inside the backward's
    // (selective).
    let mut steps = match recompute {
        Recompute::Full => forward.to_vec(),
        Recompute::None | Recompute::Selective => Vec::new(),
    };
    let attention = AttentionWork::Backward { recomputed: recompute == Recompute::Selective };
    // In reverse layer order: the MLP and output projection, the outputs' gradients to the heads,
    steps.extend([S::Matmuls(Matmuls::MlpOutputBackward), S::AllToAll(AllToAll::OutputGradToHeads)]);
    // attention's backward with the keys and values: around the ring again with their gradients,
    // as ring attention passes them; or kept from the forward (gathered again when it is
    // recomputed), their gradients then reduce-scattered to their owners,
    match kv_exchange {
        KvExchange::Ring => steps.push(S::KeysValues { copies: 2, attention }),
        KvExchange::AllGather => {
            if recompute == Recompute::Selective {
                steps.push(S::KeysValues { copies: 1, attention: AttentionWork::None });
            }
            steps.extend([S::Attention(attention), S::KvGradients]);
        }
    }
    // the inputs' gradients back to the tokens, the Q, K, V projections.
    steps.extend([S::AllToAll(AllToAll::QkvGradToTokens), S::Matmuls(Matmuls::QkvBackward)]);
    steps
}

/// Why a layer's operations cannot be written.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum LayerError {
    #[error(
        "context groups of different sizes or head splits (keys and values travel between the devices that hold \
         the same heads)"
    )]
    HeadSplitsDiffer,
    #[error("lowering a layer's collective: {0}")]
    Collective(CollectiveError),
}

impl From<CollectiveError> for LayerError {
    fn from(error: CollectiveError) -> Self {
        LayerError::Collective(error)
    }
}
