//! The overlap benchmark (`unikv bench-overlap`): with unikv under an overlap scheduler,
//! does the GPU go from one forward to the next with no gap that unikv causes?
//!
//! Each cell replays a workload through the scheduler on the CUDA backend as an overlap
//! scheduler runs it ([`scheduler::run_overlapped`]): after step N's unikv work the host
//! launches "forward N" — a spin kernel calibrated to a stated duration, between two
//! [`TimedEvent`]s — then waits for forward N-1 to end (the engine needs its tokens to
//! schedule the next step; never unikv's wait), so step N+1's work (frees, admissions,
//! allocations, eviction, metadata build and upload, the boundary) runs on the host while
//! forward N runs on the GPU; then forward N+1 is launched. The GPU idle between two
//! forwards is the time from one forward's end event to the next one's start event, read
//! only after the loop. Every cell runs twice, one arm per [`FreePath`]: unikv's, and a
//! syncing baseline whose KV segment frees each read a value back from the device first
//! (a device-to-host copy and a stream wait, as the seed's `nonzero` did), so it shows
//! the idle the seed describes.
//!
//! The report also gives the launch gap of two back-to-back spins with no host work
//! between them: the least idle any loop can have. On the emulated driver
//! ([`CudaDevice::emulated_clocked`]) the spins are host time and the other kernels take
//! none, so it checks the loop, not the GPU; on a GPU the figures are the issue's.

use crate::config::RunConfig;
use crate::error::ReplayError;
use crate::scheduler;
use crate::stats::percentile;
use serde::Serialize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use unikv::kernels::{CudaDevice, Device, HostSync, Readback, SyncLedger, TableId, TimedEvent};
use unikv::pools::{FreeOp, Hooks, KvAllocator};
use unikv_workload::Workload;

/// The schema name of `unikv bench-overlap --json`'s object.
pub const SCHEMA: &str = "unikv.bench-overlap.v1";

/// The free path of one arm of a cell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FreePath {
    /// unikv's: nothing on the scheduling path waits for the device.
    Unikv,
    /// The seed's: every KV segment free (two-sided, FULL-only, SWA-only, a finishing
    /// row) first copies a value from the device and waits for the stream, as the seed's
    /// `nonzero` on a device mask did.
    Syncing,
}

impl FreePath {
    /// Both, unikv's first.
    pub const ALL: [FreePath; 2] = [FreePath::Unikv, FreePath::Syncing];
}

/// One cell: a workload replayed with a configuration (its page size, speculation).
#[derive(Clone, Copy, Debug)]
pub struct Cell<'a> {
    /// The workload.
    pub workload: &'a Workload,
    /// The run's configuration (its `backend` is not used: the cell runs on the
    /// benchmark's device).
    pub config: &'a RunConfig,
}

/// Median, 99th percentile (nearest rank) and maximum of a series, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Spread {
    /// Values measured.
    pub count: u64,
    /// Median.
    pub median_ns: u64,
    /// 99th percentile.
    pub p99_ns: u64,
    /// Largest.
    pub max_ns: u64,
}

impl Spread {
    /// The spread of `values` (any order).
    pub fn of(mut values: Vec<u64>) -> Spread {
        values.sort_unstable();
        Spread {
            count: values.len() as u64,
            median_ns: percentile(&values, 50.0).unwrap_or(0),
            p99_ns: percentile(&values, 99.0).unwrap_or(0),
            max_ns: values.last().copied().unwrap_or(0),
        }
    }
}

/// One arm of a cell: what the GPU did between forwards.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Arm {
    /// Its free path.
    pub path: FreePath,
    /// Forwards launched (one per step).
    pub forwards: u64,
    /// GPU idle between consecutive forwards.
    pub idle: Spread,
    /// The forwards' own GPU time.
    pub forward: Spread,
    /// The host's wall time per step, from the end of one forward's launch (and the
    /// engine's wait) to the next launch: the step's unikv and scheduler work (on the
    /// emulated driver also the kernels, which run on the host). The GPU idles when it
    /// exceeds the forward.
    pub host_step: Spread,
    /// Median idle as a fraction of the median forward.
    pub idle_fraction_median: f64,
    /// 99th-percentile idle as a fraction of the median forward.
    pub idle_fraction_p99: f64,
    /// Host syncs the steps made while a forward ran (every step's but the first, whose
    /// work, and the cache's set-up, came before any forward): 0 on unikv's path.
    pub host_syncs: u64,
    /// The run's wall time, loop and final wait, in nanoseconds.
    pub wall_ns: u64,
}

