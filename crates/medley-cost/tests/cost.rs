//! The cost model's properties over many shapes, and one published measurement to compare with.

use medley_cost::{Calibration, CostModel, Setting, StageShape};
use medley_spec::{MlpKind, ModelParts, ModelSpec, NodeGroup, Recompute, catalog_device};
use proptest::prelude::*;

fn model(n_layers: u32, hidden_heads: u32, n_heads: u32, kv_divisor: u32, mlp: MlpKind) -> ModelSpec {
    let hidden = hidden_heads * n_heads;
    let parts = ModelParts {
        name: "random".into(),
        n_layers,
        hidden,
        n_heads,
        n_kv_heads: n_heads / kv_divisor,
        ffn_hidden: 4 * hidden,
        vocab: 32000,
        mlp,
        experts: None,
        tie_embeddings: false,
    };
    ModelSpec::new(parts, "test").unwrap()
}

#[test]
fn example_calibration_parses() {
    let path = format!("{}/../../examples/calibration.toml", env!("CARGO_MANIFEST_DIR"));
    let calibration = Calibration::from_toml(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    assert_eq!(calibration.efficiency(&catalog_device("h100").unwrap()).matmul, 0.62);
}

proptest! {
    #[test]
    fn time_and_memory_grow_with_work(
        head_dim in prop::sample::select(vec![64u32, 128]),
        n_heads in prop::sample::select(vec![8u32, 16, 32]),
        kv_divisor in prop::sample::select(vec![1u32, 2, 8]),
        gated in any::<bool>(),
        seq_len in prop::sample::select(vec![512u32, 2048, 8192]),
        micro_batch in 1u32..4,
        tp in prop::sample::select(vec![1u32, 2, 4, 8]),
        n_layers in 1u32..20,
        device in prop::sample::select(vec!["h100", "a100", "mi300x", "l40s", "v100"]),
    ) {
        let mlp = if gated { MlpKind::SwiGlu } else { MlpKind::Gelu };
        let model = model(32, head_dim, n_heads, kv_divisor, mlp);
        let calibration = Calibration::default();
        let cost = CostModel::new(&model, seq_len, &calibration);
        let group = NodeGroup::with_defaults(catalog_device(device).unwrap(), 1, 8);
        for recompute in Recompute::ALL {
            let setting = Setting { micro_batch, tp, recompute };
            let shape = |n_layers| StageShape { n_layers, embedding: false, head: false };
            let time = |n| cost.stage_time(&group, shape(n), setting).total_s();
            let memory = |n, in_flight| cost.stage_memory(shape(n), setting, in_flight, 1).total();
            prop_assert!(time(n_layers) > 0.0 && time(n_layers + 1) > time(n_layers));
            prop_assert!(memory(n_layers + 1, 2.0) > memory(n_layers, 2.0));
            prop_assert!(memory(n_layers, 3.0) > memory(n_layers, 2.0));
            let bigger = Setting { micro_batch: micro_batch + 1, ..setting };
            prop_assert!(cost.stage_time(&group, shape(n_layers), bigger).total_s() > time(n_layers));
            // Splitting a stage over more TP ranks never needs more memory per rank.
            if tp < 8 {
                let wider = Setting { tp: tp * 2, ..setting };
                prop_assert!(cost.stage_memory(shape(n_layers), wider, 2.0, 1).total() < memory(n_layers, 2.0));
            }
        }
    }
}
