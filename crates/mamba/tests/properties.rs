//! Property tests against small reference models:
//!
//! - the checkpoint tracker over random step sequences (with hand-overs of the latest
//!   checkpoint to the tree) against a model that lists every grid point each step
//!   crossed: the latest checkpoint is always the largest grid point crossed since the
//!   start (or the last hand-over), the slot a step writes never holds the latest
//!   checkpoint, and every other misuse leaves the tracker unchanged;
//! - the grid queries against brute force over every length;
//! - the slot layout over random geometries: ranges disjoint, in slot order, 8-aligned,
//!   inside an entry size that is a positive multiple of 8 and no more than 7 bytes of
//!   padding per range above the packed size.

use proptest::prelude::*;
use unikv_mamba::{
    CheckpointTrack, Error, MambaSpec, RecurrentState, SLOT_ALIGN, SlotPart, StatePolicy,
};
use unikv_pools::{PageSize, VirtualSlot};

#[derive(Clone, Debug)]
enum Op {
    /// Grow the request by this many tokens in one step.
    Step(usize),
    /// Hand the latest checkpoint to the tree and put a fresh slot in its place.
    Take,
    /// A step from a stale length (must be refused, changing nothing).
    Stale,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // Decode steps (1 token), small and large prefill chunks.
        6 => prop_oneof![Just(1usize), 0usize..8, 0usize..100, 0usize..1000].prop_map(Op::Step),
        1 => Just(Op::Take),
        1 => Just(Op::Stale),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_tracker_keeps_the_largest_crossed_grid_point_and_never_overwrites_it(
        page_shift in 0u32..5,
        pages_per_interval in 1u32..5,
        start in 0usize..300,
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let ps = PageSize::new(1 << page_shift).unwrap();
        let interval = (1u32 << page_shift) * pages_per_interval;
        let policy = StatePolicy::checkpointed(interval, ps).unwrap();
        let mut track = CheckpointTrack::new(policy, [VirtualSlot(1), VirtualSlot(2)], start)
            .unwrap();
        let mut next_fresh = 3u32;
        // The model: the request's length, and the grid points crossed since the start or
        // the last hand-over, each a positive multiple of the interval.
        let mut len = start;
        let mut crossed: Vec<usize> = Vec::new();
        for op in ops {
            match op {
                Op::Step(grow) => {
                    let before = track.latest();
                    let new_len = len + grow;
                    let points: Vec<usize> = (len + 1..=new_len)
                        .filter(|p| p % interval as usize == 0)
                        .collect();
                    let write = track.advance(len, new_len).unwrap();
                    match (points.last(), write) {
                        (None, None) => {}
                        (Some(&last), Some(w)) => {
                            prop_assert_eq!(w.at_len, last);
                            prop_assert!(track.slots().contains(&w.slot));
                            if let Some((held, _)) = before {
                                prop_assert_ne!(w.slot, held, "the write hit the latest checkpoint");
                            }
                            prop_assert_eq!(track.latest(), Some((w.slot, w.at_len)));
                        }
                        (p, w) => prop_assert!(false, "crossed {:?} but wrote {:?}", p, w),
                    }
                    crossed.extend(points);
                    len = new_len;
                }
                Op::Take => {
                    let fresh = VirtualSlot(next_fresh);
                    next_fresh += 1;
                    let before = track.clone();
                    let taken = track.take_latest(fresh).unwrap();
                    prop_assert_eq!(taken, before.latest());
                    if let Some((slot, _)) = taken {
                        prop_assert!(!track.slots().contains(&slot));
                        prop_assert!(track.slots().contains(&fresh));
                        crossed.clear();
                    } else {
                        prop_assert_eq!(&track, &before);
                    }
                }
                Op::Stale => {
                    let before = track.clone();
                    prop_assert_eq!(
                        track.advance(len + 1, len + 2),
                        Err(Error::OutOfStep { at: len, old_len: len + 1 })
                    );
                    if len > 0 {
                        prop_assert_eq!(
                            track.advance(len, len - 1),
                            Err(Error::Shrink { old_len: len, new_len: len - 1 })
                        );
                    }
                    prop_assert_eq!(&track, &before);
                }
            }
            prop_assert_eq!(track.request_len(), len);
            prop_assert_ne!(track.slots()[0], track.slots()[1]);
            prop_assert_eq!(track.latest().map(|(_, at)| at), crossed.iter().copied().max());
        }
    }

    #[test]
    fn grid_queries_match_brute_force(
        interval in 1u32..50,
        full_hit in 0usize..400,
        matched in 0usize..400,
    ) {
        let policy = StatePolicy::checkpointed(interval, PageSize::new(1).unwrap()).unwrap();
        let at_or_below = (1..=full_hit).rev().find(|p| p % interval as usize == 0);
        prop_assert_eq!(policy.checkpoint_at_or_below(full_hit), at_or_below);
        prop_assert_eq!(
            policy.branching_len(full_hit, matched),
            at_or_below.filter(|&b| b > matched)
        );
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
