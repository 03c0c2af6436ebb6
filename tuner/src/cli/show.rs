//! `kivi show`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi show` is not implemented yet".into())
}
