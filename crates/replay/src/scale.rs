//! `unikv bench-scale`: the same workloads at growing pool size and request count, so
//! cost growth shows in one table. Scale `k` runs `k` tenants of each workload side by
//! side ([`Workload::tenants`](unikv_workload::Workload::tenants): `k` times the requests and the concurrency, each tenant's
//! tokens its own) in `k` times the memory, and reports the host's tokens per second and
//! its step times. A cost that grows with the pool or the tree, not with what a step
//! handles, shows as tokens/s falling and step times rising with `k`.
//!
//! The table is written scale by scale as the runs end; with `--json`, one object
//! (schema [`SCHEMA`]) once every run ended. What a run shows while it runs goes to a
//! [`ScaleProgress`] (the binary's bars), never to the table's output.

use crate::config::ReplayOptions;
use crate::error::ReplayError;
use crate::runs::{build_workloads, plan};
use crate::scheduler::StepProgress;
use serde::Serialize;
use std::io::Write;
use unikv::invariants::scoped_level;

/// The schema name of `unikv bench-scale --json`'s object.
pub const SCHEMA: &str = "unikv.bench-scale.v1";

/// The options of `unikv bench-scale`: the replay's, the scales, and the output form.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchScaleArgs {
    /// What one scale-1 run is (`unikv replay`'s options; timing is what it measures,
    /// so `timing` is on).
    pub replay: ReplayOptions,
    /// The scales, in order (`--scales`, default 1, 4, 16).
    pub scales: Vec<u32>,
    /// One JSON object (schema [`SCHEMA`]) instead of the tables (`--json`).
    pub json: bool,
}

/// What `bench-scale` tells while it runs: each (run, scale) starts, steps and ends.
/// The binary draws bars on a terminal; `()` shows nothing.
pub trait ScaleProgress {
    /// A run starts: `label` names it, `total_tokens` and `total_requests` size it.
    fn start(&mut self, label: &str, total_tokens: u64, total_requests: u64);
    /// After each step of the run.
    fn step(&self, progress: StepProgress);
    /// The run ended (before its row is written).
    fn finish(&mut self);
}

/// No progress at all.
impl ScaleProgress for () {
    fn start(&mut self, _: &str, _: u64, _: u64) {}
    fn step(&self, _: StepProgress) {}
    fn finish(&mut self) {}
}

/// The default scales.
pub const DEFAULT_SCALES: [u32; 3] = [1, 4, 16];

/// One run of the table.
#[derive(Clone, Debug, PartialEq, Serialize)]
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

/// One planned run at every scale: a table of its own, an element of the JSON's `runs`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScaleRun {
    /// The workload's name.
    pub workload: String,
    /// Tokens per page.
    pub page_size: u32,
    /// The layout (its name in JSON).
    #[serde(serialize_with = "crate::config::serialize_layout")]
    pub layout: unikv::Layout,
    /// One row per scale, in `--scales` order.
    pub rows: Vec<ScaleRow>,
}

/// The JSON object of `bench-scale --json`.
#[derive(Serialize)]
struct JsonScale<'a> {
    schema: &'static str,
    model: &'static str,
    /// The scale-1 budget; each row holds its own.
    memory_bytes: u64,
    seed: u64,
    invariant_level: &'static str,
    device: &'static str,
    scales: &'a [u32],
    runs: Vec<JsonScaleRun<'a>>,
}

#[derive(Serialize)]
struct JsonScaleRun<'a> {
    #[serde(flatten)]
    run: &'a ScaleRun,
    /// Each row's tokens per second of host CPU time (derived, for readers that plot).
    tokens_per_second: Vec<f64>,
}

/// Runs every planned run of `args.replay` at every scale, telling `progress` as each
/// runs, and writes one table per run as its rows come (or, with `args.json`, one JSON
/// object at the end). Returns the runs.
pub fn bench_scale(
    args: &BenchScaleArgs,
    out: &mut dyn Write,
    progress: &mut dyn ScaleProgress,
) -> Result<Vec<ScaleRun>, ReplayError> {
    let write = ReplayError::Output;
    let workloads = build_workloads(&args.replay)?;
    let mut all = Vec::new();
    for (w, config) in plan(&args.replay, &workloads) {
        if !args.json {
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
            out.flush().map_err(write)?;
        }
        let mut rows = Vec::new();
        for &scale in &args.scales {
            let workload = workloads[w].tenants(scale);
            let mut config = config.clone();
            config.memory_bytes = config.memory_bytes.saturating_mul(u64::from(scale));
            config.host_memory_bytes = config.host_memory_bytes.saturating_mul(u64::from(scale));
            progress.start(
                &format!(
                    "{} · page size {} · {} · scale {scale}",
                    workloads[w].name, config.page_size, config.layout
                ),
                workload.total_tokens(),
                workload.requests.len() as u64,
            );
            let stats = {
                let progress = &*progress;
                scoped_level(config.invariant_level, || {
                    crate::runs::run(
                        &workload,
                        &config,
                        args.replay.record_ops.as_deref(),
                        &|p| progress.step(p),
                    )
                })
            };
            progress.finish();
            let stats = stats?;
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
            if !args.json {
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
                out.flush().map_err(write)?;
            }
            rows.push(row);
        }
        if let (false, Some(first), Some(last)) = (args.json, rows.first(), rows.last()) {
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
        all.push(ScaleRun {
            workload: workloads[w].name.clone(),
            page_size: config.page_size,
            layout: config.layout,
            rows,
        });
    }
    if args.json {
        let options = &args.replay;
        let doc = JsonScale {
            schema: SCHEMA,
            model: options.model.name,
            memory_bytes: options.memory_bytes,
            seed: options.seed,
            invariant_level: options.invariant_level.as_str(),
            device: options.backend.as_str(),
            scales: &args.scales,
            runs: all
                .iter()
                .map(|run| JsonScaleRun {
                    run,
                    tokens_per_second: run.rows.iter().map(ScaleRow::tokens_per_second).collect(),
                })
                .collect(),
        };
        let text = serde_json::to_string_pretty(&doc)?;
        writeln!(out, "{text}").map_err(write)?;
    }
    out.flush().map_err(write)?;
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
            json: false,
        };
        let mut out = Vec::new();
        let runs = bench_scale(&args, &mut out, &mut ()).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(runs.len(), 1, "{text}");
        let [one, two] = &runs[0].rows[..] else {
            panic!("{text}")
        };
        assert_eq!((one.scale, two.scale), (1, 2));
        assert_eq!(two.requests, 2 * one.requests);
        assert_eq!(two.memory_bytes, 2 * one.memory_bytes);
        assert!(two.cpu_ns > 0 && two.p99_ns >= two.p50_ns, "{text}");
        assert!(text.contains("tokens/s at 2× over 1×"), "{text}");

        // The same runs as one JSON object, with its schema and nothing else on `out`.
        let mut out = Vec::new();
        let json = BenchScaleArgs { json: true, ..args };
        bench_scale(&json, &mut out, &mut ()).unwrap();
        let doc: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(doc["schema"], SCHEMA);
        assert_eq!(doc["scales"], serde_json::json!([1, 2]));
        let run = &doc["runs"][0];
        assert_eq!(
            (&run["workload"], &run["layout"]),
            (&"smoke".into(), &"unified".into())
        );
        assert_eq!(run["rows"][1]["scale"], 2);
        assert_eq!(run["tokens_per_second"].as_array().unwrap().len(), 2);
    }
}
