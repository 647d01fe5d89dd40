//! A tiny hybrid decoder served two ways, to prove that unikv loses nothing: an engine
//! that keeps all its K/V and recurrent state in unikv's buffer (writing new K/V at the
//! step metadata's write locations, attending through its kernel ids, keeping the state
//! in the request's slot and writing every checkpoint the step metadata lists), and a
//! reference that runs each request alone with plain contiguous K/V. Both share one
//! forward (plain `f32` loops in a fixed order), so a correct cache makes their outputs
//! bit-identical. Three models ([`Model`]): FULL + SWA, FULL + Mamba and the tri-pool.
//!
//! Workloads ([`Workload`]): the mixed one is randomized and deterministic (shared
//! system prompts, follow-up turns, chunked prefill, decode batches, window releases,
//! eviction and lazy compaction under a small budget, retraction and re-admission,
//! aborts, `cache_unfinished`); the scripted ones (a shared-prefix batch, a multi-turn
//! conversation) exercise recurrent-state reuse and run with reuse on and off
//! ([`Reuse`]). Whenever a request resumes from a cached state, its first step compares
//! that state, bit for bit, with a contiguous recompute of its prefix
//! ([`RunStats::resumed_states`]). [`Fault`] breaks the engine on purpose, to show the
//! checks catch it. Plain loops instead of a tensor crate: the model is a few hundred
//! weights, and CI compiles and runs it on 2 cores many times over.
//!
//! Used by `examples/tiny_engine/main.rs` and, through `#[path]`, by
//! `tests/tiny_engine.rs` and `tests/tiny_engine_reuse.rs`.

#![allow(dead_code)] // the test and the example use different parts

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use unikv::kernels::{
    CpuDevice, Device, DeviceCall, DeviceHooks, DeviceOp, Error as DeviceError, Intercepted,
};
use unikv::mamba::{MambaSpec, SlotLayout};
use unikv::pools::Side;
use unikv::{
    Error, HybridCache, KvGeometry, KvRows, Layout, ModelSpec, PrefixMatch, RecurrentState,
    Request, RequestStep, StepMetadata, TokenId,
};

// ----- the model ---------------------------------------------------------------------------

/// Vocabulary size.
pub const VOCAB: usize = 48;
/// Hidden size.
pub const D: usize = 16;
/// Attention heads (as many KV heads: MHA).
pub const HEADS: usize = 2;
/// Head dimension.
pub const HD: usize = 4;
/// One K (or V) row: `HEADS × HD` floats.
pub const KV: usize = HEADS * HD;
/// The sliding window of the SWA layers.
pub const WINDOW: usize = 8;
/// Recurrent channels (`heads × head_dim` of the state).
pub const RC: usize = 8;
/// State size per channel.
pub const RS: usize = 4;

/// One layer of the stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Full attention; the index is its layer among the FULL ones.
    Full(u32),
    /// Sliding-window attention; the index among the SWA ones.
    Swa(u32),
    /// A recurrent (Mamba-like) layer; the index among the recurrent ones.
    Recurrent(u32),
}

/// Which tiny hybrid the engine serves: FULL attention and what it is mixed with, and so
/// which of unikv's pools share the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// FULL and SWA attention (gpt-oss's shape): FULL, SWA, SWA, FULL.
    Swa,
    /// FULL attention and recurrent layers, no SWA (Nemotron-H's and Qwen3-Next's
    /// shape): FULL, recurrent, recurrent, FULL.
    Mamba,
    /// All three kinds (the tri-pool): FULL, SWA, recurrent, SWA, FULL.
    TriPool,
}

impl Model {
    /// Every model, attention-only first.
    pub const ALL: [Model; 3] = [Model::Swa, Model::Mamba, Model::TriPool];

    /// The models with recurrent state (whose prefix reuse resumes from a cached state).
    pub const RECURRENT: [Model; 2] = [Model::Mamba, Model::TriPool];

    /// A short label for tables.
    pub const fn as_str(self) -> &'static str {
        match self {
            Model::Swa => "full+swa",
            Model::Mamba => "full+mamba",
            Model::TriPool => "full+swa+rec",
        }
    }

    /// Whether it has recurrent layers.
    pub const fn is_recurrent(self) -> bool {
        !matches!(self, Model::Swa)
    }

    /// The layer stack.
    pub fn layers(self) -> Vec<LayerKind> {
        use LayerKind::*;
        match self {
            Model::Swa => vec![Full(0), Swa(0), Swa(1), Full(1)],
            Model::Mamba => vec![Full(0), Recurrent(0), Recurrent(1), Full(1)],
            Model::TriPool => vec![Full(0), Swa(0), Recurrent(0), Swa(1), Full(1)],
        }
    }

    /// The cache's view of the model: `f32` rows of `HEADS × HD`, the [`RECURRENT`]
    /// state per recurrent layer, the window [`WINDOW`].
    pub fn spec(self) -> ModelSpec {
        match self {
            Model::Swa => FULL_SWA,
            Model::Mamba => FULL_MAMBA,
            Model::TriPool => FULL_SWA_MAMBA,
        }
    }
}

/// The recurrent state of one layer: conv state (`RC` floats, the previous input) and
/// temporal state (`RC × RS` floats), both `f32`.
pub const RECURRENT: RecurrentState = RecurrentState {
    conv_channels: RC as u32,
    conv_kernel: 2,
    heads: HEADS as u32,
    head_dim: (RC / HEADS) as u32,
    state_size: RS as u32,
    conv_dtype_bytes: 4,
    state_dtype_bytes: 4,
};

/// [`Model::Swa`]'s spec: two FULL and two SWA layers.
const FULL_SWA: ModelSpec = ModelSpec {
    name: "tiny-engine",
    full_layers: 2,
    swa_layers: 2,
    mamba_layers: 0,
    full: KvRows::new(HEADS as u32, HD as u32, 4),
    swa: KvRows::new(HEADS as u32, HD as u32, 4),
    recurrent: RecurrentState::NONE,
    window: WINDOW as u32,
};

/// [`Model::Mamba`]'s spec: two FULL and two recurrent layers, no SWA.
const FULL_MAMBA: ModelSpec = ModelSpec {
    name: "tiny-engine-mamba",
    swa_layers: 0,
    mamba_layers: 2,
    swa: KvRows::NONE,
    recurrent: RECURRENT,
    window: 0,
    ..FULL_SWA
};

/// [`Model::TriPool`]'s spec: [`FULL_SWA`] and one recurrent layer.
const FULL_SWA_MAMBA: ModelSpec = ModelSpec {
    name: "tiny-engine-tri",
    mamba_layers: 1,
    recurrent: RECURRENT,
    ..FULL_SWA
};

/// A small deterministic generator (xorshift64*).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded (any seed; 0 is remapped).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// Uniform in `[-a, a)`.
    pub fn weight(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * a
    }
}

/// A matrix `rows × cols`, row-major.
#[derive(Clone, Debug)]
pub struct Mat {
    rows: usize,
    cols: usize,
    w: Vec<f32>,
}

