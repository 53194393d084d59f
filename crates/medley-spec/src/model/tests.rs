//! Tests of [`super`].

use super::*;

#[test]
fn catalog_models_are_valid() {
    for name in catalog_model_names() {
        catalog_model(&name).unwrap();
    }
    assert_eq!(catalog_model("Llama3-70B").unwrap().n_layers(), 80);
    let err = catalog_model("llama3-7b").unwrap_err().to_string();
    assert!(err.contains("did you mean"), "{err}");
}

#[test]
fn a_name_with_terminal_escapes_is_refused() {
    let text = r#"{"_name_or_path":"evil\u001b]0;pwned\u0007","model_type":"gpt2","n_layer":2,
                   "n_embd":64,"n_head":2,"vocab_size":100}"#;
    let err = ModelSpec::from_hf_config(text, "config.json").unwrap_err().to_string();
    assert!(err.contains("control characters"), "{err}");
}

#[test]
fn models_past_the_parameter_limit_are_refused_and_the_largest_counts_fit_a_u64() {
    let huge = entry("huge", 1 << 24, 1 << 24, 1 << 10, 1 << 10, 1 << 24, 1 << 24, MlpKind::SwiGlu, None, false);
    let err = ModelSpec::new(huge, "huge.toml").unwrap_err().to_string();
    assert!(err.contains("parameters") && err.contains("1e15"), "{err}");
    let experts = Some(Experts { n_experts: 1 << 20, top_k: 1, ..Experts::default() });
    let many = entry("many", 2, 64, 4, 4, 64, 64, MlpKind::SwiGlu, experts, false);
    assert!(ModelSpec::new(many, "many.toml").unwrap_err().to_string().contains("n_experts"));
    // At the limit, a count in bytes with optimizer state (16 a parameter) still fits a u64.
    assert!(MAX_PARAMS * 16.0 * 1024.0 < u64::MAX as f64);
}

#[test]
fn hf_llama_config() {
    let text = r#"{"model_type":"mixtral","num_hidden_layers":32,"hidden_size":4096,
        "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
        "vocab_size":32000,"num_local_experts":8,"num_experts_per_tok":2,"hidden_act":"silu"}"#;
    let model = ModelSpec::from_hf_config(text, "mixtral/config.json").unwrap();
    assert_eq!(model.experts(), Some(Experts { n_experts: 8, top_k: 2, ..Experts::default() }));
    assert_eq!(model.mlp(), MlpKind::SwiGlu);
    assert!(!model.tie_embeddings());
    assert_eq!(model, {
        let mut expected = catalog_model("mixtral-8x7b").unwrap();
        expected.parts.name = "mixtral/config.json".to_string();
        expected
    });
}

#[test]
fn hf_gpt2_config_defaults_inner_to_four_h() {
    let text = r#"{"model_type":"gpt2","n_layer":12,"n_embd":768,"n_head":12,"n_inner":null,"vocab_size":50257}"#;
    let model = ModelSpec::from_hf_config(text, "gpt2.json").unwrap();
    assert_eq!((model.ffn_hidden(), model.mlp(), model.tie_embeddings()), (3072, MlpKind::Gelu, true));
}

fn llama_like(extra: &str) -> Result<ModelSpec, SpecError> {
    let text = format!(
        r#"{{"num_hidden_layers":4,"hidden_size":256,"num_attention_heads":4,"intermediate_size":512,"vocab_size":100{extra}}}"#
    );
    ModelSpec::from_hf_config(&text, "c.json")
}

