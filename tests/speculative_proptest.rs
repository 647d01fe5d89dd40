//! Random speculative lifecycles through `HybridCache`, at invariant level Strict, on both
//! layouts, for a FULL + SWA, a FULL + Mamba and a tri-pool model: arrivals sharing
//! prefixes, prefill, verify steps of random width (chains and draft trees), acceptance
//! from all rejected to all accepted, counts settled at once or one step late, plain
//! decode steps between, caching while running, finishing and aborts mid-verify, under a
//! budget small enough that eviction and compaction move pages and slots.
//!
//! The engine's kernels are simulated on the real buffer, as a GPU would run them: the
//! driver decides each verify's acceptance when it allocates it (the device knows it
//! before the host does) and writes every verify position's KV rows — FULL, SWA and the
//! draft layer — and the state after each position into the slot group, at the positions
//! the device uses (after the accepted rows of every earlier unsettled verify). A tree
//! verify's accepted nodes are moved to consecutive rows by
//! [`HybridCache::compact_accepted`]'s device copy, driven by a device table of paths.
//! Every byte is a hash of the tokens up to its position (`state_of`), so shared
//! prefixes and copies are checked exactly.
//!
//! After every operation the step boundary checks conservation on all three sides, and
//! the driver checks the bytes of every settled row (FULL, and SWA inside the window) and
//! every running state of every request, and at admission the state copied from the
//! prefix cache. A case ends by releasing everything and evicting everything: every page
//! and slot comes back. Failing seeds are kept next to this file.

mod common;

use common::{LAYOUTS, TINY_MAMBA, TINY_TRI, proptest_config, tiny_model};
use proptest::prelude::*;
use std::collections::VecDeque;
use std::sync::Arc;
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{ByteSpan, CpuDevice, Device, HostSync, Readback, TableId};
use unikv::pools::{Side, VirtualSlot, VirtualToken};
use unikv::{
    Accepted, DeviceValues, Draft, Error, HybridCache, Layout, ModelSpec, Request, Speculation,
    TokenId, VerifyMetadata, VerifyOffsets,
};

/// The widest verify: chains of up to 4 drafts, trees of up to 5 nodes.
const WIDTH: usize = 5;
/// The draft trees a verify may use (parents in row order).
const TREES: [&[i32]; 3] = [&[-1, 0, 0, 1, 2], &[-1, 0, 1, 1], &[-1, 0, 0, 0]];
/// Tokens a rejected draft position carries (never an accepted token: tokens are < 8).
const REJECTED: u32 = 1_000;

#[derive(Clone, Debug)]
enum Op {
    /// A new prompt: `prefix` tokens of base text `base`, then `suffix`, prefilled whole.
    Arrive {
        base: u8,
        prefix: u8,
        suffix: Vec<u8>,
    },
    /// The picked requests (a bit mask over the ready ones) verify: `shape` picks a chain
    /// of `shape % WIDTH` drafts or a tree, `accept` how much of it the target keeps.
    Verify {
        mask: u8,
        shape: u8,
        accept: u8,
    },
    /// The picked requests' oldest verifies are settled.
    Settle {
        mask: u8,
    },
    /// A settle that must be refused: settling twice, or accepting more than the width.
    BadSettle {
        pick: u8,
    },
    /// Every request with nothing unsettled decodes one token.
    Decode {
        token: u8,
    },
    CacheUnfinished {
        pick: u8,
    },
    /// A request finishes, settled or not.
    Finish {
        pick: u8,
    },
    /// A request is aborted (or retracted), settled or not.
    Abort {
        pick: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..3, 0u8..=common::BASE_LEN as u8, prop::collection::vec(0u8..8, 1..12))
            .prop_map(|(base, prefix, suffix)| Op::Arrive { base, prefix, suffix }),
        6 => (any::<u8>(), any::<u8>(), any::<u8>())
            .prop_map(|(mask, shape, accept)| Op::Verify { mask, shape, accept }),
        5 => any::<u8>().prop_map(|mask| Op::Settle { mask }),
        1 => any::<u8>().prop_map(|pick| Op::BadSettle { pick }),
        2 => (0u8..8).prop_map(|token| Op::Decode { token }),
        1 => any::<u8>().prop_map(|pick| Op::CacheUnfinished { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Abort { pick }),
    ]
}

