//! The host tier (issue 40): prefixes the device evicts are written back to host memory
//! and loaded back, bytes and all, by a later prompt that matches them; a host hit ends
//! only where the model has everything it needs; an abort frees both tiers; a device page
//! a copy in flight reads or writes is not handed out before its event is done (on the
//! emulated CUDA device, its stream stalled); host eviction never leaves the host tree
//! naming data the pool dropped. Every case on both layouts, a FULL + SWA, a FULL + Mamba
//! and a tri-pool model, at the matrix's page sizes, with both tiers' conservation
//! checked at every step boundary.

mod common;

use common::{LAYOUTS, TINY_MAMBA, TINY_TRI, page_sizes, tiny_model};
use std::sync::Arc;
use unikv::invariants::{Level, scoped_level};
use unikv::kernels::{ByteSpan, CpuDevice, CudaDevice, Device, HostSync, Readback};
use unikv::pools::{Side, VirtualPage, VirtualSlot};
use unikv::{CacheStats, Error, HostWritePolicy, HybridCache, Layout, ModelSpec, Request, TokenId};

/// Pages of the prompts' shared part.
const PAGES: usize = 8;

struct Case {
    cache: HybridCache,
    device: Arc<dyn Readback>,
    /// The emulated CUDA device the cache runs on, when the case stalls its stream.
    cuda: Option<Arc<CudaDevice>>,
    ps: usize,
    label: String,
}

fn models() -> [ModelSpec; 3] {
    [tiny_model(8, 1), TINY_MAMBA, TINY_TRI]
}

/// What the cases of a test run on beyond the matrix's layouts and page sizes.
struct Setup {
    models: Vec<ModelSpec>,
    /// An emulated CUDA device (its stream can be stalled) instead of a CPU one.
    emulated: bool,
    checkpoint_interval: Option<u32>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            models: models().to_vec(),
            emulated: false,
            checkpoint_interval: None,
        }
    }
}

/// Runs `case` for every model, layout and page size, with a host tier of `host(model,
/// page size)` bytes, then checks that releasing everything frees every device page and
/// slot.
fn each(host: impl Fn(ModelSpec, usize) -> u64, case: impl Fn(&mut Case)) {
    each_in(Setup::default(), host, case)
}

/// [`each`] on `setup`'s models and device.
fn each_in(setup: Setup, host: impl Fn(ModelSpec, usize) -> u64, case: impl Fn(&mut Case)) {
    for &model in &setup.models {
        for layout in LAYOUTS {
            for ps in page_sizes() {
                let (device, cuda): (Arc<dyn Readback>, _) = if setup.emulated {
                    let cuda = Arc::new(CudaDevice::emulated());
                    (cuda.clone(), Some(cuda))
                } else {
                    (Arc::new(CpuDevice::new()), None)
                };
                let mut builder = HybridCache::builder()
                    .model(model)
                    .layout(layout)
                    .page_size(ps)
                    .memory_bytes(memory(model, ps as usize))
                    .host_memory_bytes(host(model, ps as usize))
                    .device(device.clone() as Arc<dyn Device>);
                if let Some(interval) = setup.checkpoint_interval {
                    builder = builder.checkpoint_interval(interval);
                }
                let cache = builder.build().unwrap();
                let label = format!("{} {} ps {ps}", model.name, layout.as_str());
                let mut c = Case {
                    cache,
                    device,
                    cuda,
                    ps: ps as usize,
                    label,
                };
                case(&mut c);
                let cache = &mut c.cache;
                assert_eq!(cache.stats().live_requests, 0, "{}", c.label);
                cache.evict_all().unwrap();
                cache.step_boundary().unwrap();
                let s = cache.stats();
                assert_eq!(
                    (s.full.available_pages, s.mamba.available_pages),
                    (s.full.total_pages, s.mamba.total_pages),
                    "{}: every device page and slot is free again",
                    c.label
                );
            }
        }
    }
}

/// Room for a few prompts of [`PAGES`] pages and their states.
fn memory(model: ModelSpec, ps: usize) -> u64 {
    let per_token = model.full_bytes_per_token() + model.swa_bytes_per_token();
    // A wide window needs a few of its own behind each request.
    let tokens = (4 * PAGES * ps + 64 * ps).max(4 * model.window as usize) as u64;
    tokens * per_token + 16 * model.state_bytes_per_request() + (1 << 16)
}

