//! `kivi tune`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi tune` is not implemented yet".into())
}
