"""Verify steps with their device values: counts a step late translated from the
engine's device values, a tree's accepted KV compacted on the device, and the values
table's own refusals."""

import numpy as np
import pytest

import unikv


def decoding(cache: unikv.HybridCache, n: int, prompt: int = 40) -> list[unikv.Request]:
    reqs = []
    for r in range(n):
        req = cache.admit(cache.match_prefix([r * 10_000 + t for t in range(prompt)]))
        cache.alloc_extend(req, prompt)
        reqs.append(req)
    return reqs


def write_ids(
    buf: unikv.CpuBuffer, meta: unikv.VerifyMetadata, request: int
) -> list[int]:
    lay = meta.layout
    out = buf.read_verify_outputs(meta)
    at = lay["write_full"] + request * lay["width"]
    return [int(v) for v in out[at : at + lay["width"]]]


def test_late_counts_shift_the_newest_verify_by_the_device_count() -> None:
    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b",
        memory="8GiB",
        page_size=1,
        speculation=unikv.Speculation.chain(3, in_flight=2, max_batch=2),
    )
    buf = unikv.CpuBuffer(cache)
    (req,) = decoding(cache, 1)
    meta = unikv.VerifyMetadata(2)
    cache.reserve_verify_metadata(meta)
    values = cache.device_values(4)
    cache.alloc_verify([req], [3])
    cache.alloc_verify([req], [3])  # before the first one's counts reach the host
    cache.build_verify_metadata(meta, [req])
    cache.translate_verify(meta)  # as if nothing were unsettled: offset 0
    at_zero = write_ids(buf, meta, 0)
    # The accept kernel wrote the first verify's count (2) on the device.
    values.write([2], at=0)
    cache.translate_verify(meta, accepted=(values, 0))
    at_two = write_ids(buf, meta, 0)
    assert at_two != at_zero
    # Two rows further into the rows the two verifies reserved.
    assert at_two[:2] == at_zero[2:]
    lay = meta.layout
    out = buf.read_verify_outputs(meta)
    # The input state is never one the verify writes.
    state_in = int(out[lay["state_in"]])
    state_out = out[lay["state_out"] : lay["state_out"] + lay["width"]].tolist()
    assert state_in != 0 and state_in not in state_out
    cache.settle([req], [[5, 6]])
    cache.settle([req], [[7]])
    assert req.settled_len == 43 and req.unsettled_verifies == 0
    cache.cache_finished(req)
    cache.step_boundary()


def test_a_tree_verifys_accepted_kv_is_compacted_on_the_device() -> None:
    cache = unikv.HybridCache(
        model="gpt-oss-20b",
        memory="1GiB",
        page_size=1,
        speculation=unikv.Speculation.tree(4, max_batch=1),
    )
    buf = unikv.CpuBuffer(cache)
    geo = buf.geometry
    (req,) = decoding(cache, 1)
    meta = unikv.VerifyMetadata(1)
    cache.alloc_verify([req], [[-1, 0, 0, 2]])
    cache.build_verify_metadata(meta, [req])
    cache.translate_verify(meta)
    ids = write_ids(buf, meta, 0)
    # Each node's layer-0 K row gets its own bytes.
    offsets = geo.row_offsets("full", ids, 0, value=False)
    rows = np.arange(4 * geo.full_row_bytes, dtype=np.uint8).reshape(4, -1) % 251
    rows = np.ascontiguousarray(rows + np.arange(4, dtype=np.uint8)[:, None])
    buf.write(offsets, rows)
    paths = cache.device_values(4, fill=-1)
    paths.write([0, 2, 3])  # the accepted path root → 2 → 3
    cache.compact_accepted(meta, (paths, 0))
    got = buf.read(offsets, geo.full_row_bytes)
    assert (got[0] == rows[0]).all()
    assert (got[1] == rows[2]).all() and (got[2] == rows[3]).all()
    cache.settle([req], [([0, 2, 3], [7, 8, 9])])
    assert req.settled_len == 43
    cache.release(req)
    cache.step_boundary()


def test_device_values_refuse_what_does_not_fit_and_tables_of_another_cache() -> None:
    spec = unikv.Speculation.chain(2, in_flight=2, max_batch=1)
    cache = unikv.HybridCache(
        model="gpt-oss-20b", memory="1GiB", page_size=1, speculation=spec
    )
    other = unikv.HybridCache(
        model="gpt-oss-20b", memory="1GiB", page_size=1, speculation=spec
    )
    values = cache.device_values(2)
    assert len(values) == 2 and values.table > 0 and "DeviceValues" in repr(values)
    with pytest.raises(unikv.InvalidArgument, match="at least one entry"):
        cache.device_values(0)
    with pytest.raises(unikv.InvalidArgument, match="3 values from entry 0"):
        values.write([1, 2, 3])
    with pytest.raises(unikv.InvalidArgument, match="int32"):
        values.write([2**31])
    with pytest.raises(unikv.InvalidArgument, match="device values: a list of ints"):
        values.write(["a"])  # type: ignore[list-item]
    (req,) = decoding(cache, 1)
    meta = unikv.VerifyMetadata(1)
    cache.alloc_verify([req], [2])
    cache.build_verify_metadata(meta, [req])
    with pytest.raises(unikv.InvalidArgument, match="entry 2 of a table of 2"):
        cache.translate_verify(meta, accepted=(values, 2))
    with pytest.raises(unikv.InvalidArgument, match="last_nodes without accepted"):
        cache.translate_verify(meta, last_nodes=(values, 0))
    with pytest.raises(unikv.InvalidArgument, match="another cache's device"):
        cache.translate_verify(meta, accepted=(other.device_values(1), 0))
    cache.translate_verify(meta, accepted=(values, 0), last_nodes=(values, 1))
    del values  # freed on the device; the cache goes on
    cache.settle([req], [[1, 2]])
    cache.release(req)
    cache.step_boundary()
