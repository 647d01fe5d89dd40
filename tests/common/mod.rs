//! Shared set-up for the facade's integration tests: tiny models whose window and budget
//! make pressure easy to create, caches sized in pages, prompts, and the checks every
//! scenario ends with (the window rules of one request, exact accounting, no leak).

#![allow(dead_code)] // each test binary uses a different part of this module

pub mod probe;

use std::sync::{Arc, Mutex};
use unikv::kernels::Device;
use unikv::pools::{Capacity, Side, SwaState, VirtualPage, VirtualToken};
use unikv::{
    HybridCache, HybridCacheBuilder, KvRows, Layout, ModelSpec, RecurrentState, Request, TokenId,
};

/// Both layouts: the one buffer, and the static baseline at an even token ratio.
pub const LAYOUTS: [Layout; 2] = [
    Layout::Unified,
    Layout::Static {
        swa_full_tokens_ratio: 1.0,
    },
];

/// The page sizes of this matrix cell: 1, 4 and `UNIKV_TEST_PAGE_SIZE`.
pub fn page_sizes() -> Vec<u32> {
    unikv::invariants::testing::page_sizes()
}

/// A tiny hybrid model: one FULL and `swa_layers` SWA layers of one KV head of dimension
/// 4 in bf16 (16 bytes per token per layer), sliding window `window`.
pub fn tiny_model(window: u32, swa_layers: u32) -> ModelSpec {
    ModelSpec {
        name: "tiny",
        full_layers: 1,
        swa_layers,
        mamba_layers: 0,
        full: KvRows::new(1, 4, 2),
        swa: KvRows::new(1, 4, 2),
        recurrent: RecurrentState::NONE,
        window,
        draft_layers: 0,
    }
}

/// A tiny model whose FULL and SWA rows differ (like Gemma 4's global and sliding
/// layers): one FULL layer of one KV head of dimension 8 in bf16 (32 bytes per token) and
/// two SWA layers of two KV heads of dimension 2 in fp8 (16 bytes per token), sliding
/// window `window`.
pub fn tiny_asymmetric_model(window: u32) -> ModelSpec {
    ModelSpec {
        name: "tiny-asymmetric",
        full: KvRows::new(1, 8, 2),
        swa: KvRows::new(2, 2, 1),
        ..tiny_model(window, 2)
    }
}

/// A tiny Mamba hybrid (FULL + recurrent state, no SWA): one FULL layer of one KV head
/// of dimension 8 in bf16 (32 B/token) and two recurrent layers of 32 B each: a 64-byte
/// state slot, the KV of two tokens.
pub const TINY_MAMBA: ModelSpec = ModelSpec {
    name: "tiny-mamba",
    full_layers: 1,
    swa_layers: 0,
    mamba_layers: 2,
    full: KvRows::new(1, 8, 2),
    swa: KvRows::NONE,
    recurrent: RecurrentState {
        conv_channels: 4,
        conv_kernel: 3,
        heads: 1,
        head_dim: 2,
        state_size: 2,
        conv_dtype_bytes: 2,
        state_dtype_bytes: 4,
    },
    window: 0,
    draft_layers: 0,
};

/// A tiny model with all three kinds (the tri-pool): [`TINY_MAMBA`] plus two SWA layers
/// of one KV head of dimension 4 in bf16 (32 B/token) and a window of 8 tokens.
pub const TINY_TRI: ModelSpec = ModelSpec {
    name: "tiny-tri",
    swa_layers: 2,
    swa: KvRows::new(1, 4, 2),
    window: 8,
    draft_layers: 0,
    ..TINY_MAMBA
};

/// How a test cache is built.
#[derive(Clone, Debug)]
pub struct Config {
    /// Static or unified.
    pub layout: Layout,
    /// Tokens per page.
    pub page_size: u32,
    /// The model (its window sizes the batch-size-1 floor).
    pub model: ModelSpec,
    /// Room for this many joint (FULL + SWA) pages, beyond the sink.
    pub joint_pages: u64,
    /// The window eviction interval, when not the default (one page).
    pub interval: Option<u32>,
    /// The device, when not a fresh CPU device (e.g. a `SyncLedger` to inspect).
    pub device: Option<Arc<dyn Device>>,
}

