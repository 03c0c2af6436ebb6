//! A progress bar on stderr, drawn by hand (no dependency).
//!
//! On a terminal it redraws one line at most ten times a second and clears
//! it at the end; when stderr is not a terminal (CI logs, pipes) it draws
//! nothing, so logs stay readable (the final table says what happened).

use crate::bucket::Bucket;
use crate::tune::Progress;
use std::io::{IsTerminal, Write};
use std::time::Instant;

/// Progress over a list of buckets and a time budget.
pub struct Bar {
    tty: bool,
    buckets: Vec<Bucket>,
    start: Instant,
    last_draw: Option<Instant>,
    budget_s: f64,
    quiet: bool,
}

impl Bar {
    /// A bar for `buckets` (the ones that need tuning) and a budget in seconds.
    pub fn new(buckets: Vec<Bucket>, budget_s: f64, quiet: bool) -> Bar {
        Bar {
            tty: std::io::stderr().is_terminal(),
            buckets,
            start: Instant::now(),
            last_draw: None,
            budget_s,
            quiet,
        }
    }

    /// Clears the bar.
    pub fn clear(&mut self) {
        if self.tty && !self.quiet {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
        }
    }
}

impl Progress for Bar {
    fn update(&mut self, bucket: &Bucket, label: &str, done: usize, total: usize) {
        if !self.tty || self.quiet {
            return;
        }
        let now = Instant::now();
        if self.last_draw.is_some_and(|t| now.duration_since(t).as_millis() < 100) {
            return;
        }
        self.last_draw = Some(now);
        let bi = self.buckets.iter().position(|b| b == bucket).unwrap_or(0);
        let n = self.buckets.len().max(1);
        let inner = if total > 0 {
            done.min(total) as f64 / total as f64
        } else {
            0.0
        };
        let frac = ((bi as f64 + inner) / n as f64).clamp(0.0, 1.0);
        const W: usize = 28;
        let fill = (frac * W as f64).round() as usize;
        let bar: String = "#".repeat(fill) + &"-".repeat(W - fill);
        let el = self.start.elapsed().as_secs_f64();
        let mut label = label.to_string();
        if label.len() > 40 {
            label.truncate(40);
        }
        let _ = write!(
            std::io::stderr().lock(),
            "\r\x1b[2K[{bar}] {:3.0}%  {el:5.1}s/{:.0}s  bucket {}/{n} {bucket}  {label}",
            frac * 100.0,
            self.budget_s,
            bi + 1
        );
    }
}
