"""The Python example engine (``examples/python``): the tiny hybrid decoder served
through unikv with its K/V and state in the cache's buffer gives outputs identical, bit
for bit, with reuse on and off and to a contiguous reference, at page sizes 1, 16 and
256; and reuse happened, so the comparison cannot pass vacuously."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "python"))

import tiny_engine  # noqa: E402
import tiny_serve  # noqa: E402
from tiny_model import F32, State  # noqa: E402

import unikv  # noqa: E402


@pytest.mark.parametrize("page_size", [1, 16, 256])
def test_outputs_are_identical_with_reuse_on_and_off(page_size: int) -> None:
    rows = tiny_engine.run_matrix(page_sizes=[page_size], out=False)
    assert len(rows) == 2 * 2 * 2  # two workloads, two layouts, reuse off and on
    for row in rows:
        assert row.diff is None, row.diff
        s = row.stats
        if row.cfg.reuse:
            assert s.prefix_hits > 0
            assert s.resumes_checked == s.prefix_hits
            assert s.prefill_tokens < s.prompt_tokens
        else:
            assert s.prefix_hits == 0 and s.kv_hit_tokens == 0
            assert s.prefill_tokens == s.prompt_tokens
        assert all(job.finished for job in row.jobs)


def test_a_wrong_resumed_state_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # An engine that corrupts the state it loads from a slot: every run's outputs differ
    # from the reference, and with reuse on the resumed-state check names the resume.
    load = tiny_serve.load_state

    def flipped(buf: unikv.CpuBuffer, geo: unikv.KvGeometry, slot: int) -> State:
        state = load(buf, geo, slot)
        state.temporal[0] = state.temporal[0] + F32(1e-3)
        return state

    monkeypatch.setattr(tiny_serve, "load_state", flipped)
    rows = tiny_engine.run_matrix(page_sizes=[16], layouts=["unified"], out=False)
    assert all(r.diff is not None for r in rows)
    assert all("state resumed" in str(r.diff) for r in rows if r.cfg.reuse)


def test_the_buffer_round_trips_rows_and_refuses_ranges_outside_it() -> None:
    from tiny_model import SPEC

    cache = unikv.HybridCache(model=SPEC, memory=1 << 20, page_size=16)
    buf = unikv.CpuBuffer(cache)
    geo = buf.geometry
    assert geo.full_row_bytes == geo.swa_row_bytes == 8 * 4
    off = geo.row_offsets("full", [1, 2, 17], 1, value=True)
    assert off.tolist() == [(k + 3 * 16) * 32 for k in (1, 2, 17)]
    rows = np.arange(24, dtype=np.float32).reshape(3, 8)
    buf.write(off, rows)
    back = buf.read(off, 32).view(np.float32)
    np.testing.assert_array_equal(back, rows)
    with pytest.raises(unikv.InvalidArgument):
        buf.read([1 << 40], 4)
    with pytest.raises(unikv.InvalidArgument):
        geo.row_offsets("swa", [1], 2, value=False)  # two SWA layers
    with pytest.raises(unikv.InvalidArgument):
        unikv.CpuBuffer(unikv.HybridCache(model=SPEC, memory=1 << 20, device="none"))
