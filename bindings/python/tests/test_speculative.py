"""Speculative verify and settle through Python: chains and trees, on time and late."""

import pytest

import unikv


def decoding(cache: unikv.HybridCache, n: int) -> list[unikv.Request]:
    reqs = []
    for r in range(n):
        req = cache.admit(cache.match_prefix([r * 10_000 + t for t in range(40)]))
        cache.alloc_extend(req, 40)
        reqs.append(req)
    return reqs


def test_a_chain_verify_reserves_its_positions_and_settling_keeps_the_accepted() -> None:
    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b",
        memory="8GiB",
        page_size=16,
        speculation=unikv.Speculation.chain(4),
    )
    (req,) = decoding(cache, 1)
    cache.alloc_verify([req], [4])
    assert req.unsettled_verifies == 1
    assert req.len == 45 and req.settled_len == 40
    cache.settle([req], [[7, 8, 9]])
    assert req.unsettled_verifies == 0
    assert req.settled_len == req.len == 43
    assert req.tokens()[-3:] == [7, 8, 9]
    cache.cache_finished(req)
    cache.step_boundary()


def test_counts_a_step_late_and_a_tree() -> None:
    cache = unikv.HybridCache(
        model="gpt-oss-20b",
        memory="1GiB",
        page_size=1,
        speculation=unikv.Speculation.tree(6, in_flight=2),
    )
    a, b = decoding(cache, 2)
    batch = unikv.Batch([a, b])
    parents = [-1, 0, 0, 1, 1, 2]
    cache.alloc_verify(batch, [parents, 3])
    cache.alloc_verify(batch, [parents, 2])  # before the first one settles
    assert a.unsettled_verifies == 2
    cache.settle(batch, [([0, 1, 3], [5, 6, 7]), [9]])
    cache.settle(batch, [([0, 2], [1, 2]), [4, 4, 4]])
    assert (a.settled_len, b.settled_len) == (45, 44)
    cache.release(a)
    cache.release(b)
    cache.step_boundary()


def test_bad_drafts_and_settlements_are_refused_and_change_nothing() -> None:
    plain = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    (req,) = decoding(plain, 1)
    with pytest.raises(unikv.InvalidArgument, match="without speculation"):
        plain.alloc_verify([req], [2])
    cache = unikv.HybridCache(
        model="gpt-oss-20b",
        memory="1GiB",
        page_size=16,
        speculation=unikv.Speculation(max_width=3),
    )
    (req,) = decoding(cache, 1)
    with pytest.raises(unikv.InvalidArgument, match="6 positions"):
        cache.alloc_verify([req], [5])
    with pytest.raises(unikv.InvalidArgument, match="parent"):
        cache.alloc_verify([req], [[-1, 5]])
    with pytest.raises(unikv.InvalidArgument, match="no unsettled verify"):
        cache.settle([req], [[1]])
    assert req.len == 40
    cache.alloc_verify([req], [2])
    with pytest.raises(unikv.InvalidArgument, match="accepted"):
        cache.settle([req], [[1, 2, 3, 4]])
    assert req.unsettled_verifies == 1
    cache.settle([req], [[1, 2, 3]])
    assert req.len == 43


def test_the_invariant_level_can_be_set_for_the_process() -> None:
    before = unikv.invariant_level()
    try:
        unikv.set_invariant_level("warn")
        assert unikv.invariant_level() == "warn"
        with pytest.raises(unikv.InvalidArgument, match="invalid"):
            unikv.set_invariant_level("loud")
    finally:
        unikv.set_invariant_level(None)
    assert unikv.invariant_level() == before
