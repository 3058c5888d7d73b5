//! gradpack-node: runs a distributed job's scheduler or server from MXNet's
//! launch variables (DMLC_ROLE=scheduler|server, DMLC_PS_ROOT_URI,
//! DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER, ...; see
//! `gradpack::store::param_server::config`). Exits 0 when the job ends, 1 on failure.

use std::process::ExitCode;

fn main() -> ExitCode {
    let result = gradpack::store::param_server::Config::from_env().and_then(gradpack::store::param_server::serve);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gradpack-node: {e}");
            ExitCode::FAILURE
        }
    }
}
