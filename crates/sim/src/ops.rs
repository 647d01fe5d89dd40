//! Allocator-level operation traces: `unikv replay --record-ops FILE` writes every
//! operation the run made on its allocator, and `unikv bench-ops FILE` replays only those
//! operations against a fresh allocator, isolating the allocator's cost from the
//! simulator's and the tree's. The format is documented in `docs/ops-trace.md`.
//!
//! Lists of virtual token ids are stored as runs `[first, count]` of consecutive ids
//! (a page's tokens are consecutive, so a row at page size 256 is a few runs).

use crate::error::{OpsProblem, SimError};
use crate::input::{BoundedLines, LineError};
use crate::scheduler::Backend;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use unikv::pools::{
    Call, DecodeRequest, ExtendRequest, FreeOp, Hooked, Hooks, IdFree, KvAllocator, Outcome,
    PageDemand, Reclaimable, Segment, StaticSwa, StaticSwaConfig, UnifiedSwa, UnifiedSwaConfig,
    VirtualSlot, VirtualToken,
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

/// The most operations an ops trace may hold: 2^24 (about 9,000 times the operations of
/// a recorded `random-8192-64` run).
pub const MAX_OPS: usize = 1 << 24;

/// The most ids one operation may name (the sum of its runs' counts, or of the tokens
/// its alloc requests ask for): 2^24, the tokens of 412 GB of gpt-oss-20b KV on one side,
/// and 64 MiB once decoded.
pub const MAX_OP_IDS: u64 = 1 << 24;

/// The largest row position, row length or page count an operation may give: 2^32.
pub const MAX_OP_NUMBER: u64 = 1 << 32;

/// How many ids `runs` name, after checking each run: a count of at least 1, no id past
/// `u32::MAX`, at most [`MAX_OP_IDS`] in all.
pub fn run_ids(runs: &[[u32; 2]]) -> Result<u64, OpsProblem> {
    let mut ids: u64 = 0;
    for &[first, count] in runs {
        if count == 0 {
            return Err(OpsProblem::EmptyRun { first });
        }
        if u64::from(first) + u64::from(count) > 1 << 32 {
            return Err(OpsProblem::RunPastLastId { first, count });
        }
        ids += u64::from(count);
        if ids > MAX_OP_IDS {
            return Err(OpsProblem::TooManyIds {
                ids,
                limit: MAX_OP_IDS,
            });
        }
    }
    Ok(ids)
}

/// Decodes runs into ids, after the checks of [`run_ids`] (so the result holds at most
/// [`MAX_OP_IDS`] ids).
pub fn from_runs(runs: &[[u32; 2]]) -> Result<Vec<VirtualToken>, OpsProblem> {
    let mut ids = Vec::with_capacity(run_ids(runs)? as usize);
    // In range: `run_ids` checked that `first + count - 1` is at most `u32::MAX`.
    ids.extend(
        runs.iter()
            .flat_map(|&[first, count]| (0..count).map(move |i| VirtualToken(first + i))),
    );
    Ok(ids)
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
    /// `alloc_slots`, with the slots it returned.
    AllocSlots {
        /// Slots asked for.
        n: usize,
        /// The slots handed out.
        out: Vec<u32>,
    },
    /// `free_slots`.
    FreeSlots {
        /// The slots.
        slots: Vec<u32>,
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
    /// Several SWA-only segment frees (a decode batch's window release).
    FreeSwaSegments {
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
        /// Mamba slots (absent from the line when 0).
        #[serde(default, skip_serializing_if = "is_zero")]
        mamba_slots: usize,
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
        /// Mamba slots demanded (absent from the line when 0).
        #[serde(default, skip_serializing_if = "is_zero")]
        mamba_slots: usize,
        /// Mamba slots the tree could evict (absent from the line when 0).
        #[serde(default, skip_serializing_if = "is_zero")]
        evictable_mamba: usize,
    },
    /// The per-step mirror upload.
    UploadMirror,
}

/// Whether a count is 0 (serde's `skip_serializing_if`: a FULL/SWA trace's lines carry no
/// slot fields).
fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Op {
    /// The op's name, as in the trace.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Header { .. } => "header",
            Op::AllocExtend { .. } => "alloc_extend",
            Op::AllocDecode { .. } => "alloc_decode",
            Op::AllocSlots { .. } => "alloc_slots",
            Op::FreeSlots { .. } => "free_slots",
            Op::Free { .. } => "free",
            Op::FreeSwa { .. } => "free_swa",
            Op::FreeFull { .. } => "free_full",
            Op::FreeSegment(_) => "free_segment",
            Op::FreeSwaSegment(_) => "free_swa_segment",
            Op::FreeFullSegment(_) => "free_full_segment",
            Op::FreeSegments { .. } => "free_segments",
            Op::FreeSwaSegments { .. } => "free_swa_segments",
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
    pub fn wrap(self, inner: Box<dyn KvAllocator>) -> Hooked<Recorder> {
        Hooked::new(inner, self)
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if let Err(e) = self.out.flush() {
            let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert_with(|| format!("flushing {}: {e}", self.path.display()));
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

/// The trace line of one free: the checked op a [`FreeOp`] is (a batch is recorded as
/// its ops, so `bench-ops` replays the same frees).
fn recorded(op: FreeOp<'_>) -> Op {
    match op {
        FreeOp::Segment(s) => Op::FreeSegment(Seg::of(&s)),
        FreeOp::FullSegment(s) => Op::FreeFullSegment(Seg::of(&s)),
        FreeOp::SwaSegment(s) => Op::FreeSwaSegment(Seg::of(&s)),
        FreeOp::TransferSwa { from, to } => Op::TransferSwa {
            from: Seg::of(&from),
            to: Seg::of(&to),
        },
        FreeOp::KvRow {
            row,
            dead_lo,
            cursor,
            len,
        } => Op::FreeKvRowSegments {
            row: to_runs(&row[..len.min(row.len())]),
            dead_lo,
            cursor,
            len,
        },
        FreeOp::Slots(slots) => Op::FreeSlots {
            slots: slots.iter().map(|s| s.0).collect(),
        },
    }
}

impl Hooks for Recorder {
    fn after(&mut self, _: &dyn KvAllocator, call: Call<'_>, outcome: Outcome<'_>) {
        let (tokens, slots) = match outcome {
            Outcome::Done { tokens, slots } => (tokens, slots),
            // Recorded even when it fails: it flushed deferred frees either way.
            Outcome::Failed(_) if matches!(call, Call::EnsureCapacity(_)) => (&[][..], &[][..]),
            Outcome::Failed(_) => return,
        };
        let op = match call {
            Call::AllocExtend(requests) => Op::AllocExtend {
                requests: extends(requests),
                out: to_runs(tokens),
            },
            Call::AllocDecode(requests) => {
                let ext: Vec<ExtendRequest> = requests.iter().map(|&d| d.into()).collect();
                Op::AllocDecode {
                    requests: extends(&ext),
                    out: to_runs(tokens),
                }
            }
            Call::AllocSlots(n) => Op::AllocSlots {
                n,
                out: slots.iter().map(|s| s.0).collect(),
            },
            Call::FreeIds(IdFree::Both, ids) => Op::Free { ids: to_runs(ids) },
            Call::FreeIds(IdFree::Full, ids) => Op::FreeFull { ids: to_runs(ids) },
            Call::FreeIds(IdFree::Swa, ids) => Op::FreeSwa { ids: to_runs(ids) },
            Call::Free(op) => recorded(op),
            Call::FreeSegments(segments) => Op::FreeSegments {
                segments: segments.iter().map(Seg::of).collect(),
            },
            Call::FreeSwaSegments(segments) => Op::FreeSwaSegments {
                segments: segments.iter().map(Seg::of).collect(),
            },
            // Recorded as the checked ops it is made of, so `bench-ops` replays the same
            // frees.
            Call::FreeBatch(frees) => {
                for &op in frees {
                    self.write(&recorded(op));
                }
                return;
            }
            Call::GroupBegin => Op::GroupBegin,
            Call::GroupEnd => Op::GroupEnd,
            Call::FlushDeferred => Op::FlushDeferred,
            Call::Flush => Op::Flush,
            Call::EnsureCapacity(demand) => Op::EnsureCapacity {
                full_pages: demand.full_pages,
                swa_pages: demand.swa_pages,
                mamba_slots: demand.mamba_slots,
            },
            Call::ReclaimPlan(demand, evictable) => Op::ReclaimPlan {
                full_pages: demand.full_pages,
                swa_pages: demand.swa_pages,
                evictable_full: evictable.full_pages,
                evictable_swa: evictable.swa_pages,
                mamba_slots: demand.mamba_slots,
                evictable_mamba: evictable.mamba_slots,
            },
            Call::UploadMirror => Op::UploadMirror,
        };
        self.write(&op);
    }
}

/// A parsed trace: the header's allocator and the operations.
#[derive(Debug)]
pub struct Trace {
    /// The trace's path (what errors cite).
    pub source_name: String,
    /// The header line.
    pub header: Op,
    /// The header's 1-based line number.
    pub header_line: usize,
    /// Every operation after it, with its 1-based line number.
    pub ops: Vec<(usize, Op)>,
}

/// Reads a trace file, line by line within the limits of [`crate::input`], and checks
/// every operation against the limits of the format ([`check`], [`MAX_OPS`]) before
/// anything runs.
pub fn load(path: &Path) -> Result<Trace, SimError> {
    load_limited(path, MAX_OPS)
}

/// [`load`] with at most `max_ops` operations ([`MAX_OPS`] but in tests).
fn load_limited(path: &Path, max_ops: usize) -> Result<Trace, SimError> {
    let source_name = path.display().to_string();
    let file = File::open(path).map_err(|source| SimError::Io {
        path: source_name.clone(),
        source,
    })?;
    let at = |line, problem| SimError::OpsLine {
        source_name: source_name.clone(),
        line,
        problem,
    };
    // (the header, its page size, its line)
    let mut header: Option<(Op, u32, usize)> = None;
    let mut ops = Vec::new();
    let mut lines = BoundedLines::new(BufReader::new(file));
    while let Some(next) = lines.next_line() {
        let (line, text) = match next {
            Ok(line_and_text) => line_and_text,
            Err((line, LineError::Problem(problem))) => {
                return Err(at(line, OpsProblem::Line(problem)));
            }
            Err((_, LineError::Io(source))) => {
                return Err(SimError::Io {
                    path: source_name.clone(),
                    source,
                });
            }
        };
        if text.trim().is_empty() {
            continue;
        }
        let op: Op = serde_json::from_str(text).map_err(|e| {
            at(
                line,
                OpsProblem::Json {
                    message: crate::input::json_message(&e),
                },
            )
        })?;
        match (&header, op) {
            (None, op @ Op::Header { .. }) => {
                let page_size = check_header(&op).map_err(|p| at(line, p))?;
                header = Some((op, page_size, line));
            }
            (None, _) => return Err(at(line, OpsProblem::NoHeader)),
            (Some(_), Op::Header { .. }) => return Err(at(line, OpsProblem::SecondHeader)),
            (Some((_, page_size, _)), op) => {
                if ops.len() == max_ops {
                    return Err(at(line, OpsProblem::TooManyOps { limit: max_ops }));
                }
                check(&op, *page_size).map_err(|p| at(line, p))?;
                ops.push((line, op));
            }
        }
    }
    let (header, _, header_line) = header.ok_or_else(|| SimError::OpsTrace {
        reason: format!("{source_name}: empty trace"),
    })?;
    Ok(Trace {
        source_name,
        header,
        header_line,
        ops,
    })
}

/// Checks what the replay needs of a header: the schema, a known layout and model, a page
/// size of 1 to 65,536. Returns the page size.
fn check_header(header: &Op) -> Result<u32, OpsProblem> {
    let Op::Header {
        schema,
        layout,
        model,
        page_size,
        ..
    } = header
    else {
        return Err(OpsProblem::NoHeader);
    };
    let wrong = |field, value: &dyn std::fmt::Debug, expected| OpsProblem::Header {
        field,
        value: format!("{value:?}"),
        expected,
    };
    if schema != SCHEMA {
        return Err(wrong("schema", schema, "\"unikv.ops.v1\""));
    }
    if !matches!(layout.as_str(), "static" | "unified") {
        return Err(wrong("layout", layout, "\"static\" or \"unified\""));
    }
    if crate::model_spec::parse_model(model).is_err() {
        return Err(wrong(
            "model",
            model,
            "a --model name or NAME:KEY=VALUE,...",
        ));
    }
    if *page_size == 0 || *page_size > crate::cli::MAX_PAGE_SIZE {
        return Err(wrong("page_size", page_size, "1 to 65,536"));
    }
    Ok(*page_size)
}

/// Checks one operation against the limits of the format before it is replayed: every
/// run ([`run_ids`]), at most [`MAX_OP_IDS`] ids in all, numbers at most
/// [`MAX_OP_NUMBER`], alloc requests that grow (decodes by one token) and an `out` of
/// the size they ask for, and segments that start at a page's first token at a row
/// position that is a multiple of `page_size`. The allocator checks the rest (ids in its
/// id space, live pages) when the operation is replayed.
pub fn check(op: &Op, page_size: u32) -> Result<(), OpsProblem> {
    let number = |field, value: usize| {
        let value = value as u64;
        if value > MAX_OP_NUMBER {
            Err(OpsProblem::NumberTooLarge {
                field,
                value,
                limit: MAX_OP_NUMBER,
            })
        } else {
            Ok(())
        }
    };
    let total = |ids: u64| {
        if ids > MAX_OP_IDS {
            Err(OpsProblem::TooManyIds {
                ids,
                limit: MAX_OP_IDS,
            })
        } else {
            Ok(ids)
        }
    };
    let starts_on_a_page = |runs: &Runs| match runs.first() {
        Some(&[id, _]) if id % page_size != 0 => Err(OpsProblem::StartsMidPage {
            id,
            offset: id % page_size,
            page_size,
        }),
        _ => Ok(()),
    };
    let segment = |seg: &Seg| -> Result<u64, OpsProblem> {
        number("start", seg.start)?;
        let ids = run_ids(&seg.ids)?;
        if !seg.start.is_multiple_of(page_size as usize) {
            return Err(OpsProblem::UnalignedStart {
                start: seg.start,
                page_size,
            });
        }
        starts_on_a_page(&seg.ids)?;
        Ok(ids)
    };
    match op {
        Op::Header { .. } => return Err(OpsProblem::SecondHeader),
        Op::AllocExtend { requests, out } | Op::AllocDecode { requests, out } => {
            let decode = matches!(op, Op::AllocDecode { .. });
            let mut asked: u64 = 0;
            for r in requests {
                number("prefix_len", r.prefix_len)?;
                number("seq_len", r.seq_len)?;
                let grows = if decode {
                    r.seq_len.checked_sub(r.prefix_len) == Some(1)
                } else {
                    r.seq_len >= r.prefix_len
                };
                if !grows {
                    return Err(OpsProblem::BadRequest {
                        prefix_len: r.prefix_len,
                        seq_len: r.seq_len,
                        expected: if decode {
                            "seq_len = prefix_len + 1"
                        } else {
                            "seq_len >= prefix_len"
                        },
                    });
                }
                asked = total(asked + (r.seq_len - r.prefix_len) as u64)?;
            }
            let out = run_ids(out)?;
            if out != asked {
                return Err(OpsProblem::OutCount { out, asked });
            }
        }
        Op::Free { ids } | Op::FreeSwa { ids } | Op::FreeFull { ids } => {
            run_ids(ids)?;
        }
        Op::FreeSegment(seg) | Op::FreeSwaSegment(seg) | Op::FreeFullSegment(seg) => {
            segment(seg)?;
        }
        Op::FreeSegments { segments } | Op::FreeSwaSegments { segments } => {
            let mut ids = 0;
            for seg in segments {
                ids = total(ids + segment(seg)?)?;
            }
        }
        Op::FreeKvRowSegments {
            row,
            dead_lo,
            cursor,
            len,
        } => {
            number("dead_lo", *dead_lo)?;
            number("cursor", *cursor)?;
            number("len", *len)?;
            run_ids(row)?;
            starts_on_a_page(row)?;
        }
        Op::TransferSwa { from, to } => {
            total(segment(from)? + segment(to)?)?;
        }
        Op::EnsureCapacity {
            full_pages,
            swa_pages,
            mamba_slots,
        } => {
            number("full_pages", *full_pages)?;
            number("swa_pages", *swa_pages)?;
            number("mamba_slots", *mamba_slots)?;
        }
        Op::ReclaimPlan {
            full_pages,
            swa_pages,
            evictable_full,
            evictable_swa,
            mamba_slots,
            evictable_mamba,
        } => {
            number("full_pages", *full_pages)?;
            number("swa_pages", *swa_pages)?;
            number("evictable_full", *evictable_full)?;
            number("evictable_swa", *evictable_swa)?;
            number("mamba_slots", *mamba_slots)?;
            number("evictable_mamba", *evictable_mamba)?;
        }
        Op::AllocSlots { n, out } => {
            number("n", *n)?;
            total(out.len() as u64)?;
            if out.len() != *n {
                return Err(OpsProblem::OutCount {
                    out: out.len() as u64,
                    asked: *n as u64,
                });
            }
        }
        Op::FreeSlots { slots } => {
            total(slots.len() as u64)?;
        }
        Op::GroupBegin | Op::GroupEnd | Op::FlushDeferred | Op::Flush | Op::UploadMirror => {}
    }
    Ok(())
}

/// Builds the allocator a header describes, on `device`.
pub fn allocator_for(
    header: &Op,
    device: Arc<dyn unikv::kernels::Device>,
) -> Result<Box<dyn KvAllocator>, SimError> {
    let Op::Header {
        layout,
        model,
        page_size,
        memory_bytes,
        swa_full_ratio,
        ..
    } = header
    else {
        return Err(SimError::OpsTrace {
            reason: "not a header".into(),
        });
    };
    check_header(header).map_err(|problem| SimError::OpsTrace {
        reason: problem.to_string(),
    })?;
    let m = crate::model_spec::parse_model(model).map_err(|e| SimError::OpsTrace {
        reason: e.to_string(),
    })?;
    // The sides the builder gives the model, through the same mappings: each attention
    // kind's rows (`kv_sub_pools`), the state slots (`slot_pool`) and, for the static
    // layout, the fixed slot pool (`static_slot_pool`).
    let (full, swa) = m.kv_sub_pools();
    let swa = (m.swa_layers > 0).then_some(swa);
    let slots = if m.has_recurrent_state() {
        Some(m.slot_pool().map_err(|e| SimError::OpsTrace {
            reason: format!("model {}: its recurrent state: {e}", m.name),
        })?)
    } else {
        None
    };
    let built: Result<Box<dyn KvAllocator>, unikv::pools::Error> = match layout.as_str() {
        "unified" => UnifiedSwa::new(
            device,
            UnifiedSwaConfig {
                total_bytes: *memory_bytes,
                page_size: *page_size,
                window: m.window,
                full,
                swa,
                mamba: slots,
                zero_on_handout: false,
            },
        )
        .map(|a| Box::new(a) as Box<dyn KvAllocator>),
        "static" => slots
            .map(|spec| unikv::static_slot_pool(spec, *memory_bytes))
            .transpose()
            .and_then(|mamba| {
                StaticSwa::new(
                    device,
                    StaticSwaConfig {
                        total_bytes: *memory_bytes,
                        page_size: *page_size,
                        window: m.window,
                        full,
                        swa,
                        mamba,
                        swa_full_ratio: *swa_full_ratio,
                        zero_on_handout: false,
                    },
                )
            })
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
/// The allocator runs on a `backend` device behind a [`SyncLedger`](unikv::kernels::SyncLedger), and the time the device
/// spends executing ops (page moves, uploads: asynchronous launches on a GPU) is taken
/// out of each op's time, so the figures are the allocator's host bookkeeping.
pub fn replay(
    trace: &Trace,
    backend: Backend,
) -> Result<BTreeMap<&'static str, OpThroughput>, SimError> {
    let ledger = backend.ledger();
    let mut alloc = allocator_for(&trace.header, ledger.clone()).map_err(|e| match e {
        // A header the allocator cannot be built from (a budget too small for one
        // window, a ratio out of range): the header's line is the cause.
        SimError::Cache(unikv::Error::Pool(error)) => SimError::OpsLine {
            source_name: trace.source_name.clone(),
            line: trace.header_line,
            problem: OpsProblem::Refused {
                op: "header",
                error,
            },
        },
        other => other,
    })?;
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
    let mut scratch_slots: Vec<VirtualSlot> = Vec::new();
    for (line, op) in &trace.ops {
        let at = |problem| SimError::OpsLine {
            source_name: trace.source_name.clone(),
            line: *line,
            problem,
        };
        let pool = |error| {
            at(OpsProblem::Refused {
                op: op.name(),
                error,
            })
        };
        // Inputs are decoded before the clock starts.
        let tokens: u64;
        let started;
        match op {
            Op::Header { .. } => return Err(at(OpsProblem::SecondHeader)),
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
                // `check` made every request grow: no underflow.
                tokens = reqs.iter().map(|r| (r.seq_len - r.prefix_len) as u64).sum();
                out.clear();
                let decode: Option<Vec<DecodeRequest>> =
                    matches!(op, Op::AllocDecode { .. }).then(|| {
                        reqs.iter()
                            .map(|r| DecodeRequest {
                                prefix_len: r.prefix_len,
                                last_token: r.last_token,
                            })
                            .collect()
                    });
                started = Instant::now();
                match &decode {
                    Some(decode) => alloc.alloc_decode(decode, &mut out),
                    None => alloc.alloc_extend(&reqs, &mut out),
                }
                .map_err(pool)?;
                let nanos = host_nanos(started);
                if to_runs(&out) != *expected {
                    return Err(at(OpsProblem::Diverged { op: op.name() }));
                }
                add(&mut by_kind, op.name(), tokens, nanos);
                continue;
            }
            Op::Free { ids } | Op::FreeSwa { ids } | Op::FreeFull { ids } => {
                let ids = from_runs(ids).map_err(at)?;
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
                let ids = from_runs(&seg.ids).map_err(at)?;
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
            Op::FreeSegments { segments } | Op::FreeSwaSegments { segments } => {
                let ids = segments
                    .iter()
                    .map(|s| from_runs(&s.ids))
                    .collect::<Result<Vec<Vec<VirtualToken>>, OpsProblem>>()
                    .map_err(at)?;
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
                if matches!(op, Op::FreeSegments { .. }) {
                    alloc.free_segments(&segs)
                } else {
                    alloc.free_swa_segments(&segs)
                }
                .map_err(pool)?;
            }
            Op::FreeKvRowSegments {
                row,
                dead_lo,
                cursor,
                len,
            } => {
                let row = from_runs(row).map_err(at)?;
                tokens = (len - dead_lo.min(len)) as u64;
                started = Instant::now();
                alloc
                    .free_kv_row_segments(&row, *dead_lo, *cursor, *len)
                    .map_err(pool)?;
            }
            Op::TransferSwa { from, to } => {
                let (f, t) = (
                    from_runs(&from.ids).map_err(at)?,
                    from_runs(&to.ids).map_err(at)?,
                );
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
                mamba_slots,
            } => {
                tokens = 0;
                started = Instant::now();
                // It may fail as it did when recorded; its effect (a flush) is what matters.
                let _ = alloc.ensure_capacity(PageDemand {
                    full_pages: *full_pages,
                    swa_pages: *swa_pages,
                    mamba_slots: *mamba_slots,
                });
            }
            Op::ReclaimPlan {
                full_pages,
                swa_pages,
                evictable_full,
                evictable_swa,
                mamba_slots,
                evictable_mamba,
            } => {
                tokens = 0;
                started = Instant::now();
                alloc.reclaim_plan(
                    PageDemand {
                        full_pages: *full_pages,
                        swa_pages: *swa_pages,
                        mamba_slots: *mamba_slots,
                    },
                    Reclaimable {
                        full_pages: *evictable_full,
                        swa_pages: *evictable_swa,
                        mamba_slots: *evictable_mamba,
                    },
                );
            }
            Op::AllocSlots { n, out: expected } => {
                scratch_slots.clear();
                started = Instant::now();
                alloc.alloc_slots(*n, &mut scratch_slots).map_err(pool)?;
                let nanos = host_nanos(started);
                // Slots are handed out deterministically too.
                if !scratch_slots
                    .iter()
                    .map(|s| s.0)
                    .eq(expected.iter().copied())
                {
                    return Err(at(OpsProblem::Diverged { op: op.name() }));
                }
                add(&mut by_kind, op.name(), 0, nanos);
                continue;
            }
            Op::FreeSlots { slots } => {
                tokens = 0;
                let slots: Vec<VirtualSlot> = slots.iter().map(|&s| VirtualSlot(s)).collect();
                started = Instant::now();
                alloc.free_slots(&slots).map_err(pool)?;
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
        assert_eq!(from_runs(&runs).unwrap(), ids);
        assert_eq!(runs.iter().map(|r| r[1]).sum::<u32>(), 7);
        assert!(to_runs(&[]).is_empty());
    }

    /// The problem `check` finds in `line` at page size 4, as text.
    fn problem(line: &str) -> Option<String> {
        let op: Op = serde_json::from_str(line).unwrap();
        check(&op, 4).err().map(|p| p.to_string())
    }

    #[test]
    fn runs_are_bounded_before_they_are_decoded() {
        // 4 G ids in one run: refused by counting, never expanded.
        assert!(matches!(
            from_runs(&[[0, u32::MAX]]),
            Err(OpsProblem::TooManyIds {
                ids: 4_294_967_295,
                limit: MAX_OP_IDS
            })
        ));
        // Many runs that only add up to too many.
        let half = (MAX_OP_IDS / 2) as u32;
        assert!(run_ids(&[[0, half], [0, half]]).is_ok());
        assert!(matches!(
            run_ids(&[[0, half], [0, half], [0, 1]]),
            Err(OpsProblem::TooManyIds { .. })
        ));
        assert!(matches!(
            from_runs(&[[u32::MAX, 2]]),
            Err(OpsProblem::RunPastLastId {
                first: u32::MAX,
                count: 2
            })
        ));
        assert_eq!(
            from_runs(&[[u32::MAX, 1]]).unwrap(),
            [VirtualToken(u32::MAX)]
        );
        assert!(matches!(
            from_runs(&[[3, 0]]),
            Err(OpsProblem::EmptyRun { first: 3 })
        ));
    }

    #[test]
    fn check_names_the_right_cause() {
        let cases: [(&str, Option<&str>); 17] = [
            (r#"{"op":"free_segment","start":8,"ids":[[8,4]]}"#, None),
            (
                r#"{"op":"free","ids":[[0,4294967295]]}"#,
                Some("the operation names 4294967295 ids, more than 16777216"),
            ),
            // Ids that start mid-page, at an aligned row position: the ids are the cause.
            (
                r#"{"op":"free_segment","start":8,"ids":[[9,3]]}"#,
                Some("the ids start mid-page: id 9 is token 1 of its page (page size 4)"),
            ),
            (
                r#"{"op":"free_swa_segment","start":0,"ids":[[6,2]]}"#,
                Some("the ids start mid-page: id 6 is token 2"),
            ),
            // An unaligned row position with page-aligned ids: the position is the cause.
            (
                r#"{"op":"free_full_segment","start":6,"ids":[[8,2]]}"#,
                Some("segment row position 6 is not a multiple of the page size 4"),
            ),
            (
                r#"{"op":"free_segments","segments":[{"start":0,"ids":[[4,4]]},{"start":4,"ids":[[13,3]]}]}"#,
                Some("the ids start mid-page: id 13 is token 1"),
            ),
            (
                r#"{"op":"free_swa_segments","segments":[{"start":0,"ids":[[4,4]]},{"start":4,"ids":[[13,3]]}]}"#,
                Some("the ids start mid-page: id 13 is token 1"),
            ),
            (
                r#"{"op":"transfer_swa","from":{"start":0,"ids":[[4,4]]},"to":{"start":0,"ids":[[2,4]]}}"#,
                Some("the ids start mid-page: id 2"),
            ),
            (
                r#"{"op":"free_kv_row_segments","row":[[5,3]],"dead_lo":0,"cursor":0,"len":3}"#,
                Some("the ids start mid-page: id 5 is token 1"),
            ),
            (
                r#"{"op":"free_kv_row_segments","row":[[4,3]],"dead_lo":0,"cursor":0,"len":18446744073709551615}"#,
                Some("len is 18446744073709551615, more than 4294967296"),
            ),
            (
                r#"{"op":"alloc_extend","requests":[{"prefix_len":8,"seq_len":4,"last_token":null}],"out":[]}"#,
                Some("a request with prefix_len 8 and seq_len 4: expected seq_len >= prefix_len"),
            ),
            (
                r#"{"op":"alloc_decode","requests":[{"prefix_len":8,"seq_len":10,"last_token":7}],"out":[[12,2]]}"#,
                Some(
                    "a request with prefix_len 8 and seq_len 10: expected seq_len = prefix_len + 1",
                ),
            ),
            (
                r#"{"op":"alloc_extend","requests":[{"prefix_len":0,"seq_len":8,"last_token":null}],"out":[[4,7]]}"#,
                Some("out names 7 ids but the requests ask for 8"),
            ),
            (
                r#"{"op":"alloc_extend","requests":[{"prefix_len":0,"seq_len":16777216,"last_token":null},{"prefix_len":0,"seq_len":1,"last_token":null}],"out":[[4,7]]}"#,
                Some("the operation names 16777217 ids"),
            ),
            (
                r#"{"op":"ensure_capacity","full_pages":4294967297,"swa_pages":0}"#,
                Some("full_pages is 4294967297, more than 4294967296"),
            ),
            (
                r#"{"op":"free","ids":[[0,1],[7,0]]}"#,
                Some("the run [7, 0] names no id"),
            ),
            (
                r#"{"op":"free_full","ids":[[4294967295,2]]}"#,
                Some("the run [4294967295, 2] goes past the largest id 4294967295"),
            ),
        ];
        for (line, expected) in cases {
            let got = problem(line);
            match (&got, expected) {
                (None, None) => {}
                (Some(got), Some(expected)) => assert!(got.starts_with(expected), "{line}: {got}"),
                _ => panic!("{line}: got {got:?}, expected {expected:?}"),
            }
        }
    }

    /// Writes `lines` after a unified gpt-oss-20b header at page size 4 and loads the file
    /// with at most `max_ops` operations.
    fn load_lines(name: &str, lines: &[&str], max_ops: usize) -> Result<Trace, SimError> {
        let header = serde_json::to_string(&Op::Header {
            schema: SCHEMA.into(),
            layout: "unified".into(),
            model: "gpt-oss-20b".into(),
            page_size: 4,
            memory_bytes: 1 << 30,
            swa_full_ratio: 0.8,
        })
        .unwrap();
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-{name}", std::process::id()));
        let text: String = std::iter::once(header.as_str())
            .chain(lines.iter().copied())
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
        let loaded = load_limited(&path, max_ops);
        let _ = std::fs::remove_file(&path);
        loaded
    }

    /// The line and message of a load error.
    fn line_and_message(err: &SimError) -> (usize, String) {
        match err {
            SimError::OpsLine { line, problem, .. } => (*line, problem.to_string()),
            other => panic!("expected an ops line error, got {other:?}"),
        }
    }

    #[test]
    fn slot_ops_parse_and_a_page_trace_carries_no_slot_fields() {
        assert_eq!(problem(r#"{"op":"alloc_slots","n":1,"out":[3]}"#), None);
        assert_eq!(problem(r#"{"op":"free_slots","slots":[3]}"#), None);
        assert!(problem(r#"{"op":"alloc_slots","n":2,"out":[3]}"#).is_some());
        // Lines written before the slot fields existed parse, with 0 slots...
        let line = r#"{"op":"ensure_capacity","full_pages":1,"swa_pages":2}"#;
        let op: Op = serde_json::from_str(line).unwrap();
        assert_eq!(
            op,
            Op::EnsureCapacity {
                full_pages: 1,
                swa_pages: 2,
                mamba_slots: 0
            }
        );
        // ...and a FULL/SWA trace is written exactly as before.
        assert_eq!(serde_json::to_string(&op).unwrap(), line);
        let op = recorded(FreeOp::Slots(&[VirtualSlot(3)]));
        assert_eq!(op, Op::FreeSlots { slots: vec![3] });
    }

    #[test]
    fn load_reports_each_problem_on_its_line() {
        let flush = r#"{"op":"flush"}"#;
        let trace = load_lines("ok", &[flush, "", flush], 2).unwrap();
        assert_eq!(
            trace.ops.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            [2, 4]
        );
        let err = load_lines("many", &[flush, flush, flush], 2).unwrap_err();
        assert_eq!(
            line_and_message(&err),
            (
                4,
                "the trace holds more than 2 operations (the limit of an ops trace)".into()
            )
        );
        let err =
            load_lines("4g", &[flush, r#"{"op":"free","ids":[[0,4294967295]]}"#], 9).unwrap_err();
        assert_eq!(line_and_message(&err).0, 3);
        assert!(err.to_string().contains("more than 16777216"), "{err}");
        let err = load_lines("second", &[flush, &flush.replace("flush", "nope")], 9).unwrap_err();
        let (line, message) = line_and_message(&err);
        assert_eq!(line, 3);
        assert!(
            message.starts_with("not an operation: unknown variant `nope`")
                && message.ends_with("(column 12)"),
            "{message}"
        );
    }

    #[test]
    fn a_header_must_come_first_and_name_what_the_replay_can_build() {
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-headers", std::process::id()));
        let check_file = |text: &str| {
            std::fs::write(&path, text).unwrap();
            load(&path).map(drop).map_err(|e| line_and_message(&e))
        };
        let header = r#"{"op":"header","schema":"unikv.ops.v1","layout":"unified","model":"gpt-oss-20b","page_size":4,"memory_bytes":1073741824,"swa_full_ratio":0.8}"#;
        assert!(check_file(header).is_ok());
        // Every named model, recurrent ones included, on both layouts.
        for model in unikv::ModelSpec::NAMED {
            for layout in ["unified", "static"] {
                let named = header
                    .replace("gpt-oss-20b", model.name)
                    .replace("\"unified\"", &format!("{layout:?}"));
                assert!(check_file(&named).is_ok(), "{named}");
            }
        }
        assert_eq!(
            check_file(&format!("\n{{\"op\":\"flush\"}}\n{header}")),
            Err((2, "the first line must be the header".into()))
        );
        assert_eq!(
            check_file(&format!("{header}\n{header}")),
            Err((2, "a second header".into()))
        );
        for (from, to, message) in [
            ("unikv.ops.v1", "v0", "header field schema is \"v0\""),
            (
                "\"unified\"",
                "\"paged\"",
                "header field layout is \"paged\"",
            ),
            ("gpt-oss-20b", "llama", "header field model is \"llama\""),
            (
                "\"page_size\":4",
                "\"page_size\":0",
                "header field page_size is 0",
            ),
            (
                "\"page_size\":4",
                "\"page_size\":65537",
                "header field page_size is 65537",
            ),
        ] {
            let got = check_file(&header.replace(from, to)).unwrap_err();
            assert_eq!(got.0, 1);
            assert!(got.1.starts_with(message), "{}", got.1);
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_header_the_allocator_refuses_is_reported_on_its_line() {
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-tiny", std::process::id()));
        let header = r#"{"op":"header","schema":"unikv.ops.v1","layout":"unified","model":"gpt-oss-20b","page_size":4,"memory_bytes":0,"swa_full_ratio":0.8}"#;
        std::fs::write(&path, format!("\n{header}\n")).unwrap();
        let trace = load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let (line, message) = line_and_message(&replay(&trace, Backend::Cpu).unwrap_err());
        assert_eq!(line, 2);
        assert!(
            message.starts_with("header: the allocator refused it: buffer of 0 B"),
            "{message}"
        );
    }

    #[test]
    fn an_op_the_allocator_refuses_is_reported_on_its_line() {
        // Well-formed, but the ids were never handed out.
        let trace = load_lines(
            "refused",
            &[
                r#"{"op":"group_begin"}"#,
                r#"{"op":"free_segment","start":0,"ids":[[4000000000,4]]}"#,
            ],
            9,
        )
        .unwrap();
        let err = replay(&trace, Backend::Cpu).unwrap_err();
        let (line, message) = line_and_message(&err);
        assert_eq!(line, 3);
        assert!(
            message.starts_with("free_segment: the allocator refused it"),
            "{message}"
        );
        assert_eq!(err.to_string().lines().count(), 1);
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
