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


def test_verify_metadata_is_a_counted_numpy_view_of_its_inputs() -> None:
    import gc

    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b",
        memory="8GiB",
        page_size=16,
        speculation=unikv.Speculation.chain(3, max_batch=4),
    )
    reqs = decoding(cache, 2)
    meta = unikv.VerifyMetadata(4)
    cache.reserve_verify_metadata(meta)
    cache.alloc_verify(reqs, [3, 2])
    cache.build_verify_metadata(meta, reqs)
    cache.translate_verify(meta)
    lay = meta.layout
    inputs = meta.inputs
    assert inputs.dtype.name == "int32" and not inputs.flags.writeable
    assert len(inputs) == lay["inputs_len"]
    assert inputs[lay["widths"] : lay["widths"] + 2].tolist() == [4, 3]
    assert inputs[lay["settled"] : lay["settled"] + 2].tolist() == [40, 40]
    assert meta.device_tables is not None
    with pytest.raises(unikv.InvalidArgument, match="view"):
        cache.build_verify_metadata(meta, reqs)
    del inputs
    gc.collect()
    cache.build_verify_metadata(meta, reqs)  # no view left: allowed again
    cache.settle(reqs, [[1, 2], [3]])
    cache.step_boundary()
