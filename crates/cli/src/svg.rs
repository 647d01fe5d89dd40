//! `--svg DIR`: one plot per run of each sub-pool's bytes over steps (`full`, `swa`,
//! `mamba`, their total and the budget), drawn with plotters' SVG backend. Every plot
//! carries one line of what the prefix cache served ([`reuse_line`]: hit rate, with a host
//! tier its device and host parts, KV hit, recurrent hit, tokens recomputed, checkpoint
//! slots at peak); a run of a model with
//! recurrent state also one line of its state slots: the peak in use, the capacity,
//! cached states and FULL donor nodes evicted for them ([`mamba_line`]).
//!
//! Text: plotters is built without its font features (`ttf`, `ab_glyph`), so it sizes
//! labels with its built-in estimate and writes them as SVG `<text>` elements that the
//! viewer renders with its own sans-serif font. No font file is needed to build or to
//! draw; label widths are approximate, which the generous margins absorb.

use crate::error::CliError;
use plotters::prelude::*;
use std::path::{Path, PathBuf};
use unikv_replay::{Layout, Report, RunStats};

/// Line colours of the sub-pools, in name order (Tableau 10: red, blue, green, purple).
const COLORS: [RGBColor; 4] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// The budget line's colour (Tableau 10 orange).
const BUDGET: RGBColor = RGBColor(255, 127, 14);

/// The plot's size in pixels.
const SIZE: (u32, u32) = (960, 540);

/// The file name of a run's plot: `{workload}-ps{page size}-{layout}.svg`.
pub fn plot_file_name(run: &RunStats) -> String {
    plot_file_name_of(&run.workload, run.page_size, run.layout)
}

/// [`plot_file_name`] of a run not yet made (to check it can be written before it runs).
pub fn plot_file_name_of(workload: &str, page_size: u32, layout: Layout) -> String {
    format!("{workload}-ps{page_size}-{layout}.svg")
}

