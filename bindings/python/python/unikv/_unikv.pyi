"""Type stubs of the Rust extension ``unikv._unikv`` (see ``unikv``)."""

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
from typing_extensions import Buffer

__version__: str

Tokens = Union[Buffer, "np.ndarray[Any, Any]", Sequence[int]]
"""Token ids: a C-contiguous int32/int64 buffer (numpy array, ``array('q')``) or ints."""

class Error(Exception):
    """Everything unikv raises: a failed cache operation changes nothing it was given."""

class OutOfMemory(Error):
    """Not enough memory even after evicting every unlocked prefix."""

    full_pages: int
    swa_pages: int
    mamba_slots: int
    full_available: int
    swa_available: int
    mamba_available: int

class InvalidArgument(Error):
    """An argument the cache refuses (bad configuration, request, count or buffer)."""

    request: Optional[int]
    """The request it concerns, when there is one."""

class InvariantViolation(Error):
    """An invariant failed at the current ``UNIKV_INVARIANT_CHECK`` level."""

class DeviceError(Error):
    """The device refused an operation."""

class InternalError(Error):
    """A bug in unikv (a Rust panic caught at the boundary)."""

class Speculation:
    """What verify steps a cache is built for."""

    max_width: int
    max_in_flight: int
    max_batch: int

    def __init__(
        self, *, max_width: int, max_in_flight: int = 1, max_batch: int = 8
    ) -> None: ...
    @staticmethod
    def chain(k: int, *, in_flight: int = 1, max_batch: int = 8) -> "Speculation": ...
    @staticmethod
    def tree(nodes: int, *, in_flight: int = 1, max_batch: int = 8) -> "Speculation": ...

Draft = Union[int, Sequence[int]]
"""A chain of ``k`` draft tokens (an int) or a draft tree's parent indices."""

Accepted = Union[Tokens, tuple[Sequence[int], Tokens]]
"""A chain's accepted tokens, or a tree's ``(path, tokens)``."""

