//! A model from a Hugging Face `config.json`: the layer kinds, the sliding window, each
//! attention kind's KV heads × head dim and the linear-attention (Mamba2 / Gated
//! DeltaNet) state sizes, read into a [`ModelSpec`] so a model the catalogue does not
//! name sizes a cache from the file its checkpoint ships with.
//!
//! [`model_from_hf_config`] maps four families, reading the fields their `transformers`
//! configuration classes define:
//!
//! | `model_type` | layer kinds from | KV rows | recurrent state |
//! |---|---|---|---|
//! | `gpt_oss` | `layer_types` (else sliding/full alternating) | `num_key_value_heads` × `head_dim`, both kinds | — |
//! | `gemma2`, `gemma3`, `gemma3_text`, `gemma4`, `gemma4_text` | `layer_types` (else gemma2 alternating, gemma3 `sliding_window_pattern`) | SWA: `num_key_value_heads` × `head_dim`; FULL: `num_global_key_value_heads` × `global_head_dim` when given | — |
//! | `qwen3_next`, `qwen3_5`, `qwen3_5_text`, `qwen3_5_moe`, `qwen3_5_moe_text` | `layer_types` (else `full_attention_interval`) | `num_key_value_heads` × `head_dim` | Gated DeltaNet: `linear_*` fields |
//! | `nemotron_h` | `hybrid_override_pattern` (else `layers_block_type`) | `num_key_value_heads` × `attention_head_dim` (or `head_dim`) | Mamba2: `mamba_num_heads`, `mamba_head_dim`, `ssm_state_size`, `n_groups`, `conv_kernel` |
//!
//! A multimodal checkpoint nests the language model under `text_config`; its fields are
//! read from there (and `model_type` and the dtype from the top level when
//! `text_config` lacks them).
//!
//! Element sizes: the KV rows and the conv state take the checkpoint's dtype
//! (`dtype`, else `torch_dtype`: bfloat16/float16 → 2 bytes, float32 → 4; 2 when
//! absent, as for gpt-oss, whose `config.json` names none). The temporal (SSM) state is
//! float32 (4 bytes) unless the config names `mamba_ssm_dtype` or
//! `mamba_ssm_cache_dtype` — SGLang's rule (`mamba2_state_dtype`) and the catalogue's
//! ([`unikv::RecurrentState`]). The conversion from a parsed file is exact: the
//! catalogue's GPT_OSS_20B, GEMMA_4_31B, QWEN3_NEXT_80B_A3B and NEMOTRON_H_8B are what
//! their published files map to (`tests/hf.rs`, fixtures in `tests/hf/`).

use serde_json::{Map, Value};
use std::sync::{LazyLock, Mutex};
use unikv::{KvRows, ModelSpec, RecurrentState};

/// Why a `config.json` could not be mapped to a [`ModelSpec`]. Every variant names the
/// field at fault, as written in the file (`layer_types[3]`, `text_config`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HfConfigError {
    /// The configuration (or its `text_config`) is not a JSON object.
    #[error("{field} is not a JSON object")]
    NotAnObject {
        /// `config.json` or `text_config`.
        field: &'static str,
    },
    /// A field the mapping needs is absent (or `null`).
    #[error("config.json has no {field:?}")]
    Missing {
        /// The field.
        field: &'static str,
    },
    /// A field of the wrong type, out of range or with an unknown value.
    #[error("config.json field {field:?} is {value}; expected {expected}")]
    BadValue {
        /// The field (with the index for a list element: `layer_types[3]`).
        field: String,
        /// The value found, as JSON.
        value: String,
        /// What the mapping accepts.
        expected: &'static str,
    },
    /// A `model_type` this mapping does not know.
    #[error("unsupported model_type {model_type:?} (supported: {SUPPORTED})")]
    Unsupported {
        /// The `model_type` found.
        model_type: String,
    },
    /// A per-layer list whose length is not `num_hidden_layers`.
    #[error("{field} lists {listed} layers but num_hidden_layers is {num_hidden_layers}")]
    LayerCount {
        /// The list (`layer_types`, `hybrid_override_pattern`, `layers_block_type`).
        field: &'static str,
        /// Its length.
        listed: usize,
        /// `num_hidden_layers`.
        num_hidden_layers: u32,
    },
}

