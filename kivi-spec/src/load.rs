//! The one scheme loader: what a scheme argument (`kivi show --scheme ARG`,
//! `kivi tune --scheme ARG`, `kivi eval --schemes ARG,...`, a library
//! caller) means.
//!
//! **The rule**, tried in this order, first match wins:
//!
//! 1. **Scheme text** — the argument contains `{`: it is parsed as scheme
//!    text (`"x { key: full, value: full }"`).
//! 2. **A preset** — the argument is a preset name (`kivi2`, see
//!    [`crate::presets::listed`]), or one of the extra names the caller adds
//!    (the eval harness adds `f32`).
//! 3. **A file** — anything else is the path of a file holding one scheme.
//!
//! Presets win over files so that `kivi2` means the same scheme in every
//! directory; write a path with a `/` (`./kivi2`) to load a file whose name
//! is also a preset's. When a preset wins over an existing file of the same
//! name, [`ResolvedScheme::note`] says so (the CLI prints it on stderr).
//!
//! ```
//! use kivi_spec::{load_scheme, presets};
//! assert_eq!(load_scheme("kivi2").unwrap(), presets::kivi2());
//! let s = load_scheme("mine { key: full, value: quant(bits = 4, axis = token, group = 32) }").unwrap();
//! assert_eq!(s.name, "mine");
//! let e = load_scheme("kivi9").unwrap_err().to_string();
//! assert!(e.contains("not a preset (kivi2, kivi4,"), "{e}");
//! assert!(e.contains("no file `kivi9`"), "{e}");
//! ```

use crate::model::Scheme;
use crate::parse::{parse_scheme, ParseError};
use std::fmt;
use std::path::{Path, PathBuf};

/// Where a loaded scheme came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SchemeSource {
    /// The argument was scheme text.
    Text,
    /// A preset (or a caller's extra name).
    Preset,
    /// A scheme file.
    File(PathBuf),
}

/// A scheme and how [`resolve_scheme`] found it.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedScheme {
    pub scheme: Scheme,
    pub source: SchemeSource,
    /// Set when a preset was chosen although a file of that name exists.
    pub note: Option<String>,
}

/// Why a scheme argument could not be loaded. The message names the
/// argument and, when nothing matched, every rule that was tried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadError {
    /// Scheme text (inline, or read from `file`) that does not parse or validate.
    Parse { file: Option<PathBuf>, error: ParseError },
    /// A file that exists but cannot be read.
    Read { path: PathBuf, reason: String },
    /// No rule matched.
    NotFound {
        arg: String,
        presets: Vec<String>,
        /// Why the file rule failed (`no such file`, ...).
        file: String,
    },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // `path:line:column: message`, like a compiler, so editors can jump to it.
            LoadError::Parse { file: Some(p), error } => write!(f, "{}:{error}", p.display()),
            LoadError::Parse { file: None, error } => write!(f, "scheme text:{error}"),
            LoadError::Read { path, reason } => {
                write!(f, "cannot read scheme file `{}`: {reason}", path.display())
            }
            LoadError::NotFound { arg, presets, file } => write!(
                f,
                "unknown scheme `{arg}`: not scheme text (no `{{`), not a preset ({}), and no file `{arg}` ({file})",
                presets.join(", ")
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// Loads a scheme argument by the rule in the [module docs](self).
pub fn load_scheme(arg: &str) -> Result<Scheme, LoadError> {
    resolve_scheme(arg, &[]).map(|r| r.scheme)
}

/// [`load_scheme`] with the source and a note, and `extra` named schemes
/// that count as presets (checked after the built-in ones).
pub fn resolve_scheme(arg: &str, extra: &[Scheme]) -> Result<ResolvedScheme, LoadError> {
    if arg.contains('{') {
        let scheme = parse_scheme(arg).map_err(|error| LoadError::Parse { file: None, error })?;
        return Ok(ResolvedScheme {
            scheme,
            source: SchemeSource::Text,
            note: None,
        });
    }
    let presets: Vec<Scheme> = crate::presets::listed()
        .into_iter()
        .chain(extra.iter().cloned())
        .collect();
    let path = Path::new(arg);
    if let Some(p) = presets.iter().find(|p| p.name == arg) {
        let note = path.is_file().then(|| {
            format!("`{arg}` is the preset of that name; the file `{arg}` was not read (write `./{arg}` to load it)")
        });
        return Ok(ResolvedScheme {
            scheme: p.clone(),
            source: SchemeSource::Preset,
            note,
        });
    }
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8(bytes).map_err(|_| LoadError::Read {
            path: path.to_path_buf(),
            reason: "it is not UTF-8 text".into(),
        })?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound || arg.is_empty() => {
            return Err(LoadError::NotFound {
                arg: arg.to_string(),
                presets: presets.into_iter().map(|p| p.name).collect(),
                file: io_reason(&e),
            })
        }
        Err(e) => {
            return Err(LoadError::Read {
                path: path.to_path_buf(),
                reason: io_reason(&e),
            })
        }
    };
    let scheme = parse_scheme(&text).map_err(|error| LoadError::Parse {
        file: Some(path.to_path_buf()),
        error,
    })?;
    Ok(ResolvedScheme {
        scheme,
        source: SchemeSource::File(path.to_path_buf()),
        note: None,
    })
}

