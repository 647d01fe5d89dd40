//! `FaultInjector`: a [`Device`] wrapper that counts ops and fails chosen ones with a
//! typed error ([`Error::InjectedFault`]) without issuing them, so tests can check that a
//! failed device op leaves the host state as it was (fault sweeps).
//!
//! Like [`SyncLedger`](crate::SyncLedger) it is `#[track_caller]`-transparent: an
//! injected error names the line that called the op, through `dyn Device` too.

use crate::{
    ByteSpan, BytesId, Device, Error, HostSync, Readback, SpanMove, TableId, TableScatter,
    TableSpans, Translate,
};
use std::panic::Location;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// The ops of [`Device`] (what a [`FaultInjector`] counts and can fail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceOp {
    /// [`Device::alloc_bytes`].
    AllocBytes,
    /// [`Device::alloc_table`].
    AllocTable,
    /// [`Device::free_bytes`].
    FreeBytes,
    /// [`Device::free_table`].
    FreeTable,
    /// [`Device::upload_table`].
    UploadTable,
    /// [`Device::scatter_table`].
    ScatterTable,
    /// [`Device::gather_table`].
    GatherTable,
    /// [`Device::fill_spans`].
    FillSpans,
    /// [`Device::move_spans`].
    MoveSpans,
    /// [`Device::translate`].
    Translate,
    /// [`Device::scatter_tables`].
    ScatterTables,
    /// [`Device::translate_many`].
    TranslateMany,
    /// [`Device::copy_table_spans`].
    CopyTableSpans,
}

impl DeviceOp {
    /// The trait method's name (`move_spans`, ...).
    pub const fn as_str(self) -> &'static str {
        match self {
            DeviceOp::AllocBytes => "alloc_bytes",
            DeviceOp::AllocTable => "alloc_table",
            DeviceOp::FreeBytes => "free_bytes",
            DeviceOp::FreeTable => "free_table",
            DeviceOp::UploadTable => "upload_table",
            DeviceOp::ScatterTable => "scatter_table",
            DeviceOp::GatherTable => "gather_table",
            DeviceOp::FillSpans => "fill_spans",
            DeviceOp::MoveSpans => "move_spans",
            DeviceOp::Translate => "translate",
            DeviceOp::ScatterTables => "scatter_tables",
            DeviceOp::TranslateMany => "translate_many",
            DeviceOp::CopyTableSpans => "copy_table_spans",
        }
    }
}

/// One fault a [`FaultInjector`] injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InjectedFault {
    /// The op that was refused.
    pub op: DeviceOp,
    /// Its index among the ops seen since creation or the last [`FaultInjector::reset`]
    /// (0-based, failed ones included).
    pub index: u64,
    /// Where it was called from.
    pub location: &'static Location<'static>,
}

#[derive(Debug, Default)]
struct State {
    /// Ops seen (issued or refused) since the last reset.
    seen: u64,
    /// Ops forwarded to the inner device since the last reset.
    issued: u64,
    /// Fail the op whose `seen` index is this (once).
    fail_at: Option<u64>,
    /// Fail every op of these kinds.
    fail_kinds: Vec<DeviceOp>,
    /// Faults injected since the last reset.
    injected: Vec<InjectedFault>,
}

/// A [`Device`] (and, around a [`Readback`], a `Readback`) that forwards every op to an
/// inner device, counts it, and fails the ones it was armed for with
/// [`Error::InjectedFault`] **without issuing them** (so the inner device is untouched,
/// as the [`Device`] contract promises for a failed op).
///
/// Ops are numbered from 0 in call order since creation or the last
/// [`FaultInjector::reset`]. [`FaultInjector::fail_at`] arms one op by number
/// (relative to the ops already seen: `fail_at(0)` fails the next op);
/// [`FaultInjector::fail_every`] fails every op of a kind; [`FaultInjector::clear`]
/// disarms both. Read-backs ([`Readback`]) are diagnostics: they are forwarded, never
/// counted and never failed, so a test can inspect the device between faults.
///
/// A fault sweep: for `n` in `0..`, snapshot the state, `fail_at(n)`, run the call, check
/// the state is unchanged and that a retry (after `clear`) succeeds; stop when the call
/// issued fewer than `n + 1` ops (`injected()` is empty).
///
/// ```
/// use std::sync::Arc;
/// use unikv_kernels::{CpuDevice, Device, DeviceOp, Error, FaultInjector};
///
/// let faults = Arc::new(FaultInjector::new(Arc::new(CpuDevice::new())));
/// let dev: Arc<dyn Device> = faults.clone();
/// let t = dev.alloc_table(4, 0).unwrap();
/// faults.fail_at(1); // the second op from now
/// dev.scatter_table(t, &[(1, 5)]).unwrap();
/// let err = dev.scatter_table(t, &[(2, 6)]).unwrap_err();
/// assert!(matches!(err, Error::InjectedFault { op: "scatter_table", index: 2, .. }));
/// assert_eq!((faults.ops_seen(), faults.ops_issued()), (3, 2));
/// faults.fail_every(DeviceOp::FillSpans);
/// assert!(dev.alloc_bytes(8, 0).is_ok());
/// faults.clear();
/// dev.scatter_table(t, &[(2, 6)]).unwrap(); // the retry succeeds
/// ```
#[derive(Debug)]
pub struct FaultInjector<D: ?Sized = dyn Device> {
    inner: Arc<D>,
    state: Mutex<State>,
}

