//! Device faults at every op site of a replay-like run, and allocator faults at every
//! allocator call the facade makes: a failed call changes nothing an engine can read, and
//! the cache goes on as if the fault had not happened.
//!
//! The driver runs a fixed, seeded script of engine calls (arrivals sharing prefixes,
//! chunked prefill, batched decode, caching while running, finishing, aborts, explicit
//! eviction, step boundaries) on a cache small enough that compaction, eviction and
//! window release all happen, with pages zeroed on hand-out. Like an engine, it writes
//! every page it is handed: each page envelope is stamped with a byte of its own, through
//! the host tables, and every stamp is read back through them after each fault, so a
//! compaction that rewrote `v2p` without moving the bytes is caught as data corruption.
//!
//! A fault-free run counts the device ops (or allocator calls); then, for every index `n`,
//! the same script runs with the `n`-th one failing once. When a call fails, the checks
//! are: the error is the injected one; the requests' rows and tokens are as before the
//! call; the allocator's tables verify and every live page still holds its stamp; the
//! step boundary still balances. The call is then retried and must succeed, and the run
//! must end in the state of the fault-free run (tree dump, statistics, rows, and the
//! bytes of every live page).

mod common;

use common::probe::{Probe, ProbeState};
use common::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use unikv::kernels::Error as DeviceError;
use unikv::kernels::{ByteSpan, CpuDevice, Device, FaultInjector, HostSync, Readback, SyncLedger};
use unikv::pools::{Side, VirtualToken};
use unikv::{Error, HybridCache, Layout, Request, TokenId};

const W: u32 = 8;

/// One engine call of the script.
#[derive(Clone, Copy, Debug)]
enum Op {
    Arrive { base: u32, len: usize },
    Prefill { pick: usize, chunk: usize },
    Decode,
    CacheUnfinished { pick: usize },
    Finish { pick: usize },
    Abort { pick: usize },
    Evict { pages: usize },
    CanAdmit { len: usize },
}

/// Prompt, chunk and budget sizes scale with the page size, so that large pages see
/// pressure, holes and compaction too.
fn unit(ps: u32) -> usize {
    (ps as usize / 4).max(1)
}

/// The script: seeded, the same for every run.
fn script(seed: u64, len: usize) -> Vec<Op> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % m) as usize
    };
    (0..len)
        .map(|_| match next(16) {
            0..=2 => Op::Arrive {
                base: next(3) as u32,
                len: 8 + next(24),
            },
            3..=5 => Op::Prefill {
                pick: next(64),
                chunk: 1 + next(12),
            },
            6..=10 => Op::Decode,
            11 => Op::CacheUnfinished { pick: next(64) },
            12 => Op::Finish { pick: next(64) },
            13 => Op::Abort { pick: next(64) },
            14 => Op::Evict { pages: next(6) },
            _ => Op::CanAdmit { len: 8 + next(24) },
        })
        .collect()
}

/// What an engine can observe of the cache, for equality between runs. Where pages sit
/// physically is left out: compaction is lazy, and a retried call may find that the
/// room it needs no longer calls for the compaction whose move failed.
#[derive(Debug, PartialEq)]
struct Observed {
    tree: String,
    stats: String,
    rows: Vec<(Vec<VirtualToken>, Vec<TokenId>)>,
}

struct Run {
    cache: HybridCache,
    cpu: Arc<CpuDevice>,
    faults: Arc<FaultInjector<SyncLedger>>,
    /// Every op the cache issued (the ledger sits under the injector).
    ledger: Arc<SyncLedger>,
    /// The allocator wrapper that fails the n-th fallible allocator call.
    probe: Arc<Mutex<ProbeState>>,
    running: Vec<Request>,
    /// The stamp of every page envelope the driver wrote, by side and virtual page.
    stamps: HashMap<(Side, u32), u8>,
    next_stamp: u8,
    ps: usize,
    /// Faults seen (each retried).
    faults_seen: usize,
    label: String,
}

impl Run {
    fn new(layout: Layout, ps: u32) -> Run {
        let cpu = Arc::new(CpuDevice::new());
        let ledger = Arc::new(SyncLedger::new(cpu.clone()));
        let faults = Arc::new(FaultInjector::new(ledger.clone()));
        let config = Config::tokens(layout, ps, W, 40, (W + ps).div_ceil(ps) as u64 + 4);
        let probe = Arc::new(Mutex::new(ProbeState::default()));
        let wrapped = probe.clone();
        let cache = HybridCache::builder()
            .model(config.model)
            .page_size(ps)
            .memory_bytes(config.memory_bytes())
            .layout(layout)
            .eviction_interval(ps)
            .zero_on_handout(true)
            .device(faults.clone())
            .wrap_allocator(move |inner| Box::new(Probe::new(inner, wrapped)))
            .build()
            .expect("build");
        Run {
            cache,
            cpu,
            faults,
            ledger,
            probe,
            running: Vec::new(),
            stamps: HashMap::new(),
            next_stamp: 1,
            ps: ps as usize,
            faults_seen: 0,
            label: format!("{} ps {ps}", layout.as_str()),
        }
    }

