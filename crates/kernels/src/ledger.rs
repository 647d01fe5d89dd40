//! `SyncLedger`: a recording wrapper around a device (an [`Intercepted`] device with
//! [`LedgerHooks`]) that logs every op with its call site, so tests can assert that a
//! code path issued zero host syncs and produced zero data-dependent shapes.
//!
//! Ops of [`Device`] have host-known shapes by construction (their outputs are sized by
//! arguments the host chose). The only way device data can reach the host, and so the
//! only way to build a shape from device data (a boolean-mask filter, `nonzero`,
//! `unique`, `item`), is through [`Readback`], which needs a [`HostSync`] permit. The
//! ledger counts every `Readback` call as a sync, and the reads (`read_table`,
//! `read_bytes`) also as data-dependent shapes.
//!
//! A backend can also make the host wait inside an op of [`Device`]: the CUDA driver
//! may block in an allocation, a free, a copy from pageable memory or work on the legacy
//! default stream. [`CudaDevice`](crate::CudaDevice) counts those calls as *sync
//! hazards* ([`Device::sync_hazards`]); the ledger charges each to the op that issued it,
//! which then counts as a sync too.
//!
//! Call sites come from `#[track_caller]` on the trait methods, which holds through
//! `dyn Device` too: a record names the line that called the op, wherever the ledger
//! sits behind an `Arc<dyn Device>`.

use crate::{
    CpuDevice, Device, DeviceCall, DeviceHooks, Error, HostSync, Intercepted, Readback, SyncHazard,
    SyncHazards,
};
use std::fmt;
use std::panic::Location;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// One op seen by a [`SyncLedger`] (by [`LedgerHooks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpRecord {
    /// The trait method called (`translate`, `read_table`, ...).
    pub op: &'static str,
    /// Where it was called from.
    pub location: &'static Location<'static>,
    /// Whether the host waited for the device, or may have: a `Readback` op, or an op
    /// during which the device issued a sync hazard.
    pub synced: bool,
    /// How many sync hazards the device issued during the op.
    pub hazards: u64,
    /// The kind of the op's last sync hazard, if any.
    pub hazard: Option<SyncHazard>,
    /// Whether device data came back to the host, where it can size a later op.
    pub data_dependent_shape: bool,
    /// The [`HostSync::reason`] of the permit, for a `Readback` op.
    pub sync_reason: Option<&'static str>,
}

impl fmt::Display for OpRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} at {}", self.op, self.location)?;
        if let Some(reason) = self.sync_reason {
            write!(f, " (permit: {reason})")?;
        }
        if let Some(hazard) = self.hazard {
            write!(f, " ({} sync hazard(s), the last a {hazard})", self.hazards)?;
        }
        Ok(())
    }
}

/// The ops that broke "zero syncs, zero data-dependent shapes", as returned by
/// [`SyncLedger::check_no_syncs`]. Its `Display` lists each offending call site.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncReport {
    /// The device's name.
    pub device: String,
    /// Every op that synced or produced a data-dependent shape, in call order.
    pub offenders: Vec<OpRecord>,
}

impl fmt::Display for SyncReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let syncs = self.offenders.iter().filter(|r| r.synced).count();
        let shapes = self
            .offenders
            .iter()
            .filter(|r| r.data_dependent_shape)
            .count();
        writeln!(
            f,
            "{}: {syncs} host sync(s), {shapes} data-dependent shape(s) where none were allowed:",
            self.device
        )?;
        for r in &self.offenders {
            writeln!(f, "  - {r}")?;
        }
        Ok(())
    }
}

impl std::error::Error for SyncReport {}

/// The hooks of a [`SyncLedger`]: they record every op an [`Intercepted`] device
/// forwards (name, call site, sync, data-dependent shape), and the time spent in the
/// device. Failed ops are recorded too. Compose them with others (a pair, an `Option`) to
/// keep a ledger of a device that other hooks watch as well.
#[derive(Debug, Default)]
pub struct LedgerHooks {
    records: Mutex<Vec<OpRecord>>,
    device_nanos: AtomicU64,
}