impl<D: ?Sized> FaultInjector<D> {
    /// Wraps `inner`, counting from 0, with no fault armed.
    pub fn new(inner: Arc<D>) -> FaultInjector<D> {
        FaultInjector {
            inner,
            state: Mutex::new(State::default()),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update is a few stores of plain integers: a panic elsewhere cannot leave
        // the state torn, so a poisoned lock still guards usable counters.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fails the `n`-th op from now (`0`: the next op), once. Replaces an earlier
    /// `fail_at` that has not fired yet.
    pub fn fail_at(&self, n: u64) {
        let mut s = self.state();
        s.fail_at = Some(s.seen.saturating_add(n));
    }

    /// Fails every op of kind `op` until [`FaultInjector::clear`].
    pub fn fail_every(&self, op: DeviceOp) {
        let mut s = self.state();
        if !s.fail_kinds.contains(&op) {
            s.fail_kinds.push(op);
        }
    }

    /// Disarms every fault (counters and the injected list stay).
    pub fn clear(&self) {
        let mut s = self.state();
        s.fail_at = None;
        s.fail_kinds.clear();
    }

    /// Disarms every fault and restarts counting from 0 with an empty injected list.
    pub fn reset(&self) {
        *self.state() = State::default();
    }

    /// Ops seen (issued or refused) since creation or the last reset.
    pub fn ops_seen(&self) -> u64 {
        self.state().seen
    }

    /// Ops forwarded to the inner device since creation or the last reset.
    pub fn ops_issued(&self) -> u64 {
        self.state().issued
    }

    /// Whether a [`FaultInjector::fail_at`] is armed and has not fired yet.
    pub fn armed(&self) -> bool {
        self.state().fail_at.is_some()
    }

    /// Every fault injected since creation or the last reset, in call order.
    pub fn injected(&self) -> Vec<InjectedFault> {
        self.state().injected.clone()
    }

    /// Counts one op; refuses it when armed for it.
    #[track_caller]
    fn admit(&self, op: DeviceOp) -> Result<(), Error> {
        let mut s = self.state();
        let index = s.seen;
        s.seen += 1;
        let fire = s.fail_at == Some(index) || s.fail_kinds.contains(&op);
        if s.fail_at == Some(index) {
            s.fail_at = None;
        }
        if fire {
            let location = Location::caller();
            s.injected.push(InjectedFault {
                op,
                index,
                location,
            });
            return Err(Error::InjectedFault {
                op: op.as_str(),
                index,
                location,
            });
        }
        s.issued += 1;
        Ok(())
    }
}

impl<D: Device + ?Sized> Device for FaultInjector<D> {
    fn name(&self) -> String {
        format!("faults({})", self.inner.name())
    }

    fn sync_hazards(&self) -> crate::SyncHazards {
        self.inner.sync_hazards()
    }

    fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, Error> {
        self.admit(DeviceOp::AllocBytes)?;
        self.inner.alloc_bytes(len, fill)
    }

    fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, Error> {
        self.admit(DeviceOp::AllocTable)?;
        self.inner.alloc_table(len, fill)
    }

    fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
        self.admit(DeviceOp::FreeBytes)?;
        self.inner.free_bytes(buf)
    }

    fn free_table(&self, table: TableId) -> Result<(), Error> {
        self.admit(DeviceOp::FreeTable)?;
        self.inner.free_table(table)
    }

    fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error> {
        self.admit(DeviceOp::UploadTable)?;
        self.inner.upload_table(table, offset, values)
    }

    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error> {
        self.admit(DeviceOp::ScatterTable)?;
        self.inner.scatter_table(table, entries)
    }

    fn gather_table(
        &self,
        src: TableId,
        indices: TableId,
        n: usize,
        out: TableId,
    ) -> Result<(), Error> {
        self.admit(DeviceOp::GatherTable)?;
        self.inner.gather_table(src, indices, n, out)
    }

    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), Error> {
        self.admit(DeviceOp::FillSpans)?;
        self.inner.fill_spans(buf, spans, value)
    }

    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error> {
        self.admit(DeviceOp::MoveSpans)?;
        self.inner.move_spans(buf, moves)
    }

