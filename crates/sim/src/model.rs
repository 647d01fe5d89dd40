//! Model shapes the replay sizes its sub-pools from: layer counts by kind, the sliding
//! window and the KV row geometry. Only the shape matters here, never the weights.

use serde::Serialize;

/// The KV geometry of a FULL/SWA hybrid model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ModelShape {
    /// The name `--model` accepts (lower case).
    pub name: &'static str,
    /// Full-attention layers.
    pub full_layers: u32,
    /// Sliding-window attention layers.
    pub swa_layers: u32,
    /// The sliding window `W`, in tokens.
    pub sliding_window: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// Bytes of one KV element (2 for bf16).
    pub dtype_bytes: u32,
}

impl ModelShape {
    /// gpt-oss-20b (Hugging Face `openai/gpt-oss-20b`, `config.json`): 24 layers
    /// alternating sliding and full attention, window 128, 8 KV heads of dim 64, KV in
    /// bf16. 12 × 2 (K, V) × 8 × 64 × 2 bytes = 24,576 bytes per token on each side
    /// (DESIGN.md §9).
    pub const GPT_OSS_20B: ModelShape = ModelShape {
        name: "gpt-oss-20b",
        full_layers: 12,
        swa_layers: 12,
        sliding_window: 128,
        kv_heads: 8,
        head_dim: 64,
        dtype_bytes: 2,
    };

    /// gpt-oss-120b (Hugging Face `openai/gpt-oss-120b`, `config.json`): 36 layers
    /// alternating sliding and full attention, window 128, 8 KV heads of dim 64, bf16:
    /// 36,864 bytes per token on each side.
    pub const GPT_OSS_120B: ModelShape = ModelShape {
        name: "gpt-oss-120b",
        full_layers: 18,
        swa_layers: 18,
        sliding_window: 128,
        kv_heads: 8,
        head_dim: 64,
        dtype_bytes: 2,
    };

    /// Every model `--model` accepts; the first is the default.
    pub const ALL: [ModelShape; 2] = [ModelShape::GPT_OSS_20B, ModelShape::GPT_OSS_120B];

    /// The model named `name` (case-insensitive).
    pub fn by_name(name: &str) -> Option<ModelShape> {
        ModelShape::ALL
            .into_iter()
            .find(|m| m.name.eq_ignore_ascii_case(name.trim()))
    }

    /// Bytes of K and V of one token of one layer.
    pub const fn kv_bytes_per_token_per_layer(&self) -> u64 {
        2 * self.kv_heads as u64 * self.head_dim as u64 * self.dtype_bytes as u64
    }

    /// Bytes one token costs on the FULL side, across all full-attention layers.
    pub const fn full_bytes_per_token(&self) -> u64 {
        self.full_layers as u64 * self.kv_bytes_per_token_per_layer()
    }

    /// Bytes one token costs on the SWA side, across all sliding-window layers.
    pub const fn swa_bytes_per_token(&self) -> u64 {
        self.swa_layers as u64 * self.kv_bytes_per_token_per_layer()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_20b_costs_24576_bytes_per_token_per_side() {
        let m = ModelShape::GPT_OSS_20B;
        assert_eq!(m.full_bytes_per_token(), 24_576);
        assert_eq!(m.swa_bytes_per_token(), 24_576);
        assert_eq!(ModelShape::GPT_OSS_120B.full_bytes_per_token(), 36_864);
    }

    #[test]
    fn models_are_found_by_name_in_any_case() {
        assert_eq!(
            ModelShape::by_name("GPT-OSS-20B"),
            Some(ModelShape::GPT_OSS_20B)
        );
        assert_eq!(
            ModelShape::by_name("gpt-oss-120b"),
            Some(ModelShape::GPT_OSS_120B)
        );
        assert_eq!(ModelShape::by_name("llama"), None);
    }
}
