//! Model specs: the layer mix, each attention kind's KV row geometry and the recurrent
//! (Mamba/GDN) state geometry that size a cache.
//!
//! Every named spec's numbers come from the model's published configuration; each doc
//! comment names the configuration fields it read and where they were found.
//!
//! Each attention kind has its own [`KvRows`], mapped by [`ModelSpec::kv_sub_pools`] to
//! one [`SubPoolSpec`](unikv_pools::SubPoolSpec) per side; the builder and `bench-ops`'s
//! rebuild of a recorded allocator use that one mapping
//! (`each_side_pages_its_own_rows`,
//! `a_request_lives_and_ends_on_a_model_with_asymmetric_rows`). A model with recurrent
//! layers carries a [`RecurrentState`] (Qwen3-Next-80B-A3B, Nemotron-H-8B, a synthetic
//! FULL+SWA+Mamba spec; `named_models_with_recurrent_layers_build_on_both_layouts`).

use std::fmt;
use unikv_mamba::{checked_product, saturated};
use unikv_pools::SubPoolSpec;

/// The KV rows one attention layer of one kind writes per token: `kv_heads` K rows and
/// as many V rows of `head_dim` elements of `dtype_bytes` bytes. FULL and SWA layers may
/// differ (Gemma 4's global layers have fewer, wider heads than its sliding ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRows {
    /// KV heads per layer (`num_key_value_heads`).
    pub kv_heads: u32,
    /// Elements per head (`head_dim`).
    pub head_dim: u32,
    /// Bytes per element (2 for bf16, 1 for fp8).
    pub dtype_bytes: u32,
}

impl KvRows {
    /// No rows: the geometry of a kind the model does not have.
    pub const NONE: KvRows = KvRows::new(0, 0, 0);

    /// `kv_heads` heads of `head_dim` elements of `dtype_bytes` bytes.
    pub const fn new(kv_heads: u32, head_dim: u32, dtype_bytes: u32) -> KvRows {
        KvRows {
            kv_heads,
            head_dim,
            dtype_bytes,
        }
    }

    /// Whether any factor is 0 (a kind with such rows holds no bytes).
    pub const fn is_empty(&self) -> bool {
        self.kv_heads == 0 || self.head_dim == 0 || self.dtype_bytes == 0
    }

    /// `layers × 2 (K and V) × kv_heads × head_dim × dtype_bytes`: one token's bytes
    /// across `layers` layers of this geometry, or `None` when that does not fit in 64
    /// bits.
    pub const fn checked_bytes_per_token(&self, layers: u32) -> Option<u64> {
        checked_product(&[layers, 2, self.kv_heads, self.head_dim, self.dtype_bytes])
    }

    /// The sub-pool of `layers` layers of these rows, named `name` (`full`, `swa`).
    pub const fn sub_pool(&self, name: &'static str, layers: u32) -> SubPoolSpec {
        SubPoolSpec::mha(name, layers, self.kv_heads, self.head_dim, self.dtype_bytes)
    }
}

impl fmt::Display for KvRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} KV heads × {} × {} B",
            self.kv_heads, self.head_dim, self.dtype_bytes
        )
    }
}

pub use unikv_mamba::RecurrentState;

/// The shape of a hybrid model's cache: how many layers of each kind, each attention
/// kind's KV rows, the recurrent state of its Mamba/GDN layers and the sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// A short name (`gpt-oss-20b`).
    pub name: &'static str,
    /// Full-attention layers.
    pub full_layers: u32,
    /// Sliding-window attention layers.
    pub swa_layers: u32,
    /// Recurrent (Mamba/GDN) layers. The cache builder refuses them until the Mamba pool
    /// exists.
    pub mamba_layers: u32,
    /// The KV rows of a full-attention layer.
    pub full: KvRows,
    /// The KV rows of a sliding-window layer ([`KvRows::NONE`] without SWA layers).
    pub swa: KvRows,
    /// The per-request state of a recurrent layer ([`RecurrentState::NONE`] without
    /// recurrent layers).
    pub recurrent: RecurrentState,
    /// The sliding window of the SWA layers, in tokens (0 without SWA layers).
    pub window: u32,
    /// Layers of a speculative draft model whose KV lives inside the target's FULL page
    /// envelope (one EAGLE3 layer, or the target's MTP layers), with the FULL layers' row
    /// geometry, after them: draft layer `j` is FULL layer `full_layers + j` to a kernel.
    /// 0 without a draft model ([`ModelSpec::with_draft_layers`]).
    pub draft_layers: u32,
}

