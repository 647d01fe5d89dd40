//! Property tests against small reference models:
//!
//! - the checkpoint plan over random steps against a brute-force model that lists every
//!   candidate position in order of worth (branching point, prompt end, grid points from
//!   the deepest) and keeps the first distinct ones inside the step;
//! - the grid queries against brute force over every length;
//! - the slot layout over random geometries: ranges disjoint, in slot order, 8-aligned,
//!   inside an entry size that is a positive multiple of 8 and no more than 7 bytes of
//!   padding per range above the packed size.

use proptest::prelude::*;
use unikv_mamba::{Error, MambaSpec, PlanMarks, RecurrentState, SLOT_ALIGN, SlotPart, StatePolicy};
use unikv_pools::PageSize;

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_plan_keeps_the_worthiest_distinct_page_boundaries_inside_the_step(
        page_shift in 0u32..5,
        pages_per_interval in 1u32..5,
        per_step in 1u32..5,
        old_len in 0usize..2000,
        grow in prop_oneof![Just(1usize), 0usize..8, 0usize..600],
        branching in proptest::option::of(0usize..2600),
        prompt_len in 0usize..2600,
    ) {
        let ps = 1usize << page_shift;
        let interval = ps * pages_per_interval as usize;
        let policy = StatePolicy::checkpointed(interval as u32, PageSize::new(ps as u32).unwrap())
            .unwrap()
            .with_checkpoints_per_step(per_step)
            .unwrap();
        let new_len = old_len + grow;
        let marks = PlanMarks { branching, prompt_len };
        let mut got = Vec::new();
        policy.plan(old_len..new_len, marks, &mut got);

        // The model: candidates in order of worth, page-floored, kept when inside the
        // step and not seen before, up to the bound; then sorted.
        let mut candidates: Vec<usize> = branching.into_iter().chain([prompt_len]).collect();
        candidates.extend((1..=new_len / interval).rev().map(|k| k * interval));
        let mut want: Vec<usize> = Vec::new();
        for c in candidates {
            let c = c / ps * ps;
            if c > old_len && c <= new_len && !want.contains(&c) && want.len() < per_step as usize {
                want.push(c);
            }
        }
        want.sort_unstable();
        prop_assert_eq!(&got, &want);
        prop_assert!(got.iter().all(|p| p % ps == 0 && *p > 0));
    }

    #[test]
    fn grid_queries_match_brute_force(
        interval in 1u32..50,
        full_hit in 0usize..400,
    ) {
        let policy = StatePolicy::checkpointed(interval, PageSize::new(1).unwrap()).unwrap();
        let at_or_below = (1..=full_hit).rev().find(|p| p % interval as usize == 0);
        prop_assert_eq!(policy.checkpoint_at_or_below(full_hit), at_or_below);
    }

    #[test]
    fn slot_ranges_are_disjoint_ordered_aligned_and_inside_the_entry(
        layers in 1u32..40,
        conv_channels in 0u32..5000,
        conv_kernel in 0u32..6,
        heads in 0u32..64,
        head_dim in 0u32..130,
        state_size in 0u32..130,
        conv_dtype_bytes in 1u32..5,
        state_dtype_bytes in 1u32..5,
        side_state_bytes in prop_oneof![Just(0u64), 0u64..100_000],
    ) {
        let state = RecurrentState {
            conv_channels,
            conv_kernel,
            heads,
            head_dim,
            state_size,
            conv_dtype_bytes,
            state_dtype_bytes,
        };
        let spec = MambaSpec::new(layers, state).with_side_state_bytes(side_state_bytes);
        let per_layer = state.state_bytes_per_layer();
        let Ok(slot) = spec.slot_layout() else {
            prop_assert_eq!(per_layer, 0, "only a stateless layer is refused here");
            prop_assert_eq!(
                spec.slot_layout(),
                Err(Error::NoState { layers, bytes_per_layer: 0 })
            );
            return Ok(());
        };
        let entry = slot.entry_bytes();
        prop_assert!(entry > 0 && entry % SLOT_ALIGN == 0);
        prop_assert_eq!(spec.entry_bytes(), Ok(entry));
        prop_assert_eq!(spec.slot_pool_spec("mamba").unwrap().bytes_per_slot, entry);
        let parts: Vec<_> = slot.parts().collect();
        prop_assert_eq!(parts.len(), 2 * layers as usize + 1);
        let mut expected_order = (0..layers).map(SlotPart::Conv).collect::<Vec<_>>();
        expected_order.extend((0..layers).map(SlotPart::Temporal));
        expected_order.push(SlotPart::Side);
        prop_assert_eq!(parts.iter().map(|p| p.0).collect::<Vec<_>>(), expected_order);
        let mut end = 0u64;
        for (part, range) in &parts {
            prop_assert!(range.start >= end, "{:?} overlaps its predecessor", part);
            prop_assert!(range.start - end < SLOT_ALIGN, "{:?}: more than 7 bytes of padding", part);
            prop_assert_eq!(range.start % SLOT_ALIGN, 0);
            prop_assert!(range.end <= entry);
            let (want_len, accessor) = match part {
                SlotPart::Conv(l) => (state.checked_conv_bytes().unwrap(), slot.conv(*l).unwrap()),
                SlotPart::Temporal(l) => {
                    (state.checked_temporal_bytes().unwrap(), slot.temporal(*l).unwrap())
                }
                SlotPart::Side => (side_state_bytes, slot.side()),
            };
            prop_assert_eq!(range.end - range.start, want_len);
            prop_assert_eq!(range, &accessor);
            end = range.end;
        }
        prop_assert!(entry - end < SLOT_ALIGN);
        // The packed size is what the facade's ModelSpec prices; padding adds < 8 B a range.
        let packed = layers as u64 * per_layer + side_state_bytes;
        prop_assert!(entry >= packed && entry - packed < SLOT_ALIGN * (parts.len() as u64 + 1));
    }
}