impl Config {
    /// A tiny symmetric model with window `window` and room for `joint_pages` pages.
    pub fn new(layout: Layout, page_size: u32, window: u32, joint_pages: u64) -> Config {
        Config {
            layout,
            page_size,
            model: tiny_model(window, 1),
            joint_pages,
            interval: None,
            device: None,
        }
    }

    /// Room for at least `tokens` tokens per side (and at least `min_pages` pages).
    pub fn tokens(
        layout: Layout,
        page_size: u32,
        window: u32,
        tokens: u64,
        min_pages: u64,
    ) -> Config {
        let pages = tokens.div_ceil(page_size as u64).max(min_pages);
        Config::new(layout, page_size, window, pages)
    }

    /// The memory budget: the sink floor, `joint_pages` joint pages, and (static only)
    /// the slack its pool sizing needs to fit as many pages.
    pub fn memory_bytes(&self) -> u64 {
        let ps = self.page_size as u64;
        let ef = self.model.full_bytes_per_token() * ps;
        let es = self.model.swa_bytes_per_token() * ps;
        let sink = ef.max(es);
        match self.layout {
            Layout::Unified => sink + self.joint_pages * (ef + es),
            Layout::Static {
                swa_full_tokens_ratio: r,
            } => {
                // The static pools start above the sink at a FULL page boundary, keep one
                // SWA envelope apart and take `ratio` SWA pages per FULL page.
                let full_base = sink.div_ceil(ef) * ef;
                let per_full = ef as f64 + r * es as f64;
                full_base + 2 * es + (self.joint_pages as f64 * per_full).ceil() as u64
            }
        }
    }

    /// Builds the cache.
    pub fn build(&self) -> HybridCache {
        self.builder()
            .build()
            .unwrap_or_else(|e| panic!("building {self:?}: {e}"))
    }

    /// Builds the cache with its allocator wrapped in a [`probe::Probe`] sharing `state`.
    pub fn build_probed(&self, state: &Arc<Mutex<probe::ProbeState>>) -> HybridCache {
        let state = state.clone();
        self.builder()
            .wrap_allocator(move |inner| Box::new(probe::Probe::new(inner, state)))
            .build()
            .unwrap_or_else(|e| panic!("building {self:?}: {e}"))
    }

    /// The builder [`Config::build`] uses.
    pub fn builder(&self) -> HybridCacheBuilder {
        let mut builder = HybridCache::builder()
            .model(self.model)
            .page_size(self.page_size)
            .memory_bytes(self.memory_bytes())
            .layout(self.layout);
        // The tightest interval, one page, unless a test asks for another: the ratchet
        // then moves at every page boundary, which the scenarios count on.
        builder = builder.eviction_interval(self.interval.unwrap_or(self.page_size));
        if let Some(device) = &self.device {
            builder = builder.device(device.clone());
        }
        builder
    }
}

/// A cache under test with what its checks need to know.
pub struct Fixture {
    /// The cache.
    pub cache: HybridCache,
    /// Its capacity when it was empty.
    pub empty: Capacity,
    /// The window.
    pub window: usize,
    /// The page size.
    pub ps: usize,
    /// The eviction interval in force.
    pub interval: usize,
    /// A label for assertion messages (layout and page size).
    pub label: String,
}

impl Fixture {
    /// Builds a cache from `config`.
    pub fn new(config: &Config) -> Fixture {
        Fixture::of(config, config.build())
    }

    /// A fixture around `cache`, built from `config` (e.g. by [`Config::build_probed`]).
    pub fn of(config: &Config, cache: HybridCache) -> Fixture {
        let empty = cache.allocator().capacity();
        let ps = config.page_size as usize;
        Fixture {
            empty,
            window: config.model.window as usize,
            ps,
            interval: config.interval.map_or(ps, |i| i as usize),
            label: format!("{} ps {}", config.layout.as_str(), config.page_size),
            cache,
        }
    }