impl Mat {
    /// Weights uniform in `±1/√cols`.
    fn random(rng: &mut Rng, rows: usize, cols: usize) -> Mat {
        let a = 1.0 / (cols as f32).sqrt();
        Mat {
            rows,
            cols,
            w: (0..rows * cols).map(|_| rng.weight(a)).collect(),
        }
    }

    /// `out = W · x`, each output summed in column order.
    fn apply(&self, x: &[f32], out: &mut [f32]) {
        for (r, o) in out.iter_mut().enumerate().take(self.rows) {
            let row = &self.w[r * self.cols..(r + 1) * self.cols];
            let mut acc = 0.0f32;
            for (w, v) in row.iter().zip(x) {
                acc += w * v;
            }
            *o = acc;
        }
    }
}

/// One layer's weights.
#[derive(Clone, Debug)]
pub enum LayerWeights {
    /// q, k, v projections `KV × D`, output `D × KV`.
    Attention { q: Mat, k: Mat, v: Mat, o: Mat },
    /// Input `RC × D`, conv taps (current, previous), decay and input gains per state
    /// element, readout per state element, output `D × RC`.
    Recurrent {
        input: Mat,
        conv: [Vec<f32>; 2],
        decay: Vec<f32>,
        gain: Vec<f32>,
        readout: Vec<f32>,
        out: Mat,
    },
}

/// Random weights of the whole model.
#[derive(Clone, Debug)]
pub struct Weights {
    /// The layer stack.
    pub kinds: Vec<LayerKind>,
    embed: Mat,
    layers: Vec<LayerWeights>,
    unembed: Mat,
}

impl Weights {
    /// Weights drawn from `seed`.
    pub fn random(seed: u64, model: Model) -> Weights {
        let mut rng = Rng::new(seed);
        let kinds = model.layers();
        let layers = kinds
            .iter()
            .map(|k| match k {
                LayerKind::Recurrent(_) => LayerWeights::Recurrent {
                    input: Mat::random(&mut rng, RC, D),
                    conv: [
                        (0..RC).map(|_| 0.6 + rng.weight(0.3)).collect(),
                        (0..RC).map(|_| rng.weight(0.5)).collect(),
                    ],
                    decay: (0..RC * RS).map(|_| 0.75 + rng.weight(0.2)).collect(),
                    gain: (0..RC * RS).map(|_| rng.weight(0.5)).collect(),
                    readout: (0..RC * RS).map(|_| rng.weight(0.6)).collect(),
                    out: Mat::random(&mut rng, D, RC),
                },
                _ => LayerWeights::Attention {
                    q: Mat::random(&mut rng, KV, D),
                    k: Mat::random(&mut rng, KV, D),
                    v: Mat::random(&mut rng, KV, D),
                    o: Mat::random(&mut rng, D, KV),
                },
            })
            .collect();
        Weights {
            kinds,
            embed: Mat::random(&mut rng, VOCAB, D),
            layers,
            unembed: Mat::random(&mut rng, VOCAB, D),
        }
    }
}

/// Where an attention layer keeps K/V: the forward writes a token's rows once and reads
/// any earlier (or its own) position's rows back.
pub trait KvStore {
    /// Writes the K and V rows of position `pos` (one of the step's new tokens).
    fn write(&mut self, layer: LayerKind, pos: usize, k: &[f32], v: &[f32]);
    /// Reads the K and V rows of position `pos`.
    fn read(&self, layer: LayerKind, pos: usize, k: &mut [f32], v: &mut [f32]);
}

/// The recurrent states of one request: per recurrent layer, conv then temporal floats.
pub type States = Vec<Vec<f32>>;

/// Fresh (zero) states for the model.
pub fn zero_states(w: &Weights) -> States {
    w.kinds
        .iter()
        .filter(|k| matches!(k, LayerKind::Recurrent(_)))
        .map(|_| vec![0.0; RC + RC * RS])
        .collect()
}

/// `out = x / rms(x)` (no gain).
fn rms_norm(x: &[f32], out: &mut [f32]) {
    let mut ss = 0.0f32;
    for v in x {
        ss += v * v;
    }
    let scale = 1.0 / (ss / x.len() as f32 + 1e-5).sqrt();
    for (o, v) in out.iter_mut().zip(x) {
        *o = v * scale;
    }
}

/// Runs `tokens` (at positions `first_pos..`) through the model, token by token: every
/// layer writes the token's K/V and attends causally (SWA over the last `WINDOW`
/// positions), the recurrent layers update `states` in place. After each token,
/// `after(len, states)` is called with the row length reached (for checkpoints).
/// Returns the logits after the last token.
pub fn forward(
    w: &Weights,
    store: &mut impl KvStore,
    states: &mut States,
    tokens: &[TokenId],
    first_pos: usize,
    mut after: impl FnMut(usize, &States),
) -> Vec<f32> {
    let mut x = [0.0f32; D];
    let mut h = [0.0f32; D];
    let (mut q, mut k, mut v) = ([0.0f32; KV], [0.0f32; KV], [0.0f32; KV]);
    let (mut kj, mut vj) = ([0.0f32; KV], [0.0f32; KV]);
    let mut att = [0.0f32; KV];
    let mut delta = [0.0f32; D];
    let mut scores: Vec<f32> = Vec::new();
    let mut values: Vec<f32> = Vec::new();
    let scale = 1.0 / (HD as f32).sqrt();
    for (i, &tok) in tokens.iter().enumerate() {
        let pos = first_pos + i;
        let e = &w.embed.w[tok.0 as usize % VOCAB * D..][..D];
        for (d, xd) in x.iter_mut().enumerate() {
            let freq = 1.0 / 10_000f32.powf((d / 2 * 2) as f32 / D as f32);
            let angle = pos as f32 * freq;
            *xd = e[d] + 0.5 * if d % 2 == 0 { angle.sin() } else { angle.cos() };
        }
        for (kind, lw) in w.kinds.iter().zip(&w.layers) {
            rms_norm(&x, &mut h);
            match (kind, lw) {
                (
                    LayerKind::Full(_) | LayerKind::Swa(_),
                    LayerWeights::Attention {
                        q: wq,
                        k: wk,
                        v: wv,
                        o: wo,
                    },
                ) => {
                    wq.apply(&h, &mut q);
                    wk.apply(&h, &mut k);
                    wv.apply(&h, &mut v);
                    store.write(*kind, pos, &k, &v);
                    let lo = match kind {
                        LayerKind::Swa(_) => (pos + 1).saturating_sub(WINDOW),
                        _ => 0,
                    };
                    // One read of each key position's rows; scores per head, then the
                    // softmax-weighted sum of the values, both in position order. Index
                    // loops rather than iterator chains: the tests run this in debug
                    // builds, where each adaptor call costs more than the arithmetic.
                    scores.clear();
                    values.clear();
                    for j in lo..=pos {
                        store.read(*kind, j, &mut kj, &mut vj);
                        for head in 0..HEADS {
                            let mut s = 0.0f32;
                            for d in head * HD..(head + 1) * HD {
                                s += q[d] * kj[d];
                            }
                            scores.push(s * scale);
                        }
                        values.extend_from_slice(&vj);
                    }
                    let keys = pos + 1 - lo;
                    for head in 0..HEADS {
                        let mut max = f32::NEG_INFINITY;
                        for j in 0..keys {
                            max = max.max(scores[j * HEADS + head]);
                        }
                        let mut denom = 0.0f32;
                        let r = head * HD..(head + 1) * HD;
                        att[r.clone()].fill(0.0);
                        for j in 0..keys {
                            let e = (scores[j * HEADS + head] - max).exp();
                            denom += e;
                            let vj = &values[j * KV..(j + 1) * KV];
                            for d in r.clone() {
                                att[d] += e * vj[d];
                            }
                        }
                        for d in r {
                            att[d] /= denom;
                        }
                    }
                    wo.apply(&att, &mut delta);
                }
                (
                    LayerKind::Recurrent(r),
                    LayerWeights::Recurrent {
                        input,
                        conv,
                        decay,
                        gain,
                        readout,
                        out,
                    },
                ) => {
                    let state = &mut states[*r as usize];
                    let (prev, temporal) = state.split_at_mut(RC);
                    let mut u = [0.0f32; RC];
                    input.apply(&h, &mut u);
                    let mut y = [0.0f32; RC];
                    for c in 0..RC {
                        let conv_out = (conv[0][c] * u[c] + conv[1][c] * prev[c]).tanh();
                        prev[c] = u[c];
                        let mut acc = 0.0f32;
                        for s in 0..RS {
                            let e = c * RS + s;
                            temporal[e] = decay[e] * temporal[e] + gain[e] * conv_out;
                            acc += readout[e] * temporal[e];
                        }
                        y[c] = acc;
                    }
                    out.apply(&y, &mut delta);
                }
                _ => unreachable!("the weights follow the layer kinds"),
            }
            for (xd, dd) in x.iter_mut().zip(&delta) {
                *xd += dd;
            }
        }
        after(pos + 1, states);
    }
    rms_norm(&x, &mut h);
    let mut logits = vec![0.0f32; VOCAB];
    w.unembed.apply(&h, &mut logits);
    logits
}