/// `PAGES` pages of `first`'s tokens, then `tail` tokens of their own (prompts with
/// tails of different lengths part at the tail's first token).
fn prompt(first: u32, tail: usize, ps: usize) -> Vec<TokenId> {
    let mut p: Vec<TokenId> = (0..(PAGES * ps) as u32)
        .map(|i| TokenId(first * 1_000_000 + i))
        .collect();
    p.extend(
        (0..tail as u32).map(|i| TokenId(900_000_000 + first * 100_000 + tail as u32 * 1_000 + i)),
    );
    p
}

/// A next turn after `prompt(first, 1, ps)`: that prompt, then `ps + 1` new tokens.
fn follow_up(first: u32, ps: usize) -> Vec<TokenId> {
    let mut p = prompt(first, 1, ps);
    p.extend((0..=ps as u32).map(|i| TokenId(800_000_000 + first * 1_000 + i)));
    p
}

impl Case {
    /// Admits `p`, prefills it whole and returns the request.
    fn prefill(&mut self, p: Vec<TokenId>) -> Request {
        let hit = self.cache.match_prefix(p);
        let mut req = self.cache.admit(hit).unwrap();
        let n = req.remaining_prefill();
        self.cache.alloc_extend(&mut req, n).unwrap();
        req
    }

    fn page_span(&self, side: Side, token: unikv::pools::VirtualToken) -> ByteSpan {
        let alloc = self.cache.allocator();
        let grid = alloc.grid(side);
        let phys = alloc
            .physical_page(side, VirtualPage(token.0 / self.ps as u32))
            .expect("a mapped page");
        ByteSpan {
            offset: grid.offset(phys),
            len: grid.envelope,
        }
    }

    fn slot_span(&self, slot: VirtualSlot) -> ByteSpan {
        let alloc = self.cache.allocator();
        let grid = alloc.grid(Side::Mamba);
        ByteSpan {
            offset: grid.offset(alloc.physical_slot(slot).expect("a mapped slot")),
            len: grid.envelope,
        }
    }

    fn fill(&self, span: ByteSpan, value: u8) {
        let buf = self.cache.allocator().buffer();
        self.device.fill_spans(buf, &[span], value).unwrap();
    }

    fn read(&self, span: ByteSpan) -> Vec<u8> {
        let buf = self.cache.allocator().buffer();
        self.device
            .read_bytes(&HostSync::acquire("test"), buf, span.offset, span.len)
            .unwrap()
    }

    fn has_swa(&self) -> bool {
        self.cache.model().swa_layers > 0
    }

    /// Ends a step: both tiers' conservation is checked there (at strict in the cases
    /// that need it), and every side's figures add up to its total.
    fn boundary(&mut self) -> CacheStats {
        self.cache.step_boundary().unwrap();
        let s = self.cache.stats();
        for side in [&s.full, &s.swa, &s.mamba] {
            let sum = side.available_pages
                + side.evictable_pages
                + side.protected_pages
                + side.held_pages;
            assert_eq!(sum, side.total_pages, "{}: {side:?}", self.label);
        }
        s
    }

    /// Marks `req`'s FULL pages (and SWA pages) with [`mark`] and its held states with
    /// [`STATE_MARK`] (the tree adopts them when it finishes).
    fn mark_rows(&self, req: &Request) {
        for (i, t) in req.row().iter().step_by(self.ps).enumerate() {
            self.fill(self.page_span(Side::Full, *t), mark(i).0);
            if self.has_swa() {
                self.fill(self.page_span(Side::Swa, *t), mark(i).1);
            }
        }
        for w in req.held_checkpoints() {
            self.fill(self.slot_span(w.slot), STATE_MARK);
        }
    }

    /// `req`'s first `loaded` rows (and its running state) hold the bytes
    /// [`Case::mark_rows`] wrote: the FULL pages, the SWA window's pages behind the end,
    /// the state.
    fn check_loaded(&self, req: &Request, loaded: usize) {
        let ps = self.ps;
        let label = &self.label;
        let window_pages = self.cache.model().window.div_ceil(ps as u32) as usize;
        let pages = loaded / ps;
        for (i, t) in req.row()[..loaded].iter().step_by(ps).enumerate() {
            let full = self.read(self.page_span(Side::Full, *t));
            assert!(
                full.iter().all(|&x| x == mark(i).0),
                "{label}: FULL page {i}"
            );
            if self.has_swa() && i + window_pages >= pages {
                let swa = self.read(self.page_span(Side::Swa, *t));
                assert!(swa.iter().all(|&x| x == mark(i).1), "{label}: SWA page {i}");
            }
        }
        if let Some(slot) = req.state_slot() {
            let bytes = self.read(self.slot_span(slot));
            assert!(bytes.iter().all(|&x| x == STATE_MARK), "{label}: state");
        }
    }

