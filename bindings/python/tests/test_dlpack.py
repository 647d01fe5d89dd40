"""DLPack export of the device tables (``unikv.DeviceTable``): read in place by
``numpy.from_dlpack`` on the CPU backend (and ``torch.from_dlpack`` on a GPU, when one
is lent), kept alive by the consumer's array, with no host sync."""

import ctypes
import gc
import importlib
import os
import sys
from typing import Any, Optional

import numpy as np
import pytest

import unikv


def running(cache: unikv.HybridCache, n: int, prompt: int) -> list[unikv.Request]:
    reqs = []
    for r in range(n):
        req = cache.admit(cache.match_prefix([r * 100_000 + t for t in range(prompt)]))
        cache.alloc_extend(req, prompt)
        reqs.append(req)
    return reqs


def decode_step(
    device: str, page_size: int = 16
) -> tuple[unikv.HybridCache, list[unikv.Request], unikv.StepMetadata]:
    """A cache on ``device`` with its step shapes reserved and one decode step built."""
    cache = unikv.HybridCache(
        model="gpt-oss-20b", memory="256MiB", page_size=page_size, device=device
    )
    cache.reserve_step_metadata(requests=8, max_len=256, max_new_tokens=1)
    reqs = running(cache, 3, 40)
    cache.step_boundary()
    meta = cache.decode_step(reqs, [1, 2, 3])
    return cache, reqs, meta


def test_numpy_reads_the_step_table_in_place_and_equal_to_the_host_read() -> None:
    cache, _, meta = decode_step("cpu")
    table = unikv.DeviceTable(cache, meta)
    assert table.__dlpack_device__() == (1, 0)
    assert table.device == "cpu"
    arr = np.from_dlpack(table)
    assert arr.dtype == np.int32 and arr.ndim == 1
    assert len(arr) == len(table) == meta.layout["len"]
    host = unikv.CpuBuffer(cache).read_step_table(meta)
    assert arr.tolist() == host.tolist()
    assert arr[: meta.header_len].tolist() == meta.host_image.tolist()
    # No copy: the array's data is the table's memory.
    assert arr.__array_interface__["data"][0] == table.address


def test_a_device_write_shows_through_the_array() -> None:
    cache, reqs, meta = decode_step("cpu")
    arr = np.from_dlpack(unikv.DeviceTable(cache, meta))
    before = arr.copy()
    # The next step's build rewrites the same device table in place (reserved shapes).
    cache.step_boundary()
    meta2 = cache.decode_step(reqs, [4, 5, 6])
    host = unikv.CpuBuffer(cache).read_step_table(meta2)
    assert unikv.DeviceTable(cache, meta2).address == unikv.DeviceTable(cache, meta).address
    assert arr.tolist() == host.tolist()
    assert arr.tolist() != before.tolist()  # the new tokens' write ids moved on


def test_the_array_keeps_the_cache_alive_after_del_cache() -> None:
    cache, reqs, meta = decode_step("cpu")
    expected = unikv.CpuBuffer(cache).read_step_table(meta).tolist()
    arr = np.from_dlpack(unikv.DeviceTable(cache, meta))
    del cache, reqs, meta
    gc.collect()
    junk = [np.full(4096, -7, dtype=np.int32) for _ in range(64)]  # reuse freed memory
    assert arr.tolist() == expected
    del junk


def test_an_unconsumed_capsule_releases_its_reference() -> None:
    cache, _, meta = decode_step("cpu")
    table = unikv.DeviceTable(cache, meta)
    before = sys.getrefcount(table)
    capsule = table.__dlpack__()
    assert sys.getrefcount(table) == before + 1
    del capsule  # never consumed: its destructor runs the deleter
    assert sys.getrefcount(table) == before
    arr = np.from_dlpack(table)
    assert sys.getrefcount(table) == before + 1
    del arr  # consumed: numpy's array runs the deleter when it dies
    gc.collect()
    assert sys.getrefcount(table) == before


def test_bad_keyword_values_raise_clear_exceptions() -> None:
    cache, _, meta = decode_step("cpu")
    table = unikv.DeviceTable(cache, meta)
    with pytest.raises(unikv.InvalidArgument, match="CPU table"):
        table.__dlpack__(stream=1)
    with pytest.raises(BufferError, match="copy=True"):
        table.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="dl_device"):
        table.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError):
        table.__dlpack__(stream="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        table.__dlpack__(max_version="1.0")  # type: ignore[arg-type]
    # What the array API allows: an unversioned capsule for any max_version.
    capsule: Any = table.__dlpack__(max_version=(1, 0), dl_device=(1, 0), copy=False)
    assert "dltensor" in repr(capsule)
    with pytest.raises(unikv.InvalidArgument, match="part"):
        unikv.DeviceTable(cache, meta, "inputs")
    with pytest.raises(unikv.InvalidArgument, match="metadata"):
        unikv.DeviceTable(cache, object())  # type: ignore[arg-type]
    with pytest.raises(unikv.InvalidArgument, match="device"):
        unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", device="tpu")


def test_stale_metadata_is_refused() -> None:
    cache, reqs, meta = decode_step("cpu")
    cache.step_boundary()
    # A new request's pages: the tables changed since the build.
    running(cache, 1, 100)
    with pytest.raises(unikv.InvalidArgument):
        unikv.DeviceTable(cache, meta)


def test_the_null_backend_refuses_to_export() -> None:
    cache, _, meta = decode_step("none")
    with pytest.raises(unikv.DeviceError, match="no table memory to export"):
        unikv.DeviceTable(cache, meta)


def test_verify_tables_export_inputs_and_outputs() -> None:
    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b",
        memory="8GiB",
        page_size=16,
        speculation=unikv.Speculation.chain(3, max_batch=4),
    )
    reqs = running(cache, 2, 40)
    cache.step_boundary()
    meta = unikv.VerifyMetadata(4)
    with pytest.raises(unikv.InvalidArgument, match="not built"):
        unikv.DeviceTable(cache, meta, "inputs")
    cache.reserve_verify_metadata(meta)
    cache.alloc_verify(reqs, [3, 2])
    cache.build_verify_metadata(meta, reqs)
    cache.translate_verify(meta)
    lay = meta.layout
    inputs = np.from_dlpack(unikv.DeviceTable(cache, meta, "inputs"))
    assert inputs.tolist() == meta.inputs.tolist()
    outputs = np.from_dlpack(unikv.DeviceTable(cache, meta, part="outputs"))
    assert len(outputs) == lay["outputs_len"]
    writes = outputs[lay["write_full"] : lay["write_full"] + 4]
    assert (writes > 0).all()  # the first request's 4 verify positions have rows
    with pytest.raises(unikv.InvalidArgument, match="part"):
        unikv.DeviceTable(cache, meta)
    del inputs, outputs
    gc.collect()
    cache.settle(reqs, [[1, 2], [3]])
    cache.step_boundary()


