//! Lanes: each running request's row as a persistent device row of virtual pages, so a
//! step writes only the pages it added and the page tables kernels read are translated
//! on the device ([`unikv_kernels::Device::translate_lanes`]).
//!
//! A request gets a lane the first time step metadata is built for it and keeps it until
//! it finishes or is released. The cache tells the lanes which rows changed below what
//! was written (a `cache_unfinished` that makes the row read the tree's values, a settle
//! that truncates it); everything else only appends. Virtual pages never move
//! (compaction rewrites only the `v2p` mirror), so a written entry stays right until its
//! row changes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use unikv_kernels::{Device, TableId, TableScatter};
use unikv_pools::VirtualToken;

use crate::error::Error;

/// How many requests and pages the lanes hold, fixed at set-up by
/// [`crate::HybridCache::reserve_step_metadata`] (the lanes also grow on their own when
/// a step needs more: a device allocation, off the steady state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCapacity {
    /// Running requests at once (one lane each).
    pub requests: usize,
    /// The longest request, in tokens (rows).
    pub max_len: usize,
}

/// Request ids are a cache's counter: they hash to themselves.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id;
    }
}

/// One request's lane.
#[derive(Clone, Copy, Debug)]
struct Lane {
    index: u32,
    /// Leading entries that hold the request's virtual pages.
    written: usize,
}

/// The lanes of a cache: one device table of `count × len` virtual pages.
#[derive(Debug, Default)]
pub(crate) struct Lanes {
    table: Option<TableId>,
    /// Entries (pages) per lane.
    len: usize,
    /// Lanes in the table.
    count: usize,
    by_request: HashMap<u64, Lane, BuildHasherDefault<IdHasher>>,
    /// Lanes no request holds, below `next`.
    free: Vec<u32>,
    /// Lanes ever handed out (the rest of `0..count` is unused).
    next: u32,
    /// The entries one sync writes (reused).
    entries: Vec<(u32, i32)>,
}

impl Lanes {
    /// The lane table (`None` before the first build).
    pub(crate) fn table(&self) -> Option<TableId> {
        self.table
    }

    /// Entries per lane.
    pub(crate) fn lane_len(&self) -> usize {
        self.len
    }

    /// Rows of request `request` from row `row` on changed: its lane is rewritten from
    /// there at the next sync.
    pub(crate) fn invalidate(&mut self, request: u64, row: usize, page_size: usize) {
        if let Some(lane) = self.by_request.get_mut(&request) {
            lane.written = lane.written.min(row / page_size);
        }
    }

    /// Request `request` finished or was released: its lane is free.
    pub(crate) fn release(&mut self, request: u64) {
        if let Some(lane) = self.by_request.remove(&request) {
            self.free.push(lane.index);
        }
    }

    /// Makes the table hold at least `capacity` (a device allocation when it grows; the
    /// old table's entries are not copied: every lane is rewritten at its next sync).
    pub(crate) fn reserve(
        &mut self,
        device: &dyn Device,
        capacity: StepCapacity,
        page_size: usize,
    ) -> Result<(), Error> {
        let len = capacity.max_len.div_ceil(page_size).max(self.len).max(1);
        let count = capacity.requests.max(self.count).max(1);
        if self.table.is_some() && len == self.len && count == self.count {
            return Ok(());
        }
        let entries = len.checked_mul(count).filter(|&n| n <= i32::MAX as usize);
        let Some(entries) = entries else {
            return Err(Error::BadRequest {
                request: u64::MAX,
                reason: format!(
                    "{count} lanes of {len} pages do not fit the lane table's i32 indices"
                ),
            });
        };
        let table = device.alloc_table(entries, 0)?;
        if let Some(old) = self.table
            && let Err(e) = device.free_table(old)
        {
            // Nothing changes: the new table goes back, the old one stays in use.
            let _ = device.free_table(table);
            return Err(e.into());
        }
        self.table = Some(table);
        self.len = len;
        self.count = count;
        for lane in self.by_request.values_mut() {
            lane.written = 0;
        }
        Ok(())
    }

    /// Gives every request of `batch` (id, row) a lane and writes the pages of its row
    /// its lane lacks, in one device op; returns each request's lane, in order. Grows the
    /// table first when the batch needs more lanes or longer ones (doubling). Host work
    /// O(batch + pages written). A failure writes nothing the lanes rely on.
    pub(crate) fn sync<'a>(
        &mut self,
        device: &dyn Device,
        batch: impl Iterator<Item = (u64, &'a [VirtualToken])> + Clone,
        page_size: usize,
        lanes_out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        let (mut new_lanes, mut longest) = (0usize, 0usize);
        for (id, row) in batch.clone() {
            new_lanes += usize::from(!self.by_request.contains_key(&id));
            longest = longest.max(row.len().div_ceil(page_size));
        }
        let held = self.by_request.len();
        if self.table.is_none() || held + new_lanes > self.count || longest > self.len {
            let grow = |have: usize, need: usize| {
                if need > have {
                    need.next_power_of_two().max(2 * have)
                } else {
                    have
                }
            };
            let capacity = StepCapacity {
                requests: grow(self.count, held + new_lanes),
                max_len: grow(self.len, longest) * page_size,
            };
            self.reserve(device, capacity, page_size)?;
        }
        let table = self.table.expect("reserved above");
        lanes_out.clear();
        self.entries.clear();
        let batch_again = batch.clone();
        for (id, row) in batch {
            let lane = match self.by_request.get(&id) {
                Some(&lane) => lane,
                None => {
                    let index = self.free.pop().unwrap_or_else(|| {
                        self.next += 1;
                        self.next - 1
                    });
                    let lane = Lane { index, written: 0 };
                    self.by_request.insert(id, lane);
                    lane
                }
            };
            lanes_out.push(lane.index);
            let base = lane.index as usize * self.len;
            let pages = row.len().div_ceil(page_size);
            for page in lane.written..pages {
                // Every token of a page is on the page of its first token.
                let vpage = row[page * page_size].0 as usize / page_size;
                // In range: the table's entries fit i32 (checked at reserve).
                self.entries.push(((base + page) as u32, vpage as i32));
            }
        }
        if !self.entries.is_empty() {
            device.scatter_tables(&[TableScatter {
                table,
                entries: &self.entries,
            }])?;
        }
        // Issued: the lanes hold the rows now.
        for (id, row) in batch_again {
            if let Some(lane) = self.by_request.get_mut(&id) {
                lane.written = row.len().div_ceil(page_size);
            }
        }
        Ok(())
    }
}
