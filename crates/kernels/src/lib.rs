//! The device layer of unikv: a [`Device`] trait whose ops all have host-known output
//! shapes, the CPU reference backend, a recording wrapper that counts syncs, and the
//! CUDA backend behind the `cuda` feature.
//!
//! # Invariants this crate keeps
//! - No method of [`Device`] waits for the device or returns a value whose size depends
//!   on device data. Waiting ops live on [`Readback`] and need a [`HostSync`] permit.
//! - Without the `cuda` feature the CUDA API exists and returns
//!   [`Error::NotCompiledWithCuda`]; with it, a machine without a driver gets
//!   [`Error::NoCudaDriver`], never a panic.

mod device;
mod error;

pub use device::{ByteSpan, BytesId, Device, HostSync, Readback, SpanMove, TableId, Translate};
pub use error::Error;