/// What the ledger's [`DeviceHooks::before`] hands to its `after`: the device's sync
/// hazards and the time when the op started.
#[derive(Debug)]
pub struct LedgerTicket {
    hazards: u64,
    started: Instant,
}

impl LedgerHooks {
    fn records(&self) -> MutexGuard<'_, Vec<OpRecord>> {
        // A record is pushed whole; a panic elsewhere cannot leave the vector torn, so
        // a poisoned lock still guards a usable log.
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every op recorded since creation or the last [`LedgerHooks::reset`], in call order.
    pub fn ops(&self) -> Vec<OpRecord> {
        self.records().clone()
    }

    /// How many ops were recorded.
    pub fn op_count(&self) -> usize {
        self.records().len()
    }

    /// How many recorded ops waited for the device.
    pub fn syncs(&self) -> usize {
        self.records().iter().filter(|r| r.synced).count()
    }

    /// How many recorded ops brought device data back to the host (and so could size a
    /// later op from device data).
    pub fn data_dependent_shapes(&self) -> usize {
        self.records()
            .iter()
            .filter(|r| r.data_dependent_shape)
            .count()
    }

    /// Every recorded op that synced or produced a data-dependent shape, in call order.
    pub fn offenders(&self) -> Vec<OpRecord> {
        self.records()
            .iter()
            .filter(|r| r.synced || r.data_dependent_shape)
            .copied()
            .collect()
    }

    /// Forgets every record and the device time (e.g. at a step boundary, before the
    /// path under test).
    pub fn reset(&self) {
        self.records().clear();
        self.device_nanos.store(0, Ordering::Relaxed);
    }

    /// Time spent inside the wrapped device's ops since creation or the last
    /// [`LedgerHooks::reset`]. On the CPU backend device work runs synchronously inside
    /// the caller; subtracting this from a measured interval leaves the host's own
    /// bookkeeping time, which is what a GPU backend would cost the scheduler (its ops
    /// are asynchronous launches).
    pub fn device_time(&self) -> Duration {
        Duration::from_nanos(self.device_nanos.load(Ordering::Relaxed))
    }
}

/// Each op's duration goes to [`LedgerHooks::device_time`], and the sync hazards the
/// device issued meanwhile (read before and after, so ops on other threads at the same
/// time may be charged here) to its record.
impl DeviceHooks for LedgerHooks {
    type Ticket = LedgerTicket;

    fn name(&self, inner: String) -> String {
        format!("ledger({inner})")
    }

    fn before<D: Device + ?Sized>(
        &self,
        device: &D,
        _: DeviceCall<'_>,
    ) -> Result<LedgerTicket, Error> {
        let hazards = device.sync_hazards().count;
        Ok(LedgerTicket {
            hazards,
            started: Instant::now(),
        })
    }

    fn after<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
        ticket: LedgerTicket,
        _: Result<(), &Error>,
    ) {
        self.device_nanos.fetch_add(
            ticket.started.elapsed().as_nanos() as u64,
            Ordering::Relaxed,
        );
        let after: SyncHazards = device.sync_hazards();
        let hazards = after.count.saturating_sub(ticket.hazards);
        self.records().push(OpRecord {
            op: call.op.as_str(),
            location: call.location,
            synced: call.op.waits() || hazards > 0,
            hazards,
            hazard: if hazards > 0 { after.last } else { None },
            data_dependent_shape: call.op.returns_device_data(),
            sync_reason: call.permit.map(HostSync::reason),
        });
    }
}

/// A [`Device`] and [`Readback`] that forwards every op to an inner device and records
/// it (name, call site, sync, data-dependent shape): an [`Intercepted`] device with
/// [`LedgerHooks`].
///
/// ```
/// use std::sync::Arc;
/// use unikv_kernels::{CpuDevice, Device, SyncLedger};
///
/// let ledger = Arc::new(SyncLedger::new(Arc::new(CpuDevice::new())));
/// let dev: Arc<dyn Device> = ledger.clone(); // what scheduling-path code holds
/// let v2p = dev.alloc_table(8, 0).unwrap();
/// dev.scatter_table(v2p, &[(1, 5)]).unwrap();
/// assert_eq!(ledger.syncs(), 0);
/// assert!(ledger.check_no_syncs().is_ok());
/// ```
pub type SyncLedger = Intercepted<dyn Readback, LedgerHooks>;