/// One cell's two arms.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The workload's name.
    pub workload: String,
    /// Tokens per page.
    pub page_size: u32,
    /// The layout.
    pub layout: String,
    /// Speculative decoding (`--spec` spelling), or `None`.
    pub speculation: Option<String>,
    /// unikv's arm.
    pub unikv: Arm,
    /// The syncing baseline.
    pub syncing: Arm,
    /// Whether unikv's arm meets the target: median idle under 1 % of the forward, and
    /// 99th-percentile idle no more than the back-to-back launch gap's.
    pub meets_target: bool,
}

/// What `unikv bench-overlap` reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OverlapReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// The device (`cuda:0`, `emulated-cuda`) and, on a GPU, its name and driver.
    pub device: String,
    /// The forward's stated duration, in nanoseconds.
    pub forward_target_ns: u64,
    /// Spin cycles the calibration gives that duration.
    pub forward_cycles: u64,
    /// The idle between two back-to-back forwards with no host work between them.
    pub launch_gap: Spread,
    /// One row per cell, in order.
    pub rows: Vec<Row>,
}

impl OverlapReport {
    /// Whether every row meets the target.
    pub fn pass(&self) -> bool {
        self.rows.iter().all(|r| r.meets_target)
    }

    /// The table `unikv bench-overlap` prints.
    pub fn table(&self) -> String {
        let us = |ns: u64| ns as f64 / 1e3;
        let mut out = format!(
            "unikv bench-overlap · {} · forward {:.3} ms ({} cycles) · back-to-back launch gap median {:.1} µs, p99 {:.1} µs\n",
            self.device,
            self.forward_target_ns as f64 / 1e6,
            self.forward_cycles,
            us(self.launch_gap.median_ns),
            us(self.launch_gap.p99_ns),
        );
        out += &format!(
            "{:<17} {:>4} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>7} {:>11} {:>6}  {}\n",
            "workload",
            "ps",
            "idle med",
            "idle p99",
            "% fwd",
            "host med",
            "host p99",
            "sync med",
            "sync p99",
            "% fwd",
            "syncs/step",
            "target",
            "speculation",
        );
        for r in &self.rows {
            let per_step = r.syncing.host_syncs as f64 / r.syncing.forwards.max(1) as f64;
            out += &format!(
                "{:<17} {:>4} {:>9.1} {:>9.1} {:>6.2}% {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>6.2}% {:>11.2} {:>6}  {}\n",
                r.workload,
                r.page_size,
                us(r.unikv.idle.median_ns),
                us(r.unikv.idle.p99_ns),
                100.0 * r.unikv.idle_fraction_median,
                us(r.unikv.host_step.median_ns),
                us(r.unikv.host_step.p99_ns),
                us(r.syncing.idle.median_ns),
                us(r.syncing.idle.p99_ns),
                100.0 * r.syncing.idle_fraction_median,
                per_step,
                if r.meets_target { "met" } else { "MISSED" },
                r.speculation.as_deref().unwrap_or("-"),
            );
        }
        out += "idle: µs between consecutive forwards (GPU events, read after the loop); % fwd: median idle / median forward;\nhost: µs of host work per step (unikv's and the scheduler's; on the emulated driver the kernels too);\nsync: the syncing baseline (a read-back per KV segment free)\n";
        out
    }
}