#[test]
fn hf_hybrids_and_unknown_model_types_are_refused() {
    let err = llama_like(r#","model_type":"jamba""#).unwrap_err().to_string();
    assert!(err.contains("`jamba` is not one whose keys medley reads"), "{err}");
    let hybrid = r#","model_type":"qwen3","layer_types":["full_attention","linear_attention","full_attention","linear_attention"]"#;
    let err = llama_like(hybrid).unwrap_err().to_string();
    assert!(err.contains("`linear_attention` (`layer_types`)"), "{err}");
    let some_windowed = r#","model_type":"qwen2","use_sliding_window":true,"sliding_window":64,"max_window_layers":2"#;
    let err = llama_like(some_windowed).unwrap_err().to_string();
    assert!(err.contains("2 of its 4 layers attend within a sliding window"), "{err}");
}

#[test]
fn hf_sliding_windows_follow_each_families_defaults() {
    let window = |extra: &str| llama_like(extra).unwrap().sliding_window();
    assert_eq!(window(r#","model_type":"mistral""#), Some(4096), "MistralConfig's default");
    assert_eq!(window(r#","model_type":"mistral","sliding_window":null"#), None);
    assert_eq!(window(r#","model_type":"qwen2","sliding_window":64"#), None, "Qwen windows only when asked");
    assert_eq!(window(r#","model_type":"qwen2","sliding_window":64,"use_sliding_window":true"#), Some(64));
    assert_eq!(window(r#","model_type":"phi3","sliding_window":64"#), Some(64));
}

#[test]
fn hf_config_errors_name_the_key() {
    let err = ModelSpec::from_hf_config(r#"{"hidden_size":4096}"#, "c.json").unwrap_err().to_string();
    assert!(err.contains("num_attention_heads"), "{err}");
    let err = ModelSpec::from_hf_config("{\n  \"a\": ,\n}", "c.json").unwrap_err().to_string();
    assert!(err.starts_with("c.json:2:"), "{err}");
    let text =
        r#"{"num_hidden_layers":2,"hidden_size":100,"num_attention_heads":3,"intermediate_size":4,"vocab_size":5}"#;
    let err = ModelSpec::from_hf_config(text, "c.json").unwrap_err().to_string();
    assert!(err.contains("do not divide"), "{err}");
}

/// Llama 3.1 8B's `config.json` as meta-llama publishes it (the keys medley reads).
const LLAMA_3_1_8B: &str = r#"{"model_type":"llama","num_hidden_layers":32,"hidden_size":4096,
    "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,
    "hidden_act":"silu","rms_norm_eps":1e-05,"rope_theta":500000.0,"tie_word_embeddings":false,
    "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                    "original_max_position_embeddings":8192,"rope_type":"llama3"}}"#;

#[test]
fn hf_rope_base_scaling_and_norm_epsilon_are_read_in_either_transformers_layout() {
    let model = ModelSpec::from_hf_config(LLAMA_3_1_8B, "config.json").unwrap();
    let mut expected = catalog_model("llama3-8b").unwrap();
    expected.parts.name = "config.json".to_string();
    assert_eq!(model, expected);
    assert_eq!((model.rope_theta(), model.norm_eps()), (500_000.0, 1e-5));
    assert_eq!(model.rope_scaling(), Some(RopeScaling::llama3(8.0)));
    // transformers 5 keeps RoPE's keys in `rope_parameters`.
    let v5 = LLAMA_3_1_8B
        .replace(r#""rope_theta":500000.0,"#, "")
        .replace(r#""rope_scaling":{"#, r#""rope_parameters":{"rope_theta":500000.0,"#);
    assert_eq!(ModelSpec::from_hf_config(&v5, "config.json").unwrap(), expected, "{v5}");
    // Absent keys take the configuration class's defaults.
    let plain = llama_like(r#","model_type":"llama""#).unwrap();
    assert_eq!((plain.rope_theta(), plain.rope_scaling(), plain.norm_eps()), (10_000.0, None, 1e-6));
    let gpt2 = r#"{"model_type":"gpt2","n_layer":2,"n_embd":64,"n_head":2,"vocab_size":100,"layer_norm_epsilon":1e-6}"#;
    assert_eq!(ModelSpec::from_hf_config(gpt2, "gpt2.json").unwrap().norm_eps(), 1e-6);
}

#[test]
fn rope_that_medley_cannot_carry_is_refused_by_name() {
    let yarn = r#","rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}"#;
    let err = llama_like(yarn).unwrap_err().to_string();
    assert!(err.contains("RoPE scaling is of type `yarn`"), "{err}");
    let err = llama_like(r#","partial_rotary_factor":0.5"#).unwrap_err().to_string();
    assert!(err.contains("rotates only 0.5 of each head"), "{err}");
    let err = llama_like(r#","rope_scaling":{"rope_type":"llama3","factor":8.0}"#).unwrap_err().to_string();
    assert!(err.contains("original_max_position_embeddings"), "{err}");
    assert_eq!(llama_like(r#","rope_scaling":{"type":"default"}"#).unwrap().rope_scaling(), None);
    for (extra, key) in [(r#","rope_theta":0"#, "rope_theta"), (r#","rms_norm_eps":2.0"#, "norm_eps")] {
        let err = llama_like(extra).unwrap_err().to_string();
        assert!(err.contains(key), "{extra}: {err}");
    }
}

#[test]
fn a_plan_written_before_rope_and_epsilon_were_carried_means_what_the_runtime_then_trained() {
    let mut json = serde_json::to_value(catalog_model("llama3-8b").unwrap()).unwrap();
    for key in ["rope_theta", "rope_scaling", "norm_eps"] {
        json.as_object_mut().unwrap().remove(key);
    }
    let old: ModelSpec = serde_json::from_value(json).unwrap();
    assert_eq!((old.rope_theta(), old.rope_scaling(), old.norm_eps()), (10_000.0, None, 1e-5));
}

#[test]
fn llama3_scaling_stretches_long_wavelengths_and_interpolates_between() {
    // Computed apart from this code with transformers' `_compute_llama3_parameters` formula, in
    // Python floats: head size 128, base 500,000, factor 8, low 1, high 4, context 8,192.
    let freqs = RopeScaling::inverse_frequencies(Some(RopeScaling::llama3(8.0)), 500_000.0, 128);
    let plain = RopeScaling::inverse_frequencies(None, 500_000.0, 128);
    assert_eq!(freqs.len(), 64);
    for (idx, expected) in
        [(0, 1.0), (20, 0.016560440080994446), (30, 0.0013718935677611381), (33, 0.00031269375038406517)]
            .into_iter()
            .chain([(40, 3.428102195952591e-05), (63, 3.068925988914511e-07)])
    {
        assert!((freqs[idx] / expected - 1.0).abs() < 1e-12, "{idx}: {} against {expected}", freqs[idx]);
    }
    assert!((plain[40] / 0.0002742481756762073 - 1.0).abs() < 1e-12);
}