/// What the device knows of one unsettled verify and the host does not yet.
#[derive(Clone, Debug)]
struct Unsettled {
    /// The accepted tokens (what `settle` will be told).
    tokens: Vec<TokenId>,
    /// A tree's accepted path.
    path: Option<Vec<u32>>,
}

/// A running request and the device's view of it.
struct Running {
    req: Request,
    /// Its unsettled verifies, oldest first.
    unsettled: VecDeque<Unsettled>,
}

impl Running {
    /// The tokens the device has: the settled ones and every unsettled accepted one.
    fn device_tokens(&self) -> Vec<TokenId> {
        let mut t = self.req.tokens().to_vec();
        for u in &self.unsettled {
            t.extend_from_slice(&u.tokens);
        }
        t
    }
}

struct Driver {
    cache: HybridCache,
    device: Arc<CpuDevice>,
    /// The engine's device table of accepted counts and paths.
    values: TableId,
    running: Vec<Running>,
    spec: Speculation,
    label: String,
    next_token: u32,
}

impl Driver {
    /// The byte spans of a token's rows on `side` (every layer's K and V).
    fn row_spans(&self, side: Side, t: VirtualToken) -> Vec<ByteSpan> {
        let id = self.cache.allocator().kernel_id(side, t);
        assert!(id > 0, "{}: {side:?} row {t} is unbound", self.label);
        self.id_spans(side, id)
    }

    /// The byte spans of kernel id `id`'s rows on `side`.
    fn id_spans(&self, side: Side, id: i32) -> Vec<ByteSpan> {
        let g = self.cache.kv_geometry();
        let (layers, row_bytes) = match side {
            Side::Full => (self.cache.model().full_envelope_layers(), g.full_row_bytes),
            _ => (self.cache.model().swa_layers, g.swa_row_bytes),
        };
        (0..layers)
            .flat_map(|l| [false, true].map(|v| (l, v)))
            .map(|(l, v)| ByteSpan {
                offset: g.row_offset(side, id, l, v),
                len: row_bytes,
            })
            .collect()
    }

    fn slot_span(&self, slot: VirtualSlot) -> ByteSpan {
        let alloc = self.cache.allocator();
        let grid = alloc.grid(Side::Mamba);
        let p = alloc
            .physical_slot(slot)
            .unwrap_or_else(|| panic!("{}: slot {slot:?} is not bound", self.label));
        ByteSpan {
            offset: grid.offset(p),
            len: grid.envelope,
        }
    }

    fn fill(&self, spans: &[ByteSpan], value: u8) {
        self.device
            .fill_spans(self.cache.allocator().buffer(), spans, value)
            .unwrap();
    }

    fn read(&self, span: ByteSpan) -> Vec<u8> {
        let sync = HostSync::acquire("test: reading the buffer back");
        self.device
            .read_bytes(
                &sync,
                self.cache.allocator().buffer(),
                span.offset,
                span.len,
            )
            .unwrap()
    }

    fn has_swa(&self) -> bool {
        self.cache.model().swa_layers > 0
    }

    /// The simulated forward of a prefill or decode of request `i`: its new rows' KV, its
    /// running state and the checkpoints the cache asked for.
    fn forward(&self, i: usize, new_rows: usize) {
        let r = &self.running[i].req;
        let tokens = r.tokens();
        for p in r.len() - new_rows..r.len() {
            let value = common::state_of(&tokens[..=p]);
            self.fill(&self.row_spans(Side::Full, r.row()[p]), value);
            if self.has_swa() {
                self.fill(&self.row_spans(Side::Swa, r.row()[p]), value);
            }
        }
        if let Some(slot) = r.state_slot() {
            self.fill(
                &[self.slot_span(slot)],
                common::state_of(&tokens[..r.len()]),
            );
        }
        for w in r.checkpoint_writes() {
            self.fill(
                &[self.slot_span(w.slot)],
                common::state_of(&tokens[..w.at_len]),
            );
        }
    }

