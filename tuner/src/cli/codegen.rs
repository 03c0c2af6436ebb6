//! `kivi codegen`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi codegen` is not implemented yet".into())
}
