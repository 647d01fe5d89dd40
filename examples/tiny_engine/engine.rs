//! A tiny hybrid decoder served two ways, to prove that unikv loses nothing: an engine
//! that keeps all its K/V and recurrent state in unikv's buffer (writing new K/V at the
//! step metadata's write locations, attending through its kernel ids, keeping the state
//! in the request's slot), and a reference that runs each request alone with plain
//! contiguous K/V. Both share one forward (plain `f32` loops in a fixed order), so a
//! correct cache makes their outputs bit-identical.
//!
//! The serving run is randomized and deterministic: shared system prompts, follow-up
//! turns (prefix hits), chunked prefill, decode batches, window releases, eviction and
//! lazy compaction under a small budget, retraction and re-admission, aborts, and
//! `cache_unfinished`. Plain loops instead of a tensor crate: the model is a few hundred
//! weights, and CI compiles and runs it on 2 cores many times over.
//!
//! Used by `examples/tiny_engine/main.rs` and, through `#[path]`, by
//! `tests/tiny_engine.rs`.

#![allow(dead_code)] // the test and the example use different parts

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use unikv::kernels::{
    ByteSpan, BytesId, CpuDevice, Device, Error as DeviceError, SpanMove, SyncHazards, TableId,
    TableScatter, TableSpans, Translate,
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

/// The layer stack: FULL, SWA, (recurrent), SWA, FULL.
pub fn layers(recurrent: bool) -> Vec<LayerKind> {
    use LayerKind::*;
    if recurrent {
        vec![Full(0), Swa(0), Recurrent(0), Swa(1), Full(1)]
    } else {
        vec![Full(0), Swa(0), Swa(1), Full(1)]
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

/// The cache's view of the model: `f32` rows of `HEADS × HD`.
pub fn model_spec(recurrent: bool) -> ModelSpec {
    ModelSpec {
        name: if recurrent {
            "tiny-engine-tri"
        } else {
            "tiny-engine"
        },
        full_layers: 2,
        swa_layers: 2,
        mamba_layers: u32::from(recurrent),
        full: KvRows::new(HEADS as u32, HD as u32, 4),
        swa: KvRows::new(HEADS as u32, HD as u32, 4),
        recurrent: if recurrent {
            RECURRENT
        } else {
            RecurrentState::NONE
        },
        window: WINDOW as u32,
    }
}

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
    pub fn random(seed: u64, recurrent: bool) -> Weights {
        let mut rng = Rng::new(seed);
        let kinds = layers(recurrent);
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
                    // softmax-weighted sum of the values, both in position order.
                    scores.clear();
                    values.clear();
                    for j in lo..=pos {
                        store.read(*kind, j, &mut kj, &mut vj);
                        for head in 0..HEADS {
                            let r = head * HD..(head + 1) * HD;
                            let mut s = 0.0f32;
                            for (a, b) in q[r.clone()].iter().zip(&kj[r]) {
                                s += a * b;
                            }
                            scores.push(s * scale);
                        }
                        values.extend_from_slice(&vj);
                    }
                    for head in 0..HEADS {
                        let r = head * HD..(head + 1) * HD;
                        let mut max = f32::NEG_INFINITY;
                        for s in scores.iter().skip(head).step_by(HEADS) {
                            max = max.max(*s);
                        }
                        let mut denom = 0.0f32;
                        let out = &mut att[r.clone()];
                        out.fill(0.0);
                        for (s, vj) in scores
                            .iter()
                            .skip(head)
                            .step_by(HEADS)
                            .zip(values.chunks_exact(KV))
                        {
                            let e = (*s - max).exp();
                            denom += e;
                            for (o, vv) in out.iter_mut().zip(&vj[r.clone()]) {
                                *o += e * vv;
                            }
                        }
                        for o in out.iter_mut() {
                            *o /= denom;
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

// ----- the unikv engine -------------------------------------------------------------------

/// A device around a [`CpuDevice`] that counts the spans every `move_spans` moves
/// (compaction, and the state copy of an admission with a cached state).
#[derive(Debug)]
pub struct CountingDevice {
    inner: Arc<CpuDevice>,
    spans_moved: AtomicU64,
}

impl CountingDevice {
    fn moved(&self) -> u64 {
        self.spans_moved.load(Ordering::Relaxed)
    }
}

impl Device for CountingDevice {
    fn name(&self) -> String {
        format!("counting({})", self.inner.name())
    }
    fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, DeviceError> {
        self.inner.alloc_bytes(len, fill)
    }
    fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, DeviceError> {
        self.inner.alloc_table(len, fill)
    }
    fn free_bytes(&self, buf: BytesId) -> Result<(), DeviceError> {
        self.inner.free_bytes(buf)
    }
    fn free_table(&self, table: TableId) -> Result<(), DeviceError> {
        self.inner.free_table(table)
    }
    fn upload_table(
        &self,
        table: TableId,
        offset: usize,
        values: &[i32],
    ) -> Result<(), DeviceError> {
        self.inner.upload_table(table, offset, values)
    }
    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), DeviceError> {
        self.inner.scatter_table(table, entries)
    }
    fn gather_table(
        &self,
        src: TableId,
        indices: TableId,
        n: usize,
        out: TableId,
    ) -> Result<(), DeviceError> {
        self.inner.gather_table(src, indices, n, out)
    }
    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), DeviceError> {
        self.inner.fill_spans(buf, spans, value)
    }
    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), DeviceError> {
        self.inner.move_spans(buf, moves)?;
        self.spans_moved
            .fetch_add(moves.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn translate(&self, args: &Translate) -> Result<(), DeviceError> {
        self.inner.translate(args)
    }
    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), DeviceError> {
        self.inner.scatter_tables(scatters)
    }
    fn translate_many(&self, all: &[Translate]) -> Result<(), DeviceError> {
        self.inner.translate_many(all)
    }
    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), DeviceError> {
        self.inner.copy_table_spans(copies)
    }
    fn sync_hazards(&self) -> SyncHazards {
        self.inner.sync_hazards()
    }
}

/// The K/V of one request's step, in unikv's buffer: writes go to the step's write
/// locations, reads through its kernel ids.
struct BufferKv<'a> {
    bytes: &'a mut [u8],
    geo: KvGeometry,
    step: RequestStep<'a>,
}

fn read_f32s(bytes: &[u8], offset: u64, out: &mut [f32]) {
    let b = &bytes[offset as usize..offset as usize + 4 * out.len()];
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

fn write_f32s(bytes: &mut [u8], offset: u64, values: &[f32]) {
    let b = &mut bytes[offset as usize..offset as usize + 4 * values.len()];
    for (c, v) in b.chunks_exact_mut(4).zip(values) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

impl BufferKv<'_> {
    fn side(layer: LayerKind) -> (Side, u32) {
        match layer {
            LayerKind::Full(i) => (Side::Full, i),
            LayerKind::Swa(i) => (Side::Swa, i),
            LayerKind::Recurrent(_) => unreachable!("no K/V"),
        }
    }

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
    /// Prompt tokens.
    pub prompt: Vec<TokenId>,
    /// Tokens to generate.
    pub max_new: usize,
    /// What it generated (all of it, or up to its abort).
    pub output: Output,
    /// Whether it was aborted.
    pub aborted: bool,
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
    /// With the recurrent layer (the tri-pool) or FULL + SWA only.
    pub recurrent: bool,
    /// Requests arriving (follow-up turns come on top).
    pub requests: usize,
    /// Room for this many tokens of FULL and SWA KV (the budget).
    pub budget_tokens: u64,
    /// Most requests running at once.
    pub max_running: usize,
    /// Most prefill tokens per step.
    pub prefill_budget: usize,
    /// Most tokens a request generates.
    pub max_new: usize,
    /// The chance per step that a running request is aborted.
    pub abort_chance: f64,
}

/// What a serving run went through.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// Scheduler steps.
    pub steps: u64,
    /// Tokens the forwards computed (recomputation after a retraction included).
    pub computed_tokens: u64,
    /// Wall time of the forwards and the cache calls.
    pub elapsed: Duration,
    /// Page envelopes moved by compaction.
    pub compaction_moves: u64,
    /// Admissions with a prefix hit.
    pub prefix_hits: u64,
    /// Tokens served from the prefix cache.
    pub hit_tokens: u64,
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

struct Running {
    job: usize,
    req: Request,
    /// The next token to append (sampled, not yet computed).
    pending: Option<TokenId>,
}

/// The prefix-sharing workload: a few system prompts, a unique question each, some
/// follow-up turns. Lengths scale with the page size so that hits (which end on whole
/// pages and, with the recurrent layer, on checkpoints) and window releases happen at
/// every page size.
fn workload(cfg: &RunConfig, rng: &mut Rng) -> Vec<Job> {
    let unit = (cfg.page_size as usize).max(16);
    let systems: Vec<Vec<TokenId>> = (0..3)
        .map(|_| {
            (0..unit + unit / 4)
                .map(|_| TokenId(rng.below(VOCAB) as u32))
                .collect()
        })
        .collect();
    (0..cfg.requests)
        .map(|_| {
            let mut prompt = systems[rng.below(systems.len())].clone();
            let q = rng.range(1, unit / 2);
            prompt.extend((0..q).map(|_| TokenId(rng.below(VOCAB) as u32)));
            Job {
                prompt,
                max_new: rng.range(1, cfg.max_new),
                output: Output::default(),
                aborted: false,
            }
        })
        .collect()
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

/// Serves the workload through unikv. Returns every job (with follow-ups) as it ran and
/// the run's counts.
pub fn serve(cfg: &RunConfig) -> Result<(Vec<Job>, RunStats), Error> {
    let mut rng = Rng::new(cfg.seed);
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.recurrent);
    let spec = model_spec(cfg.recurrent);
    let cpu = Arc::new(CpuDevice::new());
    let device = Arc::new(CountingDevice {
        inner: cpu.clone(),
        spans_moved: AtomicU64::new(0),
    });
    let ps = cfg.page_size as usize;
    let mut builder = HybridCache::builder()
        .model(spec)
        .page_size(cfg.page_size)
        .memory_bytes(memory_bytes(cfg, &spec))
        .layout(cfg.layout)
        .device(device.clone());
    if cfg.recurrent {
        builder = builder.checkpoint_interval(cfg.page_size.max(16));
    }
    let mut cache = builder.build()?;
    let slot_layout = MambaSpec::new(spec.mamba_layers, spec.recurrent)
        .slot_layout()
        .ok();
    let geo = cache.kv_geometry();
    let buffer = cache.allocator().buffer();

    let mut jobs = workload(cfg, &mut rng);
    let mut queue: VecDeque<usize> = (0..jobs.len()).collect();
    let mut running: Vec<Running> = Vec::new();
    let mut stats = RunStats::default();
    let mut meta = StepMetadata::new();
    let mut state_copies = 0u64;
    let unit = ps.max(16);
    let max_conversation = (cfg.budget_tokens as usize / 3).max(unit);
    let started = Instant::now();

    while !queue.is_empty() || !running.is_empty() {
        // Admission.
        while running.len() < cfg.max_running {
            let Some(&j) = queue.front() else { break };
            let job = &jobs[j];
            let mut prompt = job.prompt.clone();
            prompt.extend_from_slice(&job.output.tokens);
            let hit: PrefixMatch = cache.match_prefix(prompt);
            if rng.chance(0.03) && job.output.tokens.is_empty() {
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
            if req.cached_at_admission() > 0 {
                stats.prefix_hits += 1;
                stats.hit_tokens += req.cached_at_admission() as u64;
                if cfg.recurrent {
                    state_copies += 1;
                }
            }
            running.push(Running {
                job: j,
                req,
                pending: None,
            });
        }
        if running.is_empty() {
            panic!("the budget cannot admit request {:?}", queue.front());
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
                let req = &running[i].req;
                let m = view.request(k);
                let mut states = zero_states(&weights);
                // The state before row 0 is the initial (zero) one; later rows continue
                // from the slot (a cached state copied there at admission, or this
                // request's own last step). A fresh slot's bytes are stale.
                if let (Some(slot), Some(layout), true) =
                    (m.state_slot, &slot_layout, m.first_query() > 0)
                {
                    load_states(bytes, &geo, layout, slot, &mut states);
                }
                let tokens = &req.tokens()[m.first_query()..m.len];
                let mut saved: Vec<(u32, States)> = Vec::new();
                let mut kv = BufferKv {
                    bytes: &mut *bytes,
                    geo,
                    step: m,
                };
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
                if let (Some(slot), Some(layout)) = (m.state_slot, &slot_layout) {
                    store_states(bytes, &geo, layout, slot, &states);
                    for (slot, s) in &saved {
                        store_states(bytes, &geo, layout, *slot, s);
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
            if rng.chance(0.5) && prompt.len() + unit < max_conversation {
                prompt
                    .extend((0..rng.range(1, unit / 2)).map(|_| TokenId(rng.below(VOCAB) as u32)));
                jobs.push(Job {
                    prompt,
                    max_new: rng.range(1, cfg.max_new),
                    output: Output::default(),
                    aborted: false,
                });
                queue.push_back(jobs.len() - 1);
            }
            cache.cache_finished(r.req)?;
        }
        if !running.is_empty() && rng.chance(cfg.abort_chance) {
            let i = rng.below(running.len());
            let r = running.remove(i);
            jobs[r.job].aborted = true;
            stats.aborts += 1;
            cache.release(r.req)?;
        }
        if !running.is_empty() && rng.chance(0.05) {
            let i = rng.below(running.len());
            if running[i].req.remaining_prefill() == 0 {
                cache.cache_unfinished(&mut running[i].req)?;
                stats.cached_unfinished += 1;
            }
        }
        cache.step_boundary()?;
        stats.steps += 1;
    }
    stats.elapsed = started.elapsed();
    stats.compaction_moves = device.moved() - state_copies;
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
    queue.push_front(r.job);
    cache.release(r.req)?;
    Ok(())
}

/// The reference outputs of every job, and their tokens per second.
pub fn reference_outputs(cfg: &RunConfig, jobs: &[Job]) -> (Vec<Output>, Duration, u64) {
    let weights = Weights::random(cfg.seed ^ 0x5eed, cfg.recurrent);
    let started = Instant::now();
    let mut tokens = 0u64;
    let outputs = jobs
        .iter()
        .map(|j| {
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
        let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
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