    /// The simulated verify forward of the batch's `m`-th request (`i`-th running), with
    /// `nodes` its positions' tokens and `parents` its tree (a chain's is `i - 1`): it
    /// checks the input state the metadata names and writes every position's KV at the
    /// write ids and the state after it into the group slot the metadata names — all
    /// read from the device tables `translate_verify` filled.
    fn verify_forward(
        &self,
        meta: &VerifyMetadata,
        m: usize,
        i: usize,
        nodes: &[TokenId],
        parents: &[i32],
    ) {
        let run = &self.running[i];
        let mut before = run.device_tokens();
        // The newest verify's own accepted tokens are in `unsettled` already.
        let newest = run.unsettled.back().expect("a verify to run");
        before.truncate(before.len() - newest.tokens.len());
        let l = meta.layout();
        let (_, outputs) = meta.tables().unwrap();
        let sync = HostSync::acquire("test: the simulated kernel reads its metadata");
        let out = self
            .device
            .read_table(&sync, outputs, 0, l.outputs_len)
            .unwrap();
        let w = l.width;
        if l.slots_per_request > 0 {
            let slot = out[l.state_in + m] as u32;
            let got = self.read(self.slot_span_physical(slot));
            let want = common::state_of(&before);
            assert!(
                got.iter().all(|&b| b == want) || before.len() <= run.req.cached_at_admission(),
                "{}: request {} starts its verify from state {} not {want}",
                self.label,
                run.req.id(),
                got[0]
            );
        }
        for (n, _) in nodes.iter().enumerate() {
            // The tokens on the node's root path.
            let mut path = vec![n];
            while parents[*path.last().unwrap()] >= 0 {
                path.push(parents[*path.last().unwrap()] as usize);
            }
            let mut seq = before.clone();
            seq.extend(path.iter().rev().map(|&m| nodes[m]));
            let value = common::state_of(&seq);
            self.fill(
                &self.id_spans(Side::Full, out[l.write_full + m * w + n]),
                value,
            );
            if self.has_swa() {
                self.fill(
                    &self.id_spans(Side::Swa, out[l.write_swa + m * w + n]),
                    value,
                );
            }
            if l.slots_per_request > 0 {
                let slot = out[l.state_out + m * w + n] as u32;
                self.fill(&[self.slot_span_physical(slot)], value);
            }
        }
    }

    fn slot_span_physical(&self, p: u32) -> ByteSpan {
        let grid = self.cache.allocator().grid(Side::Mamba);
        assert!(p > 0, "{}: a state slot translated to the sink", self.label);
        ByteSpan {
            offset: grid.offset(p),
            len: grid.envelope,
        }
    }

    /// Every settled row's KV and the running state hold the bytes of their tokens.
    fn check_request(&self, run: &Running) {
        let r = &run.req;
        let tokens = r.tokens();
        let settled = r.settled_len();
        let window = self.cache.model().window as usize;
        for p in 0..settled {
            let want = common::state_of(&tokens[..=p]);
            let mut sides = vec![Side::Full];
            // SWA is live from the cursor on (a window behind the settled rows).
            if self.has_swa() && p >= r.window_cursor().max(settled.saturating_sub(window)) {
                sides.push(Side::Swa);
            }
            for side in sides {
                for span in self.row_spans(side, r.row()[p]) {
                    let got = self.read(span);
                    assert!(
                        got.iter().all(|&b| b == want),
                        "{}: request {} row {p} on {side:?} holds {} not {want}",
                        self.label,
                        r.id(),
                        got[0]
                    );
                }
            }
        }
        if let Some(slot) = r.state_slot()
            && settled > r.cached_at_admission()
            && run.unsettled.is_empty()
        {
            let want = common::state_of(&tokens[..settled]);
            let got = self.read(self.slot_span(slot));
            assert!(
                got.iter().all(|&b| b == want),
                "{}: request {} runs on the state {} not {want}",
                self.label,
                r.id(),
                got[0]
            );
        }
    }

    fn pick(&self, pick: u8, filter: impl Fn(&Running) -> bool) -> Option<usize> {
        let c: Vec<usize> = (0..self.running.len())
            .filter(|&i| filter(&self.running[i]))
            .collect();
        (!c.is_empty()).then(|| c[pick as usize % c.len()])
    }

    /// The requests whose bit is set in `mask` (over those passing `filter`).
    fn picks(&self, mask: u8, filter: impl Fn(&Running) -> bool) -> Vec<usize> {
        (0..self.running.len())
            .filter(|&i| filter(&self.running[i]))
            .enumerate()
            .filter(|(n, _)| mask & (1 << (n % 8)) != 0)
            .map(|(_, i)| i)
            .collect()
    }

