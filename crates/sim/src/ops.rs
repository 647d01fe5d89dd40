//! Allocator-level operation traces: `unikv replay --record-ops FILE` writes every
//! operation the run made on its allocator, and `unikv bench-ops FILE` replays only those
//! operations against a fresh allocator, isolating the allocator's cost from the
//! simulator's and the tree's. The format is documented in `docs/ops-trace.md`.
//!
//! Lists of virtual token ids are stored as runs `[first, count]` of consecutive ids
//! (a page's tokens are consecutive, so a row at page size 256 is a few runs).

use crate::error::SimError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use unikv::ModelSpec;
use unikv::kernels::{BytesId, SyncLedger, TableId};
use unikv::pools::{
    Capacity, DecodeRequest, DeferredKind, ExtendRequest, FlushReport, Grid, KvAllocator, MoveGate,
    PageDemand, PageSize, PoolMap, ReclaimPlan, Reclaimable, Segment, Side, StaticSwa,
    StaticSwaConfig, SubPoolSpec, SwaState, UnifiedSwa, UnifiedSwaConfig, VirtualPage,
    VirtualToken,
};

/// The schema name in the header line.
pub const SCHEMA: &str = "unikv.ops.v1";

/// Virtual token ids as runs `[first, count]` of consecutive ids.
pub type Runs = Vec<[u32; 2]>;

/// Encodes ids as runs of consecutive values.
pub fn to_runs(ids: &[VirtualToken]) -> Runs {
    let mut runs: Runs = Vec::new();
    for &VirtualToken(id) in ids {
        match runs.last_mut() {
            Some([first, count]) if first.wrapping_add(*count) == id => *count += 1,
            _ => runs.push([id, 1]),
        }
    }
    runs
}

/// Decodes runs into ids.
pub fn from_runs(runs: &[[u32; 2]]) -> Vec<VirtualToken> {
    runs.iter()
        .flat_map(|&[first, count]| (0..count).map(move |i| VirtualToken(first + i)))
        .collect()
}

/// One request of an extend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extend {
    /// Tokens held before.
    pub prefix_len: usize,
    /// Tokens held after.
    pub seq_len: usize,
    /// The last token held before, if any.
    pub last_token: Option<u32>,
}

/// A segment: a page-aligned row position and its ids.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seg {
    /// Row position of the first id.
    pub start: usize,
    /// The ids.
    pub ids: Runs,
}

impl Seg {
    fn of(s: &Segment<'_>) -> Seg {
        Seg {
            start: s.start,
            ids: to_runs(s.tokens),
        }
    }
}

/// One line of an ops trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// The first line: what allocator to build.
    Header {
        /// [`SCHEMA`].
        schema: String,
        /// `static` or `unified`.
        layout: String,
        /// The model name (sizes the sub-pools).
        model: String,
        /// Tokens per page.
        page_size: u32,
        /// The buffer's bytes.
        memory_bytes: u64,
        /// The static layout's SWA:FULL token ratio.
        swa_full_ratio: f64,
    },
    /// `alloc_extend`, with the ids it returned.
    AllocExtend {
        /// The requests.
        requests: Vec<Extend>,
        /// The ids handed out.
        out: Runs,
    },
    /// `alloc_decode` (each request grows by one token), with the ids it returned.
    AllocDecode {
        /// The requests (`seq_len` is `prefix_len + 1`).
        requests: Vec<Extend>,
        /// The ids handed out.
        out: Runs,
    },
    /// Set-shaped two-sided free.
    Free {
        /// The ids.
        ids: Runs,
    },
    /// Set-shaped SWA-only free.
    FreeSwa {
        /// The ids.
        ids: Runs,
    },
    /// Set-shaped FULL-only free.
    FreeFull {
        /// The ids.
        ids: Runs,
    },
    /// Two-sided segment free.
    FreeSegment(Seg),
    /// SWA-only segment free (window release, SWA tombstoning).
    FreeSwaSegment(Seg),
    /// FULL-only segment free.
    FreeFullSegment(Seg),
    /// Several page-disjoint two-sided segment frees.
    FreeSegments {
        /// The segments.
        segments: Vec<Seg>,
    },
    /// A finishing row split at its cursor.
    FreeKvRowSegments {
        /// The row's first `len` ids.
        row: Runs,
        /// Rows below are not the caller's.
        dead_lo: usize,
        /// The window cursor.
        cursor: usize,
        /// The row's length.
        len: usize,
    },
    /// SWA ownership transfer (tombstone recovery under a locked FULL).
    TransferSwa {
        /// Live SWA pages handed over.
        from: Seg,
        /// Tombstoned pages that receive them.
        to: Seg,
    },
    /// Opens a free group.
    GroupBegin,
    /// Closes the free group.
    GroupEnd,
    /// Applies deferred frees, keeps the group open.
    FlushDeferred,
    /// Step-boundary flush (deferred frees and compaction).
    Flush,
    /// `ensure_capacity`.
    EnsureCapacity {
        /// FULL pages.
        full_pages: usize,
        /// SWA pages.
        swa_pages: usize,
    },
    /// `reclaim_plan`.
    ReclaimPlan {
        /// FULL pages demanded.
        full_pages: usize,
        /// SWA pages demanded.
        swa_pages: usize,
        /// FULL pages the tree could evict.
        evictable_full: usize,
        /// SWA pages the tree could evict.
        evictable_swa: usize,
    },
    /// The per-step mirror upload.
    UploadMirror,
}