impl SyncLedger {
    /// Wraps `inner`; the ledger starts empty.
    pub fn new(inner: Arc<dyn Readback>) -> SyncLedger {
        Intercepted::with_hooks(inner, LedgerHooks::default())
    }

    /// A ledger around a fresh [`CpuDevice`].
    pub fn cpu() -> SyncLedger {
        SyncLedger::new(Arc::new(CpuDevice::new()))
    }
}

/// The ledger's queries, on the device itself ([`LedgerHooks`] has them all).
impl<D: Device + ?Sized> Intercepted<D, LedgerHooks> {
    /// [`LedgerHooks::ops`].
    pub fn ops(&self) -> Vec<OpRecord> {
        self.hooks().ops()
    }

    /// [`LedgerHooks::op_count`].
    pub fn op_count(&self) -> usize {
        self.hooks().op_count()
    }

    /// [`LedgerHooks::syncs`].
    pub fn syncs(&self) -> usize {
        self.hooks().syncs()
    }

    /// [`LedgerHooks::data_dependent_shapes`].
    pub fn data_dependent_shapes(&self) -> usize {
        self.hooks().data_dependent_shapes()
    }

    /// [`LedgerHooks::reset`].
    pub fn reset(&self) {
        self.hooks().reset();
    }

    /// [`LedgerHooks::device_time`].
    pub fn device_time(&self) -> Duration {
        self.hooks().device_time()
    }

    /// `Ok` when no recorded op synced or produced a data-dependent shape; otherwise a
    /// report that lists each offending op with its call site.
    pub fn check_no_syncs(&self) -> Result<(), SyncReport> {
        let offenders = self.hooks().offenders();
        if offenders.is_empty() {
            Ok(())
        } else {
            Err(SyncReport {
                device: self.name(),
                offenders,
            })
        }
    }

