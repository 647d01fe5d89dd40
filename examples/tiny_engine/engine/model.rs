//! The tiny hybrid decoder: its layers ([`Model`]), random weights ([`Weights`]) and the
//! one forward both the engine and the reference run (plain `f32` loops in a fixed
//! order, K/V through a [`KvStore`]), so a correct cache makes their outputs
//! bit-identical.

use unikv::{KvRows, ModelSpec, RecurrentState, TokenId};

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
    draft_layers: 0,
};

/// [`Model::Mamba`]'s spec: two FULL and two recurrent layers, no SWA.
const FULL_MAMBA: ModelSpec = ModelSpec {
    name: "tiny-engine-mamba",
    swa_layers: 0,
    mamba_layers: 2,
    swa: KvRows::NONE,
    recurrent: RECURRENT,
    window: 0,
    draft_layers: 0,
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

    /// The draft model of speculative decoding: the target's first layer (full
    /// attention) alone, with the target's embedding and unembedding — a cheaper model
    /// that guesses the target's next tokens, often but not always right. Its K/V is FULL
    /// layer `index` (the draft's rows in the FULL envelope, past the target's layers).
    pub fn draft(&self, index: u32) -> Weights {
        assert!(
            matches!(self.kinds[0], LayerKind::Full(_)),
            "every tiny model starts with full attention"
        );
        Weights {
            kinds: vec![LayerKind::Full(index)],
            layers: vec![self.layers[0].clone()],
            ..self.clone()
        }
    }

    /// The first `n` layers' weights (a forward through them stops there).
    pub fn first_layers(&self, n: usize) -> Weights {
        Weights {
            kinds: self.kinds[..n].to_vec(),
            layers: self.layers[..n].to_vec(),
            ..self.clone()
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
                    let mut u = [0.0f32; RC];
                    input.apply(&h, &mut u);
                    let mut y = [0.0f32; RC];
                    recur(
                        (conv, decay, gain),
                        &mut states[*r as usize],
                        &u,
                        |c, e, t| y[c] += readout[e] * t,
                    );
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

/// One position's update of a recurrent layer's `state` (conv, then temporal) from the
/// conv's input `u`, calling `each(c, e, temporal[e])` after each element's update (the
/// forward's readout). The one place the recurrence's arithmetic lives, so a replay of
/// logged inputs ([`Weights::advance`]) reaches the forward's state bit for bit.
fn recur(
    (conv, decay, gain): (&[Vec<f32>; 2], &[f32], &[f32]),
    state: &mut [f32],
    u: &[f32],
    mut each: impl FnMut(usize, usize, f32),
) {
    let (prev, temporal) = state.split_at_mut(RC);
    for c in 0..RC {
        let conv_out = (conv[0][c] * u[c] + conv[1][c] * prev[c]).tanh();
        prev[c] = u[c];
        for s in 0..RS {
            let e = c * RS + s;
            temporal[e] = decay[e] * temporal[e] + gain[e] * conv_out;
            each(c, e, temporal[e]);
        }
    }
}

impl Weights {
    /// Advances `states` by one position from its logged inputs: each recurrent layer's
    /// conv input, `RC` floats per layer in layer order (what the conv state holds after
    /// the position: [`log_of`]). The replay rollback's kernel.
    pub fn advance(&self, states: &mut States, inputs: &[f32]) {
        for (kind, lw) in self.kinds.iter().zip(&self.layers) {
            if let (
                LayerKind::Recurrent(r),
                LayerWeights::Recurrent {
                    conv, decay, gain, ..
                },
            ) = (kind, lw)
            {
                let r = *r as usize;
                recur(
                    (conv, decay, gain),
                    &mut states[r],
                    &inputs[r * RC..(r + 1) * RC],
                    |_, _, _| {},
                );
            }
        }
    }
}

/// The log entry of a position: each recurrent layer's conv input there, which its conv
/// state holds right after it, in layer order.
pub fn log_of(states: &States) -> Vec<f32> {
    states
        .iter()
        .flat_map(|s| s[..RC].iter().copied())
        .collect()
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
