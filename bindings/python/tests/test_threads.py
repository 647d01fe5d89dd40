"""The GIL is released during calls, and calls from several threads never corrupt."""

import threading
import time

import numpy as np

import unikv


def test_another_thread_runs_during_a_long_call() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="16GiB", page_size=1)
    prompt = np.arange(300_000, dtype=np.int64)
    req = cache.admit(cache.match_prefix(prompt))
    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        before = ticks[0]
        cache.alloc_extend(req, 300_000)  # long: about 0.1 s in Rust
        during = ticks[0] - before
    finally:
        stop.set()
        counter.join()
    assert during > 1_000, f"the counting thread made {during} steps during the call"
    cache.release(req)


def test_threads_sharing_a_cache_leave_it_consistent() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="2GiB", page_size=16)
    errors: list[BaseException] = []

    def serve(base: int) -> None:
        try:
            for i in range(50):
                req = cache.admit(cache.match_prefix([base, i] + list(range(100))))
                cache.alloc_extend(req, req.remaining_prefill)
                cache.alloc_decode([req], [1])
                if i % 2:
                    cache.cache_finished(req)
                else:
                    cache.release(req)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(1_000_000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    cache.step_boundary()  # conservation and every invariant, strict
    assert cache.stats().live_requests == 0


def test_threads_building_step_metadata_on_one_cache_never_deadlock() -> None:
    # Each build releases the GIL; a second builder must never wait for a lock while
    # holding the GIL the first one needs back.
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    errors: list[BaseException] = []

    def build(base: int) -> None:
        try:
            req = cache.admit(cache.match_prefix([base + t for t in range(64)]))
            cache.alloc_extend(req, 64)
            for _ in range(300):
                meta = cache.build_step_metadata([req], 64)
                assert meta.layout["batch"] == 1
                assert cache.page_size == 16 and "gpt-oss" in repr(cache)
                del meta
            cache.release(req)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [
        threading.Thread(target=build, args=(1_000_000 * t,), daemon=True) for t in range(4)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a builder is stuck: a deadlock"
    assert errors == []


def test_a_second_threads_call_on_a_request_in_use_raises_or_works() -> None:
    cache = unikv.HybridCache(model="gpt-oss-20b", memory="16GiB", page_size=1)
    prompt = np.arange(300_001, dtype=np.int64)
    req = cache.admit(cache.match_prefix(prompt))
    worker = threading.Thread(target=cache.alloc_extend, args=(req, 300_000))
    worker.start()
    time.sleep(0.01)
    try:
        # A getter on the request in use raises unikv's exception, never pyo3's borrow
        # error, or reads a length the calls made.
        assert req.len in (1, 300_000)
    except unikv.InvalidArgument as e:
        assert "in use by another call" in str(e)
    try:
        cache.alloc_extend(req, 1)  # the worker's call may still hold the request
        second = "worked"
    except unikv.InvalidArgument as e:
        assert "in use by another call" in str(e)
        second = "raised"
    worker.join()
    # Never corrupted: the request holds exactly what the calls that ran allocated.
    assert req.len == (300_001 if second == "worked" else 300_000)
    cache.release(req)
    cache.step_boundary()
