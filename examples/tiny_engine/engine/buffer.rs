//! The engine's memory is unikv's buffer: K/V rows written at the step's write locations
//! and read through its kernel ids ([`BufferKv`]), recurrent states in their slots.

use super::model::{KvStore, LayerKind, RC, States};
use unikv::kernels::{CpuDevice, Error as DeviceError, HostSync, Readback};
use unikv::mamba::SlotLayout;
use unikv::pools::Side;
use unikv::{KvGeometry, RequestStep, StepView};

/// The step table's entries, as the attention kernel reads them on the device (the
/// kernel's CPU twin reads them back: empty for an empty batch).
pub(super) fn step_table(cpu: &CpuDevice, view: &StepView<'_>) -> Result<Vec<i32>, DeviceError> {
    let Some(table) = view.device_table() else {
        return Ok(Vec::new());
    };
    let sync =
        HostSync::acquire("tiny engine: the attention kernel's CPU twin reads its page tables");
    cpu.read_table(&sync, table, 0, view.device_layout().len)
}

/// The K/V of one request's step, in unikv's buffer: writes go to the step's write
/// locations, reads through its kernel ids.
pub(super) struct BufferKv<'a> {
    pub(super) bytes: &'a mut [u8],
    pub(super) geo: KvGeometry,
    pub(super) step: RequestStep<'a>,
    /// The step table's entries (its page tables).
    pub(super) table: &'a [i32],
}

/// Reads `out.len()` little-endian `f32`s at byte `offset`.
pub(super) fn read_f32s(bytes: &[u8], offset: u64, out: &mut [f32]) {
    let b = &bytes[offset as usize..offset as usize + 4 * out.len()];
    for i in 0..out.len() {
        out[i] = f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
    }
}

/// Writes `values` as little-endian `f32`s at byte `offset`.
pub(super) fn write_f32s(bytes: &mut [u8], offset: u64, values: &[f32]) {
    let b = &mut bytes[offset as usize..offset as usize + 4 * values.len()];
    for (c, v) in b.chunks_exact_mut(4).zip(values) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

/// Writes one token's K and V rows of `layer` at kernel id `id` on `side`.
fn write_kv(
    bytes: &mut [u8],
    geo: &KvGeometry,
    side: Side,
    id: i32,
    layer: u32,
    k: &[f32],
    v: &[f32],
) {
    write_f32s(bytes, geo.row_offset(side, id, layer, false), k);
    write_f32s(bytes, geo.row_offset(side, id, layer, true), v);
}

/// Reads one token's K and V rows of `layer` at kernel id `id` on `side`.
fn read_kv(
    bytes: &[u8],
    geo: &KvGeometry,
    side: Side,
    id: i32,
    layer: u32,
    k: &mut [f32],
    v: &mut [f32],
) {
    read_f32s(bytes, geo.row_offset(side, id, layer, false), k);
    read_f32s(bytes, geo.row_offset(side, id, layer, true), v);
}

impl BufferKv<'_> {
    /// The pool side and layer index of an attention layer.
    fn side(layer: LayerKind) -> (Side, u32) {
        match layer {
            LayerKind::Full(i) => (Side::Full, i),
            LayerKind::Swa(i) => (Side::Swa, i),
            LayerKind::Recurrent(_) => unreachable!("no K/V"),
        }
    }

    /// The kernel id of row `pos` on `side` (SWA rows only inside the step's window).
    fn id(&self, side: Side, pos: usize) -> i32 {
        match side {
            Side::Full => self.step.full_id(self.table, pos).unwrap_or_else(|| {
                panic!(
                    "position {pos} is past the request's {} rows",
                    self.step.len
                )
            }),
            _ => self.step.swa_id(self.table, pos).unwrap_or_else(|| {
                panic!(
                    "position {pos} is outside the SWA metadata [{}, {})",
                    self.step.swa_first, self.step.len
                )
            }),
        }
    }
}

impl KvStore for BufferKv<'_> {
    fn write(&mut self, layer: LayerKind, pos: usize, k: &[f32], v: &[f32]) {
        let (side, l) = Self::side(layer);
        let i = pos - self.step.first_query();
        let id = match side {
            Side::Full => self.step.write_full[i],
            _ => self.step.write_swa[i],
        };
        write_kv(self.bytes, &self.geo, side, id, l, k, v);
    }

    fn read(&self, layer: LayerKind, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let (side, l) = Self::side(layer);
        let id = self.id(side, pos);
        read_kv(self.bytes, &self.geo, side, id, l, k, v);
    }
}

/// K/V in unikv's buffer addressed by position: row `pos` of FULL (and SWA) layers at
/// kernel id `full[pos]` (`swa[pos]`), for reads and writes alike. A verify position's
/// ids are the settled rows' then its ancestors' in the draft tree, its own last.
pub(super) struct IdKv<'a> {
    pub(super) bytes: &'a mut [u8],
    pub(super) geo: KvGeometry,
    pub(super) full: &'a [i32],
    pub(super) swa: &'a [i32],
}

impl IdKv<'_> {
    fn id(&self, layer: LayerKind, pos: usize) -> (Side, u32, i32) {
        let (side, l) = BufferKv::side(layer);
        let ids = if side == Side::Full {
            self.full
        } else {
            self.swa
        };
        let id = ids[pos];
        assert!(id > 0, "{side:?} position {pos} has no row");
        (side, l, id)
    }
}

impl KvStore for IdKv<'_> {
    fn write(&mut self, layer: LayerKind, pos: usize, k: &[f32], v: &[f32]) {
        let (side, l, id) = self.id(layer, pos);
        write_kv(self.bytes, &self.geo, side, id, l, k, v);
    }

    fn read(&self, layer: LayerKind, pos: usize, k: &mut [f32], v: &mut [f32]) {
        let (side, l, id) = self.id(layer, pos);
        read_kv(self.bytes, &self.geo, side, id, l, k, v);
    }
}

/// Reads every recurrent layer's conv and temporal state from physical slot `slot`.
pub(super) fn load_states(
    bytes: &[u8],
    geo: &KvGeometry,
    layout: &SlotLayout,
    slot: u32,
    states: &mut States,
) {
    load_states_at(bytes, geo.slot_offset(slot), layout, states);
}

/// [`load_states`] from the slot at byte `base`.
pub(super) fn load_states_at(bytes: &[u8], base: u64, layout: &SlotLayout, states: &mut States) {
    for (l, s) in states.iter_mut().enumerate() {
        let (conv, temporal) = s.split_at_mut(RC);
        read_f32s(bytes, base + layout.conv(l as u32).unwrap().start, conv);
        read_f32s(
            bytes,
            base + layout.temporal(l as u32).unwrap().start,
            temporal,
        );
    }
}

/// Writes every recurrent layer's conv and temporal state into physical slot `slot`.
pub(super) fn store_states(
    bytes: &mut [u8],
    geo: &KvGeometry,
    layout: &SlotLayout,
    slot: u32,
    states: &States,
) {
    store_states_at(bytes, geo.slot_offset(slot), layout, states);
}

/// [`store_states`] into the slot at byte `base`.
pub(super) fn store_states_at(bytes: &mut [u8], base: u64, layout: &SlotLayout, states: &States) {
    for (l, s) in states.iter().enumerate() {
        let (conv, temporal) = s.split_at(RC);
        write_f32s(bytes, base + layout.conv(l as u32).unwrap().start, conv);
        write_f32s(
            bytes,
            base + layout.temporal(l as u32).unwrap().start,
            temporal,
        );
    }
}
