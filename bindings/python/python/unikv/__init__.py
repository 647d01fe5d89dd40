"""unikv: one byte buffer for a hybrid LLM's FULL and SWA KV and recurrent state, with a
radix prefix cache on top, for engines that schedule in Python.

The extension (``unikv._unikv``) is thin: every call releases the GIL, locks the cache
and runs the Rust facade. See ``HybridCache`` for the request lifecycle.
"""

from ._unikv import (
    Batch,
    CpuBuffer,
    DeviceError,
    DeviceTable,
    DeviceValues,
    Error,
    HostStats,
    HybridCache,
    InternalError,
    InvalidArgument,
    InvariantViolation,
    KvGeometry,
    ModelSpec,
    OutOfMemory,
    PrefixMatch,
    Request,
    SideStats,
    Speculation,
    Stats,
    StepMetadata,
    StepReport,
    VerifyMetadata,
    __version__,
    invariant_level,
    models,
    set_invariant_level,
)

__all__ = [
    "Batch",
    "CpuBuffer",
    "DeviceError",
    "DeviceTable",
    "DeviceValues",
    "Error",
    "HostStats",
    "HybridCache",
    "InternalError",
    "InvalidArgument",
    "InvariantViolation",
    "KvGeometry",
    "ModelSpec",
    "OutOfMemory",
    "PrefixMatch",
    "Request",
    "SideStats",
    "Speculation",
    "Stats",
    "StepMetadata",
    "StepReport",
    "VerifyMetadata",
    "__version__",
    "invariant_level",
    "models",
    "set_invariant_level",
]
