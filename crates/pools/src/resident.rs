//! Host tables and lists mapped at boot: a scheduling-path write or push up to a list's
//! bound never page-faults or reallocates.

/// A zeroed table of `len` entries whose memory is mapped now: one write per 4 KiB page
/// (through `black_box`, so it is not elided), instead of a page fault at the first
/// write on the scheduling path.
pub(crate) fn resident_table<T: Copy + Default>(len: usize) -> Vec<T> {
    let mut table = vec![T::default(); len];
    let step = (4096 / std::mem::size_of::<T>()).max(1);
    for i in (0..len).step_by(step) {
        table[i] = std::hint::black_box(T::default());
    }
    table
}

/// An empty list with room for `bound` entries, mapped now (written once and cleared):
/// pushes up to its bound neither reallocate nor fault on the scheduling path.
pub(crate) fn resident_list<T: Copy + Default>(bound: usize) -> Vec<T> {
    let mut list = Vec::with_capacity(bound);
    list.resize(bound, std::hint::black_box(T::default()));
    list.clear();
    list
}
