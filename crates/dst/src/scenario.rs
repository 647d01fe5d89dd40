//! One seed's configuration ([`Scenario`]): a scaled named model ([`scaled`]), a layout,
//! a page size, a budget from the batch-size-1 floor, a fault rate and, for half the
//! seeds, speculative decoding (verify width, steps in flight, chain or tree drafts, the
//! draft model's layers), all drawn from the seed alone.

use unikv::mamba::MAX_CHECKPOINTS_PER_STEP;
use unikv::{Error, HybridCache, KvRows, Layout, ModelSpec, RecurrentState, Speculation};
use unikv_workload::rng::SplitMix64;

/// One seed's configuration, derived from the seed alone.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The seed.
    pub seed: u64,
    /// The model, scaled down ([`scaled`]).
    pub model: ModelSpec,
    /// Static or unified.
    pub layout: Layout,
    /// Tokens per page.
    pub page_size: u32,
    /// The buffer's bytes.
    pub memory_bytes: u64,
    /// Steps the engine runs.
    pub steps: usize,
    /// Device faults per thousand device ops.
    pub faults_per_mille: u64,
    /// Recurrent states a request may save in one step (1 to the most the cache allows),
    /// so seeds drive single- and multi-checkpoint steps.
    pub checkpoints_per_step: u32,
    /// Speculative decoding, for half the seeds: the cache verifies drafts of up to
    /// `max_width` positions with up to `max_in_flight` verify steps of a request
    /// unsettled, and decode steps become verify steps.
    pub speculation: Option<Speculation>,
    /// Whether verify steps may draft trees (parent arrays) as well as chains.
    pub draft_trees: bool,
    /// For half the speculative seeds of a recurrent model: the replay rollback, with
    /// this many log entries to a state slot ([`DstReplay`]); else the copy rollback.
    pub replay: Option<u32>,
    /// For half the seeds, a host tier of this many bytes (1 to 4 times the device
    /// budget): device evictions write prefixes back, admissions load host hits back,
    /// and the stamps check what came back.
    pub host_memory_bytes: Option<u64>,
}

/// The named models with their KV rows and recurrent state scaled down (head dims / 32,
/// one KV head, state of a few bytes a layer), so a buffer near the batch-size-1 floor is
/// kilobytes; layer counts, windows and which kinds a model has stay.
pub fn scaled(m: ModelSpec) -> ModelSpec {
    let rows = |r: KvRows| {
        if r.kv_heads == 0 {
            r
        } else {
            KvRows::new(1, (r.head_dim / 32).max(1), r.dtype_bytes)
        }
    };
    let recurrent = if m.has_recurrent_state() {
        RecurrentState {
            conv_channels: 4,
            conv_kernel: m.recurrent.conv_kernel.clamp(2, 4),
            heads: 1,
            head_dim: 2,
            state_size: 2,
            conv_dtype_bytes: m.recurrent.conv_dtype_bytes,
            state_dtype_bytes: m.recurrent.state_dtype_bytes,
        }
    } else {
        m.recurrent
    };
    ModelSpec {
        full: rows(m.full),
        swa: rows(m.swa),
        recurrent,
        ..m
    }
}

impl Scenario {
    /// The configuration seed `seed` runs.
    pub fn from_seed(seed: u64) -> Scenario {
        let mut rng = SplitMix64::for_stream(seed, "dst.config");
        let named = ModelSpec::NAMED;
        let mut model = scaled(named[rng.below(named.len() as u64) as usize]);
        if model.swa_layers > 0 && rng.below(2) == 0 {
            model.window = rng.in_range(2, 48) as u32;
        }
        // Speculation from a stream of its own, so every draw of `rng` stays what it was.
        let mut spec_rng = SplitMix64::for_stream(seed, "dst.speculation");
        let speculation = (spec_rng.below(2) == 0).then(|| {
            model = model.with_draft_layers(spec_rng.below(3) as u32);
            Speculation {
                max_width: spec_rng.in_range(1, 8) as u32,
                // Late counts: the step after the verify (the most the cache allows).
                max_in_flight: [1, 2, 2, unikv::MAX_IN_FLIGHT][spec_rng.below(4) as usize],
                max_batch: unikv::DEFAULT_VERIFY_BATCH,
            }
        });
        let draft_trees = speculation.is_some() && spec_rng.below(3) != 0;
        // Half the speculative seeds of a recurrent model roll back by replay, with 1, 2, 4
        // or 8 log entries to a state slot (a lane of one slot, several, or shared).
        let replay =
            (speculation.is_some() && model.has_recurrent_state() && spec_rng.below(2) == 0)
                .then(|| [1u32, 2, 4, 8][spec_rng.below(4) as usize]);
        let page_size = [1, 1, 2, 3, 4, 8, 16, 64][rng.below(8) as usize];
        let layout = if rng.below(2) == 0 {
            Layout::Unified
        } else {
            Layout::Static {
                swa_full_tokens_ratio: [0.5, 0.8, 1.0, 2.0][rng.below(4) as usize],
            }
        };
        // The batch-size-1 floor.
        let floor = buildable(model, layout, page_size, speculation, replay, 1);
        // From the floor (every admission a struggle) to a few times it.
        let memory_bytes = buildable(
            model,
            layout,
            page_size,
            speculation,
            replay,
            floor + floor * rng.below(64) / 16,
        );
        // The host tier from a stream of its own, so every other draw stays what it was.
        let mut host_rng = SplitMix64::for_stream(seed, "dst.host");
        let host_memory_bytes =
            (host_rng.below(2) == 0).then(|| memory_bytes * [1, 2, 4][host_rng.below(3) as usize]);
        Scenario {
            seed,
            model,
            layout,
            page_size,
            memory_bytes,
            steps: rng.in_range(20, 80) as usize,
            faults_per_mille: [0, 5, 20, 60][rng.below(4) as usize],
            // From the seed, not the stream, so every earlier draw stays what it was.
            checkpoints_per_step: 1 + (seed / 3 % u64::from(MAX_CHECKPOINTS_PER_STEP)) as u32,
            speculation,
            draft_trees,
            replay,
            host_memory_bytes,
        }
    }

