//! `kivi schemes`: the preset schemes, and loading a scheme by preset name
//! or from a scheme file (shared by `show` and `attend`).

use kivi_spec::{canonical_body, presets, scheme_hash, Scheme};

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

/// A scheme argument, by the one rule of [`kivi_spec::load_scheme`]:
/// scheme text if it contains `{`, else a preset name, else a file path.
/// When a preset shadows a file of the same name, says so on stderr.
pub fn load_scheme(arg: &str) -> super::Result<Scheme> {
    let r = kivi_spec::resolve_scheme(arg, &[])?;
    if let Some(note) = r.note {
        eprintln!("kivi: note: {note}");
    }
    Ok(r.scheme)
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