def test_the_export_issues_no_host_sync_on_a_ledger() -> None:
    cache, _, meta = decode_step("ledger(cpu)")
    cache.step_boundary()
    unikv._unikv._reset_ledger(cache)
    reqs = running(cache, 1, 10)
    meta = cache.decode_step(reqs, [5])
    arr = np.from_dlpack(unikv.DeviceTable(cache, meta))
    assert arr.tolist() == unikv.CpuBuffer(cache).read_step_table(meta).tolist()
    ops = unikv._unikv._ledger_ops(cache)
    assert "translate_lanes" in ops  # the ledger saw the step's device work
    assert unikv._unikv._host_syncs(cache) == 0
    with pytest.raises(unikv.InvalidArgument, match="ledger"):
        unikv._unikv._host_syncs(unikv.HybridCache(model="gpt-oss-20b", memory="64MiB"))


def test_cuda_is_a_clear_error_without_a_cuda_build_or_gpu() -> None:
    try:
        unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", device="cuda")
    except unikv.DeviceError as e:
        assert "cuda" in str(e).lower()
    with pytest.raises(unikv.InvalidArgument, match="device"):
        unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", device="cuda:x")


# ----- the GPU check (when a device is lent) ---------------------------------------------


def cuda_cache_or_skip() -> Optional[str]:
    """Why the GPU check cannot run here, or ``None`` when it can."""
    try:
        unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", device="cuda")
    except unikv.DeviceError as e:
        return f"no CUDA backend: {e}"
    return None


def read_device_int32s(address: int, n: int) -> list[int]:
    """``n`` int32s at a ``CUdeviceptr``, copied with the driver (``cuMemcpyDtoH``)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    out = (ctypes.c_int32 * n)()
    rc = cuda.cuMemcpyDtoH_v2(out, ctypes.c_uint64(address), ctypes.c_size_t(4 * n))
    assert rc == 0, f"cuMemcpyDtoH: CUresult {rc}"
    return list(out)


def test_gpu_the_dlpack_step_table_equals_the_host_table_with_no_host_sync() -> None:
    reason = cuda_cache_or_skip()
    if reason is not None:
        if os.environ.get("UNIKV_REQUIRE_GPU") == "1":
            pytest.fail(f"UNIKV_REQUIRE_GPU=1 but {reason}")
        pytest.skip(f"SKIPPED (needs a GPU): {reason}")
    # The same steps on the CPU backend give the host's table to compare with.
    cpu_cache, cpu_reqs, _ = decode_step("cpu")
    gpu_cache, gpu_reqs, _ = decode_step("ledger(cuda)")
    cpu_cache.step_boundary()
    gpu_cache.step_boundary()
    unikv._unikv._reset_ledger(gpu_cache)
    cpu_meta = cpu_cache.decode_step(cpu_reqs, [9, 8, 7])
    gpu_meta = gpu_cache.decode_step(gpu_reqs, [9, 8, 7])
    table = unikv.DeviceTable(gpu_cache, gpu_meta)
    assert table.__dlpack_device__()[0] == 2
    expected = unikv.CpuBuffer(cpu_cache).read_step_table(cpu_meta).tolist()
    assert gpu_meta.host_image.tolist() == expected[: gpu_meta.header_len]
    torch: Any = None
    try:  # imported by name: CI need not install torch (a multi-GB CUDA wheel)
        torch = importlib.import_module("torch")
    except ImportError:
        pass
    if torch is not None:
        tensor = torch.from_dlpack(table)  # orders torch's stream by an event
        assert unikv._unikv._host_syncs(gpu_cache) == 0, unikv._unikv._ledger_ops(gpu_cache)
        assert tensor.device.type == "cuda" and tensor.data_ptr() == table.address
        got = tensor.cpu().tolist()  # torch's sync, not the cache's
    else:
        capsule = table.__dlpack__(stream=None)  # the legacy stream waits for the cache's
        assert unikv._unikv._host_syncs(gpu_cache) == 0, unikv._unikv._ledger_ops(gpu_cache)
        got = read_device_int32s(table.address, len(table))  # cuMemcpyDtoH: synchronous
        del capsule
    assert got == expected
    assert unikv._unikv._host_syncs(gpu_cache) == 0, unikv._unikv._ledger_ops(gpu_cache)
