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

/// What a step's metadata is shaped for, fixed at set-up by
/// [`crate::HybridCache::reserve_step_metadata`]: the lanes hold `requests` requests of
/// up to `max_len` rows, and every section of the step table is sized for a batch of
/// `requests` computing up to `max_new_tokens` tokens, so the table's layout — every
/// section's offset — is the same at every step (a CUDA graph captured once reads it).
/// A step that needs more grows the capacity (doubling; a device allocation, and a new
/// layout), as does the first build without a reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCapacity {
    /// Running requests at once (one lane each), and the batch the table is laid out for.
    pub requests: usize,
    /// The longest request, in tokens (rows).
    pub max_len: usize,
    /// The most tokens one step computes, over its whole batch (a decode batch's size,
    /// or the prefill budget plus the decodes beside it).
    pub max_new_tokens: usize,
    /// The most pages a step's admissions load back from the host tier, over the whole
    /// batch (0 without a host tier: the step table then has no load-back sections).
    pub max_loaded_pages: usize,
}

/// A capacity in the units the lanes and the table use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Lanes, and the batch the table is laid out for.
    pub(crate) requests: usize,
    /// Pages per lane.
    pub(crate) pages: usize,
    /// New tokens of a step.
    pub(crate) new_tokens: usize,
    /// Checkpoints a step saves.
    pub(crate) saves: usize,
    /// Pages a step's load-backs bring in.
    pub(crate) loads: usize,
}

impl Shape {
    /// Each of `self`'s fields that is short of `need`'s grown to at least twice its
    /// size (and to a power of two), the rest kept.
    pub(crate) fn grown_to(self, need: Shape) -> Shape {
        let grow = |have: usize, need: usize| {
            if need > have {
                need.next_power_of_two().max(2 * have)
            } else {
                have
            }
        };
        Shape {
            requests: grow(self.requests, need.requests),
            pages: grow(self.pages, need.pages),
            new_tokens: grow(self.new_tokens, need.new_tokens),
            saves: grow(self.saves, need.saves),
            loads: grow(self.loads, need.loads),
        }
    }

    /// Whether `need` fits.
    pub(crate) fn holds(self, need: Shape) -> bool {
        need.requests <= self.requests
            && need.pages <= self.pages
            && need.new_tokens <= self.new_tokens
            && need.saves <= self.saves
            && need.loads <= self.loads
    }
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

/// The lanes of a cache: one device table of `requests × pages` virtual pages, and the
/// capacity the step table is shaped for.
#[derive(Debug, Default)]
pub(crate) struct Lanes {
    table: Option<TableId>,
    shape: Shape,
    by_request: HashMap<u64, Lane, BuildHasherDefault<IdHasher>>,
    /// Lanes no request holds, below `next`.
    free: Vec<u32>,
    /// Lanes ever handed out (the rest of `0..shape.requests` is unused).
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
        self.shape.pages
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

    /// The capacity the lanes and the step table are shaped for (all zero before the
    /// first build or reservation).
    pub(crate) fn shape(&self) -> Shape {
        self.shape
    }

    /// Shapes the lanes for `shape` (a device allocation when the lanes grow; the old
    /// table's entries are not copied: every lane is rewritten at its next sync). Only
    /// grows.
    pub(crate) fn reserve(&mut self, device: &dyn Device, shape: Shape) -> Result<(), Error> {
        let shape = Shape {
            requests: shape.requests.max(self.shape.requests).max(1),
            pages: shape.pages.max(self.shape.pages).max(1),
            new_tokens: shape.new_tokens.max(self.shape.new_tokens).max(1),
            saves: shape.saves.max(self.shape.saves),
            loads: shape.loads.max(self.shape.loads),
        };
        let lanes_grow = self.table.is_none()
            || shape.requests != self.shape.requests
            || shape.pages != self.shape.pages;
        if lanes_grow {
            let entries = shape
                .pages
                .checked_mul(shape.requests)
                .filter(|&n| n <= i32::MAX as usize);
            let Some(entries) = entries else {
                return Err(Error::BadRequest {
                    request: u64::MAX,
                    reason: format!(
                        "{} lanes of {} pages do not fit the lane table's i32 indices",
                        shape.requests, shape.pages
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
            for lane in self.by_request.values_mut() {
                lane.written = 0;
            }
        }
        self.shape = shape;
        Ok(())
    }

    /// Lanes held, and those `batch` would add.
    pub(crate) fn held_with(&self, batch: impl Iterator<Item = u64>) -> usize {
        self.by_request.len() + batch.filter(|id| !self.by_request.contains_key(id)).count()
    }

    /// Gives every request of `batch` (id, row) a lane and writes the pages of its row
    /// its lane lacks, in one device op; returns each request's lane, in order. The
    /// caller shaped the lanes for the batch ([`Lanes::reserve`]). Host work
    /// O(batch + pages written). A failure writes nothing the lanes rely on.
    pub(crate) fn sync<'a>(
        &mut self,
        device: &dyn Device,
        batch: impl Iterator<Item = (u64, &'a [VirtualToken])> + Clone,
        page_size: usize,
        lanes_out: &mut Vec<u32>,
    ) -> Result<(), Error> {
        let Some(table) = self.table else {
            return Err(Error::BadRequest {
                request: u64::MAX,
                reason: "step lanes used before they were shaped".to_string(),
            });
        };
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
                    // Shaped for every lane held (checked by the caller's reserve).
                    debug_assert!((index as usize) < self.shape.requests);
                    let lane = Lane { index, written: 0 };
                    self.by_request.insert(id, lane);
                    lane
                }
            };
            lanes_out.push(lane.index);
            let base = lane.index as usize * self.shape.pages;
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
