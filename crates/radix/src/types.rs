//! Newtypes of the tree's vocabulary: token ids (keys), virtual token ids (values), token
//! and slot counts, Mamba slots, node ids and lock handles, plus the tree's configuration.
//!
//! A token count is never silently a slot count or a page count: every quantity the public
//! API hands out carries its unit in its type.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::num::NonZeroUsize;
use std::ops::{Add, AddAssign, Sub, SubAssign};

/// A token of the model's vocabulary: what the tree's keys are made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TokenId(pub u32);

impl Hash for TokenId {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u32(self.0);
    }

    /// Two tokens per `write_u64`: child keys are whole pages, hashed on every lookup.
    fn hash_slice<H: Hasher>(data: &[Self], state: &mut H) {
        let mut pairs = data.chunks_exact(2);
        for pair in &mut pairs {
            state.write_u64((pair[0].0 as u64) << 32 | pair[1].0 as u64);
        }
        if let [last] = pairs.remainder() {
            state.write_u32(last.0);
        }
    }
}

/// A virtual token id (virtual page × page size + offset): what the tree's values hold and
/// what every action names. Never a physical location.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VirtualToken(pub u32);

/// A number of tokens, or a position counted in tokens from the start of a sequence.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tokens(pub usize);

impl Tokens {
    /// Zero tokens.
    pub const ZERO: Tokens = Tokens(0);

    /// The count as a plain integer.
    pub const fn get(self) -> usize {
        self.0
    }
}

impl Add for Tokens {
    type Output = Tokens;
    fn add(self, rhs: Tokens) -> Tokens {
        Tokens(self.0 + rhs.0)
    }
}

impl AddAssign for Tokens {
    fn add_assign(&mut self, rhs: Tokens) {
        self.0 += rhs.0;
    }
}

impl Sub for Tokens {
    type Output = Tokens;
    fn sub(self, rhs: Tokens) -> Tokens {
        Tokens(self.0 - rhs.0)
    }
}

impl SubAssign for Tokens {
    fn sub_assign(&mut self, rhs: Tokens) {
        self.0 -= rhs.0;
    }
}

impl fmt::Display for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} tokens", self.0)
    }
}

/// A number of Mamba state slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slots(pub usize);

impl Slots {
    /// Zero slots.
    pub const ZERO: Slots = Slots(0);

    /// The count as a plain integer.
    pub const fn get(self) -> usize {
        self.0
    }
}

impl Add for Slots {
    type Output = Slots;
    fn add(self, rhs: Slots) -> Slots {
        Slots(self.0 + rhs.0)
    }
}

impl AddAssign for Slots {
    fn add_assign(&mut self, rhs: Slots) {
        self.0 += rhs.0;
    }
}

impl fmt::Display for Slots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} slots", self.0)
    }
}

/// A Mamba state slot (the Mamba sub-allocator's own virtual id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MambaSlot(pub u32);

/// A recurrent state to attach inside an insert's key ([`crate::InsertRequest::checkpoints`]):
/// `slot` holds the state after the key's first `at` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StateCheckpoint {
    /// The position whose state `slot` holds: a positive multiple of the page size, at
    /// most the key's length.
    pub at: Tokens,
    /// The slot holding the state.
    pub slot: MambaSlot,
    /// Whether the forward that writes the state is still in flight (it was planned in
    /// the current step). Such a state ends no match until
    /// [`crate::RadixTree::publish_states`]: a request admitted in the same step would
    /// copy it before it is written.
    pub in_flight: bool,
    /// What the state is for, which orders its eviction.
    pub role: StateRole,
}

/// Why a request saved a state, which is what the state is worth to later requests: Mamba
/// eviction frees every [`StateRole::Grid`] state that no admission copied before any
/// other state, each group least recently used first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StateRole {
    /// Where a request's path ends or leaves a cached one: its prompt's last whole page
    /// or a decode's state beyond it, its branching point, or its running state when it
    /// finished. Later turns and requests sharing the prompt resume here.
    #[default]
    Anchor,
    /// A point of the checkpoint grid inside a prompt (a prefill chunk's intermediate
    /// state): it serves only a request that diverges between it and the request's next
    /// state, so it goes before the anchors LRU would otherwise take in its place.
    Grid,
}

/// A node of the tree. Carries a generation so that an id kept past its node's eviction
/// is recognised as stale instead of naming whatever node reuses the arena entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

impl NodeId {
    /// The arena index (stable while the node lives; shown in dumps as `n<index>`).
    pub const fn index(self) -> u32 {
        self.index
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.index)
    }
}

/// A lock taken by [`crate::RadixTree::lock`]; released exactly once by
/// [`crate::RadixTree::unlock`]. Handles are never reused, so a second release is an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockHandle(pub(crate) u64);

impl fmt::Display for LockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lock#{}", self.0)
    }
}

/// Which component an eviction targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Component {
    /// FULL: evicts least recently used unlocked leaves whole (SWA and Mamba cascade).
    Full,
    /// SWA: tombstones least recently used internal nodes, evicts such leaves whole.
    Swa,
    /// MAMBA: frees least recently used unlocked states.
    Mamba,
}