    /// Stalls the emulated device's stream: copies queue, their events are not done.
    fn stall(&self) {
        let cuda = self.cuda.as_ref().expect("an emulated device");
        assert!(cuda.stall_stream(), "{}", self.label);
    }

    /// Resumes the stream: what it queued runs.
    fn resume(&self) {
        let cuda = self.cuda.as_ref().expect("an emulated device");
        cuda.resume_stream().unwrap();
    }

    /// Evicts every unlocked prefix from the device through the eviction loop (which
    /// writes back), not `evict_all` (a flush).
    fn demote_all(&mut self) {
        common::evict_all_evictable(&mut self.cache);
    }
}

/// Byte a page `i` of the shared prompt is marked with (FULL), and its SWA page.
fn mark(i: usize) -> (u8, u8) {
    (1 + i as u8, 0x40 + i as u8)
}

const STATE_MARK: u8 = 0x77;

/// A finished prompt, marked byte by byte on the device, is evicted (written back);
/// a prompt sharing its pages then matches it on the host, and admission loads the
/// FULL pages, the SWA window's pages and the state back into the request's own rows,
/// byte for byte.
#[test]
fn a_demoted_prefix_hits_from_the_host_and_loads_back_its_bytes() {
    each(
        |_, _| 1 << 22,
        |c| {
            let ps = c.ps;
            let a = c.prefill(prompt(1, 1, ps));
            let len = a.len();
            c.mark_rows(&a);
            c.cache.cache_finished(a).unwrap();
            c.cache.step_boundary().unwrap();
            // What the device serves a next turn: the host must serve the same.
            let on_device = c.cache.match_prefix(follow_up(1, ps)).cached_tokens();
            assert!(
                on_device >= len / ps * ps - ps && on_device > 0,
                "{}",
                c.label
            );
            c.demote_all();
            let label = c.label.clone();
            let host = c.cache.stats().host.unwrap();
            assert!(
                host.written_bytes > 0 && host.full_bytes > 0,
                "{label}: {host:?}"
            );

            let hit = c.cache.match_prefix(follow_up(1, ps));
            assert_eq!(hit.device_tokens(), 0, "{label}");
            assert_eq!(hit.host_tokens(), on_device, "{label}");
            let load_bytes = hit.load_bytes();
            let b = c.cache.admit(hit).unwrap();
            assert_eq!(b.cached_at_admission(), on_device, "{label}");
            c.check_loaded(&b, on_device);
            c.cache.release(b).unwrap();
            c.cache.step_boundary().unwrap();
            let host = c.cache.stats().host.unwrap();
            assert_eq!(host.hit_tokens, on_device as u64, "{label}");
            assert!(host.copies > 0, "{label}: {host:?}");
            // The match priced exactly what admission copied.
            assert!(load_bytes > 0, "{label}");
            assert_eq!(host.loaded_bytes, load_bytes, "{label}");
        },
    );
}

/// A host tier too small for the prefixes it is given keeps what fits (least recently
/// used goes), never names data it dropped, and serves what it kept: the pool and the
/// host tree agree at every boundary (checked there), and every host match loads.
#[test]
fn a_small_host_tier_evicts_lru_and_never_names_what_it_dropped() {
    // Room for about three of the six prompts' FULL pages and states (the host holds
    // only a window of SWA pages).
    let three = |model: ModelSpec, ps: usize| {
        3 * ((PAGES + 1) * ps) as u64 * model.full_bytes_per_token()
            + 3 * model.state_bytes_per_request()
    };
    each(three, |c| {
        let ps = c.ps;
        for first in 1..=6 {
            let a = c.prefill(prompt(first, 1, ps));
            c.cache.cache_finished(a).unwrap();
            c.cache.step_boundary().unwrap();
            c.demote_all();
        }
        let mut hits = Vec::new();
        for first in 1..=6 {
            let hit = c.cache.match_prefix(follow_up(first, ps));
            let host = hit.host_tokens();
            let b = c.cache.admit(hit).unwrap();
            assert_eq!(b.cached_at_admission(), host, "{}", c.label);
            hits.push(host > 0);
            c.cache.release(b).unwrap();
            c.cache.step_boundary().unwrap();
        }
        // The oldest went, the newest stayed.
        assert!(!hits[0] && hits[5], "{}: {hits:?}", c.label);
    });
}

