//! Random lifecycles of a tiny Mamba hybrid (FULL + recurrent state, no SWA) through
//! `HybridCache`, at invariant level Strict, on both layouts, with the engine's recurrent
//! kernel simulated on the real buffer: after every allocation the "kernel" writes the
//! running state (one byte per slot: a hash of the tokens processed) and any checkpoint
//! the request asks for. Compaction moves slots; donor eviction frees FULL for them.
//!
//! After every operation the step boundary checks three-side conservation, and the
//! driver checks that every running request's slot holds its state and, at admission,
//! that the state copied from the prefix cache is exactly the state after the matched
//! prefix (so cached states survived every move and sit at the right position). A case
//! ends by releasing everything and evicting everything: every page and slot comes back.

mod common;

use common::{TINY_MAMBA, TINY_TRI, proptest_config};
use proptest::prelude::*;
use std::sync::Arc;
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{ByteSpan, CpuDevice, Device, HostSync, Readback};
use unikv::pools::{Side, VirtualSlot};
use unikv::{Error, HybridCache, Layout, ModelSpec, Request, TokenId};

#[derive(Clone, Debug)]
enum Op {
    Arrive {
        base: u8,
        prefix: u8,
        suffix: Vec<u8>,
        abort: bool,
    },
    Prefill {
        pick: u8,
        chunk: u8,
    },
    Decode {
        token: u8,
    },
    Finish {
        pick: u8,
    },
    Abort {
        pick: u8,
    },
    Evict {
        full: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 4u8..common::BASE_LEN as u8, prop::collection::vec(0u8..4, 0..8), prop::bool::weighted(0.1))
            .prop_map(|(base, prefix, suffix, abort)| Op::Arrive { base, prefix, suffix, abort }),
        4 => (any::<u8>(), 1u8..24).prop_map(|(pick, chunk)| Op::Prefill { pick, chunk }),
        6 => (0u8..4).prop_map(|token| Op::Decode { token }),
        3 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Abort { pick }),
        1 => (0u8..8).prop_map(|full| Op::Evict { full }),
    ]
}

struct Driver {
    cache: HybridCache,
    device: Arc<CpuDevice>,
    running: Vec<Request>,
    label: String,
}

impl Driver {
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

    fn write(&self, slot: VirtualSlot, value: u8) {
        let span = self.slot_span(slot);
        self.device
            .fill_spans(self.cache.allocator().buffer(), &[span], value)
            .unwrap();
    }

    fn read(&self, slot: VirtualSlot) -> Vec<u8> {
        let span = self.slot_span(slot);
        let sync = HostSync::acquire("test: reading a state slot back");
        self.device
            .read_bytes(
                &sync,
                self.cache.allocator().buffer(),
                span.offset,
                span.len,
            )
            .unwrap()
    }

    /// The simulated recurrent kernel of one forward: the running state after the row,
    /// and the checkpoints the cache asked for.
    fn forward(&self, i: usize) {
        let req = &self.running[i];
        let slot = req
            .state_slot()
            .expect("a recurrent model's request has a state");
        self.write(slot, common::state_of(&req.tokens()[..req.len()]));
        for w in req.checkpoint_writes() {
            assert!(w.at_len <= req.len() && w.at_len > 0, "{}", self.label);
            self.write(w.slot, common::state_of(&req.tokens()[..w.at_len]));
        }
    }

    fn pick(&self, pick: u8, filter: impl Fn(&Request) -> bool) -> Option<usize> {
        let c: Vec<usize> = (0..self.running.len())
            .filter(|&i| filter(&self.running[i]))
            .collect();
        (!c.is_empty()).then(|| c[pick as usize % c.len()])
    }

    fn retract(&mut self, i: usize) -> Result<(), Error> {
        let r = self.running.swap_remove(i);
        self.cache.release(r).map(drop)
    }

