//! Page sorts for the compaction and relay plans: a freed row's pages as runs, dense
//! distinct pages through a bitmap of their range, anything else by comparison; the
//! result is always what a comparison sort gives.

use crate::ramp::{RUN, is_ramp, is_unit, lowest, steps};

/// Sorts `pages`, each inside `[lo, hi)`, ascending. Pages that are mostly runs (a
/// page-size-1 compaction's holes: freed rows) are sorted as runs
/// ([`sort_as_runs`]). Otherwise distinct pages not too sparse in the range (range / 64
/// at most pages × log2 pages) are sorted through a bitmap of the range in `bits`
/// (scratch): O(pages + range / 64) rather than O(pages log pages). Sparser or repeated
/// pages take a comparison sort; the result is the same.
pub(super) fn sort_pages_in(pages: &mut [u32], (lo, hi): (u32, u32), bits: &mut Vec<u64>) {
    if sort_as_runs(pages, bits) {
        return;
    }
    let words = (hi - lo).div_ceil(64) as usize;
    let log = (usize::BITS - pages.len().leading_zeros()) as usize;
    if words > pages.len() * log.max(2) {
        pages.sort_unstable();
        return;
    }
    bits.clear();
    bits.resize(words, 0);
    let mut repeated = 0;
    for &p in pages.iter() {
        let at = p - lo;
        let (word, bit) = (&mut bits[(at / 64) as usize], 1u64 << (at % 64));
        repeated |= *word & bit;
        *word |= bit;
    }
    if repeated != 0 {
        pages.sort_unstable();
        return;
    }
    let mut out = pages.iter_mut();
    for (w, &word) in bits.iter().enumerate() {
        let (base, mut word) = (lo + 64 * w as u32, word);
        while word != 0 {
            // Each set bit is one of the pages, so there is a slot for it.
            if let Some(slot) = out.next() {
                *slot = base + word.trailing_zeros();
            }
            word &= word - 1;
        }
    }
}

/// Sorts `pages` as runs when at most one in eight is outside a run: each [`RUN`]-page
/// chunk that ascends or descends by one starts a run (grown a chunk at a time), each
/// other page is a run of one; the runs, as `start << 32 | len` in `scratch`, are sorted
/// and written back ascending. O(pages + runs log runs). Returns `false`, leaving
/// `pages` as they were, when too few pages run or two runs share a page.
fn sort_as_runs(pages: &mut [u32], scratch: &mut Vec<u64>) -> bool {
    let n = pages.len();
    let (mut i, mut singles) = (0, 0);
    scratch.clear();
    while i < n {
        let run = pages[i..].first_chunk::<RUN>().and_then(|chunk| {
            let step = chunk[1].wrapping_sub(chunk[0]);
            (is_unit(step) && is_ramp(chunk, chunk[0], &steps(step))).then_some((chunk[0], step))
        });
        let Some((first, step)) = run else {
            let end = (i + RUN).min(n);
            singles += end - i;
            if 8 * singles > n {
                return false;
            }
            scratch.extend(pages[i..end].iter().map(|&p| u64::from(p) << 32 | 1));
            i = end;
            continue;
        };
        let ramp = steps(step);
        let mut len = RUN;
        while let Some(next) = pages[i + len..].first_chunk::<RUN>()
            && is_ramp(
                next,
                first.wrapping_add(step.wrapping_mul(len as u32)),
                &ramp,
            )
        {
            len += RUN;
        }
        scratch.push(u64::from(lowest((first, step), len)) << 32 | len as u64);
        i += len;
    }
    scratch.sort_unstable();
    let mut end = 0;
    for &run in scratch.iter() {
        let (start, len) = (run >> 32, run & u64::from(u32::MAX));
        if start < end {
            return false; // a page listed twice
        }
        end = start + len;
    }
    let mut out = 0;
    for &run in scratch.iter() {
        let (start, len) = ((run >> 32) as u32, (run & u64::from(u32::MAX)) as usize);
        for (slot, page) in pages[out..out + len].iter_mut().zip(start..) {
            *slot = page;
        }
        out += len;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page listed twice, the second time inside another run's span, is not lost or
    /// misplaced by the runs sort (it falls back to a comparison sort).
    #[test]
    fn a_page_repeated_inside_a_run_sorts_as_a_comparison_sort_does() {
        let mut pages: Vec<u32> = (0..200).chain(1000..1100).collect();
        pages.push(50);
        pages.extend(1100..1200);
        let mut expected = pages.clone();
        expected.sort_unstable();
        sort_pages_in(&mut pages, (0, 1200), &mut Vec::new());
        assert_eq!(pages, expected);
    }

    proptest::proptest! {
        /// Dense, sparse or repeated, pages come out as a comparison sort leaves them.
        #[test]
        fn pages_sort_as_a_comparison_sort_does(
            lo in 0u32..1000,
            width in 1u32..700,
            picks in proptest::collection::vec(0u32..700, 0..400),
            repeat in proptest::bool::ANY,
        ) {
            let mut pages: Vec<u32> = picks.iter().map(|&k| lo + k % width).collect();
            if !repeat {
                pages.sort_unstable();
                pages.dedup();
                // A fixed shuffle, so the input is not sorted already.
                let n = pages.len();
                for i in 0..n {
                    pages.swap(i, (i * 7 + 3) % n);
                }
            }
            let mut expected = pages.clone();
            expected.sort_unstable();
            let mut bits = vec![u64::MAX; 3]; // stale scratch is cleared
            sort_pages_in(&mut pages, (lo, lo + width), &mut bits);
            proptest::prop_assert_eq!(pages, expected);
        }

        /// Runs either way (a freed row's pages), some single pages and perhaps a page
        /// listed twice, in a shuffled order of runs, come out as a comparison sort
        /// leaves them.
        #[test]
        fn runs_sort_as_a_comparison_sort_does(
            lens in proptest::collection::vec((1usize..300, proptest::bool::ANY), 0..12),
            order in proptest::collection::vec(0usize..1000, 12),
            repeat in proptest::option::of(0usize..2000),
        ) {
            // Run k covers [300 k, 300 k + len), listed up or down.
            let mut runs: Vec<Vec<u32>> = lens
                .iter()
                .enumerate()
                .map(|(k, &(len, down))| {
                    let run = 300 * k as u32..300 * k as u32 + len as u32;
                    if down { run.rev().collect() } else { run.collect() }
                })
                .collect();
            for (k, &o) in order.iter().enumerate().take(runs.len()) {
                let j = o % runs.len();
                runs.swap(k, j);
            }
            let mut pages: Vec<u32> = runs.concat();
            if let Some(r) = repeat.filter(|_| !pages.is_empty()) {
                let again = pages[r % pages.len()];
                pages.insert((r * 7) % pages.len(), again);
            }
            let mut expected = pages.clone();
            expected.sort_unstable();
            let mut bits = vec![u64::MAX; 3];
            sort_pages_in(&mut pages, (0, 3600), &mut bits);
            proptest::prop_assert_eq!(pages, expected);
        }
    }
}
