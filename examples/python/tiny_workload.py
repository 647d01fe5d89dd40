"""What the engine serves: the scripted shared-prefix batch and multi-turn conversation
of the Rust tiny engine (``examples/tiny_engine/engine/workload.rs``), with their
arrivals."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from tiny_model import VOCAB

WORKLOADS = ("shared-prefix", "multi-turn")


@dataclass
class Arrival:
    """When a job enters the queue: at the start (``of is None``), once job ``of`` has
    generated ``tokens`` tokens, or (``text`` given) once ``of`` finished, as the next
    turn of its conversation: ``of``'s prompt, its output, then ``text``."""

    of: Optional[int] = None
    tokens: int = 0
    text: Optional[list[int]] = None


@dataclass
class Job:
    """One request of the workload and what it produced."""

    prompt: list[int]
    max_new: int
    arrival: Arrival
    tokens: list[int] = field(default_factory=list)
    """Generated tokens."""
    logits: Optional[np.ndarray[Any, np.dtype[np.float32]]] = None
    """The logits that chose the last token."""
    reused: int = 0
    """Prompt tokens reused from the prefix cache at admission."""

    @property
    def finished(self) -> bool:
        return len(self.tokens) == self.max_new


def checkpoint_grid(page_size: int) -> int:
    """The checkpoint grid the engine asks for: two pages, 16 to 256 tokens, at least a
    page."""
    return max(min(max(2 * page_size, 16), 256), page_size)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def workload(kind: str, page_size: int, seed: int) -> list[Job]:
    """The jobs of ``kind`` at page size ``page_size``."""
    rng = random.Random(seed)
    grid = checkpoint_grid(page_size)
    max_new = min(grid // 2, 16)
    if kind == "shared-prefix":
        # Five requests sharing one and a half grids (and a few tokens), then diverging:
        # two arrive together, the others while an earlier one decodes; the fourth
        # extends the third's prompt.
        shared = random_tokens(rng, grid + grid // 2 + 3)

        def own() -> list[int]:
            return random_tokens(rng, rng.randint(grid // 4, grid // 2))

        branch = shared + own()
        return [
            Job(shared + own(), max_new, Arrival()),
            Job(shared + own(), max_new, Arrival()),
            Job(branch, max_new, Arrival(of=0, tokens=1)),
            Job(branch + own(), max_new, Arrival(of=2, tokens=1)),
            Job(shared + own(), max_new, Arrival(of=0, tokens=max_new // 2)),
        ]
    if kind == "multi-turn":
        # Two conversations of three turns on a shared system prompt; job 2t + c is turn
        # t of conversation c; the second starts while the first one's first turn decodes.
        system = random_tokens(rng, grid + 5)
        jobs: list[Job] = []
        for turn in range(3):
            for c in range(2):
                text = random_tokens(rng, rng.randint(grid // 4, grid // 2))
                if turn == 0:
                    arrival = Arrival() if c == 0 else Arrival(of=0, tokens=1)
                    jobs.append(Job(system + text, max_new, arrival))
                else:
                    of = (turn - 1) * 2 + c
                    jobs.append(Job([], max_new, Arrival(of=of, text=text)))
        return jobs
    raise ValueError(f"unknown workload {kind!r}")


def arrive(jobs: list[Job], waiting: list[int], queue: list[int]) -> None:
    """Moves every waiting job whose arrival came to the back of the queue, in order; a
    follow-up turn gets its prompt here."""
    for j in list(waiting):
        a = jobs[j].arrival
        if a.of is not None:
            before = jobs[a.of]
            if a.text is not None and not before.finished:
                continue
            if a.text is None and len(before.tokens) < a.tokens:
                continue
            if a.text is not None:
                jobs[j].prompt = before.prompt + before.tokens + a.text
        waiting.remove(j)
        queue.append(j)
