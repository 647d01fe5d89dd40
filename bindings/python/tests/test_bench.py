"""The decode-step benchmark runs end to end (its bar is checked by running the script
in release, not here: a debug build on a shared machine says nothing about speed)."""

import importlib.util
from pathlib import Path


def test_the_benchmark_runs_and_reports_both_sides(capsys: object) -> None:
    path = Path(__file__).parents[1] / "bench.py"
    spec = importlib.util.spec_from_file_location("unikv_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--batch", "8", "--prompt", "32", "--warmup", "2", "--steps", "10"])
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "python, two calls" in out and "python, decode_step" in out
    assert "rust " in out
