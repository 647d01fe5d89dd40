//! [`VirtualIds`]: the free virtual pages of an id owner (FULL, Mamba), which the
//! composites own and their sub-allocators' tables are indexed by.

/// The free virtual pages of an id owner (FULL, Mamba): a stack, so the most recently
/// freed id is reused first; ids `1..count` (0 is the sink).
#[derive(Debug, Clone)]
pub struct VirtualIds {
    free: Vec<u32>,
    count: u32,
}

impl VirtualIds {
    /// Ids `1..count`, all free; the lowest is handed out first.
    pub fn new(count: u32) -> VirtualIds {
        VirtualIds {
            free: (1..count).rev().collect(),
            count,
        }
    }

    /// Ids in the space, the sink included.
    pub fn count(&self) -> u32 {
        self.count
    }

    /// Free ids.
    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Takes an id.
    #[inline(always)]
    pub(crate) fn pop(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// The free ids as a stack (the last is taken first), for batch takes and returns.
    #[inline]
    pub(crate) fn stack(&mut self) -> &mut Vec<u32> {
        &mut self.free
    }

    /// Returns an id (the caller checked it was live).
    #[inline(always)]
    pub(crate) fn push(&mut self, v: u32) {
        self.free.push(v);
    }

    /// The free ids, in no particular order.
    pub fn as_slice(&self) -> &[u32] {
        &self.free
    }
}
