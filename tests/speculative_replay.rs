//! Speculative decoding with the **replay rollback** ([`unikv::StateReplay`]): a verify
//! logs each position's recurrence inputs into a lane packed with others into a state
//! slot, and settling hands the engine's replay the accepted entries to replay from the
//! running state. The tests play both kernels on the CPU backend with a toy recurrence
//! (the state is an FNV fold of the tokens; a log entry is the token): the verify kernel
//! writes each position's token into the entry the verify metadata names, and the replay
//! folds the accepted entries into the running slot, saving checkpoints on the way. Every
//! state the cache hands back — running, checkpoint, resumed — must equal a recompute.

mod common;

use common::{LAYOUTS, TINY_MAMBA, TINY_TRI};
use std::sync::{Arc, Mutex};
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{CpuDevice, HostSync, Readback};
use unikv::{
    Accepted, BookkeepingReplay, DeviceValues, Draft, Error, HybridCache, Layout, ModelSpec,
    ReplayContext, Request, Speculation, StateCommit, StateReplay, TokenId, VerifyMetadata,
    VerifyOffsets,
};

/// Drafted tokens per chain verify.
const K: usize = 4;
/// Bytes of a toy log entry: one token id (a tiny model's 64-byte slot holds 16).
const LOG: u64 = 4;

/// The toy recurrence: the state after `tokens`.
fn fold(tokens: impl IntoIterator<Item = u64>) -> u64 {
    tokens.into_iter().fold(0xcbf2_9ce4_8422_2325, step)
}

fn step(h: u64, token: u64) -> u64 {
    (h ^ token).wrapping_mul(0x0100_0000_01b3)
}

fn ids(tokens: &[TokenId]) -> impl Iterator<Item = u64> + '_ {
    tokens.iter().map(|t| u64::from(t.0))
}

/// The engine's replay on the CPU backend: folds each commit's entries into its running
/// state, saving checkpoints; records every commit it saw.
#[derive(Debug)]
struct ToyReplay {
    cpu: Arc<CpuDevice>,
    seen: Mutex<Vec<(u64, usize, Vec<u32>)>>,
    fail: Mutex<bool>,
}

impl ToyReplay {
    fn new(cpu: Arc<CpuDevice>) -> Arc<ToyReplay> {
        Arc::new(ToyReplay {
            cpu,
            seen: Mutex::default(),
            fail: Mutex::new(false),
        })
    }
}

impl StateReplay for ToyReplay {
    fn log_bytes_per_position(&self) -> u64 {
        LOG
    }

    fn replay(
        &self,
        ctx: &ReplayContext<'_>,
        commits: &[StateCommit<'_>],
    ) -> Result<(), unikv::kernels::Error> {
        if *self.fail.lock().unwrap() {
            return Err(unikv::kernels::Error::Cuda("injected".into()));
        }
        self.cpu.run_kernel(ctx.buffer, |bytes| {
            for c in commits {
                let at = |slot: u32, index: u32| {
                    ctx.entry_offset(unikv::LogEntry { slot, index }) as usize
                };
                let mut h = read(bytes, at(c.running, 0));
                let mut saves = c.checkpoints.iter().peekable();
                for (n, e) in c.entries.iter().enumerate() {
                    h = step(h, read_entry(bytes, at(e.slot, e.index)));
                    while let Some(&(_, slot)) = saves.next_if(|s| s.0 as usize == n + 1) {
                        write(bytes, at(slot, 0), h);
                    }
                }
                write(bytes, at(c.running, 0), h);
                self.seen.lock().unwrap().push((
                    c.request,
                    c.entries.len(),
                    c.checkpoints.iter().map(|s| s.0).collect(),
                ));
            }
        })
    }
}

fn read(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn read_entry(bytes: &[u8], at: usize) -> u64 {
    u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()))
}

