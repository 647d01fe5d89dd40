//! Sizes, counts and durations: parsing `--memory` values, the page size bound, and
//! printing bytes, grouped digits and nanoseconds for reports.

use crate::error::WorkloadError;

/// The units `--memory` accepts, case-insensitive: decimal (powers of 1000) and binary
/// (powers of 1024). A bare number is bytes.
const UNITS: [(&str, u64); 9] = [
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// Parses a memory size: a decimal number (`24`, `1.5`), optional spaces and an
/// optional unit (`B`, `KB`, `MB`, `GB`, `TB` in powers of 1000; `KiB`, `MiB`, `GiB`,
/// `TiB` in powers of 1024; any case). `24GiB`, `512MiB`, `1.5GB`, `4096` (bytes). A
/// fraction with a unit is rounded down to whole bytes; a plain byte count must be whole.
/// Single-letter units (`G`, `M`) are refused as ambiguous.
///
/// ```
/// use unikv_workload::units::parse_memory;
/// assert_eq!(parse_memory("24GiB").unwrap(), 24 << 30);
/// assert_eq!(parse_memory("1.5GB").unwrap(), 1_500_000_000);
/// assert!(parse_memory("24G").is_err()); // GiB or GB?
/// ```
pub fn parse_memory(text: &str) -> Result<u64, WorkloadError> {
    let bad = |reason| WorkloadError::BadMemory {
        value: text.to_string(),
        reason,
    };
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(bad("empty"));
    }
    if trimmed.starts_with('-') {
        return Err(bad("a size cannot be negative"));
    }
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let multiplier = if unit.is_empty() {
        1
    } else if let Some(&(_, m)) = UNITS.iter().find(|(name, _)| *name == unit) {
        m
    } else if matches!(unit.as_str(), "k" | "m" | "g" | "t") {
        return Err(bad(
            "a one-letter unit is ambiguous: write GiB (2^30) or GB (10^9)",
        ));
    } else {
        return Err(bad("unknown unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"));
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) => (w, f),
        None => (number, ""),
    };
    if whole.is_empty() && fraction.is_empty()
        || fraction.contains('.')
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad("not a number"));
    }
    if fraction.len() > 18 {
        return Err(bad("too many decimal places"));
    }
    // value = (whole + fraction / 10^f) × multiplier, exactly, in u128.
    let scale = 10u128.pow(fraction.len() as u32);
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad("too large"))?
    };
    let fraction_value: u128 = if fraction.is_empty() {
        0
    } else {
        fraction.parse().map_err(|_| bad("not a number"))?
    };
    let scaled = whole
        .checked_mul(scale)
        .and_then(|w| w.checked_add(fraction_value))
        .and_then(|v| v.checked_mul(u128::from(multiplier)))
        .ok_or(bad("too large"))?;
    if multiplier == 1 && scaled % scale != 0 {
        return Err(bad("a byte count must be a whole number"));
    }
    let bytes = u64::try_from(scaled / scale).map_err(|_| bad("too large"))?;
    if bytes == 0 {
        return Err(bad("the size must be positive"));
    }
    Ok(bytes)
}

/// Bytes in binary units with two decimals (`16.00 GiB`, `512.00 MiB`, `768 B`).
pub fn format_bytes(bytes: u64) -> String {
    const STEPS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = STEPS[0];
    for next in &STEPS[1..] {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = next;
    }
    format!("{value:.2} {unit}")
}

/// `1234567` → `1,234,567`.
pub fn group_digits(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The largest page size accepted (far above any engine's; keeps page arithmetic small);
/// also the limit of an ops trace's header.
pub const MAX_PAGE_SIZE: u32 = 1 << 16;

/// Nanoseconds as `850 ns`, `12.3 µs`, `4.56 ms` or `1.23 s`.
pub fn format_ns(ns: u64) -> String {
    match ns {
        0..1_000 => format!("{ns} ns"),
        1_000..1_000_000 => format!("{:.1} µs", ns as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.2} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes_parse_in_every_unit() {
        let cases: [(&str, u64); 16] = [
            ("24GiB", 24 << 30),
            ("512MiB", 512 << 20),
            ("1.5GB", 1_500_000_000),
            ("4096", 4096),
            ("4096B", 4096),
            ("24 GiB", 24 << 30),
            ("  16gib ", 16 << 30),
            ("1.5GiB", 1_610_612_736),
            ("0.5KiB", 512),
            (".5KB", 500),
            ("2.KB", 2_000),
            ("1TB", 1_000_000_000_000),
            ("1TiB", 1 << 40),
            ("3kb", 3_000),
            ("0.1GiB", 107_374_182), // 107,374,182.4 rounded down
            ("18446744073709551615", u64::MAX),
        ];
        for (text, bytes) in cases {
            assert_eq!(parse_memory(text).unwrap(), bytes, "{text}");
        }
    }

    #[test]
    fn bad_memory_sizes_say_why() {
        let cases = [
            ("", "empty"),
            ("   ", "empty"),
            ("-1GiB", "negative"),
            ("24G", "ambiguous"),
            ("24m", "ambiguous"),
            ("24 parsecs", "unknown unit"),
            ("GiB", "not a number"),
            (".GiB", "not a number"),
            ("1.2.3GB", "not a number"),
            ("1e9", "unknown unit"),
            ("1.5", "whole number"),
            ("0", "positive"),
            ("0.0000001KB", "positive"),
            ("18446744073709551616", "too large"),
            ("17000000TiB", "too large"),
        ];
        for (text, reason) in cases {
            match parse_memory(text) {
                Err(WorkloadError::BadMemory { value, reason: got }) => {
                    assert_eq!(value, text);
                    assert!(got.contains(reason), "{text}: {got}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        let message = parse_memory("24G").unwrap_err().to_string();
        assert!(
            message.contains("\"24G\"") && message.contains("24GiB"),
            "{message}"
        );
    }

    #[test]
    fn bytes_and_durations_print_readably() {
        assert_eq!(format_bytes(768), "768 B");
        assert_eq!(format_bytes(1024), "1.00 KiB");
        assert_eq!(format_bytes(16 << 30), "16.00 GiB");
        assert_eq!(format_bytes(1_610_612_736), "1.50 GiB");
        assert_eq!(format_bytes(u64::MAX), "16384.00 PiB");
        assert_eq!(format_ns(850), "850 ns");
        assert_eq!(format_ns(12_345), "12.3 µs");
        assert_eq!(format_ns(4_560_000), "4.56 ms");
        assert_eq!(format_ns(1_230_000_000), "1.23 s");
    }

    #[test]
    fn digits_are_grouped_by_thousands() {
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1_000), "1,000");
        assert_eq!(group_digits(1_234_567), "1,234,567");
    }
}
