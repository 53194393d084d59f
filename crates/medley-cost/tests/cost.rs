//! The cost model's properties over many shapes, and one published measurement to compare with.

use std::collections::BTreeSet;

use medley_cost::long_context::{HeadSplit, HeadTailShards, KvExchange, Traffic, kv_traffic, ulysses_traffic};
use medley_cost::params::{active_params, total_params};
use medley_cost::{Calibration, CostModel, Setting, StageShape, StateFormat};
use medley_spec::{MlpKind, ModelParts, ModelSpec, NodeGroup, Precision, Recompute, catalog_device, catalog_model};
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
        ..ModelParts::default()
    };
    ModelSpec::new(parts, "test").unwrap()
}

#[test]
fn example_calibration_parses() {
    let path = format!("{}/../../examples/calibration.toml", env!("CARGO_MANIFEST_DIR"));
    let calibration = Calibration::from_toml(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    assert_eq!(calibration.efficiency(&catalog_device("h100").unwrap()).matmul, 0.62);
    assert_eq!(calibration.overheads(), medley_cost::Overheads { per_micro_batch_s: 5e-4, per_layer_s: 2e-5 });
}

/// Issue 33: a framework's overheads lengthen each pass of a stage by its per-micro-batch cost
/// and its per-layer cost for every layer it holds, in the forward and the backward alike.
#[test]
fn overheads_lengthen_each_pass_by_the_micro_batch_and_its_layers() {
    let model = catalog_model("llama3-8b").unwrap();
    let mut calibration = Calibration::default();
    let bare = CostModel::new(&model, 2048, &calibration);
    let group = NodeGroup::with_defaults(catalog_device("h100").unwrap(), 1, 8);
    let setting = Setting { micro_batch: 1, tp: 1, recompute: Recompute::None };
    let shape = StageShape { n_layers: 4, embedding: false, head: true };
    let before = bare.stage_time(&group, shape, setting);
    calibration.set_overheads(medley_cost::Overheads { per_micro_batch_s: 0.01, per_layer_s: 0.001 });
    let after = CostModel::new(&model, 2048, &calibration).stage_time(&group, shape, setting);
    assert!((after.forward_s - before.forward_s - 0.014).abs() < 1e-12, "{before:?} {after:?}");
    assert!((after.backward_s - before.backward_s - 0.014).abs() < 1e-12, "{before:?} {after:?}");
    assert_eq!(after.weight_grad_s, before.weight_grad_s);
}

/// A model from one of the HuggingFace configs under `tests/hf` (see its SOURCE.md).
fn hf_model(name: &str) -> Result<ModelSpec, medley_spec::SpecError> {
    let path = format!("{}/tests/hf/{name}.json", env!("CARGO_MANIFEST_DIR"));
    ModelSpec::from_hf_config(&std::fs::read_to_string(&path).unwrap(), &path)
}

#[test]
fn huggingface_configs_read_as_their_published_sizes() {
    // Billions of parameters, total and active per token, from each model card: Llama 3.1 8B
    // 8.03 and 70B 70.6; Mistral 7B 7.24; Mistral-Nemo 12.2; Mixtral 8x7B 46.7, 12.9 active;
    // Qwen2.5 7B 7.61 and 14B 14.7; Qwen1.5-MoE-A2.7B 14.3, 2.7 active.
    for (name, total, active) in [
        ("llama-3.1-8b", 8.03, 8.03),
        ("llama-3.1-70b", 70.6, 70.6),
        ("mistral-7b-v0.1", 7.24, 7.24),
        ("mistral-nemo-base-2407", 12.2, 12.2),
        ("mixtral-8x7b-v0.1", 46.7, 12.9),
        ("qwen2.5-7b", 7.61, 7.61),
        ("qwen2.5-14b", 14.7, 14.7),
        ("qwen1.5-moe-a2.7b", 14.3, 2.7),
    ] {
        let model = hf_model(name).unwrap();
        let billions = |params: u64| params as f64 / 1e9;
        let (got_total, got_active) = (billions(total_params(&model)), billions(active_params(&model)));
        assert!((got_total / total - 1.0).abs() < 0.01, "{name}: {got_total:.3}B, published {total}B");
        assert!((got_active / active - 1.0).abs() < 0.01, "{name}: {got_active:.3}B active, published {active}B");
    }
}

#[test]
fn what_shapes_a_model_is_read_from_its_config() {
    let nemo = hf_model("mistral-nemo-base-2407").unwrap();
    assert_eq!((nemo.head_dim(), nemo.q_width(), nemo.sliding_window()), (128, 4096, None));
    assert_eq!(hf_model("mistral-7b-v0.1").unwrap().sliding_window(), Some(4096));
    let qwen = hf_model("qwen2.5-7b").unwrap();
    assert!(qwen.qkv_bias() && qwen.sliding_window().is_none(), "use_sliding_window is false");
    let moe = hf_model("qwen1.5-moe-a2.7b").unwrap();
    assert_eq!((moe.stored_ffn_width(), moe.active_ffn_width()), (60 * 1408 + 5632, 4 * 1408 + 5632));
}

#[test]
fn a_model_medley_cannot_represent_is_refused_naming_the_keys() {
    let err = hf_model("deepseek-v3").unwrap_err().to_string();
    for wanted in
        ["cannot represent", "multi-head latent attention", "q_lora_rank", "kv_lora_rank", "first_k_dense_replace"]
    {
        assert!(err.contains(wanted), "{wanted} missing: {err}");
    }
}

#[test]
fn a_sliding_window_cuts_attention_work() {
    let (windowed, full) = (hf_model("mistral-7b-v0.1").unwrap(), catalog_model("llama3-8b").unwrap());
    let attention = |model: &ModelSpec, seq_len| medley_cost::flops::layer_forward(model, seq_len, 1).attention;
    // Up to the window every token attends to all before it; at 4× the window, each attends to
    // 4096 of up to 16,384: 4096·16384 − 4096²/2 pairs against 16384²/2.
    assert_eq!(attention(&windowed, 4096), attention(&full, 4096));
    assert!((attention(&windowed, 16_384) / attention(&full, 16_384) - 0.4375).abs() < 1e-12);
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
        // fp16: every catalog device has it (the V100 has no bf16), at its bf16 rate where both.
        let cost = CostModel::new(&model, seq_len, &calibration).with_states(StateFormat::new(Precision::Fp16Mixed));
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

// ---------------------------------------------------------------------------------------------
// Long context: uneven head–tail shards and head splits

proptest! {
    /// Any weights: shards cover the sequence in whole blocks, every shard's causal work is exactly
    /// tokens · (N + 1) / 2, and each device's bytes are what a hop-by-hop ring, a pairwise
    /// all-gather and an all-to-all by head ownership move.
    #[test]
    fn uneven_context_splits_cover_tokens_balance_work_and_price_each_device(
        weights in proptest::collection::vec(0.05f64..8.0, 1..9),
        blocks_per_unit in 1u64..64,
        n_heads_weights in proptest::collection::vec(0.1f64..4.0, 1..17),
    ) {
        let block = 128;
        let n_tokens = 2 * block * (weights.len() as u64 + blocks_per_unit);
        let shards = HeadTailShards::proportional(n_tokens, &weights, block).unwrap();
        prop_assert_eq!(shards.counts().iter().sum::<u64>(), n_tokens);
        let mut pairs = 0;
        for (shard, &tokens) in shards.counts().iter().enumerate() {
            prop_assert!(tokens > 0 && tokens % (2 * block) == 0);
            prop_assert_eq!(shards.pairs(shard) * 2, tokens * (n_tokens + 1));
            pairs += shards.pairs(shard);
        }
        prop_assert_eq!(pairs, n_tokens * (n_tokens + 1) / 2);

        let model = catalog_model("llama3-8b").unwrap();
        let per_token = 2 * 8 * u64::from(model.head_dim()) * 2;
        let (by_hops, by_pairs) = (ring_by_hops(shards.counts(), per_token), all_gather_by_pairs(shards.counts(), per_token));
        for group in 0..weights.len() {
            prop_assert_eq!(kv_traffic(&model, &shards, group, 8, KvExchange::Ring, 2), by_hops[group]);
            prop_assert_eq!(kv_traffic(&model, &shards, group, 8, KvExchange::AllGather, 2), by_pairs[group]);
        }
        let heads = HeadSplit::proportional(&model, &n_heads_weights).unwrap();
        let q_heads: Vec<u32> = heads.shares().iter().map(|share| share.q_heads).collect();
        prop_assert_eq!(q_heads.iter().sum::<u32>(), model.n_heads());
        let tokens: Vec<u64> = shards.counts().iter().cycle().take(n_heads_weights.len()).copied().collect();
        let by_ownership = ulysses_by_ownership(&model, &tokens, &q_heads, 2);
        for (me, expected) in by_ownership.iter().enumerate() {
            prop_assert_eq!(ulysses_traffic(&model, &tokens, heads.shares(), me, 2), *expected);
        }
    }
}

/// Each group's K/V bytes around a ring, hop by hop: at hop k a group forwards the block it
/// received at hop k − 1 (its own at hop 0) and receives its predecessor's.
fn ring_by_hops(counts: &[u64], per_token: u64) -> Vec<Traffic> {
    let n = counts.len();
    (0..n)
        .map(|me| {
            let mut traffic = Traffic::default();
            for hop in 0..n - 1 {
                traffic.sent += counts[(me + n - hop) % n] * per_token;
                traffic.received += counts[(me + n - 1 - hop) % n] * per_token;
            }
            traffic
        })
        .collect()
}

/// Each group's K/V bytes in an all-gather: its block to every other group, theirs to it.
fn all_gather_by_pairs(counts: &[u64], per_token: u64) -> Vec<Traffic> {
    let mut traffic = vec![Traffic::default(); counts.len()];
    for from in 0..counts.len() {
        for to in (0..counts.len()).filter(|&to| to != from) {
            traffic[from].sent += counts[from] * per_token;
            traffic[to].received += counts[from] * per_token;
        }
    }
    traffic
}

/// Each device's Ulysses bytes from who owns what: device j computes attention for query heads
/// `q_heads[j]` in head order and for the KV heads those read; every other device sends it Q, K
/// and V of its tokens for those heads, and gets the outputs back.
fn ulysses_by_ownership(model: &ModelSpec, tokens: &[u64], q_heads: &[u32], bytes: u64) -> Vec<Traffic> {
    let (unit, head_dim) = (model.n_heads() / model.n_kv_heads(), u64::from(model.head_dim()));
    let mut first = 0;
    let owned: Vec<(u64, u64)> = q_heads
        .iter()
        .map(|&q| {
            let kv: BTreeSet<u32> = (first..first + q).map(|head| head / unit).collect();
            first += q;
            (u64::from(q), kv.len() as u64)
        })
        .collect();
    let mut traffic = vec![Traffic::default(); tokens.len()];
    for from in 0..tokens.len() {
        for to in (0..tokens.len()).filter(|&to| to != from) {
            let (q, kv) = owned[to];
            let qkv = tokens[from] * (q + 2 * kv) * head_dim * bytes;
            let output = tokens[from] * q * head_dim * bytes;
            traffic[from].sent += qkv;
            traffic[to].received += qkv;
            traffic[to].sent += output;
            traffic[from].received += output;
        }
    }
    traffic
}