    /// The replay rollback this seed's cache registers, if it rolls back by replay.
    pub fn state_replay(&self) -> Option<std::sync::Arc<DstReplay>> {
        state_replay(self.model, self.replay)
    }
}

/// The replay rollback for `model` with `entries` log entries to a state slot.
fn state_replay(model: ModelSpec, entries: Option<u32>) -> Option<std::sync::Arc<DstReplay>> {
    let slot_bytes = model.slot_pool().ok()?.bytes_per_slot;
    entries
        .filter(|&p| slot_bytes % u64::from(p) == 0)
        .map(|p| {
            std::sync::Arc::new(DstReplay {
                log_bytes: slot_bytes / u64::from(p),
                slot_bytes,
            })
        })
}

/// The simulator's replay kernel. Its "recurrence" is the stamps': the state after a
/// position is the stamp of the prefix hash there, which the verify logs as the
/// position's entry (`log_bytes` bytes of it). Replaying `n` entries therefore writes the
/// stamp of entry `n − 1` over the whole slot — copied out of the entry with device
/// moves, so a replay sees what the verify logged where the metadata said, in stream
/// order, and a fault injected into it refuses the settlement whole.
#[derive(Debug)]
pub struct DstReplay {
    /// Bytes of one log entry (a divisor of the slot's).
    pub log_bytes: u64,
    /// Bytes of one state slot.
    pub slot_bytes: u64,
}

impl unikv::StateReplay for DstReplay {
    fn log_bytes_per_position(&self) -> u64 {
        self.log_bytes
    }

    fn replay(
        &self,
        ctx: &unikv::ReplayContext<'_>,
        commits: &[unikv::StateCommit<'_>],
    ) -> Result<(), unikv::kernels::Error> {
        // The entry copied over the whole slot, one entry-sized move at a time.
        let copies = self.slot_bytes / self.log_bytes;
        let moves: Vec<unikv::kernels::SpanMove> = commits
            .iter()
            .flat_map(|c| c.saves())
            .flat_map(|(entry, slot)| {
                (0..copies).map(move |k| unikv::kernels::SpanMove {
                    src: ctx.entry_offset(entry),
                    dst: ctx.slot_offset(slot) + k * self.log_bytes,
                    len: self.log_bytes,
                })
            })
            .collect();
        if moves.is_empty() {
            return Ok(());
        }
        ctx.device.move_spans(ctx.buffer, &moves)
    }
}

/// About the least budget from `bytes` up that a cache of `model` builds with: the need
/// the builder states, asked again until a size builds. (The static layout's slot pool
/// is a share of the budget, so its stated need grows with the budget, and at a few pages
/// a larger budget can leave its KV pools short of one request.)
fn buildable(
    model: ModelSpec,
    layout: Layout,
    page_size: u32,
    speculation: Option<Speculation>,
    replay: Option<u32>,
    bytes: u64,
) -> u64 {
    let mut bytes = bytes.max(1);
    for _ in 0..64 {
        let mut builder = HybridCache::builder()
            .model(model)
            .layout(layout)
            .page_size(page_size)
            .memory_bytes(bytes);
        if let Some(spec) = speculation {
            builder = builder.speculation(spec);
        }
        if let Some(replay) = state_replay(model, replay) {
            builder = builder.state_replay(replay);
        }
        let built = builder.build();
        match built {
            Ok(_) => return bytes,
            Err(Error::Pool(unikv::pools::Error::BufferTooSmall { needed, .. })) => {
                bytes = needed.0.max(bytes + bytes / 8 + 1);
            }
            Err(_) => bytes = bytes.saturating_mul(2),
        }
    }
    bytes
}
