//! [`Intercepted`]: the one forwarding [`Device`] (and, around a [`Readback`], the one
//! forwarding `Readback`), for everything that wraps a device to watch or fail its ops:
//! the [`SyncLedger`](crate::SyncLedger) records each op with its call site, the
//! [`FaultInjector`](crate::FaultInjector) fails chosen ones, an engine counts what it
//! moved. The wrapper forwards every op; its [`DeviceHooks`] see each as a [`DeviceCall`]
//! before it is forwarded (and may fail it, unforwarded) and after, with its outcome.
//!
//! Hooks compose, so a device is wrapped once however many hooks watch it: a pair
//! `(A, B)` is `A` wrapped around `B`, an `Option<H>` is `H` or nothing, `()` watches
//! nothing.
//!
//! The wrapper is `#[track_caller]`-transparent: a call's [`DeviceCall::location`] is the
//! line that called the op, through `dyn Device` and through nested wrappers too.

use crate::{
    ByteSpan, BytesId, CopyEvent, Device, DeviceOp, Error, HostBytesId, HostCopy, HostSync,
    LaneTranslate, Readback, RowGather, SpanMove, SyncHazards, TableId, TableScatter, TableSpans,
    Translate, WindowTranslate,
};
use std::fmt;
use std::panic::Location;
use std::sync::Arc;

/// One op of an [`Intercepted`] device, as its [`DeviceHooks`] see it.
#[derive(Clone, Copy, Debug)]
pub struct DeviceCall<'a> {
    /// The op.
    pub op: DeviceOp,
    /// Where it was called from.
    pub location: &'static Location<'static>,
    /// How many items it carries: the length of its slice argument (the moves of a
    /// `move_spans`, the spans of a `fill_spans`, the entries of a `scatter_table`, the
    /// values of an `upload_table`, the tables of a `scatter_tables` or
    /// `copy_table_spans`, the translations of a `translate_many`, the windows of a
    /// `translate_windows`, the gathers of a `gather_rows`, the copies of a
    /// `copy_device_to_host` or `copy_host_to_device`), 1 for an op with none.
    pub items: usize,
    /// The permit of a [`Readback`] op ([`DeviceOp::waits`]); `None` for the others.
    pub permit: Option<&'a HostSync>,
}

/// What an [`Intercepted`] device calls around each op. Both methods see the inner device
/// (the one the op is forwarded to), as it is before and after the op.
///
/// Hooks are shared by every thread that holds the device, so they take `&self` and keep
/// their state behind atomics or a lock.
pub trait DeviceHooks: fmt::Debug + Send + Sync {
    /// What [`DeviceHooks::before`] hands to [`DeviceHooks::after`] for one op (a start
    /// time, a counter read); `()` for most hooks.
    type Ticket;

    /// The intercepted device's name, given the inner device's (`ledger(cpu)`); by
    /// default the inner device's.
    fn name(&self, inner: String) -> String {
        inner
    }

    /// Before `call` is forwarded to `device`: an error fails the op with it, unforwarded
    /// (so the device is untouched, as the [`Device`] contract promises for a failed op),
    /// and [`DeviceHooks::after`] is not called.
    fn before<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
    ) -> Result<Self::Ticket, Error>;

    /// After `call` was forwarded to `device`, whatever its outcome, with the ticket its
    /// [`DeviceHooks::before`] returned.
    fn after<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
        ticket: Self::Ticket,
        outcome: Result<(), &Error>,
    );
}

/// Watches nothing: an `Intercepted<D, ()>` is its inner device.
impl DeviceHooks for () {
    type Ticket = ();

    fn before<D: Device + ?Sized>(&self, _: &D, _: DeviceCall<'_>) -> Result<(), Error> {
        Ok(())
    }

    fn after<D: Device + ?Sized>(&self, _: &D, _: DeviceCall<'_>, _: (), _: Result<(), &Error>) {}
}

/// `A` wrapped around `B`, as though the device were `Intercepted<Intercepted<D, B>, A>`:
/// `A` sees an op first and its outcome last, and when `B` refuses an op that `A` let
/// through, `A`'s `after` sees the refusal. The name is `A`'s of `B`'s.
impl<A: DeviceHooks, B: DeviceHooks> DeviceHooks for (A, B) {
    type Ticket = (A::Ticket, B::Ticket);