impl Op {
    /// The op's name, as in the trace.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Header { .. } => "header",
            Op::AllocExtend { .. } => "alloc_extend",
            Op::AllocDecode { .. } => "alloc_decode",
            Op::Free { .. } => "free",
            Op::FreeSwa { .. } => "free_swa",
            Op::FreeFull { .. } => "free_full",
            Op::FreeSegment(_) => "free_segment",
            Op::FreeSwaSegment(_) => "free_swa_segment",
            Op::FreeFullSegment(_) => "free_full_segment",
            Op::FreeSegments { .. } => "free_segments",
            Op::FreeKvRowSegments { .. } => "free_kv_row_segments",
            Op::TransferSwa { .. } => "transfer_swa",
            Op::GroupBegin => "group_begin",
            Op::GroupEnd => "group_end",
            Op::FlushDeferred => "flush_deferred",
            Op::Flush => "flush",
            Op::EnsureCapacity { .. } => "ensure_capacity",
            Op::ReclaimPlan { .. } => "reclaim_plan",
            Op::UploadMirror => "upload_mirror",
        }
    }
}

/// Writes a trace; [`Recorder::wrap`] puts it around an allocator.
#[derive(Debug)]
pub struct Recorder {
    out: BufWriter<File>,
    path: PathBuf,
    error: Arc<Mutex<Option<String>>>,
}

/// Reports, after the run, whether writing the trace failed.
#[derive(Clone, Debug)]
pub struct RecordStatus {
    error: Arc<Mutex<Option<String>>>,
}

impl RecordStatus {
    /// The first write error, if any.
    pub fn check(&self) -> Result<(), SimError> {
        match self.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(reason) => Err(SimError::OpsTrace { reason }),
            None => Ok(()),
        }
    }
}

impl Recorder {
    /// Creates `path` and writes the header line.
    pub fn create(path: &Path, header: Op) -> Result<(Recorder, RecordStatus), SimError> {
        let file = File::create(path).map_err(|e| SimError::OpsTrace {
            reason: format!("cannot create {}: {e}", path.display()),
        })?;
        let error = Arc::new(Mutex::new(None));
        let mut recorder = Recorder {
            out: BufWriter::new(file),
            path: path.to_path_buf(),
            error: error.clone(),
        };
        recorder.write(&header);
        Ok((recorder, RecordStatus { error }))
    }

    fn write(&mut self, op: &Op) {
        let result = serde_json::to_writer(&mut self.out, op)
            .map_err(|e| e.to_string())
            .and_then(|()| self.out.write_all(b"\n").map_err(|e| e.to_string()));
        if let Err(e) = result {
            let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert_with(|| format!("writing {}: {e}", self.path.display()));
        }
    }

    /// Wraps `inner`: every mutating call is forwarded, then written.
    pub fn wrap(self, inner: Box<dyn KvAllocator>) -> RecordingAllocator {
        RecordingAllocator {
            inner,
            recorder: self,
        }
    }
}

