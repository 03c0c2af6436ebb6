//! `kivi schemes`: the preset schemes, and loading a scheme by preset name
//! or from a scheme file (shared by `show` and `attend`).

use kivi_spec::{canonical_body, presets, scheme_hash, Scheme};
use std::path::Path;

#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array instead of a table
    #[arg(long)]
    pub json: bool,
}

/// The canonical form of a scheme on one line (fields only, defaults
/// included), e.g. `key: quant(bits = 2, ...), value: ..., residual: 128, ...`.
pub fn one_line(s: &Scheme) -> String {
    canonical_body(s)
        .lines()
        .map(|l| l.trim().trim_end_matches(','))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A stable hash as printed everywhere: 16 hex digits.
pub fn hash_hex(s: &Scheme) -> String {
    format!("{:016x}", scheme_hash(s))
}

/// A preset name (`kivi2`, ...) or the path of a file holding one scheme in
/// the `kivi::scheme!` language. A name that is both wins as a file only
/// when it exists on disk.
pub fn load_scheme(name_or_path: &str) -> super::Result<Scheme> {
    let path = Path::new(name_or_path);
    if path.is_file() {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("{}: {}", path.display(), crate::npy::io_reason(&e)))?;
        // `line:column: message`, like a compiler, so editors can jump to it.
        return kivi_spec::parse_scheme(&text).map_err(|e| format!("{}:{e}", path.display()).into());
    }
    if let Some(s) = presets::by_name(name_or_path) {
        return Ok(s);
    }
    let names: Vec<String> = presets::listed().into_iter().map(|s| s.name).collect();
    Err(format!(
        "unknown scheme `{name_or_path}`: not a preset ({}) and no such file",
        names.join(", ")
    )
    .into())
}

pub fn run(args: Args) -> super::Result {
    let all = presets::listed();
    if args.json {
        let v: Vec<serde_json::Value> = all
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name,
                    "hash": hash_hex(s),
                    "summary": one_line(s),
                    "canonical": kivi_spec::canonical(s),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let width = all.iter().map(|s| s.name.len()).max().unwrap_or(4).max(4);
    println!("{:width$}  {:16}  summary", "name", "hash");
    for s in &all {
        println!("{:width$}  {}  {}", s.name, hash_hex(s), one_line(s));
    }
    Ok(())
}