/// Runs the benchmark on `device`: calibrates the forward to `forward`, measures the
/// back-to-back launch gap, then each cell with both free paths, calling `progress` with
/// each finished row.
///
/// Errors: the device's, or a cell's run ([`ReplayError`]).
pub fn bench(
    device: &Arc<CudaDevice>,
    device_name: String,
    forward: Duration,
    cells: &[Cell<'_>],
    progress: &mut dyn FnMut(&Row),
) -> Result<OverlapReport, ReplayError> {
    let cycles = calibrate(device, forward)?;
    let launch_gap = launch_gap(device, cycles)?;
    let mut rows = Vec::with_capacity(cells.len());
    for cell in cells {
        let [unikv, syncing] = FreePath::ALL.map(|path| run_arm(device, cell, path, cycles));
        let (unikv, syncing) = (unikv?, syncing?);
        let meets_target =
            unikv.idle_fraction_median < 0.01 && unikv.idle.p99_ns <= launch_gap.p99_ns;
        let row = Row {
            workload: cell.workload.name.clone(),
            page_size: cell.config.page_size,
            layout: cell.config.layout.as_str().to_string(),
            speculation: cell.config.speculation.map(|s| s.to_string()),
            unikv,
            syncing,
            meets_target,
        };
        progress(&row);
        rows.push(row);
    }
    Ok(OverlapReport {
        schema: SCHEMA,
        device: device_name,
        forward_target_ns: forward.as_nanos() as u64,
        forward_cycles: cycles,
        launch_gap,
        rows,
    })
}

/// Waits for the stream (the benchmark's reads happen after its loops only).
fn wait(device: &CudaDevice) -> Result<(), ReplayError> {
    let sync = HostSync::acquire("overlap benchmark: read its events after the loop");
    Readback::synchronize(device, &sync).map_err(ReplayError::from)
}

/// Spin cycles for a forward of `target`: a probe spin's GPU time gives the clock rate
/// (the median of five), checked by a spin of the result.
fn calibrate(device: &CudaDevice, target: Duration) -> Result<u64, ReplayError> {
    const PROBE: u64 = 2_000_000;
    let mut times = Vec::new();
    for _ in 0..5 {
        let start = device.record_timed_event()?;
        device.launch_spin(PROBE)?;
        let end = device.record_timed_event()?;
        wait(device)?;
        times.push(end.elapsed_since(&start)?.as_nanos() as u64);
    }
    let probe_ns = Spread::of(times).median_ns.max(1);
    let cycles = (target.as_nanos() as f64 * PROBE as f64 / probe_ns as f64).round();
    Ok((cycles as u64).max(1))
}

/// The idle between two spins launched back to back, nothing between them: 100 pairs,
/// each spin a tenth of a forward (the gap does not depend on the length).
fn launch_gap(device: &CudaDevice, cycles: u64) -> Result<Spread, ReplayError> {
    let cycles = (cycles / 10).max(1);
    let mut gaps = Vec::with_capacity(100);
    for _ in 0..100 {
        let [first, second] = [(); 2].map(|()| forward_events(device, cycles));
        let ((_, first_end), (second_start, _)) = (first?, second?);
        wait(device)?;
        gaps.push(second_start.elapsed_since(&first_end)?.as_nanos() as u64);
    }
    Ok(Spread::of(gaps))
}

/// Polls `event` until the stream has reached it (the engine's wait for a forward's
/// output, outside unikv).
fn wait_for(event: &TimedEvent) -> Result<(), ReplayError> {
    while !event.is_done()? {
        std::thread::yield_now();
    }
    Ok(())
}

/// Launches one forward between two timed events, without waiting.
fn forward_events(
    device: &CudaDevice,
    cycles: u64,
) -> Result<(TimedEvent, TimedEvent), ReplayError> {
    let start = device.record_timed_event()?;
    device.launch_spin(cycles)?;
    let end = device.record_timed_event()?;
    Ok((start, end))
}

/// One arm: the cell's run on `device` with a forward launched after every step.
fn run_arm(
    device: &Arc<CudaDevice>,
    cell: &Cell<'_>,
    path: FreePath,
    cycles: u64,
) -> Result<Arm, ReplayError> {
    let ledger = Arc::new(SyncLedger::new(device.clone() as Arc<dyn Readback>));
    let syncing = match path {
        FreePath::Unikv => None,
        FreePath::Syncing => Some(SyncingFrees::new(ledger.clone())?),
    };
    let failed = syncing.as_ref().map(|s| s.failed.clone());
    let probe = syncing.as_ref().map(|s| s.probe);
    let mut forwards: Vec<(TimedEvent, TimedEvent)> = Vec::new();
    let mut host_syncs = 0;
    let mut host_step = Vec::new();
    let mut launched: Option<Instant> = None;
    let started = Instant::now();
    scheduler::run_overlapped(
        cell.workload,
        cell.config,
        ledger.clone(),
        syncing,
        &mut |step| {
            if let Some(at) = launched {
                host_step.push(at.elapsed().as_nanos() as u64);
            }
            // The step's own syncs (the scheduler forgets them after this call); step 0's
            // work, the cache's set-up with it, ran before any forward.
            if step > 0 {
                host_syncs += ledger.syncs() as u64;
            }
            // The step boundary an engine gives the device before its forward.
            device.end_step()?;
            forwards.push(forward_events(device, cycles)?);
            // The engine's own wait: it needs forward N - 1's tokens before it schedules
            // step N + 1, so the host never runs more than one step ahead of the GPU.
            if let Some(previous) = forwards.len().checked_sub(2).map(|i| &forwards[i].1) {
                wait_for(previous)?;
            }
            launched = Some(Instant::now());
            Ok(())
        },
    )?;
    wait(device)?;
    let wall_ns = started.elapsed().as_nanos() as u64;
    if let Some(e) = failed.and_then(|f| f.lock().unwrap_or_else(PoisonError::into_inner).take()) {
        return Err(e.into());
    }
    if let Some(probe) = probe {
        ledger.free_table(probe)?;
    }
    let elapsed = |to: &TimedEvent, from: &TimedEvent| {
        to.elapsed_since(from)
            .map(|d| d.as_nanos() as u64)
            .map_err(ReplayError::from)
    };
    let forward = Spread::of(
        forwards
            .iter()
            .map(|(start, end)| elapsed(end, start))
            .collect::<Result<_, _>>()?,
    );
    let idle = Spread::of(
        forwards
            .windows(2)
            .map(|w| elapsed(&w[1].0, &w[0].1))
            .collect::<Result<_, _>>()?,
    );
    let fraction = |ns: u64| ns as f64 / forward.median_ns.max(1) as f64;
    Ok(Arm {
        path,
        forwards: forwards.len() as u64,
        idle_fraction_median: fraction(idle.median_ns),
        idle_fraction_p99: fraction(idle.p99_ns),
        idle,
        forward,
        host_step: Spread::of(host_step),
        host_syncs,
        wall_ns,
    })
}

/// The syncing baseline's hooks: every KV segment free first reads one value back from
/// the device (a device-to-host copy and a stream wait), as the seed's free path did.
#[derive(Debug)]
struct SyncingFrees {
    ledger: Arc<SyncLedger>,
    /// A one-entry table the read-back copies.
    probe: TableId,
    /// The first read-back that failed (a hook cannot fail a free).
    failed: Arc<Mutex<Option<unikv::kernels::Error>>>,
}

impl SyncingFrees {
    fn new(ledger: Arc<SyncLedger>) -> Result<SyncingFrees, ReplayError> {
        let probe = ledger.alloc_table(1, 0)?;
        Ok(SyncingFrees {
            ledger,
            probe,
            failed: Arc::default(),
        })
    }
}

impl Hooks for SyncingFrees {
    fn forward_free(&mut self, _inner: &dyn KvAllocator, op: FreeOp<'_>) -> bool {
        if matches!(
            op,
            FreeOp::Segment(_)
                | FreeOp::FullSegment(_)
                | FreeOp::SwaSegment(_)
                | FreeOp::KvRow { .. }
        ) {
            let sync = HostSync::acquire("the syncing baseline: the seed's nonzero on a free");
            if let Err(e) = self.ledger.read_table(&sync, self.probe, 0, 1) {
                self.failed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(e);
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv::Layout;
    use unikv::invariants::Level;
    use unikv_workload::Preset;

    /// The smoke workload at page size 1 with 10 ms forwards on the clocked emulation:
    /// several times a debug build's step, even on a loaded machine (at 2 ms, a step of
    /// the matrix's busiest cells took 2.3 ms).
    fn smoke_report() -> OverlapReport {
        let model = unikv::ModelSpec::GPT_OSS_20B;
        let memory = 64 << 20;
        let workload = Preset::Smoke.build_for(1, &model, memory);
        let mut config = RunConfig::new(model, Layout::Unified, 1, memory);
        config.invariant_level = Level::Off;
        let device = Arc::new(CudaDevice::emulated_clocked());
        let cells = [Cell {
            workload: &workload,
            config: &config,
        }];
        let mut rows = 0;
        let report = bench(
            &device,
            "emulated-cuda".into(),
            Duration::from_millis(10),
            &cells,
            &mut |_| rows += 1,
        )
        .unwrap();
        assert_eq!(rows, 1);
        report
    }

    /// unikv's arm launches every forward while the one before runs, so the stream goes
    /// from one to the next with no idle at all on the emulation; the syncing baseline
    /// waits for the forward at each KV free, then finishes the step's work while the
    /// stream has nothing to run: idle, and a host sync, at each such step.
    #[test]
    fn unikv_keeps_the_stream_busy_where_a_syncing_free_path_leaves_it_idle() {
        let report = smoke_report();
        let near = |ns: u64| ns.abs_diff(10_000_000) < 100_000;
        assert!(
            near(report.forward_cycles),
            "1 GHz emulated clock: {report:?}"
        );
        assert_eq!(report.launch_gap.median_ns, 0, "{report:?}");
        let row = &report.rows[0];
        let (unikv, syncing) = (&row.unikv, &row.syncing);
        assert_eq!(
            (unikv.path, syncing.path),
            (FreePath::Unikv, FreePath::Syncing)
        );
        assert!(unikv.forwards > 100, "one forward per step: {unikv:?}");
        assert_eq!(unikv.forwards, syncing.forwards, "the same steps");
        assert!(near(unikv.forward.median_ns), "{unikv:?}");
        assert_eq!(unikv.host_syncs, 0);
        // A read-back at each finish (more than 1 % of the steps).
        assert!(syncing.host_syncs >= 8, "{syncing:?}");
        assert_eq!(unikv.idle.median_ns, 0, "{unikv:?}");
        assert!(syncing.idle.p99_ns > 0, "{syncing:?}");
        assert!(row.meets_target || unikv.idle.p99_ns > 0, "{row:?}");
        let table = report.table();
        assert!(
            table.contains("smoke") && table.contains("syncs/step"),
            "{table}"
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["schema"], SCHEMA);
        assert_eq!(json["rows"][0]["unikv"]["path"], "unikv");
    }
}