    fn name(&self, inner: String) -> String {
        self.0.name(self.1.name(inner))
    }

    fn before<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
    ) -> Result<Self::Ticket, Error> {
        let a = self.0.before(device, call)?;
        match self.1.before(device, call) {
            Ok(b) => Ok((a, b)),
            Err(e) => {
                self.0.after(device, call, a, Err(&e));
                Err(e)
            }
        }
    }

    fn after<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
        (a, b): Self::Ticket,
        outcome: Result<(), &Error>,
    ) {
        self.1.after(device, call, b, outcome);
        self.0.after(device, call, a, outcome);
    }
}

/// `H` when there is one, nothing otherwise (a hook chosen at run time).
impl<H: DeviceHooks> DeviceHooks for Option<H> {
    type Ticket = Option<H::Ticket>;

    fn name(&self, inner: String) -> String {
        match self {
            Some(hooks) => hooks.name(inner),
            None => inner,
        }
    }

    fn before<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
    ) -> Result<Self::Ticket, Error> {
        self.as_ref()
            .map(|hooks| hooks.before(device, call))
            .transpose()
    }

    fn after<D: Device + ?Sized>(
        &self,
        device: &D,
        call: DeviceCall<'_>,
        ticket: Self::Ticket,
        outcome: Result<(), &Error>,
    ) {
        if let (Some(hooks), Some(ticket)) = (self, ticket) {
            hooks.after(device, call, ticket, outcome);
        }
    }
}

/// A [`Device`] (and, around a [`Readback`], a `Readback`) that forwards every op to an
/// inner device and shows each to its [`DeviceHooks`]; see the module docs.
/// [`Device::sync_hazards`] is forwarded unseen.
///
/// ```
/// use std::sync::Arc;
/// use unikv_kernels::{CpuDevice, Device, FaultHooks, Intercepted, LedgerHooks};
///
/// // One wrapper, two hooks: the ledger around the fault injector.
/// let dev = Intercepted::with_hooks(
///     Arc::new(CpuDevice::new()),
///     (LedgerHooks::default(), FaultHooks::default()),
/// );
/// let t = dev.alloc_table(4, 0).unwrap();
/// dev.hooks().1.fail_at(0);
/// assert!(dev.scatter_table(t, &[(1, 5)]).is_err());
/// let (ledger, faults) = dev.hooks();
/// assert_eq!((ledger.op_count(), faults.ops_issued()), (2, 1)); // the refusal is recorded
/// assert_eq!(dev.name(), "ledger(faults(cpu))");
/// ```
#[derive(Debug)]
pub struct Intercepted<D: ?Sized, H> {
    inner: Arc<D>,
    hooks: H,
}

impl<D: ?Sized, H> Intercepted<D, H> {
    /// Wraps `inner` with `hooks`.
    pub fn with_hooks(inner: Arc<D>, hooks: H) -> Intercepted<D, H> {
        Intercepted { inner, hooks }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }

    /// The hooks.
    pub fn hooks(&self) -> &H {
        &self.hooks
    }
}

impl<D: Device + ?Sized, H: DeviceHooks> Intercepted<D, H> {
    /// Shows the op to the hooks before it is forwarded; the call and its ticket go to
    /// [`Intercepted::after`].
    #[track_caller]
    fn before<'a>(
        &self,
        op: DeviceOp,
        items: usize,
        permit: Option<&'a HostSync>,
    ) -> Result<(DeviceCall<'a>, H::Ticket), Error> {
        let call = DeviceCall {
            op,
            location: Location::caller(),
            items,
            permit,
        };
        Ok((call, self.hooks.before(&*self.inner, call)?))
    }

    /// Shows the forwarded op's outcome to the hooks and hands its result back.
    fn after<T>(
        &self,
        (call, ticket): (DeviceCall<'_>, H::Ticket),
        result: Result<T, Error>,
    ) -> Result<T, Error> {
        let outcome = result.as_ref().map(|_| ());
        self.hooks.after(&*self.inner, call, ticket, outcome);
        result
    }
}

// Each op calls the inner device in its own body (not in a closure), so the caller's
// location reaches the inner device too.
impl<D: Device + ?Sized, H: DeviceHooks> Device for Intercepted<D, H> {
    fn name(&self) -> String {
        self.hooks.name(self.inner.name())
    }