/// An allocator that records every mutating call it forwards.
#[derive(Debug)]
pub struct RecordingAllocator {
    inner: Box<dyn KvAllocator>,
    recorder: Recorder,
}

impl Drop for RecordingAllocator {
    fn drop(&mut self) {
        if let Err(e) = self.recorder.out.flush() {
            let mut slot = self
                .recorder
                .error
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert_with(|| format!("flushing {}: {e}", self.recorder.path.display()));
        }
    }
}

fn extends(requests: &[ExtendRequest]) -> Vec<Extend> {
    requests
        .iter()
        .map(|r| Extend {
            prefix_len: r.prefix_len,
            seq_len: r.seq_len,
            last_token: r.last_token.map(|t| t.0),
        })
        .collect()
}

impl KvAllocator for RecordingAllocator {
    fn page_size(&self) -> PageSize {
        self.inner.page_size()
    }
    fn virtual_pages(&self) -> u32 {
        self.inner.virtual_pages()
    }
    fn alloc_extend(
        &mut self,
        requests: &[ExtendRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), unikv::pools::Error> {
        let from = out.len();
        self.inner.alloc_extend(requests, out)?;
        let op = Op::AllocExtend {
            requests: extends(requests),
            out: to_runs(&out[from..]),
        };
        self.recorder.write(&op);
        Ok(())
    }
    fn alloc_decode(
        &mut self,
        requests: &[DecodeRequest],
        out: &mut Vec<VirtualToken>,
    ) -> Result<(), unikv::pools::Error> {
        let from = out.len();
        self.inner.alloc_decode(requests, out)?;
        let ext: Vec<ExtendRequest> = requests.iter().map(|&d| d.into()).collect();
        let op = Op::AllocDecode {
            requests: extends(&ext),
            out: to_runs(&out[from..]),
        };
        self.recorder.write(&op);
        Ok(())
    }
    fn free(&mut self, ids: &[VirtualToken]) -> Result<(), unikv::pools::Error> {
        self.inner.free(ids)?;
        self.recorder.write(&Op::Free { ids: to_runs(ids) });
        Ok(())
    }
    fn free_swa(&mut self, ids: &[VirtualToken]) -> Result<(), unikv::pools::Error> {
        self.inner.free_swa(ids)?;
        self.recorder.write(&Op::FreeSwa { ids: to_runs(ids) });
        Ok(())
    }
    fn free_full(&mut self, ids: &[VirtualToken]) -> Result<(), unikv::pools::Error> {
        self.inner.free_full(ids)?;
        self.recorder.write(&Op::FreeFull { ids: to_runs(ids) });
        Ok(())
    }
    fn free_segment(&mut self, segment: Segment<'_>) -> Result<(), unikv::pools::Error> {
        self.inner.free_segment(segment)?;
        self.recorder.write(&Op::FreeSegment(Seg::of(&segment)));
        Ok(())
    }
    fn free_swa_segment(&mut self, segment: Segment<'_>) -> Result<(), unikv::pools::Error> {
        self.inner.free_swa_segment(segment)?;
        self.recorder.write(&Op::FreeSwaSegment(Seg::of(&segment)));
        Ok(())
    }
    fn free_full_segment(&mut self, segment: Segment<'_>) -> Result<(), unikv::pools::Error> {
        self.inner.free_full_segment(segment)?;
        self.recorder.write(&Op::FreeFullSegment(Seg::of(&segment)));
        Ok(())
    }
    fn free_segments(&mut self, segments: &[Segment<'_>]) -> Result<(), unikv::pools::Error> {
        self.inner.free_segments(segments)?;
        self.recorder.write(&Op::FreeSegments {
            segments: segments.iter().map(Seg::of).collect(),
        });
        Ok(())
    }
    fn free_kv_row_segments(
        &mut self,
        row: &[VirtualToken],
        dead_lo: usize,
        cursor: usize,
        len: usize,
    ) -> Result<(), unikv::pools::Error> {
        self.inner.free_kv_row_segments(row, dead_lo, cursor, len)?;
        let row = to_runs(&row[..len.min(row.len())]);
        self.recorder.write(&Op::FreeKvRowSegments {
            row,
            dead_lo,
            cursor,
            len,
        });
        Ok(())
    }
    fn transfer_swa(
        &mut self,
        from: Segment<'_>,
        to: Segment<'_>,
    ) -> Result<(), unikv::pools::Error> {
        self.inner.transfer_swa(from, to)?;
        self.recorder.write(&Op::TransferSwa {
            from: Seg::of(&from),
            to: Seg::of(&to),
        });
        Ok(())
    }
    fn free_group_begin(&mut self) -> Result<(), unikv::pools::Error> {
        self.inner.free_group_begin()?;
        self.recorder.write(&Op::GroupBegin);
        Ok(())
    }
    fn free_group_end(&mut self) -> Result<(), unikv::pools::Error> {
        self.inner.free_group_end()?;
        self.recorder.write(&Op::GroupEnd);
        Ok(())
    }
    fn in_free_group(&self) -> bool {
        self.inner.in_free_group()
    }
    fn pending_frees(&self) -> [(DeferredKind, usize); 4] {
        self.inner.pending_frees()
    }
    fn flush_deferred(&mut self) -> bool {
        let flushed = self.inner.flush_deferred();
        self.recorder.write(&Op::FlushDeferred);
        flushed
    }
    fn flush(&mut self) -> Result<FlushReport, unikv::pools::Error> {
        let report = self.inner.flush()?;
        self.recorder.write(&Op::Flush);
        Ok(report)
    }
    fn allocation_fits(&self, demand: PageDemand) -> bool {
        self.inner.allocation_fits(demand)
    }
    fn ensure_capacity(&mut self, demand: PageDemand) -> Result<(), unikv::pools::Error> {
        let result = self.inner.ensure_capacity(demand);
        // Recorded even when it fails: it flushed deferred frees either way.
        self.recorder.write(&Op::EnsureCapacity {
            full_pages: demand.full_pages,
            swa_pages: demand.swa_pages,
        });
        result
    }
    fn reclaim_plan(&mut self, demand: PageDemand, evictable: Reclaimable) -> Option<ReclaimPlan> {
        let plan = self.inner.reclaim_plan(demand, evictable);
        self.recorder.write(&Op::ReclaimPlan {
            full_pages: demand.full_pages,
            swa_pages: demand.swa_pages,
            evictable_full: evictable.full_pages,
            evictable_swa: evictable.swa_pages,
        });
        plan
    }
    fn capacity(&self) -> Capacity {
        self.inner.capacity()
    }
    fn pool_map(&self) -> PoolMap {
        self.inner.pool_map()
    }
    fn move_gate(&self) -> MoveGate {
        self.inner.move_gate()
    }
    fn upload_mirror(&mut self) -> Result<(), unikv::pools::Error> {
        self.inner.upload_mirror()?;
        self.recorder.write(&Op::UploadMirror);
        Ok(())
    }
    fn mirror_current(&self) -> bool {
        self.inner.mirror_current()
    }
    fn mirror_table(&self, side: Side) -> TableId {
        self.inner.mirror_table(side)
    }
    fn stride(&self, side: Side) -> u32 {
        self.inner.stride(side)
    }
    fn kernel_id(&self, side: Side, token: VirtualToken) -> i32 {
        self.inner.kernel_id(side, token)
    }
    fn translate(
        &self,
        side: Side,
        ids: TableId,
        n: usize,
        out: TableId,
        out_width: usize,
    ) -> Result<(), unikv::pools::Error> {
        self.inner.translate(side, ids, n, out, out_width)
    }
    fn buffer(&self) -> BytesId {
        self.inner.buffer()
    }
    fn grid(&self, side: Side) -> Grid {
        self.inner.grid(side)
    }
    fn sink_floor(&self) -> u64 {
        self.inner.sink_floor()
    }
    fn physical_page(&self, side: Side, page: VirtualPage) -> Option<u32> {
        self.inner.physical_page(side, page)
    }
    fn full_live(&self, page: VirtualPage) -> bool {
        self.inner.full_live(page)
    }
    fn swa_state(&self, page: VirtualPage) -> SwaState {
        self.inner.swa_state(page)
    }
    fn check_conservation(&self) -> bool {
        self.inner.check_conservation()
    }
    fn verify(&self) -> Result<(), String> {
        self.inner.verify()
    }
}

/// A parsed trace: the header's allocator and the operations.
#[derive(Debug)]
pub struct Trace {
    /// The header line.
    pub header: Op,
    /// Every operation after it.
    pub ops: Vec<Op>,
}

/// Reads a trace file.
pub fn load(path: &Path) -> Result<Trace, SimError> {
    let file = File::open(path).map_err(|e| SimError::OpsTrace {
        reason: format!("cannot open {}: {e}", path.display()),
    })?;
    let mut header = None;
    let mut ops = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| SimError::OpsTrace {
            reason: format!("{}: {e}", path.display()),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let op: Op = serde_json::from_str(&line).map_err(|e| SimError::OpsTrace {
            reason: format!("{} line {}: {e}", path.display(), i + 1),
        })?;
        match (&header, op) {
            (None, op @ Op::Header { .. }) => header = Some(op),
            (None, _) => {
                return Err(SimError::OpsTrace {
                    reason: format!("{}: the first line must be the header", path.display()),
                });
            }
            (Some(_), Op::Header { .. }) => {
                return Err(SimError::OpsTrace {
                    reason: format!("{} line {}: a second header", path.display(), i + 1),
                });
            }
            (Some(_), op) => ops.push(op),
        }
    }
    let header = header.ok_or_else(|| SimError::OpsTrace {
        reason: format!("{}: empty trace", path.display()),
    })?;
    Ok(Trace { header, ops })
}

/// Builds the allocator a header describes, on `device`.
pub fn allocator_for(
    header: &Op,
    device: Arc<dyn unikv::kernels::Device>,
) -> Result<Box<dyn KvAllocator>, SimError> {
    let Op::Header {
        schema,
        layout,
        model,
        page_size,
        memory_bytes,
        swa_full_ratio,
    } = header
    else {
        return Err(SimError::OpsTrace {
            reason: "not a header".into(),
        });
    };
    if schema != SCHEMA {
        return Err(SimError::OpsTrace {
            reason: format!("schema {schema:?}, expected {SCHEMA:?}"),
        });
    }
    let m = ModelSpec::by_name(model).ok_or_else(|| SimError::OpsTrace {
        reason: format!("unknown model {model:?}"),
    })?;
    let full = SubPoolSpec::mha("full", m.full_layers, m.kv_heads, m.head_dim, m.dtype_bytes);
    let swa = SubPoolSpec::mha("swa", m.swa_layers, m.kv_heads, m.head_dim, m.dtype_bytes);
    let built: Result<Box<dyn KvAllocator>, unikv::pools::Error> = match layout.as_str() {
        "unified" => UnifiedSwa::new(
            device,
            UnifiedSwaConfig {
                total_bytes: *memory_bytes,
                page_size: *page_size,
                window: m.window,
                full,
                swa,
                zero_on_handout: false,
            },
        )
        .map(|a| Box::new(a) as Box<dyn KvAllocator>),
        "static" => StaticSwa::new(
            device,
            StaticSwaConfig {
                total_bytes: *memory_bytes,
                page_size: *page_size,
                window: m.window,
                full,
                swa,
                swa_full_ratio: *swa_full_ratio,
                zero_on_handout: false,
            },
        )
        .map(|a| Box::new(a) as Box<dyn KvAllocator>),
        other => {
            return Err(SimError::OpsTrace {
                reason: format!("unknown layout {other:?}"),
            });
        }
    };
    built.map_err(|e| SimError::Cache(e.into()))
}

/// Throughput of one op kind in a replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct OpThroughput {
    /// Calls.
    pub calls: u64,
    /// Tokens the calls named (allocated or freed).
    pub tokens: u64,
    /// Time inside the allocator, in nanoseconds.
    pub nanos: u64,
}

impl OpThroughput {
    /// Calls per second.
    pub fn ops_per_second(&self) -> f64 {
        self.calls as f64 / (self.nanos.max(1) as f64 / 1e9)
    }

