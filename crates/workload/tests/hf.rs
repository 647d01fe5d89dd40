//! The published `config.json` of each catalogue model maps to that catalogue constant
//! (apart from its name), and a config that cannot be mapped is an error naming the
//! field. Fixtures and their sources: `tests/hf/README.md`.

use serde_json::{Value, json};
use unikv::ModelSpec;
use unikv_workload::{HfConfigError, model_from_hf_config};

fn fixture(text: &str) -> Value {
    serde_json::from_str(text).expect("a fixture is JSON")
}

/// Maps `config` (named `want.name`) and compares every field with `want`.
fn check(config: &str, want: ModelSpec) {
    let got = model_from_hf_config(&fixture(config), want.name).unwrap();
    assert_eq!(got, want);
}

#[test]
fn gpt_oss_20b_config_maps_to_the_catalogue_constant() {
    check(include_str!("hf/gpt-oss-20b.json"), ModelSpec::GPT_OSS_20B);
}

#[test]
fn gemma_4_31b_config_maps_to_the_catalogue_constant_from_its_text_config() {
    check(include_str!("hf/gemma-4-31b.json"), ModelSpec::GEMMA_4_31B);
}

#[test]
fn qwen3_next_80b_a3b_config_maps_to_the_catalogue_constant() {
    check(
        include_str!("hf/qwen3-next-80b-a3b-instruct.json"),
        ModelSpec::QWEN3_NEXT_80B_A3B,
    );
}

#[test]
fn nemotron_h_8b_config_maps_to_the_catalogue_constant() {
    check(
        include_str!("hf/nemotron-h-8b-base-8k.json"),
        ModelSpec::NEMOTRON_H_8B,
    );
}

#[test]
fn the_name_is_the_callers() {
    let m = model_from_hf_config(&fixture(include_str!("hf/gpt-oss-20b.json")), "my-oss").unwrap();
    assert_eq!(m.name, "my-oss");
    assert_eq!(
        ModelSpec {
            name: ModelSpec::GPT_OSS_20B.name,
            ..m
        },
        ModelSpec::GPT_OSS_20B
    );
}

