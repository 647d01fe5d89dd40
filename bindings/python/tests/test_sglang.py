"""unikv.sglang against SGLang's allocator and prefix-cache contracts (numpy backend; the
torch tests skip when torch is absent)."""

from typing import Any

import numpy as np
import pytest

import unikv
import unikv.sglang as sg

PS = 16


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + t for t in range(n)]


def make(
    layout: str = "unified", memory: str = "64MiB"
) -> tuple[unikv.HybridCache, sg.TokenToKVPoolAllocator, sg.RadixCache]:
    cache = unikv.HybridCache(
        model="gpt-oss-20b", memory=memory, page_size=PS, layout=layout
    )
    allocator, tree = sg.adapter(cache, tensors="numpy")
    return cache, allocator, tree


def admit(tree: sg.RadixCache, tokens: list[int]) -> unikv.Request:
    return tree.inc_lock_ref(tree.match_prefix(tokens).last_device_node).request


def as_array(x: Any) -> "np.ndarray[Any, Any]":
    assert isinstance(x, np.ndarray)
    return x


@pytest.mark.parametrize("layout", ["unified", "static"])
def test_alloc_returns_int64_ids_and_available_size_comes_back_on_free(
    layout: str,
) -> None:
    cache, allocator, tree = make(layout)
    start = allocator.available_size()
    assert start > 0 and start % PS == 0
    req = admit(tree, prompt(100))
    out = as_array(allocator.alloc(100, req))
    assert out.dtype == np.int64 and out.shape == (100,)
    assert len(set(out.tolist())) == 100
    assert allocator.available_size() == start - 7 * PS  # ceil(100 / 16) pages
    assert np.array_equal(out, as_array(allocator.kv_indices(req)))
    allocator.free(req)
    assert req.closed
    assert allocator.available_size() == start  # before the step boundary
    cache.step_boundary()
    assert allocator.available_size() == start


def test_alloc_extend_returns_the_batch_rows_in_order() -> None:
    _, allocator, tree = make()
    reqs = [admit(tree, prompt(40, base=1000 * i)) for i in range(3)]
    out = as_array(allocator.alloc_extend(reqs, [40, 17, 33]))
    assert out.dtype == np.int64 and out.shape == (90,)
    rows = [as_array(allocator.kv_indices(r)) for r in reqs]
    assert np.array_equal(out, np.concatenate([rows[0], rows[1], rows[2]]))
    assert [r.len for r in reqs] == [40, 17, 33]
    # A second chunk continues the rows (SGLang's prefix_lens = the rows so far).
    more = as_array(allocator.alloc_extend(reqs[1:2], [20]))
    assert np.array_equal(more, as_array(allocator.kv_indices(reqs[1], start=17)))
    with pytest.raises(unikv.InvalidArgument):
        allocator.alloc_extend(reqs, [1, 2])


def test_alloc_decode_returns_one_id_per_request() -> None:
    _, allocator, tree = make()
    reqs = [admit(tree, prompt(31, base=1000 * i)) for i in range(4)]
    allocator.alloc_extend(reqs, [31] * 4)
    before = allocator.available_size()
    out = as_array(allocator.alloc_decode(unikv.Batch(reqs), np.array([7] * 4)))
    assert out.dtype == np.int64 and out.shape == (4,)
    assert [r.len for r in reqs] == [32] * 4
    assert out.tolist() == [int(as_array(allocator.kv_indices(r))[-1]) for r in reqs]
    assert allocator.available_size() == before  # row 31 ends a page: no new page
    allocator.alloc_decode(reqs, [8] * 4)
    assert allocator.available_size() == before - 4 * PS


def test_an_allocation_that_cannot_fit_returns_none_and_changes_nothing() -> None:
    _, allocator, tree = make(memory="16MiB")
    huge = admit(tree, prompt(100_000))
    small = admit(tree, prompt(10, base=500_000))
    before = allocator.available_size()
    assert allocator.alloc(100_000, huge) is None
    assert allocator.alloc_extend([small, huge], [10, 100_000]) is None
    assert (huge.len, small.len) == (0, 0)
    assert allocator.available_size() == before