/// Greedy sampling: the first index of the largest logit.
pub fn argmax(logits: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    TokenId(best as u32)
}

// ----- the reference: contiguous K/V, one request at a time ----------------------------------

/// Plain contiguous K/V per attention layer of one request.
#[derive(Default)]
struct ContiguousKv {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl ContiguousKv {
    /// The vector of an attention layer: FULL layers first, then SWA.
    fn slot(layer: LayerKind) -> usize {
        match layer {
            LayerKind::Full(i) => i as usize,
            LayerKind::Swa(i) => 2 + i as usize,
            LayerKind::Recurrent(_) => unreachable!("no K/V"),
        }
    }
}

impl KvStore for ContiguousKv {
    fn write(&mut self, layer: LayerKind, pos: usize, k: &[f32], v: &[f32]) {
        let s = Self::slot(layer);
        if self.k.len() <= s {
            self.k.resize(s + 1, Vec::new());
            self.v.resize(s + 1, Vec::new());
        }
        assert_eq!(self.k[s].len(), pos * KV, "the reference writes in order");
        self.k[s].extend_from_slice(k);
        self.v[s].extend_from_slice(v);
    }

    fn read(&self, layer: LayerKind, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let s = Self::slot(layer);
        k.copy_from_slice(&self.k[s][pos * KV..(pos + 1) * KV]);
        v.copy_from_slice(&self.v[s][pos * KV..(pos + 1) * KV]);
    }
}

/// What a request produced: its generated tokens and the logits that chose the last one.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    /// Generated tokens.
    pub tokens: Vec<TokenId>,
    /// The logits of the last step (empty before the first token).
    pub logits: Vec<f32>,
}

/// The reference: `prompt` prefilled in one pass, then `max_new` greedy tokens, K/V in
/// contiguous vectors. Returns the output and the tokens it computed.
pub fn reference(w: &Weights, prompt: &[TokenId], max_new: usize) -> Output {
    let mut kv = ContiguousKv::default();
    let mut states = zero_states(w);
    let mut logits = forward(w, &mut kv, &mut states, prompt, 0, |_, _| {});
    let mut out = Output::default();
    let mut pos = prompt.len();
    loop {
        let next = argmax(&logits);
        out.tokens.push(next);
        if out.tokens.len() == max_new {
            out.logits = logits;
            return out;
        }
        logits = forward(w, &mut kv, &mut states, &[next], pos, |_, _| {});
        pos += 1;
    }
}

/// The recurrent states a contiguous forward of `prefix` from the initial state reaches:
/// what a request resuming after `prefix` must start from. Layers above the last
/// recurrent one cannot change a state, so the forward stops there (half the attention
/// of a debug-build test).
pub fn reference_state(w: &Weights, prefix: &[TokenId]) -> States {
    let below = w
        .kinds
        .iter()
        .rposition(|k| matches!(k, LayerKind::Recurrent(_)))
        .map_or(0, |last| last + 1);
    let w = Weights {
        kinds: w.kinds[..below].to_vec(),
        layers: w.layers[..below].to_vec(),
        ..w.clone()
    };
    let mut kv = ContiguousKv::default();
    let mut states = zero_states(&w);
    forward(&w, &mut kv, &mut states, prefix, 0, |_, _| {});
    states
}

// ----- the unikv engine -------------------------------------------------------------------

/// Hooks that count the spans every `move_spans` moves (compaction, and the state copy
/// of an admission with a cached state), around the engine's [`CpuDevice`].
#[derive(Debug, Default)]
pub struct SpansMoved(AtomicU64);

impl SpansMoved {
    /// Spans moved so far.
    fn moved(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl DeviceHooks for SpansMoved {
    type Ticket = ();

    fn name(&self, inner: String) -> String {
        format!("counting({inner})")
    }

    fn before<D: Device + ?Sized>(&self, _: &D, _: DeviceCall<'_>) -> Result<(), DeviceError> {
        Ok(())
    }

    fn after<D: Device + ?Sized>(
        &self,
        _: &D,
        call: DeviceCall<'_>,
        _: (),
        outcome: Result<(), &DeviceError>,
    ) {
        if call.op == DeviceOp::MoveSpans && outcome.is_ok() {
            self.0.fetch_add(call.items as u64, Ordering::Relaxed);
        }
    }
}

/// The K/V of one request's step, in unikv's buffer: writes go to the step's write
/// locations, reads through its kernel ids.
struct BufferKv<'a> {
    bytes: &'a mut [u8],
    geo: KvGeometry,
    step: RequestStep<'a>,
}

/// Reads `out.len()` little-endian `f32`s at byte `offset`.
fn read_f32s(bytes: &[u8], offset: u64, out: &mut [f32]) {
    let b = &bytes[offset as usize..offset as usize + 4 * out.len()];
    for i in 0..out.len() {
        out[i] = f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    }
}

/// Writes `values` as little-endian `f32`s at byte `offset`.
fn write_f32s(bytes: &mut [u8], offset: u64, values: &[f32]) {
    let b = &mut bytes[offset as usize..offset as usize + 4 * values.len()];
    for (c, v) in b.chunks_exact_mut(4).zip(values) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

impl BufferKv<'_> {
    /// The pool side and layer index of an attention layer.
    fn side(layer: LayerKind) -> (Side, u32) {
        match layer {
            LayerKind::Full(i) => (Side::Full, i),
            LayerKind::Swa(i) => (Side::Swa, i),
            LayerKind::Recurrent(_) => unreachable!("no K/V"),
        }
    }

    /// The kernel id of row `pos` on `side` (SWA rows only inside the step's window).
    fn id(&self, side: Side, pos: usize) -> i32 {
        match side {
            Side::Full => self.step.full[pos],
            _ => self.step.swa_id(pos).unwrap_or_else(|| {
                panic!(
                    "position {pos} is outside the SWA metadata [{}, {})",
                    self.step.swa_first, self.step.len
                )
            }),
        }
    }
}

impl KvStore for BufferKv<'_> {
    fn write(&mut self, layer: LayerKind, pos: usize, k: &[f32], v: &[f32]) {
        let (side, l) = Self::side(layer);
        let i = pos - self.step.first_query();
        let id = match side {
            Side::Full => self.step.write_full[i],
            _ => self.step.write_swa[i],
        };
        write_f32s(self.bytes, self.geo.row_offset(side, id, l, false), k);
        write_f32s(self.bytes, self.geo.row_offset(side, id, l, true), v);
    }

