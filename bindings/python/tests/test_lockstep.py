"""Random lifecycles through Python and through the Rust facade, in lockstep.

Each seed builds a small cache (gpt-oss-20b or qwen3-next-80b-a3b, page size 1, 16 or
256, either layout, memory small enough that admissions and decodes run out and the
prefix cache evicts; seeds from ``SEEDS_PER_MODEL`` on with a host tier half the
device's size, and operations that evict to it, so later prompts load prefixes back)
and makes about 60 random operations, valid and invalid, through
``unikv.HybridCache`` and its ``Request`` and ``PrefixMatch`` objects, recording after
each what Python sees: the value or the exception (class and numbers), every request's
view and the cache's counters. ``unikv._unikv._reference_run`` replays the same
operations directly on the Rust facade (``bindings/python/src/reference.rs``, none of
the binding's classes) and records the same shape; the two must agree step by step.
"""

import json
import random
from typing import Any, Optional

import numpy as np
import pytest

import unikv
from unikv._unikv import _capacity, _reference_run

Op = dict[str, Any]
"""One operation, as ``_reference_run`` reads it (see ``reference.rs`` for the set)."""

Record = dict[str, Any]
"""What one operation gave: ``value`` or ``error``, then ``requests`` and ``stats``."""

MODELS = ["gpt-oss-20b", "qwen3-next-80b-a3b"]
"""An SWA model and a recurrent one (no SWA, Mamba state slots)."""
SEEDS_PER_MODEL = 100
"""Seeds without a host tier (``0 ..``), and as many with one (from here on)."""
OPS_PER_SEED = 60
REGRESSION_SEEDS: list[int] = []
"""Seeds that once diverged, run for both models whatever ``SEEDS_PER_MODEL`` is."""

# The numbers an exception may carry (``errors.rs``), recorded when it has them.
ERROR_ATTRIBUTES = (
    "full_pages",
    "swa_pages",
    "mamba_slots",
    "full_available",
    "swa_available",
    "mamba_available",
    "request",
    "step",
)
MiB = 1 << 20


def side(s: unikv.SideStats) -> list[int]:
    """A side's counters as the reference lists them."""
    return [s.total, s.available, s.evictable, s.protected, s.held]


def host(h: Optional[unikv.HostStats]) -> Optional[list[int]]:
    """The host tier's figures as the reference lists them (``None`` without one)."""
    if h is None:
        return None
    return [
        h.total_bytes,
        h.full_bytes,
        h.swa_bytes,
        h.state_bytes,
        h.peak_bytes,
        h.hit_tokens,
        h.written_bytes,
        h.loaded_bytes,
        h.copies,
        h.largest_copy,
        h.refused_writes,
    ]


