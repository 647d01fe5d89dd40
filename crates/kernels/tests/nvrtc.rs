//! CI check: every kernel source of `cu/` compiles with NVRTC.
//!
//! Needs libnvrtc at run time (e.g. from the `nvidia-cuda-nvrtc-cu12` wheel, on
//! `LD_LIBRARY_PATH`). Without it the test prints a loud `SKIPPED` line and passes,
//! unless `UNIKV_REQUIRE_NVRTC=1`, which CI sets, in which case it fails.
#![cfg(feature = "cuda")]

use unikv_kernels::Error;
use unikv_kernels::nvrtc::{self, KERNEL_SOURCES};

fn nvrtc_required() -> bool {
    std::env::var("UNIKV_REQUIRE_NVRTC").is_ok_and(|v| v.trim() == "1")
}

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    match nvrtc::compile_all() {
        Ok(compiled) => {
            let (major, minor) = nvrtc::version().unwrap();
            eprintln!("NVRTC {major}.{minor}, arch {}", nvrtc::CHECK_ARCH);
            let names: Vec<&str> = compiled.iter().map(|(name, _)| *name).collect();
            let expected: Vec<&str> = KERNEL_SOURCES.iter().map(|(name, _)| *name).collect();
            assert_eq!(names, expected);
            for (name, ptx_len) in compiled {
                eprintln!("compiled {name}: {ptx_len} bytes of PTX");
                assert!(ptx_len > 0, "{name} produced no PTX");
            }
        }
        Err(e @ Error::NoNvrtc) => {
            assert!(
                !nvrtc_required(),
                "UNIKV_REQUIRE_NVRTC=1 but NVRTC is unavailable: {e}"
            );
            eprintln!(
                "SKIPPED: libnvrtc not found ({e}); set UNIKV_REQUIRE_NVRTC=1 to fail instead"
            );
        }
        Err(e) => panic!("{e}"),
    }
}
