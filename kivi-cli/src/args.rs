//! The argument types every subcommand shares, so that one spelling means
//! one thing everywhere (the convention is checked by the `convention`
//! tests in `main.rs`):
//!
//! - a scheme is `--scheme NAME` (one) or `--schemes A,B` (many), loaded by
//!   the one rule of `kivi_spec::resolve_scheme` — never positional, so
//!   `kivi show --scheme X` and `kivi tune --scheme X` read alike;
//! - lists are plural flags with comma-separated values (`--contexts 1k,4k`,
//!   `--batches 1,8`);
//! - token counts take binary size suffixes ([`count`], [`length`]);
//! - `--backend` is a fixed choice of [`BackendChoice`] through [`backend`], each
//!   subcommand offering the subset it can run, with the same help text.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::ValueEnum;

/// Largest count accepted: 2^30 tokens, far beyond any cache that fits in
/// memory, and small enough that products of counts cannot overflow.
const MAX: usize = 1 << 30;

/// `512`, `4k`, `32K`, `1m`: a number with an optional binary suffix
/// (`k` = 1024, `m` = 1024²), at most 2^30. Zero allowed; the one parser
/// behind [`count`] and [`length`].
fn size(s: &str, zero: bool) -> Result<usize, String> {
    let t = s.trim();
    let (num, mul) = match t.as_bytes().last() {
        Some(b'k' | b'K') => (&t[..t.len() - 1], 1024),
        Some(b'm' | b'M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    let what = if zero { "a count" } else { "a positive count" };
    // `parse::<usize>` takes a leading `+`; counts are plain digits.
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("`{s}` is not {what} (examples: 512, 4k, 32k)"));
    }
    match num.parse::<usize>().ok().and_then(|n| n.checked_mul(mul)) {
        Some(0) if !zero => Err(format!("`{s}` is not {what} (examples: 512, 4k, 32k)")),
        Some(n) if n <= MAX => Ok(n),
        _ => Err(format!("`{s}` is more than 2^30 (1024m)")),
    }
}

/// A positive token (or batch) count: `512`, `4k` (4096), `32K`, `1m`.
pub fn count(s: &str) -> Result<usize, String> {
    size(s, false)
}

/// A length that may be zero (an empty sequence in `--lens`), with the
/// same suffixes as [`count`].
pub fn length(s: &str) -> Result<usize, String> {
    size(s, true)
}

/// Every backend a subcommand may offer. One enum so that each name has
/// one help text everywhere; [`backend`] restricts it per subcommand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// cuda when a GPU is usable, else cpu
    Auto,
    /// The scalar oracle (DESIGN.md §3, plainly)
    Reference,
    /// The fused CPU kernel
    Cpu,
    /// The generated CUDA kernels on the simulated device (the CPU), through
    /// the same device cache and launches as a GPU
    Sim,
    /// The generated CUDA kernels on GPU 0 (fails, with the reason, where
    /// there is no GPU, driver or NVRTC)
    Cuda,
}

/// The `--backend` parser of a subcommand that offers `allowed`: clap lists
/// exactly those values (with their help) and refuses the others in its one
/// usage-error style.
pub fn backend(allowed: &'static [BackendChoice]) -> impl TypedValueParser<Value = BackendChoice> {
    let values = allowed
        .iter()
        .filter_map(|b| b.to_possible_value())
        .collect::<Vec<PossibleValue>>();
    PossibleValuesParser::new(values)
        .try_map(|name: String| BackendChoice::from_str(&name, false).map_err(|_| format!("`{name}` is not a backend")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_suffixes_and_refuse_junk() {
        assert_eq!(count("512"), Ok(512));
        assert_eq!(count("4k"), Ok(4096));
        assert_eq!(count(" 32K "), Ok(32768));
        assert_eq!(count("1m"), Ok(1 << 20));
        assert_eq!(count("1024m"), Ok(1 << 30));
        for bad in [
            "0",
            "0k",
            "",
            "k",
            "1x",
            "-1",
            "+1",
            "1.5k",
            "1kk",
            "99999999m",
            "99999999999999999999",
        ] {
            assert!(count(bad).is_err(), "{bad}");
        }
        assert_eq!(length("0"), Ok(0));
        assert_eq!(length("2k"), Ok(2048));
        assert!(length("-3").is_err());
        assert!(count("0").unwrap_err().contains("positive"));
        assert!(count("2048m").unwrap_err().contains("2^30"));
    }

    #[test]
    fn every_backend_name_round_trips() {
        for b in BackendChoice::value_variants() {
            let v = b.to_possible_value().expect("not skipped");
            assert_eq!(BackendChoice::from_str(v.get_name(), false), Ok(*b));
            assert!(v.get_help().is_some(), "{b:?} has no help");
        }
    }
}