    fn read(&self, layer: LayerKind, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let (side, l) = Self::side(layer);
        let id = self.id(side, pos);
        read_f32s(self.bytes, self.geo.row_offset(side, id, l, false), k);
        read_f32s(self.bytes, self.geo.row_offset(side, id, l, true), v);
    }
}

/// Reads every recurrent layer's conv and temporal state from physical slot `slot`.
fn load_states(
    bytes: &[u8],
    geo: &KvGeometry,
    layout: &SlotLayout,
    slot: u32,
    states: &mut States,
) {
    let base = geo.slot_offset(slot);
    for (l, s) in states.iter_mut().enumerate() {
        let (conv, temporal) = s.split_at_mut(RC);
        read_f32s(bytes, base + layout.conv(l as u32).unwrap().start, conv);
        read_f32s(
            bytes,
            base + layout.temporal(l as u32).unwrap().start,
            temporal,
        );
    }
}

/// Writes every recurrent layer's conv and temporal state into physical slot `slot`.
fn store_states(
    bytes: &mut [u8],
    geo: &KvGeometry,
    layout: &SlotLayout,
    slot: u32,
    states: &States,
) {
    let base = geo.slot_offset(slot);
    for (l, s) in states.iter().enumerate() {
        let (conv, temporal) = s.split_at(RC);
        write_f32s(bytes, base + layout.conv(l as u32).unwrap().start, conv);
        write_f32s(
            bytes,
            base + layout.temporal(l as u32).unwrap().start,
            temporal,
        );
    }
}

/// One request of the workload.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt tokens (a follow-up turn's are set when it arrives).
    pub prompt: Vec<TokenId>,
    /// Tokens to generate.
    pub max_new: usize,
    /// When it enters the queue.
    pub arrival: Arrival,
    /// What it generated (all of it, or up to its abort).
    pub output: Output,
    /// Whether it was aborted (a follow-up of an aborted turn never arrives and counts as
    /// aborted, with nothing generated).
    pub aborted: bool,
    /// Tokens reused from the prefix cache at its last admission (for a recurrent model,
    /// where the state it resumed from ends).
    pub reused: usize,
}

impl Job {
    /// A job not yet run.
    fn new(prompt: Vec<TokenId>, max_new: usize, arrival: Arrival) -> Job {
        Job {
            prompt,
            max_new,
            arrival,
            output: Output::default(),
            aborted: false,
            reused: 0,
        }
    }

    /// Whether it generated all its tokens.
    pub fn finished(&self) -> bool {
        !self.aborted && self.output.tokens.len() == self.max_new
    }
}

/// When a job enters the admission queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// At the start of the run.
    Start,
    /// Once job `of` has generated `tokens` tokens: it arrives while `of` still decodes
    /// when `tokens` is below `of`'s `max_new`.
    Decoded {
        /// The job it waits for.
        of: usize,
        /// Tokens that job has generated.
        tokens: usize,
    },
    /// Once job `of` finished: the next turn of its conversation, whose prompt is `of`'s
    /// prompt, then its output, then `text`.
    FollowUp {
        /// The previous turn.
        of: usize,
        /// The new user text.
        text: Vec<TokenId>,
    },
}

/// Whether the engine reuses cached prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// Every prefill chunk and every finished request enters the prefix cache, and
    /// admission resumes from the deepest cached state (FULL/SWA KV with it).
    On,
    /// Nothing enters the prefix cache (requests are released, never cached), so no
    /// admission hits and every token is computed from scratch.
    Off,
}

impl Reuse {
    /// `on` or `off`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reuse::On => "on",
            Reuse::Off => "off",
        }
    }
}

/// What the engine serves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Workload {
    /// Randomized: a few system prompts with a unique question each, follow-up turns
    /// drawn at random, aborts, and a budget small enough for eviction, compaction and
    /// retraction.
    Mixed {
        /// Requests arriving (follow-up turns come on top).
        requests: usize,
        /// Most tokens a request generates.
        max_new: usize,
        /// The chance per step that a running request is aborted.
        abort_chance: f64,
    },
    /// Five requests sharing a prefix of one and a half checkpoint grids (plus a few
    /// tokens, so it ends off every page and grid point), then diverging: two arrive
    /// together (neither hits), the others while an earlier one still decodes; the fourth
    /// extends the third's prompt, so it resumes from a state the third saved.
    SharedPrefix,
    /// Two conversations of three turns sharing a system prompt: each next turn's prompt
    /// is the previous turn's prompt, its output and new text; the second conversation
    /// starts while the first one's first turn decodes.
    MultiTurn,
}

impl Workload {
    /// A short label for tables.
    pub const fn as_str(&self) -> &'static str {
        match self {
            Workload::Mixed { .. } => "mixed",
            Workload::SharedPrefix => "shared-prefix",
            Workload::MultiTurn => "multi-turn",
        }
    }
}

/// A deliberate engine bug, so a test can show that the checks catch a wrong reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// No bug.
    None,
    /// Flips one bit of the state a request resumes from (in its slot, before the first
    /// step reads it): a wrong state copy.
    FlipResumedState,
    /// Never writes the checkpoints the step metadata lists: the cache then holds stale
    /// slot bytes where it believes a state is.
    SkipCheckpointWrites,
}

/// The shape of a serving run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Seed of the workload and the scheduler's choices.
    pub seed: u64,
    /// Tokens per page.
    pub page_size: u32,
    /// Static or unified.
    pub layout: Layout,
    /// The model served.
    pub model: Model,
    /// What is served.
    pub workload: Workload,
    /// Whether cached prefixes are reused.
    pub reuse: Reuse,
    /// Room for this many tokens of FULL and SWA KV (the budget).
    pub budget_tokens: u64,
    /// Most requests running at once.
    pub max_running: usize,
    /// Most prefill tokens per step.
    pub prefill_budget: usize,
    /// A deliberate bug ([`Fault::None`] for a real run).
    pub fault: Fault,
}

