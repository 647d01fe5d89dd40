//! `FaultInjector`: a [`Device`] wrapper (an [`Intercepted`] device with [`FaultHooks`])
//! that counts ops and fails chosen ones with a typed error ([`Error::InjectedFault`])
//! without issuing them, so tests can check that a failed device op leaves the host state
//! as it was (fault sweeps).
//!
//! Like every [`Intercepted`] device it is `#[track_caller]`-transparent: an injected
//! error names the line that called the op, through `dyn Device` too.

use crate::{Device, DeviceCall, DeviceHooks, DeviceOp, Error, Intercepted};
use std::panic::Location;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

/// One fault a [`FaultInjector`] (its [`FaultHooks`]) injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InjectedFault {
    /// The op that was refused.
    pub op: DeviceOp,
    /// Its index among the ops seen since creation or the last [`FaultHooks::reset`]
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

/// The hooks of a [`FaultInjector`]: they count the ops an [`Intercepted`] device
/// forwards and refuse the ones they were armed for with [`Error::InjectedFault`], which
/// the device returns **without issuing the op**. Read-backs ([`DeviceOp::waits`]) are
/// diagnostics: never counted, never refused. Compose them with others (a pair, an
/// `Option`) to inject faults into a device that other hooks watch as well.
#[derive(Debug, Default)]
pub struct FaultHooks {
    state: Mutex<State>,
}

impl FaultHooks {
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

    /// Fails every op of kind `op` until [`FaultHooks::clear`] (a read-back kind: none).
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

    /// Ops let through since creation or the last reset.
    pub fn ops_issued(&self) -> u64 {
        self.state().issued
    }

    /// Whether a [`FaultHooks::fail_at`] is armed and has not fired yet.
    pub fn armed(&self) -> bool {
        self.state().fail_at.is_some()
    }

    /// Every fault injected since creation or the last reset, in call order.
    pub fn injected(&self) -> Vec<InjectedFault> {
        self.state().injected.clone()
    }
}

impl DeviceHooks for FaultHooks {
    type Ticket = ();

    fn name(&self, inner: String) -> String {
        format!("faults({inner})")
    }

    /// Counts one op; refuses it when armed for it.
    fn before<D: Device + ?Sized>(&self, _: &D, call: DeviceCall<'_>) -> Result<(), Error> {
        if call.op.waits() {
            return Ok(());
        }
        let mut s = self.state();
        let index = s.seen;
        s.seen += 1;
        let fire = s.fail_at == Some(index) || s.fail_kinds.contains(&call.op);
        if s.fail_at == Some(index) {
            s.fail_at = None;
        }
        if fire {
            let (op, location) = (call.op, call.location);
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

    fn after<D: Device + ?Sized>(&self, _: &D, _: DeviceCall<'_>, _: (), _: Result<(), &Error>) {}
}

/// A [`Device`] (and, around a [`Readback`](crate::Readback), a `Readback`) that
/// forwards every op to an inner device, counts it, and fails the ones it was armed for
/// with [`Error::InjectedFault`] **without issuing them** (so the inner device is
/// untouched, as the [`Device`] contract promises for a failed op): an [`Intercepted`]
/// device with [`FaultHooks`].
///
/// Ops are numbered from 0 in call order since creation or the last
/// [`FaultHooks::reset`]. [`FaultHooks::fail_at`] arms one op by number
/// (relative to the ops already seen: `fail_at(0)` fails the next op);
/// [`FaultHooks::fail_every`] fails every op of a kind; [`FaultHooks::clear`]
/// disarms both. Read-backs ([`Readback`](crate::Readback)) are diagnostics: they are
/// forwarded, never counted and never failed, so a test can inspect the device between
/// faults.
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
pub type FaultInjector<D = dyn Device> = Intercepted<D, FaultHooks>;

/// The injector's constructor and controls, on the device itself ([`FaultHooks`] has
/// them all).
impl<D: ?Sized> Intercepted<D, FaultHooks> {
    /// Wraps `inner`, counting from 0, with no fault armed.
    pub fn new(inner: Arc<D>) -> FaultInjector<D> {
        Intercepted::with_hooks(inner, FaultHooks::default())
    }

    /// [`FaultHooks::fail_at`].
    pub fn fail_at(&self, n: u64) {
        self.hooks().fail_at(n);
    }

    /// [`FaultHooks::fail_every`].
    pub fn fail_every(&self, op: DeviceOp) {
        self.hooks().fail_every(op);
    }

    /// [`FaultHooks::clear`].
    pub fn clear(&self) {
        self.hooks().clear();
    }

    /// [`FaultHooks::reset`].
    pub fn reset(&self) {
        self.hooks().reset();
    }

    /// [`FaultHooks::ops_seen`].
    pub fn ops_seen(&self) -> u64 {
        self.hooks().ops_seen()
    }

    /// [`FaultHooks::ops_issued`].
    pub fn ops_issued(&self) -> u64 {
        self.hooks().ops_issued()
    }

    /// [`FaultHooks::armed`].
    pub fn armed(&self) -> bool {
        self.hooks().armed()
    }

    /// [`FaultHooks::injected`].
    pub fn injected(&self) -> Vec<InjectedFault> {
        self.hooks().injected()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ByteSpan, CpuDevice, HostSync, Readback, SyncLedger};

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
