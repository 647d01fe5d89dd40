//! The help texts clap does not write from the options themselves: each command's long
//! description and what `--help` prints after the options (the presets, the models, the
//! trace format, the report's rows, the exit status). The pieces that document a
//! library's format come from that library (`trace::FORMAT_HELP`, `report::ROWS_HELP`).

use unikv::ModelSpec;
use unikv_workload::Preset;
use unikv_workload::units::group_digits;

/// After the main help's commands.
pub const MAIN_AFTER: &str = "\
Try `unikv help COMMAND` (or `unikv COMMAND --help`) for a command's options.

ENVIRONMENT:
  UNIKV_INVARIANT_CHECK   off|warn|strict|0|1|2: checked at start-up; the commands'
                          --invariants option sets the level they run at

EXIT STATUS:
  0  success (`replay`, `sim`: every run passed)
  1  a report was printed and some run failed its checks
  2  an error: bad options, unreadable input, a run that could not be carried out, an
     output that could not be written (one line on stderr)";

/// `unikv replay --help`'s description.
pub const REPLAY_ABOUT: &str = "\
unikv replay: run serving workloads through a deterministic scheduler, once with the
static paged pools (fixed FULL, SWA and state slot pools) and once with the unified
pool, and print a side-by-side report (on the CPU; no GPU needed)";

/// `unikv bench-ops --help`'s description.
pub const BENCH_OPS_ABOUT: &str = "\
unikv bench-ops: replay only the allocator operations a replay recorded, against a fresh
allocator, and report throughput (ops/s and tokens/s per operation kind)";

/// After `unikv bench-scale --help`'s options.
pub const BENCH_SCALE_AFTER: &str = "\
Scale K runs K tenants of each workload side by side (K times the requests and the
concurrency, each tenant's tokens its own) in K times the memory, and reports the host's
tokens per second and its step times: a cost that grows with the pool or the tree, not
with what a step handles, shows as tokens/s falling and step times rising with K. The
other options are `unikv replay`'s (see `unikv replay --help`).";

/// `unikv bench-overlap --help`'s description.
pub const BENCH_OVERLAP_ABOUT: &str = "\
unikv bench-overlap: does the GPU go from one forward to the next with no gap that unikv
causes? Each row replays a workload on the CUDA backend as an overlap scheduler runs it:
after each step's unikv work (frees, admissions, allocations, eviction, metadata build
and upload) the host launches the step's forward, a spin kernel calibrated to
--forward-us, and prepares the next step while it runs. GPU events around every forward,
read after the loop, give the idle between consecutive forwards (median, p99, and as a
share of the forward), for unikv and for a syncing baseline whose KV segment frees each
read a value back from the device first, as the seed's free path did. The target: unikv's
median idle under 1 % of the forward, its p99 no more than the launch gap of two
back-to-back forwards with no host work between them (measured too). --device emulated
runs the same loop on the emulated driver (forwards in host time): it checks the loop,
not a GPU. Exit status 1 when a row misses the target on a GPU.";

/// `unikv sim --help`'s description.
pub const SIM_ABOUT: &str = "\
unikv sim: the deterministic simulator with injected faults. Each seed fixes a random
configuration (model, layout, page size, budget near the batch-size-1 floor, fault rate)
and a random engine driving the cache through it; every step checks the allocator, the
tree, every stamped KV and state byte (through the device translation too) and every
match against an independent oracle. A failing seed prints the command that reproduces it.";

/// `--model`'s long help: the override keys.
pub fn model_option() -> String {
    format!(
        "The model's KV shapes; K=V pairs change its geometry \
         (`gpt-oss-120b:window=256,full-layers=24`), K one of: {}",
        unikv_workload::model::override_keys()
    )
}

/// What `unikv replay --help` prints after the options.
pub fn replay_after() -> String {
    let workloads: String = Preset::ALL
        .iter()
        .map(|p| {
            let default = if Preset::DEFAULTS.contains(p) {
                ""
            } else if p.needs_recurrent_state() {
                " [default for a model with recurrent state]"
            } else {
                " [not run by default]"
            };
            format!("  {:<18}{}{default}\n", p.name(), p.description())
        })
        .collect();
    let models: String = ModelSpec::NAMED
        .iter()
        .map(|m| model_entry(m) + "\n")
        .collect();
    format!(
        "\
Every option but --workload and --page-size may be given once; list items (N,N) must
not be empty.

WORKLOADS:
{workloads}
MODELS:
{models}
{trace}

{rows}
EXIT STATUS:
  0  every run finished every request with 0 host syncs, 0 invariant violations and
     0 leaked pages
  1  the report was printed, and some run failed one of those checks
  2  bad options, an unreadable trace, or a run that could not be carried out",
        trace = unikv_workload::trace::FORMAT_HELP,
        rows = unikv_replay::report::ROWS_HELP,
    )
}

