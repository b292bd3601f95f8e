//! What the benchmarks' tables share: latency histograms read in microseconds, progress bars,
//! and numbers in SI units.

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

/// A latency histogram in ns, from 1 ns to ten minutes, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

/// Quantile `q` of `h` in microseconds (0 when empty).
pub fn us(h: &Histogram<u64>, q: f64) -> f64 {
    if h.is_empty() {
        0.0
    } else {
        h.value_at_quantile(q) as f64 / 1000.0
    }
}

/// A progress bar over `len` ops labelled `msg`, or a hidden one.
pub fn progress(enabled: bool, len: u64, msg: String) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>28} [{bar:30}] {pos}/{len} ops {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

/// `x` in SI units: `1.25M`, `830.4k`, `912`.
pub fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}
