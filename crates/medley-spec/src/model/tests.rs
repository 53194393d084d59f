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
