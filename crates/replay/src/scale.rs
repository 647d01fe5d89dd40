//! `unikv bench-scale`: the same workloads at growing pool size and request count, so
//! cost growth shows in one table. Scale `k` runs `k` tenants of each workload side by
//! side ([`Workload::tenants`](unikv_workload::Workload::tenants): `k` times the requests and the concurrency, each tenant's
//! tokens its own) in `k` times the memory, and reports the host's tokens per second and
//! its step times. A cost that grows with the pool or the tree, not with what a step
//! handles, shows as tokens/s falling and step times rising with `k`.

use crate::config::ReplayOptions;
use crate::error::ReplayError;
use crate::runs::{build_workloads, plan};
use std::io::Write;
use unikv::invariants::scoped_level;

/// The options of `unikv bench-scale`: the replay's, and the scales.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchScaleArgs {
    /// What one scale-1 run is (`unikv replay`'s options).
    pub replay: ReplayOptions,
    /// The scales, in order (`--scales`, default 1, 4, 16).
    pub scales: Vec<u32>,
}

/// The default scales.
pub const DEFAULT_SCALES: [u32; 3] = [1, 4, 16];

/// One run of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleRow {
    /// The scale.
    pub scale: u32,
    /// The run's budget.
    pub memory_bytes: u64,
    /// Requests run.
    pub requests: u64,
    /// Prompt plus output tokens.
    pub tokens: u64,
    /// Steps.
    pub steps: u64,
    /// Host CPU time of all steps, in nanoseconds.
    pub cpu_ns: u64,
    /// Median step, in nanoseconds.
    pub p50_ns: u64,
    /// 99th-percentile step, in nanoseconds.
    pub p99_ns: u64,
    /// Host CPU time per page the allocator bound or released, in nanoseconds.
    pub ns_per_page: u64,
}

impl ScaleRow {
    /// Tokens per second of host CPU time.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / (self.cpu_ns.max(1) as f64 / 1e9)
    }
}

/// Runs every planned run of `args.replay` at every scale, writing one table per run.
/// Returns the rows, run by run.
pub fn bench_scale(
    args: &BenchScaleArgs,
    out: &mut dyn Write,
) -> Result<Vec<Vec<ScaleRow>>, ReplayError> {
    let write = ReplayError::Output;
    let workloads = build_workloads(&args.replay)?;
    let mut all = Vec::new();
    for (w, config) in plan(&args.replay, &workloads) {
        writeln!(
            out,
            "\n{} · page size {} · {} · device {} · invariants {}",
            workloads[w].name,
            config.page_size,
            config.layout,
            config.backend.as_str(),
            config.invariant_level
        )
        .map_err(write)?;
        writeln!(
            out,
            "{:>5} {:>11} {:>9} {:>13} {:>8} {:>10} {:>11} {:>10} {:>10} {:>8}",
            "scale",
            "memory",
            "requests",
            "tokens",
            "steps",
            "host CPU",
            "tokens/s",
            "p50",
            "p99",
            "ns/page"
        )
        .map_err(write)?;
        let mut rows = Vec::new();
        for &scale in &args.scales {
            let workload = workloads[w].tenants(scale);
            let mut config = config.clone();
            config.memory_bytes = config.memory_bytes.saturating_mul(u64::from(scale));
            eprintln!(
                "bench-scale: scale {scale}, {} requests",
                workload.requests.len()
            );
            let stats = scoped_level(config.invariant_level, || {
                crate::runs::run(
                    &workload,
                    &config,
                    args.replay.record_ops.as_deref(),
                    &|_| {},
                )
            })?;
            let timing = stats.timing().unwrap_or_default();
            let row = ScaleRow {
                scale,
                memory_bytes: config.memory_bytes,
                requests: workload.requests.len() as u64,
                tokens: workload.total_tokens(),
                steps: stats.steps,
                cpu_ns: stats.step_cpu_ns.iter().sum(),
                p50_ns: timing.median,
                p99_ns: timing.p99,
                ns_per_page: timing.ns_per_page,
            };
            writeln!(
                out,
                "{:>4}× {:>11} {:>9} {:>13} {:>8} {:>8.1}ms {:>11.3e} {:>8.1}µs {:>8.1}µs {:>8}",
                row.scale,
                unikv_workload::units::format_bytes(row.memory_bytes),
                row.requests,
                row.tokens,
                row.steps,
                row.cpu_ns as f64 / 1e6,
                row.tokens_per_second(),
                row.p50_ns as f64 / 1e3,
                row.p99_ns as f64 / 1e3,
                row.ns_per_page,
            )
            .map_err(write)?;
            rows.push(row);
        }
        if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
            writeln!(
                out,
                "tokens/s at {}× over {}×: {:.2}; ns per page: {:.2}",
                last.scale,
                first.scale,
                last.tokens_per_second() / first.tokens_per_second(),
                last.ns_per_page as f64 / first.ns_per_page.max(1) as f64
            )
            .map_err(write)?;
        }
        all.push(rows);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Backend;
    use unikv::Layout;
    use unikv_workload::Preset;
    use unikv_workload::workload::VOCAB_SIZE;

    #[test]
    fn tenants_multiply_requests_and_concurrency_and_share_nothing_across() {
        let w = Preset::Smoke.build(3);
        let t = w.tenants(3);
        assert_eq!(t.requests.len(), 3 * w.requests.len());
        assert_eq!(t.concurrency, 3 * w.concurrency);
        assert_eq!(t.total_tokens(), 3 * w.total_tokens());
        t.validate().unwrap();
        for (i, r) in t.requests.iter().enumerate() {
            let (orig, c) = (&w.requests[i / 3], (i % 3) as u32);
            assert_eq!(r.id as usize, i);
            assert_eq!(r.arrival_step, orig.arrival_step);
            let shifted: Vec<u32> = orig.prompt.iter().map(|t| t + c * VOCAB_SIZE).collect();
            assert_eq!(r.prompt, shifted);
        }
        assert_eq!(w.tenants(1), w);
    }

    #[test]
    fn the_table_has_a_row_per_scale_and_every_run_completes() {
        let args = BenchScaleArgs {
            replay: ReplayOptions {
                workloads: vec![Preset::Smoke],
                page_sizes: vec![4],
                layouts: vec![Layout::Unified],
                backend: Backend::None,
                memory_bytes: 256 << 20,
                ..ReplayOptions::default()
            },
            scales: vec![1, 2],
        };
        let mut out = Vec::new();
        let rows = bench_scale(&args, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(rows.len(), 1, "{text}");
        let [one, two] = &rows[0][..] else {
            panic!("{text}")
        };
        assert_eq!((one.scale, two.scale), (1, 2));
        assert_eq!(two.requests, 2 * one.requests);
        assert_eq!(two.memory_bytes, 2 * one.memory_bytes);
        assert!(two.cpu_ns > 0 && two.p99_ns >= two.p50_ns, "{text}");
        assert!(text.contains("tokens/s at 2× over 1×"), "{text}");
    }
}
