//! `DeviceMemory`: the buffers and tables an allocator holds on its device, freed when it
//! drops. A constructor allocates through it, so a build refused halfway (a device out of
//! memory at its second table) frees what it had already allocated; the built allocator
//! keeps it, so dropping the allocator frees the same list through the same code.

use std::sync::Arc;
use unikv_kernels::{BytesId, Device, Error, TableId};

/// One buffer or table [`DeviceMemory`] holds.
#[derive(Clone, Copy, Debug)]
enum Held {
    Bytes(BytesId),
    Table(TableId),
}

/// Owns device allocations: each `alloc_*` that succeeds is recorded, and every recorded
/// allocation is freed, in allocation order, when this drops.
#[derive(Debug)]
pub(crate) struct DeviceMemory {
    device: Arc<dyn Device>,
    held: Vec<Held>,
}

impl DeviceMemory {
    /// Holds nothing yet on `device`.
    pub(crate) fn new(device: Arc<dyn Device>) -> DeviceMemory {
        DeviceMemory {
            device,
            held: Vec::new(),
        }
    }

    /// [`Device::alloc_bytes`], freed when this drops.
    #[track_caller]
    pub(crate) fn alloc_bytes(&mut self, len: u64, fill: u8) -> Result<BytesId, Error> {
        let buffer = self.device.alloc_bytes(len, fill)?;
        self.held.push(Held::Bytes(buffer));
        Ok(buffer)
    }

    /// [`Device::alloc_table`], freed when this drops.
    #[track_caller]
    pub(crate) fn alloc_table(&mut self, len: usize, fill: i32) -> Result<TableId, Error> {
        let table = self.device.alloc_table(len, fill)?;
        self.held.push(Held::Table(table));
        Ok(table)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        for held in self.held.drain(..) {
            // Tear-down (a dropped allocator or a refused build, which reports its own
            // error); a failed free here has nobody to report to.
            let _ = match held {
                Held::Bytes(buffer) => self.device.free_bytes(buffer),
                Held::Table(table) => self.device.free_table(table),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv_kernels::{CpuDevice, FaultInjector, SyncLedger};

    /// Everything allocated is freed on drop, in allocation order.
    #[test]
    fn dropping_frees_every_allocation_in_order() {
        let ledger = Arc::new(SyncLedger::cpu());
        let mut memory = DeviceMemory::new(ledger.clone());
        memory.alloc_bytes(64, 0).unwrap();
        memory.alloc_table(8, 0).unwrap();
        memory.alloc_table(4, 0).unwrap();
        ledger.reset();
        drop(memory);
        let frees: Vec<&str> = ledger.ops().iter().map(|r| r.op).collect();
        assert_eq!(frees, ["free_bytes", "free_table", "free_table"]);
    }

    /// A refused allocation is not held; dropping after it frees what came before, so
    /// nothing stays live on the device.
    #[test]
    fn a_refused_allocation_leaves_only_earlier_ones_to_free() {
        let cpu = Arc::new(CpuDevice::new());
        let faults = Arc::new(FaultInjector::new(cpu.clone()));
        let mut memory = DeviceMemory::new(faults.clone());
        memory.alloc_bytes(64, 0).unwrap();
        memory.alloc_table(8, 0).unwrap();
        faults.fail_at(0);
        assert!(memory.alloc_table(4, 0).is_err());
        assert_eq!(cpu.live_allocations(), 2);
        drop(memory);
        assert_eq!(cpu.live_allocations(), 0);
    }
}