    /// Tokens per second.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / (self.nanos.max(1) as f64 / 1e9)
    }
}

/// Replays `trace` against a fresh allocator and times every op. Returns the throughput
/// per op kind (plus `all`). The ids each alloc returns are checked against the trace, so
/// a replay that diverged is an error, not a number.
///
/// The allocator runs on a CPU device behind a [`SyncLedger`], and the time the device
/// spends executing ops (page moves, uploads: asynchronous launches on a GPU) is taken
/// out of each op's time, so the figures are the allocator's host bookkeeping.
pub fn replay(trace: &Trace) -> Result<BTreeMap<&'static str, OpThroughput>, SimError> {
    let ledger = Arc::new(SyncLedger::cpu());
    let mut alloc = allocator_for(&trace.header, ledger.clone())?;
    let host_nanos = |started: Instant| {
        let nanos = started
            .elapsed()
            .saturating_sub(ledger.device_time())
            .as_nanos() as u64;
        ledger.reset();
        nanos
    };
    let mut by_kind: BTreeMap<&'static str, OpThroughput> = BTreeMap::new();
    let mut out = Vec::new();
    let diverged = |i: usize, what: String| SimError::OpsTrace {
        reason: format!("op {}: replay diverged: {what}", i + 1),
    };
    let pool = |e: unikv::pools::Error| SimError::Cache(e.into());
    for (i, op) in trace.ops.iter().enumerate() {
        // Inputs are decoded before the clock starts.
        let tokens: u64;
        let started;
        match op {
            Op::Header { .. } => return Err(diverged(i, "a second header".into())),
            Op::AllocExtend {
                requests,
                out: expected,
            }
            | Op::AllocDecode {
                requests,
                out: expected,
            } => {
                let reqs: Vec<ExtendRequest> = requests
                    .iter()
                    .map(|r| ExtendRequest {
                        prefix_len: r.prefix_len,
                        seq_len: r.seq_len,
                        last_token: r.last_token.map(VirtualToken),
                    })
                    .collect();
                tokens = reqs.iter().map(|r| (r.seq_len - r.prefix_len) as u64).sum();
                out.clear();
                started = Instant::now();
                if let Op::AllocDecode { .. } = op {
                    let dec: Vec<DecodeRequest> = reqs
                        .iter()
                        .map(|r| DecodeRequest {
                            prefix_len: r.prefix_len,
                            last_token: r.last_token,
                        })
                        .collect();
                    alloc.alloc_decode(&dec, &mut out).map_err(pool)?;
                } else {
                    alloc.alloc_extend(&reqs, &mut out).map_err(pool)?;
                }
                let nanos = host_nanos(started);
                if to_runs(&out) != *expected {
                    return Err(diverged(
                        i,
                        "an alloc returned other ids than recorded".into(),
                    ));
                }
                add(&mut by_kind, op.name(), tokens, nanos);
                continue;
            }
            Op::Free { ids } | Op::FreeSwa { ids } | Op::FreeFull { ids } => {
                let ids = from_runs(ids);
                tokens = ids.len() as u64;
                started = Instant::now();
                match op {
                    Op::Free { .. } => alloc.free(&ids),
                    Op::FreeSwa { .. } => alloc.free_swa(&ids),
                    _ => alloc.free_full(&ids),
                }
                .map_err(pool)?;
            }
            Op::FreeSegment(seg) | Op::FreeSwaSegment(seg) | Op::FreeFullSegment(seg) => {
                let ids = from_runs(&seg.ids);
                tokens = ids.len() as u64;
                let s = Segment {
                    tokens: &ids,
                    start: seg.start,
                };
                started = Instant::now();
                match op {
                    Op::FreeSegment(_) => alloc.free_segment(s),
                    Op::FreeSwaSegment(_) => alloc.free_swa_segment(s),
                    _ => alloc.free_full_segment(s),
                }
                .map_err(pool)?;
            }
            Op::FreeSegments { segments } => {
                let ids: Vec<Vec<VirtualToken>> =
                    segments.iter().map(|s| from_runs(&s.ids)).collect();
                let segs: Vec<Segment<'_>> = segments
                    .iter()
                    .zip(&ids)
                    .map(|(s, ids)| Segment {
                        tokens: ids,
                        start: s.start,
                    })
                    .collect();
                tokens = ids.iter().map(|v| v.len() as u64).sum();
                started = Instant::now();
                alloc.free_segments(&segs).map_err(pool)?;
            }
            Op::FreeKvRowSegments {
                row,
                dead_lo,
                cursor,
                len,
            } => {
                let row = from_runs(row);
                tokens = (len - dead_lo.min(len)) as u64;
                started = Instant::now();
                alloc
                    .free_kv_row_segments(&row, *dead_lo, *cursor, *len)
                    .map_err(pool)?;
            }
            Op::TransferSwa { from, to } => {
                let (f, t) = (from_runs(&from.ids), from_runs(&to.ids));
                tokens = f.len() as u64;
                started = Instant::now();
                alloc
                    .transfer_swa(
                        Segment {
                            tokens: &f,
                            start: from.start,
                        },
                        Segment {
                            tokens: &t,
                            start: to.start,
                        },
                    )
                    .map_err(pool)?;
            }
            Op::GroupBegin => {
                tokens = 0;
                started = Instant::now();
                alloc.free_group_begin().map_err(pool)?;
            }
            Op::GroupEnd => {
                tokens = 0;
                started = Instant::now();
                alloc.free_group_end().map_err(pool)?;
            }
            Op::FlushDeferred => {
                tokens = 0;
                started = Instant::now();
                alloc.flush_deferred();
            }
            Op::Flush => {
                tokens = 0;
                started = Instant::now();
                alloc.flush().map_err(pool)?;
            }
            Op::EnsureCapacity {
                full_pages,
                swa_pages,
            } => {
                tokens = 0;
                started = Instant::now();
                // It may fail as it did when recorded; its effect (a flush) is what matters.
                let _ = alloc.ensure_capacity(PageDemand {
                    full_pages: *full_pages,
                    swa_pages: *swa_pages,
                });
            }
            Op::ReclaimPlan {
                full_pages,
                swa_pages,
                evictable_full,
                evictable_swa,
            } => {
                tokens = 0;
                started = Instant::now();
                alloc.reclaim_plan(
                    PageDemand {
                        full_pages: *full_pages,
                        swa_pages: *swa_pages,
                    },
                    Reclaimable {
                        full_pages: *evictable_full,
                        swa_pages: *evictable_swa,
                    },
                );
            }
            Op::UploadMirror => {
                tokens = 0;
                started = Instant::now();
                alloc.upload_mirror().map_err(pool)?;
            }
        }
        add(&mut by_kind, op.name(), tokens, host_nanos(started));
    }
    let all = by_kind
        .values()
        .fold(OpThroughput::default(), |mut acc, t| {
            acc.calls += t.calls;
            acc.tokens += t.tokens;
            acc.nanos += t.nanos;
            acc
        });
    by_kind.insert("all", all);
    Ok(by_kind)
}