class Driver:
    """Runs operations through the Python API and records what they give."""

    def __init__(self) -> None:
        self.cache: Optional[unikv.HybridCache] = None
        self.requests: list[unikv.Request] = []
        self.matches: list[unikv.PrefixMatch] = []
        self.consumed_matches: set[int] = set()

    def stats(self) -> Optional[dict[str, Any]]:
        """The counters, as the reference records them (``None`` without a cache)."""
        if self.cache is None:
            return None
        s = self.cache.stats()
        return {
            "step": s.step,
            "full": side(s.full),
            "swa": side(s.swa),
            "mamba": side(s.mamba),
            "live_requests": s.live_requests,
            "hit_tokens": s.hit_tokens,
            "host": host(s.host),
        }

    def views(self) -> list[Optional[list[int]]]:
        """Every request's view: ``None`` once consumed."""
        return [
            None
            if r.closed
            else [r.id, r.len, r.remaining_prefill, r.cached_at_admission]
            for r in self.requests
        ]

    def apply(self, op: Op) -> Record:
        """Runs `op` and records its value or its exception, then the views."""
        record: Record
        try:
            record = {"value": self.call(op)}
        except unikv.Error as e:
            attrs = {a: getattr(e, a) for a in ERROR_ATTRIBUTES if hasattr(e, a)}
            record = {"error": [type(e).__name__, attrs]}
        record["requests"] = self.views()
        record["stats"] = self.stats()
        # Through JSON, so both sides compare as the same plain types.
        normal: Record = json.loads(json.dumps(record))
        return normal

    def tokens(self, op: Op, key: str) -> Any:
        """`op`'s token ids, as a list or (when `op` says so) an int64 array."""
        ids: list[int] = op[key]
        if op.get("buffer"):
            return np.array(ids, dtype=np.int64)
        return ids

    def call(self, op: Op) -> Any:
        """Runs `op` through the Python API; returns its value."""
        kind = op["op"]
        if kind == "new":
            self.cache = unikv.HybridCache(
                model=op["model"],
                memory=op["memory"],
                page_size=op["page_size"],
                layout=op["layout"],
                checkpoint_interval=op["checkpoint_interval"],
                host_memory_bytes=op.get("host_memory_bytes", 0),
            )
            return {"page_size": self.cache.page_size, "step": self.cache.step}
        cache = self.cache
        assert cache is not None
        if kind == "match":
            hit = cache.match_prefix(self.tokens(op, "tokens"))
            self.matches.append(hit)
            return {
                "cached": hit.cached_tokens,
                "device": hit.device_tokens,
                "host": hit.host_tokens,
                "kv_hit": hit.kv_hit_tokens,
                "prompt_len": hit.prompt_len,
            }
        if kind == "can_admit":
            hit = self.matches[op["match"]]
            return cache.can_admit(hit, reserve_tokens=op["reserve"])
        if kind == "admit":
            self.consumed_matches.add(op["match"])
            req = cache.admit(self.matches[op["match"]])
            self.requests.append(req)
            return req.id
        if kind == "alloc_extend":
            cache.alloc_extend(self.requests[op["req"]], op["n"])
            return None
        if kind == "alloc_decode":
            batch = [self.requests[k] for k in op["reqs"]]
            cache.alloc_decode(batch, self.tokens(op, "tokens"))
            return None
        if kind == "release_out_of_window":
            return cache.release_out_of_window(self.requests[op["req"]])
        if kind == "cache_unfinished":
            cache.cache_unfinished(self.requests[op["req"]])
            return None
        if kind == "cache_finished":
            cache.cache_finished(self.requests[op["req"]])
            return None
        if kind == "release":
            return cache.release(self.requests[op["req"]])
        if kind == "tokens":
            return self.requests[op["req"]].tokens()
        if kind == "step_boundary":
            report = cache.step_boundary()
            return {"step": report.step, "text": report.text}
        if kind == "evict_to_free":
            cache.evict_to_free(full_pages=op["full_pages"], swa_pages=op["swa_pages"])
            return None
        if kind == "stats":
            return self.stats()
        raise AssertionError(f"unknown op {kind!r}")


