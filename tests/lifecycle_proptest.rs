//! Random request lifecycles through `HybridCache`, at invariant level Strict: arrivals
//! whose prompts share prefixes (a tiny vocabulary over three base texts), aborts before
//! admission, chunked prefill, batched decode, caching while running, finishing, aborts,
//! retraction and re-admission, explicit eviction, all under a budget small enough that
//! memory runs out. `OutOfMemory` is a legitimate outcome (the driver retracts a request);
//! any other error fails the case.
//!
//! After every operation the driver ends the step (`step_boundary`: conservation and the
//! invariant poll) and checks against its own bookkeeping: each running request's cursor
//! only moves up, in pages, never below its protected length, every in-window row has live
//! SWA; pages held by requests, the tree and the allocator add up exactly. A case ends by
//! releasing everything and evicting everything: every page comes back.
//!
//! Failing seeds are kept in `lifecycle_proptest.proptest-regressions` next to this file.

mod common;

use common::*;
use proptest::prelude::*;
use unikv::invariants::{Level, scoped_level};
use unikv::{Error, Layout, Request, TokenId};

const W: u32 = 8;

/// One step of the driver. Indices pick among the running or retracted requests, modulo
/// their count.
#[derive(Clone, Debug)]
enum Op {
    /// A new prompt: `prefix` tokens of base text `base`, then `suffix`. `abort` drops the
    /// match before admission; `eager` prefills it whole at once (and then `can_admit`'s
    /// yes must hold).
    Arrive {
        base: u8,
        prefix: u8,
        suffix: Vec<u8>,
        abort: bool,
        eager: bool,
    },
    /// A retracted request comes back (matched and admitted again).
    Readmit { pick: u8 },
    /// One prefill chunk of a request still prefilling.
    Prefill { pick: u8, chunk: u8 },
    /// Every request done prefilling decodes one token.
    Decode { token: u8 },
    /// Caches what a running request computed and keeps it running.
    CacheUnfinished { pick: u8 },
    /// A decoding request finishes.
    Finish { pick: u8 },
    /// A running request is aborted.
    Abort { pick: u8 },
    /// A running request is retracted (released, its tokens queued for re-admission).
    Retract { pick: u8 },
    /// Explicit eviction for a demand of this many pages per side.
    Evict { full: u8, swa: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    let token = 0u8..4;
    prop_oneof![
        4 => (0u8..3, 8u8..common::BASE_LEN as u8, prop::collection::vec(token.clone(), 0..12), prop::bool::weighted(0.15), prop::bool::weighted(0.2))
            .prop_map(|(base, prefix, suffix, abort, eager)| Op::Arrive { base, prefix, suffix, abort, eager }),
        1 => any::<u8>().prop_map(|pick| Op::Readmit { pick }),
        4 => (any::<u8>(), 1u8..24).prop_map(|(pick, chunk)| Op::Prefill { pick, chunk }),
        8 => token.prop_map(|token| Op::Decode { token }),
        1 => any::<u8>().prop_map(|pick| Op::CacheUnfinished { pick }),
        2 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Abort { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Retract { pick }),
        1 => (0u8..6, 0u8..6).prop_map(|(full, swa)| Op::Evict { full, swa }),
    ]
}

/// The cache configurations a case runs in: page size, budget, SWA:FULL byte ratio,
/// (static) token ratio and window eviction interval.
fn config(layout: Layout) -> impl Strategy<Value = Config> {
    (
        prop::sample::select(page_sizes()),
        prop::sample::select(vec![24u64, 48, 96]),
        1u32..3,
        prop::bool::ANY,
        0u8..3,
    )
        .prop_map(move |(ps, tokens, swa_layers, half, interval)| {
            let layout = match layout {
                Layout::Static { .. } if half => Layout::Static {
                    swa_full_tokens_ratio: 0.5,
                },
                other => other,
            };
            let window_pages = (W + ps).div_ceil(ps) as u64;
            let min_pages = if half {
                2 * window_pages + 2
            } else {
                window_pages + 2
            };
            let mut config = Config::tokens(layout, ps, W, tokens, min_pages);
            config.model = tiny_model(W, swa_layers);
            // The window eviction interval: one page (default), one token, or a lag of
            // several pages that is not a multiple of the page size.
            config.interval = [None, Some(1), Some(3 * ps + 1)][interval as usize];
            config
        })
}

/// A running request with what the driver remembers about it.
struct Running {
    req: Request,
    /// Its cursor after the previous step (the ratchet only moves up).
    cursor: usize,
}

struct Driver {
    fx: Fixture,
    running: Vec<Running>,
    retracted: Vec<Vec<TokenId>>,
}

impl Driver {
    fn pick(&self, pick: u8, filter: impl Fn(&Request) -> bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.running.len())
            .filter(|&i| filter(&self.running[i].req))
            .collect();
        (!candidates.is_empty()).then(|| candidates[pick as usize % candidates.len()])
    }