fn add(
    by_kind: &mut BTreeMap<&'static str, OpThroughput>,
    name: &'static str,
    tokens: u64,
    nanos: u64,
) {
    let t = by_kind.entry(name).or_default();
    t.calls += 1;
    t.tokens += tokens;
    t.nanos += nanos;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_round_trip_and_compress_consecutive_ids() {
        let ids: Vec<VirtualToken> = [4, 5, 6, 7, 20, 21, 9].map(VirtualToken).to_vec();
        let runs = to_runs(&ids);
        assert_eq!(runs, vec![[4, 4], [20, 2], [9, 1]]);
        assert_eq!(from_runs(&runs), ids);
        assert_eq!(runs.iter().map(|r| r[1]).sum::<u32>(), 7);
        assert!(to_runs(&[]).is_empty());
    }

    #[test]
    fn ops_serialise_with_their_names() {
        let line = serde_json::to_string(&Op::FreeSwaSegment(Seg {
            start: 8,
            ids: vec![[8, 4]],
        }))
        .unwrap();
        assert_eq!(line, r#"{"op":"free_swa_segment","start":8,"ids":[[8,4]]}"#);
        let back: Op = serde_json::from_str(&line).unwrap();
        assert_eq!(back.name(), "free_swa_segment");
        assert_eq!(
            serde_json::to_string(&Op::GroupBegin).unwrap(),
            r#"{"op":"group_begin"}"#
        );
    }
}