    /// Test helper: panics with [`SyncLedger::check_no_syncs`]'s report when any op
    /// synced or produced a data-dependent shape.
    ///
    /// # Panics
    /// When the ledger holds an offending op; that is the point of the helper.
    #[track_caller]
    pub fn assert_no_syncs(&self) {
        if let Err(report) = self.check_no_syncs() {
            panic!("{report}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ByteSpan, BytesId, SpanMove, TableId, Translate};

    /// The Python reference's free path: read `v2p` back and keep only the ids whose
    /// page is live (a boolean-mask index: the output size depends on device data).
    /// Deliberately syncing; the ledger must catch it.
    fn filter_by_liveness(dev: &dyn Readback, v2p: TableId, ids: &[i32], ps: i32) -> Vec<i32> {
        let sync = HostSync::acquire("filter ids by SWA liveness");
        let len = 8;
        let table = dev.read_table(&sync, v2p, 0, len).unwrap();
        ids.iter()
            .copied()
            .filter(|&id| table.get((id / ps) as usize).is_some_and(|&p| p > 0))
            .collect()
    }

    /// The unikv way: the host already knows which pages are live, so it uploads dirty
    /// entries, translates and compacts without asking the device anything.
    fn clean_step(dev: &dyn Device, v2p: TableId, ids: TableId, out: TableId, buf: BytesId) {
        dev.scatter_table(v2p, &[(1, 3), (2, -1)]).unwrap();
        dev.translate(&Translate {
            v2p,
            ids,
            n: 4,
            page_size: 2,
            stride: 2,
            out,
            out_width: 6,
        })
        .unwrap();
        dev.move_spans(
            buf,
            &[SpanMove {
                src: 0,
                dst: 8,
                len: 8,
            }],
        )
        .unwrap();
        dev.fill_spans(buf, &[ByteSpan { offset: 0, len: 8 }], 0)
            .unwrap();
    }

    fn setup(ledger: &SyncLedger) -> (TableId, TableId, TableId, BytesId) {
        let v2p = ledger.alloc_table(8, 0).unwrap();
        let ids = ledger.alloc_table(4, 0).unwrap();
        ledger.upload_table(ids, 0, &[2, 3, 4, 5]).unwrap();
        let out = ledger.alloc_table(6, 0).unwrap();
        let buf = ledger.alloc_bytes(16, 1).unwrap();
        (v2p, ids, out, buf)
    }

    #[test]
    fn a_syncing_path_is_caught_with_its_call_site() {
        let ledger = Arc::new(SyncLedger::cpu());
        let (v2p, ..) = setup(&ledger);
        ledger.scatter_table(v2p, &[(1, 3)]).unwrap();
        ledger.reset();

        let dev: Arc<dyn Readback> = ledger.clone();
        let live = filter_by_liveness(dev.as_ref(), v2p, &[2, 3, 4], 2);
        assert_eq!(live, vec![2, 3]);

        assert_eq!(ledger.syncs(), 1);
        assert_eq!(ledger.data_dependent_shapes(), 1);
        let report = ledger.check_no_syncs().unwrap_err();
        assert_eq!(report.offenders.len(), 1);
        let offender = report.offenders[0];
        assert_eq!(offender.op, "read_table");
        assert_eq!(offender.location.file(), file!());
        assert_eq!(offender.sync_reason, Some("filter ids by SWA liveness"));
        let text = report.to_string();
        assert!(text.contains("1 host sync(s)"), "{text}");
        assert!(
            text.contains(&format!("read_table at {}", offender.location)),
            "{text}"
        );
    }

    #[test]
    fn the_call_site_is_the_callers_line_through_dyn_device() {
        let ledger = Arc::new(SyncLedger::cpu());
        let dev: Arc<dyn Device> = ledger.clone();
        let line = line!() + 1;
        let t = dev.alloc_table(1, 0).unwrap();
        dev.free_table(t).unwrap();
        let ops = ledger.ops();
        assert_eq!(ops[0].op, "alloc_table");
        assert_eq!(
            (ops[0].location.file(), ops[0].location.line()),
            (file!(), line)
        );
        assert_eq!(ops[1].location.line(), line + 1);
    }

    #[test]
    fn a_clean_path_records_its_ops_and_zero_syncs() {
        let ledger = Arc::new(SyncLedger::cpu());
        let (v2p, ids, out, buf) = setup(&ledger);
        ledger.reset();

        let dev: Arc<dyn Device> = ledger.clone();
        clean_step(dev.as_ref(), v2p, ids, out, buf);

        let names: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
        assert_eq!(
            names,
            ["scatter_table", "translate", "move_spans", "fill_spans"]
        );
        assert_eq!(ledger.syncs(), 0);
        assert_eq!(ledger.data_dependent_shapes(), 0);
        ledger.assert_no_syncs();

        // The step did what it says (checked after the fact, outside the ledger).
        let sync = HostSync::acquire("test check");
        let got = ledger.inner().read_table(&sync, out, 0, 6).unwrap();
        assert_eq!(got, vec![6, 7, 0, 0, 0, 0]);
    }

    #[test]
    #[should_panic(expected = "synchronize at")]
    fn assert_no_syncs_panics_with_the_report() {
        let ledger = SyncLedger::cpu();
        ledger
            .synchronize(&HostSync::acquire("deliberate"))
            .unwrap();
        ledger.assert_no_syncs();
    }

    #[test]
    fn reset_forgets_everything_and_a_failed_op_is_still_recorded() {
        let ledger = SyncLedger::cpu();
        ledger
            .synchronize(&HostSync::acquire("deliberate"))
            .unwrap();
        assert_eq!(ledger.syncs(), 1);
        ledger.reset();
        assert_eq!(ledger.op_count(), 0);
        assert!(ledger.free_table(TableId(42)).is_err());
        assert_eq!(ledger.op_count(), 1);
        assert_eq!(ledger.name(), "ledger(cpu)");
    }
}
