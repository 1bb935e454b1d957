//! `ferroce sim`: placeholder until the transport lands.

use std::process::ExitCode;

use clap::Args;

/// Arguments of `ferroce sim`.
#[derive(Debug, Args)]
pub struct SimArgs {}

/// Runs the simulator.
pub fn run(_args: &SimArgs) -> Result<ExitCode, String> {
    Err("the simulator is not built yet".into())
}
