//! `kivi generate` end to end (with the `eval` feature, which brings the
//! model): on an f16 cache its greedy text is the plain forward's, the
//! prompt comes from an argument or stdin, the summary goes to stderr, and
//! bad input is one line and a non-zero exit. Uses the model in
//! `$KIVI_CACHE_DIR/models` or `.cache/models` (fetched on first use).
#![cfg(feature = "eval")]

use kivi_eval::model::{Gemma3, Logits, Weights};
use std::io::Write;
use std::process::{Command, Output, Stdio};

const PROMPT: &str = "The capital of France is Paris. The capital of Germany is";

fn kivi(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kivi"))
        .arg("generate")
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kivi");
    let mut pipe = child.stdin.take().expect("stdin");
    if let Some(s) = stdin {
        pipe.write_all(s.as_bytes()).expect("write stdin");
    }
    drop(pipe);
    child.wait_with_output().expect("wait for kivi")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn fails(args: &[&str], want: &str) {
    let o = kivi(args, None);
    let err = text(&o.stderr);
    assert!(!o.status.success(), "{args:?} should fail; stdout {}", text(&o.stdout));
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err} lacks {want:?}");
}

#[test]
fn f16_greedy_text_is_the_plain_forwards_and_stdin_works() {
    let path = kivi_eval::fetch::ensure_model(&kivi_eval::fetch::models_dir(), &mut |l| eprintln!("{l}")).unwrap();
    let (m, tok) = Gemma3::load(&path, 128, Weights::F32).unwrap();
    let mut seq = tok.encode(PROMPT, false);
    let start = seq.len();
    for _ in 0..16 {
        let l: Vec<f32> = m
            .forward(&seq, Logits::Last, false)
            .unwrap()
            .logits
            .unwrap()
            .get(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        seq.push(l.iter().enumerate().fold(0, |b, (i, &x)| if x > l[b] { i } else { b }) as u32);
    }
    let want = tok.decode(&seq[start..]).unwrap();

    let o = kivi(
        &["--scheme", "f16", "--max-tokens", "16", "--prefill-chunk", "7", PROMPT],
        None,
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), format!("{want}\n"));
    let err = text(&o.stderr);
    assert!(
        err.contains("prefilled at") && err.contains("decode") && err.contains("vs f16"),
        "{err}"
    );

    // The prompt from stdin (absent argument, and `-`), kivi2 this time.
    let a = kivi(&["--scheme", "kivi2", "--max-tokens", "4", PROMPT], None);
    let b = kivi(&["--scheme", "kivi2", "--max-tokens", "4"], Some(PROMPT));
    let c = kivi(&["--scheme", "kivi2", "--max-tokens", "4", "-"], Some(PROMPT));
    assert!(a.status.success() && b.status.success() && c.status.success());
    assert!(!text(&a.stdout).trim().is_empty());
    assert_eq!((text(&a.stdout), text(&a.stdout)), (text(&b.stdout), text(&c.stdout)));
}

#[test]
fn bad_input_is_one_line_and_a_failure() {
    fails(&["--scheme", "kivi9", "x"], "kivi9");
    fails(&["--model", "/nonexistent/model.gguf", "x"], "/nonexistent/model.gguf");
    fails(&["--top-p", "0", "x"], "top-p");
    fails(&["--temperature=-1", "x"], "temperature");
    fails(&["--prefill-chunk", "0", "x"], "--prefill-chunk");
    let long = "word ".repeat(100);
    fails(&["--max-context", "32", &long], "--max-context");
    // An empty prompt on stdin.
    let o = kivi(&[], Some("  \n"));
    assert!(
        !o.status.success() && text(&o.stderr).contains("empty"),
        "{}",
        text(&o.stderr)
    );
}