    fn fresh_token(&mut self) -> TokenId {
        self.next_token = (self.next_token + 1) % 8;
        TokenId(self.next_token)
    }

    fn apply(&mut self, op: &Op) -> Result<(), Error> {
        match *op {
            Op::Arrive {
                base,
                prefix,
                ref suffix,
            } => {
                let mut prompt = common::base_text(base, 8)[..prefix as usize].to_vec();
                prompt.extend(suffix.iter().map(|&t| TokenId(t as u32)));
                let hit = self.cache.match_prefix(prompt);
                if !self.cache.can_admit(&hit, 0) {
                    return Ok(());
                }
                let mut req = match self.cache.admit(hit) {
                    Err(Error::OutOfMemory { .. }) => return Ok(()),
                    other => other?,
                };
                let cached = req.cached_at_admission();
                if let Some(slot) = req.state_slot()
                    && cached > 0
                {
                    let want = common::state_of(&req.tokens()[..cached]);
                    let got = self.read(self.slot_span(slot));
                    assert!(
                        got.iter().all(|&b| b == want),
                        "{}: admitted with {cached} cached tokens, its state holds {}",
                        self.label,
                        got[0]
                    );
                }
                let n = req.remaining_prefill();
                match self.cache.alloc_extend(&mut req, n) {
                    Err(Error::OutOfMemory { .. }) => return self.cache.release(req).map(drop),
                    other => other?,
                }
                self.running.push(Running {
                    req,
                    unsettled: VecDeque::new(),
                });
                self.forward(self.running.len() - 1, n);
                Ok(())
            }
            Op::Verify {
                mask,
                shape,
                accept,
            } => {
                let max = self.spec.max_in_flight as usize;
                let mut idx = self.picks(mask, |r| {
                    r.req.remaining_prefill() == 0 && r.unsettled.len() < max
                });
                // The verify metadata is built for batches of up to 8.
                idx.truncate(8);
                if idx.is_empty() {
                    return Ok(());
                }
                // One shape for the batch: a chain of 0..WIDTH drafts or a tree.
                let s = shape as usize % (WIDTH + TREES.len());
                let (draft, parents): (Draft<'_>, Vec<i32>) = if s < WIDTH {
                    (Draft::Chain { k: s }, (-1..s as i32).collect())
                } else {
                    let t = TREES[s - WIDTH];
                    (Draft::Tree { parents: t }, t.to_vec())
                };
                let drafts = vec![draft; idx.len()];
                let result = {
                    let mut batch: Vec<&mut Request> = Vec::new();
                    for (n, run) in self.running.iter_mut().enumerate() {
                        if idx.contains(&n) {
                            batch.push(&mut run.req);
                        }
                    }
                    self.cache.alloc_verify(&mut batch, &drafts)
                };
                match result {
                    Err(Error::OutOfMemory { .. }) => return Ok(()),
                    other => other?,
                }
                // The device's offsets: where the earlier unsettled verify's accepted
                // positions end (its accepted count, and one past its last node).
                let mut offsets = vec![0i32; 2 * idx.len()];
                for (m, &i) in idx.iter().enumerate() {
                    if let Some(earlier) = self.running[i].unsettled.back() {
                        offsets[m] = earlier.tokens.len() as i32;
                        offsets[idx.len() + m] = earlier
                            .path
                            .as_ref()
                            .map_or(earlier.tokens.len() as i32, |p| {
                                *p.last().unwrap() as i32 + 1
                            });
                    }
                }
                let mut meta = VerifyMetadata::new(8);
                let batch: Vec<&Request> = idx.iter().map(|&i| &self.running[i].req).collect();
                self.cache.build_verify_metadata(&mut meta, &batch)?;
                self.device.upload_table(self.values, 0, &offsets).unwrap();
                let values = |at| DeviceValues {
                    table: self.values,
                    at,
                };
                self.cache.translate_verify(
                    &mut meta,
                    Some(VerifyOffsets {
                        accepted: values(0),
                        last_node: values(idx.len()),
                    }),
                )?;
                let mut paths = vec![-1i32; idx.len() * WIDTH];
                for (m, &i) in idx.iter().enumerate() {
                    // The target's choice: a root-to-node path as deep as `accept` allows.
                    let width = parents.len();
                    let want = 1 + (accept as usize + m) % width;
                    let mut path = vec![0u32];
                    while path.len() < want {
                        let last = *path.last().unwrap() as i32;
                        let children: Vec<usize> =
                            (0..width).filter(|&c| parents[c] == last).collect();
                        if children.is_empty() {
                            break;
                        }
                        path.push(children[(accept as usize + path.len()) % children.len()] as u32);
                    }
                    let mut nodes: Vec<TokenId> =
                        (0..width).map(|n| TokenId(REJECTED + n as u32)).collect();
                    let tokens: Vec<TokenId> = path
                        .iter()
                        .map(|&n| {
                            let t = self.fresh_token();
                            nodes[n as usize] = t;
                            t
                        })
                        .collect();
                    for (n, &node) in path.iter().enumerate() {
                        paths[m * WIDTH + n] = node as i32;
                    }
                    let tree = matches!(draft, Draft::Tree { .. });
                    self.running[i].unsettled.push_back(Unsettled {
                        tokens,
                        path: tree.then_some(path.clone()),
                    });
                    self.verify_forward(&meta, m, i, &nodes, &parents);
                }
                // The device moves each tree's accepted nodes' KV to consecutive rows,
                // reading the paths on the device (a chain's moves nothing).
                self.device.upload_table(self.values, 0, &paths).unwrap();
                self.cache.compact_accepted(
                    &meta,
                    DeviceValues {
                        table: self.values,
                        at: 0,
                    },
                )?;
                Ok(())
            }
            Op::Settle { mask } => {
                let idx = self.picks(mask, |r| !r.unsettled.is_empty());
                if idx.is_empty() {
                    return Ok(());
                }
                let settled: Vec<Unsettled> = idx
                    .iter()
                    .map(|&i| self.running[i].unsettled.front().unwrap().clone())
                    .collect();
                let accepted: Vec<Accepted<'_>> = settled
                    .iter()
                    .map(|u| match &u.path {
                        Some(path) => Accepted::tree(path, &u.tokens),
                        None => Accepted::chain(&u.tokens),
                    })
                    .collect();
                let mut batch: Vec<&mut Request> = Vec::new();
                for (n, run) in self.running.iter_mut().enumerate() {
                    if idx.contains(&n) {
                        batch.push(&mut run.req);
                    }
                }
                self.cache.settle(&mut batch, &accepted)?;
                for &i in &idx {
                    self.running[i].unsettled.pop_front();
                }
                Ok(())
            }
            Op::BadSettle { pick } => {
                let Some(i) = self.pick(pick, |_| true) else {
                    return Ok(());
                };
                let before = (
                    self.running[i].req.row().to_vec(),
                    self.running[i].req.tokens().to_vec(),
                    self.cache.stats(),
                );
                let too_many = vec![TokenId(0); WIDTH + 1];
                let e = self
                    .cache
                    .settle(
                        &mut [&mut self.running[i].req],
                        &[Accepted::chain(&too_many)],
                    )
                    .unwrap_err();
                assert!(
                    matches!(e, Error::NothingToSettle { .. } | Error::BadAccepted { .. }),
                    "{}: {e}",
                    self.label
                );
                let r = &self.running[i].req;
                assert_eq!(
                    (r.row(), r.tokens(), self.cache.stats()),
                    (&before.0[..], &before.1[..], before.2),
                    "{}: a refused settle changed something",
                    self.label
                );
                Ok(())
            }
            Op::Decode { token } => {
                let idx: Vec<usize> = (0..self.running.len())
                    .filter(|&i| {
                        let r = &self.running[i];
                        r.req.remaining_prefill() == 0 && r.unsettled.is_empty()
                    })
                    .collect();
                if idx.is_empty() {
                    return Ok(());
                }
                let tokens: Vec<TokenId> = (0..idx.len())
                    .map(|m| TokenId((token as u32 + m as u32) % 8))
                    .collect();
                let result = {
                    let mut batch: Vec<&mut Request> = Vec::new();
                    for (n, run) in self.running.iter_mut().enumerate() {
                        if idx.contains(&n) {
                            batch.push(&mut run.req);
                        }
                    }
                    self.cache.alloc_decode(&mut batch, &tokens)
                };
                match result {
                    Err(Error::OutOfMemory { .. }) => Ok(()),
                    Err(e) => Err(e),
                    Ok(()) => {
                        for i in idx {
                            self.forward(i, 1);
                        }
                        Ok(())
                    }
                }
            }
            Op::CacheUnfinished { pick } => match self.pick(pick, |_| true) {
                Some(i) => self.cache.cache_unfinished(&mut self.running[i].req),
                None => Ok(()),
            },
            Op::Finish { pick } => match self.pick(pick, |_| true) {
                Some(i) => {
                    let run = self.running.swap_remove(i);
                    self.cache.cache_finished(run.req)
                }
                None => Ok(()),
            },
            Op::Abort { pick } => match self.pick(pick, |_| true) {
                Some(i) => {
                    let run = self.running.swap_remove(i);
                    self.cache.release(run.req).map(drop)
                }
                None => Ok(()),
            },
        }
    }

