//! The host pool against a reference model: random allocations and frees of every kind,
//! each checked against what a model of frames and their units allows, with the pool's
//! conservation after every call, byte ranges that never overlap, and refused calls that
//! change nothing.

use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use unikv_pools::{Error, HostBlock, HostKind, HostPool, HostPoolSpec};

#[derive(Clone, Debug)]
enum Op {
    Alloc(HostKind, usize),
    /// Frees the held units of a kind whose position modulo `stride` is `phase`.
    Free(HostKind, usize, usize),
    /// Frees a unit not in use (or one twice): refused.
    BadFree(HostKind, u32, u32),
}

fn kind() -> impl Strategy<Value = HostKind> {
    prop_oneof![
        Just(HostKind::Full),
        Just(HostKind::Swa),
        Just(HostKind::State)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (kind(), 0usize..12).prop_map(|(k, n)| Op::Alloc(k, n)),
        3 => (kind(), 1usize..4, 0usize..4).prop_map(|(k, s, p)| Op::Free(k, s, p % s)),
        1 => (kind(), 0u32..12, 0u32..12).prop_map(|(k, f, i)| Op::BadFree(k, f, i)),
    ]
}

proptest! {
    #[test]
    fn the_host_pool_matches_a_model_of_frames_and_units(
        full in 1u64..5,
        swa in 0u64..3,
        state in 0u64..2,
        frames in 1u64..9,
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        // Unit sizes in 8-byte words: FULL always present, SWA and states maybe not.
        let spec = HostPoolSpec {
            total_bytes: 0,
            full_page_bytes: full * 8,
            swa_page_bytes: swa * 24,
            state_bytes: state * 64,
        };
        let frame = [spec.full_page_bytes, spec.swa_page_bytes, spec.state_bytes]
            .into_iter()
            .max()
            .unwrap();
        let spec = HostPoolSpec { total_bytes: frames * frame + 5, ..spec };
        let mut pool = HostPool::new(spec).unwrap();
        prop_assert_eq!(u64::from(pool.frame_count()), frames);
        let mut held: BTreeMap<HostKind, Vec<HostBlock>> = BTreeMap::new();
        for op in ops {
            let before = format!("{pool:?}");
            match op {
                Op::Alloc(kind, n) => {
                    // The model: frames holding a unit of a kind are lent to it.
                    let per = pool.units_per_frame(kind) as u64;
                    let lent: BTreeMap<u32, HostKind> = held
                        .iter()
                        .flat_map(|(&k, v)| v.iter().map(move |b| (b.frame, k)))
                        .collect();
                    let used_here = held.get(&kind).map_or(0, Vec::len) as u64;
                    let lent_here = lent.values().filter(|&&k| k == kind).count() as u64;
                    let free_frames = frames - lent.len() as u64;
                    let available = if per == 0 { 0 } else { lent_here * per - used_here + free_frames * per };
                    prop_assert_eq!(pool.available(kind), available);
                    let mut one = [0u64; 3];
                    one[HostKind::ALL.iter().position(|&k| k == kind).unwrap()] = n as u64;
                    prop_assert_eq!(pool.fits(one), n == 0 || (per > 0 && n as u64 <= available));
                    let mut out = Vec::new();
                    match pool.alloc(kind, n, &mut out) {
                        Ok(()) => {
                            prop_assert!(per > 0 && n as u64 <= available);
                            prop_assert_eq!(out.len(), n);
                            held.entry(kind).or_default().extend(out);
                        }
                        Err(Error::HostFull { requested, available: a, .. }) => {
                            prop_assert!(n as u64 > available);
                            prop_assert_eq!((requested, a), (n as u64, available));
                            prop_assert!(out.is_empty());
                            prop_assert_eq!(format!("{pool:?}"), before);
                        }
                        Err(Error::BadConfig(_)) => prop_assert_eq!(per, 0),
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                Op::Free(kind, stride, phase) => {
                    let v = held.entry(kind).or_default();
                    let (gone, kept): (Vec<_>, Vec<_>) =
                        v.iter().enumerate().partition(|(i, _)| i % stride == phase);
                    let gone: Vec<HostBlock> = gone.into_iter().map(|(_, &b)| b).collect();
                    *v = kept.into_iter().map(|(_, &b)| b).collect();
                    pool.free(kind, &gone).unwrap();
                }
                Op::BadFree(kind, frame, index) => {
                    let b = HostBlock { frame, index };
                    let live = held.get(&kind).is_some_and(|v| v.contains(&b));
                    // A live unit named twice, or a unit not in use: refused whole.
                    let call = if live { vec![b, b] } else { vec![b] };
                    prop_assert!(
                        matches!(pool.free(kind, &call), Err(Error::HostBadFree { .. })),
                        "{call:?}"
                    );
                    prop_assert_eq!(format!("{pool:?}"), before);
                }
            }
            pool.conservation().map_err(TestCaseError::fail)?;
            // Every unit in use: within the buffer, and no two share a byte.
            let mut spans = BTreeSet::new();
            for (&kind, v) in &held {
                prop_assert_eq!(pool.held(kind), v.len() as u64);
                for &b in v {
                    let lo = pool.offset(kind, b);
                    let hi = lo + pool.unit_bytes(kind);
                    prop_assert!(hi <= frames * frame);
                    spans.insert((lo, hi));
                }
            }
            let spans: Vec<_> = spans.into_iter().collect();
            prop_assert_eq!(spans.len() as u64, held.values().map(|v| v.len() as u64).sum::<u64>());
            prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "{spans:?}");
        }
    }
}