    fn sync_hazards(&self) -> SyncHazards {
        self.inner.sync_hazards()
    }

    fn holds_bytes(&self) -> bool {
        self.inner.holds_bytes()
    }

    fn alloc_bytes(&self, len: u64, fill: u8) -> Result<BytesId, Error> {
        let call = self.before(DeviceOp::AllocBytes, 1, None)?;
        self.after(call, self.inner.alloc_bytes(len, fill))
    }

    fn alloc_table(&self, len: usize, fill: i32) -> Result<TableId, Error> {
        let call = self.before(DeviceOp::AllocTable, 1, None)?;
        self.after(call, self.inner.alloc_table(len, fill))
    }

    fn free_bytes(&self, buf: BytesId) -> Result<(), Error> {
        let call = self.before(DeviceOp::FreeBytes, 1, None)?;
        self.after(call, self.inner.free_bytes(buf))
    }

    fn free_table(&self, table: TableId) -> Result<(), Error> {
        let call = self.before(DeviceOp::FreeTable, 1, None)?;
        self.after(call, self.inner.free_table(table))
    }

    fn upload_table(&self, table: TableId, offset: usize, values: &[i32]) -> Result<(), Error> {
        let call = self.before(DeviceOp::UploadTable, values.len(), None)?;
        self.after(call, self.inner.upload_table(table, offset, values))
    }

    fn scatter_table(&self, table: TableId, entries: &[(u32, i32)]) -> Result<(), Error> {
        let call = self.before(DeviceOp::ScatterTable, entries.len(), None)?;
        self.after(call, self.inner.scatter_table(table, entries))
    }