/// bf16 rows of `kv_heads` heads of dimension `head_dim`.
const fn bf16(kv_heads: u32, head_dim: u32) -> KvRows {
    KvRows::new(kv_heads, head_dim, 2)
}

impl ModelSpec {
    /// gpt-oss-20b: 24 layers alternating full and sliding attention (12 + 12), window
    /// 128, 8 KV heads of dimension 64 on both kinds, bf16 — 24,576 bytes per token per
    /// side.
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
        full: bf16(8, 64),
        swa: bf16(8, 64),
        recurrent: RecurrentState::NONE,
        window: 128,
        draft_layers: 0,
    };

    /// gpt-oss-120b: 36 layers alternating full and sliding attention (18 + 18), window
    /// 128, 8 KV heads of dimension 64 on both kinds, bf16 — 36,864 bytes per token per
    /// side.
    ///
    /// Source: the model's published configuration (`num_hidden_layers = 36`, the same
    /// alternating `layer_types`, `sliding_window = 128`, `num_key_value_heads = 8`,
    /// `head_dim = 64`).
    pub const GPT_OSS_120B: ModelSpec = ModelSpec {
        name: "gpt-oss-120b",
        full_layers: 18,
        swa_layers: 18,
        mamba_layers: 0,
        full: bf16(8, 64),
        swa: bf16(8, 64),
        recurrent: RecurrentState::NONE,
        window: 128,
        draft_layers: 0,
    };

    /// Gemma 4 31B: FULL and SWA rows that **differ**. 60 layers, five sliding to one
    /// global (50 SWA + 10 FULL), window 1,024. Sliding layers: 16 KV heads of dimension
    /// 256; global layers: 4 KV heads of dimension 512; bf16. FULL costs
    /// 10 × 2 × 4 × 512 × 2 = 81,920 bytes per token, SWA 50 × 2 × 16 × 256 × 2 =
    /// 819,200.
    ///
    /// Source: the published `google/gemma-4-31B` configuration, `text_config`:
    /// `num_hidden_layers = 60`, `layer_types` = (`sliding_attention` × 5,
    /// `full_attention`) × 10, `sliding_window = 1024`, `num_key_value_heads = 16`,
    /// `head_dim = 256`, `num_global_key_value_heads = 4`, `global_head_dim = 512`,
    /// `num_kv_shared_layers = 0`, `dtype = "bfloat16"` (as reproduced by engines' test
    /// fixtures of that configuration); the 10 : 50 split is also in
    /// `shared/reference/sglang-unified-memory.md` §1.3 (PR #37560). The global layers'
    /// `attention_k_eq_v = true` shares the K and V *projection*; the cache still holds
    /// a K row and a (separately normalised) V row, as counted here.
    pub const GEMMA_4_31B: ModelSpec = ModelSpec {
        name: "gemma-4-31b",
        full_layers: 10,
        swa_layers: 50,
        mamba_layers: 0,
        full: bf16(4, 512),
        swa: bf16(16, 256),
        recurrent: RecurrentState::NONE,
        window: 1024,
        draft_layers: 0,
    };

    /// Qwen3-Next-80B-A3B: full attention plus Gated DeltaNet. 48 layers, one full
    /// attention layer in every 4 (12 FULL + 36 GDN), no sliding window. Full attention:
    /// 2 KV heads of dimension 256, bf16 — 12 × 2 × 2 × 256 × 2 = 24,576 bytes per token.
    /// GDN state per layer: conv 8,192 channels × 3 × 2 B = 49,152 bytes, temporal
    /// 32 × 128 × 128 × 4 B = 2,097,152 bytes.
    ///
    /// Source: the published `Qwen/Qwen3-Next-80B-A3B-Instruct` `config.json`:
    /// `full_attention_interval = 4`, `head_dim = 256`, `linear_num_value_heads = 32`,
    /// `linear_num_key_heads = 16`, `linear_key_head_dim = 128`,
    /// `linear_value_head_dim = 128`, `linear_conv_kernel_dim = 4`; its model card:
    /// 48 layers laid out as `12 * (3 * (Gated DeltaNet -> MoE) -> 1 * (Gated Attention
    /// -> MoE))`, "16 for Q and 2 for KV" attention heads (`num_key_value_heads = 2`),
    /// bf16 weights (the KV element size here). Conv channels
    /// `2 × 16 × 128 + 32 × 128 = 8,192`; state element sizes as [`RecurrentState`]
    /// says (conv bf16, temporal float32).
    pub const QWEN3_NEXT_80B_A3B: ModelSpec = ModelSpec {
        name: "qwen3-next-80b-a3b",
        full_layers: 12,
        swa_layers: 0,
        mamba_layers: 36,
        full: bf16(2, 256),
        swa: KvRows::NONE,
        recurrent: RecurrentState {
            conv_channels: 8192,
            conv_kernel: 4,
            heads: 32,
            head_dim: 128,
            state_size: 128,
            conv_dtype_bytes: 2,
            state_dtype_bytes: 4,
        },
        window: 0,
        draft_layers: 0,
    };

    /// Nemotron-H-8B: a Mamba2 hybrid. 52 layers: 24 Mamba2, 4 attention (full, no
    /// window), 24 MLP-only. Attention: 8 KV heads of dimension 128, bf16 —
    /// 4 × 2 × 8 × 128 × 2 = 16,384 bytes per token. Mamba2 state per layer: conv
    /// 10,240 channels × 3 × 2 B = 61,440 bytes, temporal 128 × 64 × 128 × 4 B =
    /// 4,194,304 bytes.
    ///
    /// Source: the published `nvidia/Nemotron-H-8B-Base-8K` `config.json`:
    /// `num_hidden_layers = 52`, `hybrid_override_pattern =
    /// "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"` (24 `M`, 4 `*`, 24 `-`),
    /// `num_key_value_heads = 8`, `attention_head_dim = 128`, `mamba_num_heads = 128`,
    /// `mamba_head_dim = 64`, `ssm_state_size = 128`, `n_groups = 8`,
    /// `conv_kernel = 4`, `torch_dtype = "bfloat16"`. Conv channels
    /// `128 × 64 + 2 × 8 × 128 = 10,240`; element sizes as [`RecurrentState`] says.
    pub const NEMOTRON_H_8B: ModelSpec = ModelSpec {
        name: "nemotron-h-8b",
        full_layers: 4,
        swa_layers: 0,
        mamba_layers: 24,
        full: bf16(8, 128),
        swa: KvRows::NONE,
        recurrent: RecurrentState {
            conv_channels: 10_240,
            conv_kernel: 4,
            heads: 128,
            head_dim: 64,
            state_size: 128,
            conv_dtype_bytes: 2,
            state_dtype_bytes: 4,
        },
        window: 0,
        draft_layers: 0,
    };

    /// **Synthetic** (no published model): FULL, SWA and recurrent state at once, for
    /// the tri-pool. 4 FULL and 12 SWA layers of 8 KV heads of dimension 128 (bf16),
    /// window 1,024, and 16 recurrent layers with Nemotron-H-8B's Mamba2 state geometry
    /// ([`ModelSpec::NEMOTRON_H_8B`]).
    ///
    /// Hymba-1.5B has all three kinds (3 global layers `global_attn_idx = [0, 15, 31]`,
    /// the other 29 sliding with `sliding_window = 1024`, a Mamba head in every layer),
    /// but its published configuration shares KV across layer pairs
    /// (`kv_reuse_group`), whose exact grouping was not found in any available copy of
    /// the configuration, so how many SWA layers hold rows could not be established.
    pub const SYNTHETIC_TRI: ModelSpec = ModelSpec {
        name: "synthetic-tri",
        full_layers: 4,
        swa_layers: 12,
        mamba_layers: 16,
        full: bf16(8, 128),
        swa: bf16(8, 128),
        recurrent: ModelSpec::NEMOTRON_H_8B.recurrent,
        window: 1024,
        draft_layers: 0,
    };

    /// Every named spec.
    pub const NAMED: [ModelSpec; 6] = [
        ModelSpec::GPT_OSS_20B,
        ModelSpec::GPT_OSS_120B,
        ModelSpec::GEMMA_4_31B,
        ModelSpec::QWEN3_NEXT_80B_A3B,
        ModelSpec::NEMOTRON_H_8B,
        ModelSpec::SYNTHETIC_TRI,
    ];

    /// The named spec called `name`.
    pub fn by_name(name: &str) -> Option<ModelSpec> {
        ModelSpec::NAMED.iter().find(|m| m.name == name).copied()
    }

    /// Whether the model has recurrent layers (which [`crate::HybridCache`] refuses until
    /// the Mamba pool is built).
    pub const fn has_recurrent_state(&self) -> bool {
        self.mamba_layers != 0
    }

    /// This model with a speculative draft model of `layers` layers whose KV shares the
    /// FULL page envelope (see [`ModelSpec::draft_layers`]): EAGLE3 drafts with one
    /// decoder layer, an MTP head with the target's `num_nextn_predict_layers`.
    pub const fn with_draft_layers(self, layers: u32) -> ModelSpec {
        ModelSpec {
            draft_layers: layers,
            ..self
        }
    }

    /// FULL-envelope layers: the target's full-attention layers and the draft's.
    pub const fn full_envelope_layers(&self) -> u32 {
        self.full_layers.saturating_add(self.draft_layers)
    }

    /// KV bytes of one token across every full-attention layer (K and V), the draft
    /// model's included; `u64::MAX`
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
        self.full
            .checked_bytes_per_token(self.full_envelope_layers())
    }

    /// [`ModelSpec::swa_bytes_per_token`], or `None` when it does not fit in 64 bits.
    pub const fn checked_swa_bytes_per_token(&self) -> Option<u64> {
        self.swa.checked_bytes_per_token(self.swa_layers)
    }

    /// Recurrent state bytes of one request across every recurrent layer
    /// (`mamba_layers × state bytes per layer`), or `None` past 64 bits.
    pub const fn checked_state_bytes_per_request(&self) -> Option<u64> {
        match self.recurrent.checked_state_bytes_per_layer() {
            Some(per_layer) => per_layer.checked_mul(self.mamba_layers as u64),
            None => None,
        }
    }

    /// [`ModelSpec::checked_state_bytes_per_request`], `u64::MAX` past 64 bits.
    pub const fn state_bytes_per_request(&self) -> u64 {
        saturated(self.checked_state_bytes_per_request())
    }

    /// The Mamba slot pool of this model's recurrent state: one slot holds every
    /// recurrent layer's conv and temporal state ([`unikv_mamba::MambaSpec`]'s layout).
    /// A model without recurrent layers, or one whose slot overflows 64 bits, is an
    /// error.
    pub fn slot_pool(&self) -> Result<unikv_pools::SlotPoolSpec, unikv_mamba::Error> {
        unikv_mamba::MambaSpec::new(self.mamba_layers, self.recurrent).slot_pool_spec("mamba")
    }

    /// The bytes a replay rollback logs per verify position, every recurrent layer's
    /// inputs ([`unikv_mamba::RecurrentState::checked_log_bytes_per_layer`] × the
    /// recurrent layers; saturated past 64 bits): an estimate for engines and simulators
    /// that do not state their own ([`crate::StateReplay::log_bytes_per_position`]).
    pub const fn replay_log_bytes(&self) -> u64 {
        match self.recurrent.checked_log_bytes_per_layer() {
            Some(b) => b.saturating_mul(self.mamba_layers as u64),
            None => u64::MAX,
        }
    }

    /// The FULL and SWA sub-pools of this model's KV, each with its own rows.
    pub const fn kv_sub_pools(&self) -> (SubPoolSpec, SubPoolSpec) {
        (
            self.full.sub_pool("full", self.full_envelope_layers()),
            self.swa.sub_pool("swa", self.swa_layers),
        )
    }
}

