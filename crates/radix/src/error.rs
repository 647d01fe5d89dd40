//! The crate's one error type. Every error leaves the tree exactly as it was.

use crate::{LockHandle, NodeId};

/// Why a tree operation refused its input. The tree is unchanged when one is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RadixError {
    /// The configuration is unusable (page size, window or Mamba checkpoint interval of
    /// zero, or a Mamba option without the Mamba component).
    #[error("invalid tree configuration: {reason}")]
    InvalidConfig {
        /// What is wrong.
        reason: &'static str,
    },
    /// An insert's key and value have different lengths.
    #[error("key has {key} tokens but value has {value}")]
    KeyValueLengthMismatch {
        /// Key length.
        key: usize,
        /// Value length.
        value: usize,
    },
    /// A length or position that must be a multiple of the page size is not.
    #[error("{what} = {len} is not a multiple of the page size {page_size}")]
    NotPageAligned {
        /// Which argument.
        what: &'static str,
        /// Its value in tokens.
        len: usize,
        /// The tree's page size.
        page_size: u32,
    },
    /// A node id that names no live node (never existed or evicted since).
    #[error("unknown or evicted node {0}")]
    UnknownNode(NodeId),
    /// A lock handle that is not held (never issued, or released already).
    #[error("{0} is not held (unknown or released twice)")]
    UnknownLock(LockHandle),
    /// The SWA part of a lock was released already.
    #[error("the window of {0} was released already")]
    WindowAlreadyReleased(LockHandle),
    /// An insert claims the tree owns a prefix longer than the tree holds for its key.
    #[error("insert claims a cached prefix of {claimed} tokens, the tree holds {cached}")]
    PrefixNotInTree {
        /// The claimed length (`prev_prefix_len`).
        claimed: usize,
        /// What the tree holds for that key.
        cached: usize,
    },
    /// A suffix insert ([`crate::InsertRequest::after`]) says its key starts somewhere
    /// other than the end of the node its lock holds.
    #[error("a suffix insert starts at {at}, but its locked node ends at {node_end}")]
    SuffixStartMismatch {
        /// Where the insert says its key starts.
        at: usize,
        /// Where the locked node ends.
        node_end: usize,
    },
    /// An insert's value differs from the tree's inside the prefix it claims the tree owns.
    #[error("insert value differs from the tree's at position {position} of its cached prefix")]
    PrefixValueMismatch {
        /// The first differing position.
        position: usize,
    },
    /// A Mamba state was given to a tree without the Mamba component.
    #[error("a Mamba slot was given to a tree without the Mamba component")]
    MambaDisabled,
    /// An insert's checkpoints are not strictly ascending page boundaries inside its key.
    #[error(
        "checkpoint at {at} tokens: checkpoints must ascend, end a page of {page_size} tokens and lie in (0, {key_len}]"
    )]
    BadCheckpoint {
        /// The refused position.
        at: usize,
        /// The key's length.
        key_len: usize,
        /// The tree's page size.
        page_size: u32,
    },
    /// [`crate::RadixTree::sanity_check`] found recorded state that a recomputation from
    /// the tree contradicts.
    #[error("radix tree sanity check failed: {0}")]
    Insane(String),
}