    fn observed(&self) -> Observed {
        Observed {
            tree: self.cache.tree().dump(),
            // A failed boundary still ends its step (the group is closed and reopened), so
            // the step count is the one thing a retried boundary adds to.
            stats: format!(
                "{:?}",
                unikv::CacheStats {
                    step: 0,
                    ..self.cache.stats()
                }
            ),
            rows: self
                .running
                .iter()
                .map(|r| (r.row().to_vec(), r.tokens().to_vec()))
                .collect(),
        }
    }

    /// Stamps every page `req` was handed since row position `from` (the engine writing
    /// its KV): both sides of each page whose first row is at or past `from`.
    fn stamp_new_pages(&mut self, req: usize, from: usize) {
        let row = self.running[req].row().to_vec();
        let alloc = self.cache.allocator();
        let buf = alloc.buffer();
        for (i, &t) in row.iter().enumerate().skip(from) {
            if i % self.ps != 0 {
                continue;
            }
            let v = page_of(t, self.ps);
            for side in [Side::Full, Side::Swa] {
                let Some(p) = alloc.physical_page(side, v) else {
                    continue;
                };
                let grid = alloc.grid(side);
                let stamp = self.next_stamp;
                self.next_stamp = self.next_stamp.wrapping_add(1).max(1);
                let span = ByteSpan {
                    offset: grid.offset(p),
                    len: grid.envelope,
                };
                self.cpu.fill_spans(buf, &[span], stamp).expect("stamp");
                self.stamps.insert((side, v.0), stamp);
            }
        }
    }

    /// Every live page still holds the stamp it was written with, read through the
    /// host tables.
    fn check_bytes(&self, when: &str) {
        let alloc = self.cache.allocator();
        let sync = HostSync::acquire("test: reading stamps back");
        for (&(side, v), &stamp) in &self.stamps {
            let Some(p) = alloc.physical_page(side, unikv::pools::VirtualPage(v)) else {
                continue; // freed since; a later hand-out stamps it again
            };
            let grid = alloc.grid(side);
            let bytes = self
                .cpu
                .read_bytes(&sync, alloc.buffer(), grid.offset(p), grid.envelope)
                .expect("read back");
            let bad = bytes.iter().filter(|&&b| b != stamp).count();
            assert_eq!(
                bad, 0,
                "{} {when}: {side:?} page v{v} at p{p}: {bad} of {} bytes lost their stamp {stamp}",
                self.label, grid.envelope
            );
        }
    }