fn write(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn cache(
    model: ModelSpec,
    layout: Layout,
    ps: u32,
    spec: Speculation,
) -> (HybridCache, Arc<CpuDevice>, Arc<ToyReplay>) {
    let cpu = Arc::new(CpuDevice::new());
    let replay = ToyReplay::new(cpu.clone());
    let c = HybridCache::builder()
        .model(model)
        .page_size(ps)
        .memory_bytes(8 << 20)
        .layout(layout)
        .checkpoint_interval(16)
        .speculation(spec)
        .state_replay(replay.clone())
        .device(cpu.clone())
        .build()
        .unwrap();
    (c, cpu, replay)
}

/// The physical slot a request's running state is in.
fn physical(c: &HybridCache, slot: unikv::pools::VirtualSlot) -> u32 {
    c.allocator().physical_slot(slot).expect("a bound slot")
}

/// The toy state in physical slot `p`.
fn state(c: &HybridCache, cpu: &CpuDevice, p: u32) -> u64 {
    let sync = HostSync::acquire("test: reading a toy state");
    let at = c.kv_geometry().slot_offset(p);
    let b = cpu
        .read_bytes(&sync, c.allocator().buffer(), at, 8)
        .unwrap();
    u64::from_le_bytes(b.try_into().unwrap())
}

/// Writes the toy state `v` into physical slot `p` (a prefill kernel).
fn set_state(c: &HybridCache, cpu: &CpuDevice, p: u32, v: u64) {
    let at = c.kv_geometry().slot_offset(p) as usize;
    cpu.run_kernel(c.allocator().buffer(), |bytes| write(bytes, at, v))
        .unwrap();
}

/// The draft token request `r` proposes at row `pos`.
fn draft(r: usize, pos: usize) -> TokenId {
    TokenId((r * 1000 + pos) as u32 % 50_000 + 7)
}

/// Admits request `r`'s prompt of `len` tokens, prefills it and writes its states.
fn prefill(c: &mut HybridCache, cpu: &CpuDevice, r: usize, len: usize) -> Request {
    let prompt: Vec<TokenId> = (0..len).map(|p| draft(r, p)).collect();
    let hit = c.match_prefix(prompt.clone());
    let mut req = c.admit(hit).unwrap();
    c.alloc_extend(&mut req, len).unwrap();
    set_state(
        c,
        cpu,
        physical(c, req.state_slot().unwrap()),
        fold(ids(&prompt)),
    );
    // The checkpoints the prefill's forward saves (its prompt's end, grid points).
    for w in req.checkpoint_writes() {
        set_state(c, cpu, physical(c, w.slot), fold(ids(&prompt[..w.at_len])));
    }
    req
}

/// The verify kernel: for each request of the batch, the state it starts from (the
/// running one, then the earlier verify's accepted entries replayed: `earlier` is how
/// many) must be the recompute's, and it logs each position's draft token into the entry
/// the metadata names.
fn verify_kernel(
    c: &HybridCache,
    cpu: &CpuDevice,
    meta: &VerifyMetadata,
    batch: &[&Request],
    earlier: &[usize],
) {
    let l = meta.layout();
    let (inputs, outputs) = meta.tables().unwrap();
    let sync = HostSync::acquire("test: the verify kernel reads its ids");
    let ins = cpu.read_table(&sync, inputs, 0, l.inputs_len).unwrap();
    let outs = cpu.read_table(&sync, outputs, 0, l.outputs_len).unwrap();
    let g = c.kv_geometry();
    let s = l.slots_per_request;
    for (m, req) in batch.iter().enumerate() {
        let settled = req.settled_len();
        let running = outs[l.state_in + m] as u32;
        assert_eq!(running, physical(c, req.state_slot().unwrap()), "state_in");
        let mut h = state(c, cpu, running);
        assert_eq!(
            h,
            fold(ids(req.tokens())),
            "the running state is the settled one"
        );
        for i in 0..earlier[m] {
            let slot = outs[l.prev_out + m * l.width + i] as u32;
            let index = ins[l.entries + m * s + 1 + i] as u64;
            let sync = HostSync::acquire("test");
            let b = cpu
                .read_bytes(
                    &sync,
                    c.allocator().buffer(),
                    g.slot_offset(slot) + index * LOG,
                    4,
                )
                .unwrap();
            h = step(h, read_entry(&b, 0));
        }
        let start = settled + earlier[m];
        let all: Vec<u64> = ids(req.tokens())
            .chain((settled..start).map(|p| u64::from(draft(m, p).0)))
            .collect();
        assert_eq!(h, fold(all), "the verify starts from the accepted state");
        let width = ins[l.widths + m] as usize;
        cpu.run_kernel(c.allocator().buffer(), |bytes| {
            for i in 0..width {
                let slot = outs[l.state_out + m * l.width + i] as u32;
                let index = ins[l.entries + m * s + s - l.width + i] as u32;
                assert!(slot > 0, "an entry translated to the sink");
                let at = (g.slot_offset(slot) + u64::from(index) * LOG) as usize;
                bytes[at..at + 4].copy_from_slice(&draft(m, start + i).0.to_le_bytes());
            }
        })
        .unwrap();
    }
}

/// What the target accepts of request `m`'s verify from row `from`: `n` draft tokens.
fn accepted(m: usize, from: usize, n: usize) -> Vec<TokenId> {
    (from..from + n).map(|p| draft(m, p)).collect()
}

#[test]
fn replay_rollback_packs_many_verifies_into_one_slot_and_commits_the_accepted_entries() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                for ps in [1u32, 16] {
                    let spec = Speculation::chain(K as u32).batch(3);
                    let (mut c, cpu, replay) = cache(model, layout, ps, spec);
                    let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                    let shape = c.scratch_shape();
                    assert!(shape.entries_per_slot as usize >= 3 * (K + 1), "{label}");
                    let mut reqs: Vec<Request> = (0..3)
                        .map(|r| prefill(&mut c, &cpu, r, 10 + 3 * r))
                        .collect();
                    c.step_boundary().unwrap();
                    let mut meta = VerifyMetadata::new(3);
                    for (round, counts) in [[1, 5, 3], [5, 5, 5], [2, 1, 4], [5, 2, 1]]
                        .into_iter()
                        .enumerate()
                    {
                        let mut batch: Vec<&mut Request> = reqs.iter_mut().collect();
                        c.alloc_verify(&mut batch, &[Draft::Chain { k: K }; 3])
                            .unwrap();
                        // Three verifies' lanes share one slot.
                        assert_eq!(c.stats().verify_scratch_slots, 1, "{label}");
                        let view: Vec<&Request> = batch.iter().map(|r| &**r).collect();
                        c.build_verify_metadata(&mut meta, &view).unwrap();
                        c.translate_verify(&mut meta, None).unwrap();
                        verify_kernel(&c, &cpu, &meta, &view, &[0; 3]);
                        let from: Vec<usize> = batch.iter().map(|r| r.settled_len()).collect();
                        let acc: Vec<Vec<TokenId>> =
                            (0..3).map(|m| accepted(m, from[m], counts[m])).collect();
                        let lists: Vec<Accepted<'_>> =
                            acc.iter().map(|a| Accepted::chain(a)).collect();
                        c.settle(&mut batch, &lists).unwrap();
                        for (m, req) in reqs.iter().enumerate() {
                            let p = physical(&c, req.state_slot().unwrap());
                            assert_eq!(
                                state(&c, &cpu, p),
                                fold(ids(req.tokens())),
                                "{label} round {round}: request {m}'s running state"
                            );
                            for w in req.held_checkpoints() {
                                assert_eq!(
                                    state(&c, &cpu, physical(&c, w.slot)),
                                    fold(ids(&req.tokens()[..w.at_len])),
                                    "{label}: request {m}'s checkpoint at {}",
                                    w.at_len
                                );
                            }
                        }
                        c.step_boundary().unwrap();
                    }
                    let seen = replay.seen.lock().unwrap().len();
                    assert_eq!(seen, 12, "{label}: one commit per request per settle");
                    // A finished request's state resumes a follow-up exactly.
                    let conversation = reqs[1].tokens().to_vec();
                    for req in reqs.drain(..) {
                        c.cache_finished(req).unwrap();
                    }
                    c.step_boundary().unwrap();
                    // A follow-up turn: the conversation and a new token; it resumes from
                    // the running state the finish cached.
                    let mut follow_up = conversation.clone();
                    follow_up.push(TokenId(3));
                    let hit = c.match_prefix(follow_up);
                    let at = hit.cached_tokens();
                    let page = ps as usize;
                    assert_eq!(
                        at,
                        conversation.len() / page * page,
                        "{label}: resumes at its end's page"
                    );
                    let req = c.admit(hit).unwrap();
                    assert_eq!(
                        state(&c, &cpu, physical(&c, req.state_slot().unwrap())),
                        fold(ids(&conversation[..at])),
                        "{label}: the resumed state"
                    );
                    c.release(req).unwrap();
                    common::clear_and_assert_all_free(&mut c, &label);
                }
            }
        }
    });
}

