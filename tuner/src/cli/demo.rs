//! `kivi demo`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi demo` is not implemented yet".into())
}
