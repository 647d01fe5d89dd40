//! Running commands: echoed, timed, with extra environment.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is inside the workspace")
        .to_path_buf()
}

/// A command to run from the workspace root.
pub struct Cmd {
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    quiet: bool,
}

impl Cmd {
    /// `program args...`.
    pub fn new(program: &str, args: &[&str]) -> Cmd {
        Cmd {
            program: program.to_string(),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            quiet: false,
        }
    }

    /// `cargo args...` with the cargo that runs xtask.
    pub fn cargo(args: &[&str]) -> Cmd {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        Cmd::new(&cargo, args)
    }

    /// Adds arguments.
    pub fn args<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Cmd {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// Sets an environment variable for the child.
    pub fn env(mut self, key: &str, value: impl Into<String>) -> Cmd {
        self.env.push((key.to_string(), value.into()));
        self
    }

    /// Captures output instead of streaming it.
    pub fn quiet(mut self) -> Cmd {
        self.quiet = true;
        self
    }

    fn describe(&self) -> String {
        let env: String = self.env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
        let program = Path::new(&self.program)
            .file_name()
            .map_or(self.program.clone(), |p| p.to_string_lossy().into_owned());
        format!("{env}{program} {}", self.args.join(" "))
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.program);
        command.args(&self.args).current_dir(root());
        for (k, v) in &self.env {
            command.env(k, v);
        }
        command
    }

    /// Runs it, streaming output; an error names the command and its status.
    pub fn run(&self) -> Result<(), String> {
        eprintln!("$ {}", self.describe());
        let started = Instant::now();
        let status = self
            .command()
            .status()
            .map_err(|e| format!("cannot start {}: {e}", self.describe()))?;
        let took = started.elapsed().as_secs_f64();
        if status.success() {
            eprintln!("  ok in {took:.1}s");
            Ok(())
        } else {
            Err(format!(
                "`{}` failed ({status}) after {took:.1}s",
                self.describe()
            ))
        }
    }

    /// Runs it, capturing stdout and stderr, then prints both; returns whether it
    /// succeeded and the output (stdout first). Only a command that cannot start is an
    /// error.
    pub fn run_reporting(&self) -> Result<(bool, String), String> {
        eprintln!("$ {}", self.describe());
        let out = self
            .command()
            .output()
            .map_err(|e| format!("cannot start {}: {e}", self.describe()))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprint!("{text}");
        Ok((out.status.success(), text))
    }

    /// Runs it and returns its stdout (stderr passes through unless quiet).
    pub fn output(&self) -> Result<String, String> {
        if !self.quiet {
            eprintln!("$ {}", self.describe());
        }
        let mut command = self.command();
        if self.quiet {
            command.stderr(Stdio::null());
        }
        let out = command
            .output()
            .map_err(|e| format!("cannot start {}: {e}", self.describe()))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!("`{}` failed ({})", self.describe(), out.status))
        }
    }
}
