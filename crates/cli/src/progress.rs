//! The progress shown on stderr while a command runs (indicatif): never on stdout, so a
//! report, a table or a JSON object there is never mixed with it.
//!
//! - `replay`: one bar per run, cleared when the run ends, so the terminal keeps only the
//!   report. Drawn only when stderr is a terminal ([`ReplayProgress::for_stderr`]); with
//!   stderr redirected (CI, `2> log`) nothing is drawn. `--json` does not hide it: the
//!   JSON goes to stdout, and a bar on a terminal's stderr does not mix with it.
//! - `bench-scale` ([`ScaleBars`]): the same bar for each run at each scale, cleared
//!   before the scale's row is written; without a terminal, one plain line per run
//!   instead.
//! - `sim` ([`SimBar`]): one bar over the seeds, cleared before the summary; without a
//!   terminal, a plain line every tenth of the seeds.
//!
//! The scheduler drives it through the callback [`RunProgress::callback`] gives, called
//! once per step with cumulative counts; indicatif redraws at most 20 times a second, so
//! a call costs a few atomic operations.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::cell::Cell;
use std::io::IsTerminal;
use unikv_replay::StepProgress;

/// The bars of one replay.
#[derive(Debug)]
pub struct ReplayProgress {
    visible: bool,
    runs_total: usize,
    runs_started: Cell<usize>,
}

impl ReplayProgress {
    /// Bars on stderr when it is a terminal, none otherwise.
    pub fn for_stderr(runs_total: usize) -> ReplayProgress {
        ReplayProgress::new(std::io::stderr().is_terminal(), runs_total)
    }

    /// Bars on stderr if `visible`, else nothing drawn (the bars still count).
    pub fn new(visible: bool, runs_total: usize) -> ReplayProgress {
        ReplayProgress {
            visible,
            runs_total,
            runs_started: Cell::new(0),
        }
    }

    /// A hidden instance (tests).
    #[cfg(test)]
    pub fn hidden() -> ReplayProgress {
        ReplayProgress::new(false, 0)
    }

    /// Starts the bar of the next run: `label` names it, `total_tokens` is its length
    /// ([`unikv_workload::Workload::total_tokens`]), `total_requests` the requests.
    pub fn start_run(&self, label: &str, total_tokens: u64, total_requests: u64) -> RunProgress {
        let index = self.runs_started.get() + 1;
        self.runs_started.set(index);
        let target = if self.visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total_tokens.max(1)), target);
        // The template is a constant; should indicatif ever refuse it, keep the default.
        if let Ok(style) =
            ProgressStyle::with_template("{prefix} [{bar:32}] {percent:>3}% {msg} ({elapsed})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(format!("[{index}/{}] {label}", self.runs_total.max(index)));
        bar.set_message(format!("step 0, 0/{total_requests} requests"));
        RunProgress {
            bar,
            total_requests,
            last_completed: Cell::new(u64::MAX),
        }
    }
}

/// The bar of one run.
#[derive(Debug)]
pub struct RunProgress {
    bar: ProgressBar,
    total_requests: u64,
    last_completed: Cell<u64>,
}

/// How many steps pass between message updates (the position moves every step).
const MESSAGE_EVERY: u64 = 64;

impl RunProgress {
    /// Moves the bar to `progress` (call after every step).
    pub fn update(&self, progress: StepProgress) {
        self.bar.set_position(
            progress
                .tokens_done
                .min(self.bar.length().unwrap_or(u64::MAX)),
        );
        if progress.step.is_multiple_of(MESSAGE_EVERY)
            || progress.requests_completed != self.last_completed.get()
        {
            self.last_completed.set(progress.requests_completed);
            self.bar.set_message(format!(
                "step {}, {}/{} requests",
                progress.step, progress.requests_completed, self.total_requests
            ));
        }
    }

    /// The callback to hand to the scheduler ([`unikv_replay::run`]).
    pub fn callback(&self) -> impl Fn(StepProgress) + '_ {
        move |p| self.update(p)
    }

    /// Tokens done so far, as the bar shows them.
    #[cfg(test)]
    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// Ends the run's bar and clears it from the terminal.
    pub fn finish(self) {
        self.bar.finish_and_clear();
    }
}

/// `bench-scale`'s progress: a bar per (run, scale) on a terminal, a plain line per
/// (run, scale) on stderr otherwise.
#[derive(Debug)]
pub struct ScaleBars {
    bars: ReplayProgress,
    /// Plain lines instead of bars (stderr is not a terminal).
    plain: bool,
    current: Option<RunProgress>,
}

impl ScaleBars {
    /// Bars on a terminal's stderr, plain lines on any other stderr; `runs_total` is
    /// runs × scales.
    pub fn for_stderr(runs_total: usize) -> ScaleBars {
        let terminal = std::io::stderr().is_terminal();
        ScaleBars {
            bars: ReplayProgress::new(terminal, runs_total),
            plain: !terminal,
            current: None,
        }
    }
}

impl unikv_replay::scale::ScaleProgress for ScaleBars {
    fn start(&mut self, label: &str, total_tokens: u64, total_requests: u64) {
        if self.plain {
            eprintln!("bench-scale: {label}, {total_requests} requests");
        }
        self.current = Some(self.bars.start_run(label, total_tokens, total_requests));
    }

    fn step(&self, progress: StepProgress) {
        if let Some(run) = &self.current {
            run.update(progress);
        }
    }

    fn finish(&mut self) {
        if let Some(run) = self.current.take() {
            run.finish();
        }
    }
}

/// `sim`'s progress: a bar over the seeds on a terminal's stderr, else a plain line on
/// stderr every tenth of them.
#[derive(Debug)]
pub struct SimBar {
    bar: Option<ProgressBar>,
    started: std::time::Instant,
}

impl SimBar {
    /// A bar when stderr is a terminal, plain lines otherwise.
    pub fn for_stderr(seeds: u64) -> SimBar {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(seeds), ProgressDrawTarget::stderr());
            // The template is a constant; should indicatif ever refuse it, keep the default.
            if let Ok(style) = ProgressStyle::with_template(
                "sim [{bar:32}] {pos}/{len} seeds clean ({elapsed}, about {eta} left)",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        SimBar {
            bar,
            started: std::time::Instant::now(),
        }
    }
}

impl unikv_dst::SimProgress for SimBar {
    fn seed_done(&mut self, done: u64, total: u64) {
        match &self.bar {
            Some(bar) => bar.set_position(done),
            None => {
                let every = (total / 10).max(1);
                if done.is_multiple_of(every) && done < total {
                    eprintln!(
                        "sim: {done} of {total} seeds clean ({:.1} s)",
                        self.started.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_follows_the_callback_and_never_passes_its_length() {
        let replay = ReplayProgress::hidden();
        let run = replay.start_run("smoke · page size 1 · unified", 1_000, 8);
        {
            let callback = run.callback();
            callback(StepProgress {
                step: 1,
                tokens_done: 300,
                requests_completed: 0,
            });
            callback(StepProgress {
                step: 2,
                tokens_done: 640,
                requests_completed: 2,
            });
        }
        assert_eq!(run.position(), 640);
        run.update(StepProgress {
            step: 3,
            tokens_done: 5_000,
            requests_completed: 8,
        });
        assert_eq!(run.position(), 1_000);
        run.finish();
        let next = replay.start_run("next", 0, 0);
        next.update(StepProgress::default());
        next.finish();
    }
}