/// The `model_type`s [`model_from_hf_config`] maps, for the error message.
const SUPPORTED: &str = "gpt_oss, gemma2, gemma3, gemma3_text, gemma4, gemma4_text, \
                         qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, \
                         nemotron_h";

/// The [`ModelSpec`] a Hugging Face `config.json` describes, named `name`.
///
/// `config` is the parsed file (or its Python dict). The families, the fields read and
/// the element sizes are in the [module documentation](self). A config this cannot map
/// is an [`HfConfigError`] naming the field; the cache builder checks the resulting
/// geometry itself.
///
/// `ModelSpec::name` is `&'static str`: each distinct `name` is leaked once and reused
/// by later calls with the same name, so building many caches of one model does not
/// grow memory.
///
/// # Example
///
/// ```
/// use serde_json::json;
/// use unikv_workload::hf::model_from_hf_config;
///
/// let config = json!({
///     "model_type": "gpt_oss",
///     "num_hidden_layers": 4,
///     "layer_types": ["sliding_attention", "full_attention",
///                     "sliding_attention", "full_attention"],
///     "sliding_window": 128,
///     "num_key_value_heads": 8,
///     "head_dim": 64
/// });
/// let model = model_from_hf_config(&config, "tiny-gpt-oss").unwrap();
/// assert_eq!((model.full_layers, model.swa_layers, model.window), (2, 2, 128));
/// assert_eq!(model.full_bytes_per_token(), 2 * 2 * 8 * 64 * 2);
/// ```
pub fn model_from_hf_config(config: &Value, name: &str) -> Result<ModelSpec, HfConfigError> {
    let cfg = Config::new(config)?;
    let model_type = cfg.model_type()?;
    let mut model = match model_type {
        "gpt_oss" => attention_only(&cfg, Family::GptOss)?,
        "gemma2" => attention_only(&cfg, Family::Gemma2)?,
        "gemma3" | "gemma3_text" | "gemma4" | "gemma4_text" => {
            attention_only(&cfg, Family::Gemma3Or4)?
        }
        "qwen3_next" | "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" => {
            gated_deltanet(&cfg)?
        }
        "nemotron_h" => mamba2_hybrid(&cfg)?,
        other => {
            return Err(HfConfigError::Unsupported {
                model_type: other.to_string(),
            });
        }
    };
    model.name = intern(name);
    Ok(model)
}

/// The language model's fields: `text_config` when the file nests one, else the top
/// level; `top` is the top level, where a multimodal file keeps `model_type` and dtype.
struct Config<'a> {
    text: &'a Map<String, Value>,
    top: &'a Map<String, Value>,
}

impl<'a> Config<'a> {
    fn new(config: &'a Value) -> Result<Config<'a>, HfConfigError> {
        let top = config.as_object().ok_or(HfConfigError::NotAnObject {
            field: "config.json",
        })?;
        let text = match top.get("text_config") {
            None | Some(Value::Null) => top,
            Some(nested) => nested.as_object().ok_or(HfConfigError::NotAnObject {
                field: "text_config",
            })?,
        };
        Ok(Config { text, top })
    }

    /// The field `key` of the language model, `None` when absent or `null`.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.text.get(key).filter(|v| !v.is_null())
    }