def test_match_prefix_after_cache_finished_req_returns_the_cached_prefix() -> None:
    cache, allocator, tree = make()
    miss = tree.match_prefix(prompt(200))
    assert as_array(miss.device_indices).dtype == np.int64
    assert len(miss.device_indices) == 0 and miss.full_kv_hit_length == 0

    first = admit(tree, prompt(200))
    allocator.alloc_extend([first], [200])
    rows = as_array(allocator.kv_indices(first))
    tree.cache_finished_req(first)
    assert first.closed
    cache.step_boundary()

    hit = tree.match_prefix(np.array(prompt(200) + [1, 2], dtype=np.int64))
    assert len(hit.device_indices) == 192  # whole pages
    assert np.array_equal(as_array(hit.device_indices), rows[:192])
    assert hit.full_kv_hit_length == 192
    assert hit.last_host_node is hit.last_device_node
    assert hit.host_hit_length == 0
    # Locking the hit gives a request whose rows start with exactly those ids.
    second = tree.inc_lock_ref(hit.last_device_node).request
    assert np.array_equal(as_array(allocator.kv_indices(second)), rows[:192])
    allocator.free(second)


def test_lock_refs_protect_the_prefix_from_evict() -> None:
    cache, allocator, tree = make()
    first = admit(tree, prompt(160))
    allocator.alloc_extend([first], [160])
    tree.cache_finished_req(first)
    cache.step_boundary()
    assert (tree.evictable_size(), tree.protected_size()) == (160, 0)
    assert tree.total_size() == 160

    receipt = tree.inc_lock_ref(tree.match_prefix(prompt(170)).last_device_node)
    assert receipt.delta == -160
    assert (tree.evictable_size(), tree.protected_size()) == (0, 160)
    assert tree.swa_protected_size() > 0
    assert tree.evict(sg.EvictParams(num_tokens=10_000)) == sg.EvictResult()
    assert tree.protected_size() == 160

    released = tree.dec_lock_ref(receipt)
    assert receipt.request.closed
    assert released.delta == 160
    assert (tree.evictable_size(), tree.protected_size()) == (160, 0)
    evicted = tree.evict(1)
    assert evicted.num_tokens_evicted >= 1 and tree.evictable_size() < 160


def test_evict_gives_up_at_least_what_was_asked_and_reports_it() -> None:
    cache, allocator, tree = make()
    for i in range(4):
        req = admit(tree, prompt(64, base=10_000 * i))
        allocator.alloc_extend([req], [64])
        tree.cache_finished_req(req)
    cache.step_boundary()
    assert tree.evictable_size() == 4 * 64
    available = allocator.available_size()
    result = tree.evict(sg.EvictParams(num_tokens=available + 100))
    assert result.num_tokens_evicted >= 100
    assert tree.evictable_size() == 4 * 64 - result.num_tokens_evicted
    assert allocator.available_size() >= available + 100
    # More than all there is: everything unlocked goes.
    tree.evict(10**9)
    assert tree.evictable_size() == 0
    tree.reset()


def test_a_free_group_applies_its_frees_together_at_the_end() -> None:
    _, allocator, tree = make()
    start = allocator.available_size()
    reqs = [admit(tree, prompt(50, base=1000 * i)) for i in range(3)]
    allocator.alloc_extend(reqs, [50] * 3)
    after_alloc = allocator.available_size()
    allocator.free_group_begin()
    with pytest.raises(unikv.InvalidArgument):
        allocator.free_group_begin()
    for r in reqs:
        allocator.free(r)
    assert allocator.available_size() == after_alloc
    assert not any(r.closed for r in reqs)
    allocator.free_group_end()
    assert all(r.closed for r in reqs)
    assert allocator.available_size() == start
    allocator.free_group_end()  # no group open: nothing, as SGLang's


def test_free_takes_a_request_not_indices() -> None:
    _, allocator, tree = make()
    req = admit(tree, prompt(20))
    out = allocator.alloc(20, req)
    with pytest.raises(TypeError, match="by request"):
        allocator.free(out)  # type: ignore[arg-type]
    allocator.free(req)
    with pytest.raises(unikv.InvalidArgument):
        allocator.free(req)


