"""The tiny hybrid decoder: FULL attention, sliding-window attention and a Mamba-like
linear recurrent layer (FULL, SWA, recurrent, SWA, FULL), random weights, and the one
forward that the engine (K/V in unikv's buffer) and the reference (contiguous K/V) both
run, so a correct cache makes their outputs bit-identical.

Why the arithmetic is spelled out: BLAS and numpy's pairwise sums pick their summation
order from an array's shape, and a request's tokens arrive in chunks whose shape depends
on what the prefix cache held. Every sum here is therefore sequential
(``np.add.accumulate``, the last element), every other operation element-wise, and the
masked-out keys of an attention row contribute exact zeros: a token's result does not
depend on how its request was chunked, batched or resumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np

import unikv

F32 = np.float32

VOCAB = 48
"""Vocabulary size."""
D = 16
"""Hidden size."""
HEADS = 2
"""Attention heads (as many KV heads)."""
HD = 4
"""Head dimension."""
KV = HEADS * HD
"""One K (or V) row: ``HEADS × HD`` floats."""
WINDOW = 8
"""The sliding window of the SWA layers."""
RC = 8
"""Recurrent channels."""
RS = 4
"""State size per channel."""
MAX_POS = 4096
"""Positions the positional table covers."""

LAYERS: tuple[tuple[str, int], ...] = (
    ("full", 0),
    ("swa", 0),
    ("mamba", 0),
    ("swa", 1),
    ("full", 1),
)
"""The layer stack: each layer's kind and its index among the layers of its kind."""

NAME = "full+swa+rec"
"""A short label for tables."""

SPEC = unikv.ModelSpec(
    name="tiny-engine-tri",
    full_layers=2,
    swa_layers=2,
    mamba_layers=1,
    kv_heads=HEADS,
    head_dim=HD,
    dtype_bytes=4,
    window=WINDOW,
    conv_channels=RC,
    conv_kernel=2,
    state_heads=HEADS,
    state_head_dim=RC // HEADS,
    state_size=RS,
    state_dtype_bytes=4,
)
"""The cache's view of the model: float32 rows, one conv input and an ``RC × RS``
temporal state per recurrent layer."""

FloatArray = np.ndarray[Any, np.dtype[np.float32]]


def seq_sum(a: FloatArray, axis: int = -1) -> FloatArray:
    """The sum along ``axis``, strictly left to right (independent of the array's shape)."""
    acc: FloatArray = np.add.accumulate(a, axis=axis)
    last: FloatArray = np.take(acc, -1, axis=axis)
    return last


def linear(x: FloatArray, w: FloatArray) -> FloatArray:
    """``x @ w.T`` for ``x`` of shape ``(n, cols)`` and ``w`` of ``(rows, cols)``, each
    output a sequential sum over ``cols``."""
    return seq_sum(x[:, None, :] * w[None, :, :])


def rms_norm(x: FloatArray) -> FloatArray:
    """``x / rms(x)`` row by row (no gain)."""
    ss = seq_sum(x * x)
    scale = F32(1.0) / np.sqrt(ss / F32(x.shape[-1]) + F32(1e-5))
    out: FloatArray = x * scale[:, None]
    return out


@dataclass
class State:
    """The recurrent state of one request: per recurrent layer, the previous conv input
    (``RC``) and the temporal state (``RC × RS``)."""

    conv: list[FloatArray]
    temporal: list[FloatArray]

    @staticmethod
    def zero(layers: int = 1) -> State:
        return State(
            [np.zeros(RC, F32) for _ in range(layers)],
            [np.zeros((RC, RS), F32) for _ in range(layers)],
        )

    def equals(self, other: State) -> bool:
        """Bit for bit."""
        return all(
            np.array_equal(a.view(np.uint32), b.view(np.uint32))
            for a, b in zip(self.conv + self.temporal, other.conv + other.temporal)
        )


class KvStore(Protocol):
    """Where the attention layers keep K/V: the forward writes the step's new rows, then
    reads back the rows of positions ``[lo, hi)`` (its own included)."""

    def write(self, kind: str, layer: int, first: int, k: FloatArray, v: FloatArray) -> None:
        """Writes the K and V rows of positions ``first ..`` (one row per new token)."""

    def read(self, kind: str, layer: int, lo: int, hi: int) -> tuple[FloatArray, FloatArray]:
        """The K and V rows of positions ``[lo, hi)``, shape ``(hi - lo, KV)`` each."""


