//! `Hooked`, the one forwarding allocator: its hooks see every mutating call with what it
//! handed out, a refusing gate fails a call unforwarded (nothing changes), and the
//! wrapped pool behaves exactly like the bare one. A pair of hooks is one wrapped around
//! the other, an `Option` its hooks or nothing, and a gate sees the line that called the
//! allocator, through pairs and nested wrappers.

mod common;

use common::*;
use std::panic::Location;
use std::sync::{Arc, Mutex};
use unikv_kernels::Error as DeviceError;
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

/// Logs every hook call under its tag into a shared log; refuses calls named `refuse`.
#[derive(Debug)]
struct Tagged {
    tag: &'static str,
    refuse: Option<&'static str>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Tagged {
    fn new(
        tag: &'static str,
        refuse: Option<&'static str>,
        log: &Arc<Mutex<Vec<String>>>,
    ) -> Tagged {
        Tagged {
            tag,
            refuse,
            log: log.clone(),
        }
    }

    fn note(&self, what: String) {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} {what}", self.tag));
    }
}

impl Hooks for Tagged {
    fn gate(&mut self, _: &dyn KvAllocator, call: Call<'_>) -> Result<(), Error> {
        self.note(format!("gate {}", call.name()));
        match self.refuse {
            Some(name) if name == call.name() => Err(Error::Device(DeviceError::InjectedFault {
                op: call.name(),
                index: 0,
                location: Location::caller(),
            })),
            _ => Ok(()),
        }
    }
    fn forward_free(&mut self, _: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        self.note(format!("forward {}", op.name()));
        true
    }
    fn after(&mut self, _: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        self.note(format!("after {} {}", call.name(), outcome.done()));
    }
}

/// A few calls on `alloc` (a checked free, a group with a batch, an upload): whether each
/// succeeded.
fn script(alloc: &mut dyn KvAllocator, ps: u32) -> Vec<bool> {
    let p = ps as usize;
    let row = fresh_row(alloc, 2 * p);
    vec![
        alloc.free_swa_segment(Segment::of_row(&row, 0..p)).is_ok(),
        alloc.free_group_begin().is_ok(),
        {
            alloc.free_batch(&[FreeOp::FullSegment(Segment::of_row(&row, 0..p))]);
            true
        },
        alloc.free_group_end().is_ok(),
        alloc.upload_mirror().is_ok(),
    ]
}

/// The logs of `script` on a pool behind a pair of hooks and behind two layers of the
/// same hooks (`b` refusing calls named `refuse`), after checking that both did alike.
fn paired_and_layered(layout: Layout, ps: u32, refuse: Option<&'static str>) -> [Vec<String>; 2] {
    let (paired, layered) = (Arc::default(), Arc::default());
    let hooks = (
        Tagged::new("a", None, &paired),
        Tagged::new("b", refuse, &paired),
    );
    let mut one = Hooked::new(pool(layout, ps, 16).alloc, hooks);
    let inner = Hooked::new(
        pool(layout, ps, 16).alloc,
        Tagged::new("b", refuse, &layered),
    );
    let mut two = Hooked::new(Box::new(inner), Tagged::new("a", None, &layered));
    assert_eq!(script(&mut one, ps), script(&mut two, ps));
    assert_eq!(
        format!("{:?}", (one.capacity(), one.pool_map())),
        format!("{:?}", (two.capacity(), two.pool_map())),
    );
    [paired, layered].map(|l| l.lock().unwrap().clone())
}

/// The entries of `log` by the hook tagged `tag`.
fn by(tag: &str, log: &[String]) -> Vec<String> {
    let tag = format!("{tag} ");
    log.iter()
        .filter(|e| e.starts_with(&tag))
        .cloned()
        .collect()
}

