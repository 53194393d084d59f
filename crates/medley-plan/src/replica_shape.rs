//! A plan's replicas grouped by shape, as reports summarise them.

use crate::plan::Plan;

/// Replicas that look alike: the same device type and layer count at every stage.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaShape {
    /// (device type, layers) per stage.
    pub stages: Vec<(String, u32)>,
    pub n_replicas: u32,
    /// Distinct batch shares among these replicas, ascending.
    pub micro_batches: Vec<u32>,
}

impl Plan {
    /// The replicas grouped by shape, in order of first appearance.
    pub fn replica_shapes(&self) -> Vec<ReplicaShape> {
        let mut shapes: Vec<ReplicaShape> = Vec::new();
        for replica in self.replicas() {
            let stages: Vec<(String, u32)> =
                replica.stages.iter().map(|stage| (self.stage_label(stage), stage.layers.len())).collect();
            match shapes.iter_mut().find(|shape| shape.stages == stages) {
                Some(shape) => {
                    shape.n_replicas += 1;
                    if let Err(at) = shape.micro_batches.binary_search(&replica.n_micro_batches) {
                        shape.micro_batches.insert(at, replica.n_micro_batches);
                    }
                }
                None => {
                    shapes.push(ReplicaShape { stages, n_replicas: 1, micro_batches: vec![replica.n_micro_batches] })
                }
            }
        }
        shapes
    }
}
