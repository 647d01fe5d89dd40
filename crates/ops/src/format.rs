//! The ops trace format: one JSON object per line ([`Op`]), a header first, lists of
//! virtual token ids as runs `[first, count]` of consecutive ids (a page's tokens are
//! consecutive, so a row at page size 256 is a few runs), and the limits every line is
//! checked against before it is replayed ([`check`]). `docs/ops-trace.md` documents it.

use crate::error::OpsProblem;
use serde::{Deserialize, Serialize};
use unikv::pools::{Segment, VirtualToken};
use unikv::{Draft, MAX_VERIFY_WIDTH};
use unikv_workload::units::MAX_PAGE_SIZE;

/// The schema name in the header line of a run without speculation (a trace written as
/// before speculative operations existed).
pub const SCHEMA: &str = "unikv.ops.v1";

/// The schema name in the header line of a speculative run's trace: `unikv.ops.v1` with
/// the `verify` and `settle` lines. A loader reads both; `verify` and `settle` in a v1
/// trace are an error.
pub const SCHEMA_V2: &str = "unikv.ops.v2";

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
    pub(crate) fn of(s: &Segment<'_>) -> Seg {
        Seg {
            start: s.start,
            ids: to_runs(s.tokens),
        }
    }
}

/// One request's draft in a `verify` line: `{"k": K}` (a chain of `K` drafts, `1 + K`
/// positions) or `{"parents": [-1, 0, ...]}` (a tree, one parent per node).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DraftLine {
    /// A chain.
    Chain {
        /// Drafted tokens.
        k: usize,
    },
    /// A tree.
    Tree {
        /// Each node's parent (`-1` for the root).
        parents: Vec<i32>,
    },
}

impl DraftLine {
    /// The line of `draft`.
    pub fn of(draft: &unikv::Draft<'_>) -> DraftLine {
        match draft {
            unikv::Draft::Chain { k } => DraftLine::Chain { k: *k },
            unikv::Draft::Tree { parents } => DraftLine::Tree {
                parents: parents.to_vec(),
            },
        }
    }

    /// Positions it verifies.
    pub fn width(&self) -> usize {
        match self {
            DraftLine::Chain { k } => k.saturating_add(1),
            DraftLine::Tree { parents } => parents.len(),
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
        /// State slots the static layout adds to its reference slot pool for verify
        /// scratch (`unikv::verify_scratch_slots` of the run's speculation; absent: 0).
        #[serde(default, skip_serializing_if = "no_slots")]
        scratch_slots: u32,
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
    /// A verify step of one batch (`HybridCache::alloc_verify`), written after the
    /// allocator calls it made: they are the `ops` lines before it (schema v2).
    Verify {
        /// Each request's draft.
        drafts: Vec<DraftLine>,
        /// Allocator lines the call wrote, right before this one.
        ops: usize,
    },
    /// The settlement of one verify step of each request of a batch
    /// (`HybridCache::settle`), written after the allocator calls it made: the `ops`
    /// lines before it (schema v2).
    Settle {
        /// Positions each request accepted.
        accepted: Vec<usize>,
        /// A tree verify's accepted root-to-node paths (absent for chains).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        paths: Option<Vec<Vec<u32>>>,
        /// Allocator lines the call wrote, right before this one.
        ops: usize,
    },
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
            Op::Verify { .. } => "verify",
            Op::Settle { .. } => "settle",
        }
    }

    /// Whether it is a speculative line (`verify`, `settle`): a span over the
    /// allocator lines before it, not an allocator call.
    pub fn is_speculative(&self) -> bool {
        matches!(self, Op::Verify { .. } | Op::Settle { .. })
    }
}

/// Whether a header's optional slot count is absent (0).
fn no_slots(n: &u32) -> bool {
    *n == 0
}