/// A short, lower-case reason for an I/O error, without the OS error code.
fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => {
            let s = e.to_string();
            s.split(" (os error").next().unwrap_or(&s).to_lowercase()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kivi-spec-load-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    const INT8_TEXT: &str = "fromfile { key: quant(bits = 8, axis = token, group = 32), value: full }";

    #[test]
    fn presets_win_over_files_and_a_slash_forces_the_file() {
        let d = temp_dir("shadow");
        let file = d.join("kivi2");
        std::fs::write(&file, INT8_TEXT).unwrap();
        // A path with a separator is never a preset name.
        let r = resolve_scheme(file.to_str().unwrap(), &[]).unwrap();
        assert_eq!(r.scheme.name, "fromfile");
        assert_eq!(r.source, SchemeSource::File(file.clone()));
        // The bare name is the preset (the note about a shadowed file in the
        // working directory is checked by the CLI tests, which can set it).
        assert_eq!(load_scheme("kivi2").unwrap(), presets::kivi2());
    }

    #[test]
    fn text_extra_names_and_errors() {
        let r = resolve_scheme("t { key: full, value: full }", &[]).unwrap();
        assert_eq!((r.scheme.name.as_str(), r.source), ("t", SchemeSource::Text));
        let mut f32s = presets::f16();
        f32s.name = "f32".into();
        assert_eq!(resolve_scheme("f32", &[f32s.clone()]).unwrap().scheme, f32s);
        let e = resolve_scheme("f32", &[]).unwrap_err().to_string();
        assert!(e.starts_with("unknown scheme `f32`: not scheme text"), "{e}");
        assert!(e.ends_with("no file `f32` (no such file)"), "{e}");
        let e = load_scheme("t { key: full }").unwrap_err().to_string();
        assert!(e.starts_with("scheme text:1:"), "{e}");
        assert!(e.contains("value"), "{e}");
        let d = temp_dir("errors");
        let bad = d.join("bad.kivi");
        std::fs::write(
            &bad,
            "b {\n key: full,\n value: quant(bits = 5, axis = token, group = 32) }",
        )
        .unwrap();
        let e = load_scheme(bad.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:3:", bad.display())), "{e}");
        let e = load_scheme(d.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.starts_with("cannot read scheme file"), "{e}");
        assert!(e.contains("directory"), "{e}");
        std::fs::write(&bad, b"\xff\xfe").unwrap();
        let e = load_scheme(bad.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("not UTF-8"), "{e}");
        let e = load_scheme("").unwrap_err().to_string();
        assert!(e.starts_with("unknown scheme ``"), "{e}");
    }
}