impl RunConfig {
    /// A run of a scripted reuse workload ([`Workload::SharedPrefix`] or
    /// [`Workload::MultiTurn`]) at page size `page_size`: room for every request's KV
    /// and states at once, so nothing a later request could hit is evicted; prefill in
    /// chunks of up to two grid intervals.
    pub fn scripted(
        page_size: u32,
        layout: Layout,
        model: Model,
        workload: Workload,
        reuse: Reuse,
    ) -> RunConfig {
        let grid = checkpoint_grid(page_size) as usize;
        RunConfig {
            seed: 11,
            page_size,
            layout,
            model,
            workload,
            reuse,
            budget_tokens: 32 * grid as u64,
            max_running: 4,
            prefill_budget: 2 * grid,
            fault: Fault::None,
        }
    }
}

/// The checkpoint grid the engine asks for at page size `ps`: two pages, at least 16
/// tokens, at most 256 tokens and at least a page. At page sizes 1 and 16 a grid point
/// is not on every page, so a prompt's last whole page and its branching point are
/// states of their own; at 256 the grid is the page, which keeps the prompts (and the
/// debug-build test) short.
pub fn checkpoint_grid(ps: u32) -> u32 {
    (2 * ps).clamp(16, 256).max(ps)
}

/// What a serving run went through.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Scheduler steps.
    pub steps: u64,
    /// Tokens the forwards computed (recomputation after a retraction included).
    pub computed_tokens: u64,
    /// Prompt tokens of every admission (a re-admitted request's generated tokens
    /// count as prompt).
    pub prompt_tokens: u64,
    /// Prompt tokens the prefill chunks computed: the prompt tokens less the reused ones
    /// (and what a retraction threw away).
    pub prefill_tokens: u64,
    /// Wall time of the forwards and the cache calls (not of the resumed-state checks).
    pub elapsed: Duration,
    /// Page envelopes moved by compaction.
    pub compaction_moves: u64,
    /// Admissions with a prefix hit (for a recurrent model: a resumed state).
    pub prefix_hits: u64,
    /// Tokens reused from the prefix cache (`Request::cached_at_admission`).
    pub hit_tokens: u64,
    /// Tokens whose FULL KV the cache held at admission (`Request::kv_hit_at_admission`);
    /// beyond `hit_tokens` they were recomputed, for want of a state there.
    pub kv_hit_tokens: u64,
    /// Resumed states compared with a contiguous recompute of their prefix.
    pub resumes_checked: u64,
    /// Requests retracted after resuming from a state but before their first step read
    /// it (nothing to check; they are admitted again).
    pub resumes_retracted: u64,
    /// The first resumed state that differed from the recompute.
    pub state_mismatch: Option<String>,
    /// Window releases (a request's cursor moved up).
    pub window_releases: u64,
    /// Nodes evicted from the prefix cache.
    pub evictions: u64,
    /// Requests retracted for memory and admitted again.
    pub retractions: u64,
    /// Requests aborted.
    pub aborts: u64,
    /// `cache_unfinished` calls.
    pub cached_unfinished: u64,
}

impl RunStats {
    /// The number of resumed states checked, or the first that differed, bit for bit,
    /// from the state a contiguous recompute of its prefix reaches.
    pub fn resumed_states(&self) -> Result<u64, String> {
        match &self.state_mismatch {
            Some(diff) => Err(diff.clone()),
            None => Ok(self.resumes_checked),
        }
    }
}

/// A job admitted to the cache, with its request.
struct Running {
    job: usize,
    req: Request,
    /// The next token to append (sampled, not yet computed).
    pending: Option<TokenId>,
    /// It prefilled a chunk this step (cached unfinished after the step, with reuse on).
    chunked: bool,
    /// Resumed from a cached state after this many tokens, not yet checked: its first
    /// step compares the state it reads with a recompute.
    resumed_at: Option<usize>,
}

/// `n` random tokens.
fn random_tokens(rng: &mut Rng, n: usize) -> Vec<TokenId> {
    (0..n).map(|_| TokenId(rng.below(VOCAB) as u32)).collect()
}

/// The jobs of `cfg`'s workload.
fn workload(cfg: &RunConfig, rng: &mut Rng) -> Vec<Job> {
    let grid = checkpoint_grid(cfg.page_size) as usize;
    match cfg.workload {
        Workload::Mixed {
            requests, max_new, ..
        } => mixed(cfg.page_size, requests, max_new, rng),
        Workload::SharedPrefix => shared_prefix(grid, rng),
        Workload::MultiTurn => multi_turn(grid, rng),
    }
}

/// The tokens a scripted job generates: half a grid interval, at most 16.
fn scripted_max_new(grid: usize) -> usize {
    (grid / 2).min(16)
}

/// [`Workload::SharedPrefix`] for checkpoint grid `grid`.
fn shared_prefix(grid: usize, rng: &mut Rng) -> Vec<Job> {
    let shared = random_tokens(rng, grid + grid / 2 + 3);
    let max_new = scripted_max_new(grid);
    let own = |rng: &mut Rng| {
        let n = rng.range(grid / 4, grid / 2);
        random_tokens(rng, n)
    };
    let branch = [shared.clone(), own(rng)].concat();
    vec![
        Job::new([&shared[..], &own(rng)].concat(), max_new, Arrival::Start),
        Job::new([&shared[..], &own(rng)].concat(), max_new, Arrival::Start),
        Job::new(
            branch.clone(),
            max_new,
            Arrival::Decoded { of: 0, tokens: 1 },
        ),
        Job::new(
            [branch, own(rng)].concat(),
            max_new,
            Arrival::Decoded { of: 2, tokens: 1 },
        ),
        Job::new(
            [&shared[..], &own(rng)].concat(),
            max_new,
            Arrival::Decoded {
                of: 0,
                tokens: max_new / 2,
            },
        ),
    ]
}

/// [`Workload::MultiTurn`] for checkpoint grid `grid`: job `2t + c` is turn `t` of
/// conversation `c`.
fn multi_turn(grid: usize, rng: &mut Rng) -> Vec<Job> {
    /// Conversations.
    const CONVERSATIONS: usize = 2;
    /// Turns of each.
    const TURNS: usize = 3;
    let system = random_tokens(rng, grid + 5);
    let max_new = scripted_max_new(grid);
    let mut jobs = Vec::new();
    for turn in 0..TURNS {
        for c in 0..CONVERSATIONS {
            let own = rng.range(grid / 4, grid / 2);
            let text = random_tokens(rng, own);
            let job = if turn == 0 {
                let arrival = if c == 0 {
                    Arrival::Start
                } else {
                    Arrival::Decoded { of: 0, tokens: 1 }
                };
                Job::new([system.clone(), text].concat(), max_new, arrival)
            } else {
                let of = (turn - 1) * CONVERSATIONS + c;
                Job::new(Vec::new(), max_new, Arrival::FollowUp { of, text })
            };
            jobs.push(job);
        }
    }
    jobs
}

