//! `kivi schemes`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi schemes` is not implemented yet".into())
}