/// A request admitted with a host hit and released at once (an abort right after its
/// load) frees its device rows and leaves the host prefix cached and unlocked.
#[test]
fn an_abort_after_a_load_frees_both_tiers() {
    each(
        |_, _| 1 << 22,
        |c| {
            let ps = c.ps;
            let a = c.prefill(prompt(1, 1, ps));
            c.cache.cache_finished(a).unwrap();
            c.cache.step_boundary().unwrap();
            c.demote_all();
            let hit = c.cache.match_prefix(follow_up(1, ps));
            let host = hit.host_tokens();
            assert!(host > 0, "{}", c.label);
            let b = c.cache.admit(hit).unwrap();
            c.cache.release(b).unwrap();
            c.cache.step_boundary().unwrap();
            // The host still holds it: the next match hits it again.
            let again = c.cache.match_prefix(follow_up(1, ps));
            assert_eq!(again.host_tokens(), host, "{}", c.label);
        },
    );
}

/// Every side's available, evictable and held pages.
fn figures(s: &CacheStats) -> [[usize; 3]; 3] {
    [&s.full, &s.swa, &s.mamba].map(|x| [x.available_pages, x.evictable_pages, x.held_pages])
}

/// The host tree's locked (protected) FULL tokens.
fn host_locked(cache: &HybridCache) -> usize {
    cache.host_tree().unwrap().sizes().full_protected.0
}

/// A write-back in flight (the stream stalled: its copy queued, its event not done) keeps
/// the evicted prefix's device pages and slots held across step boundaries: the
/// allocation that evicted it for them fails, one that fits gets other pages. Once the
/// copy is done they are free, and the prefix hits from the host and loads back its bytes.
#[test]
fn a_page_in_a_write_back_in_flight_is_not_reused_until_its_event_completes() {
    let setup = Setup {
        emulated: true,
        ..Setup::default()
    };
    scoped_level(Level::Strict, || {
        each_in(
            setup,
            |_, _| 1 << 22,
            |c| {
                let ps = c.ps;
                let a = c.prefill(prompt(1, 1, ps));
                c.mark_rows(&a);
                let a_pages: Vec<u64> = a.row()[..a.len() / ps * ps]
                    .iter()
                    .step_by(ps)
                    .map(|t| c.page_span(Side::Full, *t).offset)
                    .collect();
                c.cache.cache_finished(a).unwrap();
                let cached = figures(&c.boundary());
                let on_device = c.cache.match_prefix(follow_up(1, ps)).cached_tokens();
                assert!(on_device > 0, "{}", c.label);

                c.stall();
                let s = c.cache.stats();
                let everything = s.full.available_pages + s.full.evictable_pages;
                let err = c.cache.evict_to_free(everything, 0).unwrap_err();
                assert!(
                    matches!(err, Error::OutOfMemory { .. }),
                    "{}: {err}",
                    c.label
                );
                // Evicted and written back, but the copy still reads the pages: held.
                let parked =
                    cached.map(|[available, evictable, held]| [available, 0, held + evictable]);
                assert_eq!(c.cache.tree().sizes().full_evictable.0, 0, "{}", c.label);
                assert!(
                    c.cache.stats().host.unwrap().written_bytes > 0,
                    "{}",
                    c.label
                );
                for _ in 0..3 {
                    assert_eq!(figures(&c.boundary()), parked, "{}", c.label);
                }
                // A prompt that fits gets other pages.
                let d = c.prefill(
                    (0..2 * ps as u32)
                        .map(|i| TokenId(500_000_000 + i))
                        .collect(),
                );
                for t in d.row().iter().step_by(ps) {
                    let page = c.page_span(Side::Full, *t).offset;
                    assert!(!a_pages.contains(&page), "{}: page at {page}", c.label);
                }
                c.cache.release(d).unwrap();
                assert_eq!(figures(&c.boundary()), parked, "{}", c.label);

                c.resume();
                let free = figures(&c.boundary());
                for (side, [available, evictable, held]) in free.iter().enumerate() {
                    let [before, before_evictable, before_held] = cached[side];
                    assert_eq!(
                        (*available, *evictable, *held),
                        (before + before_evictable + before_held, 0, 0),
                        "{}: side {side} free once the copy is done",
                        c.label
                    );
                }
                let hit = c.cache.match_prefix(follow_up(1, ps));
                assert_eq!(
                    (hit.device_tokens(), hit.host_tokens()),
                    (0, on_device),
                    "{}",
                    c.label
                );
                let b = c.cache.admit(hit).unwrap();
                c.check_loaded(&b, on_device);
                c.cache.release(b).unwrap();
                c.boundary();
            },
        )
    });
}