/// The randomized workload ([`Workload::Mixed`]): a few system prompts, a unique
/// question each; follow-up turns come while serving. Lengths scale with the page size
/// so that hits (which end on whole pages and, with the recurrent layer, on checkpoints)
/// and window releases happen at every page size.
fn mixed(page_size: u32, requests: usize, max_new: usize, rng: &mut Rng) -> Vec<Job> {
    let unit = (page_size as usize).max(16);
    let systems: Vec<Vec<TokenId>> = (0..3)
        .map(|_| random_tokens(rng, unit + unit / 4))
        .collect();
    (0..requests)
        .map(|_| {
            let mut prompt = systems[rng.below(systems.len())].clone();
            let q = rng.range(1, unit / 2);
            prompt.extend(random_tokens(rng, q));
            Job::new(prompt, rng.range(1, max_new), Arrival::Start)
        })
        .collect()
}

/// Moves every waiting job whose arrival came to the back of the queue, in job order.
/// A follow-up turn gets its prompt here; one of an aborted turn is aborted.
fn arrive(jobs: &mut [Job], waiting: &mut Vec<usize>, queue: &mut VecDeque<usize>) {
    waiting.retain(|&j| {
        let arrived = match &jobs[j].arrival {
            Arrival::Start => true,
            Arrival::Decoded { of, tokens } => {
                jobs[*of].output.tokens.len() >= *tokens || jobs[*of].aborted
            }
            Arrival::FollowUp { of, .. } => jobs[*of].finished() || jobs[*of].aborted,
        };
        if !arrived {
            return true;
        }
        if let Arrival::FollowUp { of, text } = &jobs[j].arrival {
            let before = &jobs[*of];
            if before.aborted {
                jobs[j].aborted = true;
                return false;
            }
            let prompt = [&before.prompt[..], &before.output.tokens, text].concat();
            jobs[j].prompt = prompt;
        }
        queue.push_back(j);
        false
    });
}

/// The budget in bytes for `tokens` tokens of FULL and SWA KV, state slots on top.
fn memory_bytes(cfg: &RunConfig, spec: &ModelSpec) -> u64 {
    let per_token = spec.full_bytes_per_token() + spec.swa_bytes_per_token();
    let kv = cfg.budget_tokens * per_token;
    let slots = if spec.has_recurrent_state() {
        3 * cfg.max_running as u64 * spec.slot_pool().unwrap().bytes_per_slot * 2
    } else {
        0
    };
    match cfg.layout {
        // The static layout keeps ~0.9 of the KV bytes again for its slot pool.
        Layout::Static { .. } if spec.has_recurrent_state() => kv * 2 + slots,
        _ => kv + slots,
    }
}

/// Compares a resumed state with the state a contiguous recompute of `prefix` reaches,
/// bit for bit.
fn check_resumed_state(w: &Weights, prefix: &[TokenId], resumed: &States) -> Result<(), String> {
    let want = reference_state(w, prefix);
    let bits = |s: &States| {
        s.iter()
            .flatten()
            .map(|x| x.to_bits())
            .collect::<Vec<u32>>()
    };
    let (got, want) = (bits(resumed), bits(&want));
    match got.iter().zip(&want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "the state resumed after {} tokens differs from the recompute at float {i}: \
             {:#010x} vs {:#010x}",
            prefix.len(),
            got[i],
            want[i]
        )),
    }
}