class PrefixMatch:
    """What the prefix cache holds for a prompt; admitting it consumes it."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the request reuses: ``device_tokens + host_tokens``."""
    @property
    def device_tokens(self) -> int:
        """Of ``cached_tokens``, those the device holds."""
    @property
    def host_tokens(self) -> int:
        """Of ``cached_tokens``, those admission loads back from the host tier."""
    @property
    def load_bytes(self) -> int:
        """Bytes admission copies from the host tier to load back ``host_tokens``."""
    @property
    def kv_hit_tokens(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...

class Request:
    """A running request; ``cache_finished`` and ``release`` consume it."""

    @property
    def id(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def settled_len(self) -> int: ...
    @property
    def unsettled_verifies(self) -> int: ...
    @property
    def remaining_prefill(self) -> int: ...
    @property
    def cached_at_admission(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def tokens(self) -> list[int]: ...
    @property
    def state_slot(self) -> Optional[int]:
        """Its running state slot (virtual; ``None`` without recurrent layers)."""

class Batch:
    """An immutable list of requests, reused across steps (no list conversion a step)."""

    def __init__(self, requests: Sequence[Request]) -> None: ...
    def __len__(self) -> int: ...
    @property
    def requests(self) -> list[Request]: ...

Requests = Union[Batch, Sequence[Request]]

class StepReport:
    """What a step boundary reports."""

    @property
    def step(self) -> int: ...
    @property
    def text(self) -> str: ...

class StepMetadata:
    """One step's metadata: the host-written header (a numpy view) and its layout."""

    @property
    def host_image(self) -> "np.ndarray[Any, np.dtype[np.int32]]":
        """The header the host wrote, viewed without a copy (int32, read-only)."""
    @property
    def layout(self) -> dict[str, int]: ...
    @property
    def header_len(self) -> int: ...
    @property
    def device_table(self) -> Optional[int]: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...

class VerifyMetadata:
    """One verify step's metadata for batches of up to ``max_batch`` requests."""

    def __init__(self, max_batch: int) -> None: ...
    @property
    def inputs(self) -> "np.ndarray[Any, np.dtype[np.int32]]":
        """The inputs table's host image, viewed without a copy; builds wait for it."""
    @property
    def layout(self) -> dict[str, int]: ...
    @property
    def device_tables(self) -> Optional[tuple[int, int]]: ...

class DeviceValues:
    """An ``int32`` table on the cache's device that the engine's kernels write
    (accepted counts, last accepted nodes, accepted paths), made by
    ``HybridCache.device_values``; ``translate_verify`` and ``compact_accepted`` read
    ``(values, at)`` on the device. Freed when the object goes."""

    def __len__(self) -> int: ...
    @property
    def table(self) -> int:
        """The device table's id."""
    def write(self, values: Tokens, *, at: int = 0) -> None:
        """Writes ``values`` from entry ``at`` (an asynchronous upload: the CPU
        backend's stand-in for the engine's accept kernel)."""

class SideStats:
    """One side's pages (``full``, ``swa``) or slots (``mamba``)."""

    total: int
    available: int
    evictable: int
    protected: int
    held: int

class HostStats:
    """What the host tier did and holds (``Stats.host``); bytes and counts."""

    @property
    def total_bytes(self) -> int:
        """Bytes of the host buffer."""
    @property
    def full_bytes(self) -> int:
        """Bytes the host holds of FULL pages."""
    @property
    def swa_bytes(self) -> int:
        """Bytes the host holds of SWA pages."""
    @property
    def state_bytes(self) -> int:
        """Bytes the host holds of recurrent states."""
    @property
    def peak_bytes(self) -> int:
        """Most bytes the host held at once (all kinds)."""
    @property
    def hit_tokens(self) -> int:
        """Prompt tokens admissions loaded back from the host."""
    @property
    def written_bytes(self) -> int:
        """Bytes written back (device to host)."""
    @property
    def loaded_bytes(self) -> int:
        """Bytes loaded back (host to device)."""
    @property
    def copies(self) -> int:
        """Copies issued (one per run of adjacent bytes)."""
    @property
    def largest_copy(self) -> int:
        """The largest single copy, in bytes."""
    @property
    def refused_writes(self) -> int:
        """Write-backs skipped because the host could not make room for them."""

class Stats:
    """The cache's counters."""

    step: int
    full: SideStats
    swa: SideStats
    mamba: SideStats
    live_requests: int
    hit_tokens: int
    host: Optional[HostStats]
    """The host tier's figures (``None`` without ``host_memory_bytes``)."""

class ModelSpec:
    """A model given by its geometry (FULL, SWA and recurrent layers, one K/V row shape
    for both attention kinds, one recurrent state per recurrent layer), for small test
    and example models: ``HybridCache(model=ModelSpec(...))``."""

    def __init__(
        self,
        *,
        name: str,
        full_layers: int,
        swa_layers: int = 0,
        mamba_layers: int = 0,
        kv_heads: int,
        head_dim: int,
        dtype_bytes: int = 2,
        window: int = 0,
        conv_channels: int = 0,
        conv_kernel: int = 0,
        state_heads: int = 0,
        state_head_dim: int = 0,
        state_size: int = 0,
        state_dtype_bytes: int = 4,
    ) -> None: ...
    name: str
    full_layers: int
    swa_layers: int
    mamba_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    window: int
    conv_channels: int
    conv_kernel: int
    state_heads: int
    state_head_dim: int
    state_size: int
    state_dtype_bytes: int

class KvGeometry:
    """Where a cache's buffer keeps a kernel id's K/V rows (layer ``l``'s K row at row
    ``k + 2·l·page_size``, its V row at ``k + (2·l + 1)·page_size``) and a state slot's
    conv and temporal states. Kernel id 0 and slot 0 are the sink."""

    def __init__(self, cache: HybridCache) -> None: ...
    @property
    def page_size(self) -> int: ...
    @property
    def full_row_bytes(self) -> int: ...
    @property
    def swa_row_bytes(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    def row_offsets(
        self, side: str, kernel_ids: Tokens, layer: int, *, value: bool
    ) -> "np.ndarray[Any, np.dtype[np.int64]]":
        """Byte offsets of layer ``layer``'s K (``value=False``) or V rows of
        ``kernel_ids`` on ``side`` (``"full"`` or ``"swa"``)."""
    def slot_offset(self, slot: int) -> int: ...
    def conv_state(self, layer: int) -> tuple[int, int]:
        """Byte range of recurrent layer ``layer``'s conv state inside a slot."""
    def temporal_state(self, layer: int) -> tuple[int, int]:
        """Byte range of recurrent layer ``layer``'s temporal state inside a slot."""

class CpuBuffer:
    """The bytes of a ``device="cpu"`` cache's buffer, for an engine whose forward runs
    on the host: rows copied out and in with the cache locked (the CPU backend's
    buffer is chunked and moves under compaction, so no view is handed out), and the
    step's page tables read back from the device table."""

    def __init__(self, cache: HybridCache) -> None: ...
    @property
    def geometry(self) -> KvGeometry: ...
    def read(
        self, offsets: Tokens, nbytes: int
    ) -> "np.ndarray[Any, np.dtype[np.uint8]]":
        """``nbytes`` at each offset: a new ``uint8`` array ``(len(offsets), nbytes)``."""
    def write(self, offsets: Tokens, rows: Union[Buffer, "np.ndarray[Any, Any]"]) -> None:
        """Row ``i`` of ``rows`` (C-contiguous, equal rows) at byte ``offsets[i]``."""
    def read_step_table(
        self, step: StepMetadata
    ) -> "np.ndarray[Any, np.dtype[np.int32]]":
        """The current step's whole device table (header, then the page tables the
        device wrote), read back to the host: the CPU stand-in for a kernel's read."""
    def read_verify_outputs(
        self, meta: VerifyMetadata
    ) -> "np.ndarray[Any, np.dtype[np.int32]]":
        """The verify metadata's outputs table as the device holds it (write ids and
        state slots ``translate_verify`` wrote), read back to the host."""

class DeviceTable:
    """A cache's device table (a step table, or a verify table's ``part``) exported
    through DLPack, read in place: ``torch.from_dlpack(DeviceTable(cache, meta))`` is
    an ``int32`` tensor of ``meta.layout["len"]`` entries with no copy and no host
    sync. A class of its own because metadata does not refer to its cache; a tensor
    made from it keeps the cache and the table's memory alive. The contents are the
    latest build's (read within the step); read-only by contract."""

    def __init__(
        self,
        cache: HybridCache,
        metadata: Union[StepMetadata, VerifyMetadata],
        part: Optional[str] = None,
    ) -> None: ...
    @property
    def address(self) -> int:
        """The first entry's address on its device (host pointer or ``CUdeviceptr``)."""
    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
    def __len__(self) -> int: ...
    def __dlpack_device__(self) -> tuple[int, int]:
        """``(1, 0)`` on the CPU (``kDLCPU``), ``(2, N)`` on CUDA GPU ``N``."""
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[tuple[int, int]] = None,
        dl_device: Optional[tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any:
        """A ``"dltensor"`` capsule; on CUDA ``stream`` (None: legacy default, 1, 2,
        -1: no ordering, or a ``CUstream``) is ordered after the cache's work by an
        event, never a host sync."""

class HybridCache:
    """One byte buffer for a hybrid model's KV and state, with the prefix cache on top."""

    def __init__(
        self,
        *,
        model: Union[str, Mapping[str, Any], ModelSpec],
        memory: Union[int, str],
        page_size: int = 1,
        layout: str = "unified",
        swa_full_tokens_ratio: float = 0.8,
        checkpoint_interval: Optional[int] = None,
        checkpoints_per_step: Optional[int] = None,
        model_name: Optional[str] = None,
        device: str = "cpu",
        speculation: Optional[Speculation] = None,
        host_memory_bytes: int = 0,
        host_write_policy: str = "write_back",
        host_write_hits: int = 2,
    ) -> None:
        """``host_memory_bytes``: a host tier of that many bytes (0: none); evicted
        prefixes are written back to it and loaded back by a later match.
        ``host_write_policy``: when a prefix is copied to the host — ``"write_back"`` (on
        eviction), ``"write_through"`` (once cached) or ``"write_through_selective"``
        (after ``host_write_hits`` admissions hit it)."""
    @property
    def model(self) -> str: ...
    @property
    def layout(self) -> str:
        """``"unified"`` or ``"static"``."""
    @property
    def scratch_shape(self) -> dict[str, int]:
        """How verify scratch lanes sit in state slots: ``width`` and
        ``entries_per_slot`` (1 under the copy rollback)."""
    @property
    def page_size(self) -> int: ...
    @property
    def step(self) -> int: ...
    def match_prefix(self, tokens: Tokens) -> PrefixMatch: ...
    def can_admit(self, hit: PrefixMatch, *, reserve_tokens: int = 0) -> bool: ...
    def admit(self, hit: PrefixMatch) -> Request: ...
    def alloc_extend(self, request: Request, tokens: int) -> None: ...
    def alloc_decode(self, requests: Requests, next_tokens: Tokens) -> None: ...
    def alloc_verify(self, requests: Requests, drafts: Sequence[Draft]) -> None: ...
    def settle(self, requests: Requests, accepted: Sequence[Accepted]) -> None: ...
    def reserve_verify_metadata(self, meta: VerifyMetadata) -> None: ...
    def build_verify_metadata(self, meta: VerifyMetadata, requests: Requests) -> None: ...
    def translate_verify(
        self,
        meta: VerifyMetadata,
        *,
        accepted: Optional[tuple[DeviceValues, int]] = None,
        last_nodes: Optional[tuple[DeviceValues, int]] = None,
    ) -> None:
        """The verify's write ids and state slots, on the device; with counts a step
        late, ``accepted`` (and for trees ``last_nodes``) name the device values of
        each request's earlier unsettled verify."""
    def compact_accepted(
        self, meta: VerifyMetadata, paths: tuple[DeviceValues, int]
    ) -> None:
        """Moves each tree verify's accepted nodes' KV to consecutive rows, reading
        the paths (``width`` entries per request, then −1) on the device."""
    def device_values(self, len: int, *, fill: int = 0) -> DeviceValues:
        """A table of ``len`` ``int32`` entries on the cache's device for the
        engine's kernels to write (set-up: an allocation)."""
    def release_out_of_window(self, request: Request) -> int: ...
    def cache_unfinished(self, request: Request) -> None: ...
    def cache_finished(self, request: Request) -> None: ...
    def release(self, request: Request) -> list[int]: ...
    def build_step_metadata(
        self, requests: Requests, new_tokens: Union[int, Tokens, None] = None
    ) -> StepMetadata: ...
    def decode_step(self, requests: Requests, next_tokens: Tokens) -> StepMetadata:
        """``alloc_decode`` then ``build_step_metadata`` (one new token each), one call."""
    def reserve_step_metadata(
        self,
        *,
        requests: int,
        max_len: int,
        max_new_tokens: int,
        max_loaded_pages: int = 0,
    ) -> None: ...
    def evict_to_free(self, *, full_pages: int = 0, swa_pages: int = 0) -> None: ...
    def evict_all(self) -> int: ...
    def step_boundary(self) -> StepReport: ...
    def host_geometry(self) -> Optional[dict[str, Union[int, list[int]]]]:
        """The host buffer's geometry (``frame_bytes``, ``units_per_frame``,
        ``unit_bytes``), or ``None`` without a host tier."""
    def stats(self) -> Stats: ...

def set_invariant_level(level: Optional[str]) -> None:
    """Sets the process's invariant level (``None``: back to UNIKV_INVARIANT_CHECK)."""

def invariant_level() -> str:
    """The invariant level in force on this thread."""

def models() -> list[str]:
    """The model names ``HybridCache(model=...)`` accepts."""

def _panic_for_tests() -> None: ...
def _token_ids_for_tests(tokens: Tokens) -> list[int]: ...
def _rust_decode_steps(
    *,
    model: str,
    memory: int,
    page_size: int,
    batch: int,
    prompt: int,
    warmup: int,
    steps: int,
    device: str = "cpu",
) -> list[int]: ...
def _reference_run(ops: str) -> str: ...

# For unikv.sglang (the SGLang-shaped adapter): ids as little-endian bytes.
def _request_kv_indices(
    cache: HybridCache,
    request: Request,
    side: str = "virtual",
    start: int = 0,
    end: Optional[int] = None,
) -> bytearray:
    """Rows ``[start, end)`` of ``request``: int64 virtual ids, or int32 kernel ids."""
def _kernel_ids(cache: HybridCache, ids: Tokens, side: str) -> bytearray:
    """The int32 kernel ids of virtual ids on ``side`` (``"full"`` or ``"swa"``)."""
def _prefix_indices(cache: HybridCache, tokens: Tokens, length: int) -> bytearray:
    """The int64 virtual ids the prefix cache holds for ``tokens[:length]``."""
def _capacity(cache: HybridCache) -> dict[str, int]:
    """The allocator's capacity views, in pages."""
def _evict_to_free(cache: HybridCache, full_pages: int, swa_pages: int) -> None:
    """Evicts until that many FULL and SWA pages can be allocated together."""
def _evict_all(cache: HybridCache) -> int:
    """Evicts every unlocked prefix; returns the tokens evicted."""
def _request_rows(request: Request) -> tuple[int, int, int]:
    """``(len, protected_len, window_cursor)`` of ``request``."""
def _host_syncs(cache: HybridCache) -> int:
    """Host syncs the ledger of a ``device="ledger(...)"`` cache counted."""
def _ledger_ops(cache: HybridCache) -> list[str]:
    """The ops the ledger of a ``device="ledger(...)"`` cache recorded, in order."""
def _reset_ledger(cache: HybridCache) -> None:
    """Forgets what the ledger of a ``device="ledger(...)"`` cache recorded."""