#[test]
fn a_pair_of_hooks_is_the_first_wrapped_around_the_second() {
    each_case(|layout, ps| {
        for refuse in [None, Some("free_group_end")] {
            let [paired, layered] = paired_and_layered(layout, ps, refuse);
            // Each hook sees what it would as a layer. (Across the two, a pair runs both
            // gates of a checked free before it asks either whether to forward it.)
            for tag in ["a", "b"] {
                assert_eq!(
                    by(tag, &paired),
                    by(tag, &layered),
                    "{layout:?}/{ps}/{refuse:?}"
                );
            }
            if refuse.is_some() {
                // `a` sees `b`'s refusal; `b` sees no `after`.
                let at = paired
                    .iter()
                    .position(|l| l == "b gate free_group_end")
                    .unwrap();
                assert_eq!(paired[at + 1], "a after free_group_end false", "{paired:?}");
            }
        }
        // The documented difference: a checked free `b` refuses is refused before `a` is
        // asked whether to forward it.
        let [paired, layered] = paired_and_layered(layout, ps, Some("free_swa_segment"));
        let refused = |log: &[String]| {
            let at = log
                .iter()
                .position(|l| l == "a gate free_swa_segment")
                .unwrap();
            log[at..at + 4].to_vec()
        };
        let gate_a = "a gate free_swa_segment";
        let (gate_b, forward_a) = ("b gate free_swa_segment", "a forward free_swa_segment");
        let failed = "a after free_swa_segment false";
        assert_eq!(refused(&paired)[..3], [gate_a, gate_b, failed]);
        assert_eq!(refused(&layered), [gate_a, forward_a, gate_b, failed]);
    });
}

#[test]
fn none_watches_nothing_and_some_is_its_hooks() {
    each_case(|layout, ps| {
        let log = Arc::default();
        let mut none = Hooked::new(pool(layout, ps, 16).alloc, None::<Tagged>);
        let mut some = Hooked::new(
            pool(layout, ps, 16).alloc,
            Some(Tagged::new("s", None, &log)),
        );
        assert_eq!(script(&mut none, ps), script(&mut some, ps));
        assert_eq!(
            log.lock().unwrap()[..2],
            ["s gate alloc_extend", "s after alloc_extend true"]
        );
    });
}

/// The file and line an injected fault names.
fn refusal_site(err: Result<(), Error>) -> (&'static str, u32) {
    match err {
        Err(Error::Device(DeviceError::InjectedFault { location, .. })) => {
            (location.file(), location.line())
        }
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn an_injected_allocator_fault_names_the_line_that_called_the_allocator() {
    each_case(|layout, ps| {
        let log = Arc::default();
        let p = ps as usize;
        // One wrapper, a pair of hooks, and two nested wrappers: the gate that refuses
        // sees the test's line each time.
        let refuse = |name| Tagged::new("r", Some(name), &log);
        let mut allocators: [Box<dyn KvAllocator>; 3] = [
            Box::new(Hooked::new(
                pool(layout, ps, 16).alloc,
                refuse("free_segment"),
            )),
            Box::new(Hooked::new(
                pool(layout, ps, 16).alloc,
                (Tagged::new("a", None, &log), refuse("free_segment")),
            )),
            Box::new(Hooked::new(
                Box::new(Hooked::new(
                    pool(layout, ps, 16).alloc,
                    refuse("free_segment"),
                )),
                Tagged::new("a", None, &log),
            )),
        ];
        for alloc in &mut allocators {
            let row = fresh_row(&mut **alloc, 2 * p);
            let line = line!() + 1;
            let err = alloc.free_segment(Segment::of_row(&row, 0..p));
            assert_eq!(refusal_site(err), (file!(), line), "{layout:?}/{ps}");
        }
        // An allocation and a call by ids too.
        let mut alloc = Hooked::new(pool(layout, ps, 16).alloc, refuse("alloc_slots"));
        let line = line!() + 1;
        let err = alloc.alloc_slots(1, &mut Vec::new());
        assert_eq!(refusal_site(err), (file!(), line));
        let mut alloc = Hooked::new(pool(layout, ps, 16).alloc, refuse("free"));
        let row = fresh_row(&mut alloc, p);
        let line = line!() + 1;
        let err = alloc.free(&row);
        assert_eq!(refusal_site(err), (file!(), line));
    });
}