#[test]
fn a_late_verify_replays_the_earlier_verifys_accepted_entries_and_settles_in_order() {
    scoped_level(Level::Strict, || {
        for model in [TINY_MAMBA, TINY_TRI] {
            for layout in LAYOUTS {
                let spec = Speculation::chain(K as u32).in_flight(2).batch(2);
                let (mut c, cpu, _) = cache(model, layout, 1, spec);
                let label = format!("{} {}", model.name, layout.as_str());
                let mut a = prefill(&mut c, &cpu, 0, 14);
                let mut b = prefill(&mut c, &cpu, 1, 9);
                c.step_boundary().unwrap();
                let values = cpu_values(&cpu, 2);
                let mut meta = VerifyMetadata::new(2);
                c.alloc_verify(&mut [&mut a, &mut b], &[Draft::Chain { k: K }; 2])
                    .unwrap();
                c.build_verify_metadata(&mut meta, &[&a, &b]).unwrap();
                c.translate_verify(&mut meta, None).unwrap();
                verify_kernel(&c, &cpu, &meta, &[&a, &b], &[0, 0]);
                c.step_boundary().unwrap();
                // The next verify before the counts reach the host: the device holds
                // them (a accepted 5, b 2), and the new verify replays them first.
                let counts = [5usize, 2];
                use unikv::kernels::Device;
                cpu.upload_table(values, 0, &[5, 2]).unwrap();
                c.alloc_verify(&mut [&mut a, &mut b], &[Draft::Chain { k: K }; 2])
                    .unwrap();
                c.build_verify_metadata(&mut meta, &[&a, &b]).unwrap();
                let offsets = VerifyOffsets {
                    accepted: DeviceValues {
                        table: values,
                        at: 0,
                    },
                    last_node: DeviceValues {
                        table: values,
                        at: 0,
                    },
                };
                c.translate_verify(&mut meta, Some(offsets)).unwrap();
                verify_kernel(&c, &cpu, &meta, &[&a, &b], &counts);
                // Settle the first (crossing the grid point at 16 for a), then the second.
                let first = [accepted(0, 14, 5), accepted(1, 9, 2)];
                c.settle(
                    &mut [&mut a, &mut b],
                    &[Accepted::chain(&first[0]), Accepted::chain(&first[1])],
                )
                .unwrap();
                assert_eq!(
                    a.held_checkpoints().map(|w| w.at_len).collect::<Vec<_>>(),
                    [16],
                    "{label}: the grid point's checkpoint"
                );
                let second = [accepted(0, 19, 3), accepted(1, 11, 5)];
                c.settle(
                    &mut [&mut a, &mut b],
                    &[Accepted::chain(&second[0]), Accepted::chain(&second[1])],
                )
                .unwrap();
                for (m, req) in [&a, &b].into_iter().enumerate() {
                    let p = physical(&c, req.state_slot().unwrap());
                    assert_eq!(state(&c, &cpu, p), fold(ids(req.tokens())), "{label}: {m}");
                    for w in req.held_checkpoints() {
                        assert_eq!(
                            state(&c, &cpu, physical(&c, w.slot)),
                            fold(ids(&req.tokens()[..w.at_len])),
                            "{label}: {m}'s checkpoint at {}",
                            w.at_len
                        );
                    }
                }
                c.release(a).unwrap();
                c.release(b).unwrap();
                cpu.free_table(values).unwrap();
                common::clear_and_assert_all_free(&mut c, &label);
            }
        }
    });
}