/// A request admitted with a host hit and released while its load-back is still queued
/// (an abort mid-load) keeps its rows and slots held, and the host path locked, until
/// the copy is done: the copy still writes them. Then both tiers are free again and the
/// host still serves the prefix.
#[test]
fn an_abort_mid_load_frees_both_tiers_once_the_copy_is_done() {
    let setup = Setup {
        emulated: true,
        ..Setup::default()
    };
    scoped_level(Level::Strict, || {
        each_in(
            setup,
            |_, _| 1 << 22,
            |c| {
                let ps = c.ps;
                let a = c.prefill(prompt(1, 1, ps));
                c.cache.cache_finished(a).unwrap();
                c.boundary();
                c.demote_all();
                let idle = figures(&c.boundary());
                let hit = c.cache.match_prefix(follow_up(1, ps));
                let host = hit.host_tokens();
                assert!(host > 0, "{}", c.label);

                c.stall();
                let b = c.cache.admit(hit).unwrap();
                assert_eq!(b.len(), host, "{}", c.label);
                let loading = figures(&c.cache.stats());
                assert!(loading[0][2] > 0, "{}: {loading:?}", c.label);
                assert!(host_locked(&c.cache) > 0, "{}", c.label);
                c.cache.release(b).unwrap();
                assert_eq!(c.cache.stats().live_requests, 0, "{}", c.label);
                for _ in 0..3 {
                    assert_eq!(
                        figures(&c.boundary()),
                        loading,
                        "{}: the queued load still writes the rows",
                        c.label
                    );
                    assert!(host_locked(&c.cache) > 0, "{}", c.label);
                }

                c.resume();
                assert_eq!(figures(&c.boundary()), idle, "{}", c.label);
                assert_eq!(host_locked(&c.cache), 0, "{}", c.label);
                let again = c.cache.match_prefix(follow_up(1, ps));
                assert_eq!(again.host_tokens(), host, "{}", c.label);
            },
        )
    });
}

