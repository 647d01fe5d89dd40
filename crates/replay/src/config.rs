//! What a run and a replay are configured with: the layouts (the facade's [`Layout`],
//! both in [`LAYOUTS`]), the device
//! ([`Backend`]), one run's settings ([`RunConfig`]) and a replay's grid of runs
//! ([`ReplayOptions`]), with the defaults `unikv replay` documents.

use crate::speculative::SpecMode;
use std::path::PathBuf;
use std::sync::Arc;
use unikv::kernels::SyncLedger;
use unikv::{HybridCache, Layout, ModelSpec};
use unikv_invariants::Level;
use unikv_workload::Preset;

/// The default KV budget of `unikv replay`: **16 GiB**, chosen so that the static split
/// is under pressure while the unified pool is not.
///
/// gpt-oss-20b costs 24,576 bytes per token on each side. The static pools split the
/// budget 1 : 0.8 (FULL : SWA tokens), so 16 GiB gives FULL 16 GiB / (24,576 B × 1.8) ≈
/// 388,000 tokens. At full concurrency the FULL side needs, per preset:
///
/// | preset | FULL tokens at the end of a full batch | static (≈ 388k) | unified (≈ 699k, less SWA's windows) |
/// |---|---|---|---|
/// | `shared-prefix` | 4,096 + 192 × 2,176 = 421,888 | short: retracts | fits |
/// | `long-outputs` | 100 × 4,608 = 460,800 | short: retracts | fits |
/// | `random-8192-64` | 64 × 8,256 = 528,384 | short | fits |
/// | `random-2048-512` | 64 × 2,560 = 163,840 | fits | fits |
///
/// SWA needs only a window (128 tokens, rounded up to pages) per running request plus
/// the prefill chunk, so the static pools' 44 % on SWA mostly sits idle — the case the
/// unified pool exists for. 16 GiB is also about what a 32 GB GPU leaves for KV next to
/// gpt-oss-20b's ~13 GB of weights.
pub const DEFAULT_MEMORY_BYTES: u64 = 16 << 30;

/// The default page sizes: 1 and 256.
pub const DEFAULT_PAGE_SIZES: [u32; 2] = [1, 256];

/// The default seed.
pub const DEFAULT_SEED: u64 = 1;

/// Both layouts, static first (the table's column order; `--layout both`, the default):
/// the static one with the reference engine's SWA:FULL token ratio
/// ([`Layout::DEFAULT_SWA_FULL_TOKENS_RATIO`], 0.8).
pub const LAYOUTS: [Layout; 2] = [
    Layout::Static {
        swa_full_tokens_ratio: Layout::DEFAULT_SWA_FULL_TOKENS_RATIO,
    },
    Layout::Unified,
];

/// Serialises a layout as its name, `"static"` or `"unified"` (the facade's [`Layout`]
/// has no serde; a report's JSON shows the name only).
pub(crate) fn serialize_layout<S: serde::Serializer>(
    layout: &Layout,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(layout.as_str())
}

/// The device a run's buffer lives on (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// The byte-keeping CPU reference device: every move and fill is carried out.
    #[default]
    Cpu,
    /// [`NullDevice`](unikv::kernels::NullDevice): shapes checked, no bytes kept, so a
    /// real model's budget runs in megabytes and the time is the host's bookkeeping.
    None,
}

impl Backend {
    /// Both, in `--device` order.
    pub const ALL: [Backend; 2] = [Backend::Cpu, Backend::None];

    /// The `--device` spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::None => "none",
        }
    }

    /// The backend spelled `name` (any case).
    pub fn from_name(name: &str) -> Option<Backend> {
        Backend::ALL
            .into_iter()
            .find(|b| b.as_str().eq_ignore_ascii_case(name.trim()))
    }

    /// A fresh device of this kind behind a [`SyncLedger`] (which counts syncs and
    /// device time).
    pub fn ledger(self) -> Arc<SyncLedger> {
        let device: Arc<dyn unikv::kernels::Readback> = match self {
            Backend::Cpu => Arc::new(unikv::kernels::CpuDevice::new()),
            Backend::None => Arc::new(unikv::kernels::NullDevice::new()),
        };
        Arc::new(SyncLedger::new(device))
    }
}