    /// Out of memory: retract the running request `i` (or the longest one).
    fn retract(&mut self, i: Option<usize>) -> Result<(), Error> {
        let i = match i {
            Some(i) => i,
            None => match (0..self.running.len()).max_by_key(|&i| self.running[i].req.len()) {
                Some(i) => i,
                None => return Ok(()),
            },
        };
        let r = self.running.swap_remove(i);
        let tokens = self.fx.cache.release(r.req)?;
        self.retracted.push(tokens);
        Ok(())
    }

    /// Matches and admits `prompt` if `can_admit` says it fits; `eager` prefills it whole.
    fn arrive(&mut self, prompt: Vec<TokenId>, abort: bool, eager: bool) -> Result<(), Error> {
        let hit = self.fx.cache.match_prefix(prompt.clone());
        let cached = hit.cached_tokens();
        assert!(
            cached <= prompt.len() && cached.is_multiple_of(self.fx.ps),
            "{}: hit {cached} of {}",
            self.fx.label,
            prompt.len()
        );
        if abort || !self.fx.cache.can_admit(&hit, 0) {
            drop(hit);
            return Ok(());
        }
        let hits = self.fx.cache.stats().hit_tokens;
        let mut req = self.fx.cache.admit(hit)?;
        // The hit counted is the one admitted with (matched again if the tree changed).
        assert_eq!(
            self.fx.cache.stats().hit_tokens,
            hits + req.cached_at_admission() as u64
        );
        assert_eq!(req.tokens(), &prompt[..]);
        assert_eq!(req.len(), req.cached_at_admission());
        if eager {
            let n = req.remaining_prefill();
            if let Err(e) = self.fx.cache.alloc_extend(&mut req, n) {
                panic!(
                    "{}: can_admit allowed {} tokens ({cached} cached) but: {e}",
                    self.fx.label,
                    prompt.len()
                );
            }
        }
        let cursor = req.window_cursor();
        self.running.push(Running { req, cursor });
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), Error> {
        match *op {
            Op::Arrive {
                base,
                prefix,
                ref suffix,
                abort,
                eager,
            } => {
                let mut prompt = common::base_text(base, 4)[..prefix as usize].to_vec();
                prompt.extend(suffix.iter().map(|&t| TokenId(t as u32)));
                if prompt.is_empty() {
                    prompt.push(TokenId(0));
                }
                self.arrive(prompt, abort, eager)
            }
            Op::Readmit { pick } => {
                if self.retracted.is_empty() {
                    return Ok(());
                }
                let tokens = self
                    .retracted
                    .swap_remove(pick as usize % self.retracted.len());
                self.arrive(tokens, false, false)
            }
            Op::Prefill { pick, chunk } => {
                let Some(i) = self.pick(pick, |r| r.remaining_prefill() > 0) else {
                    return Ok(());
                };
                let n = (chunk as usize).min(self.running[i].req.remaining_prefill());
                let (len, row) = (self.running[i].req.len(), self.running[i].req.row().len());
                match self.fx.cache.alloc_extend(&mut self.running[i].req, n) {
                    Err(Error::OutOfMemory { .. }) => {
                        let r = &self.running[i].req;
                        let after = (r.len(), r.row().len());
                        assert_eq!(
                            after,
                            (len, row),
                            "{}: a failed extend grew the row",
                            self.fx.label
                        );
                        self.retract(Some(i))
                    }
                    other => other,
                }
            }
            Op::Decode { token } => {
                let mut batch: Vec<&mut Request> = self
                    .running
                    .iter_mut()
                    .map(|r| &mut r.req)
                    .filter(|r| r.remaining_prefill() == 0)
                    .collect();
                if batch.is_empty() {
                    return Ok(());
                }
                let tokens: Vec<TokenId> = (0..batch.len())
                    .map(|i| TokenId((token as u32 + i as u32) % 4))
                    .collect();
                let lens: Vec<(usize, usize)> =
                    batch.iter().map(|r| (r.len(), r.tokens().len())).collect();
                match self.fx.cache.alloc_decode(&mut batch, &tokens) {
                    Err(Error::OutOfMemory { .. }) => {
                        let after: Vec<(usize, usize)> =
                            batch.iter().map(|r| (r.len(), r.tokens().len())).collect();
                        assert_eq!(
                            after, lens,
                            "{}: a failed decode grew a request",
                            self.fx.label
                        );
                        self.retract(None)
                    }
                    other => other,
                }
            }
            Op::CacheUnfinished { pick } => {
                let Some(i) = self.pick(pick, |_| true) else {
                    return Ok(());
                };
                let before = self.running[i].req.protected_len();
                self.fx.cache.cache_unfinished(&mut self.running[i].req)?;
                let r = &self.running[i].req;
                assert!(
                    r.protected_len() >= before && r.protected_len() <= r.len(),
                    "{}",
                    self.fx.label
                );
                Ok(())
            }
            Op::Finish { pick } => {
                let Some(i) = self.pick(pick, |r| r.remaining_prefill() == 0) else {
                    return Ok(());
                };
                let r = self.running.swap_remove(i);
                self.fx.cache.cache_finished(r.req)
            }
            Op::Abort { pick } => {
                let Some(i) = self.pick(pick, |_| true) else {
                    return Ok(());
                };
                let r = self.running.swap_remove(i);
                let len = r.req.tokens().len();
                assert_eq!(self.fx.cache.release(r.req)?.len(), len);
                Ok(())
            }
            Op::Retract { pick } => {
                let Some(i) = self.pick(pick, |_| true) else {
                    return Ok(());
                };
                self.retract(Some(i))
            }
            Op::Evict { full, swa } => {
                let before = (
                    self.fx.cache.stats().evictions,
                    self.fx.cache.tree().sizes(),
                );
                match self.fx.cache.evict_to_free(full as usize, swa as usize) {
                    Ok(()) => {
                        let demand = unikv::pools::PageDemand::pages(full as usize, swa as usize);
                        assert!(
                            self.fx.cache.allocator().allocation_fits(demand),
                            "{}: {demand:?}",
                            self.fx.label
                        );
                        Ok(())
                    }
                    Err(Error::OutOfMemory { .. }) => {
                        let after = (
                            self.fx.cache.stats().evictions,
                            self.fx.cache.tree().sizes(),
                        );
                        assert_eq!(
                            after, before,
                            "{}: a refused eviction evicted",
                            self.fx.label
                        );
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
        }
    }

    /// The step boundary and the driver's own checks.
    fn step(&mut self) {
        self.fx.step();
        for r in &mut self.running {
            let cursor = r.req.window_cursor();
            assert!(
                cursor >= r.cursor,
                "{}: cursor of request {} moved down {} -> {cursor}",
                self.fx.label,
                r.req.id(),
                r.cursor
            );
            r.cursor = cursor;
            self.fx.check_request(&r.req);
        }
        let live: Vec<&Request> = self.running.iter().map(|r| &r.req).collect();
        self.fx.check_accounting(&live);
    }
}

fn run(config: Config, ops: Vec<Op>) {
    scoped_level(Level::Strict, || {
        let mut driver = Driver {
            fx: Fixture::new(&config),
            running: Vec::new(),
            retracted: Vec::new(),
        };
        for op in &ops {
            if let Err(e) = driver.apply(op) {
                panic!("{}: {op:?}: {e}", driver.fx.label);
            }
            driver.step();
        }
        let live = driver.running.into_iter().map(|r| r.req).collect();
        driver.fx.teardown(live);
    });
}

// 64 cases (the matrix runs this file 18 times on 2 cores); `PROPTEST_CASES` asks for
// more in a local hunt.
proptest! {
    #![proptest_config(proptest_config(64))]

    #[test]
    fn unified_lifecycles_conserve_every_page(config in config(Layout::Unified), ops in prop::collection::vec(op(), 1..80)) {
        run(config, ops);
    }

    #[test]
    fn static_lifecycles_conserve_every_page(
        config in config(Layout::Static { swa_full_tokens_ratio: 1.0 }),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        run(config, ops);
    }
}
