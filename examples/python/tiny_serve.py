"""The serving loop on unikv: admission through the prefix cache, chunked prefill and
decode batches allocated by the cache, the step metadata built for them, and the
forward over unikv's buffer — new K/V written at the step's write locations, earlier
rows read through the page tables' kernel ids, the recurrent state kept in the
request's slot and every checkpoint the step lists written to its slot.

The buffer is reached through ``unikv.CpuBuffer`` (row copies in and out, the CPU
twin of a kernel) and addressed through ``unikv.KvGeometry``; the header comes from the
step metadata's numpy view (``host_image``), the page tables from
``CpuBuffer.read_step_table`` — a host read-back, the CPU backend's stand-in for a
kernel reading them on the GPU.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

import unikv
from tiny_model import (
    F32,
    KV,
    SPEC,
    FloatArray,
    State,
    Weights,
    argmax,
    forward,
    reference_state,
)
from tiny_workload import Job, arrive, checkpoint_grid, workload

IntArray = np.ndarray[Any, np.dtype[np.int32]]


@dataclass
class RunConfig:
    """The shape of a serving run of a scripted workload."""

    page_size: int
    workload: str
    reuse: bool
    layout: str = "unified"
    seed: int = 11

    @property
    def grid(self) -> int:
        return checkpoint_grid(self.page_size)


@dataclass
class RunStats:
    """What a serving run went through."""

    steps: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of every admission."""
    prefill_tokens: int = 0
    """Prompt tokens the prefill chunks computed (the prompt tokens less the reused)."""
    prefix_hits: int = 0
    """Admissions that resumed from the prefix cache."""
    hit_tokens: int = 0
    kv_hit_tokens: int = 0
    resumes_checked: int = 0
    """Resumed states compared with a contiguous recompute of their prefix."""
    state_mismatch: Optional[str] = None
    elapsed: float = 0.0


@dataclass
class Running:
    """A job admitted to the cache, with its request."""

    job: int
    req: unikv.Request
    pending: Optional[int] = None
    """The next token to append (sampled, not yet computed)."""
    chunked: bool = False
    resumed_at: Optional[int] = None
    """Resumed from a cached state after this many tokens, not yet checked."""


@dataclass
class StepRows:
    """One request's part of the step: where its new rows go, where its rows are."""

    first: int
    """Row position of its first new token."""
    length: int
    """Its rows after the step's allocation."""
    full_pages: IntArray
    """Kernel id of each FULL page's first token."""
    swa_pages: IntArray
    """Kernel id of each SWA window page's first token, from page ``swa_first_page``."""
    swa_first_page: int
    write_full: IntArray
    write_swa: IntArray
    state_slot: int
    checkpoints: dict[int, int] = field(default_factory=dict)
    """Row length → the physical slot its state is saved to."""


def step_rows(img: IntArray, table: IntArray, lay: dict[str, int], b: int) -> StepRows:
    """Request ``b``'s part of the step: the header from the host image, the page tables
    from the device table (sections as ``StepMetadata.layout`` places them)."""

    def at(section: str, i: int) -> int:
        return int(img[lay[section] + i])

    q0, q1 = at("query_starts", b), at("query_starts", b + 1)
    f0, f1 = at("full_starts", b), at("full_starts", b + 1)
    s0, s1 = at("swa_starts", b), at("swa_starts", b + 1)
    c0, c1 = at("checkpoint_starts", b), at("checkpoint_starts", b + 1)
    ps = lay["page_size"]
    length = (f1 - f0 - 1) * ps + at("full_last", b)
    slots = img[lay["checkpoint_slots"] + c0 : lay["checkpoint_slots"] + c1]
    lengths = img[lay["checkpoint_at"] + c0 : lay["checkpoint_at"] + c1]
    return StepRows(
        first=length - (q1 - q0),
        length=length,
        full_pages=table[lay["full_pages"] + f0 : lay["full_pages"] + f1],
        swa_pages=table[lay["swa_pages"] + s0 : lay["swa_pages"] + s1],
        swa_first_page=at("swa_first_page", b),
        write_full=img[lay["write_full"] + q0 : lay["write_full"] + q1],
        write_swa=img[lay["write_swa"] + q0 : lay["write_swa"] + q1],
        state_slot=at("state_slots", b),
        checkpoints={int(n): int(s) for n, s in zip(lengths, slots)},
    )