    /// Tokens kept behind the last whole page by window eviction: the window rounded up
    /// to whole pages (`max(W, ps)` when the page size divides the window or exceeds it).
    pub fn keep(&self) -> usize {
        self.window.div_ceil(self.ps) * self.ps
    }

    /// `tokens` rounded down to whole pages.
    pub fn floor(&self, tokens: usize) -> usize {
        tokens / self.ps * self.ps
    }

    /// Matches and admits `prompt`.
    pub fn admit(&mut self, prompt: Vec<TokenId>) -> Request {
        let hit = self.cache.match_prefix(prompt);
        self.cache
            .admit(hit)
            .unwrap_or_else(|e| panic!("{}: admit: {e}", self.label))
    }

    /// Prefills the rest of the prompt in chunks of `chunk` tokens, one step each, checking
    /// the request's window after every chunk.
    pub fn prefill(&mut self, req: &mut Request, chunk: usize) {
        while req.remaining_prefill() > 0 {
            let n = chunk.min(req.remaining_prefill());
            self.cache
                .alloc_extend(req, n)
                .unwrap_or_else(|e| panic!("{}: extend by {n}: {e}", self.label));
            self.step();
            self.check_request(req);
        }
    }

    /// Decodes `n` tokens (`first`, `first + 1`, ...), one step each, checking the window
    /// after every step.
    pub fn decode(&mut self, req: &mut Request, n: usize, first: u32) {
        for i in 0..n {
            self.cache
                .alloc_decode(&mut [&mut *req], &[TokenId(first + i as u32)])
                .unwrap_or_else(|e| panic!("{}: decode at {}: {e}", self.label, req.len()));
            self.step();
            self.check_request(req);
        }
    }

    /// Ends the step (conservation, invariants, mirror upload).
    pub fn step(&mut self) {
        self.cache
            .step_boundary()
            .unwrap_or_else(|e| panic!("{}: step boundary: {e}", self.label));
    }

    /// The SWA state of the page holding `token`.
    pub fn swa_state(&self, token: VirtualToken) -> SwaState {
        self.cache.allocator().swa_state(page_of(token, self.ps))
    }

    /// Whether FULL is live for the page holding `token`.
    pub fn full_live(&self, token: VirtualToken) -> bool {
        self.cache.allocator().full_live(page_of(token, self.ps))
    }

    /// The window rules for one running request: the cursor is page-aligned and at least
    /// the protected length; every row has live FULL; every row below the cursor that the
    /// request owns is an SWA tombstone; every row from the cursor on — the whole window
    /// included — has its SWA bound to a physical page.
    pub fn check_request(&self, req: &Request) {
        let (len, cursor, protected) = (req.len(), req.window_cursor(), req.protected_len());
        let at = || {
            format!(
                "{}: request {} at len {len}, cursor {cursor}, protected {protected}",
                self.label,
                req.id()
            )
        };
        assert_eq!(cursor % self.ps, 0, "{}: cursor not page-aligned", at());
        assert!(
            cursor >= protected,
            "{}: cursor below the protected length",
            at()
        );
        assert!(cursor <= len, "{}: cursor past the row", at());
        let alloc = self.cache.allocator();
        for (i, &t) in req.row().iter().enumerate() {
            let page = page_of(t, self.ps);
            assert!(
                alloc.full_live(page),
                "{}: row {i} ({t}) has no live FULL",
                at()
            );
            let state = alloc.swa_state(page);
            if i >= cursor || i + self.window >= len {
                assert_eq!(
                    state,
                    SwaState::Live,
                    "{}: row {i} ({t}) must have live SWA",
                    at()
                );
                assert!(
                    alloc.physical_page(Side::Swa, page).is_some(),
                    "{}: row {i} unbound",
                    at()
                );
            } else if i >= protected {
                assert_eq!(
                    state,
                    SwaState::Tombstone,
                    "{}: row {i} ({t}) is below the cursor",
                    at()
                );
            }
        }
    }

