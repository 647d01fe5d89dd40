//! The static layout's allocation path: a continuing request's last token is checked
//! before it is trusted, and hand-out zeroing fills exactly when it is asked for and
//! there are new pages.

mod common;

use common::*;
use unikv_pools::{Error, ExtendRequest, VirtualToken};

/// A request continuing from `last` mid-page.
fn continuing(last: VirtualToken) -> ExtendRequest {
    ExtendRequest {
        prefix_len: 3,
        seq_len: 5,
        last_token: Some(last),
    }
}

#[test]
fn a_last_token_outside_the_live_pages_is_a_bad_request() {
    for layout in LAYOUTS {
        let ps = 4u32;
        let mut p = pool(layout, ps, 16);
        let pages = p.virtual_pages();
        // The sink, the first page past the id space, one far past it, a free page.
        for last in [2, pages * ps + 2, 10 * pages * ps + 2, 5 * ps + 2] {
            let mut out = Vec::new();
            let err = p.alloc_extend(&[continuing(VirtualToken(last))], &mut out);
            assert!(
                matches!(err, Err(Error::BadRequest { index: 0, .. })),
                "{layout:?}: last token {last}: {err:?}"
            );
            assert!(out.is_empty());
        }
    }
}

#[test]
fn hand_out_zeroing_fills_only_new_pages_and_only_when_asked() {
    for zero in [true, false] {
        let ps = 4u32;
        let mut p = pool(Layout::Static, ps, 16);
        if !zero {
            let mut config = static_config(ps, 16);
            config.zero_on_handout = false;
            let device: std::sync::Arc<dyn unikv_kernels::Device> = p.ledger.clone();
            p.alloc = Box::new(unikv_pools::StaticSwa::new(device, config).unwrap());
        }
        let fills = |p: &Pool| {
            p.ledger
                .ops()
                .iter()
                .filter(|o| o.op == "fill_spans")
                .count()
        };
        let row = new_row(&mut p, 3);
        assert_eq!(
            fills(&p),
            zero as usize,
            "zero_on_handout {zero}: a new page"
        );
        // The tail of the last page: no new page, nothing to zero.
        let mut out = Vec::new();
        let tail = ExtendRequest {
            seq_len: 4,
            ..continuing(row[2])
        };
        p.alloc_extend(&[tail], &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(
            fills(&p),
            zero as usize,
            "zero_on_handout {zero}: the tail only"
        );
    }
}