/// Checks what the replay needs of a header: the schema, a known layout and model, a page
/// size of 1 to 65,536. Returns the page size.
pub(crate) fn check_header(header: &Op) -> Result<u32, OpsProblem> {
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
    if schema != SCHEMA && schema != SCHEMA_V2 {
        return Err(wrong(
            "schema",
            schema,
            "\"unikv.ops.v1\" or \"unikv.ops.v2\"",
        ));
    }
    if !matches!(layout.as_str(), "static" | "unified") {
        return Err(wrong("layout", layout, "\"static\" or \"unified\""));
    }
    if unikv_workload::model::parse_model(model).is_err() {
        return Err(wrong(
            "model",
            model,
            "a --model name or NAME:KEY=VALUE,...",
        ));
    }
    if *page_size == 0 || *page_size > MAX_PAGE_SIZE {
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
        Op::Verify { drafts, ops } => {
            number("ops", *ops)?;
            let bad = |index, reason: String| OpsProblem::BadSpeculative {
                op: "verify",
                index,
                reason,
            };
            let mut positions = 0;
            for (index, draft) in drafts.iter().enumerate() {
                let width = draft.width();
                if !(1..=MAX_VERIFY_WIDTH as usize).contains(&width) {
                    return Err(bad(
                        index,
                        format!("a draft of {width} positions (1 to {MAX_VERIFY_WIDTH})"),
                    ));
                }
                if let DraftLine::Tree { parents } = draft
                    && let Some((node, parent)) = (Draft::Tree { parents }).bad_parent()
                {
                    return Err(bad(
                        index,
                        format!(
                            "node {node}'s parent is {parent} (the root's is -1, every other \
                             node's an earlier node)"
                        ),
                    ));
                }
                positions = total(positions + width as u64)?;
            }
        }
        Op::Settle {
            accepted,
            paths,
            ops,
        } => {
            number("ops", *ops)?;
            total(accepted.len() as u64)?;
            let bad = |index, reason: String| OpsProblem::BadSpeculative {
                op: "settle",
                index,
                reason,
            };
            for (index, &count) in accepted.iter().enumerate() {
                if !(1..=MAX_VERIFY_WIDTH as usize).contains(&count) {
                    return Err(bad(
                        index,
                        format!("{count} positions accepted (1 to {MAX_VERIFY_WIDTH})"),
                    ));
                }
            }
            if let Some(paths) = paths {
                if paths.len() != accepted.len() {
                    return Err(bad(
                        paths.len().min(accepted.len()),
                        format!("{} paths for {} requests", paths.len(), accepted.len()),
                    ));
                }
                for (index, (path, &count)) in paths.iter().zip(accepted).enumerate() {
                    if path.len() != count || path.first() != Some(&0) {
                        return Err(bad(
                            index,
                            format!(
                                "a path of {} nodes for {count} accepted positions (it \
                                 starts at node 0 and has one node per position)",
                                path.len()
                            ),
                        ));
                    }
                }
            }
        }
    }
    Ok(())
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
    }

    #[test]
    fn speculative_lines_parse_and_check_their_drafts_and_counts() {
        let verify = r#"{"op":"verify","drafts":[{"k":4},{"parents":[-1,0,0,1]}],"ops":2}"#;
        let op: Op = serde_json::from_str(verify).unwrap();
        assert_eq!(
            op,
            Op::Verify {
                drafts: vec![
                    DraftLine::Chain { k: 4 },
                    DraftLine::Tree {
                        parents: vec![-1, 0, 0, 1]
                    }
                ],
                ops: 2
            }
        );
        assert_eq!(serde_json::to_string(&op).unwrap(), verify, "round trip");
        assert!(op.is_speculative() && op.name() == "verify");
        assert_eq!(problem(verify), None);
        let chain_settle = r#"{"op":"settle","accepted":[3,1],"ops":1}"#;
        let op: Op = serde_json::from_str(chain_settle).unwrap();
        assert_eq!(serde_json::to_string(&op).unwrap(), chain_settle);
        assert_eq!(problem(chain_settle), None);
        assert_eq!(
            problem(r#"{"op":"settle","accepted":[3],"paths":[[0,2,5]],"ops":0}"#),
            None
        );
        for (line, expected) in [
            (
                r#"{"op":"verify","drafts":[{"k":64}],"ops":1}"#,
                "verify: entry 0: a draft of 65 positions (1 to 64)",
            ),
            (
                r#"{"op":"verify","drafts":[{"k":1},{"parents":[-1,0,2]}],"ops":1}"#,
                "verify: entry 1: node 2's parent is 2",
            ),
            (
                r#"{"op":"verify","drafts":[{"parents":[0]}],"ops":1}"#,
                "verify: entry 0: node 0's parent is 0",
            ),
            (
                r#"{"op":"settle","accepted":[2,0],"ops":1}"#,
                "settle: entry 1: 0 positions accepted (1 to 64)",
            ),
            (
                r#"{"op":"settle","accepted":[2],"paths":[[0,1],[0]],"ops":1}"#,
                "settle: entry 1: 2 paths for 1 requests",
            ),
            (
                r#"{"op":"settle","accepted":[2],"paths":[[0]],"ops":1}"#,
                "settle: entry 0: a path of 1 nodes for 2 accepted positions",
            ),
            (
                r#"{"op":"settle","accepted":[2],"paths":[[1,3]],"ops":1}"#,
                "settle: entry 0: a path of 2 nodes for 2 accepted positions (it starts at node 0",
            ),
            (
                r#"{"op":"settle","accepted":[1],"ops":4294967297}"#,
                "ops is 4294967297",
            ),
        ] {
            let got = problem(line).unwrap_or_else(|| panic!("{line}: accepted"));
            assert!(got.starts_with(expected), "{line}: {got}");
        }
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