/// Serves the workload through unikv. Returns every job (with follow-ups) as it ran and
/// the run's counts.
pub fn serve(cfg: &RunConfig) -> Result<(Vec<Job>, RunStats), Error> {
    let mut rng = Rng::new(cfg.seed);
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.model);
    let spec = cfg.model.spec();
    let cpu = Arc::new(CpuDevice::new());
    let device = Arc::new(Intercepted::with_hooks(cpu.clone(), SpansMoved::default()));
    let ps = cfg.page_size as usize;
    let mut builder = HybridCache::builder()
        .model(spec)
        .page_size(cfg.page_size)
        .memory_bytes(memory_bytes(cfg, &spec))
        .layout(cfg.layout)
        .device(device.clone());
    if cfg.model.is_recurrent() {
        builder = builder.checkpoint_interval(checkpoint_grid(cfg.page_size));
    }
    let mut cache = builder.build()?;
    let slot_layout = MambaSpec::new(spec.mamba_layers, spec.recurrent)
        .slot_layout()
        .ok();
    let geo = cache.kv_geometry();
    let buffer = cache.allocator().buffer();

    let mut jobs = workload(cfg, &mut rng);
    let mut waiting: Vec<usize> = (0..jobs.len()).collect();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut running: Vec<Running> = Vec::new();
    let mut stats = RunStats::default();
    let mut meta = StepMetadata::new();
    let mut state_copies = 0u64;
    let unit = ps.max(16);
    let max_conversation = (cfg.budget_tokens as usize / 3).max(unit);
    let (max_new, abort_chance) = match cfg.workload {
        Workload::Mixed {
            max_new,
            abort_chance,
            ..
        } => (max_new, abort_chance),
        _ => (0, 0.0),
    };
    let mixed = matches!(cfg.workload, Workload::Mixed { .. });
    let started = Instant::now();
    // Time spent recomputing resumed states to check them (not serving).
    let mut verifying = Duration::ZERO;

    while !(queue.is_empty() && running.is_empty() && waiting.is_empty()) {
        arrive(&mut jobs, &mut waiting, &mut queue);
        // Admission.
        while running.len() < cfg.max_running {
            let Some(&j) = queue.front() else { break };
            let job = &jobs[j];
            let mut prompt = job.prompt.clone();
            prompt.extend_from_slice(&job.output.tokens);
            let hit: PrefixMatch = cache.match_prefix(prompt);
            if mixed && rng.chance(0.03) && job.output.tokens.is_empty() {
                // Abort before admission: dropping the match undoes nothing.
                drop(hit);
                queue.pop_front();
                jobs[j].aborted = true;
                stats.aborts += 1;
                continue;
            }
            if !cache.can_admit(&hit, 1) {
                break;
            }
            let req = match cache.admit(hit) {
                Ok(r) => r,
                Err(Error::OutOfMemory { .. }) => break,
                Err(e) => return Err(e),
            };
            queue.pop_front();
            let cached = req.cached_at_admission();
            jobs[j].reused = cached;
            if cfg.reuse == Reuse::Off {
                assert_eq!(
                    req.kv_hit_at_admission(),
                    0,
                    "with reuse off nothing is cached, so nothing is hit"
                );
            }
            stats.prompt_tokens += req.tokens().len() as u64;
            stats.kv_hit_tokens += req.kv_hit_at_admission() as u64;
            if cached > 0 {
                stats.prefix_hits += 1;
                stats.hit_tokens += cached as u64;
                if cfg.model.is_recurrent() {
                    state_copies += 1;
                }
            }
            running.push(Running {
                job: j,
                req,
                pending: None,
                chunked: false,
                resumed_at: (cached > 0 && cfg.model.is_recurrent()).then_some(cached),
            });
        }
        if running.is_empty() {
            assert!(
                queue.is_empty(),
                "the budget cannot admit request {:?}",
                queue.front()
            );
            panic!("jobs {waiting:?} wait for jobs that will never run");
        }

        // Allocation: prefill chunks under the step's token budget, then one decode batch.
        // A shortfall retracts the newest request (it is admitted again later).
        let mut step: Vec<(usize, usize)> = Vec::new(); // (running index, new tokens)
        let mut budget = cfg.prefill_budget;
        let mut i = 0;
        while i < running.len() {
            let r = &mut running[i];
            let remaining = r.req.remaining_prefill();
            if remaining == 0 || budget == 0 {
                i += 1;
                continue;
            }
            let n = remaining.min(budget).min(rng.range(1, unit * 2));
            let cursor = r.req.window_cursor();
            match cache.alloc_extend(&mut r.req, n) {
                Ok(()) => {
                    stats.window_releases += u64::from(r.req.window_cursor() > cursor);
                    stats.prefill_tokens += n as u64;
                    r.chunked = true;
                    budget -= n;
                    step.push((i, n));
                    i += 1;
                }
                Err(Error::OutOfMemory { .. }) => {
                    // The newest goes: `i` itself (then `i` names the next request) or a
                    // newer one (then `i` is tried again).
                    retract(&mut cache, &mut running, &mut step, &mut queue, &mut stats)?;
                }
                Err(e) => return Err(e),
            }
        }
        loop {
            let decoders: Vec<usize> = (0..running.len())
                .filter(|&i| {
                    running[i].pending.is_some() && running[i].req.remaining_prefill() == 0
                })
                .filter(|i| !step.iter().any(|&(j, _)| j == *i))
                .collect();
            if decoders.is_empty() {
                break;
            }
            let cursors: Vec<usize> = decoders
                .iter()
                .map(|&i| running[i].req.window_cursor())
                .collect();
            let next: Vec<TokenId> = decoders
                .iter()
                .map(|&i| running[i].pending.unwrap())
                .collect();
            let result = {
                let mut batch: Vec<&mut Request> = running
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| decoders.contains(i))
                    .map(|(_, r)| &mut r.req)
                    .collect();
                cache.alloc_decode(&mut batch, &next)
            };
            match result {
                Ok(()) => {
                    for (k, &i) in decoders.iter().enumerate() {
                        running[i].pending = None;
                        stats.window_releases +=
                            u64::from(running[i].req.window_cursor() > cursors[k]);
                        step.push((i, 1));
                    }
                    break;
                }
                Err(Error::OutOfMemory { .. }) => {
                    retract(&mut cache, &mut running, &mut step, &mut queue, &mut stats)?;
                }
                Err(e) => return Err(e),
            }
        }
        step.sort_unstable();

        // Metadata, after every allocation of the step; then the forward on the "device".
        let batch: Vec<(&Request, usize)> =
            step.iter().map(|&(i, n)| (&running[i].req, n)).collect();
        cache.build_step_metadata(&mut meta, &batch)?;
        drop(batch);
        let view = cache.step_view(&meta)?;
        let mut logits: Vec<Vec<f32>> = Vec::with_capacity(step.len());
        cpu.run_kernel(buffer, |bytes| {
            for (k, &(i, _)) in step.iter().enumerate() {
                let resumed_at = running[i].resumed_at.take();
                let req = &running[i].req;
                let m = view.request(k);
                let mut states = zero_states(&weights);
                // The state before row 0 is the initial (zero) one; later rows continue
                // from the slot (a cached state copied there at admission, or this
                // request's own last step). A fresh slot's bytes are stale.
                if let (Some(slot), Some(layout), true) =
                    (m.state_slot, &slot_layout, m.first_query() > 0)
                {
                    if resumed_at.is_some() && cfg.fault == Fault::FlipResumedState {
                        let at = geo.slot_offset(slot) + layout.temporal(0).unwrap().start;
                        bytes[at as usize] ^= 1;
                    }
                    load_states(bytes, &geo, layout, slot, &mut states);
                }
                // The first step after a resume reads the cached state: it must be the
                // one a full recompute of the prefix reaches.
                if let Some(at) = resumed_at {
                    stats.resumes_checked += 1;
                    let checking = Instant::now();
                    let checked = if m.first_query() == at {
                        check_resumed_state(&weights, &req.tokens()[..at], &states)
                    } else {
                        Err(format!(
                            "resumed after {at} tokens, but its first step starts at {}",
                            m.first_query()
                        ))
                    };
                    verifying += checking.elapsed();
                    if let Err(diff) = checked
                        && stats.state_mismatch.is_none()
                    {
                        stats.state_mismatch = Some(format!("request {}: {diff}", req.id()));
                    }
                }
                let tokens = &req.tokens()[m.first_query()..m.len];
                let mut saved: Vec<(u32, States)> = Vec::new();
                let mut kv = BufferKv {
                    bytes: &mut *bytes,
                    geo,
                    step: m,
                };
                // Every checkpoint the step metadata lists for this request (a list: the
                // branching point, the prompt's last whole page, grid points) gets the
                // state after its row length.
                let l = forward(
                    &weights,
                    &mut kv,
                    &mut states,
                    tokens,
                    m.first_query(),
                    |len, s| {
                        for c in m.checkpoints.iter().filter(|c| c.at_len == len) {
                            saved.push((c.slot, s.clone()));
                        }
                    },
                );
                assert_eq!(
                    saved.len(),
                    m.checkpoints.len(),
                    "every listed checkpoint lies inside the step's new tokens"
                );
                if let (Some(slot), Some(layout)) = (m.state_slot, &slot_layout) {
                    store_states(bytes, &geo, layout, slot, &states);
                    if cfg.fault != Fault::SkipCheckpointWrites {
                        for (slot, s) in &saved {
                            store_states(bytes, &geo, layout, *slot, s);
                        }
                    }
                }
                logits.push(l);
            }
        })?;
        stats.computed_tokens += step.iter().map(|&(_, n)| n as u64).sum::<u64>();

        // Sampling, finishing, aborts, caching.
        let mut finished: Vec<usize> = Vec::new();
        for (k, &(i, _)) in step.iter().enumerate() {
            let r = &mut running[i];
            if r.req.remaining_prefill() > 0 {
                continue;
            }
            let job = &mut jobs[r.job];
            let next = argmax(&logits[k]);
            job.output.tokens.push(next);
            job.output.logits = std::mem::take(&mut logits[k]);
            if job.output.tokens.len() == job.max_new {
                finished.push(i);
            } else {
                r.pending = Some(next);
            }
        }
        finished.sort_unstable();
        for &i in finished.iter().rev() {
            let r = running.remove(i);
            let job = &jobs[r.job];
            let mut prompt = job.prompt.clone();
            prompt.extend_from_slice(&job.output.tokens);
            // A follow-up turn on the whole conversation: a prefix hit on its pages.
            if mixed && rng.chance(0.5) && prompt.len() + unit < max_conversation {
                let question = rng.range(1, unit / 2);
                prompt.extend(random_tokens(&mut rng, question));
                jobs.push(Job::new(prompt, rng.range(1, max_new), Arrival::Start));
                queue.push_back(jobs.len() - 1);
            }
            match cfg.reuse {
                Reuse::On => cache.cache_finished(r.req)?,
                Reuse::Off => drop(cache.release(r.req)?),
            }
        }
        if mixed && !running.is_empty() && rng.chance(abort_chance) {
            let i = rng.below(running.len());
            let r = running.remove(i);
            jobs[r.job].aborted = true;
            stats.aborts += 1;
            cache.release(r.req)?;
        }
        if cfg.reuse == Reuse::On && !mixed {
            // The scripted workloads cache every prefill chunk with the states it saved
            // (a request holds at most `checkpoints_per_step` of them), as SGLang's
            // chunked prefill does, so a request arriving while this one still runs
            // resumes from them.
            for r in running.iter_mut().filter(|r| r.chunked) {
                cache.cache_unfinished(&mut r.req)?;
                stats.cached_unfinished += 1;
            }
        }
        if cfg.reuse == Reuse::On && mixed {
            // The mixed workload caches a decoding request now and then (so a request
            // keeps checkpoints across steps, the cache reuses their slots, and the
            // windows of uncached prompts are released).
            if !running.is_empty() && rng.chance(0.05) {
                let i = rng.below(running.len());
                if running[i].req.remaining_prefill() == 0 {
                    cache.cache_unfinished(&mut running[i].req)?;
                    stats.cached_unfinished += 1;
                }
            }
        }
        for r in &mut running {
            r.chunked = false;
        }
        cache.step_boundary()?;
        stats.steps += 1;
    }
    stats.elapsed = started.elapsed() - verifying;
    stats.compaction_moves = device.hooks().moved().saturating_sub(state_copies);
    let ev = cache.stats().evictions;
    stats.evictions = ev.full_nodes + ev.swa_tombstones + ev.mamba_states;
    Ok((jobs, stats))
}

