//! Model specs: the layer mix and KV shape that size a cache.

use std::fmt;

/// The shape of a hybrid model's KV state: how many layers of each kind, the KV head
/// geometry, the element size and the sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// A short name (`gpt-oss-20b`).
    pub name: &'static str,
    /// Full-attention layers.
    pub full_layers: u32,
    /// Sliding-window attention layers.
    pub swa_layers: u32,
    /// Mamba/GDN layers (reserved: the Mamba issue adds state slots; must be 0 for now).
    pub mamba_layers: u32,
    /// KV heads per attention layer.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per KV element (2 for bf16, 1 for fp8).
    pub dtype_bytes: u32,
    /// The sliding window of the SWA layers, in tokens.
    pub window: u32,
}

impl ModelSpec {
    /// gpt-oss-20b: 24 layers alternating full and sliding attention (12 + 12), window
    /// 128, 8 KV heads of dimension 64, bf16 — 24,576 bytes per token per side.
    ///
    /// Source: the model's published configuration (`num_hidden_layers = 24`,
    /// `layer_types` alternating `sliding_attention`/`full_attention`,
    /// `sliding_window = 128`, `num_key_value_heads = 8`, `head_dim = 64`), as summarised
    /// in `shared/reference/sglang-unified-memory.md` §8.
    pub const GPT_OSS_20B: ModelSpec = ModelSpec {
        name: "gpt-oss-20b",
        full_layers: 12,
        swa_layers: 12,
        mamba_layers: 0,
        kv_heads: 8,
        head_dim: 64,
        dtype_bytes: 2,
        window: 128,
    };

    /// gpt-oss-120b: 36 layers alternating full and sliding attention (18 + 18), window
    /// 128, 8 KV heads of dimension 64, bf16 — 36,864 bytes per token per side.
    ///
    /// Source: the model's published configuration (`num_hidden_layers = 36`, the same
    /// alternating `layer_types`, `sliding_window = 128`, `num_key_value_heads = 8`,
    /// `head_dim = 64`).
    pub const GPT_OSS_120B: ModelSpec = ModelSpec {
        name: "gpt-oss-120b",
        full_layers: 18,
        swa_layers: 18,
        mamba_layers: 0,
        kv_heads: 8,
        head_dim: 64,
        dtype_bytes: 2,
        window: 128,
    };

    /// Every named spec.
    pub const NAMED: [ModelSpec; 2] = [ModelSpec::GPT_OSS_20B, ModelSpec::GPT_OSS_120B];

    /// The named spec called `name`.
    pub fn by_name(name: &str) -> Option<ModelSpec> {
        ModelSpec::NAMED.iter().find(|m| m.name == name).copied()
    }

    /// KV bytes of one token across every full-attention layer (K and V); `u64::MAX`
    /// when that does not fit in 64 bits (a spec the cache builder refuses).
    pub const fn full_bytes_per_token(&self) -> u64 {
        saturated(self.checked_full_bytes_per_token())
    }

    /// KV bytes of one token across every sliding-window layer (K and V); `u64::MAX`
    /// when that does not fit in 64 bits (a spec the cache builder refuses).
    pub const fn swa_bytes_per_token(&self) -> u64 {
        saturated(self.checked_swa_bytes_per_token())
    }

    /// [`ModelSpec::full_bytes_per_token`], or `None` when it does not fit in 64 bits.
    pub const fn checked_full_bytes_per_token(&self) -> Option<u64> {
        self.checked_layers_bytes(self.full_layers)
    }

    /// [`ModelSpec::swa_bytes_per_token`], or `None` when it does not fit in 64 bits.
    pub const fn checked_swa_bytes_per_token(&self) -> Option<u64> {
        self.checked_layers_bytes(self.swa_layers)
    }

    /// `layers × 2 (K and V) × kv_heads × head_dim × dtype_bytes`, checked.
    const fn checked_layers_bytes(&self, layers: u32) -> Option<u64> {
        let factors = [2, self.kv_heads, self.head_dim, self.dtype_bytes];
        let mut bytes = layers as u64;
        let mut i = 0;
        while i < factors.len() {
            bytes = match bytes.checked_mul(factors[i] as u64) {
                Some(b) => b,
                None => return None,
            };
            i += 1;
        }
        Some(bytes)
    }
}

const fn saturated(bytes: Option<u64>) -> u64 {
    match bytes {
        Some(b) => b,
        None => u64::MAX,
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} FULL + {} SWA layers, W = {}, {} KV heads × {} × {} B)",
            self.name,
            self.full_layers,
            self.swa_layers,
            self.window,
            self.kv_heads,
            self.head_dim,
            self.dtype_bytes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_20b_costs_24576_bytes_per_token_per_side() {
        let m = ModelSpec::GPT_OSS_20B;
        assert_eq!(m.full_bytes_per_token(), 24_576);
        assert_eq!(m.swa_bytes_per_token(), 24_576);
        assert_eq!(ModelSpec::by_name("gpt-oss-20b"), Some(m));
        assert_eq!(
            ModelSpec::by_name("gpt-oss-120b")
                .unwrap()
                .full_bytes_per_token(),
            36_864
        );
        assert_eq!(ModelSpec::by_name("llama"), None);
    }

    #[test]
    fn per_token_bytes_past_64_bits_are_none_or_saturate_instead_of_wrapping() {
        let huge = ModelSpec {
            full_layers: u32::MAX,
            kv_heads: u32::MAX,
            head_dim: u32::MAX,
            ..ModelSpec::GPT_OSS_20B
        };
        assert_eq!(huge.checked_full_bytes_per_token(), None);
        assert_eq!(huge.full_bytes_per_token(), u64::MAX);
        // 12 SWA layers × 2 × 2^32−1 × 2^32−1 × 2 does not fit either.
        assert_eq!(huge.checked_swa_bytes_per_token(), None);
        let m = ModelSpec::GPT_OSS_20B;
        assert_eq!(m.checked_full_bytes_per_token(), Some(24_576));
    }
}
