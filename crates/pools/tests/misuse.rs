//! Misuse of the public allocator API that used to panic (or to pass validation and then
//! corrupt the tables) gets a typed error and changes nothing.

mod common;

use common::{each_case, new_row, pool};
use unikv_kernels::TableId;
use unikv_pools::{
    DecodeRequest, Error, ExtendRequest, Grid, KvAllocator, PageDemand, Reclaimable, Segment, Side,
    VirtualPage, VirtualSlot, VirtualToken,
};

/// What a refused call must leave as it was.
fn snapshot(a: &dyn KvAllocator) -> impl PartialEq + std::fmt::Debug + use<> {
    (a.capacity(), a.pool_map(), a.pending_frees(), a.verify())
}

#[test]
fn an_empty_segment_does_not_hide_an_overlap() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 16);
        let row = new_row(&mut p, 2 * ps as usize);
        let psz = ps as usize;
        let before = snapshot(&*p.alloc);
        let segs = [
            Segment::of_row(&row, 0..psz),
            Segment::of_row(&row, psz..psz),
            Segment::of_row(&row, 0..psz),
        ];
        let err = p.free_segments(&segs).unwrap_err();
        assert!(matches!(err, Error::SegmentsShareAPage { .. }), "{err}");
        assert_eq!(snapshot(&*p.alloc), before);
    });
}

#[test]
fn a_transfer_that_names_a_page_twice_is_refused_before_anything_moves() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 16);
        let psz = ps as usize;
        let live = new_row(&mut p, 2 * psz);
        let dead = new_row(&mut p, 2 * psz);
        p.free_swa_segment(Segment::of_row(&dead, 0..2 * psz))
            .unwrap();
        let before = snapshot(&*p.alloc);
        // The same source page twice (a row with a repeated page).
        let twice: Vec<_> = live[..psz].iter().chain(&live[..psz]).copied().collect();
        let err = p
            .transfer_swa(
                Segment::of_row(&twice, 0..2 * psz),
                Segment::of_row(&dead, 0..2 * psz),
            )
            .unwrap_err();
        assert!(matches!(err, Error::BadTransfer { .. }), "{err}");
        assert_eq!(snapshot(&*p.alloc), before);
        // The same target twice.
        let twice: Vec<_> = dead[..psz].iter().chain(&dead[..psz]).copied().collect();
        let err = p
            .transfer_swa(
                Segment::of_row(&live, 0..2 * psz),
                Segment::of_row(&twice, 0..2 * psz),
            )
            .unwrap_err();
        assert!(matches!(err, Error::BadTransfer { .. }), "{err}");
        assert_eq!(snapshot(&*p.alloc), before);
        p.transfer_swa(
            Segment::of_row(&live, 0..2 * psz),
            Segment::of_row(&dead, 0..2 * psz),
        )
        .unwrap();
        p.verify().unwrap();
    });
}

#[test]
fn huge_sizes_are_typed_errors_without_wrapped_numbers() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 16);
        let psz = ps as usize;
        let row = new_row(&mut p, 3);
        let before = snapshot(&*p.alloc);
        let mut out = Vec::new();
        for req in [
            ExtendRequest {
                prefix_len: 0,
                seq_len: usize::MAX,
                last_token: None,
            },
            ExtendRequest {
                prefix_len: 3,
                seq_len: usize::MAX,
                last_token: row.last().copied(),
            },
        ] {
            let err = p.alloc_extend(&[req], &mut out).unwrap_err();
            // The true page count, not a wrapped one.
            let pages = req.new_pages(p.page_size());
            assert!(
                matches!(err, Error::OutOfCapacity { full_pages, .. } if full_pages == pages),
                "{err}"
            );
        }
        let half = ExtendRequest {
            prefix_len: 0,
            seq_len: usize::MAX / 2 + 1,
            last_token: None,
        };
        let err = p.alloc_extend(&[half, half], &mut out).unwrap_err();
        assert!(
            matches!(err, Error::OutOfCapacity { full_pages, .. } if full_pages >= usize::MAX / 2 / psz),
            "{err}"
        );
        let decode = DecodeRequest {
            prefix_len: usize::MAX,
            last_token: row.last().copied(),
        };
        let err = p.alloc_decode(&[decode], &mut out).unwrap_err();
        assert!(matches!(err, Error::BadRequest { index: 0, .. }), "{err}");
        assert!(out.is_empty());
        let huge = PageDemand::pages(usize::MAX, usize::MAX);
        assert!(!p.allocation_fits(huge));
        assert!(!p.allocation_fits(PageDemand::pages(0, usize::MAX)));
        let err = p.ensure_capacity(huge).unwrap_err();
        assert!(matches!(err, Error::OutOfCapacity { .. }), "{err}");
        let all = Reclaimable::pages(usize::MAX, usize::MAX);
        assert_eq!(p.reclaim_plan(huge, all), None);
        assert!(p.reclaim_plan(PageDemand::joint(1), all).is_some());
        assert_eq!(snapshot(&*p.alloc), before);
    });
}

