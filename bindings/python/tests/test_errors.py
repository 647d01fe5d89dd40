"""Errors: typed, with their numbers, never a crash, and nothing changed by a refusal."""

import pytest

import unikv


def cache() -> unikv.HybridCache:
    return unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)


def test_the_exceptions_form_one_hierarchy() -> None:
    for cls in (
        unikv.OutOfMemory,
        unikv.InvalidArgument,
        unikv.InvariantViolation,
        unikv.DeviceError,
        unikv.InternalError,
    ):
        assert issubclass(cls, unikv.Error)
    assert issubclass(unikv.Error, Exception)


def test_bad_configurations_are_invalid_arguments_naming_the_value() -> None:
    with pytest.raises(unikv.InvalidArgument, match="unknown model"):
        unikv.HybridCache(model="gpt-5", memory="1GiB")
    with pytest.raises(unikv.InvalidArgument, match="unknown layout"):
        unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", layout="paged")
    with pytest.raises(unikv.InvalidArgument, match="memory"):
        unikv.HybridCache(model="gpt-oss-20b", memory="lots")
    with pytest.raises(unikv.InvalidArgument, match="configuration"):
        unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=0)


def test_a_finished_request_or_admitted_match_cannot_be_used_again() -> None:
    c = cache()
    hit = c.match_prefix([1, 2, 3])
    req = c.admit(hit)
    with pytest.raises(unikv.InvalidArgument, match="admitted already"):
        c.admit(hit)
    with pytest.raises(unikv.InvalidArgument, match="admitted already"):
        hit.cached_tokens
    c.alloc_extend(req, 3)
    c.cache_finished(req)
    for use in (
        lambda: c.alloc_extend(req, 1),
        lambda: c.alloc_decode([req], [1]),
        lambda: c.cache_finished(req),
        lambda: c.release(req),
        lambda: req.len,
        lambda: req.tokens(),
    ):
        with pytest.raises(unikv.InvalidArgument, match="finished or released"):
            use()
    assert "closed" in repr(req)


def test_a_request_of_another_cache_is_refused_with_its_id() -> None:
    a, b = cache(), cache()
    req = a.admit(a.match_prefix([1, 2, 3]))
    with pytest.raises(unikv.InvalidArgument) as err:
        b.alloc_extend(req, 3)
    assert err.value.request == req.id
    a.alloc_extend(req, 3)  # unchanged: still usable in its own cache
    a.release(req)


def test_a_refused_call_changes_nothing() -> None:
    c = cache()
    req = c.admit(c.match_prefix(list(range(100))))
    with pytest.raises(unikv.InvalidArgument):
        c.alloc_extend(req, 101)  # past the prompt
    with pytest.raises(unikv.InvalidArgument, match="2 requests but 1 next tokens"):
        c.alloc_decode([req, req], [1])
    with pytest.raises(unikv.InvalidArgument, match="twice"):
        c.alloc_decode([req, req], [1, 2])
    assert req.len == 0
    assert req.remaining_prefill == 100
    c.alloc_extend(req, 100)
    assert req.len == 100
    c.release(req)
    c.step_boundary()


def test_out_of_memory_carries_the_demand_and_what_was_free() -> None:
    c = unikv.HybridCache(model="gpt-oss-20b", memory="64MiB", page_size=16)
    req = c.admit(c.match_prefix(list(range(1_000_000))))
    with pytest.raises(unikv.OutOfMemory) as err:
        c.alloc_extend(req, 1_000_000)
    e = err.value
    assert e.full_pages > e.full_available
    assert req.len == 0
    c.release(req)


def test_a_rust_panic_is_an_internal_error_not_a_crash() -> None:
    with pytest.raises(unikv.InternalError, match="a deliberate panic"):
        unikv._unikv._panic_for_tests()