def test_swa_extras_translate_and_free_out_of_window_rows() -> None:
    cache, allocator, tree = make()
    req = admit(tree, prompt(64))
    allocator.alloc_extend([req], [64])
    full = as_array(allocator.kv_indices(req, side="full"))
    swa = as_array(allocator.kv_indices(req, side="swa"))
    assert full.dtype == np.int32 and swa.dtype == np.int32 and full.shape == (64,)
    virtual = as_array(allocator.kv_indices(req))
    assert np.array_equal(as_array(allocator.translate(virtual, "full")), full)
    assert np.array_equal(
        as_array(allocator.translate_loc_from_full_to_swa(virtual)), swa
    )
    assert (swa > 0).all()
    assert allocator.full_available_size() > 0 and allocator.swa_available_size() > 0
    for step in range(300):
        allocator.alloc_decode([req], [step])
        cache.step_boundary()
    assert allocator.free_swa(req) == 0  # decode released the window on the way
    swa = as_array(allocator.kv_indices(req, side="swa"))
    assert (swa[:64] == 0).all()  # left gpt-oss's 128-token window: the sink
    assert (swa[-128:] > 0).all()
    allocator.free(req)


def test_cache_unfinished_req_and_insert_keep_the_request_running() -> None:
    cache, allocator, tree = make()
    req = admit(tree, prompt(100))
    allocator.alloc_extend([req], [64])
    tree.cache_unfinished_req(req, chunked=True)
    assert tree.protected_size() == 64 and not req.closed
    allocator.alloc_extend([req], [36])
    result = tree.insert(req)
    assert result == sg.InsertResult(prefix_len=64, total_len=96)
    assert tree.protected_size() == 96
    tree.cache_finished_req(req, is_insert=False)
    assert req.closed
    cache.step_boundary()
    assert tree.protected_size() == 0 and tree.evictable_size() == 96


def test_the_backend_is_numpy_without_torch() -> None:
    if sg.torch_available():
        pytest.skip("torch is installed: the torch backend is tested instead")
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", page_size=PS)
    assert sg.TokenToKVPoolAllocator(cache).tensors == "numpy"
    with pytest.raises(unikv.InvalidArgument, match="torch"):
        sg.TokenToKVPoolAllocator(cache, tensors="torch")
    with pytest.raises(unikv.InvalidArgument):
        sg.TokenToKVPoolAllocator(cache, tensors="cupy")


def test_torch_tensors_come_back_when_torch_is_importable() -> None:
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (its only wheel is a multi-GB CUDA build)"
    )
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", page_size=PS)
    allocator, tree = sg.adapter(cache)
    assert allocator.tensors == "torch"
    req = tree.inc_lock_ref(
        tree.match_prefix(torch.arange(40, dtype=torch.int64)).last_device_node
    ).request
    out = allocator.alloc_extend([req], [40])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int64
    assert out.shape == (40,)
    dec = allocator.alloc_decode([req], torch.tensor([3], dtype=torch.int64))
    assert isinstance(dec, torch.Tensor) and dec.shape == (1,)
    swa = allocator.translate_loc_from_full_to_swa(out)
    assert isinstance(swa, torch.Tensor) and swa.dtype == torch.int32
    tree.cache_finished_req(req)
    cache.step_boundary()
    hit = tree.match_prefix(torch.arange(41, dtype=torch.int64))
    assert isinstance(hit.device_indices, torch.Tensor)
    assert torch.equal(hit.device_indices, out[:32])


def test_a_recurrent_model_matches_at_a_cached_state_and_evicts_it_with_its_node() -> None:
    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b", memory="2GiB", page_size=64, checkpoint_interval=64
    )
    allocator, tree = sg.adapter(cache, tensors="numpy")
    start = allocator.available_size()
    assert allocator.swa_available_size() == 0  # no sliding-window layers
    req = admit(tree, prompt(256))
    out = as_array(allocator.alloc_extend([req], [256]))
    # The state slots share the buffer's bytes with the KV: more than 256 tokens' worth.
    assert start - allocator.available_size() > 256
    tree.cache_finished_req(req)
    cache.step_boundary()
    hit = tree.match_prefix(prompt(256) + [1, 2])
    assert np.array_equal(as_array(hit.device_indices), out)
    result = tree.evict(10**6)
    assert result.num_tokens_evicted == 256 and result.mamba_num_evicted == 2
    assert allocator.available_size() == start