/// How a tree is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeConfig {
    /// Page size `ps` ≥ 1: every key length and every cursor the tree takes is a multiple.
    pub page_size: u32,
    /// Sliding window `W` ≥ 1 in tokens, or `None` for a model without SWA layers.
    pub window: Option<Tokens>,
    /// Whether the model has Mamba (recurrent state) layers.
    pub mamba: bool,
    /// At most this many Mamba states on one root-to-node path, enforced when an insert
    /// attaches a state (best-effort: only unlocked states other than the new one are
    /// evicted for it); `None` for no cap. Needs `mamba`. The reference engine's
    /// `MambaEvictExcessPathStates`, with a value order in place of its pure LRU: the
    /// states that serve no reuse go first — a state serves reuse when it is the deepest
    /// state above a node where paths diverge (what a request taking another branch
    /// resumes from) or an admission copied it — then the others, each group least
    /// recently used first. A path's own newer chunk states thus never push out the state
    /// its siblings resume from.
    pub mamba_path_cap: Option<NonZeroUsize>,
    /// The grid (in tokens, a positive multiple of the page size) on which the engine
    /// checkpoints Mamba states; [`crate::MatchResult::mamba_branching`] is aligned down to
    /// it. `None` uses the page size. Needs `mamba`.
    pub mamba_checkpoint_interval: Option<Tokens>,
}

impl TreeConfig {
    /// FULL + SWA with window `window` at page size `page_size`.
    pub const fn swa(page_size: u32, window: usize) -> Self {
        TreeConfig {
            page_size,
            window: Some(Tokens(window)),
            mamba: false,
            mamba_path_cap: None,
            mamba_checkpoint_interval: None,
        }
    }

    /// FULL only (no sliding window) at page size `page_size`: full-attention models, and,
    /// with [`TreeConfig::with_mamba`], Mamba hybrids such as Qwen3-Next, whose attention
    /// layers are all full.
    pub const fn full_only(page_size: u32) -> Self {
        TreeConfig {
            page_size,
            window: None,
            mamba: false,
            mamba_path_cap: None,
            mamba_checkpoint_interval: None,
        }
    }

    /// The same configuration with the Mamba component switched on.
    pub const fn with_mamba(mut self) -> Self {
        self.mamba = true;
        self
    }

    /// The same configuration with at most `cap` Mamba states per root-to-node path (see
    /// [`TreeConfig::mamba_path_cap`]).
    pub const fn with_mamba_path_cap(mut self, cap: NonZeroUsize) -> Self {
        self.mamba_path_cap = Some(cap);
        self
    }

    /// The same configuration with Mamba states checkpointed every `interval` tokens (see
    /// [`TreeConfig::mamba_checkpoint_interval`]; [`crate::RadixTree::new`] refuses an
    /// interval that is not a positive multiple of the page size).
    pub const fn with_mamba_checkpoint_interval(mut self, interval: usize) -> Self {
        self.mamba_checkpoint_interval = Some(Tokens(interval));
        self
    }

    /// The grid Mamba branching lengths are aligned down to: the checkpoint interval, or
    /// the page size without one.
    pub fn mamba_grid(&self) -> Tokens {
        self.mamba_checkpoint_interval
            .unwrap_or(Tokens(self.page_size as usize))
    }

    /// One page-aligned window, `ceil(W / ps) × ps`: the length a fresh live leaf is
    /// capped at (none without SWA).
    pub fn leaf_window(&self) -> Option<Tokens> {
        let ps = self.page_size as usize;
        self.window.map(|w| Tokens(w.0.div_ceil(ps) * ps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_and_slot_counts_add_subtract_and_print() {
        let mut t = Tokens(7) + Tokens(5);
        assert_eq!(t, Tokens(12));
        assert_eq!(t - Tokens(5), Tokens(7));
        t -= Tokens(2);
        t += Tokens(1);
        assert_eq!(t.get(), 11);
        assert_eq!(Tokens(11).to_string(), "11 tokens");
        let mut s = Slots(2) + Slots(3);
        s += Slots(1);
        assert_eq!(s, Slots(6));
        assert_eq!(s.get(), 6);
        assert_eq!(Slots(6).to_string(), "6 slots");
        assert_eq!(LockHandle(3).to_string(), "lock#3");
    }

    /// Tokens hash by value, one at a time or a page at a time (two per word, an odd
    /// last one alone): distinct pages, distinct hashes.
    #[test]
    fn tokens_and_pages_hash_by_every_token() {
        use std::hash::{DefaultHasher, Hash, Hasher};
        fn hash(v: impl Hash) -> u64 {
            let mut h = DefaultHasher::new();
            v.hash(&mut h);
            h.finish()
        }
        let mut seen = std::collections::HashSet::new();
        for a in 0..48 {
            assert!(seen.insert(hash(TokenId(a))));
            for b in 0..48 {
                assert!(seen.insert(hash([TokenId(a), TokenId(b)].as_slice())));
                assert!(seen.insert(hash([TokenId(a), TokenId(b), TokenId(7)].as_slice())));
            }
        }
    }
}
