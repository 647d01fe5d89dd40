"""A decode step of a batch through Python against the same step through the Rust facade,
in one run: ``alloc_decode`` for the batch, the step metadata with its header as a numpy
view, the step boundary. Python makes the step two ways: the two calls, and
``decode_step`` (the same work in one call). Prints the medians and checks the bar
(Python at most 1.5x Rust plus 5 us) for both; the exit status is the one-call form's. Build the wheel in release first (``pip install ./bindings/python`` or
``maturin develop --release``), then ``python bindings/python/bench.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import unikv
from unikv._unikv import _rust_decode_steps


def python_steps(
    model: str,
    memory: int,
    page_size: int,
    batch: int,
    prompt: int,
    warmup: int,
    steps: int,
    device: str,
    fused: bool,
) -> list[int]:
    cache = unikv.HybridCache(model=model, memory=memory, page_size=page_size, device=device)
    requests = []
    for r in range(batch):
        tokens = np.arange(r * 1_000_000, r * 1_000_000 + prompt, dtype=np.int64)
        req = cache.admit(cache.match_prefix(tokens))
        cache.alloc_extend(req, prompt)
        requests.append(req)
    cache.step_boundary()
    batch_of = unikv.Batch(requests)
    times = []
    for step in range(warmup + steps):
        next_tokens = np.full(batch, step, dtype=np.int64)
        start = time.perf_counter_ns()
        if fused:
            meta = cache.decode_step(batch_of, next_tokens)
        else:
            cache.alloc_decode(batch_of, next_tokens)
            meta = cache.build_step_metadata(batch_of)
        header = meta.host_image
        cache.step_boundary()
        took = time.perf_counter_ns() - start
        del meta, header
        if step >= warmup:
            times.append(took)
    for req in requests:
        cache.release(req)
    return times


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-oss-20b")
    parser.add_argument("--memory", type=int, default=16 << 30)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--device",
        default="none",
        help="none (bookkeeping only: what the binding adds stands out) or cpu",
    )
    args = parser.parse_args(argv)
    shape = dict(
        model=args.model,
        memory=args.memory,
        page_size=args.page_size,
        batch=args.batch,
        prompt=args.prompt,
        warmup=args.warmup,
        steps=args.steps,
        device=args.device,
    )
    # Alternate halves so drift on a shared machine hits both sides alike.
    half = dict(shape, steps=args.steps // 2)
    calls: list[int] = []
    fused: list[int] = []
    rust: list[int] = []
    for _ in range(2):
        calls += python_steps(**half, fused=False)
        fused += python_steps(**half, fused=True)
        rust += _rust_decode_steps(**half)
    r = statistics.median(rust)
    bar = 1.5 * r + 5_000
    print(
        f"{args.model}, batch {args.batch}, prompt {args.prompt}, page size {args.page_size}, "
        f"device {args.device}, {len(rust)} steps each"
    )
    print(f"rust                 median {r / 1000:8.1f} us   bar 1.5x rust + 5 us = {bar / 1000:.1f} us")
    verdicts = []
    for name, times in (("python, two calls", calls), ("python, decode_step", fused)):
        p = statistics.median(times)
        verdicts.append(p <= bar)
        print(
            f"{name:<20} median {p / 1000:8.1f} us   ratio {p / r:.2f}x   "
            f"{'PASS' if p <= bar else 'FAIL'}"
        )
    return 0 if verdicts[-1] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
