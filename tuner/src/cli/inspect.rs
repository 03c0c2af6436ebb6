//! `kivi inspect`.

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> super::Result {
    Err("`kivi inspect` is not implemented yet".into())
}
