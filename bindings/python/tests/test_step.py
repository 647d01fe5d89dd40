"""Step metadata: a numpy view of the host-written header, safe to keep."""

import gc

import numpy as np

import unikv


def running(cache: unikv.HybridCache, n: int, prompt: int) -> list[unikv.Request]:
    reqs = []
    for r in range(n):
        req = cache.admit(cache.match_prefix([r * 100_000 + t for t in range(prompt)]))
        cache.alloc_extend(req, prompt)
        reqs.append(req)
    return reqs


def test_the_header_is_a_numpy_view_with_its_layout() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    reqs = running(cache, 3, 40)
    cache.alloc_decode(reqs, [1, 2, 3])
    meta = cache.build_step_metadata(reqs)
    img = meta.host_image
    assert img.dtype == np.int32
    assert img.base is not None  # a view, not a copy
    assert not img.flags.writeable
    lay = meta.layout
    assert lay["batch"] == 3
    assert meta.header_len == lay["full_pages"] <= len(img)
    q = img[lay["query_starts"] : lay["query_starts"] + 4]
    assert q.tolist() == [0, 1, 2, 3]
    full = img[lay["full_starts"] : lay["full_starts"] + 4]
    assert full.tolist() == [0, 3, 6, 9]  # 41 rows: three pages of 16 each
    writes = img[lay["write_full"] : lay["write_full"] + 3]
    assert (writes > 0).all()  # kernel ids of the new tokens (0 is the sink)
    assert meta.device_table is not None
    cache.step_boundary()


def test_a_view_kept_past_the_next_build_still_reads_its_own_step() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=1)
    reqs = running(cache, 2, 10)
    cache.alloc_decode(reqs, [1, 2])
    first = cache.build_step_metadata(reqs).host_image
    kept = first.copy()
    for step in range(20):
        cache.alloc_decode(reqs, [step, step])
        cache.build_step_metadata(reqs)
        cache.step_boundary()
    np.testing.assert_array_equal(first, kept)


def test_a_dropped_view_lets_the_next_build_reuse_its_object() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=1)
    reqs = running(cache, 2, 10)
    ids = set()
    for step in range(5):
        cache.alloc_decode(reqs, [step, step])
        meta = cache.build_step_metadata(reqs)
        ids.add(id(meta))
        img = meta.host_image
        assert img[meta.layout["query_starts"] + 2] == 2
        del meta, img
        gc.collect()
        cache.step_boundary()
    assert len(ids) == 1


def test_a_finished_request_in_the_batch_is_refused() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    (req,) = running(cache, 1, 20)
    cache.cache_finished(req)
    try:
        cache.build_step_metadata([req], 1)
    except unikv.InvalidArgument as e:
        assert "finished or released" in str(e)
    else:
        raise AssertionError("a finished request was accepted")


def test_a_batch_object_serves_every_step_and_refuses_a_duplicate() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16, device="none")
    reqs = running(cache, 3, 20)
    batch = unikv.Batch(reqs)
    assert len(batch) == 3
    assert [r.id for r in batch.requests] == [r.id for r in reqs]
    for step in range(3):
        cache.alloc_decode(batch, np.full(3, step, dtype=np.int64))
        meta = cache.build_step_metadata(batch, np.ones(3, dtype=np.int32))
        assert meta.layout["batch"] == 3
        del meta
        cache.step_boundary()
    assert [r.len for r in reqs] == [23, 23, 23]
    try:
        unikv.Batch([reqs[0], reqs[0]])
    except unikv.InvalidArgument as e:
        assert "twice" in str(e)
    else:
        raise AssertionError("a duplicate was accepted")


def test_new_token_counts_must_match_the_batch() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    reqs = running(cache, 2, 20)
    cache.alloc_decode(reqs, [1, 2])
    try:
        cache.build_step_metadata(reqs, [1, 1, 1])
    except unikv.InvalidArgument as e:
        assert "3 counts for 2 requests" in str(e)
    else:
        raise AssertionError("a count per request was not checked")


def test_decode_step_is_alloc_decode_then_the_metadata() -> None:
    def build(fused: bool) -> list[int]:
        cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
        reqs = running(cache, 3, 40)
        out: list[int] = []
        for step in range(20):
            tokens = np.full(3, step, dtype=np.int64)
            if fused:
                meta = cache.decode_step(reqs, tokens)
            else:
                cache.alloc_decode(reqs, tokens)
                meta = cache.build_step_metadata(reqs)
            out += meta.host_image.tolist()
            del meta
            cache.step_boundary()
        assert [r.len for r in reqs] == [60, 60, 60]
        return out

    assert build(fused=True) == build(fused=False)
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    reqs = running(cache, 2, 40)
    try:
        cache.decode_step(reqs, [1])
    except unikv.InvalidArgument as e:
        assert "2 requests but 1 next tokens" in str(e)
    else:
        raise AssertionError("a short token list was accepted")
    assert [r.len for r in reqs] == [40, 40]
