"""Token ids from any int32/int64 buffer or a list, with bad buffers refused."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

import unikv
from unikv._unikv import _token_ids_for_tests as ids


@pytest.mark.parametrize(
    "tokens",
    [
        [5, 6, 7],
        (5, 6, 7),
        array("q", [5, 6, 7]),
        array("i", [5, 6, 7]),
        array("I", [5, 6, 7]),
        np.array([5, 6, 7], dtype=np.int64),
        np.array([5, 6, 7], dtype=np.int32),
        np.array([5, 6, 7], dtype=np.uint32),
        memoryview(array("q", [5, 6, 7])),
    ],
)
def test_every_integer_buffer_and_list_gives_the_same_ids(tokens: unikv._unikv.Tokens) -> None:
    assert ids(tokens) == [5, 6, 7]


def test_a_large_prompt_goes_through_without_a_python_loop() -> None:
    prompt = np.arange(1_000_000, dtype=np.int64)
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="4GiB", page_size=16)
    hit = cache.match_prefix(prompt)
    assert hit.prompt_len == 1_000_000


@pytest.mark.parametrize(
    "tokens, message",
    [
        (np.array([1.0, 2.0]), "int32 or int64"),
        (np.array([1, 2], dtype=np.int16), "int32 or int64"),
        (b"\x01\x02", "int32 or int64"),
        (np.zeros((2, 2), dtype=np.int64), "one-dimensional"),
        (np.arange(10, dtype=np.int64)[::2], "contiguous"),
        (np.array([1, -1], dtype=np.int64), "not in 0"),
        ([1, 2**32], "not in 0"),
        (["a"], "list of ints"),
        (3.5, "buffer or a list"),
    ],
)
def test_bad_token_buffers_are_refused_clearly(tokens: object, message: str) -> None:
    with pytest.raises(unikv.InvalidArgument, match=message):
        ids(tokens)  # type: ignore[arg-type]