impl fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} FULL", self.name, self.full_layers)?;
        if self.full == self.swa {
            write!(
                f,
                " + {} SWA layers, W = {}, {})",
                self.swa_layers, self.window, self.full
            )?;
        } else {
            write!(f, " layers of {}", self.full)?;
            if self.swa_layers != 0 {
                write!(
                    f,
                    " + {} SWA layers of {}, W = {}",
                    self.swa_layers, self.swa, self.window
                )?;
            }
            f.write_str(")")?;
        }
        if self.mamba_layers != 0 {
            write!(
                f,
                " + {} recurrent layers of {} B state",
                self.mamba_layers,
                self.recurrent.state_bytes_per_layer()
            )?;
        }
        if self.draft_layers != 0 {
            write!(
                f,
                " + {} draft layers in the FULL envelope",
                self.draft_layers
            )?;
        }
        Ok(())
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
        assert_eq!(m.state_bytes_per_request(), 0);
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
    fn gemma_4_31b_prices_its_global_and_sliding_rows_apart() {
        let m = ModelSpec::by_name("gemma-4-31b").unwrap();
        // 10 full layers × 2 (K, V) × num_global_key_value_heads 4 × global_head_dim 512
        // × 2 B (bf16).
        assert_eq!(m.full_bytes_per_token(), 10 * 2 * 4 * 512 * 2);
        assert_eq!(m.full_bytes_per_token(), 81_920);
        // 50 sliding layers × 2 × num_key_value_heads 16 × head_dim 256 × 2 B.
        assert_eq!(m.swa_bytes_per_token(), 50 * 2 * 16 * 256 * 2);
        assert_eq!(m.swa_bytes_per_token(), 819_200);
        assert_eq!(m.state_bytes_per_request(), 0);
        // The sub-pools carry each kind's own rows.
        let (full, swa) = m.kv_sub_pools();
        assert_eq!((full.bytes_per_token, full.rows_per_token), (81_920, 20));
        assert_eq!((swa.bytes_per_token, swa.rows_per_token), (819_200, 100));
        assert_eq!(
            m.to_string(),
            "gemma-4-31b (10 FULL layers of 4 KV heads × 512 × 2 B + 50 SWA layers of \
             16 KV heads × 256 × 2 B, W = 1024)"
        );
    }

    #[test]
    fn qwen3_next_prices_its_attention_rows_and_gated_deltanet_state() {
        let m = ModelSpec::by_name("qwen3-next-80b-a3b").unwrap();
        // 48 layers / full_attention_interval 4 = 12 full; the other 36 are GDN.
        assert_eq!((m.full_layers, m.swa_layers, m.mamba_layers), (12, 0, 36));
        // 12 × 2 × num_key_value_heads 2 × head_dim 256 × 2 B.
        assert_eq!(m.full_bytes_per_token(), 12 * 2 * 2 * 256 * 2);
        assert_eq!(m.full_bytes_per_token(), 24_576);
        assert_eq!(m.swa_bytes_per_token(), 0);
        // Conv: (2 × linear_num_key_heads 16 × linear_key_head_dim 128
        //        + linear_num_value_heads 32 × linear_value_head_dim 128) channels
        //       × (linear_conv_kernel_dim 4 − 1) × 2 B (bf16).
        let conv = (2 * 16 * 128 + 32 * 128) * (4 - 1) * 2;
        assert_eq!(m.recurrent.checked_conv_bytes(), Some(conv));
        assert_eq!(conv, 49_152);
        // Temporal: 32 value heads × 128 value dim × 128 key dim × 4 B (float32).
        let temporal = 32 * 128 * 128 * 4;
        assert_eq!(m.recurrent.checked_temporal_bytes(), Some(temporal));
        assert_eq!(m.recurrent.state_bytes_per_layer(), 2_146_304);
        assert_eq!(m.state_bytes_per_request(), 36 * (conv + temporal));
        assert_eq!(m.state_bytes_per_request(), 77_266_944);
    }

    #[test]
    fn nemotron_h_prices_its_attention_rows_and_mamba2_state() {
        let m = ModelSpec::by_name("nemotron-h-8b").unwrap();
        // hybrid_override_pattern: 24 `M`, 4 `*`, 24 `-` over 52 layers.
        let pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-";
        assert_eq!(pattern.len(), 52);
        let count = |c| pattern.chars().filter(|&p| p == c).count() as u32;
        assert_eq!((m.full_layers, m.mamba_layers), (count('*'), count('M')));
        // 4 × 2 × num_key_value_heads 8 × attention_head_dim 128 × 2 B.
        assert_eq!(m.full_bytes_per_token(), 4 * 2 * 8 * 128 * 2);
        assert_eq!(m.full_bytes_per_token(), 16_384);
        // Conv: (mamba_num_heads 128 × mamba_head_dim 64 + 2 × n_groups 8 ×
        //        ssm_state_size 128) channels × (conv_kernel 4 − 1) × 2 B.
        let conv = (128 * 64 + 2 * 8 * 128) * (4 - 1) * 2;
        assert_eq!(conv, 61_440);
        // Temporal: 128 heads × 64 head dim × 128 state × 4 B.
        let temporal = 128 * 64 * 128 * 4;
        assert_eq!(temporal, 4_194_304);
        assert_eq!(m.recurrent.state_bytes_per_layer(), conv + temporal);
        assert_eq!(m.state_bytes_per_request(), 24 * (conv + temporal));
        assert_eq!(m.state_bytes_per_request(), 102_137_856);
    }

    #[test]
    fn the_synthetic_tri_pool_model_has_all_three_kinds() {
        let m = ModelSpec::by_name("synthetic-tri").unwrap();
        assert!(m.full_layers > 0 && m.swa_layers > 0 && m.has_recurrent_state());
        assert_eq!(m.full_bytes_per_token(), 4 * 2 * 8 * 128 * 2);
        assert_eq!(m.swa_bytes_per_token(), 12 * 2 * 8 * 128 * 2);
        assert_eq!(
            m.state_bytes_per_request(),
            16 * ModelSpec::NEMOTRON_H_8B.recurrent.state_bytes_per_layer()
        );
    }

    #[test]
    fn per_token_bytes_past_64_bits_are_none_or_saturate_instead_of_wrapping() {
        let huge = ModelSpec {
            full_layers: u32::MAX,
            full: KvRows::new(u32::MAX, u32::MAX, 2),
            ..ModelSpec::GPT_OSS_20B
        };
        assert_eq!(huge.checked_full_bytes_per_token(), None);
        assert_eq!(huge.full_bytes_per_token(), u64::MAX);
        // The SWA rows are their own: gpt-oss's still fit.
        assert_eq!(huge.checked_swa_bytes_per_token(), Some(24_576));
        let huge_swa = ModelSpec {
            swa: KvRows::new(u32::MAX, u32::MAX, u32::MAX),
            ..ModelSpec::GPT_OSS_20B
        };
        // 12 SWA layers × 2 × (2^32−1)^3 does not fit.
        assert_eq!(huge_swa.checked_swa_bytes_per_token(), None);
        assert_eq!(huge_swa.swa_bytes_per_token(), u64::MAX);
        assert_eq!(huge_swa.checked_full_bytes_per_token(), Some(24_576));
    }

    #[test]
    fn recurrent_state_bytes_past_64_bits_are_none_or_saturate() {
        let wide = RecurrentState {
            heads: u32::MAX,
            head_dim: u32::MAX,
            state_size: u32::MAX,
            ..ModelSpec::NEMOTRON_H_8B.recurrent
        };
        assert_eq!(wide.checked_temporal_bytes(), None);
        assert_eq!(wide.checked_state_bytes_per_layer(), None);
        assert_eq!(wide.state_bytes_per_layer(), u64::MAX);
        let wide_conv = RecurrentState {
            conv_channels: u32::MAX,
            conv_kernel: u32::MAX,
            conv_dtype_bytes: u32::MAX,
            ..ModelSpec::NEMOTRON_H_8B.recurrent
        };
        assert_eq!(wide_conv.checked_conv_bytes(), None);
        assert_eq!(wide_conv.checked_state_bytes_per_layer(), None);
        // Each part fits ((2^32−1)(2^32−2) and (2^32−1)^2 are below 2^64), their sum
        // does not.
        let sum_overflows = RecurrentState {
            conv_channels: u32::MAX,
            conv_kernel: u32::MAX,
            conv_dtype_bytes: 1,
            heads: u32::MAX,
            head_dim: u32::MAX,
            state_size: 1,
            state_dtype_bytes: 1,
        };
        assert!(sum_overflows.checked_conv_bytes().is_some());
        assert!(sum_overflows.checked_temporal_bytes().is_some());
        assert_eq!(sum_overflows.checked_state_bytes_per_layer(), None);
        // Per layer fits, times the layers does not.
        let many = ModelSpec {
            mamba_layers: u32::MAX,
            recurrent: RecurrentState {
                heads: u32::MAX,
                head_dim: 1 << 16,
                state_size: 1,
                state_dtype_bytes: 4,
                ..ModelSpec::NEMOTRON_H_8B.recurrent
            },
            ..ModelSpec::NEMOTRON_H_8B
        };
        assert!(many.recurrent.checked_state_bytes_per_layer().is_some());
        assert_eq!(many.checked_state_bytes_per_request(), None);
        assert_eq!(many.state_bytes_per_request(), u64::MAX);
        // A kernel of width 1 keeps no inputs.
        let no_conv = RecurrentState {
            conv_kernel: 1,
            ..ModelSpec::NEMOTRON_H_8B.recurrent
        };
        assert_eq!(no_conv.checked_conv_bytes(), Some(0));
    }
}
