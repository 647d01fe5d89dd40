//! Newtypes for the id spaces and quantities of the pools: virtual tokens and pages,
//! physical pages, bytes and the page size. A page count is never silently a token count.

use std::fmt;

/// A virtual token id: `virtual page × page size + offset`. What request rows and the
/// prefix tree store; it never moves. Token `0` is the sink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualToken(pub u32);

/// A virtual page: the unit FULL mints and SWA binds to. Page `0` is the sink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualPage(pub u32);

/// A virtual Mamba state slot: what a request and the prefix tree hold for one recurrent
/// state. Its own id space (a slot is a page of size 1 on its own grid, not a FULL
/// page); it never moves. Slot `0` is the sink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VirtualSlot(pub u32);

/// A physical page of one sub-pool's grid: its envelope lives at byte
/// `page × envelope bytes` of the buffer (every grid is anchored at byte 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysicalPage(pub u32);

/// A number of bytes (buffer sizes, offsets, envelope sizes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bytes(pub u64);

/// Tokens per page (`ps`), at least 1. FULL and SWA share it.
///
/// A power of two (the usual case) divides by shifting: token → page is on every free's
/// hot path, and an integer division by a run-time value costs tens of cycles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageSize(u32, u8);

/// `PageSize.1` when the size is not a power of two.
const NO_SHIFT: u8 = u8::MAX;

impl PageSize {
    /// A page size; `None` for zero.
    pub const fn new(tokens: u32) -> Option<PageSize> {
        if tokens == 0 {
            None
        } else if tokens.is_power_of_two() {
            Some(PageSize(tokens, tokens.trailing_zeros() as u8))
        } else {
            Some(PageSize(tokens, NO_SHIFT))
        }
    }

    /// Tokens per page.
    #[inline]
    pub const fn get(self) -> u32 {
        self.0
    }

    /// `x / ps`.
    #[inline]
    const fn div(self, x: u32) -> u32 {
        if self.1 != NO_SHIFT {
            x >> self.1
        } else {
            x / self.0
        }
    }

    /// `x % ps`.
    #[inline]
    const fn rem(self, x: u32) -> u32 {
        if self.1 != NO_SHIFT {
            x & (self.0 - 1)
        } else {
            x % self.0
        }
    }

    /// `tokens % ps` for a row position or token count (a mask for a power of two).
    #[inline]
    const fn rem_tokens(self, tokens: usize) -> usize {
        if self.1 != NO_SHIFT {
            tokens & (self.0 as usize - 1)
        } else {
            tokens % self.0 as usize
        }
    }

    /// The number of pages that hold `tokens` tokens (rounded up).
    #[inline]
    pub const fn pages_for(self, tokens: usize) -> usize {
        if self.1 != NO_SHIFT {
            (tokens >> self.1) + (self.rem_tokens(tokens) != 0) as usize
        } else {
            tokens.div_ceil(self.0 as usize)
        }
    }

    /// Whether a row position or token count is a multiple of the page size.
    #[inline]
    pub const fn is_aligned(self, tokens: usize) -> bool {
        self.rem_tokens(tokens) == 0
    }

    /// `tokens` rounded down to a page boundary.
    #[inline]
    pub const fn floor(self, tokens: usize) -> usize {
        tokens - self.rem_tokens(tokens)
    }

    /// The offset of row position `tokens` inside its page (`tokens % ps`).
    #[inline]
    pub(crate) const fn offset_of(self, tokens: usize) -> usize {
        self.rem_tokens(tokens)
    }
}

impl fmt::Display for PageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl VirtualToken {
    /// The virtual page holding this token.
    #[inline]
    pub const fn page(self, ps: PageSize) -> VirtualPage {
        VirtualPage(ps.div(self.0))
    }

    /// The token's offset inside its page.
    #[inline]
    pub const fn offset(self, ps: PageSize) -> u32 {
        ps.rem(self.0)
    }
}

impl VirtualPage {
    /// The sink: virtual page 0, bound to physical page 0, never allocated or freed.
    pub const SINK: VirtualPage = VirtualPage(0);

    /// The first token of this page.
    #[inline]
    pub const fn first_token(self, ps: PageSize) -> VirtualToken {
        VirtualToken(self.0 * ps.0)
    }

    /// The token at `offset` inside this page.
    #[inline]
    pub const fn token(self, ps: PageSize, offset: u32) -> VirtualToken {
        VirtualToken(self.0 * ps.0 + offset)
    }
}

impl PhysicalPage {
    /// The sink's physical page.
    pub const SINK: PhysicalPage = PhysicalPage(0);
}

impl fmt::Display for VirtualToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

impl fmt::Display for VirtualPage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.0)
    }
}

impl fmt::Display for PhysicalPage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}", self.0)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} B", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_and_offsets_agree_with_division_at_every_page_size() {
        for ps in [1, 2, 3, 4, 16, 100, 256] {
            let p = PageSize::new(ps).unwrap();
            for t in [0, 1, 2, 3, 255, 256, 257, 1000, u32::MAX] {
                let token = VirtualToken(t);
                assert_eq!(token.page(p).0, t / ps, "ps {ps} t {t}");
                assert_eq!(token.offset(p), t % ps, "ps {ps} t {t}");
                assert_eq!(token.page(p).token(p, token.offset(p)), token);
            }
        }
        assert!(PageSize::new(0).is_none());
        for ps in [1usize, 2, 3, 4, 16, 100, 256] {
            let p = PageSize::new(ps as u32).unwrap();
            for n in [0, 1, 2, 3, 255, 256, 257, 1000, usize::MAX - 1, usize::MAX] {
                assert_eq!(p.pages_for(n), n.div_ceil(ps), "ps {ps} n {n}");
                assert_eq!(p.is_aligned(n), n % ps == 0, "ps {ps} n {n}");
                assert_eq!(p.floor(n), n - n % ps, "ps {ps} n {n}");
                assert_eq!(p.offset_of(n), n % ps, "ps {ps} n {n}");
            }
        }
        let p = PageSize::new(4).unwrap();
        assert_eq!((p.pages_for(0), p.pages_for(1), p.pages_for(8)), (0, 1, 2));
        assert_eq!(
            (p.floor(7), p.is_aligned(8), p.is_aligned(9)),
            (4, true, false)
        );
    }
}