    /// Runs one engine call; on an injected fault checks that it changed nothing the
    /// engine reads, then retries it with the fault spent.
    fn call<T>(
        &mut self,
        what: &str,
        mut f: impl FnMut(&mut HybridCache, &mut Vec<Request>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let injected = self.injected();
        let rows: Vec<_> = self
            .running
            .iter()
            .map(|r| (r.row().to_vec(), r.tokens().to_vec()))
            .collect();
        match f(&mut self.cache, &mut self.running) {
            Err(e) if self.injected() > injected => {
                self.faults_seen += 1;
                assert!(
                    matches!(
                        e,
                        Error::Device(DeviceError::InjectedFault { .. })
                            | Error::Pool(unikv::pools::Error::Device(
                                DeviceError::InjectedFault { .. }
                            ))
                    ) || e.to_string().contains("injected fault in"),
                    "{}: {what}: not the injected fault: {e}",
                    self.label
                );
                let after: Vec<_> = self
                    .running
                    .iter()
                    .map(|r| (r.row().to_vec(), r.tokens().to_vec()))
                    .collect();
                assert_eq!(
                    rows, after,
                    "{}: {what} failed but changed a row",
                    self.label
                );
                if let Err(why) = self.cache.allocator().verify() {
                    panic!(
                        "{}: {what} failed and left the tables broken: {why}",
                        self.label
                    );
                }
                self.check_bytes(&format!("after a failed {what}"));
                f(&mut self.cache, &mut self.running).inspect_err(|e| {
                    assert!(
                        !matches!(
                            e,
                            Error::Device(_) | Error::Pool(unikv::pools::Error::Device(_))
                        ),
                        "{}: {what}: the retry failed: {e}",
                        self.label
                    )
                })
            }
            other => other,
        }
    }

    /// Faults injected so far, device and allocator.
    fn injected(&self) -> usize {
        self.faults.injected().len() + self.probe.lock().expect("probe").injected
    }

    /// Fallible allocator calls the cache made so far.
    fn allocator_calls(&self) -> usize {
        self.probe.lock().expect("probe").fallible_calls
    }

    fn pick(&self, pick: usize, prefilling: bool) -> Option<usize> {
        let candidates: Vec<usize> = (0..self.running.len())
            .filter(|&i| (self.running[i].remaining_prefill() > 0) == prefilling)
            .collect();
        (!candidates.is_empty()).then(|| candidates[pick % candidates.len()])
    }

    fn exec(&mut self, op: Op) {
        match op {
            Op::Arrive { base, len } => {
                let len = len * unit(self.ps as u32);
                if self.running.len() >= 4 {
                    return;
                }
                let prompt = text(base, len);
                let req = self.call("admit", |c, _| {
                    let hit = c.match_prefix(prompt.clone());
                    c.admit(hit)
                });
                self.running.push(req.expect("admit"));
            }
            Op::Prefill { pick, chunk } => {
                let Some(i) = self.pick(pick, true) else {
                    return;
                };
                let from = self.running[i].len();
                let n = (chunk * unit(self.ps as u32)).min(self.running[i].remaining_prefill());
                match self.call("alloc_extend", |c, r| c.alloc_extend(&mut r[i], n)) {
                    Ok(()) => self.stamp_new_pages(i, from),
                    Err(Error::OutOfMemory { .. }) => self.retract(i),
                    Err(e) => panic!("{}: alloc_extend: {e}", self.label),
                }
            }
            Op::Decode => {
                let batch: Vec<usize> = (0..self.running.len())
                    .filter(|&i| self.running[i].remaining_prefill() == 0)
                    .collect();
                if batch.is_empty() {
                    return;
                }
                let from: Vec<usize> = batch.iter().map(|&i| self.running[i].len()).collect();
                let tokens: Vec<TokenId> = batch.iter().map(|&i| TokenId(i as u32 % 4)).collect();
                let result = self.call("alloc_decode", |c, r| {
                    let mut refs: Vec<&mut Request> = r
                        .iter_mut()
                        .enumerate()
                        .filter(|(i, _)| batch.contains(i))
                        .map(|(_, r)| r)
                        .collect();
                    c.alloc_decode(&mut refs, &tokens)
                });
                match result {
                    Ok(()) => {
                        for (&i, &from) in batch.iter().zip(&from) {
                            self.stamp_new_pages(i, from);
                        }
                    }
                    Err(Error::OutOfMemory { .. }) => self.retract(batch[0]),
                    Err(e) => panic!("{}: alloc_decode: {e}", self.label),
                }
            }
            Op::CacheUnfinished { pick } => {
                let Some(i) = self.pick(pick, false) else {
                    return;
                };
                self.call("cache_unfinished", |c, r| c.cache_unfinished(&mut r[i]))
                    .expect("cache_unfinished");
            }
            Op::Finish { pick } => {
                let Some(i) = self.pick(pick, false) else {
                    return;
                };
                let req = self.running.remove(i);
                self.cache.cache_finished(req).expect("cache_finished");
            }
            Op::Abort { pick } => {
                if self.running.is_empty() {
                    return;
                }
                let req = self.running.remove(pick % self.running.len());
                self.cache.release(req).expect("release");
            }
            Op::Evict { pages } => {
                match self.call("evict_to_free", |c, _| c.evict_to_free(pages, pages)) {
                    Ok(()) | Err(Error::OutOfMemory { .. }) => {}
                    Err(e) => panic!("{}: evict_to_free: {e}", self.label),
                }
            }
            Op::CanAdmit { len } => {
                let hit = self.cache.match_prefix(text(0, len));
                self.cache.can_admit(&hit, 4);
            }
        }
        self.call("step_boundary", |c, _| c.step_boundary())
            .unwrap_or_else(|e| panic!("{}: step boundary: {e}", self.label));
    }

    fn retract(&mut self, i: usize) {
        let req = self.running.remove(i);
        self.cache.release(req).expect("retract");
    }

    fn run(&mut self, ops: &[Op]) {
        for &op in ops {
            self.exec(op);
        }
        self.check_bytes("at the end");
        self.check_mirror();
    }

    /// After a step boundary the device mirror of each side's `v2p` names the pages the
    /// host tables do (a failed upload must leave its entries dirty for the retry).
    fn check_mirror(&self) {
        let alloc = self.cache.allocator();
        assert!(alloc.mirror_current(), "{}: mirror behind", self.label);
        let sync = HostSync::acquire("test: reading the mirror back");
        let pages = alloc.virtual_pages();
        for side in [Side::Full, Side::Swa] {
            let mirror = self
                .cpu
                .read_table(
                    &sync,
                    alloc.mirror_table(side).expect("a FULL/SWA side"),
                    0,
                    pages as usize,
                )
                .expect("read mirror");
            for v in 1..pages {
                let host = alloc.physical_page(side, unikv::pools::VirtualPage(v));
                let device = u32::try_from(mirror[v as usize]).ok().filter(|&p| p > 0);
                assert_eq!(
                    device, host,
                    "{}: {side:?} mirror of v{v} disagrees with the host table",
                    self.label
                );
            }
        }
    }
}

/// The device ops the sweep must reach in `layout` (only the one buffer compacts).
fn kinds_expected(layout: Layout) -> &'static [&'static str] {
    match layout {
        Layout::Unified => &["move_spans", "fill_spans", "copy_table_spans"],
        Layout::Static { .. } => &["fill_spans", "scatter_tables"],
    }
}

