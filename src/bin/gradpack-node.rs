//! gradpack-node: runs a distributed job's scheduler or server from MXNet's
//! launch variables (DMLC_ROLE=scheduler|server, DMLC_PS_ROOT_URI,
//! DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER, ...; see
//! `gradpack::dist::config`). Exits 0 when the job ends, 1 on failure.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = gradpack::dist::Config::from_env().and_then(gradpack::dist::serve);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gradpack-node: {e}");
            ExitCode::FAILURE
        }
    }
}