/// A host hit whose FULL KV reaches past its last state is cut back to that state: a
/// turn decoded past its prompt with no checkpoint on the way and finished off a page
/// boundary (no state at its last whole page) is evicted to the host; its next turn's
/// host match ends at the prompt's anchor state (where the device's did), its KV hit
/// reaches the host's deeper FULL pages, and admission loads back exactly to the anchor,
/// its state included. FULL + Mamba and the tri-pool; a FULL + SWA model has no such
/// cut (the window behind a turn's last whole page is live when it finishes).
#[test]
fn a_host_kv_hit_with_no_state_at_its_end_is_cut_back_to_its_last_state() {
    let setup = Setup {
        models: vec![
            TINY_MAMBA,
            // A window past the whole turn: nothing leaves it during the decode, so the
            // anchor keeps the live window a match there needs.
            ModelSpec {
                window: 4096,
                ..TINY_TRI
            },
        ],
        // No grid point on the way: the prompt's anchor is the only state.
        checkpoint_interval: Some(1 << 16),
        ..Setup::default()
    };
    scoped_level(Level::Strict, || {
        each_in(
            setup,
            |_, _| 1 << 22,
            |c| {
                let ps = c.ps;
                let p = prompt(1, 1, ps);
                // The prompt's last whole page (its end at page size 1).
                let anchor = p.len() / ps * ps;
                let mut a = c.prefill(p);
                let at: Vec<usize> = a.checkpoint_writes().iter().map(|w| w.at_len).collect();
                assert_eq!(at, [anchor], "{}", c.label);
                c.mark_rows(&a);
                c.boundary();
                // Past the next whole page, ending off a page boundary (ps > 1).
                for t in 0..ps as u32 + 2 {
                    c.cache
                        .alloc_decode(&mut [&mut a], &[TokenId(700_000_000 + t)])
                        .unwrap();
                    assert!(a.checkpoint_writes().is_empty(), "{}", c.label);
                    c.boundary();
                }
                let deeper = a.len() / ps * ps;
                assert!(deeper > anchor, "{}", c.label);
                let mut next = a.tokens().to_vec();
                next.extend((0..=ps as u32).map(|i| TokenId(600_000_000 + i)));
                if ps > 1 {
                    c.cache.cache_finished(a).unwrap();
                } else {
                    // Every length ends a page at page size 1, so finishing would cache
                    // the running state at the end: cache the KV alone, then abort.
                    c.cache.cache_unfinished(&mut a).unwrap();
                    c.cache.release(a).unwrap();
                }
                c.boundary();
                let on_device = c.cache.match_prefix(next.clone());
                assert_eq!(
                    (on_device.cached_tokens(), on_device.kv_hit_tokens()),
                    (anchor, deeper),
                    "{}",
                    c.label
                );
                c.demote_all();
                let hit = c.cache.match_prefix(next);
                assert_eq!(
                    (
                        hit.device_tokens(),
                        hit.host_tokens(),
                        hit.cached_tokens(),
                        hit.kv_hit_tokens()
                    ),
                    (0, anchor, anchor, deeper),
                    "{}",
                    c.label
                );
                let b = c.cache.admit(hit).unwrap();
                assert_eq!(
                    (b.len(), b.cached_at_admission(), b.kv_hit_at_admission()),
                    (anchor, anchor, deeper),
                    "{}",
                    c.label
                );
                c.check_loaded(&b, anchor);
                assert!(b.state_slot().is_some(), "{}", c.label);
                c.cache.release(b).unwrap();
                c.boundary();
                let host = c.cache.stats().host.unwrap();
                assert_eq!(host.hit_tokens, anchor as u64, "{}", c.label);
            },
        )
    });
}

/// Without a host tier nothing changes: no host figures, and an evicted prefix is gone.
#[test]
fn without_a_host_tier_an_evicted_prefix_is_recomputed() {
    each(
        |_, _| 0,
        |c| {
            assert!(c.cache.stats().host.is_none());
            let ps = c.ps;
            let a = c.prefill(prompt(1, 1, ps));
            c.cache.cache_finished(a).unwrap();
            c.cache.step_boundary().unwrap();
            c.demote_all();
            let hit = c.cache.match_prefix(prompt(1, ps + 1, ps));
            assert_eq!(
                (hit.cached_tokens(), hit.host_tokens()),
                (0, 0),
                "{}",
                c.label
            );
        },
    );
}

#[test]
fn a_host_tier_that_holds_nothing_is_refused() {
    let err = HybridCache::builder()
        .model(TINY_MAMBA)
        .layout(Layout::Unified)
        .memory_bytes(1 << 20)
        .host_memory_bytes(8)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("host memory"), "{err}");
}

/// A turn that decoded past its window (its SWA behind the window released) and was
/// evicted still serves its next turn from the host: the write-back takes the live
/// stretch of the window behind the end, whatever the device released before it.
#[test]
fn a_turn_decoded_past_its_window_serves_its_next_turn_from_the_host() {
    each(
        |_, _| 1 << 22,
        |c| {
            let ps = c.ps;
            let mut a = c.prefill(prompt(1, 1, ps));
            c.cache.step_boundary().unwrap();
            // Decode three windows' worth (and at least three pages).
            let n = (3 * c.cache.model().window as usize).max(3 * ps) as u32;
            for t in 0..n {
                c.cache
                    .alloc_decode(&mut [&mut a], &[TokenId(700_000_000 + t)])
                    .unwrap();
                c.cache.step_boundary().unwrap();
            }
            let mut next: Vec<TokenId> = a.tokens().to_vec();
            next.extend((0..=ps as u32).map(|i| TokenId(600_000_000 + i)));
            c.cache.cache_finished(a).unwrap();
            c.cache.step_boundary().unwrap();
            let on_device = c.cache.match_prefix(next.clone()).cached_tokens();
            c.demote_all();
            let hit = c.cache.match_prefix(next);
            assert_eq!(
                (hit.device_tokens(), hit.host_tokens()),
                (0, on_device),
                "{}",
                c.label
            );
            let b = c.cache.admit(hit).unwrap();
            c.cache.release(b).unwrap();
            c.cache.step_boundary().unwrap();
        },
    );
}

