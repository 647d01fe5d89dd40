//! The cache's device tables: the step table, the two verify tables and the lanes
//! (lanes.rs), each grown when a step needs more than any before. A leaf: the step and
//! verify modules fill these tables, and the cache only owns and frees them.

mod lanes;

pub use lanes::StepCapacity;
pub(crate) use lanes::{Lanes, Shape};

use crate::error::Error;
use unikv_kernels::{Device, TableId};

/// One device table of `i32` entries and its length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Table {
    pub(crate) id: TableId,
    pub(crate) len: usize,
}

/// Every device table a cache owns.
#[derive(Debug, Default)]
pub(crate) struct DeviceTables {
    /// Step metadata (header and page tables).
    pub(crate) step: Option<Table>,
    /// Verify metadata's inputs, uploaded by the host.
    pub(crate) verify_inputs: Option<Table>,
    /// Verify metadata's outputs, translated on the device.
    pub(crate) verify_outputs: Option<Table>,
    /// Each running request's row of virtual pages (step metadata's source).
    pub(crate) lanes: Lanes,
}

impl DeviceTables {
    /// `table` made to hold `len` entries: kept when it does, else replaced by a new one
    /// of at least twice its length (the old one freed: set-up work, off the steady
    /// state, as a table only grows). On error `table` is as it was.
    pub(crate) fn grow(
        device: &dyn Device,
        table: &mut Option<Table>,
        len: usize,
    ) -> Result<TableId, Error> {
        match *table {
            Some(t) if t.len >= len => Ok(t.id),
            old => {
                let len = len.max(old.map_or(0, |t| 2 * t.len)).max(1024);
                let id = device.alloc_table(len, 0)?;
                if let Some(old) = old
                    && let Err(e) = device.free_table(old.id)
                {
                    // Nothing changes: the new table goes back, the old one stays in use.
                    let _ = device.free_table(id);
                    return Err(e.into());
                }
                *table = Some(Table { id, len });
                Ok(id)
            }
        }
    }

    /// Frees every table (a cache's drop): the device is left as the cache found it.
    pub(crate) fn free(&mut self, device: &dyn Device) {
        let tables = [
            self.step.take(),
            self.verify_inputs.take(),
            self.verify_outputs.take(),
        ];
        let lanes = self.lanes.table();
        for table in tables.into_iter().flatten().map(|t| t.id).chain(lanes) {
            // Nothing to report to: a failed free of a table no one reads only leaks it.
            let _ = device.free_table(table);
        }
    }
}

/// `n` as a table entry (`table`: which table, for the message), or the request's
/// [`Error::BadRequest`] when it does not fit an `i32`.
pub(crate) fn to_i32(request: u64, what: &str, table: &str, n: usize) -> Result<i32, Error> {
    i32::try_from(n).map_err(|_| Error::BadRequest {
        request,
        reason: format!("{what} {n} does not fit the {table} table's i32 entries"),
    })
}
