//! The facade's error type.

/// Everything `HybridCache` can report. An operation that returns an error leaves the
/// request it was given as it was and loses no KV; work that is valid on its own and was
/// done before the failure stays done (a window release, evicting unlocked prefixes,
/// applying deferred frees). Arguments are checked before any of that: a request or match
/// of another cache ([`Error::ForeignRequest`]), a token count past the prompt
/// ([`Error::BadRequest`], with no arithmetic that could wrap) and a page demand beyond a
/// side's total ([`Error::OutOfMemory`]) change nothing at all. The finishing methods
/// (`cache_finished`, `release`) check the request's cache before anything else; a
/// request of another cache is refused and, having been moved in, is dropped: its KV stays
/// held in the cache it came from. An error from `step_boundary` still ends the step with
/// the next free group open (see its docs).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The builder was given an unusable combination.
    #[error("invalid cache configuration: {0}")]
    Config(String),
    /// Not enough memory even after evicting everything the prefix cache may give up (or
    /// a demand beyond a side's total, refused before evicting anything).
    #[error(
        "out of memory: need {full_pages} FULL and {swa_pages} SWA pages and {mamba_slots} \
         Mamba state slots, {full_available}, {swa_available} and {mamba_available} free \
         after evicting every unlocked prefix"
    )]
    OutOfMemory {
        /// FULL pages asked for.
        full_pages: usize,
        /// SWA pages asked for.
        swa_pages: usize,
        /// Mamba state slots asked for.
        mamba_slots: usize,
        /// FULL pages free after eviction.
        full_available: usize,
        /// SWA pages free after eviction.
        swa_available: usize,
        /// Mamba state slots free after eviction.
        mamba_available: usize,
    },
    /// A request handle of another cache.
    #[error("request {request} belongs to another cache")]
    ForeignRequest {
        /// The request's id.
        request: u64,
    },
    /// Arguments that do not fit the request (more tokens than the prompt has, ...).
    #[error("request {request}: {reason}")]
    BadRequest {
        /// The request's id.
        request: u64,
        /// What is wrong.
        reason: String,
    },
    /// Conservation failed at a step boundary: pages were lost or counted twice.
    #[error("conservation broken at step {step}: {detail}")]
    Conservation {
        /// The step boundary that found it.
        step: u64,
        /// Which side and which numbers.
        detail: String,
    },
    /// The allocator refused an operation.
    #[error(transparent)]
    Pool(#[from] unikv_pools::Error),
    /// The tree refused an operation.
    #[error(transparent)]
    Radix(#[from] unikv_radix::RadixError),
    /// Start-up configuration or an invariant failing at the step boundary.
    #[error(transparent)]
    Invariants(#[from] unikv_invariants::Error),
    /// Step metadata read after a table it names changed: an allocation (which may
    /// compact), a free or a mirror upload ran since it was built. Build it again.
    #[error(
        "step metadata built at mirror generation {built} is stale (now {current}; host \
         tables changed since the last upload: {tables_changed}): build it after the \
         step's last allocation"
    )]
    StaleStepMetadata {
        /// The mirror generation it was built at.
        built: u64,
        /// The cache's mirror generation now.
        current: u64,
        /// Whether host tables changed since the last mirror upload.
        tables_changed: bool,
    },
    /// Step metadata that was never built by this cache, or whose last build failed.
    #[error("step metadata was not built by this cache (or its last build failed)")]
    UnbuiltStepMetadata,
    /// The device layer failed.
    #[error(transparent)]
    Device(#[from] unikv_kernels::Error),
    /// A verify step on a cache built without [`crate::Speculation`].
    #[error("request {request}: a verify step on a cache built without speculation")]
    SpeculationOff {
        /// The request's id.
        request: u64,
    },
    /// A draft wider than the cache was built for (or of no position).
    #[error(
        "request {request}: a verify of {width} positions (the cache verifies 1 ..= {max_width})"
    )]
    VerifyWidth {
        /// The request's id.
        request: u64,
        /// Positions asked for.
        width: usize,
        /// [`crate::Speculation::max_width`].
        max_width: usize,
    },
    /// A draft tree whose parent array is not a tree in row order.
    #[error(
        "request {request}: draft tree node {node} has parent {parent} (the root's is -1, \
         every other node's an earlier node)"
    )]
    BadDraftTree {
        /// The request's id.
        request: u64,
        /// The node.
        node: usize,
        /// Its parent entry.
        parent: i32,
    },
    /// More unsettled verify steps than the cache was built for.
    #[error(
        "request {request}: {in_flight} verify steps are unsettled, the most the cache \
         allows (settle the oldest first)"
    )]
    TooManyInFlight {
        /// The request's id.
        request: u64,
        /// Its unsettled verify steps.
        in_flight: usize,
    },
    /// A prefill chunk or plain decode of a request whose verify steps are unsettled.
    #[error("request {request}: {in_flight} verify steps are unsettled (settle them first)")]
    Unsettled {
        /// The request's id.
        request: u64,
        /// Its unsettled verify steps.
        in_flight: usize,
    },
    /// A settle with no unsettled verify step (settled twice).
    #[error("request {request}: no unsettled verify step to settle")]
    NothingToSettle {
        /// The request's id.
        request: u64,
    },
    /// Accepted positions that do not fit the verify they settle.
    #[error("request {request}: {accepted} accepted of a {width}-position verify: {reason}")]
    BadAccepted {
        /// The request's id.
        request: u64,
        /// Positions accepted.
        accepted: usize,
        /// The verify's positions.
        width: usize,
        /// What is wrong.
        reason: AcceptedFault,
    },
}

/// Why [`crate::HybridCache::settle`] refused an [`crate::Accepted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AcceptedFault {
    /// None, or more than the verify's positions.
    #[error("a verify keeps 1 ..= its width positions")]
    Count,
    /// A path for a chain verify.
    #[error("a chain verify's accepted positions are a prefix, not a path")]
    PathForChain,
    /// No path for a tree verify.
    #[error("a tree verify needs the accepted path")]
    NoPath,
    /// A path whose length is not the number of tokens.
    #[error("the path has {path} nodes")]
    PathLength {
        /// Nodes in the path.
        path: usize,
    },
    /// A path that does not start at the root or leaves the tree.
    #[error("node {node} at index {index} is not a child of the node before it")]
    NotAPath {
        /// Its index in the path.
        index: usize,
        /// The node.
        node: u32,
    },
}