/// Builds `layout` with `total` bytes and the given geometry.
fn build(
    layout: common::Layout,
    ps: u32,
    window: u32,
    ratio: f64,
    total: u64,
) -> Result<Box<dyn KvAllocator>, Error> {
    let device: std::sync::Arc<dyn unikv_kernels::Device> =
        std::sync::Arc::new(unikv_kernels::CpuDevice::new());
    let (full, swa) = (common::full_spec(), common::swa_spec());
    Ok(match layout {
        common::Layout::Unified => Box::new(unikv_pools::UnifiedSwa::new(
            device,
            unikv_pools::UnifiedSwaConfig {
                total_bytes: total,
                page_size: ps,
                window,
                full,
                swa: Some(swa),
                mamba: None,
                zero_on_handout: false,
            },
        )?),
        common::Layout::Static => Box::new(unikv_pools::StaticSwa::new(
            device,
            unikv_pools::StaticSwaConfig {
                total_bytes: total,
                page_size: ps,
                window,
                full,
                swa: Some(swa),
                mamba: None,
                swa_full_ratio: ratio,
                zero_on_handout: false,
            },
        )?),
    })
}

#[test]
fn the_stated_need_of_a_too_small_buffer_is_exactly_enough() {
    for layout in common::LAYOUTS {
        for ps in [1, 4, 16] {
            for window in [8, 64] {
                for ratio in [0.5, 0.8, 1.0, 2.0] {
                    let case = format!("{layout:?} ps {ps} window {window} ratio {ratio}");
                    let Err(Error::BufferTooSmall {
                        needed,
                        have,
                        floor,
                    }) = build(layout, ps, window, ratio, 256)
                    else {
                        panic!("{case}: 256 bytes must be too small");
                    };
                    assert_eq!(have.0, 256);
                    // The floor it states: a window and a page of both sides.
                    assert_eq!(
                        floor.window_tokens,
                        Some(window as usize + ps as usize),
                        "{case}"
                    );
                    assert!(needed.0 > 256, "{case}");
                    build(layout, ps, window, ratio, needed.0)
                        .unwrap_or_else(|e| panic!("{case}: the stated need {needed} fails: {e}"));
                    let err = build(layout, ps, window, ratio, needed.0 - 1).err();
                    assert!(
                        matches!(err, Some(Error::BufferTooSmall { needed: n, .. }) if n == needed),
                        "{case}: one byte less must be refused with the same need: {err:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn huge_model_dimensions_are_a_typed_error() {
    let spec = unikv_pools::SubPoolSpec::mha("huge", u32::MAX, u32::MAX, u32::MAX, u32::MAX);
    assert_eq!(spec.bytes_per_token, u64::MAX, "saturated, not wrapped");
    let device: std::sync::Arc<dyn unikv_kernels::Device> =
        std::sync::Arc::new(unikv_kernels::CpuDevice::new());
    let err = unikv_pools::UnifiedSwa::new(
        device,
        unikv_pools::UnifiedSwaConfig {
            total_bytes: u64::MAX,
            page_size: 256,
            window: 8,
            full: spec.clone(),
            swa: Some(spec),
            mamba: None,
            zero_on_handout: false,
        },
    )
    .unwrap_err();
    assert!(matches!(err, Error::BadConfig(_)), "{err}");
}

#[test]
fn a_segment_is_refused_for_its_real_cause_unaligned_or_mid_page() {
    each_case(|layout, ps| {
        if ps < 2 {
            return; // at page size 1 every id starts its page and every position aligns
        }
        let mut p = pool(layout, ps, 16);
        let psz = ps as usize;
        let row = new_row(&mut p, 2 * psz);
        let before = snapshot(&*p.alloc);
        let err = p.free_segment(Segment::of_row(&row, 1..psz)).unwrap_err();
        assert!(
            matches!(err, Error::UnalignedSegment { start: 1, .. }),
            "{err}"
        );
        // An aligned position whose ids start mid-page (a row shifted by one token).
        let shifted = &row[1..];
        let err = p
            .free_segment(Segment::of_row(shifted, 0..psz))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::SegmentStartsMidPage {
                    start: 0,
                    offset: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("starts mid-page"), "{err}");
        assert_eq!(snapshot(&*p.alloc), before);
    });
}

#[test]
fn slot_demands_on_a_pool_without_slots_are_typed_errors_that_change_nothing() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 16);
        let row = new_row(&mut p, 2 * ps as usize);
        // A deferred free is pending: a refused call must not flush it either.
        p.free_group_begin().unwrap();
        p.free(&row).unwrap();
        let before = snapshot(&*p.alloc);
        let mut out = vec![VirtualSlot(7)];
        let err = p.alloc_slots(1, &mut out).unwrap_err();
        assert!(
            matches!(err, Error::NoSlotPool { op: "alloc_slots" }),
            "{err}"
        );
        assert_eq!(out, [VirtualSlot(7)]);
        assert!(!p.allocation_fits(PageDemand::slots(1)));
        let err = p.ensure_capacity(PageDemand::slots(1)).unwrap_err();
        assert!(matches!(err, Error::NoSlotPool { .. }), "{err}");
        let everything = Reclaimable {
            mamba_slots: usize::MAX,
            ..Reclaimable::pages(usize::MAX, usize::MAX)
        };
        assert_eq!(p.reclaim_plan(PageDemand::slots(1), everything), None);
        // Pages fit, slots do not: the demand as a whole does not.
        let mixed = PageDemand {
            mamba_slots: 1,
            ..PageDemand::joint(1)
        };
        assert!(p.allocation_fits(PageDemand::joint(1)));
        assert!(!p.allocation_fits(mixed));
        assert_eq!(snapshot(&*p.alloc), before, "{layout:?}/{ps}");
        // A page demand with slots evictable but none asked: sized as before.
        assert_eq!(
            p.reclaim_plan(PageDemand::joint(1), everything),
            Some(unikv_pools::ReclaimPlan::default())
        );
        p.free_group_end().unwrap();
    });
}

#[test]
fn the_mamba_side_of_a_pool_without_slots_is_absent_not_a_panic() {
    each_case(|layout, ps| {
        let mut p = pool(layout, ps, 16);
        let row = new_row(&mut p, 2 * ps as usize);
        p.upload_mirror().unwrap();
        let before = snapshot(&*p.alloc);
        assert_eq!(p.grid(Side::Mamba), Grid::ABSENT);
        assert_eq!(p.stride(Side::Mamba), 0);
        assert_eq!(p.mirror_table(Side::Mamba), None);
        assert!(p.mirror_table(Side::Full).is_some());
        // A live FULL token is the sink on the absent side.
        assert_ne!(p.kernel_id(Side::Full, row[0]), 0);
        assert_eq!(p.kernel_id(Side::Mamba, row[0]), 0);
        assert_eq!(p.kernel_id(Side::Mamba, VirtualToken(u32::MAX)), 0);
        assert_eq!(p.physical_page(Side::Mamba, VirtualPage(1)), None);
        let err = p
            .translate(Side::Mamba, TableId(0), 1, TableId(0), 1)
            .unwrap_err();
        assert!(
            matches!(err, Error::NoSlotPool { op: "translate" }),
            "{err}"
        );
        assert!(p.pool_map().spans.iter().all(|s| s.side != Side::Mamba));
        assert_eq!(snapshot(&*p.alloc), before, "{layout:?}/{ps}");
    });
}