@dataclass
class Weights:
    """Random weights of the whole model."""

    embed: FloatArray
    pos: FloatArray
    unembed: FloatArray
    attention: dict[tuple[str, int], tuple[FloatArray, FloatArray, FloatArray, FloatArray]]
    recurrent: dict[int, dict[str, FloatArray]] = field(default_factory=dict)

    @staticmethod
    def random(seed: int) -> Weights:
        rng = np.random.default_rng(seed)

        def mat(rows: int, cols: int) -> FloatArray:
            a = 1.0 / np.sqrt(cols)
            return rng.uniform(-a, a, (rows, cols)).astype(F32)

        def around(mid: float, spread: float, shape: tuple[int, ...]) -> FloatArray:
            return (mid + rng.uniform(-spread, spread, shape)).astype(F32)

        attention = {}
        recurrent = {}
        for kind, i in LAYERS:
            if kind == "mamba":
                recurrent[i] = {
                    "input": mat(RC, D),
                    "conv0": around(0.6, 0.3, (RC,)),
                    "conv1": around(0.0, 0.5, (RC,)),
                    "decay": around(0.75, 0.2, (RC, RS)),
                    "gain": around(0.0, 0.5, (RC, RS)),
                    "readout": around(0.0, 0.6, (RC, RS)),
                    "out": mat(D, RC),
                }
            else:
                attention[(kind, i)] = (mat(KV, D), mat(KV, D), mat(KV, D), mat(D, KV))
        # Sinusoidal positions, tabulated once (the same float for a position however
        # its token is batched).
        d = np.arange(D)
        freq = 1.0 / 10_000.0 ** ((d // 2 * 2) / D)
        angle = np.arange(MAX_POS)[:, None] * freq[None, :]
        pos = 0.5 * np.where(d % 2 == 0, np.sin(angle), np.cos(angle))
        return Weights(
            embed=mat(VOCAB, D),
            pos=pos.astype(F32),
            unembed=mat(VOCAB, D),
            attention=attention,
            recurrent=recurrent,
        )


@dataclass
class Saved:
    """What a forward leaves besides the logits: the state after the last token and the
    states after the row lengths it was asked to save (checkpoints)."""

    state: State
    checkpoints: dict[int, State]


def attention(
    w: Weights, kind: str, layer: int, h: FloatArray, first: int, store: KvStore
) -> FloatArray:
    """One attention layer over the new tokens ``h`` at positions ``first ..``: writes
    their K/V, reads the keys they see (SWA: the last ``WINDOW`` positions) and returns
    the layer's output."""
    wq, wk, wv, wo = w.attention[(kind, layer)]
    n = h.shape[0]
    q, k, v = linear(h, wq), linear(h, wk), linear(h, wv)
    store.write(kind, layer, first, k, v)
    hi = first + n
    lo = max(0, first + 1 - WINDOW) if kind == "swa" else 0
    keys, values = store.read(kind, layer, lo, hi)
    m = hi - lo
    qh = q.reshape(n, HEADS, 1, HD)
    kh = keys.reshape(m, HEADS, HD).transpose(1, 0, 2)[None]  # (1, HEADS, m, HD)
    vh = values.reshape(m, HEADS, HD).transpose(1, 0, 2)[None]
    scores = seq_sum(qh * kh) * F32(1.0 / np.sqrt(HD))  # (n, HEADS, m)
    pos = np.arange(first, hi)[:, None]
    key = np.arange(lo, hi)[None, :]
    visible = key <= pos
    if kind == "swa":
        visible &= key > pos - WINDOW
    scores = np.where(visible[:, None, :], scores, F32(-np.inf))
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))  # masked keys: exactly 0
    denom = seq_sum(e)
    att = seq_sum(e[..., None] * vh, axis=2) / denom[..., None]  # (n, HEADS, HD)
    return linear(att.reshape(n, KV), wo)


