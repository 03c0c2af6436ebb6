//! A quick run of the evaluation without the `kivi` binary:
//! `cargo run --release -p kivi-eval --example quick -- [tokens] [prefix] [schemes,...]`.

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let mut cfg = kivi_eval::metrics::EvalConfig::default();
    if let Some(t) = a.first() {
        cfg.tokens = t.parse().expect("tokens");
    }
    if let Some(p) = a.get(1) {
        cfg.prefix = p.parse().expect("prefix");
    }
    if let Some(s) = a.get(2) {
        cfg.schemes = s.split(',').map(String::from).collect();
    }
    cfg.layers = std::env::var("NO_LAYERS").is_err();
    if std::env::var("QUANTIZED").is_ok() {
        cfg.weights = kivi_eval::model::Weights::Quantized;
    }
    match kivi_eval::metrics::run(&cfg, &mut |l| eprintln!("{l}")) {
        Ok(r) => println!("{}", r.markdown()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
