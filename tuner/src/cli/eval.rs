//! `kivi eval`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi eval` is not implemented yet".into())
}
