//! Builds the C++ side: the cxx bridge always, and with feature `mxnet` the
//! MXNet extension-operator library (cpp/mxnet_ops.cc plus MXNet's own
//! src/lib_api.cc, taken from the installed mxnet wheel, never copied here).

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/bridge.rs");
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-changed=include");
    println!("cargo:rerun-if-env-changed=GRADPACK_MXNET_DIR");
    println!("cargo:rerun-if-env-changed=PYTHON");

    let mut build = cxx_build::bridge("src/bridge.rs");
    build.include("include").file("cpp/kvstore.cc").flag_if_supported("-std=c++17").flag_if_supported("-fPIC");

    if env::var_os("CARGO_FEATURE_MXNET").is_some() {
        let mxnet = mxnet_dir();
        let header = mxnet.join("include/mxnet/lib_api.h");
        let source = mxnet.join("src/lib_api.cc");
        for f in [&header, &source] {
            if !f.exists() {
                panic!("feature `mxnet`: {} not found; install mxnet==1.9.1 or set GRADPACK_MXNET_DIR", f.display());
            }
        }
        // lib_api.h is MXNet's code, compiled as shipped: silence its unused parameters.
        build.include(mxnet.join("include")).flag_if_supported("-Wno-unused-parameter").flag_if_supported("-Wno-deprecated-copy").flag_if_supported("-Wno-deprecated-copy-with-user-provided-copy").file("cpp/mxnet_ops.cc").file(&source);
        // MXNet dlopens the library and looks up lib_api.cc's extern "C" entry
        // points by name. A Rust cdylib exports only its own symbols (through
        // the version script rustc gives the linker; a second script is merged
        // differently by GNU ld and LLD, which then exported every C++ symbol),
        // so lib_api.cc's entry points are compiled as gpmx_<name>, and Rust
        // exports <name> as a jump to each (capi::mxnet_exports includes
        // the file written here).
        let symbols = lib_api_exports(&std::fs::read_to_string(&header).unwrap());
        for s in &symbols {
            build.define(s, format!("gpmx_{s}").as_str());
        }
        let out = PathBuf::from(env::var("OUT_DIR").unwrap());
        std::fs::write(out.join("mxnet_exports.rs"), mxnet_trampolines(&symbols)).unwrap();
    }
    build.compile("gradpack_cxx");
}

/// The mxnet package directory: $GRADPACK_MXNET_DIR, or where $PYTHON finds it.
fn mxnet_dir() -> PathBuf {
    if let Some(dir) = env::var_os("GRADPACK_MXNET_DIR") {
        return PathBuf::from(dir);
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = "import importlib.util, os; s = importlib.util.find_spec('mxnet'); print(os.path.dirname(s.origin) if s else '')";
    let out = Command::new(&python).args(["-c", probe]).output().unwrap_or_else(|e| panic!("feature `mxnet`: cannot run {python}: {e}"));
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if dir.is_empty() {
        panic!("feature `mxnet`: {python} cannot find the mxnet package; install mxnet==1.9.1 or set GRADPACK_MXNET_DIR");
    }
    PathBuf::from(dir)
}

/// The Rust side of each exported entry point: a function named as MXNet
/// looks it up that only jumps to lib_api.cc's, leaving every argument
/// register and the stack as MXNet set them, so the C signature is not
/// restated here.
fn mxnet_trampolines(symbols: &[String]) -> String {
    let mut code = String::new();
    for s in symbols {
        code += &format!(
            "unsafe extern \"C\" {{\n    fn gpmx_{s}();\n}}\n\
             /// lib_api.cc's `{s}` (compiled as `gpmx_{s}`), for MXNet's dlsym.\n\
             ///\n/// # Safety\n/// Callers follow MXNet's lib_api contract for `{s}`; this jump adds no requirement of its own.\n\
             #[unsafe(no_mangle)]\n#[unsafe(naked)]\npub unsafe extern \"C\" fn {s}() {{\n    \
             core::arch::naked_asm!(\"jmp {{0}}\", sym gpmx_{s})\n}}\n"
        );
    }
    code
}

/// Names of the extern "C" functions lib_api.h declares with MX_INT_RET /
/// MX_VOID_RET, plus `initialize` (which gradpack's operator library defines).
fn lib_api_exports(header: &str) -> Vec<String> {
    let mut names = vec!["initialize".to_string()];
    for line in header.lines() {
        let line = line.trim();
        for macro_name in ["MX_INT_RET ", "MX_VOID_RET "] {
            if let Some(rest) = line.strip_prefix(macro_name) {
                let name: String = rest.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                if !name.is_empty() && rest.trim()[name.len()..].starts_with('(') && !names.contains(&name) {
                    names.push(name);
                }
            }
        }
    }
    assert!(names.len() > 10, "lib_api.h: found only {names:?}");
    names
}