    fn apply(&mut self, op: &Op) -> Result<(), Error> {
        match *op {
            Op::Arrive {
                base,
                prefix,
                ref suffix,
                abort,
            } => {
                let mut prompt = common::base_text(base, 4)[..prefix as usize].to_vec();
                prompt.extend(suffix.iter().map(|&t| TokenId(t as u32)));
                let hit = self.cache.match_prefix(prompt);
                if abort || !self.cache.can_admit(&hit, 0) {
                    return Ok(());
                }
                let req = match self.cache.admit(hit) {
                    Err(Error::OutOfMemory { .. }) => return Ok(()),
                    other => other?,
                };
                let cached = req.cached_at_admission();
                let running = req.state_slot().unwrap();
                let want = if cached == 0 {
                    0
                } else {
                    common::state_of(&req.tokens()[..cached])
                };
                self.running.push(req);
                let bytes = self.read(running);
                assert!(
                    bytes.iter().all(|&b| b == want),
                    "{}: admitted with {cached} cached tokens, the running state holds {:?}, not {want}",
                    self.label,
                    &bytes[..4]
                );
                Ok(())
            }
            Op::Prefill { pick, chunk } => {
                let Some(i) = self.pick(pick, |r| r.remaining_prefill() > 0) else {
                    return Ok(());
                };
                let n = (chunk as usize).min(self.running[i].remaining_prefill());
                match self.cache.alloc_extend(&mut self.running[i], n) {
                    Err(Error::OutOfMemory { .. }) => self.retract(i),
                    Err(e) => Err(e),
                    Ok(()) => {
                        self.forward(i);
                        Ok(())
                    }
                }
            }
            Op::Decode { token } => {
                let idx: Vec<usize> = (0..self.running.len())
                    .filter(|&i| self.running[i].remaining_prefill() == 0)
                    .collect();
                if idx.is_empty() {
                    return Ok(());
                }
                let mut batch: Vec<&mut Request> = self
                    .running
                    .iter_mut()
                    .filter(|r| r.remaining_prefill() == 0)
                    .collect();
                let tokens: Vec<TokenId> = (0..batch.len())
                    .map(|i| TokenId((token as u32 + i as u32) % 4))
                    .collect();
                match self.cache.alloc_decode(&mut batch, &tokens) {
                    Err(Error::OutOfMemory { .. }) => self.retract(idx[0]),
                    Err(e) => Err(e),
                    Ok(()) => {
                        for i in idx {
                            self.forward(i);
                        }
                        Ok(())
                    }
                }
            }
            Op::Finish { pick } => {
                let Some(i) = self.pick(pick, |r| r.remaining_prefill() == 0 && !r.is_empty())
                else {
                    return Ok(());
                };
                let r = self.running.swap_remove(i);
                self.cache.cache_finished(r)
            }
            Op::Abort { pick } => match self.pick(pick, |_| true) {
                Some(i) => self.retract(i),
                None => Ok(()),
            },
            Op::Evict { full } => match self.cache.evict_to_free(full as usize, 0) {
                Ok(()) | Err(Error::OutOfMemory { .. }) => Ok(()),
                Err(e) => Err(e),
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
        let requests: Vec<&Request> = self.running.iter().collect();
        common::assert_device_tables_match_host(
            &mut self.cache,
            &self.device,
            &requests,
            &self.label,
        );
        let stats = self.cache.stats();
        let slots = self
            .running
            .iter()
            .map(|r| r.state_slots().len())
            .sum::<usize>();
        assert_eq!(stats.mamba.held_pages, slots, "{}", self.label);
        for r in &self.running {
            if r.is_empty() {
                continue;
            }
            let want = common::state_of(&r.tokens()[..r.len()]);
            let slot = r.state_slot().unwrap();
            if r.len() > r.cached_at_admission() {
                assert!(
                    self.read(slot).iter().all(|&b| b == want),
                    "{}: request {} lost its running state",
                    self.label,
                    r.id()
                );
            }
        }
    }
}

fn run(model: ModelSpec, layout: Layout, ps: u32, kv_tokens: u64, interval: u32, ops: Vec<Op>) {
    scoped_level(Level::Strict, || {
        let device = Arc::new(CpuDevice::new());
        let slot = model.slot_pool().unwrap().bytes_per_slot;
        let token = model.full_bytes_per_token() + model.swa_bytes_per_token();
        // Room for the sink, a few requests' states and `kv_tokens` of KV.
        let memory = slot * 16 + token * (kv_tokens + 2 * ps as u64) + 4 * slot;
        let cache = HybridCache::builder()
            .model(model)
            .page_size(ps)
            .memory_bytes(memory)
            .layout(layout)
            .checkpoint_interval(interval * ps)
            .zero_on_handout(true)
            .device(device.clone())
            .build()
            .unwrap();
        let mut d = Driver {
            cache,
            device,
            running: Vec::new(),
            label: format!(
                "{} {} ps {ps} kv {kv_tokens} interval {interval}",
                model.name,
                layout.as_str()
            ),
        };
        for op in &ops {
            if let Err(e) = d.apply(op) {
                panic!("{}: {op:?}: {e}", d.label);
            }
            d.step();
        }
        for r in std::mem::take(&mut d.running) {
            d.cache.release(r).unwrap();
        }
        d.cache.evict_all().unwrap();
        d.step();
        common::assert_all_free(&d.cache.stats(), &d.label);
    });
}

proptest! {
    #![proptest_config(proptest_config(48))]

    #[test]
    fn mamba_lifecycles_conserve_every_page_and_slot_and_keep_every_state(
        model in prop::sample::select(vec![TINY_MAMBA, TINY_TRI]),
        unified in any::<bool>(),
        ps in prop::sample::select(vec![1u32, 2, 4]),
        kv_tokens in prop::sample::select(vec![48u64, 96, 192]),
        interval in 1u32..4,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let layout = if unified {
            Layout::Unified
        } else {
            Layout::Static { swa_full_tokens_ratio: 0.8 }
        };
        run(model, layout, ps, kv_tokens, interval, ops);
    }
}