    fn scatter_tables(&self, scatters: &[TableScatter<'_>]) -> Result<(), Error> {
        let call = self.before(DeviceOp::ScatterTables, scatters.len(), None)?;
        self.after(call, self.inner.scatter_tables(scatters))
    }

    fn copy_table_spans(&self, copies: &[TableSpans<'_>]) -> Result<(), Error> {
        let call = self.before(DeviceOp::CopyTableSpans, copies.len(), None)?;
        self.after(call, self.inner.copy_table_spans(copies))
    }

    fn gather_table(
        &self,
        src: TableId,
        indices: TableId,
        n: usize,
        out: TableId,
    ) -> Result<(), Error> {
        let call = self.before(DeviceOp::GatherTable, 1, None)?;
        self.after(call, self.inner.gather_table(src, indices, n, out))
    }

    fn fill_spans(&self, buf: BytesId, spans: &[ByteSpan], value: u8) -> Result<(), Error> {
        let call = self.before(DeviceOp::FillSpans, spans.len(), None)?;
        self.after(call, self.inner.fill_spans(buf, spans, value))
    }

    fn move_spans(&self, buf: BytesId, moves: &[SpanMove]) -> Result<(), Error> {
        let call = self.before(DeviceOp::MoveSpans, moves.len(), None)?;
        self.after(call, self.inner.move_spans(buf, moves))
    }

    fn translate(&self, args: &Translate) -> Result<(), Error> {
        let call = self.before(DeviceOp::Translate, 1, None)?;
        self.after(call, self.inner.translate(args))
    }

    fn translate_many(&self, all: &[Translate]) -> Result<(), Error> {
        let call = self.before(DeviceOp::TranslateMany, all.len(), None)?;
        self.after(call, self.inner.translate_many(all))
    }

    fn translate_windows(&self, all: &[WindowTranslate]) -> Result<(), Error> {
        let call = self.before(DeviceOp::TranslateWindows, all.len(), None)?;
        self.after(call, self.inner.translate_windows(all))
    }

    fn gather_rows(&self, all: &[RowGather]) -> Result<(), Error> {
        let call = self.before(DeviceOp::GatherRows, all.len(), None)?;
        self.after(call, self.inner.gather_rows(all))
    }

    fn translate_lanes(&self, all: &[LaneTranslate]) -> Result<(), Error> {
        let call = self.before(DeviceOp::TranslateLanes, all.len(), None)?;
        self.after(call, self.inner.translate_lanes(all))
    }

    fn alloc_host(&self, len: u64) -> Result<HostBytesId, Error> {
        let call = self.before(DeviceOp::AllocHost, 1, None)?;
        self.after(call, self.inner.alloc_host(len))
    }

    fn free_host(&self, host: HostBytesId) -> Result<(), Error> {
        let call = self.before(DeviceOp::FreeHost, 1, None)?;
        self.after(call, self.inner.free_host(host))
    }

    fn copy_device_to_host(
        &self,
        buf: BytesId,
        host: HostBytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        let call = self.before(DeviceOp::CopyDeviceToHost, copies.len(), None)?;
        self.after(call, self.inner.copy_device_to_host(buf, host, copies))
    }

    fn copy_host_to_device(
        &self,
        host: HostBytesId,
        buf: BytesId,
        copies: &[HostCopy],
    ) -> Result<(), Error> {
        let call = self.before(DeviceOp::CopyHostToDevice, copies.len(), None)?;
        self.after(call, self.inner.copy_host_to_device(host, buf, copies))
    }

    fn record_copy_event(&self) -> Result<CopyEvent, Error> {
        let call = self.before(DeviceOp::RecordCopyEvent, 1, None)?;
        self.after(call, self.inner.record_copy_event())
    }

    fn copy_event_done(&self, event: CopyEvent) -> Result<bool, Error> {
        let call = self.before(DeviceOp::CopyEventDone, 1, None)?;
        self.after(call, self.inner.copy_event_done(event))
    }

    fn free_copy_event(&self, event: CopyEvent) -> Result<(), Error> {
        let call = self.before(DeviceOp::FreeCopyEvent, 1, None)?;
        self.after(call, self.inner.free_copy_event(event))
    }

    // Not an op: it issues nothing (the hooks see the reads and waits around it).
    fn export_table(&self, table: TableId) -> Result<crate::TableExport, Error> {
        self.inner.export_table(table)
    }

    unsafe fn make_stream_wait(&self, consumer: crate::RawStream) -> Result<(), Error> {
        let call = self.before(DeviceOp::MakeStreamWait, 1, None)?;
        // SAFETY: forwarded contract: `consumer` is valid for the inner device's context.
        self.after(call, unsafe { self.inner.make_stream_wait(consumer) })
    }
}

impl<D: Readback + ?Sized, H: DeviceHooks> Readback for Intercepted<D, H> {
    fn read_table(
        &self,
        sync: &HostSync,
        table: TableId,
        offset: usize,
        len: usize,
    ) -> Result<Vec<i32>, Error> {
        let call = self.before(DeviceOp::ReadTable, 1, Some(sync))?;
        self.after(call, self.inner.read_table(sync, table, offset, len))
    }

    fn read_bytes(
        &self,
        sync: &HostSync,
        buf: BytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let call = self.before(DeviceOp::ReadBytes, 1, Some(sync))?;
        self.after(call, self.inner.read_bytes(sync, buf, offset, len))
    }

    fn synchronize(&self, sync: &HostSync) -> Result<(), Error> {
        let call = self.before(DeviceOp::Synchronize, 1, Some(sync))?;
        self.after(call, self.inner.synchronize(sync))
    }

    fn read_host(
        &self,
        sync: &HostSync,
        host: HostBytesId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let call = self.before(DeviceOp::ReadHost, 1, Some(sync))?;
        self.after(call, self.inner.read_host(sync, host, offset, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuDevice, FaultHooks, LedgerHooks, SyncLedger};
    use std::sync::Mutex;

    /// Logs `before` and `after` of every op under its name, and refuses the ops it is
    /// told to.
    #[derive(Debug)]
    struct Log {
        name: &'static str,
        refuse: Option<DeviceOp>,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl Log {
        fn new(name: &'static str, log: &Arc<Mutex<Vec<String>>>) -> Log {
            Log {
                name,
                refuse: None,
                log: log.clone(),
            }
        }
    }

    impl DeviceHooks for Log {
        type Ticket = &'static str;

        fn name(&self, inner: String) -> String {
            format!("{}({inner})", self.name)
        }

        fn before<D: Device + ?Sized>(
            &self,
            _: &D,
            call: DeviceCall<'_>,
        ) -> Result<&'static str, Error> {
            let mut log = self.log.lock().unwrap();
            log.push(format!("{} before {}", self.name, call.op.as_str()));
            if self.refuse == Some(call.op) {
                return Err(Error::BadArguments {
                    op: call.op.as_str(),
                    reason: "refused by a test hook".into(),
                });
            }
            Ok(self.name)
        }

        fn after<D: Device + ?Sized>(
            &self,
            _: &D,
            call: DeviceCall<'_>,
            ticket: &'static str,
            outcome: Result<(), &Error>,
        ) {
            assert_eq!(ticket, self.name, "each hook gets its own ticket back");
            let ok = if outcome.is_ok() { "ok" } else { "failed" };
            let line = format!("{} after {} {ok}", self.name, call.op.as_str());
            self.log.lock().unwrap().push(line);
        }
    }

    fn logs(log: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
        std::mem::take(&mut *log.lock().unwrap())
    }

    #[test]
    fn a_pair_is_its_first_hook_around_its_second() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut inner = Log::new("b", &log);
        inner.refuse = Some(DeviceOp::FreeTable);
        let hooks = (Log::new("a", &log), inner);
        let dev = Intercepted::with_hooks(Arc::new(CpuDevice::new()), hooks);
        let t = dev.alloc_table(2, 0).unwrap();
        assert_eq!(
            logs(&log),
            [
                "a before alloc_table",
                "b before alloc_table",
                "b after alloc_table ok",
                "a after alloc_table ok"
            ]
        );
        // Refused by `b`: `a` sees the refusal, `b` no `after`.
        assert!(dev.free_table(t).is_err());
        assert_eq!(
            logs(&log),
            [
                "a before free_table",
                "b before free_table",
                "a after free_table failed"
            ]
        );
        // A failed op (an unknown table) is shown as failed.
        assert!(dev.upload_table(TableId(99), 0, &[1]).is_err());
        assert_eq!(
            logs(&log)[2..],
            ["b after upload_table failed", "a after upload_table failed"]
        );
        assert_eq!(dev.name(), "a(b(cpu))");
    }

    #[test]
    fn none_watches_nothing_and_some_is_its_hook() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let none = Intercepted::with_hooks(Arc::new(CpuDevice::new()), None::<Log>);
        none.alloc_bytes(8, 0).unwrap();
        assert_eq!(none.name(), "cpu");
        let some = Intercepted::with_hooks(Arc::new(CpuDevice::new()), Some(Log::new("s", &log)));
        some.alloc_bytes(8, 0).unwrap();
        assert_eq!(
            logs(&log),
            ["s before alloc_bytes", "s after alloc_bytes ok"]
        );
        assert_eq!(some.name(), "s(cpu)");
        let nothing = Intercepted::with_hooks(Arc::new(CpuDevice::new()), ());
        assert_eq!(nothing.name(), "cpu");
    }

    #[test]
    fn every_op_reaches_the_hooks_and_the_device_with_its_items_and_call_site() {
        let ledger = Arc::new(SyncLedger::cpu());
        let dev = Intercepted::with_hooks(ledger.clone(), LedgerHooks::default());
        let sync = HostSync::acquire("test check");
        let line = line!() + 1;
        let buf = dev.alloc_bytes(64, 1).unwrap();
        let t = dev.alloc_table(8, 0).unwrap();
        let u = dev.alloc_table(8, 0).unwrap();
        dev.upload_table(t, 0, &[1, 2, 3]).unwrap();
        dev.scatter_table(t, &[(4, 5), (5, 6)]).unwrap();
        let scatter = TableScatter {
            table: u,
            entries: &[(0, 1)],
        };
        dev.scatter_tables(&[scatter, scatter]).unwrap();
        let values = [7; 8];
        let spans = TableSpans {
            table: u,
            values: &values,
            spans: &[(1, 2)],
        };
        dev.copy_table_spans(&[spans]).unwrap();
        dev.gather_table(t, t, 2, u).unwrap();
        dev.fill_spans(buf, &[ByteSpan { offset: 0, len: 8 }; 3], 2)
            .unwrap();
        let moves = [SpanMove {
            src: 0,
            dst: 32,
            len: 8,
        }];
        dev.move_spans(buf, &moves).unwrap();
        let args = Translate {
            v2p: t,
            ids: t,
            n: 1,
            page_size: 1,
            stride: 1,
            out: u,
            out_width: 1,
        };
        dev.translate(&args).unwrap();
        dev.translate_many(&[args]).unwrap();
        assert_eq!(dev.read_table(&sync, u, 0, 3).unwrap(), [2, 3, 7]);
        assert_eq!(dev.read_bytes(&sync, buf, 32, 1).unwrap(), [2]);
        dev.synchronize(&sync).unwrap();
        dev.free_table(u).unwrap();
        dev.free_table(t).unwrap();
        let last = line!() + 1;
        dev.free_bytes(buf).unwrap();
        // The outer hooks and the inner ledger saw the same ops at the same call sites.
        let (outer, inner) = (dev.hooks().ops(), ledger.ops());
        assert_eq!(outer, inner);
        let names: Vec<&str> = outer.iter().map(|r| r.op).collect();
        assert_eq!(
            names,
            [
                "alloc_bytes",
                "alloc_table",
                "alloc_table",
                "upload_table",
                "scatter_table",
                "scatter_tables",
                "copy_table_spans",
                "gather_table",
                "fill_spans",
                "move_spans",
                "translate",
                "translate_many",
                "read_table",
                "read_bytes",
                "synchronize",
                "free_table",
                "free_table",
                "free_bytes"
            ]
        );
        assert!(outer.iter().all(|r| r.location.file() == file!()));
        assert_eq!(outer[0].location.line(), line);
        assert_eq!(outer[17].location.line(), last);
        assert_eq!(ledger.syncs(), 3);
        assert_eq!(dev.name(), "ledger(ledger(cpu))");
    }

    #[test]
    fn a_call_carries_its_item_count_and_permit() {
        #[derive(Debug, Default)]
        struct Items(Mutex<Vec<(DeviceOp, usize, Option<&'static str>)>>);
        impl DeviceHooks for Items {
            type Ticket = ();
            fn before<D: Device + ?Sized>(&self, _: &D, c: DeviceCall<'_>) -> Result<(), Error> {
                let reason = c.permit.map(HostSync::reason);
                self.0.lock().unwrap().push((c.op, c.items, reason));
                Ok(())
            }
            fn after<D: Device + ?Sized>(
                &self,
                _: &D,
                _: DeviceCall<'_>,
                _: (),
                _: Result<(), &Error>,
            ) {
            }
        }
        let dev = Intercepted::with_hooks(Arc::new(CpuDevice::new()), Items::default());
        let buf = dev.alloc_bytes(64, 0).unwrap();
        let t = dev.alloc_table(8, 0).unwrap();
        dev.upload_table(t, 0, &[1, 2, 3]).unwrap();
        dev.fill_spans(buf, &[ByteSpan { offset: 0, len: 8 }; 2], 1)
            .unwrap();
        let moves = [
            SpanMove {
                src: 0,
                dst: 16,
                len: 8,
            },
            SpanMove {
                src: 8,
                dst: 24,
                len: 8,
            },
        ];
        dev.move_spans(buf, &moves).unwrap();
        dev.synchronize(&HostSync::acquire("why")).unwrap();
        let seen = std::mem::take(&mut *dev.hooks().0.lock().unwrap());
        assert_eq!(
            seen,
            [
                (DeviceOp::AllocBytes, 1, None),
                (DeviceOp::AllocTable, 1, None),
                (DeviceOp::UploadTable, 3, None),
                (DeviceOp::FillSpans, 2, None),
                (DeviceOp::MoveSpans, 2, None),
                (DeviceOp::Synchronize, 1, Some("why")),
            ]
        );
    }

    #[test]
    fn a_refusal_names_the_call_site_through_nested_wrappers() {
        let faults = Arc::new(Intercepted::with_hooks(
            Arc::new(CpuDevice::new()),
            FaultHooks::default(),
        ));
        let outer: Arc<dyn Device> = Arc::new(Intercepted::with_hooks(faults.clone(), ()));
        faults.fail_at(0);
        let line = line!() + 1;
        let err = outer.alloc_table(1, 0).unwrap_err();
        let Error::InjectedFault { location, .. } = err else {
            panic!("{err:?}");
        };
        assert_eq!((location.file(), location.line()), (file!(), line));
    }
}
