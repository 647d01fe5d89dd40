"""The host tier through Python (``HybridCache(host_memory_bytes=...)``): a finished
prompt the device evicts is written back to the host, a later prompt matches it there
(``PrefixMatch.host_tokens``) and admission loads it back, counted in
``stats().host``. On an SWA model (gpt-oss-20b) and a FULL + SWA + Mamba one."""

from typing import Any, Union

import pytest

import unikv
from unikv._unikv import _capacity

PS = 16

TINY_TRI = unikv.ModelSpec(
    name="tiny-tri",
    full_layers=2,
    swa_layers=2,
    mamba_layers=1,
    kv_heads=2,
    head_dim=16,
    window=32,
    conv_channels=16,
    conv_kernel=4,
    state_heads=2,
    state_head_dim=8,
    state_size=8,
)

Model = Union[str, unikv.ModelSpec]

# Each model with a device of a few dozen pages (a prompt of ten pages fills a quarter)
# and a host that holds many such prompts.
MODELS: list[tuple[Model, int, int]] = [
    ("gpt-oss-20b", 16 << 20, 128 << 20),
    (TINY_TRI, 192 << 10, 4 << 20),
]
IDS = ["gpt-oss-20b", "tiny-tri"]


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + t for t in range(n)]


FIRST = prompt(10 * PS + 1)
"""The prompt that goes to the host: ten pages and a token."""
NEXT_TURN = FIRST + prompt(PS + 1, base=50_000)
"""A prompt starting with all of ``FIRST``."""


def make(model: Model, memory: int, host: int) -> unikv.HybridCache:
    return unikv.HybridCache(
        model=model, memory=memory, page_size=PS, host_memory_bytes=host
    )


def finish(cache: unikv.HybridCache, tokens: list[int]) -> None:
    """Admits, prefills and finishes ``tokens``, then ends the step."""
    req = cache.admit(cache.match_prefix(tokens))
    cache.alloc_extend(req, req.remaining_prefill)
    cache.cache_finished(req)
    cache.step_boundary()


def host(cache: unikv.HybridCache) -> unikv.HostStats:
    h = cache.stats().host
    assert h is not None
    return h


def demote_all(cache: unikv.HybridCache) -> None:
    """Evicts every unlocked prefix through the eviction loop (which writes back; not
    ``evict_all``, a flush), a page more than the device could allocate at a time."""
    for _ in range(100):
        if cache.stats().full.evictable == 0:
            break
        cache.evict_to_free(full_pages=_capacity(cache)["full_schedulable_pages"] + 1)
    assert cache.stats().full.evictable == 0
    cache.step_boundary()


@pytest.mark.parametrize(("model", "memory", "host_bytes"), MODELS, ids=IDS)
def test_an_evicted_prompt_is_matched_on_the_host_and_admitted_cached(
    model: Model, memory: int, host_bytes: int
) -> None:
    cache = make(model, memory, host_bytes)
    finish(cache, FIRST)
    on_device = cache.match_prefix(NEXT_TURN)
    cached = on_device.cached_tokens
    assert cached >= 9 * PS
    assert (on_device.device_tokens, on_device.host_tokens) == (cached, 0)
    before = host(cache)
    assert before.total_bytes == host_bytes
    assert (before.written_bytes, before.loaded_bytes, before.hit_tokens) == (0, 0, 0)

    demote_all(cache)
    assert cache.stats().full.evictable == 0
    written = host(cache)
    assert written.written_bytes > 0 and written.full_bytes > 0
    assert written.peak_bytes >= written.full_bytes + written.swa_bytes
    assert written.loaded_bytes == 0

    hit = cache.match_prefix(NEXT_TURN)
    assert (hit.cached_tokens, hit.device_tokens, hit.host_tokens) == (cached, 0, cached)
    assert hit.kv_hit_tokens >= cached
    assert f"host_tokens={cached}" in repr(hit)
    load_bytes = hit.load_bytes
    assert load_bytes > 0
    assert cache.can_admit(hit)
    req = cache.admit(hit)
    with pytest.raises(unikv.InvalidArgument, match="admitted already"):
        hit.host_tokens
    assert req.cached_at_admission == cached
    assert req.len == cached
    assert req.remaining_prefill == len(NEXT_TURN) - cached
    cache.alloc_extend(req, req.remaining_prefill)
    cache.cache_finished(req)
    cache.step_boundary()

    loaded = host(cache)
    assert loaded.hit_tokens == cached
    assert loaded.loaded_bytes == load_bytes and loaded.copies > written.copies
    assert loaded.written_bytes == written.written_bytes
    assert cache.stats().hit_tokens == cached
    # The finished request cached it on the device again: the device serves it now.
    again = cache.match_prefix(NEXT_TURN)
    assert again.device_tokens == again.cached_tokens >= cached
    assert again.host_tokens == 0