/// A device table of `n` entries for the engine's accepted counts.
fn cpu_values(cpu: &CpuDevice, n: usize) -> unikv::kernels::TableId {
    use unikv::kernels::Device;
    cpu.alloc_table(n, 0).unwrap()
}

#[test]
fn a_refused_replay_changes_nothing_and_the_settlement_can_be_retried() {
    scoped_level(Level::Strict, || {
        let spec = Speculation::chain(K as u32).batch(1);
        let (mut c, cpu, replay) = cache(TINY_MAMBA, Layout::Unified, 1, spec);
        let mut req = prefill(&mut c, &cpu, 0, 14);
        c.alloc_verify(&mut [&mut req], &[Draft::Chain { k: K }])
            .unwrap();
        let mut meta = VerifyMetadata::new(1);
        c.build_verify_metadata(&mut meta, &[&req]).unwrap();
        c.translate_verify(&mut meta, None).unwrap();
        verify_kernel(&c, &cpu, &meta, &[&req], &[0]);
        let before = (req.len(), req.settled_len(), req.state_slots());
        let held = c.stats().mamba.held_pages;
        c.step_boundary().unwrap();
        let available = c.stats().mamba.available_pages;
        *replay.fail.lock().unwrap() = true;
        let acc = accepted(0, 14, 4);
        let err = c
            .settle(&mut [&mut req], &[Accepted::chain(&acc)])
            .unwrap_err();
        assert!(matches!(err, Error::Device(_)), "{err:?}");
        let after = (req.len(), req.settled_len(), req.state_slots());
        assert_eq!(after, before, "nothing changed");
        assert_eq!(c.stats().mamba.held_pages, held);
        // The checkpoint slot it took goes back with the step's frees.
        c.step_boundary().unwrap();
        assert_eq!(c.stats().mamba.available_pages, available);
        *replay.fail.lock().unwrap() = false;
        c.settle(&mut [&mut req], &[Accepted::chain(&acc)]).unwrap();
        let p = physical(&c, req.state_slot().unwrap());
        assert_eq!(state(&c, &cpu, p), fold(ids(req.tokens())));
        c.release(req).unwrap();
        common::clear_and_assert_all_free(&mut c, "refused replay");
    });
}