    /// `key` from the language model, else from the top level.
    fn get_or_top(&self, key: &str) -> Option<&'a Value> {
        self.get(key)
            .or_else(|| self.top.get(key).filter(|v| !v.is_null()))
    }

    fn model_type(&self) -> Result<&'a str, HfConfigError> {
        let value = self
            .get_or_top("model_type")
            .ok_or(HfConfigError::Missing {
                field: "model_type",
            })?;
        value
            .as_str()
            .ok_or_else(|| bad("model_type", value, "a string"))
    }

    /// The non-negative integer `key`, which must fit in 32 bits.
    fn u32(&self, key: &'static str) -> Result<u32, HfConfigError> {
        self.opt_u32(key)?
            .ok_or(HfConfigError::Missing { field: key })
    }

    fn opt_u32(&self, key: &'static str) -> Result<Option<u32>, HfConfigError> {
        self.get(key).map(|v| as_u32(key, v)).transpose()
    }

    /// `num_hidden_layers`, which must be at least 1.
    fn layers(&self) -> Result<u32, HfConfigError> {
        let layers = self.u32("num_hidden_layers")?;
        if layers == 0 {
            return Err(bad(
                "num_hidden_layers",
                &Value::from(0),
                "at least one layer",
            ));
        }
        Ok(layers)
    }

    /// `head_dim`, else `hidden_size / num_attention_heads` as `transformers` derives it.
    fn head_dim(&self) -> Result<u32, HfConfigError> {
        if let Some(dim) = self.opt_u32("head_dim")? {
            return Ok(dim);
        }
        match (
            self.opt_u32("hidden_size")?,
            self.opt_u32("num_attention_heads")?,
        ) {
            (Some(hidden), Some(heads)) if heads != 0 => Ok(hidden / heads),
            _ => Err(HfConfigError::Missing { field: "head_dim" }),
        }
    }

    /// Bytes per element of the checkpoint's dtype (`dtype`, else `torch_dtype`; 2 when
    /// neither is given).
    fn dtype_bytes(&self) -> Result<u32, HfConfigError> {
        for key in ["dtype", "torch_dtype"] {
            if let Some(value) = self.get_or_top(key) {
                return float_bytes(key, value);
            }
        }
        Ok(2)
    }

    /// Bytes per element of the temporal (SSM) state: `mamba_ssm_dtype`, else
    /// `mamba_ssm_cache_dtype`, else float32.
    fn ssm_dtype_bytes(&self) -> Result<u32, HfConfigError> {
        for key in ["mamba_ssm_dtype", "mamba_ssm_cache_dtype"] {
            if let Some(value) = self.get(key) {
                return float_bytes(key, value);
            }
        }
        Ok(4)
    }

    /// The list field `key`, which must hold one entry per layer.
    fn per_layer_list(
        &self,
        key: &'static str,
        layers: u32,
    ) -> Result<Option<&'a [Value]>, HfConfigError> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        let list = value
            .as_array()
            .ok_or_else(|| bad(key, value, "a list with one entry per layer"))?;
        check_count(key, list.len(), layers)?;
        Ok(Some(list))
    }
}

/// The families whose layers are all attention (FULL or SWA).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    /// `gpt_oss`: without `layer_types`, sliding then full, alternating.
    GptOss,
    /// `gemma2`: without `layer_types`, sliding then full, alternating.
    Gemma2,
    /// `gemma3`/`gemma4`: without `layer_types`, `sliding_window_pattern` (default 6):
    /// every pattern-th layer is full. Gemma 4's global layers may have their own KV
    /// heads and head dim, and its last `num_kv_shared_layers` layers reuse earlier
    /// layers' KV and hold none.
    Gemma3Or4,
}

/// Each layer's attention kind, from `layer_types` or the family's default pattern.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Full,
    Sliding,
    Linear,
    Mamba,
    /// A layer without a cache (Nemotron-H's MLP and MoE layers).
    NoCache,
}