    fn translate(&self, args: &Translate) -> Result<(), Error> {
        self.admit(DeviceOp::Translate)?;
        self.inner.translate(args)
    }

    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), Error> {
        self.admit(DeviceOp::ScatterTables)?;
        self.inner.scatter_tables(scatters)
    }

    fn translate_many(&self, all: &[Translate]) -> Result<(), Error> {
        self.admit(DeviceOp::TranslateMany)?;
        self.inner.translate_many(all)
    }

    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), Error> {
        self.admit(DeviceOp::CopyTableSpans)?;
        self.inner.copy_table_spans(copies)
    }
}

impl<D: Readback + ?Sized> Readback for FaultInjector<D> {
    fn read_table(
        &self,
        sync: &HostSync,
        table: TableId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<i32>, Error> {
        self.inner.read_table(sync, table, offset, len)
    }

    fn read_bytes(
        &self,
        sync: &HostSync,
        buf: BytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        self.inner.read_bytes(sync, buf, offset, len)
    }

    fn synchronize(&self, sync: &HostSync) -> Result<(), Error> {
        self.inner.synchronize(sync)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuDevice, SyncLedger};

    #[test]
    fn a_refused_op_is_not_issued_and_names_its_call_site() {
        let ledger = Arc::new(SyncLedger::cpu());
        let faults = FaultInjector::new(ledger.clone() as Arc<dyn Device>);
        let buf = faults.alloc_bytes(16, 7).unwrap();
        ledger.reset();
        faults.fail_at(0);
        let line = line!() + 1;
        let err = faults.fill_spans(buf, &[ByteSpan { offset: 0, len: 16 }], 0);
        let Err(Error::InjectedFault {
            op,
            index,
            location,
        }) = err
        else {
            panic!("{err:?}");
        };
        assert_eq!((op, index), ("fill_spans", 1));
        assert_eq!((location.file(), location.line()), (file!(), line));
        assert_eq!(ledger.op_count(), 0, "the inner device never saw it");
        assert!(!faults.armed(), "fail_at fires once");
        assert_eq!(faults.injected().len(), 1);
        let sync = HostSync::acquire("test check");
        let bytes = ledger.inner().read_bytes(&sync, buf, 0, 16).unwrap();
        assert_eq!(bytes, vec![7; 16], "the buffer is untouched");
    }

    #[test]
    fn fail_every_refuses_one_kind_until_cleared_and_reset_restarts_the_count() {
        let faults = FaultInjector::new(Arc::new(CpuDevice::new()));
        let t = faults.alloc_table(4, 0).unwrap();
        faults.fail_every(DeviceOp::ScatterTable);
        assert!(faults.scatter_table(t, &[(0, 1)]).is_err());
        assert!(faults.scatter_table(t, &[(0, 1)]).is_err());
        assert!(faults.upload_table(t, 0, &[1]).is_ok(), "other kinds pass");
        faults.clear();
        assert!(faults.scatter_table(t, &[(0, 1)]).is_ok());
        assert_eq!((faults.ops_seen(), faults.ops_issued()), (5, 3));
        // Readbacks are forwarded, neither counted nor failed.
        faults.fail_at(0);
        let sync = HostSync::acquire("test check");
        assert_eq!(faults.read_table(&sync, t, 0, 1).unwrap(), [1]);
        assert!(faults.armed());
        faults.reset();
        assert_eq!((faults.ops_seen(), faults.ops_issued()), (0, 0));
        assert!(!faults.armed() && faults.injected().is_empty());
        assert_eq!(faults.name(), "faults(cpu)");
    }
}