/// Everything one run needs besides the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// The model whose KV shapes size the sub-pools.
    pub model: ModelSpec,
    /// Static (with its SWA:FULL token ratio, the reference engine's 0.8 by default) or
    /// unified.
    pub layout: Layout,
    /// Tokens per page (≥ 1).
    pub page_size: u32,
    /// The KV budget in bytes: the one buffer of the unified layout, or both pools of the
    /// static one together.
    pub memory_bytes: u64,
    /// The seed the workload was generated from; also seeds any tie-break the scheduler
    /// makes at random.
    pub seed: u64,
    /// The invariant level the run is checked at (Strict by default).
    pub invariant_level: Level,
    /// Largest prefill chunk, in tokens (chunked prefill), per step across the batch.
    pub chunk_tokens: u32,
    /// At most this many samples in [`RunStats::samples`](crate::stats::RunStats::samples).
    pub max_samples: usize,
    /// The run fails with [`ReplayError::Stalled`](crate::ReplayError::Stalled) after this
    /// many steps.
    pub max_steps: u64,
    /// The device the buffer lives on (`--device`).
    pub backend: Backend,
    /// Speculative decoding (`--spec`, `--spec-tree`, `--spec-late`): every decode step
    /// is a verify step. `None` decodes one token per step.
    pub speculation: Option<SpecMode>,
    /// The host tier's buffer in bytes (`--host-memory`; 0, the default: none): prefixes
    /// the device evicts are written back there and loaded back by a prompt that
    /// matches them ([`unikv::HybridCacheBuilder::host_memory_bytes`]).
    pub host_memory_bytes: u64,
    /// The recurrent checkpoint interval in tokens (`--checkpoint-interval`; `None`, the
    /// default: the builder's, 256 tokens in whole pages,
    /// [`unikv::HybridCacheBuilder::checkpoint_interval`]).
    pub checkpoint_interval: Option<u32>,
}

impl RunConfig {
    /// The default prefill chunk: 8,192 tokens per step (a common
    /// `--chunked-prefill-size`; the reference engine picks 2,048 to 16,384 by GPU memory).
    pub const DEFAULT_CHUNK_TOKENS: u32 = 8_192;
    /// The default cap on plotted samples per run.
    pub const DEFAULT_MAX_SAMPLES: usize = 512;
    /// The default step limit: far beyond what any preset needs (even at concurrency 1
    /// none takes 10⁶ steps), low enough to stop a livelock in minutes.
    pub const DEFAULT_MAX_STEPS: u64 = 10_000_000;

    /// A configuration with the defaults for everything but the run's identity.
    pub fn new(model: ModelSpec, layout: Layout, page_size: u32, memory_bytes: u64) -> RunConfig {
        RunConfig {
            model,
            layout,
            page_size,
            memory_bytes,
            seed: 0,
            invariant_level: Level::Strict,
            chunk_tokens: RunConfig::DEFAULT_CHUNK_TOKENS,
            max_samples: RunConfig::DEFAULT_MAX_SAMPLES,
            max_steps: RunConfig::DEFAULT_MAX_STEPS,
            backend: Backend::Cpu,
            speculation: None,
            host_memory_bytes: 0,
            checkpoint_interval: None,
        }
    }
}

/// What a replay runs: `unikv replay`'s options that choose the runs, resolved (defaults
/// filled in). How the report is printed (`--json`, `--svg`) is the command line's.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayOptions {
    /// The presets to run, in order, without duplicates. Empty only when a trace is given
    /// alone.
    pub workloads: Vec<Preset>,
    /// A trace file to run after the presets (`--trace`).
    pub trace: Option<PathBuf>,
    /// The model (`--model`, default gpt-oss-20b).
    pub model: ModelSpec,
    /// Page sizes, in order, without duplicates (`--page-size`, default 1 and 256).
    pub page_sizes: Vec<u32>,
    /// The KV budget in bytes (`--memory`, default [`DEFAULT_MEMORY_BYTES`]).
    pub memory_bytes: u64,
    /// Layouts, static first (`--layout`, default both).
    pub layouts: Vec<Layout>,
    /// The seed of workload generation and of the scheduler (`--seed`).
    pub seed: u64,
    /// The invariant level of the runs (`--invariants`, default strict).
    pub invariant_level: Level,
    /// Record the run's allocator operations into this file (`--record-ops`; one run).
    pub record_ops: Option<PathBuf>,
    /// Report CPU time per step (off with `--no-timing`, for byte-identical output).
    pub timing: bool,
    /// The device of the runs (`--device`, default cpu).
    pub backend: Backend,
    /// Speculative decoding in every run (`--spec K`, `--spec-tree N`, `--spec-late`);
    /// each run is then also replayed without it, for the report's comparison.
    pub speculation: Option<SpecMode>,
    /// The host tier of every run, in bytes (`--host-memory`; 0, the default: none).
    pub host_memory_bytes: u64,
    /// The recurrent checkpoint interval of every run (`--checkpoint-interval`; `None`:
    /// the builder's default).
    pub checkpoint_interval: Option<u32>,
}

