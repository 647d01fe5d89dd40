//! The per-step checkpoint plan (src/cache/checkpoints.rs) where it is easy to get wrong:
//! which held slots a step may rewrite, which writes a best-effort step keeps when its
//! fresh slots do not fit, and the fresh slots a failed settlement copy gives back. Each
//! scenario at invariant level Strict, so a leaked or doubly freed slot fails the step
//! boundary's conservation check.

mod common;

use common::{LAYOUTS, TINY_MAMBA, TINY_TRI, clear_and_assert_all_free, page_sizes, text};
use std::sync::Arc;
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{CpuDevice, DeviceOp, Error as DeviceError, FaultInjector};
use unikv::mamba::CheckpointWrite;
use unikv::pools::Error as PoolError;
use unikv::{Accepted, Draft, Error, HybridCache, Layout, Request, Speculation, TokenId};

/// Admits `prompt` and prefills all of it in one chunk.
fn prefill(c: &mut HybridCache, prompt: Vec<TokenId>) -> Request {
    let hit = c.match_prefix(prompt);
    let mut req = c.admit(hit).unwrap();
    let n = req.remaining_prefill();
    c.alloc_extend(&mut req, n).unwrap();
    req
}

/// Decodes the batch one token a step, `steps` times.
fn decode(c: &mut HybridCache, batch: &mut [&mut Request], steps: usize) {
    for t in 0..steps {
        let next = vec![TokenId(7_000_000 + t as u32); batch.len()];
        c.alloc_decode(batch, &next).unwrap();
        c.step_boundary().unwrap();
    }
}

/// The slots a request holds for checkpoints (its state slots but the running one).
fn checkpoint_slots(req: &Request) -> usize {
    req.state_slots().len() - 1
}

/// Two chunks of one request in the same step: the first one's checkpoints are written by
/// the step's forward, so the second may not rewrite their slots (a `CheckpointWrite`'s
/// slot is written by nothing else in its step). Holding the per-step bound with this
/// step's checkpoints, the second chunk saves none; at the next step it rewrites them
/// (they are then older, and the tree never saw them).
#[test]
fn a_second_chunk_in_one_step_never_rewrites_a_slot_the_step_writes() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                for ps in page_sizes() {
                    let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                    let grid = ps as usize;
                    let mut c = HybridCache::builder()
                        .model(model)
                        .page_size(ps)
                        .memory_bytes(64 << 20)
                        .layout(layout)
                        .checkpoint_interval(ps)
                        .build()
                        .unwrap();
                    let hit = c.match_prefix(text(0, 12 * grid));
                    let mut req = c.admit(hit).unwrap();
                    c.alloc_extend(&mut req, 4 * grid).unwrap();
                    let first = req.checkpoint_writes().to_vec();
                    assert_eq!(
                        first.iter().map(|w| w.at_len).collect::<Vec<_>>(),
                        [3 * grid, 4 * grid],
                        "{label}: the chunk's two deepest grid points"
                    );
                    c.alloc_extend(&mut req, 4 * grid).unwrap();
                    assert_eq!(req.checkpoint_writes(), [], "{label}: at the bound");
                    assert_eq!(checkpoint_slots(&req), 2, "{label}");
                    c.step_boundary().unwrap();

                    c.alloc_extend(&mut req, 4 * grid).unwrap();
                    let rewrites: Vec<CheckpointWrite> = first
                        .iter()
                        .zip([11, 12])
                        .map(|(w, at)| CheckpointWrite {
                            slot: w.slot,
                            at_len: at * grid,
                        })
                        .collect();
                    assert_eq!(req.checkpoint_writes(), rewrites, "{label}");
                    assert_eq!(checkpoint_slots(&req), 2, "{label}");
                    c.cache_finished(req).unwrap();
                    clear_and_assert_all_free(&mut c, &label);
                }
            }
        }
    });
}