class Generator:
    """Random operations, valid and invalid, chosen from the driver's state."""

    def __init__(
        self, rng: random.Random, driver: Driver, unit: int, host_tier: bool
    ) -> None:
        self.rng = rng
        self.driver = driver
        self.unit = unit
        self.host_tier = host_tier
        # Prompts share prefixes of a few documents, of what requests cached and of
        # running requests' tokens.
        self.documents = [
            [rng.randrange(1000) for _ in range(4 * unit)] for _ in range(3)
        ]

    def new(self, model: str) -> Op:
        """A cache: small memory, any page size and layout; now and then too small.
        With a host tier, one of half the device's memory."""
        rng = self.rng
        page_size = self.unit if self.unit > 16 else rng.choice([1, 16])
        layout = rng.choice(["unified", "static"])
        # In MiB; the lowest tenth or so of each range is too small to build (a refusal
        # compared like any other).
        low, high = {
            ("gpt-oss-20b", False, "unified"): (6.5, 14),
            ("gpt-oss-20b", False, "static"): (8.5, 20),
            ("gpt-oss-20b", True, "unified"): (28, 64),
            ("gpt-oss-20b", True, "static"): (44, 96),
            ("qwen3-next-80b-a3b", False, "unified"): (290, 500),
            ("qwen3-next-80b-a3b", True, "unified"): (290, 500),
            ("qwen3-next-80b-a3b", False, "static"): (560, 900),
            ("qwen3-next-80b-a3b", True, "static"): (560, 900),
        }[model, page_size == 256, layout]
        checkpoint: Optional[int] = None
        if model != "gpt-oss-20b" and rng.random() < 0.5:
            checkpoint = page_size * rng.choice([1, 2, 4])
        op: Op = {
            "op": "new",
            "model": model,
            "memory": rng.randrange(int(low * MiB), int(high * MiB)),
            "page_size": page_size,
            "layout": layout,
            "checkpoint_interval": checkpoint,
        }
        if self.host_tier:
            op["host_memory_bytes"] = op["memory"] // 2
        return op

    def token(self) -> int:
        """A token id, now and then one no cache accepts."""
        if self.rng.random() < 0.02:
            return self.rng.choice([-1, 1 << 32])
        return self.rng.randrange(1000)

    def prompt(self) -> list[int]:
        """A prompt sharing a prefix with a document or an earlier request."""
        rng = self.rng
        sources = self.documents + [
            r.tokens() for r in self.driver.requests if not r.closed
        ]
        base = rng.choice(sources)
        keep = rng.randint(0, len(base))
        tail = rng.randint(0, self.unit) if rng.random() < 0.8 else 0
        tokens = base[:keep] + [rng.randrange(1000) for _ in range(tail)]
        if rng.random() < 0.03:
            tokens.append(self.token())
        return tokens

    def request(self, live: list[int]) -> int:
        """A live request's index, now and then one finished or released."""
        everyone = range(len(self.driver.requests))
        if not live or self.rng.random() < 0.08:
            return self.rng.choice(everyone)
        return self.rng.choice(live)

    def next(self) -> Op:
        """The next operation."""
        rng = self.rng
        d = self.driver
        live = [k for k, r in enumerate(d.requests) if not r.closed]
        pending = [k for k in range(len(d.matches)) if k not in d.consumed_matches]
        roll = rng.random()
        if not live or roll < 0.16:
            if pending and rng.random() < 0.6:
                return {"op": "admit", "match": pending[-1]}
            op: Op = {"op": "match", "tokens": self.prompt()}
            op["buffer"] = rng.random() < 0.3
            return op
        if roll < 0.21:
            if d.matches and (not pending or rng.random() < 0.1):
                m = rng.randrange(len(d.matches))
                if rng.random() < 0.5:
                    return {"op": "admit", "match": m}
            elif pending:
                m = rng.choice(pending)
            else:
                return {"op": "stats"}
            reserve = rng.choice([0, rng.randrange(4 * self.unit), 1 << 40])
            return {"op": "can_admit", "match": m, "reserve": reserve}
        if roll < 0.40:
            prefilling = [k for k in live if d.requests[k].remaining_prefill > 0]
            k = self.request(prefilling or live)
            req = d.requests[k]
            left = 0 if req.closed else req.remaining_prefill
            n = rng.choice([left, left, rng.randint(0, left), rng.randint(0, left)])
            if rng.random() < 0.1:
                n = rng.choice([left + rng.randint(1, 3), 1 << 40])
            return {"op": "alloc_extend", "req": k, "n": n}
        if roll < 0.62:
            ready = [k for k in live if d.requests[k].remaining_prefill == 0]
            reqs = rng.sample(ready, rng.randint(0, len(ready))) if ready else []
            if rng.random() < 0.1:
                reqs.append(self.request(live))
            if reqs and rng.random() < 0.03:
                reqs.append(rng.choice(reqs))
            tokens = [self.token() for _ in reqs]
            if rng.random() < 0.03:
                tokens.append(1)
            return {
                "op": "alloc_decode",
                "reqs": reqs,
                "tokens": tokens,
                "buffer": rng.random() < 0.3,
            }
        if roll < 0.67:
            return {"op": "release_out_of_window", "req": self.request(live)}
        if roll < 0.78:
            k = self.request(live)
            if not d.requests[k].closed:
                # What it caches is a prefix later prompts can hit (and extend).
                self.documents.append(d.requests[k].tokens())
            kind = "cache_unfinished" if roll < 0.72 else "cache_finished"
            return {"op": kind, "req": k}
        if roll < 0.82:
            return {"op": "release", "req": self.request(live)}
        if roll < 0.84:
            return {"op": "tokens", "req": self.request(live)}
        if roll < 0.90 and self.host_tier:
            # Demote some or all unlocked prefixes to the host (the eviction loop writes
            # back), now and then more than there is (refused, nothing evicted).
            cache = d.cache
            assert cache is not None
            s = cache.stats()
            now = _capacity(cache)["full_schedulable_pages"]
            some = now + rng.randint(1, max(1, s.full.evictable))
            full = rng.choice([some, some, now + s.full.evictable, s.full.total + 1])
            swa = full if s.swa.total > 0 and rng.random() < 0.1 else 0
            return {"op": "evict_to_free", "full_pages": full, "swa_pages": swa}
        if roll < 0.98:
            return {"op": "step_boundary"}
        return {"op": "stats"}


