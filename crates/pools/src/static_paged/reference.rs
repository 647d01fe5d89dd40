//! The reference engine's default slot pool: how SGLang splits a hybrid model's KV budget
//! between Mamba states and FULL KV ([`reference_slot_pool`]), and the running-request
//! cap the slot count implies, so the static baseline's slot pool can be sized as the
//! reference sizes it.

use crate::error::Error;
use crate::spec::SlotPoolSpec;

/// The reference engine's default `mamba_full_memory_ratio`, the ratio of Mamba state
/// bytes to FULL KV bytes it splits the KV budget by (SGLang `ServerArgs`,
/// `python/sglang/srt/server_args.py`: `mamba_full_memory_ratio: float = 0.9`).
pub const REFERENCE_MAMBA_FULL_MEMORY_RATIO: f64 = 0.9;

/// State slots the reference engine charges each running request with a radix cache
/// (`MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3` in SGLang
/// `python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py`; the default
/// `mamba_scheduler_strategy` `no_buffer` adds no extra-buffer slots).
pub const REFERENCE_SLOTS_PER_RUNNING_REQUEST: u32 = 3;

/// Whether the engine keeps a prefix (radix) cache: it decides how many state slots the
/// reference engine charges each running request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixCaching {
    /// A radix cache: each running request is charged
    /// [`REFERENCE_SLOTS_PER_RUNNING_REQUEST`] slots (its own state plus checkpoints).
    Radix,
    /// No prefix cache: one slot per running request.
    Disabled,
}

/// A slot pool sized as the reference engine sizes it ([`reference_slot_pool`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReferenceSlotPool {
    /// State slots of the pool (the reference's `max_mamba_cache_size`).
    pub slots: u32,
    /// The running-request cap the slot pool implies (`slots // 3` with a radix cache,
    /// `slots` without); the reference takes the minimum of this and its token-derived
    /// cap.
    pub max_running_requests: u32,
}

/// Sizes a static slot pool the way the reference engine does by default for a hybrid
/// (Mamba/linear-attention) model: of the KV budget `total_bytes`, the Mamba states get
/// `total × r / (1 + r)` bytes, `r = mamba_full_memory_ratio`
/// ([`REFERENCE_MAMBA_FULL_MEMORY_RATIO`] = 0.9 by default), so that state bytes : FULL KV
/// bytes = r; the slot count is that share divided by the slot's bytes, rounded down, and
/// the KV pools get the rest of the buffer. Reference: SGLang
/// `ModelRunnerKVCacheMixin.handle_max_mamba_cache`
/// (`python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py`), the branch taken
/// when neither `max_mamba_cache_size` nor (with the radix cache disabled)
/// `max_running_requests` is given; `init_memory` then caps the running requests at
/// `max_mamba_cache_size // calculate_mamba_ratio()` (3 with a radix cache, 1 without).
/// Speculative decoding's intermediate states are not in this count: the facade adds
/// them beyond it (`unikv::verify_scratch_slots`), as SGLang's
/// `intermediate_ssm_state_cache` is a buffer apart from its Mamba pool.
///
/// A ratio that is not positive and finite, or a slot spec [`SlotPoolSpec::grid`]
/// refuses, is [`Error::BadConfig`]. The count may be below [`BS1_STATE_SLOTS`](crate::BS1_STATE_SLOTS); then
/// [`StaticSwa::new`](crate::StaticSwa::new) refuses the pool.
pub fn reference_slot_pool(
    total_bytes: u64,
    spec: &SlotPoolSpec,
    mamba_full_memory_ratio: f64,
    caching: PrefixCaching,
) -> Result<ReferenceSlotPool, Error> {
    let r = mamba_full_memory_ratio;
    if !(r > 0.0 && r.is_finite()) {
        return Err(Error::BadConfig(format!(
            "mamba_full_memory_ratio must be positive, got {r}"
        )));
    }
    // Validates the spec; its page count (total / slot bytes) fits i32, so the count
    // below, a share of it, fits u32.
    spec.grid(total_bytes, 0)?;
    // The reference computes the share in floating point and truncates; so does this.
    let state_bytes = (total_bytes as f64 * r / (1.0 + r)) as u64;
    let slots = (state_bytes / spec.bytes_per_slot).min(total_bytes / spec.bytes_per_slot) as u32;
    let per_request = match caching {
        PrefixCaching::Radix => REFERENCE_SLOTS_PER_RUNNING_REQUEST,
        PrefixCaching::Disabled => 1,
    };
    Ok(ReferenceSlotPool {
        slots,
        max_running_requests: slots / per_request,
    })
}