impl Default for ReplayOptions {
    /// `unikv replay` with no options.
    fn default() -> ReplayOptions {
        ReplayOptions {
            workloads: Preset::DEFAULTS.to_vec(),
            trace: None,
            model: ModelSpec::GPT_OSS_20B,
            page_sizes: DEFAULT_PAGE_SIZES.to_vec(),
            memory_bytes: DEFAULT_MEMORY_BYTES,
            layouts: LAYOUTS.to_vec(),
            seed: DEFAULT_SEED,
            invariant_level: Level::Strict,
            record_ops: None,
            timing: true,
            backend: Backend::Cpu,
            speculation: None,
            host_memory_bytes: 0,
            checkpoint_interval: None,
        }
    }
}

impl ReplayOptions {
    /// How many runs these options give: workloads (presets and trace) × page sizes ×
    /// layouts.
    pub fn runs(&self) -> usize {
        let workloads = self.workloads.len() + usize::from(self.trace.is_some());
        workloads * self.page_sizes.len() * self.layouts.len()
    }
}

/// The builder of a run's cache, on `device`.
pub(crate) fn cache_builder(
    config: &RunConfig,
    device: Arc<SyncLedger>,
) -> unikv::HybridCacheBuilder {
    let replay = state_replay(config, unikv::kernels::Device::holds_bytes(&*device));
    let builder = HybridCache::builder()
        .model(config.model)
        .page_size(config.page_size)
        .memory_bytes(config.memory_bytes)
        .layout(config.layout)
        .host_memory_bytes(config.host_memory_bytes)
        .device(device);
    let builder = match config.checkpoint_interval {
        Some(tokens) => builder.checkpoint_interval(tokens),
        None => builder,
    };
    let builder = match config.speculation {
        Some(_) => builder.speculation(speculation(config).expect("a speculative run")),
        None => builder,
    };
    match replay {
        Some(replay) => builder.state_replay(replay),
        None => builder,
    }
}

/// The replay rollback a speculative run of a model with recurrent state registers (none
/// otherwise): a log entry of the model's [`ModelSpec::replay_log_bytes`], replayed by
/// [`StandInReplay`] on a device with bytes and by [`unikv::BookkeepingReplay`] on one
/// without.
pub fn state_replay(config: &RunConfig, holds_bytes: bool) -> Option<Arc<dyn unikv::StateReplay>> {
    if config.speculation.is_none() || !config.model.has_recurrent_state() {
        return None;
    }
    let log_bytes_per_position = config.model.replay_log_bytes();
    Some(if holds_bytes {
        Arc::new(StandInReplay {
            log_bytes_per_position,
        })
    } else {
        Arc::new(unikv::BookkeepingReplay {
            log_bytes_per_position,
        })
    })
}

/// The replay's stand-in for an engine's replay kernel, on a device with bytes: the
/// simulator has no model to run the recurrence with, so it moves what the kernel reads
/// into what it writes — the log entry that ends each prefix into the running slot and
/// into each checkpoint slot — one span move op per settlement. The bytes it leaves are
/// not states (the simulator never reads them as such).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StandInReplay {
    /// Bytes of one log entry.
    pub log_bytes_per_position: u64,
}

impl unikv::StateReplay for StandInReplay {
    fn log_bytes_per_position(&self) -> u64 {
        self.log_bytes_per_position
    }