/// Releases the newest running request for memory and queues it again at the front (its
/// generated tokens become part of its prompt when it is admitted again).
fn retract(
    cache: &mut HybridCache,
    running: &mut Vec<Running>,
    step: &mut Vec<(usize, usize)>,
    queue: &mut VecDeque<usize>,
    stats: &mut RunStats,
) -> Result<(), Error> {
    assert!(
        running.len() > 1,
        "the budget cannot hold one request even with everything else evicted"
    );
    let victim = running.len() - 1;
    let r = running.remove(victim);
    step.retain(|&(j, _)| j != victim);
    for s in step.iter_mut() {
        if s.0 > victim {
            s.0 -= 1;
        }
    }
    stats.retractions += 1;
    stats.resumes_retracted += u64::from(r.resumed_at.is_some());
    queue.push_front(r.job);
    cache.release(r.req)?;
    Ok(())
}

/// The reference outputs of every job, and their tokens per second. A job that never
/// arrived (a follow-up of an aborted turn) has an empty output.
pub fn reference_outputs(cfg: &RunConfig, jobs: &[Job]) -> (Vec<Output>, Duration, u64) {
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.model);
    let started = Instant::now();
    let mut tokens = 0u64;
    let outputs = jobs
        .iter()
        .map(|j| {
            if j.prompt.is_empty() {
                return Output::default();
            }
            tokens += (j.prompt.len() + j.max_new - 1) as u64;
            reference(&weights, &j.prompt, j.max_new)
        })
        .collect();
    (outputs, started.elapsed(), tokens)
}

/// Compares every job with the reference: a finished job's tokens and final logits bit
/// for bit, an aborted one's tokens as a prefix. Returns the first difference.
pub fn compare(jobs: &[Job], reference: &[Output]) -> Result<usize, String> {
    let mut compared = 0;
    for (i, (job, want)) in jobs.iter().zip(reference).enumerate() {
        let got = &job.output;
        if job.aborted {
            if !want.tokens.starts_with(&got.tokens) {
                return Err(format!(
                    "aborted request {i}: generated {:?}, the reference {:?}",
                    got.tokens, want.tokens
                ));
            }
            continue;
        }
        if got.tokens != want.tokens {
            return Err(format!(
                "request {i} (prompt of {} tokens): generated {:?}, the reference {:?}",
                job.prompt.len(),
                got.tokens,
                want.tokens
            ));
        }
        if bits(&got.logits) != bits(&want.logits) {
            return Err(format!(
                "request {i}: final logits differ: {:?} vs the reference {:?}",
                &got.logits[..4.min(got.logits.len())],
                &want.logits[..4.min(want.logits.len())]
            ));
        }
        compared += 1;
    }
    Ok(compared)
}

/// Compares two runs of one workload (reuse on and off, two layouts): the same jobs with
/// the same prompts, each aborted in both or in neither, with identical generated tokens
/// and final logits, bit for bit. Returns the jobs compared or the first difference.
pub fn compare_runs(a: &[Job], b: &[Job]) -> Result<usize, String> {
    if a.len() != b.len() {
        return Err(format!("{} jobs against {}", a.len(), b.len()));
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.prompt != y.prompt {
            return Err(format!(
                "job {i}: prompts of {} and {} tokens differ",
                x.prompt.len(),
                y.prompt.len()
            ));
        }
        if x.aborted != y.aborted {
            return Err(format!("job {i}: aborted in one run only"));
        }
        if x.output.tokens != y.output.tokens {
            return Err(format!(
                "job {i}: generated {:?} against {:?}",
                x.output.tokens, y.output.tokens
            ));
        }
        if bits(&x.output.logits) != bits(&y.output.logits) {
            return Err(format!("job {i}: final logits differ"));
        }
    }
    Ok(a.len())
}

/// Checks one run of a scripted reuse workload against `baseline`, a run of the same
/// workload (reuse off, say) whose outputs equal `reference`: the same jobs with the same
/// prompts and bit-identical outputs, equal to the reference; every state a request
/// resumed from equal, bit for bit, to a contiguous recompute of its prefix; and reuse
/// happened exactly when it is on (on: states resumed, fewer prompt tokens prefilled
/// than admitted; off: not one token hit), so the check cannot pass vacuously. Returns
/// the jobs compared.
pub fn check_reuse(
    cfg: &RunConfig,
    jobs: &[Job],
    stats: &RunStats,
    baseline: &[Job],
    reference: &[Output],
) -> Result<usize, String> {
    let resumed = stats.resumed_states()?;
    compare_runs(baseline, jobs)?;
    let compared = compare(jobs, reference)?;
    match cfg.reuse {
        Reuse::On => {
            if stats.prefix_hits == 0 {
                return Err("reuse on, but no request hit the prefix cache".into());
            }
            if cfg.model.is_recurrent() && resumed + stats.resumes_retracted != stats.prefix_hits {
                return Err(format!(
                    "{} hits but {resumed} resumed states checked ({} retracted first)",
                    stats.prefix_hits, stats.resumes_retracted
                ));
            }
            if stats.prefill_tokens >= stats.prompt_tokens {
                return Err(format!(
                    "reuse on, but {} of {} prompt tokens were prefilled",
                    stats.prefill_tokens, stats.prompt_tokens
                ));
            }
        }
        Reuse::Off => {
            // (A request retracted mid-prefill is admitted again, so its prompt counts
            // twice while only part of it was prefilled the first time.)
            if stats.prefix_hits > 0 || stats.kv_hit_tokens > 0 {
                return Err(format!(
                    "reuse off, but {} hits ({} tokens of KV)",
                    stats.prefix_hits, stats.kv_hit_tokens
                ));
            }
        }
    }
    Ok(compared)
}

/// The bit patterns of `l`.
fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|x| x.to_bits()).collect()
}