/// Only anchors go to the host: a prompt's grid state (a checkpoint-grid point inside
/// it) is dropped with its device copy, its prompt-end state is written back.
#[test]
fn grid_states_are_not_written_back() {
    for layout in LAYOUTS {
        let device = Arc::new(CpuDevice::new());
        let mut cache = HybridCache::builder()
            .model(TINY_MAMBA)
            .layout(layout)
            .page_size(16)
            .checkpoint_interval(64)
            .memory_bytes(1 << 20)
            .host_memory_bytes(1 << 22)
            .device(device as Arc<dyn Device>)
            .build()
            .unwrap();
        // 230 tokens: a grid state at 192, the prompt's last whole page ends at 224.
        let p: Vec<TokenId> = (0..230).map(TokenId).collect();
        let hit = cache.match_prefix(p.clone());
        let mut a = cache.admit(hit).unwrap();
        cache.alloc_extend(&mut a, 230).unwrap();
        let at: Vec<usize> = a.checkpoint_writes().iter().map(|w| w.at_len).collect();
        assert_eq!(at, [192, 224], "{layout}");
        cache.cache_finished(a).unwrap();
        cache.step_boundary().unwrap();
        common::evict_all_evictable(&mut cache);
        let host = cache.stats().host.unwrap();
        let state = cache.allocator().grid(Side::Mamba).envelope;
        assert_eq!(
            host.state_bytes, state,
            "{layout}: one state, the prompt end's"
        );
        let mut next = p;
        next.push(TokenId(5_000));
        assert_eq!(cache.match_prefix(next).host_tokens(), 224, "{layout}");
    }
}

fn policy_cache(policy: HostWritePolicy) -> HybridCache {
    HybridCache::builder()
        .model(TINY_TRI)
        .layout(Layout::Unified)
        .page_size(16)
        .memory_bytes(1 << 20)
        .host_memory_bytes(1 << 22)
        .host_write_policy(policy)
        .build()
        .unwrap()
}

/// Finishes a prefilled request of `p` and passes a step boundary.
fn finish(cache: &mut HybridCache, p: &[TokenId]) {
    let hit = cache.match_prefix(p.to_vec());
    let mut req = cache.admit(hit).unwrap();
    let n = req.remaining_prefill();
    cache.alloc_extend(&mut req, n).unwrap();
    cache.cache_finished(req).unwrap();
    cache.step_boundary().unwrap();
}

/// Write-back copies on eviction only; write-through at the boundary after caching,
/// so the eviction then copies nothing; selective write-through after the prefix's
/// `hits`-th admission hit.
#[test]
fn write_policies_copy_on_eviction_on_caching_or_on_reuse() {
    let p: Vec<TokenId> = (0..100).map(TokenId).collect();
    let written = |cache: &HybridCache| cache.stats().host.unwrap().written_bytes;
    let evict = common::evict_all_evictable;

    let mut back = policy_cache(HostWritePolicy::WriteBack);
    finish(&mut back, &p);
    assert_eq!(written(&back), 0);
    evict(&mut back);
    let on_eviction = written(&back);
    assert!(on_eviction > 0);

    let mut through = policy_cache(HostWritePolicy::WriteThrough);
    finish(&mut through, &p);
    assert_eq!(
        written(&through),
        on_eviction,
        "the same bytes, before any eviction"
    );
    evict(&mut through);
    assert_eq!(
        written(&through),
        on_eviction,
        "the eviction copies nothing more"
    );
    assert_eq!(through.match_prefix(p.clone()).host_tokens(), 96);

    let mut selective = policy_cache(HostWritePolicy::WriteThroughSelective { hits: 2 });
    finish(&mut selective, &p);
    let mut longer = p.clone();
    longer.extend((0..20).map(|i| TokenId(5_000 + i)));
    for hit in 1..=2 {
        assert_eq!(written(&selective), 0, "before hit {hit}'s boundary");
        let m = selective.match_prefix(longer.clone());
        assert!(m.device_tokens() > 0);
        let req = selective.admit(m).unwrap();
        selective.release(req).unwrap();
        selective.step_boundary().unwrap();
    }
    assert!(written(&selective) > 0, "copied after the second hit");

    let zero = HybridCache::builder()
        .model(TINY_TRI)
        .memory_bytes(1 << 20)
        .host_memory_bytes(1 << 22)
        .host_write_policy(HostWritePolicy::WriteThroughSelective { hits: 0 })
        .build();
    assert!(zero.is_err());
}