    fn replay(
        &self,
        ctx: &unikv::ReplayContext<'_>,
        commits: &[unikv::StateCommit<'_>],
    ) -> Result<(), unikv::kernels::Error> {
        let moves: Vec<unikv::kernels::SpanMove> = commits
            .iter()
            .flat_map(|c| c.saves())
            .map(|(entry, slot)| unikv::kernels::SpanMove {
                src: ctx.entry_offset(entry),
                dst: ctx.slot_offset(slot),
                len: ctx.log_bytes,
            })
            .collect();
        if moves.is_empty() {
            return Ok(());
        }
        ctx.device.move_spans(ctx.buffer, &moves)
    }
}

/// How a run's verify lanes sit in state slots: its cache's, as built (the copy
/// rollback's one state per slot without a replay).
pub fn scratch_shape(config: &RunConfig) -> unikv::ScratchShape {
    let width = config
        .speculation
        .map_or(1, |mode| mode.speculation().max_width);
    state_replay(config, false)
        .zip(config.model.slot_pool().ok())
        .and_then(|(replay, slots)| {
            unikv::ScratchShape::replaying(
                width,
                slots.bytes_per_slot,
                replay.log_bytes_per_position(),
            )
        })
        .unwrap_or(unikv::ScratchShape::copy(width))
}

/// The share of the budget a speculative run of a model with recurrent state may give its
/// verify scratch (the draft positions' log entries): a sixteenth, which
/// [`REPLAY_VERIFY_BATCH`] caps far below. Every byte of scratch is a
/// byte the prefix cache cannot hold (the unified layout lends it from the same buffer,
/// the static one takes it from the KV pools), and the decoders beyond the verify batch
/// decode plainly, so a small batch costs speculation's speed-up on those requests, not
/// their progress: on `mamba-starvation` at 16 GiB a quarter lost up to 30 % of the
/// no-spec hit rate on Qwen3-Next and all of it on synthetic-tri.
pub const VERIFY_SCRATCH_SHARE: (u64, u64) = (1, 16);

/// The speculation a run's cache is built with (`None` without): its mode's, with the
/// verify batch [`verify_lanes`] declares.
pub fn speculation(config: &RunConfig) -> Option<unikv::Speculation> {
    config
        .speculation
        .map(|mode| mode.speculation().batch(verify_lanes(config)))
}

/// The verify batch a speculative run declares ([`unikv::Speculation::max_batch`]) and
/// admits at most, for a model with recurrent state: as many requests as
/// [`VERIFY_SCRATCH_SHARE`] of the budget holds scratch lanes for (the verify width per
/// verify in flight, in log entries under the replay rollback the runs use: see
/// [`state_replay`]), at least 1 and at most [`REPLAY_VERIFY_BATCH`]. An engine verifies
/// at most its CUDA graph's batch a step, and SGLang sizes its
/// `intermediate_ssm_state_cache` by the requests it speculates for; the decoders beyond
/// the batch decode plainly. The static layout sizes its slot pool for that many lanes
/// beyond the reference pool. [`unikv::DEFAULT_VERIFY_BATCH`] without recurrent state (no
/// scratch, no cap).
pub fn verify_lanes(config: &RunConfig) -> u32 {
    let (Some(mode), Some(replay)) = (config.speculation, state_replay(config, false)) else {
        return unikv::DEFAULT_VERIFY_BATCH;
    };
    let spec = mode.speculation();
    let lane_bytes = replay
        .log_bytes_per_position()
        .saturating_mul(u64::from(spec.max_width) * u64::from(spec.max_in_flight));
    let (num, den) = VERIFY_SCRATCH_SHARE;
    (config.memory_bytes / den * num / lane_bytes.max(1)).clamp(1, u64::from(REPLAY_VERIFY_BATCH))
        as u32
}

/// The most requests a speculative run of a recurrent model verifies in one step: 64, a
/// CUDA graph's verify batch (SGLang caps its running requests at 48 when it
/// speculates). Log lanes are cheap — 64 lanes of 5 Qwen3-Next positions take 3 state
/// slots — but the static layout sets them aside up front.
pub const REPLAY_VERIFY_BATCH: u32 = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_print_and_serialise_in_lower_case() {
        #[derive(serde::Serialize)]
        struct Named(#[serde(serialize_with = "serialize_layout")] Layout);
        assert_eq!(LAYOUTS[0].to_string(), "static");
        assert_eq!(
            serde_json::to_string(&Named(LAYOUTS[0])).unwrap(),
            "\"static\""
        );
        assert_eq!(
            serde_json::to_string(&Named(LAYOUTS[1])).unwrap(),
            "\"unified\""
        );
    }

    #[test]
    fn no_options_give_the_documented_defaults() {
        let r = ReplayOptions::default();
        assert_eq!(r.workloads, Preset::DEFAULTS);
        assert_eq!(r.page_sizes, [1, 256]);
        assert_eq!(r.layouts, LAYOUTS);
        assert_eq!(r.model, ModelSpec::GPT_OSS_20B);
        assert_eq!(r.memory_bytes, 16 << 30);
        assert_eq!(r.invariant_level, Level::Strict);
        assert!(r.timing && r.trace.is_none() && r.record_ops.is_none());
        assert_eq!(r.host_memory_bytes, 0, "no host tier");
        assert_eq!(r.runs(), 20);
    }
}