#[test]
fn qwen3_next_layer_types_and_interval_agree() {
    // transformers writes `layer_types` out when it saves the config again: the same
    // model either way.
    let mut config = fixture(include_str!("hf/qwen3-next-80b-a3b-instruct.json"));
    let types: Vec<&str> = (1..=48)
        .map(|i| {
            if i % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    config["layer_types"] = json!(types);
    config
        .as_object_mut()
        .unwrap()
        .remove("full_attention_interval");
    check(&config.to_string(), ModelSpec::QWEN3_NEXT_80B_A3B);
}

/// `config` with `edit` applied to its language-model object, mapped.
fn map_edited(
    config: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> HfConfigError {
    let mut config = fixture(config);
    let text = match config.get("text_config") {
        Some(_) => config["text_config"].as_object_mut().unwrap(),
        None => config.as_object_mut().unwrap(),
    };
    edit(text);
    model_from_hf_config(&config, "edited").unwrap_err()
}

#[test]
fn a_missing_field_is_named() {
    for (config, field) in [
        (include_str!("hf/gpt-oss-20b.json"), "sliding_window"),
        (include_str!("hf/gpt-oss-20b.json"), "num_key_value_heads"),
        (include_str!("hf/gemma-4-31b.json"), "num_hidden_layers"),
        (
            include_str!("hf/qwen3-next-80b-a3b-instruct.json"),
            "linear_num_value_heads",
        ),
        (
            include_str!("hf/qwen3-next-80b-a3b-instruct.json"),
            "full_attention_interval",
        ),
        (
            include_str!("hf/nemotron-h-8b-base-8k.json"),
            "ssm_state_size",
        ),
        (
            include_str!("hf/nemotron-h-8b-base-8k.json"),
            "hybrid_override_pattern",
        ),
        (include_str!("hf/nemotron-h-8b-base-8k.json"), "model_type"),
    ] {
        let err = map_edited(config, |c| {
            c.remove(field);
        });
        assert_eq!(err, HfConfigError::Missing { field }, "{field}");
        assert!(err.to_string().contains(field), "{err}");
    }
    // A `null` field is a missing one.
    let err = map_edited(include_str!("hf/gpt-oss-20b.json"), |c| {
        c.insert("sliding_window".into(), Value::Null);
    });
    assert_eq!(
        err,
        HfConfigError::Missing {
            field: "sliding_window"
        }
    );
}

#[test]
fn a_field_of_the_wrong_type_or_value_is_named_with_its_value() {
    for (config, field, value, named) in [
        (
            include_str!("hf/gpt-oss-20b.json"),
            "head_dim",
            json!("64"),
            "head_dim",
        ),
        (
            include_str!("hf/gpt-oss-20b.json"),
            "num_key_value_heads",
            json!(-8),
            "num_key_value_heads",
        ),
        (
            include_str!("hf/gpt-oss-20b.json"),
            "num_key_value_heads",
            json!(8.5),
            "num_key_value_heads",
        ),
        (
            include_str!("hf/gpt-oss-20b.json"),
            "sliding_window",
            json!(1u64 << 32),
            "sliding_window",
        ),
        (
            include_str!("hf/gpt-oss-20b.json"),
            "torch_dtype",
            json!("int8"),
            "torch_dtype",
        ),
        (
            include_str!("hf/gpt-oss-20b.json"),
            "model_type",
            json!(7),
            "model_type",
        ),
        (
            include_str!("hf/gpt-oss-20b.json"),
            "layer_types",
            json!("sliding_attention"),
            "layer_types",
        ),
        (
            include_str!("hf/gemma-4-31b.json"),
            "dtype",
            json!(true),
            "dtype",
        ),
        (
            include_str!("hf/nemotron-h-8b-base-8k.json"),
            "hybrid_override_pattern",
            json!(52),
            "hybrid_override_pattern",
        ),
        (
            include_str!("hf/qwen3-next-80b-a3b-instruct.json"),
            "full_attention_interval",
            json!(0),
            "full_attention_interval",
        ),
    ] {
        let shown = value.to_string();
        let err = map_edited(config, |c| {
            c.insert(field.into(), value);
        });
        match &err {
            HfConfigError::BadValue {
                field: f, value: v, ..
            } => {
                assert_eq!((f.as_str(), v.as_str()), (named, shown.as_str()), "{err}");
            }
            other => panic!("{field}: {other:?}"),
        }
        assert!(err.to_string().contains(named), "{err}");
    }
    // An unknown layer kind is named with its index.
    let err = map_edited(include_str!("hf/gemma-4-31b.json"), |c| {
        c["layer_types"][7] = json!("linear_attention");
    });
    assert!(
        matches!(&err, HfConfigError::BadValue { field, .. } if field == "layer_types[7]"),
        "{err:?}"
    );
    let err = map_edited(include_str!("hf/nemotron-h-8b-base-8k.json"), |c| {
        let pattern = c["hybrid_override_pattern"]
            .as_str()
            .unwrap()
            .replacen('*', "S", 1);
        c.insert("hybrid_override_pattern".into(), json!(pattern));
    });
    assert!(
        matches!(&err, HfConfigError::BadValue { field, .. } if field == "hybrid_override_pattern[7]"),
        "{err:?}"
    );
    // The configuration itself, or its text_config, is not an object.
    assert_eq!(
        model_from_hf_config(&json!([1, 2]), "x").unwrap_err(),
        HfConfigError::NotAnObject {
            field: "config.json"
        }
    );
    assert_eq!(
        model_from_hf_config(&json!({"model_type": "gemma4", "text_config": "x"}), "x")
            .unwrap_err(),
        HfConfigError::NotAnObject {
            field: "text_config"
        }
    );
}

#[test]
fn an_unknown_model_type_is_unsupported() {
    let err = map_edited(include_str!("hf/gpt-oss-20b.json"), |c| {
        c.insert("model_type".into(), json!("llama"));
    });
    assert_eq!(
        err,
        HfConfigError::Unsupported {
            model_type: "llama".into()
        }
    );
    let message = err.to_string();
    assert!(
        message.contains("\"llama\"") && message.contains("nemotron_h"),
        "{message}"
    );
}

#[test]
fn per_layer_lists_must_match_num_hidden_layers() {
    let err = map_edited(include_str!("hf/gpt-oss-20b.json"), |c| {
        c.insert("num_hidden_layers".into(), json!(36));
    });
    assert_eq!(
        err,
        HfConfigError::LayerCount {
            field: "layer_types",
            listed: 24,
            num_hidden_layers: 36
        }
    );
    assert_eq!(
        err.to_string(),
        "layer_types lists 24 layers but num_hidden_layers is 36"
    );
    let err = map_edited(include_str!("hf/nemotron-h-8b-base-8k.json"), |c| {
        c.insert("hybrid_override_pattern".into(), json!("M-M-M-M*-"));
    });
    assert_eq!(
        err,
        HfConfigError::LayerCount {
            field: "hybrid_override_pattern",
            listed: 9,
            num_hidden_layers: 52
        }
    );
    let err = map_edited(include_str!("hf/gemma-4-31b.json"), |c| {
        c.insert("num_kv_shared_layers".into(), json!(60));
    });
    assert!(
        matches!(&err, HfConfigError::BadValue { field, .. } if field == "num_kv_shared_layers"),
        "{err:?}"
    );
    let err = map_edited(include_str!("hf/gpt-oss-20b.json"), |c| {
        c.insert("num_hidden_layers".into(), json!(0));
    });
    assert!(
        matches!(&err, HfConfigError::BadValue { field, .. } if field == "num_hidden_layers"),
        "{err:?}"
    );
}

#[test]
fn a_workload_error_carries_the_config_error() {
    let err: unikv_workload::WorkloadError = HfConfigError::Missing { field: "head_dim" }.into();
    assert_eq!(
        err.to_string(),
        "model config: config.json has no \"head_dim\""
    );
}