/// The help's width: clap wraps its help at 100 columns, and a longer line would be
/// broken where clap chooses, its rest starting at column 0 where a model name belongs.
const HELP_WIDTH: usize = 100;

/// The column a model's description starts at: two spaces, the longest name
/// (`qwen3-next-80b-a3b`, 18) and one space.
const MODEL_COLUMN: usize = 2 + 18 + 1;

/// One model's entry in `--help`: its name, its layers and what a token (and a
/// request's state) costs, the description's parts filled into lines of at most
/// [`HELP_WIDTH`] columns, each continuation line indented to [`MODEL_COLUMN`].
fn model_entry(m: &ModelSpec) -> String {
    let parts = model_parts(m);
    let mut lines: Vec<String> = vec![String::new()];
    for (i, part) in parts.iter().enumerate() {
        let piece = if i + 1 < parts.len() {
            format!("{part},")
        } else {
            part.clone()
        };
        let line = lines.last_mut().expect("one line at least");
        if line.is_empty() {
            line.push_str(&piece);
        } else if MODEL_COLUMN + line.len() + 1 + piece.len() <= HELP_WIDTH {
            line.push(' ');
            line.push_str(&piece);
        } else {
            lines.push(piece);
        }
    }
    let indent = format!("\n{:MODEL_COLUMN$}", "");
    format!("  {:<18} {}", m.name, lines.join(&indent))
}

/// A model's description, in the parts a line may break between: its layers, what a
/// token costs and, with recurrent state, what a request's state costs.
fn model_parts(m: &ModelSpec) -> Vec<String> {
    let mut layers = format!("{} FULL", m.full_layers);
    if m.swa_layers > 0 {
        layers += &format!(" + {} SWA", m.swa_layers);
    }
    if m.has_recurrent_state() {
        layers += &format!(" + {} recurrent", m.mamba_layers);
    }
    layers += " layers";
    if m.swa_layers > 0 {
        layers += &format!(" (window {})", m.window);
    }
    let bytes = if m.swa_layers == 0 {
        format!("{} bytes/token", group_digits(m.full_bytes_per_token()))
    } else if m.full_bytes_per_token() == m.swa_bytes_per_token() {
        format!(
            "{} bytes/token/side",
            group_digits(m.full_bytes_per_token())
        )
    } else {
        format!(
            "{} + {} bytes/token",
            group_digits(m.full_bytes_per_token()),
            group_digits(m.swa_bytes_per_token())
        )
    };
    let mut parts = vec![layers, bytes];
    if m.has_recurrent_state() {
        parts.push(format!(
            "{} bytes of state per request",
            group_digits(m.state_bytes_per_request())
        ));
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The long help keeps what the hand-written help documented.
    #[test]
    fn the_replay_help_documents_presets_models_the_trace_format_and_the_rows() {
        let help = replay_after();
        for needle in [
            "may be given once",
            "random-8192-64",
            "mamba-starvation  4,096-token histories",
            "gemma-4-31b        10 FULL + 50 SWA layers (window 1024), 81,920 + 819,200 bytes/token",
            "77,266,944 bytes of state per request",
            "TRACE FORMAT",
            "prefix_len",
            "REPORT ROWS",
            "peak checkpoint slots",
            "EXIT STATUS",
        ] {
            assert!(help.contains(needle), "{needle}");
        }
    }

    /// Every model entry fits the help's width (clap would break a longer line and start
    /// its rest at column 0, where a reader looks for a model name), its continuation
    /// lines indented to the description's column.
    #[test]
    fn model_entries_fit_the_width_and_continue_at_their_column() {
        for m in ModelSpec::NAMED {
            let entry = model_entry(&m);
            let mut lines = entry.lines();
            let first = lines.next().unwrap();
            assert!(first.starts_with(&format!("  {} ", m.name)), "{entry}");
            assert_eq!(
                first[MODEL_COLUMN - 1..].chars().next(),
                Some(' '),
                "{entry}"
            );
            assert_ne!(first[MODEL_COLUMN..].chars().next(), Some(' '), "{entry}");
            for line in entry.lines() {
                assert!(line.len() <= HELP_WIDTH, "{line}");
            }
            for line in lines {
                assert!(line.starts_with(&" ".repeat(MODEL_COLUMN)), "{entry}");
                assert_ne!(line[MODEL_COLUMN..].chars().next(), Some(' '), "{entry}");
            }
        }
        let tri = model_entry(&ModelSpec::SYNTHETIC_TRI);
        assert_eq!(
            tri,
            format!(
                "  synthetic-tri      4 FULL + 12 SWA + 16 recurrent layers (window 1024),\n{:21}\
                 16,384 + 49,152 bytes/token, 68,091,904 bytes of state per request",
                ""
            )
        );
    }
}
