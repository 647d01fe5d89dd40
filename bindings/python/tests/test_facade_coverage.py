"""Every public call of the Rust facade's ``HybridCache`` has its Python counterpart,
or a stated reason it has none: a new facade call without either fails here."""

import re
from pathlib import Path

import unikv

ROOT = Path(__file__).resolve().parents[3]

# Facade calls reached another way from Python, or deliberately Rust-only.
ELSEWHERE = {
    "builder": "the keyword constructor unikv.HybridCache(...)",
    "kv_geometry": "unikv.KvGeometry(cache)",
    "invariant_scope": "unikv.set_invariant_level / invariant_level",
    "step_view": "the unikv.StepMetadata object build_step_metadata returns",
    "build_step_metadata_on_host": "the host-built reference the benches time; "
    "Python engines get the device-built table",
    "translate": "the step and verify metadata translate on the device",
    "translate_many": "the step and verify metadata translate on the device",
    "allocator": "Rust-only inspection of the allocator trait object; Python has stats()",
    "tree": "Rust-only inspection of the radix tree; Python has stats()",
    "host_tree": "Rust-only inspection of the host tier's radix tree, as tree(); "
    "Python has stats().host and PrefixMatch.host_tokens",
    "export_table": "unikv.DeviceTable(cache, meta): the DLPack export",
    "make_stream_wait": "DeviceTable.__dlpack__(stream=...) orders the consumer's stream",
    "device_arc": "Rust-only: Python names the device by HybridCache(device=...)",
    "build_step_inputs": "Rust-only: the eager half of build_step_metadata, for a CUDA "
    "graph captured with CudaDevice::capture, which Python does not expose; Python "
    "engines call build_step_metadata",
    "translate_step_tables": "Rust-only: the captured half of build_step_metadata "
    "(see build_step_inputs)",
}


def facade_calls() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "src").rglob("*.rs"):
        text = path.read_text()
        for block in re.finditer(r"^impl HybridCache \{\n(.*?)^\}", text, re.S | re.M):
            names.update(re.findall(r"^    pub (?:unsafe )?fn (\w+)", block.group(1), re.M))
    return names


def test_every_facade_call_is_bound_or_says_why_not() -> None:
    calls = facade_calls()
    assert {"admit", "settle", "compact_accepted", "step_boundary"} <= calls
    unbound = sorted(
        name
        for name in calls
        if name not in ELSEWHERE and not hasattr(unikv.HybridCache, name)
    )
    assert unbound == [], f"facade calls with no Python counterpart: {unbound}"
    stale = sorted(set(ELSEWHERE) - calls)
    assert stale == [], f"reasons for calls the facade no longer has: {stale}"


def test_the_layout_and_the_running_state_slot_are_readable() -> None:
    cache = unikv.HybridCache(
        model="qwen3-next-80b-a3b", memory="8GiB", page_size=16, layout="static"
    )
    assert cache.layout == "static"
    assert cache.scratch_shape == {"width": 1, "entries_per_slot": 1}
    req = cache.admit(cache.match_prefix(list(range(32))))
    slot = req.state_slot
    assert slot is not None and slot > 0
    cache.release(req)
    plain = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB")
    assert plain.layout == "unified"
    req = plain.admit(plain.match_prefix([1, 2, 3]))
    assert req.state_slot is None
    plain.release(req)
