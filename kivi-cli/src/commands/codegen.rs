//! `kivi codegen`: print the CUDA source the generator writes for a scheme's
//! kernel, or list its variants. The same text is what NVRTC compiles (the
//! `cuda` backend) and what the `sim` backend runs on the CPU.

use super::schemes::load_scheme;
use super::show::parse_heads;
use kivi_spec::Heads;
use kivi_templates::{default_variant, generate, variants, Kernel, Variant};

#[derive(clap::Args)]
pub struct Args {
    /// Scheme text (contains `{`), else a preset name (`kivi schemes`), else a file path (`./NAME` for a file named like a preset)
    #[arg(long)]
    pub scheme: String,
    /// Head layout: gqa:Q:KV, mha:N or mqa:Q (default: the scheme's own, else gqa:32:8)
    #[arg(long, value_parser = parse_heads)]
    pub heads: Option<Heads>,
    /// Head dimension (default: the scheme's own, else 128)
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// Kernel: decode (with its combine step), append or prefill
    #[arg(long, default_value = "decode")]
    pub kernel: String,
    /// Variant name, e.g. t128.tile32.s8.h4.w1.u1 (default: the canonical one; see --list)
    #[arg(long)]
    pub variant: Option<String>,
    /// List the valid variants (canonical first) with their names and source hashes
    #[arg(long)]
    pub list: bool,
}

pub fn run(args: Args) -> super::Result {
    let scheme = load_scheme(&args.scheme)?;
    let bound = super::show::bind_or_default(&scheme, args.heads, args.head_dim)?;
    let kernel = Kernel::parse(&args.kernel)?;
    let all = variants(&bound, kernel);
    if args.list {
        println!(
            "# {} variants of {} for {}",
            all.len(),
            kernel,
            kivi_templates::scheme_tag(&bound)
        );
        for (i, v) in all.iter().enumerate() {
            let g = generate(&bound, kernel, v)?;
            let mark = if i == 0 { "  (canonical)" } else { "" };
            println!("{:<28} {:016x}{mark}", v.name(), g.hash);
        }
        return Ok(());
    }
    let variant = match &args.variant {
        Some(name) => Variant::parse(name)?,
        None => default_variant(&bound, kernel),
    };
    let g = generate(&bound, kernel, &variant)?;
    print!("{}", g.source);
    println!(
        "// ---- end of {} (source hash {:016x}); entry points: {}",
        g.name,
        g.hash,
        g.entry_points.join(", ")
    );
    for e in &g.launch.entries {
        println!(
            "//   {}: block {:?}, grid ({}, {}, batch), {} bytes of shared memory",
            e.entry, e.block, e.grid_xy[0], e.grid_xy[1], e.shared_bytes
        );
    }
    Ok(())
}
