"""An SGLang-shaped adapter: the calls SGLang's scheduler makes on its token-to-KV
allocator and on its prefix cache, backed by one :class:`unikv.HybridCache`.

SGLang's scheduler talks to two objects that share the KV pools: a token-to-KV allocator
(``BaseTokenToKVPoolAllocator`` and the SWA allocator's extras) and a prefix cache
(``BasePrefixCache``). This module gives both, over one cache::

    cache = unikv.HybridCache(model="gpt-oss-20b", memory="1GiB", page_size=16)
    allocator, tree_cache = unikv.sglang.adapter(cache)

    match = tree_cache.match_prefix(prompt)          # MatchResult, nothing locked
    req = tree_cache.inc_lock_ref(match.last_device_node).request
    out_cache_loc = allocator.alloc_extend([req], [req.remaining_prefill])
    ...
    out_cache_loc = allocator.alloc_decode([req], [next_token])
    tree_cache.cache_finished_req(req)
    cache.step_boundary()                            # once per scheduler step

SGLang's HiCache (a host tier) is the cache's ``host_memory_bytes``
(:func:`hicache_host_memory_bytes` maps the server arguments); a match's host part is
``MatchResult.host_hit_length``, loaded back by ``inc_lock_ref``.

unikv owns the request-to-token rows: a request's KV indices are its rows, allocated by
the request and freed with it. So the calls that take a batch's lengths and last
locations in SGLang take the requests here, and ``free`` takes a request, not indices.
``bindings/python/SGLANG.md`` says method by method what maps exactly and what differs.

Indices come back as torch tensors (on the CPU) when torch is importable, numpy arrays
otherwise (``tensors="numpy"`` or ``"torch"`` forces one): int64 virtual token ids (what
SGLang's ``req_to_token`` holds and its unified pool hands out), and int32 kernel ids
where a call translates them to one side (``translate_loc_from_full_to_swa``,
``kv_indices(side=...)``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import numpy as np
import numpy.typing as npt

from . import _unikv
from ._unikv import (
    Batch,
    HybridCache,
    InvalidArgument,
    OutOfMemory,
    PrefixMatch,
    Request,
    Stats,
)

__all__ = [
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "HICACHE_WRITE_POLICIES",
    "IncLockRefResult",
    "Indices",
    "InsertResult",
    "MatchResult",
    "PrefixNode",
    "RadixCache",
    "TokenToKVPoolAllocator",
    "adapter",
    "hicache_host_memory_bytes",
    "torch_available",
]

Indices = Any
"""A one-dimensional index array: a CPU ``torch.Tensor`` when torch is the backend, else a
``numpy.ndarray`` (int64 virtual ids, int32 kernel ids)."""

Key = Any
"""Token ids: a list of ints, an int32/int64 numpy array or buffer, a CPU torch tensor, or
an object with ``token_ids`` (SGLang's ``RadixKey``) or ``key`` (``MatchPrefixParams``)."""

Requests = Union[Batch, Sequence[Request]]


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


_torch: Any = _import_torch()


def torch_available() -> bool:
    """Whether torch could be imported (then ``tensors="auto"`` returns torch tensors)."""
    return _torch is not None


def _backend(tensors: str) -> str:
    if tensors == "auto":
        return "torch" if _torch is not None else "numpy"
    if tensors == "torch" and _torch is None:
        raise InvalidArgument("tensors='torch' but torch cannot be imported")
    if tensors not in ("torch", "numpy"):
        raise InvalidArgument(
            f"tensors={tensors!r} (expected 'auto', 'torch' or 'numpy')"
        )
    return tensors


def _token_ids(key: Key) -> Any:
    """What the extension reads as token ids (see ``Key``)."""
    if not isinstance(key, (list, tuple, np.ndarray)):
        for attr in ("token_ids", "key"):
            inner = getattr(key, attr, None)
            if inner is not None:
                return _token_ids(inner)
    if _torch is not None and isinstance(key, _torch.Tensor):
        return key.detach().cpu().numpy()
    return key


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _deferred(side: _unikv.SideStats) -> int:
    """Pages freed in this step whose free the allocator has not applied yet: at a step
    boundary ``available + evictable + protected + held == total``; between boundaries
    the difference is what a free gave back and the next allocation short of memory (or
    the boundary) applies."""
    return max(
        0, side.total - side.available - side.evictable - side.protected - side.held
    )


class _Ids:
    """Turns the extension's little-endian id bytes into the adapter's arrays."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def out(self, array: npt.NDArray[Any]) -> Indices:
        if self.backend == "torch":
            return _torch.from_numpy(array)
        return array

    def virtual(self, raw: bytearray) -> npt.NDArray[np.int64]:
        return np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)

    def kernel(self, raw: bytearray) -> npt.NDArray[np.int32]:
        return np.frombuffer(raw, dtype="<i4").astype(np.int32, copy=False)


class TokenToKVPoolAllocator:
    """SGLang's token-to-KV allocator (``BaseTokenToKVPoolAllocator`` with the SWA
    allocator's extras) over a :class:`unikv.HybridCache`.

    Allocations are per request (unikv appends the new rows to the request) and return
    the new rows' int64 virtual ids in batch order, or ``None`` when they cannot fit even
    after evicting every unlocked prefix (SGLang's contract: ``None``, nothing
    allocated). Sizes are in tokens.
    """

    def __init__(self, cache: HybridCache, *, tensors: str = "auto") -> None:
        """Wraps ``cache``; ``tensors`` picks what indices come back as (``"auto"``:
        torch when importable, else numpy)."""
        self._cache = cache
        self._ids = _Ids(_backend(tensors))
        self.page_size: int = cache.page_size
        """Tokens per page."""
        self._group: Optional[list[Request]] = None

    @property
    def cache(self) -> HybridCache:
        """The cache behind the adapter."""
        return self._cache

    @property
    def tensors(self) -> str:
        """``"torch"`` or ``"numpy"``: what indices come back as."""
        return self._ids.backend

    # ----- sizes ---------------------------------------------------------------------

    def _free_pages(self) -> tuple[int, int, int]:
        """Pages a joint (FULL + SWA) allocation, FULL alone and SWA alone could get now
        without evicting (after compaction), counting the step's frees not applied yet."""
        stats = self._cache.stats()
        cap = _unikv._capacity(self._cache)
        d_full, d_swa = _deferred(stats.full), _deferred(stats.swa)
        has_swa = stats.swa.total > 0
        joint = cap["joint_schedulable_pages"] + (
            min(d_full, d_swa) if has_swa else d_full
        )
        full = cap["full_schedulable_pages"] + d_full
        swa = cap["swa_schedulable_pages"] + d_swa if has_swa else 0
        return joint, full, swa

    def available_size(self) -> int:
        """Tokens an allocation gets now without evicting (whole pages × page size): for a
        model with SWA layers, tokens with both FULL and SWA KV, as the SWA allocator's
        ``min(full, swa)`` and the unified pool's joint count. Frees of this step count
        at once (the allocator applies them before it would refuse). In the unified
        layout a free that gave back more FULL than SWA is counted by its SWA pages (a
        lower bound, exact again after the step boundary)."""
        return self._free_pages()[0] * self.page_size

    def full_available_size(self) -> int:
        """Tokens of FULL KV alone that could be allocated now (SWA allocator extra)."""
        return self._free_pages()[1] * self.page_size

    def swa_available_size(self) -> int:
        """Tokens of SWA KV alone that could be allocated now (SWA allocator extra; 0
        for a model without sliding-window layers)."""
        return self._free_pages()[2] * self.page_size

    # ----- allocation ----------------------------------------------------------------

    def alloc(self, need_size: int, request: Request) -> Optional[Indices]:
        """Allocates the next ``need_size`` prompt tokens of ``request`` and returns their
        ids (length ``need_size``), or ``None`` when they cannot fit. SGLang's ``alloc``
        takes only the count (page size 1); here the rows belong to the request."""
        return self.alloc_extend([request], [need_size])

    def alloc_extend(
        self, requests: Requests, extend_lens: Sequence[int]
    ) -> Optional[Indices]:
        """Allocates a prefill chunk of ``extend_lens[i]`` tokens for each request and
        returns the new rows' ids, request after request (length ``sum(extend_lens)``,
        SGLang's ``out_indices``), or ``None`` with nothing allocated when the chunk does
        not fit even after evicting unlocked prefixes.

        SGLang passes ``prefix_lens``, ``seq_lens`` and ``last_loc``; unikv knows them
        from the requests (prefix = ``request.len``, seq = prefix + extend).
        """
        reqs = list(requests.requests if isinstance(requests, Batch) else requests)
        lens = [int(n) for n in extend_lens]
        if len(lens) != len(reqs):
            raise InvalidArgument(
                f"{len(reqs)} requests but {len(lens)} extend lengths"
            )
        if any(n < 0 for n in lens):
            raise InvalidArgument(f"extend lengths must not be negative: {lens}")
        before = [r.len for r in reqs]
        if len(reqs) > 1:
            # All or nothing, as SGLang's: make room for the whole batch first (one
            # request's own allocation is atomic and evicts for itself).
            ps = self.page_size
            pages = sum(_pages(b + n, ps) - _pages(b, ps) for b, n in zip(before, lens))
            swa = pages if self._cache.stats().swa.total > 0 else 0
            try:
                _unikv._evict_to_free(self._cache, pages, swa)
            except OutOfMemory:
                return None
        for i, (req, n) in enumerate(zip(reqs, lens)):
            try:
                self._cache.alloc_extend(req, n)
            except OutOfMemory:
                if i == 0:
                    return None
                # Only recurrent state slots can run short after the room was made.
                raise
        return self._rows(reqs, before)

    def alloc_decode(self, requests: Requests, next_tokens: Any) -> Optional[Indices]:
        """Allocates one decode token for each request (``next_tokens``: the token each
        appends) and returns the new rows' ids (one per request, SGLang's
        ``out_indices`` of shape ``(bs,)``), or ``None`` with nothing allocated when they
        do not fit. SGLang passes ``seq_lens`` and ``last_loc``; unikv knows them, but
        needs the tokens (the prefix cache keys on them)."""
        try:
            self._cache.alloc_decode(requests, _token_ids(next_tokens))
        except OutOfMemory:
            return None
        reqs = list(requests.requests if isinstance(requests, Batch) else requests)
        return self._rows(reqs, [r.len - 1 for r in reqs])

    def _rows(self, reqs: Sequence[Request], starts: Sequence[int]) -> Indices:
        parts = [
            self._ids.virtual(_unikv._request_kv_indices(self._cache, r, "virtual", s))
            for r, s in zip(reqs, starts)
        ]
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._ids.out(out)

    # ----- frees -----------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Frees ``request``'s own KV without caching it (its rows past the prefix it
        shares with the prefix cache, whose lock it drops) and closes it. SGLang's
        ``free`` takes indices; unikv frees by request. Inside a free group the request
        is released at ``free_group_end``."""
        if not isinstance(request, Request):
            raise TypeError(
                "unikv.sglang frees by request (unikv owns the request-to-token rows); "
                f"got {type(request).__name__}"
            )
        if self._group is not None:
            if any(r is request for r in self._group):
                raise InvalidArgument(f"request {request.id} is freed twice in a group")
            self._group.append(request)
            return
        self._cache.release(request)

    def free_group_begin(self) -> None:
        """Opens a free group: frees until ``free_group_end`` are held and applied
        together (SGLang's contract; groups do not nest)."""
        if self._group is not None:
            raise InvalidArgument("free groups cannot be nested")
        self._group = []

    def free_group_end(self) -> None:
        """Closes the free group and releases every request freed in it, in order (the
        first error is raised after all were tried). Without an open group, nothing."""
        pending, self._group = self._group, None
        first: Optional[BaseException] = None
        for req in pending or []:
            try:
                self._cache.release(req)
            except _unikv.Error as e:
                first = first or e
        if first is not None:
            raise first

    def free_swa(self, request: Request) -> int:
        """Frees the SWA KV of ``request``'s rows that left the window (FULL stays) and
        returns the tokens freed. SGLang's ``free_swa`` takes the indices; unikv knows
        the window and the request's cursor."""
        return self._cache.release_out_of_window(request)

    # ----- ids ---------------------------------------------------------------------------

    def kv_indices(
        self,
        request: Request,
        side: str = "virtual",
        start: int = 0,
        end: Optional[int] = None,
    ) -> Indices:
        """``request``'s rows ``[start, end)``: SGLang's
        ``req_to_token[req.req_pool_idx, start:end]``. ``side="virtual"``: the int64
        virtual ids; ``"full"`` or ``"swa"``: their int32 kernel ids on that side (0, the
        sink, for a row whose SWA left the window)."""
        raw = _unikv._request_kv_indices(self._cache, request, side, start, end)
        if side == "virtual":
            return self._ids.out(self._ids.virtual(raw))
        return self._ids.out(self._ids.kernel(raw))

    def translate_loc_from_full_to_swa(self, kv_indices: Any) -> Indices:
        """The SWA kernel ids (int32) of virtual ids (0 where SWA is not bound), as the
        SWA allocator's full-to-SWA mapping gives them."""
        return self.translate(kv_indices, "swa")

    def translate(self, kv_indices: Any, side: str = "full") -> Indices:
        """The kernel ids (int32) of virtual ids on ``side`` (``"full"`` or ``"swa"``),
        read from the host tables."""
        raw = _unikv._kernel_ids(self._cache, _token_ids(kv_indices), side)
        return self._ids.out(self._ids.kernel(raw))

    # ----- scheduler hooks --------------------------------------------------------------

    def evict_to_free_tokens(self, tree_cache: RadixCache, num_tokens: int) -> None:
        """Evicts unlocked prefixes until ``num_tokens`` can be allocated (or nothing
        evictable remains), as SGLang's scheduler hook."""
        deficit = num_tokens - self.available_size()
        if deficit > 0:
            tree_cache.evict(EvictParams(num_tokens=deficit))

    def check_decode_capacity(self, *, num_tokens: int, tree_cache: RadixCache) -> bool:
        """Whether the next decode step's ``num_tokens`` fit, evicting first."""
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.available_size() >= num_tokens


@dataclasses.dataclass
class EvictParams:
    """SGLang's ``EvictParams``: tokens of FULL (with their SWA), SWA-only tokens, and
    Mamba states to evict."""

    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    """SGLang's ``EvictResult``: what an eviction gave up."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclasses.dataclass
class IncLockRefResult:
    """SGLang's ``IncLockRefResult`` receipt, plus the request the lock admitted."""

    delta: int
    """The change of ``evictable_size`` (≤ 0), as SGLang's radix cache reports it."""
    request: Request
    """The running request holding the lock (its rows start with the matched prefix)."""


@dataclasses.dataclass
class DecLockRefResult:
    """SGLang's ``DecLockRefResult``."""

    delta: int
    """The change of ``evictable_size`` (≥ 0)."""


@dataclasses.dataclass
class InsertResult:
    """SGLang's ``InsertResult`` (the fields unikv knows)."""

    prefix_len: int
    """Tokens of the request the prefix cache held for it before the insert."""
    total_len: int
    """Tokens of the request the prefix cache holds for it after the insert."""


class PrefixNode:
    """The handle a :class:`MatchResult` names as its last node: the match itself, which
    :meth:`RadixCache.inc_lock_ref` admits (once)."""

    def __init__(self, match: PrefixMatch) -> None:
        self.match = match
        """The cache's prefix match (consumed by ``inc_lock_ref``)."""

    def __repr__(self) -> str:
        return f"PrefixNode({self.match!r})"


class MatchResult(NamedTuple):
    """SGLang's ``MatchResult``: the cached prefix's ids and where the match ended. Every
    node is the same :class:`PrefixNode` (the match, device and host parts together);
    ``inc_lock_ref`` on it admits the request and loads the host part back."""

    device_indices: Indices
    """The int64 virtual ids of the reused prefix the device holds (whole pages)."""
    last_device_node: PrefixNode
    last_host_node: PrefixNode
    best_match_node: PrefixNode
    host_hit_length: int = 0
    """Tokens past ``device_indices`` that the host tier holds and admission loads back
    (``PrefixMatch.host_tokens``; 0 without a host tier)."""
    swa_host_hit_length: int = 0
    swa_branching_seqlen: Optional[int] = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: Optional[int] = None
    cache_protected_len: Optional[int] = None
    full_kv_hit_length: int = 0


class RadixCache:
    """SGLang's prefix cache (``BasePrefixCache``) over the allocator's
    :class:`unikv.HybridCache`: the same tree for FULL, SWA and Mamba state. Sizes are in
    tokens."""

    def __init__(self, token_to_kv_pool_allocator: TokenToKVPoolAllocator) -> None:
        """A prefix cache sharing ``token_to_kv_pool_allocator``'s cache."""
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self._cache = token_to_kv_pool_allocator.cache
        self._ids = token_to_kv_pool_allocator._ids
        self.page_size: int = self._cache.page_size
        """Tokens per page."""
        self.disable: bool = False
        """Always ``False``: the prefix cache is part of unikv's cache."""

    # ----- matching and locking ------------------------------------------------------

    def match_prefix(self, key: Key) -> MatchResult:
        """Matches ``key`` (the prompt) against the prefix cache; nothing is locked.
        ``device_indices`` are the ids of the reused prefix the device holds (whole
        pages, never the prompt's last token, whose forward gives the first output's
        logits); ``host_hit_length`` tokens after them are on the host tier, loaded back
        when ``inc_lock_ref`` admits the match."""
        tokens = _token_ids(key)
        match = self._cache.match_prefix(tokens)
        on_device = match.device_tokens
        if on_device:
            raw = _unikv._prefix_indices(self._cache, tokens, on_device)
            indices = self._ids.virtual(raw)
        else:
            indices = np.zeros(0, dtype=np.int64)
        node = PrefixNode(match)
        return MatchResult(
            device_indices=self._ids.out(indices),
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            host_hit_length=match.host_tokens,
            cache_protected_len=on_device,
            full_kv_hit_length=match.kv_hit_tokens,
        )

    def inc_lock_ref(self, node: PrefixNode) -> IncLockRefResult:
        """Locks the matched prefix for a new request and returns the receipt with the
        request (admission: a recurrent model's request also gets its state slot here,
        and a host hit is loaded back into the request's rows, SGLang's
        ``init_load_back``). Each lock is one request: a node is locked once."""
        before = self.evictable_size()
        request = self._cache.admit(node.match)
        return IncLockRefResult(delta=self.evictable_size() - before, request=request)

    def dec_lock_ref(
        self,
        node: Union[Request, IncLockRefResult],
        params: Optional[object] = None,
    ) -> DecLockRefResult:
        """Drops a request's lock: the request is released without caching (its own
        rows are freed too), since in unikv a lock lives exactly as long as its request.
        ``params`` (SGLang's ``DecLockRefParams``) is not needed: the request is the
        receipt."""
        request = node.request if isinstance(node, IncLockRefResult) else node
        before = self.evictable_size()
        self._cache.release(request)
        return DecLockRefResult(delta=self.evictable_size() - before)

    # ----- caching -----------------------------------------------------------------------

    def cache_finished_req(self, req: Request, is_insert: bool = True) -> None:
        """Finishes ``req``: its whole pages enter the prefix cache (duplicates and the
        partial last page are freed), its lock is dropped and it is closed. With
        ``is_insert=False`` it is released without caching."""
        if is_insert:
            self._cache.cache_finished(req)
        else:
            self._cache.release(req)

    def cache_unfinished_req(self, req: Request, chunked: bool = False) -> None:
        """Caches what ``req`` computed so far (after a prefill chunk) and keeps it
        running, locked on the cached prefix; its rows now read the cache's ids
        (``kv_indices`` gives them)."""
        del chunked  # unikv caches a chunk and a whole prefill alike
        self._cache.cache_unfinished(req)

    def insert(self, req: Request) -> InsertResult:
        """Inserts ``req``'s whole pages (as ``cache_unfinished_req``). SGLang's insert
        takes a key and any values; unikv's tree takes values only from a request's
        rows, so that its ids' ownership stays known."""
        _, before, _ = _unikv._request_rows(req)
        self._cache.cache_unfinished(req)
        _, after, _ = _unikv._request_rows(req)
        return InsertResult(prefix_len=before, total_len=after)

    # ----- eviction ----------------------------------------------------------------------

    def evict(self, params: Union[EvictParams, int]) -> EvictResult:
        """Evicts unlocked prefixes (least recently used first) until ``num_tokens`` more
        tokens (FULL with their SWA) and ``swa_num_tokens`` more SWA tokens can be
        allocated, or everything unlocked when that cannot be reached. Mamba states go
        with the nodes evicted (and an admission evicts them itself when short of
        slots), so ``mamba_num`` alone evicts nothing."""
        if isinstance(params, int):
            params = EvictParams(num_tokens=params)
        ps = self.page_size
        before = self._cache.stats()
        if params.num_tokens <= 0 and params.swa_num_tokens <= 0:
            return EvictResult()
        joint, _, swa_free = self.token_to_kv_pool_allocator._free_pages()
        has_swa = before.swa.total > 0
        full = joint + _pages(params.num_tokens, ps) if params.num_tokens > 0 else 0
        swa = 0
        if has_swa:
            swa = full
            if params.swa_num_tokens > 0:
                swa = max(swa, swa_free + _pages(params.swa_num_tokens, ps))
        try:
            _unikv._evict_to_free(self._cache, full, swa)
        except OutOfMemory:
            _unikv._evict_all(self._cache)
        return self._evicted(before, self._cache.stats())

    def _evicted(self, before: Stats, after: Stats) -> EvictResult:
        ps = self.page_size
        return EvictResult(
            num_tokens_evicted=max(0, before.full.evictable - after.full.evictable) * ps,
            swa_num_tokens_evicted=max(0, before.swa.evictable - after.swa.evictable)
            * ps,
            mamba_num_evicted=max(0, before.mamba.evictable - after.mamba.evictable),
        )

    def reset(self) -> None:
        """Evicts everything the prefix cache holds; only with no request running (as
        SGLang resets only when idle)."""
        if self._cache.stats().live_requests:
            raise InvalidArgument("reset with requests running")
        _unikv._evict_all(self._cache)

    # ----- sizes -------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens the prefix cache holds unlocked (FULL)."""
        return self._cache.stats().full.evictable * self.page_size

    def full_evictable_size(self) -> int:
        """Tokens of FULL KV the prefix cache holds unlocked."""
        return self.evictable_size()

    def swa_evictable_size(self) -> int:
        """Tokens of live SWA KV the prefix cache holds unlocked."""
        return self._cache.stats().swa.evictable * self.page_size

    def protected_size(self) -> int:
        """Tokens the prefix cache holds locked by running requests (FULL)."""
        return self._cache.stats().full.protected * self.page_size

    def full_protected_size(self) -> int:
        """Tokens of FULL KV locked by running requests."""
        return self.protected_size()

    def swa_protected_size(self) -> int:
        """Tokens of SWA KV locked by running requests (their windows)."""
        return self._cache.stats().swa.protected * self.page_size

    def total_size(self) -> int:
        """Tokens the prefix cache holds (FULL, locked or not)."""
        return self.evictable_size() + self.protected_size()


def adapter(
    cache: HybridCache, *, tensors: str = "auto"
) -> tuple[TokenToKVPoolAllocator, RadixCache]:
    """The allocator and the prefix cache SGLang's scheduler holds, both over ``cache``."""
    allocator = TokenToKVPoolAllocator(cache, tensors=tensors)
    return allocator, RadixCache(allocator)


HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
"""The HiCache write policies, by SGLang's names, that ``HybridCache(host_write_policy=...)``
takes: on eviction, once cached, or after ``host_write_hits`` admissions hit a prefix."""


def hicache_host_memory_bytes(
    *,
    enable_hierarchical_cache: bool,
    hicache_size: int = 0,
    hicache_ratio: float = 2.0,
    memory: Optional[int] = None,
    hicache_write_policy: str = "write_back",
) -> int:
    """SGLang's HiCache server arguments as ``HybridCache(host_memory_bytes=...)``: 0
    when ``enable_hierarchical_cache`` is off; else ``hicache_size`` gigabytes (10^9
    bytes, as SGLang counts them) when it is set, or ``hicache_ratio`` times the
    device's ``memory`` (bytes, an int). The host tier's own checks (a size too small to
    hold a page or a state) are the cache's, when it is built. The write policy goes to
    ``HybridCache(host_write_policy=...)`` under the same name; one not in
    ``HICACHE_WRITE_POLICIES`` raises ``InvalidArgument``."""
    if not enable_hierarchical_cache:
        return 0
    if hicache_write_policy not in HICACHE_WRITE_POLICIES:
        raise InvalidArgument(
            f"unknown hicache_write_policy={hicache_write_policy!r} (expected one of "
            f"{HICACHE_WRITE_POLICIES})"
        )
    if hicache_size > 0:
        return int(hicache_size) * 10**9
    if memory is None or hicache_ratio <= 0:
        raise InvalidArgument(
            "HiCache sized by hicache_ratio needs the device's memory in bytes "
            f"(memory={memory!r}) and a positive ratio (hicache_ratio={hicache_ratio!r})"
        )
    return int(hicache_ratio * memory)
