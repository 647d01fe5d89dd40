//! The argument lists a captured CUDA graph owns. A fused translation
//! (`translate_many`, `translate_windows`, `translate_lanes`) reads a list of table
//! addresses and shapes, not per-step data, so it may be captured: while
//! [`CudaDevice::capture`] records, its list goes into pinned memory and a device buffer
//! of the graph's own (the captured copy from the one to the other, and the launch that
//! reads the other, run at every replay), never into the shared staging ring that later
//! ops overwrite. Both stay untouched for the graph's life.
//!
//! A dropped [`CapturedGraph`](super::CapturedGraph) hands its lists to the device
//! ([`Orphans`]); the next step boundary fences them behind an event recorded after
//! every replay already enqueued (none can be enqueued any more), and frees them once the
//! event reports done, queried, never waited on, as retired rings are.

use super::{CudaDevice, State};
use crate::Error;
use crate::driver::{DevPtr, Driver, DriverCall, EventHandle, Pinned};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// One list a captured graph reads at every replay: its pinned bytes and the device
/// buffer the replay copies them into.
#[derive(Debug)]
pub(super) struct GraphList {
    pinned: Pinned,
    dev: DevPtr,
}

impl GraphList {
    /// Frees both halves; the caller knows no enqueued work uses them.
    pub(super) fn free(self, driver: &dyn Driver) -> Result<(), Error> {
        let freed = driver.free_unordered(self.dev);
        driver.free_pinned(self.pinned).and(freed)
    }
}

/// Lists of dropped graphs, waiting for the device's next step boundary, shared between
/// the device and every graph captured from it.
#[derive(Debug, Default)]
pub(super) struct Orphans {
    /// Set when the device dropped: its stream is idle and no replay can be enqueued, so a
    /// graph dropped later frees its lists at once.
    device_gone: bool,
    lists: Vec<GraphList>,
}

/// The shared [`Orphans`] of one device.
#[derive(Debug, Default)]
pub(super) struct SharedOrphans(Mutex<Orphans>);

impl SharedOrphans {
    fn lock(&self) -> MutexGuard<'_, Orphans> {
        // Every update is one push, take or assignment: a poisoned lock guards whole state.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A dropped graph's lists: kept for the device's step boundary, or freed at once when
    /// the device is gone (its drop waited for the stream).
    pub(super) fn adopt(&self, lists: Vec<GraphList>, driver: &dyn Driver) {
        let mut orphans = self.lock();
        if orphans.device_gone {
            drop(orphans);
            for list in lists {
                // Tear-down: a failure only leaks the memory of a graph going away.
                let _ = list.free(driver);
            }
        } else {
            orphans.lists.extend(lists);
        }
    }

    /// Every list waiting, and (`device_gone`) no more from now on.
    fn take(&self, device_gone: bool) -> Vec<GraphList> {
        let mut orphans = self.lock();
        orphans.device_gone |= device_gone;
        std::mem::take(&mut orphans.lists)
    }

    /// Puts lists back (a fence that could not be recorded).
    fn restore(&self, lists: Vec<GraphList>) {
        self.lock().lists.extend(lists);
    }
}

/// Lists of dropped graphs fenced behind an event, freed once it is done.
#[derive(Debug)]
pub(super) struct FencedLists {
    event: EventHandle,
    lists: Vec<GraphList>,
}

impl CudaDevice {
    /// Stages `st.pack` (not empty) for a graph being captured: into pinned memory and a
    /// device buffer of the graph's own, with a captured copy from one to the other.
    /// Returns the device address the captured launch reads; the graph keeps both.
    pub(super) fn stage_for_graph(
        &self,
        st: &mut State,
        op: &'static str,
    ) -> Result<DevPtr, Error> {
        let len = st.pack.len();
        let pinned = self.issue(op, DriverCall::PinnedAlloc { bytes: len as u64 }, |d| {
            d.alloc_pinned(len)
        })?;
        let dev = match self.issue(op, DriverCall::DeviceAlloc { bytes: len as u64 }, |d| {
            d.alloc_unordered(len)
        }) {
            Ok(dev) => dev,
            Err(e) => {
                let _ = self.issue(op, DriverCall::PinnedFree, |d| d.free_pinned(pinned));
                return Err(e);
            }
        };
        self.driver.write_pinned(&pinned, 0, &st.pack);
        let list = GraphList { pinned, dev };
        // Captured, not run: every replay copies the pinned bytes as they are then, which
        // nothing writes again.
        if let Err(e) = self.issue(op, DriverCall::CopyFromPinned { bytes: len as u64 }, |d| {
            d.copy_from_pinned(dev, &list.pinned, 0, len)
        }) {
            // Nothing that reads the list will run: free it now.
            let _ = self.free_graph_list(op, list);
            return Err(e);
        }
        st.graph_lists.push(list);
        Ok(dev)
    }

    /// Frees one list no enqueued work uses (each half one driver call, traced).
    pub(super) fn free_graph_list(&self, op: &'static str, list: GraphList) -> Result<(), Error> {
        let GraphList { pinned, dev } = list;
        let freed = self.issue(op, DriverCall::DeviceFree, |d| d.free_unordered(dev));
        self.issue(op, DriverCall::PinnedFree, |d| d.free_pinned(pinned))
            .and(freed)
    }

    /// The step boundary's part: fences the lists of graphs dropped since the last one
    /// behind an event recorded now (after every replay of theirs), and frees the fenced
    /// lists whose event is done (queried, never waited on).
    pub(super) fn release_graph_lists(
        &self,
        st: &mut State,
        op: &'static str,
    ) -> Result<(), Error> {
        let orphaned = self.orphans.take(false);
        if !orphaned.is_empty() {
            let event = match st.spare.pop() {
                Some(event) => event,
                None => match self.issue(op, DriverCall::EventCreate, |d| d.event_create()) {
                    Ok(event) => event,
                    Err(e) => {
                        self.orphans.restore(orphaned);
                        return Err(e);
                    }
                },
            };
            if let Err(e) = self.issue(op, DriverCall::EventRecord, |d| d.event_record(event)) {
                st.spare.push(event);
                self.orphans.restore(orphaned);
                return Err(e);
            }
            st.fenced_lists.push(FencedLists {
                event,
                lists: orphaned,
            });
        }
        let mut i = 0;
        while i < st.fenced_lists.len() {
            let event = st.fenced_lists[i].event;
            if !self.issue(op, DriverCall::EventQuery, |d| d.event_done(event))? {
                i += 1;
                continue;
            }
            let fenced = st.fenced_lists.swap_remove(i);
            st.spare.push(fenced.event);
            let mut freed = Ok(());
            for list in fenced.lists {
                // Every list is freed even when one fails; the first error is reported.
                freed = freed.and(self.free_graph_list(op, list));
            }
            freed?;
        }
        Ok(())
    }

    /// Tear-down (the device's drop, after its stream is idle): frees every list of a
    /// dropped graph, and makes graphs dropped later free theirs at once.
    pub(super) fn drop_graph_lists(st: &mut State, orphans: &SharedOrphans, driver: &dyn Driver) {
        let fenced = st.fenced_lists.drain(..).flat_map(|f| {
            let _ = driver.event_destroy(f.event);
            f.lists
        });
        let pending: Vec<GraphList> = fenced
            .chain(st.graph_lists.drain(..))
            .chain(orphans.take(true))
            .collect();
        for list in pending {
            // Tear-down: a failure only leaks memory of a device going away.
            let _ = list.free(driver);
        }
    }
}