def run_seed(model: str, seed: int) -> tuple[list[Op], list[Record]]:
    """Generates and runs one seed's operations through Python; returns both."""
    rng = random.Random(f"{model}/{seed}")
    driver = Driver()
    gen = Generator(
        rng,
        driver,
        unit=rng.choice([16, 16, 256]),
        host_tier=seed >= SEEDS_PER_MODEL,
    )
    ops = [gen.new(model)]
    records = [driver.apply(ops[0])]
    if driver.cache is None:
        return ops, records
    for _ in range(OPS_PER_SEED):
        op = gen.next()
        ops.append(op)
        records.append(driver.apply(op))
    return ops, records


def check_seed(model: str, seed: int) -> dict[str, int]:
    """Runs a seed both ways and compares the records step by step; returns how many
    operations succeeded and how many raised each class. A divergence fails with the
    seed, the operation's index, both records and the operations up to it."""
    ops, python = run_seed(model, seed)
    reference = json.loads(_reference_run(json.dumps(ops)))
    assert len(reference) == len(python)
    counts: dict[str, int] = {}
    for i, (op, ours, theirs) in enumerate(zip(ops, python, reference)):
        if ours != theirs:
            so_far = enumerate(ops[: i + 1])
            recent = "\n".join(f"  {j}: {json.dumps(o)}" for j, o in so_far)
            pytest.fail(
                f"model {model} seed {seed}: op {i} {json.dumps(op)} diverged\n"
                f"python:    {json.dumps(ours)}\n"
                f"reference: {json.dumps(theirs)}\n"
                f"ops so far:\n{recent}"
            )
        outcome = ours["error"][0] if "error" in ours else "ok"
        counts[outcome] = counts.get(outcome, 0) + 1
        if op["op"] == "match" and "value" in ours and ours["value"]["host"] > 0:
            counts["host hit"] = counts.get("host hit", 0) + 1
    return counts


@pytest.mark.parametrize("model", MODELS)
def test_python_and_the_facade_agree_step_by_step(model: str) -> None:
    """Every seed's records agree; together they reach successes, OutOfMemory,
    InvalidArgument and matches on the host tier often enough for the comparison to
    mean something."""
    totals: dict[str, int] = {}
    seeds = sorted(set(range(2 * SEEDS_PER_MODEL)) | set(REGRESSION_SEEDS))
    for seed in seeds:
        for outcome, n in check_seed(model, seed).items():
            totals[outcome] = totals.get(outcome, 0) + n
    print(f"{model}: {len(seeds)} seeds, outcomes {sorted(totals.items())}")
    # The runs reach the paths worth comparing: refusals of every kind, and successes.
    assert totals.get("ok", 0) > 1000
    assert totals.get("OutOfMemory", 0) > 10
    assert totals.get("InvalidArgument", 0) > 100
    assert totals.get("host hit", 0) > 10
