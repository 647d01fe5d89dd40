"""The request lifecycle through Python: admit, prefill, decode, cache, hit, release."""

import pytest

import unikv


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + t for t in range(n)]


def test_a_finished_request_is_hit_by_the_next_one_with_its_prefix() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    first = cache.admit(cache.match_prefix(prompt(300)))
    cache.alloc_extend(first, 300)
    cache.alloc_decode([first], [7])
    assert first.len == 301
    cache.cache_finished(first)
    assert first.closed
    cache.step_boundary()

    hit = cache.match_prefix(prompt(300) + [7, 1, 2, 3])
    assert hit.prompt_len == 304
    assert hit.cached_tokens == 288  # whole pages of the first request's 301 tokens
    second = cache.admit(hit)
    assert second.cached_at_admission == 288
    assert second.remaining_prefill == 304 - 288
    cache.alloc_extend(second, second.remaining_prefill)
    tokens = cache.release(second)
    assert tokens == prompt(300) + [7, 1, 2, 3]
    report = cache.step_boundary()
    assert report.step == 2
    stats = cache.stats()
    assert stats.live_requests == 0
    assert stats.hit_tokens == 288


def test_a_recurrent_model_resumes_from_a_cached_state() -> None:
    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b", memory="8GiB", page_size=16, checkpoint_interval=64
    )
    first = cache.admit(cache.match_prefix(prompt(256)))
    cache.alloc_extend(first, 256)
    cache.cache_finished(first)
    cache.step_boundary()
    hit = cache.match_prefix(prompt(256) + [1, 2, 3])
    assert hit.cached_tokens == 256
    assert hit.kv_hit_tokens == 256
    req = cache.admit(hit)
    cache.alloc_extend(req, req.remaining_prefill)
    cache.release(req)
    assert cache.stats().mamba.total > 0


def test_a_batch_decodes_in_one_call_and_the_window_is_released() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    reqs = []
    for r in range(4):
        req = cache.admit(cache.match_prefix(prompt(200, base=10_000 * r)))
        cache.alloc_extend(req, 200)
        reqs.append(req)
    for step in range(300):
        cache.alloc_decode(reqs, [step] * 4)
        cache.step_boundary()
    assert [r.len for r in reqs] == [500] * 4
    # gpt-oss's window is 128 tokens: most of each request's SWA was released on the way.
    assert cache.release_out_of_window(reqs[0]) == 0
    for req in reqs:
        cache.cache_unfinished(req)
        cache.cache_finished(req)
    cache.step_boundary()
    assert cache.stats().live_requests == 0


@pytest.mark.parametrize("layout", ["static", "unified"])
def test_both_layouts_and_both_ways_of_giving_memory_build(layout: str) -> None:
    for memory in (1 << 30, "1GiB", "1073741824"):
        cache = unikv.HybridCache(
            model="gpt-oss-20b", memory=memory, page_size=1, layout=layout
        )
        assert cache.page_size == 1
        assert cache.step == 0
        assert "gpt-oss-20b" in repr(cache)


def test_construction_is_keyword_only_and_models_are_listed() -> None:
    with pytest.raises(TypeError):
        unikv.HybridCache("gpt-oss-20b", "1GiB")  # type: ignore[call-arg]
    assert "qwen3-next-80b-a3b" in unikv.models()
    assert unikv.__version__


def test_eviction_on_demand_and_a_flush() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="256MiB", page_size=16)
    for r in range(3):
        req = cache.admit(cache.match_prefix(prompt(320, base=10_000 * r)))
        cache.alloc_extend(req, 320)
        cache.cache_finished(req)
    cache.step_boundary()
    cached = cache.stats().full.evictable
    assert cached == 3 * 20
    cache.evict_to_free(full_pages=cache.stats().full.total)  # everything
    assert cache.stats().full.evictable == 0
    req = cache.admit(cache.match_prefix(prompt(320)))
    assert req.cached_at_admission == 0
    cache.alloc_extend(req, 320)
    cache.cache_finished(req)
    assert cache.evict_all() == 320
    with pytest.raises(unikv.OutOfMemory):
        cache.evict_to_free(full_pages=cache.stats().full.total + 1)


def test_a_reserved_step_shape_keeps_the_layout_fixed() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    cache.reserve_step_metadata(requests=8, max_len=1024, max_new_tokens=64)
    layouts = []
    for n in (2, 5):
        new = 60 // n  # within max_new_tokens
        reqs = [
            cache.admit(cache.match_prefix(prompt(new, base=1_000 * (n + r)))) for r in range(n)
        ]
        for req in reqs:
            cache.alloc_extend(req, new)
        meta = cache.build_step_metadata(reqs, new)
        layouts.append(meta.layout)
        del meta
        for req in reqs:
            cache.release(req)
        cache.step_boundary()
    offsets = [{k: v for k, v in lay.items() if k not in ("batch", "len")} for lay in layouts]
    assert offsets[0] == offsets[1]
    assert layouts[0]["max_batch"] == 8
