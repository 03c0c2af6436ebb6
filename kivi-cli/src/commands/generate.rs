//! `kivi generate`: Gemma 3 270M generating text on a kivi cache, through
//! the candle integration (kivi-candle). The prompt is prefilled in chunks
//! straight into the quantized cache, then tokens are decoded one at a time
//! and streamed to stdout as they come; the summary (speeds, exact KV
//! bytes against f16) goes to stderr. The model code (candle) is heavy, so
//! it lives behind the `eval` feature:
//! `cargo run --release -p kivi-cli --features eval -- generate --scheme kivi2 "..."`.

use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The prompt; read from stdin when absent or `-`
    pub prompt: Option<String>,
    /// KV-cache scheme: `f32`, a preset name, scheme text or a scheme file (see `kivi show --help`)
    #[arg(long, default_value = "kivi2")]
    pub scheme: String,
    /// Tokens to generate at most (`1k` = 1024)
    #[arg(long, default_value = "64", value_parser = crate::args::count)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: draw from the smallest most likely set whose probability reaches this
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampler
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Wrap the prompt in Gemma's chat template (one user turn, then the model's)
    #[arg(long)]
    pub chat: bool,
    /// Prompt tokens per prefill step
    #[arg(long, default_value = "256", value_parser = crate::args::count)]
    pub prefill_chunk: usize,
    /// Tokens of context (prompt and generated); sizes the cache and the RoPE tables
    #[arg(long, default_value = "4k", value_parser = crate::args::count)]
    pub max_context: usize,
    /// A Gemma 3 GGUF file (default: fetch Gemma 3 270M Q4_K_M into $KIVI_CACHE_DIR/models or .cache/models)
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Worker threads for the model and the cache
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

#[cfg(feature = "eval")]
pub fn run(args: Args) -> super::Result {
    use kivi_eval::generate::{check_sampling, generate, GenerateConfig, Sampling, Stop};
    use kivi_eval::model::{Gemma3, Weights};
    use std::io::{Read, Write};

    // Everything about the arguments is checked before the model loads.
    let scheme = kivi_eval::kv::resolve_scheme(&args.scheme)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
    };
    check_sampling(&sampling)?;
    if args.max_context < 2 || args.prefill_chunk == 0 {
        return Err("--max-context must be at least 2 and --prefill-chunk at least 1".into());
    }
    let prompt = match args.prompt.as_deref() {
        Some(p) if p != "-" => p.to_string(),
        _ => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| format!("reading the prompt from stdin: {e}"))?;
            s
        }
    };
    if prompt.trim().is_empty() {
        return Err("the prompt is empty".into());
    }
    let path = match args.model {
        Some(p) if !p.is_file() => return Err(format!("model file {} does not exist", p.display()).into()),
        Some(p) => p,
        None => kivi_eval::fetch::ensure_model(&kivi_eval::fetch::models_dir(), &mut |l| {
            eprintln!("kivi generate: {l}")
        })?,
    };
    kivi_eval::set_threads(args.threads)?;
    let (model, tok) = Gemma3::load(&path, args.max_context, Weights::F32)?;
    let text = if args.chat {
        format!("<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n")
    } else {
        prompt
    };
    // Control tokens are parsed only in the template (the user's own text
    // could hold the strings; with --chat it is the template's turn anyway).
    let ids = tok.encode(&text, args.chat);
    if ids.len() >= args.max_context {
        return Err(format!(
            "the prompt has {} tokens, more than --max-context {} leaves room for; raise --max-context",
            ids.len(),
            args.max_context
        )
        .into());
    }
    let scheme_name = scheme.name.clone();
    let mut cache = model.new_cache(&[scheme], args.max_context)?;
    let mut stop = vec![tok.eos()];
    stop.extend(tok.id_of("<end_of_turn>"));
    let cfg = GenerateConfig {
        max_tokens: args.max_tokens,
        prefill_chunk: args.prefill_chunk,
        sampling,
        stop,
    };

    // Streaming: decode everything generated so far and print what is new,
    // holding back a tail that ends inside a UTF-8 character (the tokenizer
    // emits single bytes for rare characters; decoding a partial one gives
    // U+FFFD, which the next byte turns into the real character).
    let mut out = std::io::stdout().lock();
    let mut generated = Vec::new();
    let mut printed = 0;
    let mut emit = |generated: &[u32], last: bool, printed: &mut usize| -> kivi_eval::Result<()> {
        let text = tok.decode(generated)?;
        if (last || !text.ends_with('\u{fffd}')) && text.len() > *printed {
            if let Some(new) = text.get(*printed..) {
                out.write_all(new.as_bytes())
                    .and_then(|()| out.flush())
                    .map_err(|e| kivi_eval::Error::Config(format!("writing to stdout: {e}")))?;
                *printed = text.len();
            }
        }
        Ok(())
    };
    let g = generate(&model, &mut cache, &ids, &cfg, &mut |t| {
        generated.push(t);
        emit(&generated, false, &mut printed)
    })?;
    emit(&generated, true, &mut printed)?;
    let _ = writeln!(out);

    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let why = match g.stop {
        Stop::StopToken => "end of turn",
        Stop::MaxTokens => "--max-tokens",
        Stop::ContextFull => "--max-context reached",
    };
    eprintln!(
        "kivi generate: {} prompt tokens prefilled at {:.1} tokens/s ({}-token chunks), {} generated, decode {:.1} tokens/s, stopped by {why}; \
         KV cache ({}) {} bytes for {} tokens vs f16 {} bytes ({:.3} of f16; windows are allocated whole from the first token)",
        g.prompt_tokens,
        rate(g.prompt_tokens, g.prefill_secs),
        args.prefill_chunk,
        g.tokens.len(),
        rate(g.decode_steps, g.decode_secs),
        scheme_name,
        g.kv_bytes,
        cache.current_seq_len(),
        g.f16_bytes,
        if g.f16_bytes > 0 { g.kv_bytes as f64 / g.f16_bytes as f64 } else { 0.0 }
    );
    Ok(())
}

#[cfg(not(feature = "eval"))]
pub fn run(_args: Args) -> super::Result {
    Err(
        "built without the `eval` feature; run `cargo run --release -p kivi-cli --features eval -- generate ...`"
            .into(),
    )
}
