"""Models by catalogue name or from a Hugging Face config.json dict."""

import json
import math
from pathlib import Path

import pytest

import unikv

FIXTURES = Path(__file__).parents[3] / "crates" / "workload" / "tests" / "hf"

# Each published config and the catalogue model it describes.
CONFIGS = [
    ("gpt-oss-20b.json", "gpt-oss-20b"),
    ("gemma-4-31b.json", "gemma-4-31b"),
    ("qwen3-next-80b-a3b-instruct.json", "qwen3-next-80b-a3b"),
    ("nemotron-h-8b-base-8k.json", "nemotron-h-8b"),
]


def sides(cache: unikv.HybridCache) -> list[int]:
    s = cache.stats()
    return [s.full.total, s.swa.total, s.mamba.total]


@pytest.mark.parametrize("file, name", CONFIGS)
def test_a_published_config_builds_the_catalogue_models_cache(file: str, name: str) -> None:
    config = json.loads((FIXTURES / file).read_text())
    config["time_step_limit"] = [0.0, math.inf]  # as Nemotron-H publishes it
    from_config = unikv.HybridCache(
        model=config, model_name="mine", memory="8GiB", page_size=16
    )
    by_name = unikv.HybridCache(model=name, memory="8GiB", page_size=16)
    assert from_config.model == "mine"
    assert sides(from_config) == sides(by_name)


def test_a_config_it_cannot_map_names_the_field() -> None:
    config = json.loads((FIXTURES / "gpt-oss-20b.json").read_text())
    del config["num_key_value_heads"]
    with pytest.raises(unikv.InvalidArgument, match="num_key_value_heads"):
        unikv.HybridCache(model=config, memory="1GiB")
    with pytest.raises(unikv.InvalidArgument, match="model_type"):
        unikv.HybridCache(model={"model_type": "llama"}, memory="1GiB")
    with pytest.raises(unikv.InvalidArgument, match="config.x is a object"):
        unikv.HybridCache(model={"x": object()}, memory="1GiB")
    with pytest.raises(unikv.InvalidArgument, match="catalogue name"):
        unikv.HybridCache(model=42, memory="1GiB")  # type: ignore[arg-type]