/// An eviction whose victim's frees wait behind a write-back in flight goes on to the
/// next victim: a prefix the host already holds frees at once, so the room is made
/// without waiting for the copy.
#[test]
fn an_eviction_goes_past_a_victim_parked_behind_a_copy_in_flight() {
    let cuda = Arc::new(CudaDevice::emulated());
    let mut cache = HybridCache::builder()
        .model(TINY_TRI)
        .layout(Layout::Unified)
        .page_size(16)
        .memory_bytes(1 << 20)
        .host_memory_bytes(1 << 22)
        .host_write_policy(HostWritePolicy::WriteThrough)
        .device(cuda.clone() as Arc<dyn Device>)
        .build()
        .unwrap();
    let (a, b) = (prompt(1, 1, 16), prompt(2, 1, 16));
    // `b` is copied at its boundary and the copy runs; `a`'s is queued behind a stall.
    finish(&mut cache, &b);
    cache.step_boundary().unwrap();
    assert!(cuda.stall_stream());
    finish(&mut cache, &a);
    // `b` is used again: `a` is now the least recently used prefix.
    let hit = cache.match_prefix(b.clone());
    assert!(hit.device_tokens() > 0);
    let req = cache.admit(hit).unwrap();
    cache.release(req).unwrap();
    cache.step_boundary().unwrap();
    let need = cache.stats().full.schedulable_pages + 1;
    cache.evict_to_free(need, 0).unwrap();
    let s = cache.stats();
    assert!(s.full.schedulable_pages >= need, "{s:?}");
    assert_eq!(s.full.held_pages, 8, "`a`'s pages wait for its copy: {s:?}");
    cuda.resume_stream().unwrap();
    cache.step_boundary().unwrap();
    cache.evict_all().unwrap();
    cache.step_boundary().unwrap();
    let s = cache.stats();
    assert_eq!(s.full.available_pages, s.full.total_pages);
}

/// A match taken before a step boundary whose write-through evicted its host part from
/// the host is matched again at admission (the host tree changed), never locked on a
/// node the host dropped.
#[test]
fn a_match_whose_host_part_a_write_through_evicted_is_matched_again() {
    let build = |host: u64| {
        HybridCache::builder()
            .model(TINY_TRI)
            .layout(Layout::Unified)
            .page_size(16)
            .memory_bytes(1 << 20)
            .host_memory_bytes(host)
            .host_write_policy(HostWritePolicy::WriteThrough)
            .build()
            .unwrap()
    };
    let (a, b) = (prompt(1, 1, 16), prompt(2, 1, 16));
    // A host of exactly the frames one prompt takes.
    let mut sizing = build(1 << 22);
    finish(&mut sizing, &a);
    let (s, g) = (
        sizing.stats().host.unwrap(),
        sizing.host_geometry().unwrap(),
    );
    let frames = |bytes: u64, k: usize| match g.units_per_frame[k] {
        0 => 0,
        per => (bytes / g.unit_bytes[k]).div_ceil(u64::from(per)),
    };
    let held = frames(s.full_bytes, 0) + frames(s.swa_bytes, 1) + frames(s.state_bytes, 2);
    let mut cache = build(held * g.frame_bytes);
    finish(&mut cache, &a);
    let all = cache.stats().full;
    cache
        .evict_to_free(all.available_pages + all.evictable_pages, 0)
        .unwrap();
    cache.step_boundary().unwrap();
    let req = {
        let hit = cache.match_prefix(b.clone());
        let mut req = cache.admit(hit).unwrap();
        let n = req.remaining_prefill();
        cache.alloc_extend(&mut req, n).unwrap();
        req
    };
    cache.cache_finished(req).unwrap();
    let hit = cache.match_prefix(follow_up(1, 16));
    assert!(hit.host_tokens() > 0);
    // The write-through of `b` makes room by evicting `a` from the host.
    cache.step_boundary().unwrap();
    let req = cache.admit(hit).unwrap();
    assert_eq!(req.cached_at_admission(), 0);
    assert_eq!(cache.stats().host.unwrap().hit_tokens, 0);
    cache.release(req).unwrap();
    cache.step_boundary().unwrap();
}