    fn step(&mut self) {
        if let Err(e) = self.cache.step_boundary() {
            panic!("{}: step boundary: {e}", self.label);
        }
        if let Err(e) = self.cache.allocator().verify() {
            panic!("{}: {e}", self.label);
        }
        for run in &self.running {
            self.check_request(run);
        }
        let requests: Vec<&Request> = self.running.iter().map(|r| &r.req).collect();
        common::assert_device_tables_match_host(
            &mut self.cache,
            &self.device,
            &requests,
            &self.label,
        );
    }
}

fn run(model: ModelSpec, layout: Layout, ps: u32, kv_tokens: u64, late: bool, ops: Vec<Op>) {
    scoped_level(Level::Strict, || {
        let device = Arc::new(CpuDevice::new());
        let model = model.with_draft_layers(1);
        let slot = model.slot_pool().map_or(0, |s| s.bytes_per_slot);
        let token = model.full_bytes_per_token() + model.swa_bytes_per_token();
        // Room for the sink, a few requests' slot groups and `kv_tokens` of KV.
        let memory = slot * 40 + token * (kv_tokens + 2 * ps as u64) + 4096;
        let spec = Speculation::tree(WIDTH as u32).in_flight(if late { 2 } else { 1 });
        let build = |memory: u64| {
            HybridCache::builder()
                .model(model)
                .page_size(ps)
                .memory_bytes(memory)
                .layout(layout)
                .checkpoint_interval(8 * ps)
                .zero_on_handout(true)
                .speculation(spec)
                .device(device.clone())
                .build()
        };
        // At large pages one request's floor (a page per side and its slots) may be more
        // (and what it needs moves with the split of the buffer): grow until it fits.
        let mut memory = memory;
        let cache = loop {
            match build(memory) {
                Err(unikv::Error::Pool(unikv::pools::Error::BufferTooSmall { needed, .. })) => {
                    memory = needed.0.max(memory) + memory / 4;
                }
                built => break built.unwrap(),
            }
        };
        let values = device.alloc_table(8 * WIDTH * 2, 0).unwrap();
        let mut d = Driver {
            cache,
            device,
            values,
            running: Vec::new(),
            spec,
            label: format!(
                "{} {} ps {ps} kv {kv_tokens} late {late}",
                model.name,
                layout.as_str()
            ),
            next_token: 0,
        };
        for op in &ops {
            if let Err(e) = d.apply(op) {
                panic!("{}: {op:?}: {e}", d.label);
            }
            d.step();
        }
        for run in std::mem::take(&mut d.running) {
            d.cache.release(run.req).unwrap();
        }
        // Verify scratch given back in a step is idle (and freed by `evict_all`) from the
        // next one.
        d.step();
        d.cache.evict_all().unwrap();
        d.step();
        common::assert_all_free(&d.cache.stats(), &d.label);
    });
}

proptest! {
    #![proptest_config(proptest_config(96))]

    #[test]
    fn speculative_lifecycles_conserve_every_page_and_slot_and_keep_every_byte(
        model in prop::sample::select(vec![tiny_model(8, 1), TINY_MAMBA, TINY_TRI]),
        layout in prop::sample::select(LAYOUTS.to_vec()),
        ps in prop::sample::select(common::page_sizes()),
        kv_tokens in 60u64..400,
        late in any::<bool>(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(model, layout, ps, kv_tokens, late, ops);
    }
}
