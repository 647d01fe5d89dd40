//! Arbitrary arguments through `HybridCache`'s public API, at invariant level Strict:
//! every method with sizes up to `usize::MAX`, empty prompts, matches and requests of
//! another cache, and calls out of order (decode before prefill, caching an empty
//! request, a batch whose token count is off). Each call must return `Ok` or the typed
//! error its arguments call for (`BadRequest`, `ForeignRequest`, `OutOfMemory`), never
//! panic, and leave the request it refused as it was; every step boundary must pass
//! (conservation, the tree's sanity check, the invariant poll), and every free the cache
//! issues must name pages it still owns (the probe allocator of `common::probe`). A case
//! ends by releasing everything: every page comes back.
//!
//! 24 cases per layout (the matrix runs this file 18 times); `PROPTEST_CASES` asks for
//! more.

mod common;

use common::probe::ProbeState;
use common::*;
use proptest::prelude::*;
use std::sync::{Arc, Mutex};
use unikv::invariants::{Level, scoped_level};
use unikv::{Error, HybridCache, Layout, PrefixMatch, Request, TokenId};

/// A size argument: small, around a page or a window, or near `usize::MAX`.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0usize..4,
        3 => 0usize..48,
        1 => Just(usize::MAX),
        1 => Just(usize::MAX / 2),
        1 => (usize::MAX - 64)..=usize::MAX,
    ]
}

#[derive(Clone, Debug)]
enum Op {
    /// Matches `len` tokens of base text `base` (empty when `len` is 0), on the other
    /// cache when `foreign`; the match is kept for `CanAdmit`/`Admit`.
    Match { base: u8, len: u8, foreign: bool },
    /// `can_admit` of a kept match.
    CanAdmit { pick: u8, reserve: usize },
    /// `admit` of a kept match.
    Admit { pick: u8 },
    /// `alloc_extend` of a request by any size.
    Extend { pick: u8, tokens: usize },
    /// `alloc_decode` of the requests whose bit is set in `mask`, with one token too many
    /// when `extra`.
    Decode { mask: u8, extra: bool },
    /// `release_out_of_window`.
    ReleaseWindow { pick: u8 },
    /// `cache_unfinished`.
    CacheUnfinished { pick: u8 },
    /// `cache_finished`.
    CacheFinished { pick: u8 },
    /// `release`.
    Release { pick: u8 },
    /// A request of the other cache handed to one of the request methods (`which`).
    Foreign { which: u8, prefilled: bool },
    /// `evict_to_free` of any sizes.
    EvictToFree { full: usize, swa: usize },
    /// `evict_all`.
    EvictAll,
    /// `step_boundary`.
    Step,
    /// `stats`.
    Stats,
}

fn op() -> impl Strategy<Value = Op> {
    let pick = any::<u8>();
    prop_oneof![
        4 => (0u8..3, 0u8..40, prop::bool::weighted(0.1))
            .prop_map(|(base, len, foreign)| Op::Match { base, len, foreign }),
        2 => (pick, size()).prop_map(|(pick, reserve)| Op::CanAdmit { pick, reserve }),
        3 => pick.prop_map(|pick| Op::Admit { pick }),
        4 => (pick, size()).prop_map(|(pick, tokens)| Op::Extend { pick, tokens }),
        3 => (any::<u8>(), prop::bool::weighted(0.1))
            .prop_map(|(mask, extra)| Op::Decode { mask, extra }),
        1 => pick.prop_map(|pick| Op::ReleaseWindow { pick }),
        1 => pick.prop_map(|pick| Op::CacheUnfinished { pick }),
        2 => pick.prop_map(|pick| Op::CacheFinished { pick }),
        1 => pick.prop_map(|pick| Op::Release { pick }),
        1 => (0u8..6, any::<bool>()).prop_map(|(which, prefilled)| Op::Foreign { which, prefilled }),
        1 => (size(), size()).prop_map(|(full, swa)| Op::EvictToFree { full, swa }),
        1 => Just(Op::EvictAll),
        3 => Just(Op::Step),
        1 => Just(Op::Stats),
    ]
}