    /// Exact accounting after a step boundary: per side, `available + evictable +
    /// protected + held = total`; held equals what the live requests hold by their own
    /// lengths; and the allocator's live pages are the tree's plus the requests'.
    pub fn check_accounting(&self, live: &[&Request]) {
        let stats = self.cache.stats();
        let sizes = self.cache.tree().sizes();
        let ps = self.ps;
        let (mut full, mut swa) = (0, 0);
        for r in live {
            let end = r.len().div_ceil(ps);
            full += end - r.protected_len() / ps;
            swa += end - r.window_cursor().max(r.protected_len()) / ps;
        }
        assert_eq!(
            stats.live_requests,
            live.len(),
            "{}: live requests",
            self.label
        );
        assert_eq!(
            stats.full.held_pages, full,
            "{}: FULL pages held by requests",
            self.label
        );
        assert_eq!(
            stats.swa.held_pages, swa,
            "{}: SWA pages held by requests",
            self.label
        );
        for side in [&stats.full, &stats.swa] {
            assert_eq!(
                side.available_pages
                    + side.evictable_pages
                    + side.protected_pages
                    + side.held_pages,
                side.total_pages,
                "{}: conservation of {}: {side:?}",
                self.label,
                side.name
            );
        }
        let cap = self.cache.allocator().capacity();
        let tree_full = (sizes.full_evictable.0 + sizes.full_protected.0) / ps;
        let tree_swa = (sizes.swa_evictable.0 + sizes.swa_protected.0) / ps;
        assert_eq!(
            cap.full.allocated_pages,
            tree_full + full,
            "{}: FULL live pages",
            self.label
        );
        assert_eq!(
            cap.swa.allocated_pages,
            tree_swa + swa,
            "{}: SWA live pages",
            self.label
        );
    }

    /// Evicts every unlocked prefix: a FULL demand of the whole side only fits once the
    /// tree holds nothing evictable.
    pub fn evict_everything(&mut self) {
        let total = self.cache.stats().full.total_pages;
        self.cache
            .evict_to_free(total, 0)
            .unwrap_or_else(|e| panic!("{}: evicting everything: {e}", self.label));
        self.step();
    }

    /// Releases every live request, evicts every prefix and checks that every page came
    /// back: nothing allocated, no tombstone, no lock, the tree empty, the tables
    /// consistent and the capacity that of an empty cache.
    pub fn teardown(mut self, live: Vec<Request>) {
        for r in live {
            self.cache
                .release(r)
                .unwrap_or_else(|e| panic!("{}: release: {e}", self.label));
        }
        self.step();
        self.check_accounting(&[]);
        self.evict_everything();
        self.assert_empty();
    }

    /// Nothing allocated on either side, no tombstone (the tree may hold nodes only if
    /// it holds no pages, which it cannot).
    pub fn assert_empty_allocator(&self) {
        let cap = self.cache.allocator().capacity();
        assert_eq!(
            cap.full.allocated_pages, 0,
            "{}: FULL pages leaked: {cap:?}",
            self.label
        );
        assert_eq!(
            cap.swa.allocated_pages, 0,
            "{}: SWA pages leaked: {cap:?}",
            self.label
        );
        assert_eq!(
            cap.swa.tombstones, 0,
            "{}: tombstones left: {cap:?}",
            self.label
        );
        assert_eq!(
            self.cache.stats().full.held_pages + self.cache.stats().swa.held_pages,
            0
        );
    }

    /// Nothing allocated and nothing cached.
    pub fn assert_empty(&self) {
        let cap = self.cache.allocator().capacity();
        let tree = self.cache.tree();
        assert_eq!(
            cap.full.allocated_pages, 0,
            "{}: FULL pages leaked: {cap:?}",
            self.label
        );
        assert_eq!(
            cap.swa.allocated_pages, 0,
            "{}: SWA pages leaked: {cap:?}",
            self.label
        );
        assert_eq!(
            cap.swa.tombstones, 0,
            "{}: tombstones left: {cap:?}",
            self.label
        );
        assert_eq!(
            tree.node_count(),
            1,
            "{}: tree not empty:\n{}",
            self.label,
            tree.dump()
        );
        assert_eq!(tree.lock_count(), 0, "{}: locks left", self.label);
        assert_eq!(self.cache.stats().live_requests, 0, "{}", self.label);
        self.cache
            .allocator()
            .verify()
            .unwrap_or_else(|e| panic!("{}: verify: {e}", self.label));
        assert_eq!(
            settled(&cap),
            settled(&self.empty),
            "{}: capacity of the empty cache: {cap:?}",
            self.label
        );
        tree.sanity_check()
            .unwrap_or_else(|e| panic!("{}: tree sanity: {e}", self.label));
        assert_no_violations(&self.cache, &self.label);
    }
}