/// Writes one SVG per run of `report` into `dir` (created if missing) and returns their
/// paths, in run order.
pub fn write_plots(report: &Report, dir: &Path) -> Result<Vec<PathBuf>, CliError> {
    std::fs::create_dir_all(dir).map_err(|source| CliError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    report
        .runs
        .iter()
        .map(|run| {
            let path = dir.join(plot_file_name(run));
            plot_run(run, report.model.name, &path)?;
            Ok(path)
        })
        .collect()
}

/// Draws `run`'s sub-pool bytes over steps, the total of them and the budget, into the
/// SVG file `path`.
pub fn plot_run(run: &RunStats, model: &str, path: &Path) -> Result<(), CliError> {
    draw(run, model, path).map_err(|message| CliError::Svg {
        path: path.display().to_string(),
        message,
    })
}

fn draw(run: &RunStats, model: &str, path: &Path) -> Result<(), String> {
    let (unit_name, unit) = match run.memory_bytes {
        b if b >= 1 << 30 => ("GiB", (1u64 << 30) as f64),
        b if b >= 1 << 20 => ("MiB", (1u64 << 20) as f64),
        _ => ("KiB", 1024.0),
    };
    let mut pools: Vec<&str> = run
        .samples
        .iter()
        .flat_map(|s| s.bytes_by_subpool.keys().map(String::as_str))
        .collect();
    pools.sort_unstable();
    pools.dedup();
    let last_step = run
        .samples
        .last()
        .map_or(0, |s| s.step)
        .max(run.steps)
        .max(1);
    let total = |s: &unikv_replay::StepSample| s.bytes_by_subpool.values().sum::<u64>();
    let peak = run.samples.iter().map(total).max().unwrap_or(0);
    let y_max = (run.memory_bytes.max(peak) as f64 / unit) * 1.05;
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };

    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let title = format!(
        "{} · page size {} · {} · {}",
        run.workload, run.page_size, run.layout, model
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d(0u64..last_step, 0f64..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(format!("bytes held ({unit_name})"))
        .draw()
        .map_err(|e| e.to_string())?;

    let mut series: Vec<(String, Vec<(u64, f64)>)> = pools
        .iter()
        .map(|pool| {
            let points = run
                .samples
                .iter()
                .map(|s| {
                    let bytes = s.bytes_by_subpool.get(*pool).copied().unwrap_or(0);
                    (s.step, bytes as f64 / unit)
                })
                .collect();
            (pool.to_string(), points)
        })
        .collect();
    if pools.len() > 1 {
        let points = run
            .samples
            .iter()
            .map(|s| (s.step, total(s) as f64 / unit))
            .collect();
        series.push(("total".to_string(), points));
    }
    for (i, (name, points)) in series.into_iter().enumerate() {
        let color = if name == "total" {
            RGBColor(60, 60, 60)
        } else {
            COLORS[i % COLORS.len()]
        };
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    let budget = run.memory_bytes as f64 / unit;
    chart
        .draw_series(LineSeries::new(
            vec![(0, budget), (last_step, budget)],
            BUDGET.stroke_width(2),
        ))
        .map_err(|e| e.to_string())?
        .label("budget")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BUDGET.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(|e| e.to_string())?;
    // Upper left, inside the plot area (the legend is upper right).
    root.draw(&Text::new(reuse_line(run), (100, 56), ("sans-serif", 15)))
        .map_err(|e| e.to_string())?;
    if let Some(line) = mamba_line(run) {
        root.draw(&Text::new(line, (100, 76), ("sans-serif", 15)))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

/// The line every plot carries: what the prefix cache served the run's prompts — the
/// hit rate (with a host tier, the tokens of it the device held and those loaded back
/// from the host), the KV hit, for a model with recurrent state the recurrent hit, the
/// tokens recomputed, and for such a model the most slots held as checkpoints.
pub fn reuse_line(run: &RunStats) -> String {
    use unikv_workload::units::group_digits;
    let rate = match run.prefix_hit_rate() {
        Some(rate) => format!("{:.1} %", rate * 100.0),
        None => "—".to_string(),
    };
    let rate = match &run.host {
        Some(h) => format!(
            "{rate} (device {}, host {})",
            group_digits(h.device_hit_tokens),
            group_digits(h.host_hit_tokens)
        ),
        None => rate,
    };
    let kv = group_digits(run.kv_hit_tokens);
    let recomputed = group_digits(run.recomputed_tokens);
    match &run.mamba {
        Some(m) => format!(
            "prefix hit {rate}: KV hit {kv}, recurrent hit {}, recomputed {recomputed} tokens; \
             peak {} checkpoint slots",
            group_digits(m.recurrent_hit_tokens),
            m.peak_checkpoint_slots
        ),
        None => format!("prefix hit {rate}: KV hit {kv}, recomputed {recomputed} tokens"),
    }
}

/// The line a plot of a run with recurrent state carries: its state slots and what was
/// evicted for them (`None` for a model without recurrent state).
pub fn mamba_line(run: &RunStats) -> Option<String> {
    let m = run.mamba?;
    let bytes = run.peak_bytes_by_subpool.get("mamba").copied().unwrap_or(0);
    Some(format!(
        "mamba: peak {} of {} state slots ({}), {} states evicted, {} FULL donor nodes evicted",
        m.peak_slots,
        m.slots_total,
        unikv_workload::units::format_bytes(bytes),
        m.state_evictions,
        m.donor_nodes
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use unikv_replay::samples::sample_report;

    /// A fresh directory under the system's temp dir for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("unikv-sim-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn one_svg_per_run_with_a_line_per_sub_pool() {
        let dir = scratch("svg");
        let report = sample_report();
        let paths = write_plots(&report, &dir.join("plots")).unwrap();
        let names: Vec<String> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "shared-prefix-ps256-static.svg",
                "shared-prefix-ps256-unified.svg"
            ]
        );
        for path in &paths {
            let svg = std::fs::read_to_string(path).unwrap();
            assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
            for label in ["full", "swa", "total", "budget", "step", "GiB"] {
                assert!(svg.contains(label), "{label} in {}", path.display());
            }
            // Every run's plot says what the prefix cache served.
            assert!(svg.contains("prefix hit "), "{}", path.display());
            // full, swa, total, budget and the legend's sample strokes.
            assert!(svg.matches("<polyline").count() >= 4);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_run_with_recurrent_state_plots_its_slots_and_what_was_evicted_for_them() {
        let dir = scratch("svg-mamba");
        let mut report = unikv_replay::samples::sample_mamba_report();
        for run in &mut report.runs {
            run.samples = vec![unikv_replay::StepSample {
                step: 100,
                bytes_by_subpool: [
                    ("full".to_string(), 1 << 30),
                    ("mamba".to_string(), 2 << 30),
                ]
                .into(),
            }];
        }
        let paths = write_plots(&report, &dir).unwrap();
        let svg = std::fs::read_to_string(&paths[1]).unwrap();
        let line = "mamba: peak 150 of 221 state slots (10.79 GiB), 71 states evicted, 138 FULL \
                    donor nodes evicted";
        assert_eq!(mamba_line(&report.runs[1]).as_deref(), Some(line));
        let reuse = "prefix hit 28.7 %: KV hit 212,992, recurrent hit 204,800, recomputed 8,192 \
                     tokens; peak 125 checkpoint slots";
        assert_eq!(reuse_line(&report.runs[1]), reuse);
        for label in ["full", "mamba", "total", "budget", line, reuse] {
            assert!(svg.contains(label), "{label}");
        }
        assert_eq!(mamba_line(&sample_report().runs[0]), None);
        assert_eq!(
            reuse_line(&sample_report().runs[0]),
            "prefix hit 81.2 %: KV hit 790,528, recomputed 4,096 tokens"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// With a host tier the reuse line splits the hit into the device's and the host's
    /// tokens; without one it is as it was.
    #[test]
    fn a_run_with_a_host_tier_says_where_its_hit_came_from() {
        let dir = scratch("svg-host");
        let report = unikv_replay::samples::sample_host_report();
        let line = "prefix hit 51.0 % (device 21,504, host 507,904): KV hit 529,408, \
                    recomputed 0 tokens";
        assert_eq!(reuse_line(&report.runs[1]), line);
        let paths = write_plots(&report, &dir).unwrap();
        let svg = std::fs::read_to_string(&paths[1]).unwrap();
        assert!(svg.contains(line), "{svg}");
        assert!(!reuse_line(&sample_report().runs[1]).contains("host"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_run_without_samples_still_gets_a_plot() {
        let dir = scratch("empty");
        let mut report = sample_report();
        report.runs.truncate(1);
        report.runs[0].samples.clear();
        report.runs[0].steps = 0;
        let paths = write_plots(&report, &dir).unwrap();
        assert!(
            std::fs::read_to_string(&paths[0])
                .unwrap()
                .contains("budget")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_directory_is_a_typed_error() {
        let dir = scratch("blocked");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("not-a-dir");
        std::fs::write(&file, "x").unwrap();
        let err = write_plots(&sample_report(), &file.join("sub")).unwrap_err();
        assert!(matches!(err, CliError::Io { .. }), "{err:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
