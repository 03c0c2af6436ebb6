//! The CLI convention seen from outside, on the built binary: every
//! subcommand listed by `kivi --help` is asked for its own `--help`, and the
//! text must follow the one convention (the clap-model side of the same
//! rules is the `convention` unit test in `src/main.rs`). Also: shell
//! completions cover every subcommand.

use std::process::Command;

fn kivi(args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kivi"))
        .args(args)
        .output()
        .expect("run kivi");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The subcommands `kivi --help` lists (the `Commands:` section), without
/// clap's own `help`.
fn subcommands() -> Vec<String> {
    let (ok, out, err) = kivi(&["--help"]);
    assert!(ok, "{err}");
    let names: Vec<String> = out
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "help")
        .map(str::to_string)
        .collect();
    assert!(names.len() >= 8, "too few subcommands in: {out}");
    names
}

#[test]
fn every_subcommand_help_follows_the_convention() {
    let mut backends = 0;
    for sub in subcommands() {
        let (ok, help, err) = kivi(&[&sub, "--help"]);
        assert!(ok, "kivi {sub} --help: {err}");
        let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap_or("");
        // A scheme is named by a flag: `--scheme <SCHEME>`, never a bare `<SCHEME>`.
        assert!(
            !usage.replace("--scheme <SCHEME>", "").contains("<SCHEME"),
            "kivi {sub}: positional scheme in `{usage}`"
        );
        // Lists are plural: the old singular spellings are gone.
        for old in ["--batch ", "--batch\n", "--layout ", "--peer "] {
            assert!(
                !help.contains(old),
                "kivi {sub}: `{}` is a singular list flag",
                old.trim()
            );
        }
        // Every backend flag lists its fixed choices.
        if help.contains("--backend <BACKEND>") {
            backends += 1;
            let after = &help[help.find("--backend <BACKEND>").unwrap_or(0)..];
            assert!(
                after.contains("Possible values:"),
                "kivi {sub} --backend lists no values:\n{help}"
            );
            assert!(
                after.contains("- cpu:") || after.contains("- sim:"),
                "kivi {sub}:\n{help}"
            );
        }
        // Token counts take suffixes: each parses `1k` and refuses `1x`.
        // (`--flag=VALUE` is parsed at once, so the unknown flag after it
        // stops the run only when the value passed.)
        for flag in [
            "--context",
            "--contexts",
            "--window",
            "--block-tokens",
            "--prefill-tokens",
            "--tile",
            "--tokens",
        ] {
            if help.contains(&format!("{flag} <")) {
                let (_, _, err) = kivi(&[&sub, &format!("{flag}=1k"), "--not-a-flag"]);
                assert!(err.contains("'--not-a-flag'"), "kivi {sub} {flag}=1k is refused: {err}");
                let (_, _, err) = kivi(&[&sub, &format!("{flag}=1x"), "--not-a-flag"]);
                assert!(err.contains("`1x` is not"), "kivi {sub} {flag}=1x is accepted: {err}");
            }
        }
    }
    assert!(backends >= 3, "only {backends} subcommands with --backend");
}

#[test]
fn bash_completions_mention_every_subcommand() {
    let (ok, bash, err) = kivi(&["completions", "bash"]);
    assert!(ok, "{err}");
    assert!(bash.contains("complete -F _kivi"), "{bash}");
    for sub in subcommands() {
        assert!(bash.contains(&sub), "bash completions lack `{sub}`");
    }
    for shell in ["zsh", "fish"] {
        let (ok, out, err) = kivi(&["completions", shell]);
        assert!(ok && out.contains("attend"), "{shell}: {err}");
    }
    let (ok, _, err) = kivi(&["completions", "tcsh"]);
    assert!(
        !ok && err.lines().count() == 1 && err.contains("possible values"),
        "{err}"
    );
}
