//! `kivi attend`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi attend` is not implemented yet".into())
}