fn config(layout: Layout) -> impl Strategy<Value = Config> {
    (
        prop::sample::select(page_sizes()),
        prop::sample::select(vec![3u32, 8]),
        prop::sample::select(vec![16u64, 48]),
    )
        .prop_map(move |(ps, window, pages)| Config::new(layout, ps, window, pages))
}

struct Driver {
    fx: Fixture,
    probe: Arc<Mutex<ProbeState>>,
    other: HybridCache,
    matches: Vec<PrefixMatch>,
    requests: Vec<Request>,
}

/// Whether `result` is `Ok` or one of the errors `allowed` names; anything else fails.
fn expect_typed<T>(what: &str, result: Result<T, Error>, allowed: &[&str]) -> Option<T> {
    match result {
        Ok(v) => Some(v),
        Err(e) => {
            let kind = match &e {
                Error::BadRequest { .. } => "bad",
                Error::ForeignRequest { .. } => "foreign",
                Error::OutOfMemory { .. } => "oom",
                _ => "other",
            };
            assert!(allowed.contains(&kind), "{what}: unexpected error {e:?}");
            None
        }
    }
}

impl Driver {
    fn pick<T>(items: &[T], pick: u8) -> Option<usize> {
        (!items.is_empty()).then(|| pick as usize % items.len())
    }

    fn foreign_request(&mut self, prefilled: bool) -> Request {
        let hit = self.other.match_prefix(text(70_000, 5));
        let mut req = self.other.admit(hit).unwrap();
        if prefilled {
            self.other.alloc_extend(&mut req, 5).unwrap();
        }
        req
    }

