//! `Hooked`, the one forwarding allocator: its hooks see every mutating call with what it
//! handed out, a refusing gate fails a call unforwarded (nothing changes), and the
//! wrapped pool behaves exactly like the bare one.

mod common;

use common::*;
use unikv_pools::{Call, Error, FreeOp, Hooked, Hooks, KvAllocator, Outcome, Segment};

/// Records each call's name and outcome; refuses the call named `refuse`.
#[derive(Debug, Default)]
struct Log {
    seen: Vec<(&'static str, bool, usize)>,
    refuse: Option<&'static str>,
}

impl Hooks for Log {
    fn gate(&mut self, _: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        match self.refuse {
            Some(name) if name == call.name() => Err(Error::NoFreeGroup),
            _ => Ok(()),
        }
    }
    fn after(&mut self, _: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        let handed = match outcome {
            Outcome::Done { tokens, slots } => tokens.len() + slots.len(),
            Outcome::Failed(_) => 0,
        };
        self.seen.push((call.name(), outcome.done(), handed));
    }
}

#[test]
fn hooks_see_every_mutating_call_and_a_refused_call_changes_nothing() {
    each_case(|layout, ps| {
        let mut bare = pool(layout, ps, 16);
        let inner = pool(layout, ps, 16).alloc;
        let mut hooked = Hooked::new(inner, Log::default());
        let n = 3 * ps as usize;
        let a = fresh_row(&mut *bare, n);
        let b = fresh_row(&mut hooked, n);
        assert_eq!(a, b, "{layout:?}/{ps}");

        hooked.hooks_mut().refuse = Some("free_swa_segment");
        let before = format!("{:?}", (hooked.capacity(), hooked.pool_map()));
        let err = hooked.free_swa_segment(Segment::of_row(&b, 0..ps as usize));
        assert!(matches!(err, Err(Error::NoFreeGroup)), "{err:?}");
        assert_eq!(
            format!("{:?}", (hooked.capacity(), hooked.pool_map())),
            before
        );

        hooked.hooks_mut().refuse = None;
        for (p, row) in [
            (&mut *bare.alloc, &a),
            (&mut hooked as &mut dyn KvAllocator, &b),
        ] {
            p.free_group_begin().unwrap();
            p.free_batch(&[FreeOp::Segment(Segment::of_row(row, 0..n))]);
            p.free_group_end().unwrap();
            p.upload_mirror().unwrap();
        }
        assert_eq!(
            format!("{:?}", (bare.capacity(), bare.pool_map())),
            format!("{:?}", (hooked.capacity(), hooked.pool_map())),
        );
        assert_sound(&hooked);
        assert_eq!(
            hooked.hooks().seen,
            [
                ("alloc_extend", true, n),
                ("free_group_begin", true, 0),
                ("free_batch", true, 0),
                ("free_group_end", true, 0),
                ("upload_mirror", true, 0),
            ],
            "{layout:?}/{ps}: the refused call is not shown as forwarded"
        );
    });
}

/// Drops every two-sided segment free.
#[derive(Debug, Default)]
struct LoseSegments(usize);

impl Hooks for LoseSegments {
    fn forward_free(&mut self, _: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        let lost = matches!(op, FreeOp::Segment(_));
        self.0 += lost as usize;
        !lost
    }
}

#[test]
fn a_dropped_free_changes_nothing_and_a_batch_keeps_its_other_ops() {
    each_case(|layout, ps| {
        let p = ps as usize;
        let mut hooked = Hooked::new(pool(layout, ps, 16).alloc, LoseSegments::default());
        let (a, b) = (fresh_row(&mut hooked, 2 * p), fresh_row(&mut hooked, 2 * p));
        let before = hooked.capacity();
        hooked.free_segment(Segment::of_row(&a, 0..2 * p)).unwrap();
        assert_eq!(hooked.capacity(), before, "{layout:?}/{ps}: dropped");
        hooked.free_group_begin().unwrap();
        hooked.free_batch(&[
            FreeOp::Segment(Segment::of_row(&a, 0..2 * p)),
            FreeOp::FullSegment(Segment::of_row(&b, 0..2 * p)),
        ]);
        hooked.free_group_end().unwrap();
        assert_eq!(hooked.hooks().0, 2);
        assert!(hooked.full_live(a[0].page(hooked.page_size())));
        assert!(
            !hooked.full_live(b[0].page(hooked.page_size())),
            "{layout:?}/{ps}"
        );
    });
}
