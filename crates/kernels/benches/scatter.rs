//! Host cost of a mirror upload at page size 1: one step's changes to a FULL and an SWA
//! table of 1 Mi entries each, half of them a prefill's run and half a decode batch's
//! scattered pages, every page changed twice (a bind, then a release or tombstone). As
//! `scatter_tables` of the entries in change order (the static pool's upload) and as
//! `copy_table_spans` of the changed spans (the unified pool's), on the CPU device and on
//! the CUDA backend over its emulated driver (whose host-side packing and
//! de-duplication are what a GPU machine pays for; the emulated kernel adds its own CPU
//! time to both).
//!
//! `cargo bench -p unikv-kernels --bench scatter`

use divan::Bencher;
use unikv_kernels::{CpuDevice, CudaDevice, Device, TableId, TableScatter, TableSpans};

fn main() {
    divan::main();
}

const TABLE: usize = 1 << 20;

/// `pages` pages of a prefill (a run) and of a decode batch (scattered), each entry
/// written twice, the second time to its final value.
fn entries(pages: u32) -> Vec<(u32, i32)> {
    let run = (1..=pages / 2).map(|v| (v, v as i32));
    let scattered = (0..pages / 2).map(|i| (1 + (i * 7919) % (TABLE as u32 - 1), i as i32 + 1));
    let first: Vec<(u32, i32)> = run.chain(scattered).collect();
    let second = first.iter().map(|&(v, _)| (v, 0));
    first.iter().copied().chain(second).collect()
}

fn upload(bencher: Bencher<'_, '_>, dev: &dyn Device, pages: u32) {
    let (full, swa) = (
        dev.alloc_table(TABLE, 0).unwrap(),
        dev.alloc_table(TABLE, 0).unwrap(),
    );
    let (a, b) = (entries(pages), entries(pages));
    let scatters = |t: (TableId, TableId)| {
        [
            TableScatter {
                table: t.0,
                entries: &a,
            },
            TableScatter {
                table: t.1,
                entries: &b,
            },
        ]
    };
    let s = scatters((full, swa));
    bencher
        .counter(divan::counter::ItemsCount::new(4 * pages as usize))
        .bench_local(|| dev.scatter_tables(&s).unwrap());
}

/// The same changes as spans of a host table: the run is one span, each scattered page
/// one (twice: bound, then released).
fn copy(bencher: Bencher<'_, '_>, dev: &dyn Device, pages: u32) {
    let (full, swa) = (
        dev.alloc_table(TABLE, 0).unwrap(),
        dev.alloc_table(TABLE, 0).unwrap(),
    );
    let host = vec![0; TABLE];
    let first = entries(pages)[pages as usize / 2..pages as usize].to_vec();
    let spans: Vec<(u32, u32)> = std::iter::once((1, pages / 2))
        .chain(first.iter().chain(&first).map(|&(v, _)| (v, 1)))
        .collect();
    let copies = [
        TableSpans {
            table: full,
            values: &host,
            spans: &spans,
        },
        TableSpans {
            table: swa,
            values: &host,
            spans: &spans,
        },
    ];
    bencher
        .counter(divan::counter::ItemsCount::new(4 * pages as usize))
        .bench_local(|| dev.copy_table_spans(&copies).unwrap());
}

#[divan::bench(args = [256, 4096])]
fn cpu_copy(bencher: Bencher<'_, '_>, pages: u32) {
    copy(bencher, &CpuDevice::new(), pages);
}

#[divan::bench(args = [256, 4096])]
fn cuda_emulated_copy(bencher: Bencher<'_, '_>, pages: u32) {
    let dev = CudaDevice::emulated();
    copy(bencher, &dev, pages);
}

#[divan::bench(args = [256, 4096])]
fn cpu(bencher: Bencher<'_, '_>, pages: u32) {
    upload(bencher, &CpuDevice::new(), pages);
}

#[divan::bench(args = [256, 4096])]
fn cuda_emulated(bencher: Bencher<'_, '_>, pages: u32) {
    let dev = CudaDevice::emulated();
    upload(bencher, &dev, pages);
}
