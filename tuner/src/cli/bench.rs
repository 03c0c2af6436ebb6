//! `kivi bench`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi bench` is not implemented yet".into())
}
