//! The `gradpack-node` binary's start: a bad setting is an error naming it
//! and the process exits 1 (never a panic's 101).

use std::process::Command;

fn node(env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gradpack-node"));
    cmd.env_clear().envs([("DMLC_ROLE", "server"), ("DMLC_PS_ROOT_URI", "127.0.0.1"), ("DMLC_PS_ROOT_PORT", "9"), ("DMLC_NUM_WORKER", "1"), ("DMLC_NUM_SERVER", "1")]);
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_duration_out_of_range_is_named_and_the_node_exits_1() {
    for (var, value) in [("PS_HEARTBEAT_INTERVAL", "1e300"), ("PS_HEARTBEAT_TIMEOUT", "1e300"), ("PS_HEARTBEAT_INTERVAL", "-5"), ("PS_HEARTBEAT_TIMEOUT", "NaN")] {
        let (code, stderr) = node(&[(var, value)]);
        assert_eq!(code, Some(1), "{var}={value}: {stderr}");
        assert!(stderr.contains(&format!("invalid parameter '{var}': must be a number of seconds from 0.001 to 1000000, got '{value}'")), "{stderr}");
    }
}