#[test]
fn the_builder_refuses_a_replay_it_cannot_use() {
    let cpu = Arc::new(CpuDevice::new());
    let build = |model: ModelSpec, spec: Option<Speculation>, replay: Arc<dyn StateReplay>| {
        let b = HybridCache::builder()
            .model(model)
            .memory_bytes(8 << 20)
            .state_replay(replay)
            .device(cpu.clone());
        match spec {
            Some(s) => b.speculation(s),
            None => b,
        }
        .build()
    };
    let toy: Arc<dyn StateReplay> = ToyReplay::new(cpu.clone());
    let spec = Some(Speculation::chain(2));
    let config = |r: Result<HybridCache, Error>| match r {
        Err(Error::Config(why)) => why,
        other => panic!("expected a config error, got {other:?}"),
    };
    assert!(config(build(TINY_MAMBA, None, toy.clone())).contains("needs speculation"));
    assert!(
        config(build(common::tiny_model(8, 1), spec, toy.clone())).contains("needs speculation")
    );
    let huge: Arc<dyn StateReplay> = Arc::new(BookkeepingReplay {
        log_bytes_per_position: u64::MAX,
    });
    let why = config(build(TINY_MAMBA, spec, huge));
    assert!(why.contains("bookkeeping"), "{why}");
    // On a device without bytes, bookkeeping is allowed, but not a log past a slot.
    let none = |log: u64| {
        HybridCache::builder()
            .model(TINY_MAMBA)
            .memory_bytes(8 << 20)
            .speculation(Speculation::chain(2))
            .state_replay(Arc::new(BookkeepingReplay {
                log_bytes_per_position: log,
            }))
            .device(Arc::new(unikv::kernels::NullDevice::new()))
            .build()
    };
    assert!(config(none(u64::MAX)).contains("log entry"));
    assert!(config(none(0)).contains("log entry"));
    let c = none(LOG).unwrap();
    assert!(c.scratch_shape().entries_per_slot > 1);
    // The copy rollback is the default: one state per entry.
    let copy = HybridCache::builder()
        .model(TINY_MAMBA)
        .memory_bytes(8 << 20)
        .speculation(Speculation::chain(2))
        .build()
        .unwrap();
    assert_eq!(copy.scratch_shape(), unikv::ScratchShape::copy(3));
}

#[test]
fn a_tree_verify_commits_the_entries_along_its_accepted_path() {
    scoped_level(Level::Strict, || {
        for layout in LAYOUTS {
            let spec = Speculation::tree(5).batch(1);
            let (mut c, cpu, replay) = cache(TINY_TRI, layout, 1, spec);
            let mut req = prefill(&mut c, &cpu, 0, 13);
            let parents = [-1, 0, 0, 1, 2];
            c.alloc_verify(&mut [&mut req], &[Draft::Tree { parents: &parents }])
                .unwrap();
            let mut meta = VerifyMetadata::new(1);
            c.build_verify_metadata(&mut meta, &[&req]).unwrap();
            c.translate_verify(&mut meta, None).unwrap();
            verify_kernel(&c, &cpu, &meta, &[&req], &[0]);
            // The path root → 2 → 4 crosses the grid point at 16.
            let path = [0u32, 2, 4];
            let toks: Vec<TokenId> = path.iter().map(|&n| draft(0, 13 + n as usize)).collect();
            c.settle(&mut [&mut req], &[Accepted::tree(&path, &toks)])
                .unwrap();
            let p = physical(&c, req.state_slot().unwrap());
            assert_eq!(state(&c, &cpu, p), fold(ids(req.tokens())), "{layout:?}");
            let saves: Vec<(usize, u64)> = req
                .held_checkpoints()
                .map(|w| (w.at_len, state(&c, &cpu, physical(&c, w.slot))))
                .collect();
            assert!(
                saves.iter().any(|&(at, _)| at == 16),
                "{layout:?}: {saves:?}"
            );
            for (at, h) in saves {
                assert_eq!(h, fold(ids(&req.tokens()[..at])), "{layout:?}: at {at}");
            }
            assert_eq!(replay.seen.lock().unwrap().last().unwrap().1, 3);
            c.release(req).unwrap();
            common::clear_and_assert_all_free(&mut c, "tree");
        }
    });
}
