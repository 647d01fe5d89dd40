//! Run-at-a-time arithmetic for the batch passes (the sub-allocator's binds, releases,
//! compaction and page sorts, and the free paths' page walks): [`RUN`] consecutive pages
//! (a page-size-1 row) are recognised by one branch-free test as a ramp (each entry one
//! more, or one less, than the last) and written as vector adds.

/// Pages a batch pass handles at once when they form a run.
pub(crate) const RUN: usize = 16;

/// `step * t` for each `t < RUN` (wrapping), for a step of 1 or -1: with `m` all ones
/// for -1 and zero for 1, `step * t = (t ^ m) - m`, since SSE2 has no lane-wise 32-bit
/// multiply (and a select between two ramps costs more than this).
#[inline(always)]
pub(crate) fn steps(step: u32) -> [u32; RUN] {
    let m = ((step as i32) >> 31) as u32;
    let mut out = [0; RUN];
    for (t, o) in out.iter_mut().enumerate() {
        *o = (t as u32 ^ m).wrapping_sub(m);
    }
    out
}

/// The lowest of the `len` values `first + step·t` (`step` ±1, no wrap).
#[inline(always)]
pub(crate) fn lowest((first, step): (u32, u32), len: usize) -> u32 {
    first.min(first.wrapping_add(step.wrapping_mul(len as u32 - 1)))
}

/// Whether `step` is 1 or -1 (wrapping).
#[inline(always)]
pub(crate) fn is_unit(step: u32) -> bool {
    step == 1 || step == u32::MAX
}

/// Whether `chunk[t] == first + steps[t]` for every `t` (wrapping), branch-free.
#[inline(always)]
pub(crate) fn is_ramp(chunk: &[u32; RUN], first: u32, steps: &[u32; RUN]) -> bool {
    chunk
        .iter()
        .zip(steps)
        .fold(true, |ok, (&x, &d)| ok & (x == first.wrapping_add(d)))
}

/// Writes `f(a + sa·t, b + sb·t)` (wrapping) to `dst[t]`, for steps of ±1: two ramps,
/// [`RUN`] slots at a time as vector adds (a ramp not needed is `(0, 1)`, and folds
/// away).
#[inline(always)]
pub(crate) fn fill_ramps<T>(
    dst: &mut [T],
    (a, sa): (u32, u32),
    (b, sb): (u32, u32),
    f: impl Fn(u32, u32) -> T,
) {
    let (da, db) = (steps(sa), steps(sb));
    let (ja, jb) = (sa.wrapping_mul(RUN as u32), sb.wrapping_mul(RUN as u32));
    let (mut a, mut b) = (a, b);
    let mut chunks = dst.chunks_exact_mut(RUN);
    for chunk in &mut chunks {
        for ((slot, &da), &db) in chunk.iter_mut().zip(&da).zip(&db) {
            *slot = f(a.wrapping_add(da), b.wrapping_add(db));
        }
        a = a.wrapping_add(ja);
        b = b.wrapping_add(jb);
    }
    for ((slot, &da), &db) in chunks.into_remainder().iter_mut().zip(&da).zip(&db) {
        *slot = f(a.wrapping_add(da), b.wrapping_add(db));
    }
}