/// A best-effort decode whose fresh checkpoint slots do not fit keeps, per request, the
/// writes into slots it already holds, and only those: with the slot pool full, request
/// `a` rewrites its held checkpoint at the grid point while `b`, which holds none, saves
/// nothing, and the decode succeeds. In either batch order (so each request is planned
/// first once). The static layout: its slot pool fills up independently of the KV.
#[test]
fn a_decode_short_of_fresh_slots_keeps_the_writes_into_held_ones() {
    let layout = LAYOUTS[1];
    assert!(matches!(layout, Layout::Static { .. }));
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for ps in page_sizes() {
                for a_first in [true, false] {
                    let label = format!("{} ps {ps} a first {a_first}", model.name);
                    let grid = ps as usize;
                    let mut c = HybridCache::builder()
                        .model(model)
                        .page_size(ps)
                        .memory_bytes(64 << 20)
                        .layout(layout)
                        .checkpoint_interval(2 * ps)
                        .build()
                        .unwrap();
                    let grid = 2 * grid;
                    // `a` ends one token short of a grid point, then crosses it: it holds
                    // that checkpoint (never cached) from then on.
                    let mut a = prefill(&mut c, text(0, 3 * grid - 1));
                    c.cache_unfinished(&mut a).unwrap();
                    c.step_boundary().unwrap();
                    decode(&mut c, &mut [&mut a], 1);
                    assert_eq!(checkpoint_slots(&a), 1, "{label}");
                    let held = a.state_slots()[1];
                    decode(&mut c, &mut [&mut a], grid - 1);
                    assert_eq!(a.len() % grid, grid - 1, "{label}");
                    // `b` ends one short of a grid point too and holds no checkpoint.
                    let mut b = prefill(&mut c, text(1_000_000, 5 * grid - 1));
                    c.cache_unfinished(&mut b).unwrap();
                    c.step_boundary().unwrap();
                    assert_eq!(checkpoint_slots(&b), 0, "{label}");
                    // No free slot and no cached state to evict.
                    c.evict_all().unwrap();
                    let mut fillers = Vec::new();
                    for i in 0.. {
                        let hit = c.match_prefix(vec![TokenId(9_000_000 + i)]);
                        match c.admit(hit) {
                            Ok(r) => fillers.push(r),
                            Err(Error::OutOfMemory { .. }) => break,
                            Err(e) => panic!("{label}: {e}"),
                        }
                    }
                    assert_eq!(c.stats().mamba.available_pages, 0, "{label}");

                    let next = [TokenId(8_000_000), TokenId(8_000_001)];
                    if a_first {
                        c.alloc_decode(&mut [&mut a, &mut b], &next).unwrap();
                    } else {
                        c.alloc_decode(&mut [&mut b, &mut a], &next).unwrap();
                    }
                    assert_eq!(
                        a.checkpoint_writes(),
                        [CheckpointWrite {
                            slot: held,
                            at_len: a.len()
                        }],
                        "{label}"
                    );
                    assert_eq!(b.checkpoint_writes(), [], "{label}: no fresh slot");
                    assert_eq!(
                        (checkpoint_slots(&a), checkpoint_slots(&b)),
                        (1, 0),
                        "{label}"
                    );
                    c.step_boundary().unwrap();
                    for r in fillers.into_iter().chain([a, b]) {
                        c.release(r).unwrap();
                    }
                    clear_and_assert_all_free(&mut c, &label);
                }
            }
        }
    });
}

/// A settlement whose checkpoint copy out of the slot group fails (the device refuses
/// it) records no checkpoint and gives back the fresh slot it took for it: the step
/// boundary still balances and, once everything is released, every slot is free.
#[test]
fn a_failed_settlement_copy_gives_back_its_fresh_checkpoint_slots() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                let label = format!("{} {}", model.name, layout.as_str());
                let device = Arc::new(FaultInjector::new(Arc::new(CpuDevice::new())));
                let mut c = HybridCache::builder()
                    .model(model)
                    .memory_bytes(8 << 20)
                    .layout(layout)
                    .device(device.clone())
                    .checkpoint_interval(16)
                    .speculation(Speculation::chain(4))
                    .build()
                    .unwrap();
                // 14 prompt tokens, then 5 accepted cross the grid point at 16.
                let mut req = prefill(&mut c, text(0, 14));
                c.cache_unfinished(&mut req).unwrap();
                c.step_boundary().unwrap();
                c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: 4 }])
                    .unwrap();
                let held = c.stats().mamba.held_pages;
                let slots = req.state_slots().len();
                device.fail_at(0);
                let accepted: Vec<TokenId> = text(900, 5);
                let result = c.settle(&mut [&mut req], &[Accepted::chain(&accepted)]);
                assert!(
                    matches!(
                        result,
                        Err(Error::Pool(PoolError::Device(
                            DeviceError::InjectedFault { .. }
                        )))
                    ),
                    "{label}: {result:?}"
                );
                let injected = device.injected();
                assert_eq!(injected.len(), 1, "{label}");
                assert_eq!(injected[0].op, DeviceOp::MoveSpans, "{label}: the copy");
                assert_eq!(
                    req.state_slots().len(),
                    slots,
                    "{label}: no checkpoint recorded"
                );
                assert_eq!(
                    c.stats().mamba.held_pages,
                    held,
                    "{label}: the slot is back"
                );
                c.step_boundary().unwrap();
                c.release(req).unwrap();
                clear_and_assert_all_free(&mut c, &label);
            }
        }
    });
}