def test_a_host_hit_is_the_match_results_host_part_and_inc_lock_ref_loads_it() -> None:
    memory = 16 << 20
    host_bytes = sg.hicache_host_memory_bytes(
        enable_hierarchical_cache=True, hicache_ratio=8.0, memory=memory
    )
    cache = unikv.HybridCache(
        model="gpt-oss-20b", memory=memory, page_size=PS, host_memory_bytes=host_bytes
    )
    allocator, tree = sg.adapter(cache, tensors="numpy")
    first = prompt(10 * PS + 1)
    req = admit(tree, first)
    allocator.alloc_extend([req], [req.remaining_prefill])
    tree.cache_finished_req(req)
    cache.step_boundary()
    next_turn = first + prompt(PS + 1, base=50_000)
    on_device = tree.match_prefix(next_turn)
    n = len(on_device.device_indices)
    assert n >= 9 * PS
    assert on_device.host_hit_length == 0 and on_device.cache_protected_len == n

    # SGLang's eviction writes the prefix back to the host (unikv's write-back policy).
    evicted = tree.evict(sg.EvictParams(num_tokens=tree.evictable_size()))
    assert evicted.num_tokens_evicted >= n and tree.evictable_size() == 0
    cache.step_boundary()
    stats = cache.stats().host
    assert stats is not None and stats.written_bytes > 0

    match = tree.match_prefix(next_turn)
    assert len(as_array(match.device_indices)) == 0
    assert match.host_hit_length == n
    assert match.cache_protected_len == 0 and match.full_kv_hit_length >= n
    assert match.last_host_node is match.best_match_node
    # Locking is admission: the host part is loaded back into the request's own rows.
    req = tree.inc_lock_ref(match.last_host_node).request
    assert req.cached_at_admission == n
    ids = as_array(allocator.kv_indices(req))
    assert ids.shape == (n,) and len(set(ids.tolist())) == n
    assert req.remaining_prefill == len(next_turn) - n
    allocator.alloc_extend([req], [req.remaining_prefill])
    tree.cache_finished_req(req)
    cache.step_boundary()
    stats = cache.stats().host
    assert stats is not None and stats.hit_tokens == n and stats.loaded_bytes > 0
    again = tree.match_prefix(next_turn)
    assert again.host_hit_length == 0 and len(again.device_indices) >= n


def test_hicache_server_arguments_map_to_host_memory_bytes() -> None:
    assert sg.hicache_host_memory_bytes(enable_hierarchical_cache=False) == 0
    assert (
        sg.hicache_host_memory_bytes(enable_hierarchical_cache=True, hicache_size=4)
        == 4 * 10**9
    )
    by_ratio = sg.hicache_host_memory_bytes(
        enable_hierarchical_cache=True, hicache_ratio=2.0, memory=64 << 20
    )
    assert by_ratio == 128 << 20
    cache = unikv.HybridCache(
        model="gpt-oss-20b", memory=64 << 20, host_memory_bytes=by_ratio
    )
    stats = cache.stats().host
    assert stats is not None and stats.total_bytes == by_ratio
    with pytest.raises(unikv.InvalidArgument, match="memory"):
        sg.hicache_host_memory_bytes(enable_hierarchical_cache=True)
    for policy in sg.HICACHE_WRITE_POLICIES:
        assert (
            sg.hicache_host_memory_bytes(
                enable_hierarchical_cache=True,
                hicache_size=1,
                hicache_write_policy=policy,
            )
            == 10**9
        )
    with pytest.raises(unikv.InvalidArgument, match="write_through"):
        sg.hicache_host_memory_bytes(
            enable_hierarchical_cache=True, hicache_size=1, hicache_write_policy="lazy"
        )
    assert sg.HICACHE_WRITE_POLICIES == (
        "write_back",
        "write_through",
        "write_through_selective",
    )