/// The capacity views that do not depend on when compaction runs (it is lazy: holes
/// stay until an allocation needs them): pages allocated, tombstones, and what each side
/// and a joint allocation could get after compaction.
pub fn settled(c: &Capacity) -> [usize; 6] {
    [
        c.full.allocated_pages,
        c.swa.allocated_pages,
        c.swa.tombstones,
        c.full.schedulable_pages,
        c.swa.schedulable_pages,
        c.joint_schedulable_pages,
    ]
}

/// From `Warn` up, no invariant was breached in `cache`'s scope (other caches of the test
/// binary count in their own).
pub fn assert_no_violations(cache: &unikv::HybridCache, label: &str) {
    if unikv::invariants::level() != unikv::invariants::Level::Off {
        let report = cache.invariant_scope().report().expect("registry");
        assert_eq!(
            report.total_violations(),
            0,
            "{label}: invariant breaches:\n{report:?}"
        );
    }
}

/// The virtual page of `token` at page size `ps`.
pub fn page_of(token: VirtualToken, ps: usize) -> VirtualPage {
    VirtualPage(token.0 / ps as u32)
}

/// `len` tokens `base, base + 1, ...`: distinct bases give prompts that share nothing.
pub fn text(base: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| TokenId(base + i)).collect()
}

/// `a` followed by `b`.
pub fn concat(a: &[TokenId], b: &[TokenId]) -> Vec<TokenId> {
    let mut v = a.to_vec();
    v.extend_from_slice(b);
    v
}

/// Runs `f` for every layout and page size of this matrix cell.
pub fn for_each_layout_and_page_size(mut f: impl FnMut(Layout, u32)) {
    for layout in LAYOUTS {
        for ps in page_sizes() {
            f(layout, ps);
        }
    }
}

/// `prompt` followed by one new token: a follow-up turn. A match never serves a prompt's
/// last token from the cache (its forward pass yields the first output's logits), so a
/// test that expects all of `prompt` to be a hit matches its follow-up.
pub fn follow_up(prompt: &[TokenId]) -> Vec<TokenId> {
    concat(prompt, &[TokenId(999_999)])
}

/// A property test's configuration: [`proptest_cases`]`(default)` cases, and failing
/// seeds kept in a `.proptest-regressions` file next to the test's source.
pub fn proptest_config(default: u32) -> proptest::test_runner::Config {
    proptest::test_runner::Config {
        cases: proptest_cases(default),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..proptest::test_runner::Config::default()
    }
}

/// Property-test cases: `PROPTEST_CASES` when it is set (a local hunt asks for more),
/// else `default` (sized for the CI matrix, which runs each file 18 times on 2 cores).
pub fn proptest_cases(default: u32) -> u32 {
    match std::env::var("PROPTEST_CASES") {
        Err(_) => default,
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("PROPTEST_CASES={v:?} is not a number of cases")),
    }
}

/// Tokens of the property tests' base texts.
pub const BASE_LEN: usize = 40;

/// Base text `base`: [`BASE_LEN`] tokens of a `vocab`-word vocabulary (xorshift), so
/// prompts cut from the same base share prefixes at every length.
pub fn base_text(base: u8, vocab: u32) -> Vec<TokenId> {
    let mut x = 0x9e37_79b9u32.wrapping_mul(base as u32 + 1);
    (0..BASE_LEN)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            TokenId(x % vocab)
        })
        .collect()
}

/// The bytes a simulated forward leaves after processing `tokens` (a KV row's, of its
/// token and everything before, or a state's): an FNV-1a hash, never 0 (the zeroed page).
pub fn state_of(tokens: &[TokenId]) -> u8 {
    let mut h = 0x811c_9dc5u32;
    for t in tokens {
        h = (h ^ t.0).wrapping_mul(0x0100_0193);
    }
    (h % 255) as u8 + 1
}

