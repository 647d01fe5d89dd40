//! The recorder: `unikv replay --record-ops FILE` writes every operation the run made on
//! its allocator through a [`Recorder`], the [`Hooks`] of a `Hooked` allocator around the
//! cache's own, and a speculative run's verify and settle calls through its [`Marks`],
//! into the same file.

use crate::error::OpsError;
use crate::format::{DraftLine, Extend, Op, Seg, to_runs};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use unikv::pools::{Call, ExtendRequest, FreeOp, Hooks, IdFree, KvAllocator, Outcome};

/// Writes a trace: the [`Hooks`] of a `Hooked` allocator, it writes every mutating call.
#[derive(Debug)]
pub struct Recorder {
    sink: Arc<Mutex<Sink>>,
}

/// The trace file, shared by the recorder and its [`Marks`]: flushed when the last of
/// them is dropped.
#[derive(Debug)]
struct Sink {
    out: BufWriter<File>,
    path: PathBuf,
    error: Arc<Mutex<Option<String>>>,
    /// Operation lines written (the header not counted).
    lines: usize,
}

/// Writes a speculative run's `verify` and `settle` lines into a [`Recorder`]'s trace,
/// each after the allocator lines its call wrote ([`Recorder::marks`]).
#[derive(Debug)]
pub struct Marks {
    sink: Arc<Mutex<Sink>>,
    /// The trace's line count when the call began.
    begun_at: usize,
}

impl Marks {
    /// A verify or settle call begins: the allocator lines from here on are its own.
    pub fn begin(&mut self) {
        self.begun_at = lock(&self.sink).lines;
    }

    /// `alloc_verify` allocated `drafts`: writes the `verify` line.
    pub fn verify(&mut self, drafts: &[unikv::Draft<'_>]) {
        let mut sink = lock(&self.sink);
        let ops = sink.lines.saturating_sub(self.begun_at);
        sink.write(&Op::Verify {
            drafts: drafts.iter().map(DraftLine::of).collect(),
            ops,
        });
    }

    /// `settle` settled one verify of each request with `accepted` positions (and, for
    /// trees, `paths`): writes the `settle` line.
    pub fn settle(&mut self, accepted: &[usize], paths: Option<&[Vec<u32>]>) {
        let mut sink = lock(&self.sink);
        let ops = sink.lines.saturating_sub(self.begun_at);
        sink.write(&Op::Settle {
            accepted: accepted.to_vec(),
            paths: paths.map(<[Vec<u32>]>::to_vec),
            ops,
        });
    }
}

/// The sink, whatever a panic elsewhere left in it.
fn lock(sink: &Mutex<Sink>) -> std::sync::MutexGuard<'_, Sink> {
    sink.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reports, after the run, whether writing the trace failed.
#[derive(Clone, Debug)]
pub struct RecordStatus {
    error: Arc<Mutex<Option<String>>>,
}

impl RecordStatus {
    /// The first write error, if any.
    pub fn check(&self) -> Result<(), OpsError> {
        match self.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(reason) => Err(OpsError::OpsTrace { reason }),
            None => Ok(()),
        }
    }
}

impl Recorder {
    /// Creates `path` and writes the header line.
    pub fn create(path: &Path, header: Op) -> Result<(Recorder, RecordStatus), OpsError> {
        let file = File::create(path).map_err(|e| OpsError::OpsTrace {
            reason: format!("cannot create {}: {e}", path.display()),
        })?;
        let error = Arc::new(Mutex::new(None));
        let mut sink = Sink {
            out: BufWriter::new(file),
            path: path.to_path_buf(),
            error: error.clone(),
            lines: 0,
        };
        sink.write(&header);
        sink.lines = 0;
        let recorder = Recorder {
            sink: Arc::new(Mutex::new(sink)),
        };
        Ok((recorder, RecordStatus { error }))
    }

    /// The handle that writes a speculative run's `verify` and `settle` lines into this
    /// trace (drop it before checking the [`RecordStatus`]: the file is flushed when the
    /// recorder and every handle are gone).
    pub fn marks(&self) -> Marks {
        Marks {
            sink: self.sink.clone(),
            begun_at: 0,
        }
    }

    fn write(&mut self, op: &Op) {
        lock(&self.sink).write(op);
    }
}

impl Sink {
    fn write(&mut self, op: &Op) {
        self.lines += 1;
        let result = serde_json::to_writer(&mut self.out, op)
            .map_err(|e| e.to_string())
            .and_then(|()| self.out.write_all(b"\n").map_err(|e| e.to_string()));
        if let Err(e) = result {
            let mut slot = self.error.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert_with(|| format!("writing {}: {e}", self.path.display()));
        }
    }
}

impl Drop for Sink {
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

#[cfg(test)]
mod tests {
    use super::*;
    use unikv::pools::VirtualSlot;

    #[test]
    fn a_slot_free_is_recorded_as_its_slots() {
        let op = recorded(FreeOp::Slots(&[VirtualSlot(3)]));
        assert_eq!(op, Op::FreeSlots { slots: vec![3] });
    }
}