@pytest.mark.parametrize(("model", "memory", "host_bytes"), MODELS, ids=IDS)
def test_prompts_that_fill_the_device_push_a_finished_one_to_the_host(
    model: Model, memory: int, host_bytes: int
) -> None:
    cache = make(model, memory, host_bytes)
    finish(cache, FIRST)
    cached = cache.match_prefix(NEXT_TURN).cached_tokens
    assert cached > 0
    written = [host(cache).written_bytes]
    # Enough other prompts of the same size to fill the device (no match meanwhile: a
    # match would make FIRST the most recently used).
    pages = -(-len(FIRST) // PS)
    for k in range(1, cache.stats().full.total // pages + 2):
        finish(cache, prompt(len(FIRST), base=1_000_000 * k))
        written.append(host(cache).written_bytes)
    hit = cache.match_prefix(NEXT_TURN)
    assert hit.device_tokens == 0
    assert hit.host_tokens == cached
    assert written[0] == 0 and written[-1] > 0
    assert written == sorted(written)
    req = cache.admit(hit)
    assert req.cached_at_admission == cached
    cache.release(req)
    cache.step_boundary()
    assert host(cache).hit_tokens == cached
    assert host(cache).loaded_bytes > 0


def test_without_a_host_tier_an_evicted_prompt_is_gone_and_stats_host_is_none() -> None:
    model, memory, _ = MODELS[0]
    for cache in (
        unikv.HybridCache(model=model, memory=memory, page_size=PS),
        make(model, memory, 0),
    ):
        assert cache.stats().host is None
        finish(cache, FIRST)
        demote_all(cache)
        hit = cache.match_prefix(NEXT_TURN)
        assert (hit.cached_tokens, hit.device_tokens, hit.host_tokens) == (0, 0, 0)
        assert cache.stats().host is None


def test_a_host_tier_too_small_for_a_page_is_a_configuration_error() -> None:
    for model, memory, _ in MODELS:
        with pytest.raises(unikv.InvalidArgument, match="host memory"):
            make(model, memory, 1)


@pytest.mark.parametrize("bad", ["64MiB", 1.5, None, [1 << 20]])
def test_host_memory_bytes_takes_an_int(bad: Any) -> None:
    model, memory, host_bytes = MODELS[0]
    assert make(model, memory, host_bytes).stats().host is not None
    with pytest.raises(TypeError, match=r"argument 'host_memory_bytes': '\w+' object"):
        unikv.HybridCache(model=model, memory=memory, host_memory_bytes=bad)


def test_the_host_figures_are_read_only() -> None:
    model, memory, host_bytes = MODELS[0]
    figures = host(make(model, memory, host_bytes))
    for name in ("total_bytes", "written_bytes", "hit_tokens", "refused_writes"):
        assert isinstance(getattr(figures, name), int)
        with pytest.raises(AttributeError):
            setattr(figures, name, 0)


def test_write_through_copies_a_prefix_once_cached_and_a_bad_policy_is_refused() -> None:
    prompt = list(range(100))
    written = []
    for policy in ("write_back", "write_through"):
        cache = unikv.HybridCache(
            model="gpt-oss-20b",
            memory=64 << 20,
            page_size=16,
            host_memory_bytes=64 << 20,
            host_write_policy=policy,
        )
        req = cache.admit(cache.match_prefix(prompt))
        cache.alloc_extend(req, req.remaining_prefill)
        cache.cache_finished(req)
        cache.step_boundary()
        host = cache.stats().host
        assert host is not None
        written.append(host.written_bytes)
    # Write-back waits for an eviction; write-through copied at the boundary.
    assert written[0] == 0 and written[1] > 0
    with pytest.raises(unikv.InvalidArgument, match="write_through_selective"):
        unikv.HybridCache(
            model="gpt-oss-20b",
            memory=64 << 20,
            host_memory_bytes=64 << 20,
            host_write_policy="lazy",
        )
    with pytest.raises(unikv.InvalidArgument, match="1 hit"):
        unikv.HybridCache(
            model="gpt-oss-20b",
            memory=64 << 20,
            host_memory_bytes=64 << 20,
            host_write_policy="write_through_selective",
            host_write_hits=0,
        )


def test_the_host_geometry_places_every_unit_in_the_host_buffer() -> None:
    cache = make("gpt-oss-20b", 16 << 20, 128 << 20)
    geometry = cache.host_geometry()
    assert geometry is not None
    frame = geometry["frame_bytes"]
    assert isinstance(frame, int) and frame > 0
    units, sizes = geometry["units_per_frame"], geometry["unit_bytes"]
    assert isinstance(units, list) and isinstance(sizes, list)
    assert all(u * b <= frame for u, b in zip(units, sizes))
    plain = unikv.HybridCache(model="gpt-oss-20b", memory=16 << 20, page_size=PS)
    assert plain.host_geometry() is None