fn attention_only(cfg: &Config<'_>, family: Family) -> Result<ModelSpec, HfConfigError> {
    let layers = cfg.layers()?;
    let kinds = match cfg.per_layer_list("layer_types", layers)? {
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("full_attention") => Ok(Kind::Full),
                Some("sliding_attention") => Ok(Kind::Sliding),
                _ => Err(bad(
                    format!("layer_types[{i}]"),
                    v,
                    "\"full_attention\" or \"sliding_attention\"",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        None => {
            let period = match family {
                Family::GptOss | Family::Gemma2 => 2,
                Family::Gemma3Or4 => match cfg.opt_u32("sliding_window_pattern")? {
                    Some(0) => {
                        return Err(bad(
                            "sliding_window_pattern",
                            &Value::from(0),
                            "a period of at least 1",
                        ));
                    }
                    Some(period) => period,
                    None => 6,
                },
            };
            (1..=layers)
                .map(|i| {
                    if i % period == 0 {
                        Kind::Full
                    } else {
                        Kind::Sliding
                    }
                })
                .collect()
        }
    };
    // Gemma 4 (and 3n): the last `num_kv_shared_layers` layers read earlier layers' KV.
    let shared = match family {
        Family::Gemma3Or4 => cfg.opt_u32("num_kv_shared_layers")?.unwrap_or(0),
        Family::GptOss | Family::Gemma2 => 0,
    };
    if shared >= layers {
        return Err(bad(
            "num_kv_shared_layers",
            &Value::from(shared),
            "fewer than num_hidden_layers",
        ));
    }
    let own = &kinds[..kinds.len() - shared as usize];
    let full_layers = count(own, Kind::Full);
    let swa_layers = count(own, Kind::Sliding);

    let dtype = cfg.dtype_bytes()?;
    let kv_heads = cfg.u32("num_key_value_heads")?;
    let head_dim = cfg.head_dim()?;
    let swa = KvRows::new(kv_heads, head_dim, dtype);
    let full = match family {
        Family::Gemma3Or4 => KvRows::new(
            cfg.opt_u32("num_global_key_value_heads")?
                .unwrap_or(kv_heads),
            cfg.opt_u32("global_head_dim")?.unwrap_or(head_dim),
            dtype,
        ),
        Family::GptOss | Family::Gemma2 => swa,
    };
    let window = if swa_layers == 0 {
        0
    } else {
        cfg.u32("sliding_window")?
    };
    Ok(ModelSpec {
        name: "",
        full_layers,
        swa_layers,
        mamba_layers: 0,
        full: if full_layers == 0 { KvRows::NONE } else { full },
        swa: if swa_layers == 0 { KvRows::NONE } else { swa },
        recurrent: RecurrentState::NONE,
        window,
        draft_layers: 0,
    })
}

/// Qwen3-Next / Qwen3.5: full attention every `full_attention_interval` layers, Gated
/// DeltaNet in the others.
fn gated_deltanet(cfg: &Config<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = cfg.layers()?;
    let kinds = match cfg.per_layer_list("layer_types", layers)? {
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("full_attention") => Ok(Kind::Full),
                Some("linear_attention") => Ok(Kind::Linear),
                _ => Err(bad(
                    format!("layer_types[{i}]"),
                    v,
                    "\"full_attention\" or \"linear_attention\"",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        None => {
            let interval = cfg.u32("full_attention_interval")?;
            if interval == 0 {
                return Err(bad(
                    "full_attention_interval",
                    &Value::from(0),
                    "an interval of at least 1",
                ));
            }
            (1..=layers)
                .map(|i| {
                    if i % interval == 0 {
                        Kind::Full
                    } else {
                        Kind::Linear
                    }
                })
                .collect()
        }
    };
    let full_layers = count(&kinds, Kind::Full);
    let mamba_layers = count(&kinds, Kind::Linear);
    let dtype = cfg.dtype_bytes()?;
    let full = if full_layers == 0 {
        KvRows::NONE
    } else {
        KvRows::new(cfg.u32("num_key_value_heads")?, cfg.head_dim()?, dtype)
    };
    let recurrent = if mamba_layers == 0 {
        RecurrentState::NONE
    } else {
        let key_heads = cfg.u32("linear_num_key_heads")?;
        let value_heads = cfg.u32("linear_num_value_heads")?;
        let key_dim = cfg.u32("linear_key_head_dim")?;
        let value_dim = cfg.u32("linear_value_head_dim")?;
        // q, k and v go through the convolution: 2 × key heads × key dim + value heads
        // × value dim channels.
        let conv_channels = sum_of_products(
            "linear_num_key_heads",
            &[&[2, key_heads, key_dim], &[value_heads, value_dim]],
        )?;
        RecurrentState {
            conv_channels,
            conv_kernel: cfg.u32("linear_conv_kernel_dim")?,
            // One key-dim × value-dim matrix per value head.
            heads: value_heads,
            head_dim: value_dim,
            state_size: key_dim,
            conv_dtype_bytes: dtype,
            state_dtype_bytes: cfg.ssm_dtype_bytes()?,
        }
    };
    Ok(recurrent_hybrid(full_layers, mamba_layers, full, recurrent))
}

/// Nemotron-H: Mamba2 (`M`), attention (`*`), MLP (`-`) and MoE (`E`) layers.
fn mamba2_hybrid(cfg: &Config<'_>) -> Result<ModelSpec, HfConfigError> {
    let layers = cfg.layers()?;
    let kinds: Vec<Kind> = if let Some(value) = cfg.get("hybrid_override_pattern") {
        let pattern = value.as_str().ok_or_else(|| {
            bad(
                "hybrid_override_pattern",
                value,
                "a string of M, *, - and E",
            )
        })?;
        check_count("hybrid_override_pattern", pattern.chars().count(), layers)?;
        pattern
            .chars()
            .enumerate()
            .map(|(i, c)| match c {
                'M' => Ok(Kind::Mamba),
                '*' => Ok(Kind::Full),
                '-' | 'E' => Ok(Kind::NoCache),
                _ => Err(bad(
                    format!("hybrid_override_pattern[{i}]"),
                    &Value::from(c.to_string()),
                    "M (Mamba2), * (attention), - (MLP) or E (MoE)",
                )),
            })
            .collect::<Result<_, _>>()?
    } else if let Some(list) = cfg.per_layer_list("layers_block_type", layers)? {
        list.iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("mamba") => Ok(Kind::Mamba),
                Some("attention") => Ok(Kind::Full),
                Some("mlp" | "moe") => Ok(Kind::NoCache),
                _ => Err(bad(
                    format!("layers_block_type[{i}]"),
                    v,
                    "\"mamba\", \"attention\", \"mlp\" or \"moe\"",
                )),
            })
            .collect::<Result<_, _>>()?
    } else {
        return Err(HfConfigError::Missing {
            field: "hybrid_override_pattern",
        });
    };
    let full_layers = count(&kinds, Kind::Full);
    let mamba_layers = count(&kinds, Kind::Mamba);
    let dtype = cfg.dtype_bytes()?;
    let full = if full_layers == 0 {
        KvRows::NONE
    } else {
        let head_dim = match cfg.opt_u32("attention_head_dim")? {
            Some(dim) => dim,
            None => cfg.head_dim()?,
        };
        KvRows::new(cfg.u32("num_key_value_heads")?, head_dim, dtype)
    };
    let recurrent = if mamba_layers == 0 {
        RecurrentState::NONE
    } else {
        let heads = cfg.u32("mamba_num_heads")?;
        let head_dim = cfg.u32("mamba_head_dim")?;
        let state_size = cfg.u32("ssm_state_size")?;
        let groups = cfg.u32("n_groups")?;
        // x, B and C go through the convolution: heads × head dim + 2 × groups × state.
        let conv_channels = sum_of_products(
            "mamba_num_heads",
            &[&[heads, head_dim], &[2, groups, state_size]],
        )?;
        RecurrentState {
            conv_channels,
            conv_kernel: cfg.u32("conv_kernel")?,
            heads,
            head_dim,
            state_size,
            conv_dtype_bytes: dtype,
            state_dtype_bytes: cfg.ssm_dtype_bytes()?,
        }
    };
    Ok(recurrent_hybrid(full_layers, mamba_layers, full, recurrent))
}

/// How many of `kinds` are `kind` (at most `num_hidden_layers`, a `u32`).
fn count(kinds: &[Kind], kind: Kind) -> u32 {
    let n = kinds.iter().filter(|&&k| k == kind).count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// A per-layer list of `listed` entries against `num_hidden_layers`.
fn check_count(field: &'static str, listed: usize, layers: u32) -> Result<(), HfConfigError> {
    if u32::try_from(listed) == Ok(layers) {
        Ok(())
    } else {
        Err(HfConfigError::LayerCount {
            field,
            listed,
            num_hidden_layers: layers,
        })
    }
}

/// Σ Π `terms`, refused (naming `field`) past 32 bits.
fn sum_of_products(field: &'static str, terms: &[&[u32]]) -> Result<u32, HfConfigError> {
    terms
        .iter()
        .try_fold(0u32, |sum, factors| {
            factors
                .iter()
                .try_fold(1u32, |p, &f| p.checked_mul(f))
                .and_then(|p| sum.checked_add(p))
        })
        .ok_or_else(|| HfConfigError::BadValue {
            field: field.to_string(),
            value: "a size".to_string(),
            expected: "conv channels that fit in 32 bits",
        })
}

fn as_u32(key: &'static str, value: &Value) -> Result<u32, HfConfigError> {
    value
        .as_u64()
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| bad(key, value, "an integer from 0 to 2^32-1"))
}

/// Bytes per element of a floating-point dtype name.
fn float_bytes(key: &'static str, value: &Value) -> Result<u32, HfConfigError> {
    match value.as_str().map(|s| s.trim_start_matches("torch.")) {
        Some("bfloat16" | "float16" | "half" | "bf16" | "fp16") => Ok(2),
        Some("float32" | "float" | "fp32") => Ok(4),
        _ => Err(bad(key, value, "bfloat16, float16 or float32")),
    }
}

fn bad(field: impl Into<String>, value: &Value, expected: &'static str) -> HfConfigError {
    HfConfigError::BadValue {
        field: field.into(),
        value: value.to_string(),
        expected,
    }
}

/// `name` as a `&'static str`, leaked once per distinct name.
fn intern(name: &str) -> &'static str {
    static NAMES: LazyLock<Mutex<Vec<&'static str>>> = LazyLock::new(|| Mutex::new(Vec::new()));
    // A poisoned lock still holds valid names (pushes cannot half-happen).
    let mut names = NAMES
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&known) = names.iter().find(|&&known| known == name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.push(leaked);
    leaked
}

/// A model of full-attention and recurrent layers (no sliding window), named by the
/// caller: the shape Qwen3-Next and Nemotron-H share.
fn recurrent_hybrid(
    full_layers: u32,
    mamba_layers: u32,
    full: KvRows,
    recurrent: RecurrentState,
) -> ModelSpec {
    ModelSpec {
        name: "",
        full_layers,
        swa_layers: 0,
        mamba_layers,
        full,
        swa: KvRows::NONE,
        recurrent,
        window: 0,
        draft_layers: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn one_name_is_leaked_once() {
        let a = intern("hf-test-model");
        let b = intern(&String::from("hf-test-model"));
        assert!(std::ptr::eq(a, b));
        assert_ne!(intern("hf-test-other"), a);
    }

    #[test]
    fn gemma3_without_layer_types_follows_its_sliding_window_pattern() {
        // google/gemma-3-27b-it's text_config fields for the cache: 62 layers, every
        // sixth global, 16 KV heads of 128 on both kinds, window 1,024.
        let config = json!({
            "model_type": "gemma3",
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "gemma3_text",
                "num_hidden_layers": 62,
                "sliding_window_pattern": 6,
                "sliding_window": 1024,
                "num_key_value_heads": 16,
                "head_dim": 128
            }
        });
        let m = model_from_hf_config(&config, "gemma-3-27b").unwrap();
        // Layers 6, 12, ..., 60 are global: 10 of them; the other 52 slide.
        assert_eq!((m.full_layers, m.swa_layers, m.window), (10, 52, 1024));
        assert_eq!(
            (m.full, m.swa),
            (KvRows::new(16, 128, 2), KvRows::new(16, 128, 2))
        );
    }

    #[test]
    fn gemma2_and_gpt_oss_without_layer_types_alternate_sliding_then_full() {
        for model_type in ["gemma2", "gpt_oss"] {
            let config = json!({
                "model_type": model_type, "num_hidden_layers": 5, "sliding_window": 4096,
                "num_key_value_heads": 8, "head_dim": 256, "torch_dtype": "float32"
            });
            let m = model_from_hf_config(&config, model_type).unwrap();
            assert_eq!((m.full_layers, m.swa_layers), (2, 3), "{model_type}");
            assert_eq!(m.full, KvRows::new(8, 256, 4), "{model_type}");
        }
    }

    #[test]
    fn gemma4_shared_kv_layers_hold_no_rows() {
        // 12 layers, (5 sliding, 1 full) × 2; the last 4 (sliding, full, sliding...
        // layers 8..12: S S S F) read earlier layers' KV.
        let layer_types = [["sliding_attention"; 5].as_slice(), &["full_attention"]]
            .concat()
            .repeat(2);
        let config = json!({
            "model_type": "gemma4_text", "num_hidden_layers": 12,
            "layer_types": layer_types,
            "num_kv_shared_layers": 4, "sliding_window": 512,
            "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512
        });
        let m = model_from_hf_config(&config, "gemma4-shared").unwrap();
        // Own layers 0..8: S S S S S F S S.
        assert_eq!((m.full_layers, m.swa_layers), (1, 7));
        // No num_global_key_value_heads: the global layers keep num_key_value_heads.
        assert_eq!(m.full, KvRows::new(2, 512, 2));
    }

    #[test]
    fn qwen3_5_maps_like_qwen3_next_from_its_text_config() {
        // Qwen/Qwen3.5-9B's text_config: 32 layers, full attention every 4th, 4 KV heads
        // of 256; GDN 16 key heads × 128, 32 value heads × 128, kernel 4; the temporal
        // state in the config's own mamba_ssm_dtype.
        let config = json!({
            "model_type": "qwen3_5",
            "text_config": {
                "model_type": "qwen3_5_text", "num_hidden_layers": 32,
                "full_attention_interval": 4, "num_key_value_heads": 4, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4, "mamba_ssm_dtype": "float32",
                "dtype": "bfloat16"
            }
        });
        let m = model_from_hf_config(&config, "qwen3.5-9b").unwrap();
        assert_eq!((m.full_layers, m.mamba_layers), (8, 24));
        assert_eq!(m.full, KvRows::new(4, 256, 2));
        assert_eq!(
            m.recurrent,
            RecurrentState {
                conv_channels: 2 * 16 * 128 + 32 * 128,
                conv_kernel: 4,
                heads: 32,
                head_dim: 128,
                state_size: 128,
                conv_dtype_bytes: 2,
                state_dtype_bytes: 4,
            }
        );
    }

    #[test]
    fn the_state_dtype_follows_mamba_ssm_cache_dtype_and_the_head_dim_can_be_derived() {
        let config = json!({
            "model_type": "nemotron_h", "num_hidden_layers": 3,
            "layers_block_type": ["mamba", "attention", "moe"],
            "num_key_value_heads": 2, "hidden_size": 1024, "num_attention_heads": 8,
            "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16,
            "n_groups": 1, "conv_kernel": 4, "mamba_ssm_cache_dtype": "bfloat16"
        });
        let m = model_from_hf_config(&config, "nemotron-list").unwrap();
        assert_eq!((m.full_layers, m.mamba_layers), (1, 1));
        assert_eq!(m.full, KvRows::new(2, 1024 / 8, 2));
        assert_eq!(m.recurrent.conv_channels, 4 * 8 + 2 * 16);
        assert_eq!(m.recurrent.state_dtype_bytes, 2);
    }
}
