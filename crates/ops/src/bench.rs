//! The bench replay: `unikv bench-ops FILE` replays a loaded trace against a fresh
//! allocator, built from the header through the cache builder's own mappings, and times
//! every operation.
//!
//! Before any timed pass, [`check`] replays the trace once at invariant level strict,
//! polling the allocator's invariants after every line: an operation the allocator
//! contains instead of refusing (a double free, a free of the sink page or of a page
//! never allocated: the allocator skips it and records a breach, so a timed pass at
//! level off would go on and report a number) is the trace's typed error on its line.

use crate::error::{OpsError, OpsProblem};
use crate::format::{Op, check_header, from_runs, to_runs};
use crate::load::Trace;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;
use unikv::invariants::{FailMode, Level, scoped_level};
use unikv::kernels::SyncLedger;
use unikv::pools::{
    DecodeRequest, ExtendRequest, KvAllocator, PageDemand, Reclaimable, Segment, StaticSwa,
    StaticSwaConfig, UnifiedSwa, UnifiedSwaConfig, VirtualSlot, VirtualToken,
};

/// Builds the allocator a header describes, on `device`.
pub fn allocator_for(
    header: &Op,
    device: Arc<dyn unikv::kernels::Device>,
) -> Result<Box<dyn KvAllocator>, OpsError> {
    let Op::Header {
        layout,
        model,
        page_size,
        memory_bytes,
        swa_full_ratio,
        scratch_slots,
        ..
    } = header
    else {
        return Err(OpsError::OpsTrace {
            reason: "not a header".into(),
        });
    };
    check_header(header).map_err(|problem| OpsError::OpsTrace {
        reason: problem.to_string(),
    })?;
    let m = unikv_workload::model::parse_model(model).map_err(|e| OpsError::OpsTrace {
        reason: e.to_string(),
    })?;
    // The sides the builder gives the model, through the same mappings: each attention
    // kind's rows (`kv_sub_pools`), the state slots (`slot_pool`) and, for the static
    // layout, the fixed slot pool (`static_slot_pool`, plus the verify scratch the
    // header names).
    let (full, swa) = m.kv_sub_pools();
    let swa = (m.swa_layers > 0).then_some(swa);
    let slots = if m.has_recurrent_state() {
        Some(m.slot_pool().map_err(|e| OpsError::OpsTrace {
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
            .map(|spec| {
                unikv::static_slot_pool(spec, *memory_bytes).map(|pool| unikv::pools::StaticSlots {
                    slots: pool.slots + scratch_slots,
                    ..pool
                })
            })
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
            return Err(OpsError::OpsTrace {
                reason: format!("unknown layout {other:?}"),
            });
        }
    };
    built.map_err(|e| OpsError::Cache(e.into()))
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
/// per op kind (plus `all`). A speculative trace's `verify` and `settle` lines are
/// counted as kinds of their own, each with the time of the allocator lines it claims
/// (its call's, also counted under their own kinds, so not again in `all`) and the
/// positions it verified or accepted as its tokens; a `verify` must claim the
/// `alloc_extend` of its drafts. The ids each alloc returns are checked against the trace, so
/// a replay that diverged is an error, not a number.
///
/// The allocator runs on the device behind `ledger` (a fresh one per replay), and the
/// time the device spends executing ops (page moves, uploads: asynchronous launches on a
/// GPU) is taken out of each op's time, so the figures are the allocator's host
/// bookkeeping.
pub fn replay(
    trace: &Trace,
    ledger: Arc<SyncLedger>,
) -> Result<BTreeMap<&'static str, OpThroughput>, OpsError> {
    replay_lines(trace, ledger, false)
}

/// The schema name of `unikv bench-ops --json`'s object.
pub const SCHEMA: &str = "unikv.bench-ops.v1";

/// Replays `trace` once, untimed, at invariant level strict, and polls the
/// allocator's invariants after every line: the first line whose operation broke one
/// (a double free, a free of the sink page, a free of a page never allocated: breaches
/// the allocator contains rather than refuses) is
/// [`OpsProblem::Breach`] on that line. Every error
/// [`replay`] gives is found here too.
pub fn check(trace: &Trace, ledger: Arc<SyncLedger>) -> Result<(), OpsError> {
    scoped_level(Level::Strict, || replay_lines(trace, ledger, true)).map(drop)
}

/// [`replay`], and with `checked` [`check`]'s poll after every line.
fn replay_lines(
    trace: &Trace,
    ledger: Arc<SyncLedger>,
    checked: bool,
) -> Result<BTreeMap<&'static str, OpThroughput>, OpsError> {
    let mut alloc = allocator_for(&trace.header, ledger.clone()).map_err(|e| match e {
        // A header the allocator cannot be built from (a budget too small for one
        // window, a ratio out of range): the header's line is the cause.
        OpsError::Cache(unikv::Error::Pool(error)) => OpsError::OpsLine {
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
    // The allocator lines since the last `verify` or `settle` line: each one's time and,
    // for an `alloc_extend`, how much each of its requests grew.
    let mut span: Vec<(u64, Option<Vec<usize>>)> = Vec::new();
    let mut out = Vec::new();
    let mut scratch_slots: Vec<VirtualSlot> = Vec::new();
    if checked {
        alloc.invariant_scope().set_fail_mode(FailMode::Error);
    }
    // The line before the current one: a breach found by the poll at the top of an
    // iteration (or after the loop) is that line's.
    let mut previous: Option<(usize, &'static str)> = None;
    let poll = |alloc: &dyn KvAllocator, previous: Option<(usize, &'static str)>| match (
        alloc.invariant_scope().poll(),
        previous,
    ) {
        (Ok(()), _) | (Err(_), None) => Ok(()),
        (Err(error), Some((line, op))) => Err(OpsError::OpsLine {
            source_name: trace.source_name.clone(),
            line,
            problem: OpsProblem::Breach { op, error },
        }),
    };
    for (line, op) in &trace.ops {
        if checked {
            poll(&*alloc, previous)?;
            previous = Some((*line, op.name()));
        }
        let at = |problem| OpsError::OpsLine {
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
            Op::Verify { ops, .. } | Op::Settle { ops, .. } => {
                let bad_span = |reason| {
                    at(OpsProblem::BadSpan {
                        op: op.name(),
                        reason,
                    })
                };
                if *ops > span.len() {
                    return Err(bad_span(format!(
                        "it claims the {ops} allocator lines before it, but only {} came \
                         after the last verify or settle",
                        span.len()
                    )));
                }
                let own = &span[span.len() - ops..];
                let nanos = own.iter().map(|(nanos, _)| nanos).sum();
                let positions = match op {
                    Op::Verify { drafts, .. } => {
                        // Its rows: one alloc_extend growing each request by its draft.
                        let widths: Vec<usize> = drafts.iter().map(|d| d.width()).collect();
                        if !own.iter().any(|(_, grew)| grew.as_ref() == Some(&widths)) {
                            return Err(bad_span(format!(
                                "none of its {ops} allocator lines is an alloc_extend of its \
                                 drafts' {} positions",
                                widths.iter().sum::<usize>()
                            )));
                        }
                        widths.iter().sum::<usize>() as u64
                    }
                    Op::Settle { accepted, .. } => accepted.iter().sum::<usize>() as u64,
                    _ => 0,
                };
                add(&mut by_kind, op.name(), positions, nanos);
                span.clear();
                continue;
            }
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
                let grew = reqs.iter().map(|r| r.seq_len - r.prefix_len).collect();
                span.push((nanos, decode.is_none().then_some(grew)));
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
                span.push((nanos, None));
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
        let nanos = host_nanos(started);
        add(&mut by_kind, op.name(), tokens, nanos);
        span.push((nanos, None));
    }
    if checked {
        poll(&*alloc, previous)?;
    }
    // `verify` and `settle` are spans over the allocator calls counted above.
    let all = by_kind
        .iter()
        .filter(|(name, _)| !matches!(**name, "verify" | "settle"))
        .map(|(_, t)| t)
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
    use crate::load::load;
    use crate::load::tests::{line_and_message, load_lines, load_lines_of};

    /// A CPU device behind a fresh ledger.
    fn cpu() -> Arc<SyncLedger> {
        Arc::new(SyncLedger::new(Arc::new(unikv::kernels::CpuDevice::new())))
    }

    /// A span line claims the allocator lines before it: more than came since the last
    /// span is an error on its line, as is a verify without the alloc_extend of its
    /// drafts; one that claims its alloc_extend is timed as a verify.
    #[test]
    fn a_verify_is_timed_over_the_lines_it_claims() {
        let v2 = |trace: Result<Trace, OpsError>| trace.unwrap();
        let alloc = r#"{"op":"alloc_extend","requests":[{"prefix_len":0,"seq_len":8,"last_token":null}],"out":[[4,8]]}"#;
        let grow = r#"{"op":"alloc_extend","requests":[{"prefix_len":8,"seq_len":13,"last_token":11}],"out":[[12,5]]}"#;
        let verify = r#"{"op":"verify","drafts":[{"k":4}],"ops":1}"#;
        let trace = v2(load_lines_of(
            crate::format::SCHEMA_V2,
            "verify-ok",
            &[alloc, grow, verify],
            9,
        ));
        let by_kind = replay(&trace, cpu()).unwrap();
        assert_eq!((by_kind["verify"].calls, by_kind["verify"].tokens), (1, 5));
        assert_eq!(
            by_kind["all"].calls, 2,
            "a span is not counted again in all"
        );
        let trace = v2(load_lines_of(
            crate::format::SCHEMA_V2,
            "verify-long",
            &[
                alloc,
                r#"{"op":"settle","accepted":[1],"ops":0}"#,
                grow,
                r#"{"op":"verify","drafts":[{"k":4}],"ops":2}"#,
            ],
            9,
        ));
        let (line, message) = line_and_message(&replay(&trace, cpu()).unwrap_err());
        assert_eq!(line, 5);
        assert!(
            message.starts_with("verify: it claims the 2 allocator lines before it, but only 1"),
            "{message}"
        );
        let trace = v2(load_lines_of(
            crate::format::SCHEMA_V2,
            "verify-other",
            &[alloc, grow, r#"{"op":"verify","drafts":[{"k":3}],"ops":1}"#],
            9,
        ));
        let (line, message) = line_and_message(&replay(&trace, cpu()).unwrap_err());
        assert_eq!(line, 4);
        assert!(
            message.contains(
                "none of its 1 allocator lines is an alloc_extend of its drafts' 4 positions"
            ),
            "{message}"
        );
    }

    #[test]
    fn a_header_the_allocator_refuses_is_reported_on_its_line() {
        let path = std::env::temp_dir().join(format!("unikv-sim-{}-tiny", std::process::id()));
        let header = r#"{"op":"header","schema":"unikv.ops.v1","layout":"unified","model":"gpt-oss-20b","page_size":4,"memory_bytes":0,"swa_full_ratio":0.8}"#;
        std::fs::write(&path, format!("\n{header}\n")).unwrap();
        let trace = load(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let (line, message) = line_and_message(&replay(&trace, cpu()).unwrap_err());
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
        let err = replay(&trace, cpu()).unwrap_err();
        let (line, message) = line_and_message(&err);
        assert_eq!(line, 3);
        assert!(
            message.starts_with("free_segment: the allocator refused it"),
            "{message}"
        );
        assert_eq!(err.to_string().lines().count(), 1);
    }
}
