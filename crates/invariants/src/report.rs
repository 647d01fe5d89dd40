//! A readable list of every invariant with its counts in one scope ([`crate::Scope::report`]).

use crate::{Bucket, Level};
use std::fmt;

/// One invariant in a [`Report`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportRow {
    /// Unique name.
    pub name: &'static str,
    /// Bucket.
    pub bucket: Bucket,
    /// Declaring module.
    pub module: &'static str,
    /// One-sentence rule.
    pub description: &'static str,
    /// Violations recorded in the scope the report was taken of.
    pub violations: u64,
}

/// Every registered invariant with its counts in one scope, sorted by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The level in force when the report was taken.
    pub level: Level,
    /// One row per invariant.
    pub rows: Vec<ReportRow>,
}

impl Report {
    /// Violations over all invariants.
    pub fn total_violations(&self) -> u64 {
        self.rows.iter().map(|r| r.violations).sum()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name_w = self
            .rows
            .iter()
            .map(|r| r.name.len())
            .max()
            .unwrap_or(4)
            .max(9);
        writeln!(
            f,
            "invariants at level {} ({} registered)",
            self.level,
            self.rows.len()
        )?;
        writeln!(
            f,
            "{:<name_w$}  {:<19}  {:>10}  rule",
            "invariant", "bucket", "violations"
        )?;
        for row in &self.rows {
            writeln!(
                f,
                "{:<name_w$}  {:<19}  {:>10}  {}",
                row.name,
                row.bucket.as_str(),
                row.violations,
                row.description
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Scope, declare_invariant, scoped_level};

    declare_invariant! {
        /// Reported in the snapshot below.
        static REPORTED: "report.example", Guard, "an example rule for the report snapshot";
    }

    #[test]
    fn the_report_lists_every_invariant_with_counts() {
        scoped_level(Level::Warn, || {
            let scope = Scope::new();
            scope.expect(&REPORTED, false, || "first".into());
            scope.expect(&REPORTED, false, || "second".into());
            let report = scope.report().unwrap();
            let row = report
                .rows
                .iter()
                .find(|r| r.name == "report.example")
                .unwrap();
            assert_eq!(row.violations, 2);
            assert_eq!(row.module, "unikv_invariants::report::tests");
            assert_eq!(report.total_violations(), 2, "only this scope's breaches");
            let only = Report {
                level: report.level,
                rows: vec![row.clone()],
            };
            insta::assert_snapshot!(only.to_string());
        });
    }
}
