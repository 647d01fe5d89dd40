"""``python examples/python/tiny_engine.py``: the Rust tiny engine's idea in numpy — a
tiny hybrid decoder (FULL, SWA and a Mamba-like recurrent layer) served through unikv
with every K/V row and recurrent state in unikv's buffer, against a reference with
contiguous K/V.

For page sizes 1, 16 and 256, both layouts, it serves the shared-prefix batch and the
multi-turn conversation with reuse off and on: each run's outputs (generated tokens and
final logits, bit for bit) against the first run's and the reference's, every state a
request resumed from against a contiguous recompute of its prefix, and reuse must have
happened exactly when it is on. Each row gives both implementations' tokens/s, the
prefixes hit and the prompt tokens they reused; it ends with ``outputs identical: yes``
when everything matched (exit status 0), ``no`` otherwise (exit status 1).

Modules: ``tiny_model`` (the decoder, its one forward, the reference), ``tiny_workload``
(the jobs), ``tiny_serve`` (the serving loop over unikv's buffer, the checks).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from tiny_model import NAME, FloatArray, Weights, reference
from tiny_serve import RunConfig, RunStats, check_reuse, compare_runs, same_bits, serve
from tiny_workload import WORKLOADS, Job

PAGE_SIZES = (1, 16, 256)
LAYOUTS = ("static", "unified")
SEED = 11


@dataclass
class Row:
    """One run: its configuration, counts, and the first difference found (if any)."""

    cfg: RunConfig
    jobs: list[Job]
    stats: RunStats
    ref_seconds: float
    ref_tokens: int
    diff: Optional[str]


def reference_outputs(
    weights: Weights, jobs: list[Job]
) -> tuple[list[tuple[list[int], FloatArray]], float, int]:
    """Every job's reference output, the time they took and the tokens computed."""
    started = time.perf_counter()
    outputs = [reference(weights, j.prompt, j.max_new) for j in jobs]
    tokens = sum(len(j.prompt) + j.max_new - 1 for j in jobs)
    return outputs, time.perf_counter() - started, tokens


def compare_reference(jobs: list[Job], want: list[tuple[list[int], FloatArray]]) -> Optional[str]:
    for i, (job, (tokens, logits)) in enumerate(zip(jobs, want)):
        if job.tokens != tokens:
            return f"job {i} (prompt of {len(job.prompt)} tokens): generated {job.tokens}, the reference {tokens}"
        if not same_bits(job.logits, logits):
            return f"job {i}: final logits differ from the reference's"
    return None


def run_matrix(
    page_sizes: Sequence[int] = PAGE_SIZES,
    layouts: Sequence[str] = LAYOUTS,
    workloads: Sequence[str] = WORKLOADS,
    out: bool = True,
) -> list[Row]:
    """Serves every workload at every page size and layout with reuse off and on,
    checking each run; prints a row per run when ``out``."""
    weights = Weights.random(SEED ^ 0x5EED)
    rows: list[Row] = []
    for ps in page_sizes:
        if out:
            print(f"page size {ps}")
        for workload in workloads:
            baseline: Optional[list[Job]] = None
            want: Optional[list[tuple[list[int], FloatArray]]] = None
            ref_seconds, ref_tokens = 0.0, 0
            for layout in layouts:
                for reuse in (False, True):
                    cfg = RunConfig(page_size=ps, workload=workload, reuse=reuse, layout=layout, seed=SEED)
                    jobs, stats = serve(cfg, weights)
                    if want is None:
                        want, ref_seconds, ref_tokens = reference_outputs(weights, jobs)
                    if baseline is None:
                        baseline = jobs
                    diff = (
                        check_reuse(cfg, jobs, stats)
                        or compare_runs(baseline, jobs)
                        or compare_reference(jobs, want)
                    )
                    row = Row(cfg, jobs, stats, ref_seconds, ref_tokens, diff)
                    rows.append(row)
                    if out:
                        print_row(row)
    return rows


def print_row(row: Row) -> None:
    """One row of the table (and the difference under it, if any)."""
    cfg, s = row.cfg, row.stats
    print(
        f"  {NAME:<12} {cfg.layout:<7} {cfg.workload:<13} reuse {'on' if cfg.reuse else 'off':<3}  "
        f"unikv {s.computed_tokens / s.elapsed:>8.0f} tok/s  "
        f"reference {row.ref_tokens / row.ref_seconds:>8.0f} tok/s  "
        f"hits {s.prefix_hits:>3}  reused {s.hit_tokens:>5} of {s.prompt_tokens:>5} prompt tokens "
        f"(KV hit {s.kv_hit_tokens:>5})  prefilled {s.prefill_tokens:>5}  "
        f"resumes checked {s.resumes_checked:>2}  steps {s.steps:>4}  requests {len(row.jobs):>3}"
    )
    if row.diff is not None:
        print(f"    DIFFERS: {row.diff}")


def main(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if argv:
        print(f"tiny_engine: unexpected arguments {list(argv)} (try --help)", file=sys.stderr)
        return 2
    rows = run_matrix()
    identical = all(r.diff is None for r in rows)
    print(f"outputs identical: {'yes' if identical else 'no'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