def recurrent(
    w: Weights, layer: int, h: FloatArray, first: int, state: State, save: list[int]
) -> tuple[FloatArray, dict[int, tuple[FloatArray, FloatArray]]]:
    """The recurrent layer over the new tokens ``h`` from ``state`` (updated in place):
    a width-2 causal conv, then ``s ← decay·s + gain·conv``, read out per channel.
    Returns the output and the layer's state after each row length in ``save``."""
    p = w.recurrent[layer]
    u = linear(h, p["input"])
    prev = np.concatenate([state.conv[layer][None], u[:-1]])
    conv = np.tanh(p["conv0"] * u + p["conv1"] * prev)
    temporal = np.empty((len(u), RC, RS), F32)
    s = state.temporal[layer]
    for t in range(len(u)):
        s = p["decay"] * s + p["gain"] * conv[t][:, None]
        temporal[t] = s
    state.conv[layer] = u[-1].copy()
    state.temporal[layer] = s.copy()
    saved = {at: (u[at - first - 1].copy(), temporal[at - first - 1].copy()) for at in save}
    y = seq_sum(p["readout"] * temporal)  # (n, RC)
    return linear(y, p["out"]), saved


def forward(
    w: Weights,
    store: KvStore,
    state: State,
    tokens: list[int],
    first: int,
    save: Optional[list[int]] = None,
    layers: int = len(LAYERS),
) -> tuple[FloatArray, Saved]:
    """Runs ``tokens`` (at positions ``first ..``) through the first ``layers`` layers,
    layer by layer: attention writes the tokens' K/V and attends causally, the recurrent
    layer continues from ``state``. Returns the logits after the last token and the
    state after it and after each row length in ``save``."""
    save = save or []
    x = w.embed[np.asarray(tokens) % VOCAB] + w.pos[first : first + len(tokens)]
    state = State(list(state.conv), list(state.temporal))
    checkpoints: dict[int, State] = {at: State.zero(0) for at in save}
    for kind, i in LAYERS[:layers]:
        h = rms_norm(x)
        if kind == "mamba":
            delta, saved = recurrent(w, i, h, first, state, save)
            for at, (conv, temporal) in saved.items():
                checkpoints[at].conv.append(conv)
                checkpoints[at].temporal.append(temporal)
        else:
            delta = attention(w, kind, i, h, first, store)
        x = x + delta
    logits = linear(rms_norm(x[-1:]), w.unembed)[0]
    return logits, Saved(state, checkpoints)


def argmax(logits: FloatArray) -> int:
    """Greedy sampling: the first index of the largest logit."""
    return int(np.argmax(logits))


class ContiguousKv:
    """The reference's K/V: one growing array per attention layer."""

    def __init__(self) -> None:
        self.k: dict[tuple[str, int], FloatArray] = {}
        self.v: dict[tuple[str, int], FloatArray] = {}

    def write(self, kind: str, layer: int, first: int, k: FloatArray, v: FloatArray) -> None:
        key = (kind, layer)
        old_k = self.k.get(key, np.zeros((0, KV), F32))
        assert len(old_k) == first, "the reference writes in order"
        self.k[key] = np.concatenate([old_k, k])
        self.v[key] = np.concatenate([self.v.get(key, np.zeros((0, KV), F32)), v])

    def read(self, kind: str, layer: int, lo: int, hi: int) -> tuple[FloatArray, FloatArray]:
        return self.k[(kind, layer)][lo:hi], self.v[(kind, layer)][lo:hi]


def reference(w: Weights, prompt: list[int], max_new: int) -> tuple[list[int], FloatArray]:
    """The reference: ``prompt`` prefilled in one pass, then ``max_new`` greedy tokens,
    K/V in contiguous arrays. Returns the tokens and the logits that chose the last."""
    kv = ContiguousKv()
    logits, saved = forward(w, kv, State.zero(), prompt, 0)
    out: list[int] = []
    pos = len(prompt)
    while True:
        out.append(argmax(logits))
        if len(out) == max_new:
            return out, logits
        logits, saved = forward(w, kv, saved.state, [out[-1]], pos)
        pos += 1


def reference_state(w: Weights, prefix: list[int]) -> State:
    """The recurrent state a contiguous forward of ``prefix`` reaches: what a request
    resuming after it must start from (the layers above the recurrent one cannot change
    it, so the forward stops there)."""
    below = max(i for i, (kind, _) in enumerate(LAYERS) if kind == "mamba") + 1
    _, saved = forward(w, ContiguousKv(), State.zero(), prefix, 0, layers=below)
    return saved.state