class BufferKv:
    """One request's K/V in unikv's buffer for one step: writes go to the step's write
    locations, reads through the page tables' kernel ids."""

    def __init__(self, buf: unikv.CpuBuffer, geo: unikv.KvGeometry, rows: StepRows) -> None:
        self.buf, self.geo, self.rows = buf, geo, rows
        self.row_bytes = {"full": geo.full_row_bytes, "swa": geo.swa_row_bytes}

    def kernel_ids(self, kind: str, lo: int, hi: int) -> IntArray:
        """The kernel ids of rows ``[lo, hi)``: the page's entry plus the row's offset in
        it (0, the sink, for a page not there: a correct run never reads one)."""
        ps = self.geo.page_size
        pos = np.arange(lo, hi)
        if kind == "full":
            pages = self.rows.full_pages[pos // ps]
        else:
            pages = self.rows.swa_pages[pos // ps - self.rows.swa_first_page]
        assert (pages > 0).all(), f"{kind} rows [{lo}, {hi}) read the sink"
        ids: IntArray = (pages + pos % ps).astype(np.int32)
        return ids

    def offsets(self, kind: str, layer: int, ids: IntArray) -> Any:
        """Byte offsets of the K rows, then the V rows, of ``ids``."""
        k = self.geo.row_offsets(kind, ids, layer, value=False)
        v = self.geo.row_offsets(kind, ids, layer, value=True)
        return np.concatenate([k, v])

    def write(self, kind: str, layer: int, first: int, k: FloatArray, v: FloatArray) -> None:
        assert first == self.rows.first
        ids = self.rows.write_full if kind == "full" else self.rows.write_swa
        self.buf.write(self.offsets(kind, layer, ids), np.concatenate([k, v]))

    def read(self, kind: str, layer: int, lo: int, hi: int) -> tuple[FloatArray, FloatArray]:
        ids = self.kernel_ids(kind, lo, hi)
        raw = self.buf.read(self.offsets(kind, layer, ids), self.row_bytes[kind])
        rows = raw.view(F32).reshape(2, hi - lo, KV)
        return rows[0], rows[1]


def load_state(buf: unikv.CpuBuffer, geo: unikv.KvGeometry, slot: int) -> State:
    """The recurrent state in physical slot ``slot``."""
    base = geo.slot_offset(slot)
    (c0, c1), (t0, t1) = geo.conv_state(0), geo.temporal_state(0)
    conv = buf.read([base + c0], c1 - c0).view(F32).reshape(-1)
    temporal = buf.read([base + t0], t1 - t0).view(F32).reshape(conv.shape[0], -1)
    return State([conv.copy()], [temporal.copy()])


def store_state(buf: unikv.CpuBuffer, geo: unikv.KvGeometry, slot: int, state: State) -> None:
    """Writes ``state`` into physical slot ``slot``."""
    base = geo.slot_offset(slot)
    buf.write([base + geo.conv_state(0)[0]], state.conv[0])
    buf.write([base + geo.temporal_state(0)[0]], np.ascontiguousarray(state.temporal[0]))


def memory_bytes(cfg: RunConfig) -> int:
    """Room for 32 grids of tokens of FULL and SWA K/V, state slots on top (twice that
    for the static layout, which splits the buffer in fixed parts)."""
    per_token = (SPEC.full_layers + SPEC.swa_layers) * 2 * KV * 4
    kv = 32 * cfg.grid * per_token
    slots = 64 * 1024
    return (2 * kv if cfg.layout == "static" else kv) + slots


def serve(cfg: RunConfig, weights: Weights) -> tuple[list[Job], RunStats]:
    """Serves ``cfg``'s workload through unikv; returns every job as it ran and the
    run's counts."""
    rng = random.Random(cfg.seed)
    cache = unikv.HybridCache(
        model=SPEC,
        memory=memory_bytes(cfg),
        page_size=cfg.page_size,
        layout=cfg.layout,
        swa_full_tokens_ratio=1.0,
        checkpoint_interval=cfg.grid,
        device="cpu",
    )
    buf = unikv.CpuBuffer(cache)
    geo = buf.geometry
    jobs = workload(cfg.workload, cfg.page_size, cfg.seed)
    waiting = list(range(len(jobs)))
    queue: list[int] = []
    running: list[Running] = []
    stats = RunStats()
    max_running, prefill_budget = 4, 2 * cfg.grid
    checking = 0.0
    started = time.perf_counter()
    while queue or running or waiting:
        arrive(jobs, waiting, queue)
        # Admission.
        while len(running) < max_running and queue:
            job = jobs[queue[0]]
            hit = cache.match_prefix(job.prompt + job.tokens)
            if not cache.can_admit(hit, reserve_tokens=1):
                break
            kv_hit = hit.kv_hit_tokens
            req = cache.admit(hit)
            j = queue.pop(0)
            cached = req.cached_at_admission
            jobs[j].reused = cached
            assert cfg.reuse or kv_hit == 0, "reuse off, but the cache held a prefix"
            stats.prompt_tokens += len(job.prompt)
            stats.kv_hit_tokens += kv_hit
            if cached > 0:
                stats.prefix_hits += 1
                stats.hit_tokens += cached
            running.append(Running(j, req, resumed_at=cached if cached > 0 else None))
        assert running, f"the budget cannot admit job {queue[:1]}"

        # Allocation: prefill chunks under the step's budget, then one decode batch.
        step: list[tuple[int, int]] = []  # (running index, new tokens)
        budget = prefill_budget
        for i, r in enumerate(running):
            remaining = r.req.remaining_prefill
            if remaining == 0 or budget == 0:
                continue
            n = min(remaining, budget, rng.randint(1, 2 * max(cfg.page_size, 16)))
            cache.alloc_extend(r.req, n)
            stats.prefill_tokens += n
            r.chunked = True
            budget -= n
            step.append((i, n))
        decoders = [
            (i, r.pending)
            for i, r in enumerate(running)
            if r.pending is not None and r.req.remaining_prefill == 0 and not r.chunked
        ]
        if decoders:
            cache.alloc_decode([running[i].req for i, _ in decoders], [t for _, t in decoders])
            for i, _ in decoders:
                running[i].pending = None
                step.append((i, 1))
        step.sort()

        # Metadata after every allocation of the step; then the forward on the buffer.
        meta = cache.build_step_metadata(
            [running[i].req for i, _ in step], [n for _, n in step]
        )
        img, lay = meta.host_image, meta.layout
        table = buf.read_step_table(meta)
        logits: list[FloatArray] = []
        for b, (i, _) in enumerate(step):
            r = running[i]
            rows = step_rows(img, table, lay, b)
            tokens = r.req.tokens()
            # The state before row 0 is the zero one; later rows continue from the slot
            # (a cached state copied there at admission, or this request's last step).
            state = load_state(buf, geo, rows.state_slot) if rows.first > 0 else State.zero()
            if r.resumed_at is not None:
                # The first step after a resume reads the cached state: it must be the
                # one a contiguous recompute of the prefix reaches.
                t0 = time.perf_counter()
                stats.resumes_checked += 1
                want = reference_state(weights, tokens[: r.resumed_at])
                if (rows.first != r.resumed_at or not state.equals(want)) and (
                    stats.state_mismatch is None
                ):
                    stats.state_mismatch = (
                        f"job {r.job}: the state resumed after {r.resumed_at} tokens "
                        f"differs from its recompute (first step at {rows.first})"
                    )
                r.resumed_at = None
                checking += time.perf_counter() - t0
            kv = BufferKv(buf, geo, rows)
            out, saved = forward(
                weights,
                kv,
                state,
                tokens[rows.first : rows.length],
                rows.first,
                save=list(rows.checkpoints),
            )
            store_state(buf, geo, rows.state_slot, saved.state)
            for at, slot in rows.checkpoints.items():
                store_state(buf, geo, slot, saved.checkpoints[at])
            logits.append(out)
        del img, table, meta
        stats.computed_tokens += sum(n for _, n in step)

        # Sampling, finishing, caching.
        finished: list[int] = []
        for b, (i, _) in enumerate(step):
            r = running[i]
            if r.req.remaining_prefill > 0:
                continue
            job = jobs[r.job]
            job.tokens.append(argmax(logits[b]))
            job.logits = logits[b]
            if job.finished:
                finished.append(i)
            else:
                r.pending = job.tokens[-1]
        for i in sorted(finished, reverse=True):
            r = running.pop(i)
            if cfg.reuse:
                cache.cache_finished(r.req)
            else:
                cache.release(r.req)
        for r in running:
            if cfg.reuse and r.chunked:
                # Every prefill chunk is cached with the states it saved, as SGLang's
                # chunked prefill does, so a request arriving meanwhile resumes there.
                cache.cache_unfinished(r.req)
            r.chunked = False
        cache.step_boundary()
        stats.steps += 1
    stats.elapsed = time.perf_counter() - started - checking
    return jobs, stats


def same_bits(a: Optional[FloatArray], b: Optional[FloatArray]) -> bool:
    return a is not None and b is not None and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def compare_runs(a: list[Job], b: list[Job]) -> Optional[str]:
    """The first difference between two runs of one workload (prompts, generated
    tokens, final logits bit for bit), or ``None``."""
    if len(a) != len(b):
        return f"{len(a)} jobs against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.prompt != y.prompt:
            return f"job {i}: prompts of {len(x.prompt)} and {len(y.prompt)} tokens differ"
        if x.tokens != y.tokens:
            return f"job {i}: generated {x.tokens} against {y.tokens}"
        if not same_bits(x.logits, y.logits):
            return f"job {i}: final logits differ"
    return None


def check_reuse(cfg: RunConfig, jobs: list[Job], stats: RunStats) -> Optional[str]:
    """Whether reuse happened exactly when it is on (on: prefixes hit, states resumed
    and checked, fewer prompt tokens prefilled than admitted; off: not one token hit),
    so that identical outputs cannot pass vacuously; the first problem or ``None``."""
    if stats.state_mismatch is not None:
        return stats.state_mismatch
    if cfg.reuse:
        if stats.prefix_hits == 0:
            return "reuse on, but no request hit the prefix cache"
        if stats.resumes_checked != stats.prefix_hits:
            return f"{stats.prefix_hits} hits but {stats.resumes_checked} states checked"
        if stats.prefill_tokens >= stats.prompt_tokens:
            return (
                f"reuse on, but {stats.prefill_tokens} of {stats.prompt_tokens} "
                "prompt tokens were prefilled"
            )
    elif stats.prefix_hits or stats.kv_hit_tokens:
        return f"reuse off, but {stats.prefix_hits} hits ({stats.kv_hit_tokens} tokens of KV)"
    return None