/// Where a sweep injects its faults.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Site {
    /// The `n`-th device op.
    Device,
    /// The `n`-th fallible allocator call (`alloc_*`, the checked frees, group begin and
    /// end, `ensure_capacity`, `upload_mirror`, ...). The frees of the tree's actions
    /// and of finishing requests go through `free_batch`, which cannot fail, so no
    /// fault can land between a tree change and its frees.
    Allocator,
}

impl Run {
    /// Device ops or fallible allocator calls so far.
    fn sites(&self, site: Site) -> usize {
        match site {
            Site::Device => self.faults.ops_seen() as usize,
            Site::Allocator => self.allocator_calls(),
        }
    }

    /// Fails the `n`-th site from now, once.
    fn fail_at(&self, site: Site, n: usize) {
        match site {
            Site::Device => self.faults.fail_at(n as u64),
            Site::Allocator => {
                let mut probe = self.probe.lock().expect("probe");
                probe.fail_call = Some(probe.fallible_calls + n);
            }
        }
    }
}

/// Runs the script once per site, failing that one once. The script's seed is the first
/// whose fault-free run issues every kind of device op the layout has, so the sweep
/// reaches compaction moves, zeroing and mirror uploads.
fn sweep(layout: Layout, ps: u32, site: Site) {
    let (ops, clean, total) = (1..=32)
        .find_map(|seed| {
            let ops = script(seed * 1000 + ps as u64, 120);
            let mut clean = Run::new(layout, ps);
            let start = clean.sites(site);
            clean.run(&ops);
            let total = clean.sites(site) - start;
            let issued: Vec<&str> = clean.ledger.ops().iter().map(|r| r.op).collect();
            kinds_expected(layout)
                .iter()
                .all(|k| issued.contains(k))
                .then_some((ops, clean, total))
        })
        .unwrap_or_else(|| panic!("{layout:?} ps {ps}: no seed reaches every op kind"));
    let expected = clean.observed();
    let mut kinds = std::collections::BTreeSet::new();
    for n in 0..total {
        let mut run = Run::new(layout, ps);
        run.fail_at(site, n);
        run.run(&ops);
        assert_eq!(
            run.observed(),
            expected,
            "{}: a fault at {site:?} site {n} of {total} changed the end state",
            run.label
        );
        assert_eq!(
            run.faults_seen, 1,
            "{}: the fault at {site:?} site {n} did not reach exactly one call",
            run.label
        );
        kinds.extend(run.faults.injected().iter().map(|f| f.op.as_str()));
    }
    for &kind in kinds_expected(layout)
        .iter()
        .filter(|_| site == Site::Device)
    {
        assert!(
            kinds.contains(kind),
            "{}: no fault was injected into a {kind} (faults at {kinds:?})",
            clean.label
        );
    }
}

#[test]
fn a_device_fault_at_any_op_changes_nothing_and_the_retry_succeeds() {
    for_each_layout_and_page_size(|layout, ps| sweep(layout, ps, Site::Device));
}

#[test]
fn an_allocator_fault_at_any_call_changes_nothing_and_the_retry_succeeds() {
    for_each_layout_and_page_size(|layout, ps| sweep(layout, ps, Site::Allocator));
}