    fn apply(&mut self, op: &Op) {
        let label = self.fx.label.clone();
        let at = |what: &str| format!("{label}: {what} ({op:?})");
        match *op {
            Op::Match { base, len, foreign } => {
                let prompt = text(1_000 * base as u32, len as usize);
                let hit = if foreign {
                    self.other.match_prefix(prompt)
                } else {
                    self.fx.cache.match_prefix(prompt)
                };
                self.matches.push(hit);
            }
            Op::CanAdmit { pick, reserve } => {
                if let Some(i) = Self::pick(&self.matches, pick) {
                    let fits = self.fx.cache.can_admit(&self.matches[i], reserve);
                    let target = self.matches[i].prompt_len().checked_add(reserve);
                    let total = self.fx.cache.stats().full.total_pages * self.fx.ps;
                    if target.is_none_or(|t| t > total) {
                        assert!(!fits, "{}", at("a reservation past every page fits"));
                    }
                }
            }
            Op::Admit { pick } => {
                if let Some(i) = Self::pick(&self.matches, pick) {
                    let hit = self.matches.swap_remove(i);
                    let admitted = self.fx.cache.admit(hit);
                    if let Some(req) = expect_typed(&at("admit"), admitted, &["foreign"]) {
                        self.requests.push(req);
                    }
                }
            }
            Op::Extend { pick, tokens } => {
                if let Some(i) = Self::pick(&self.requests, pick) {
                    let req = &mut self.requests[i];
                    let len = req.len();
                    let r = self.fx.cache.alloc_extend(req, tokens);
                    if expect_typed(&at("extend"), r, &["bad", "oom"]).is_none() {
                        assert_eq!(req.len(), len, "{}", at("a refused extend changed the row"));
                    }
                }
            }
            Op::Decode { mask, extra } => {
                let mut batch: Vec<&mut Request> = self
                    .requests
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| *i < 8 && mask & (1 << i) != 0)
                    .map(|(_, r)| r)
                    .collect();
                let lens: Vec<usize> = batch.iter().map(|r| r.len()).collect();
                let tokens: Vec<TokenId> = (0..batch.len() + extra as usize)
                    .map(|t| TokenId(5 + t as u32))
                    .collect();
                let r = self.fx.cache.alloc_decode(&mut batch, &tokens);
                if expect_typed(&at("decode"), r, &["bad", "oom"]).is_none() {
                    let after: Vec<usize> = batch.iter().map(|r| r.len()).collect();
                    assert_eq!(after, lens, "{}", at("a refused decode changed a row"));
                }
            }
            Op::ReleaseWindow { pick } => {
                if let Some(i) = Self::pick(&self.requests, pick) {
                    let r = self.fx.cache.release_out_of_window(&mut self.requests[i]);
                    expect_typed(&at("release_out_of_window"), r, &[]);
                }
            }
            Op::CacheUnfinished { pick } => {
                if let Some(i) = Self::pick(&self.requests, pick) {
                    let r = self.fx.cache.cache_unfinished(&mut self.requests[i]);
                    expect_typed(&at("cache_unfinished"), r, &[]);
                }
            }
            Op::CacheFinished { pick } => {
                if let Some(i) = Self::pick(&self.requests, pick) {
                    let req = self.requests.swap_remove(i);
                    expect_typed(
                        &at("cache_finished"),
                        self.fx.cache.cache_finished(req),
                        &[],
                    );
                }
            }
            Op::Release { pick } => {
                if let Some(i) = Self::pick(&self.requests, pick) {
                    let req = self.requests.swap_remove(i);
                    expect_typed(&at("release"), self.fx.cache.release(req), &[]);
                }
            }
            Op::Foreign { which, prefilled } => {
                let mut req = self.foreign_request(prefilled);
                let before = self.fx.cache.stats();
                let cache = &mut self.fx.cache;
                let refused = match which {
                    0 => cache.alloc_extend(&mut req, 1).err(),
                    1 => cache.alloc_decode(&mut [&mut req], &[TokenId(1)]).err(),
                    2 => cache.release_out_of_window(&mut req).err(),
                    3 => cache.cache_unfinished(&mut req).err(),
                    4 => cache.cache_finished(req).err(),
                    _ => cache.release(req).err(),
                };
                assert!(
                    matches!(refused, Some(Error::ForeignRequest { .. })),
                    "{}: {refused:?}",
                    at("a foreign request")
                );
                assert_eq!(self.fx.cache.stats(), before, "{}", at("a foreign request"));
            }
            Op::EvictToFree { full, swa } => {
                let r = self.fx.cache.evict_to_free(full, swa);
                expect_typed(&at("evict_to_free"), r, &["oom"]);
            }
            Op::EvictAll => {
                expect_typed(&at("evict_all"), self.fx.cache.evict_all(), &[]);
            }
            Op::Step => self.step(),
            Op::Stats => {
                let stats = self.fx.cache.stats();
                assert_eq!(stats.live_requests, self.requests.len(), "{}", at("stats"));
            }
        }
    }

    fn step(&mut self) {
        self.fx.step();
        let live: Vec<&Request> = self.requests.iter().collect();
        self.fx.check_accounting(&live);
        let probe = self.probe.lock().unwrap();
        assert!(
            probe.violations.is_empty(),
            "{}: {:#?}",
            self.fx.label,
            probe.violations
        );
    }
}

fn run(config: Config, ops: Vec<Op>) {
    scoped_level(Level::Strict, || {
        let probe = Arc::new(Mutex::new(ProbeState::checking_frees()));
        let other = Config {
            joint_pages: 256,
            ..config.clone()
        };
        let mut driver = Driver {
            fx: Fixture::of(&config, config.build_probed(&probe)),
            probe,
            other: other.build(),
            matches: Vec::new(),
            requests: Vec::new(),
        };
        for op in &ops {
            driver.apply(op);
        }
        driver.step();
        driver.matches.clear();
        let live = std::mem::take(&mut driver.requests);
        driver.fx.teardown(live);
    });
}

proptest! {
    #![proptest_config(proptest_config(24))]

    #[test]
    fn unified_api_calls_with_arbitrary_arguments_fail_typed_and_conserve(
        config in config(Layout::Unified),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(config, ops);
    }

    #[test]
    fn static_api_calls_with_arbitrary_arguments_fail_typed_and_conserve(
        config in config(Layout::Static { swa_full_tokens_ratio: 1.0 }),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(config, ops);
    }
}