/// No request is live and every page of every side is free again (after releasing and
/// evicting everything).
pub fn assert_all_free(s: &unikv::CacheStats, label: &str) {
    assert_eq!(s.live_requests, 0, "{label}");
    for side in [&s.full, &s.swa, &s.mamba] {
        assert_eq!(
            side.available_pages, side.total_pages,
            "{label}: every {} page is free again",
            side.name
        );
    }
}

/// Evicts every cached FULL page the device can (with a host tier, written back there)
/// and ends the step, so the evictions take effect.
pub fn evict_all_evictable(cache: &mut HybridCache) {
    let s = cache.stats();
    cache
        .evict_to_free(s.full.available_pages + s.full.evictable_pages, 0)
        .unwrap();
    cache.step_boundary().unwrap();
}

/// Ends the step, clears the prefix cache and ends the step again; then every page and
/// slot of every side must be free (what a test ends with once it released its requests).
pub fn clear_and_assert_all_free(cache: &mut HybridCache, label: &str) {
    cache.step_boundary().unwrap();
    cache.evict_all().unwrap();
    cache.step_boundary().unwrap();
    assert_all_free(&cache.stats(), label);
}

/// Builds step metadata for `requests` (each with the new tokens its pending checkpoints
/// need, at least one; those whose window would reach below their window cursor left
/// out: no forward reads such a window) on the device and on
/// the host, and checks the two device tables
/// entry for entry: the page tables `translate_lanes` derives from the lanes equal the
/// ones the host builds row by row. The step boundary must have run (the mirror is
/// current), so the builds change nothing another check reads.
pub fn assert_device_tables_match_host(
    cache: &mut HybridCache,
    cpu: &unikv::kernels::CpuDevice,
    requests: &[&Request],
    label: &str,
) {
    use unikv::kernels::{HostSync, Readback};
    let window = cache.model().window as usize;
    let batch: Vec<(&Request, usize)> = requests
        .iter()
        .filter(|r| !r.is_empty())
        .map(|&r| {
            let first = r.checkpoint_writes().iter().map(|w| w.at_len).min();
            (r, first.map_or(1, |at| r.len() - at + 1))
        })
        .filter(|&(r, n)| {
            cache.model().swa_layers == 0
                || (r.len() - n + 1).saturating_sub(window) >= r.window_cursor()
        })
        .collect();
    // What each build's table holds where kernels read: the header, then each request's
    // FULL pages and SWA window pages (the sections' tails past the batch are stale).
    let mut tables = Vec::new();
    for on_host in [false, true] {
        let mut meta = unikv::StepMetadata::new();
        let built = if on_host {
            cache.build_step_metadata_on_host(&mut meta, &batch)
        } else {
            cache.build_step_metadata(&mut meta, &batch)
        };
        built.unwrap_or_else(|e| panic!("{label}: step metadata (on host: {on_host}): {e}"));
        let view = cache.step_view(&meta).unwrap();
        let layout = view.device_layout();
        let mut read = Vec::new();
        if let Some(table) = view.device_table() {
            let sync = HostSync::acquire("test: the device-built step table");
            let entries = cpu.read_table(&sync, table, 0, layout.len).unwrap();
            read.extend_from_slice(&entries[..layout.header_len()]);
            for m in view.requests() {
                read.extend_from_slice(&entries[m.full_pages()]);
                read.extend_from_slice(&entries[m.swa_pages()]);
            }
        }
        tables.push((layout, read));
    }
    assert_eq!(tables[0].0, tables[1].0, "{label}: layouts");
    // The host build names no lanes (it reads none): each request has its own.
    let (l, b) = (tables[0].0, batch.len());
    let lanes = tables[0].1[l.lanes..l.lanes + b].to_vec();
    let mut distinct = lanes.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), b, "{label}: lanes {lanes:?}");
    tables[1].1[l.lanes..l.lanes + b].copy_from_slice(&lanes);
    assert_eq!(
        tables[0].1, tables[1].1,
        "{label}: the device-built step table is the host's"
    );
}
