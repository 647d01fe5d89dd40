//! The CUDA kernel sources of this crate and their run-time compilation with NVRTC.
//!
//! Every `.cu` file of `crates/kernels/cu/` is listed once in [`KERNEL_SOURCES`] (a unit
//! test checks the list against the directory, so a new file cannot be forgotten) and
//! embedded with `include_str!`. [`compile_all`] compiles every one of them, which is
//! the CI check that no kernel is broken; [`CudaDevice`](crate::CudaDevice) compiles
//! them for its own GPU when it starts. Building needs no CUDA toolkit: the sources use
//! plain C types and include no header.
//!
//! Without the `cuda` feature the functions exist and return
//! [`Error::NotCompiledWithCuda`].

use crate::Error;

/// Every kernel source file: `(file name, source)`.
pub const KERNEL_SOURCES: &[(&str, &str)] = &[
    ("diag.cu", include_str!("../cu/diag.cu")),
    ("spans.cu", include_str!("../cu/spans.cu")),
    ("tables.cu", include_str!("../cu/tables.cu")),
    ("translate.cu", include_str!("../cu/translate.cu")),
];

/// The virtual architecture [`compile_all`] targets: generic enough for every GPU the
/// project supports (Ampere and newer), so the check does not depend on a local GPU.
pub const CHECK_ARCH: &str = "compute_80";

/// The source of one file of [`KERNEL_SOURCES`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn source(file: &str) -> Option<&'static str> {
    KERNEL_SOURCES
        .iter()
        .find(|(name, _)| *name == file)
        .map(|(_, src)| *src)
}

#[cfg(feature = "cuda")]
mod imp {
    use super::{CHECK_ARCH, KERNEL_SOURCES};
    use crate::Error;
    use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};
    use std::sync::OnceLock;

    /// Whether libnvrtc can be loaded; asked once per process.
    pub(crate) fn present() -> bool {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        *PRESENT.get_or_init(|| {
            // SAFETY: `is_culib_present` only tries `dlopen` on NVRTC's library names
            // (and closes what it opened). Loading runs that library's initialisers,
            // which have no precondition on our side; no NVRTC function is called.
            unsafe { cudarc::nvrtc::sys::is_culib_present() }
        })
    }

    /// Compiles one source for `arch` (e.g. `compute_90`).
    pub(crate) fn compile(file: &'static str, src: &str, arch: &str) -> Result<Ptx, Error> {
        if !present() {
            return Err(Error::NoNvrtc);
        }
        let opts = CompileOptions {
            name: Some(file.to_string()),
            options: vec![format!("--gpu-architecture={arch}")],
            ..CompileOptions::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| match e {
            CompileError::CompileError { log, .. } => Error::KernelCompile {
                file,
                log: log.to_string_lossy().into_owned(),
            },
            other => Error::KernelCompile {
                file,
                log: format!("{other:?}"),
            },
        })
    }

    pub(crate) fn compile_all() -> Result<Vec<(&'static str, usize)>, Error> {
        KERNEL_SOURCES
            .iter()
            .map(|&(file, src)| {
                let ptx = compile(file, src, CHECK_ARCH)?;
                Ok((file, ptx.as_bytes().map_or(0, <[u8]>::len)))
            })
            .collect()
    }

    pub(crate) fn version() -> Result<(i32, i32), Error> {
        if !present() {
            return Err(Error::NoNvrtc);
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: libnvrtc is loadable (checked above), so the symbol lookup succeeds;
        // `nvrtcVersion` only writes two ints through the valid pointers we pass.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
            .result()
            .map_err(|e| Error::Cuda(format!("nvrtcVersion: {e:?}")))?;
        Ok((major, minor))
    }
}

/// Compiles every file of [`KERNEL_SOURCES`] with NVRTC for [`CHECK_ARCH`] and returns
/// `(file name, PTX length)` for each.
///
/// Errors: [`Error::NoNvrtc`] when libnvrtc cannot be loaded,
/// [`Error::KernelCompile`] (with the compiler's log) for the first file that does not
/// compile, [`Error::NotCompiledWithCuda`] without the `cuda` feature.
pub fn compile_all() -> Result<Vec<(&'static str, usize)>, Error> {
    #[cfg(feature = "cuda")]
    return imp::compile_all();
    #[cfg(not(feature = "cuda"))]
    Err(Error::NotCompiledWithCuda)
}

/// The version `(major, minor)` of the libnvrtc that was loaded.
///
/// Errors: [`Error::NoNvrtc`] when libnvrtc cannot be loaded,
/// [`Error::NotCompiledWithCuda`] without the `cuda` feature.
pub fn version() -> Result<(i32, i32), Error> {
    #[cfg(feature = "cuda")]
    return imp::version();
    #[cfg(not(feature = "cuda"))]
    Err(Error::NotCompiledWithCuda)
}

#[cfg(feature = "cuda")]
pub(crate) use imp::compile;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_sources_list_every_cu_file_of_the_cu_directory() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/cu");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let listed: Vec<&str> = KERNEL_SOURCES.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            listed, on_disk,
            "KERNEL_SOURCES must list every cu/*.cu, sorted"
        );
    }

    #[test]
    fn kernel_sources_include_no_header() {
        for (name, src) in KERNEL_SOURCES {
            assert!(!src.contains("#include"), "{name} includes a header");
            assert!(source(name).is_some());
        }
    }

    /// The `extern "C" __global__` kernels a source file defines, by name.
    fn defined(src: &str) -> Vec<&str> {
        const DEFINITION: &str = "extern \"C\" __global__ void ";
        src.match_indices(DEFINITION)
            .map(|(at, _)| {
                let name = &src[at + DEFINITION.len()..];
                &name[..name.find('(').unwrap_or(name.len())]
            })
            .collect()
    }

    /// What a driver loads (`Kernel::ALL`, by symbol from its file) and what the sources
    /// define are the same kernels, so a kernel added to a `.cu` file and to `Kernel`
    /// (`unikv_translate_lanes`, say) is loaded by the real driver and compiled by
    /// [`compile_all`], and a misspelt symbol fails here rather than on a GPU.
    #[test]
    fn every_kernel_a_driver_loads_is_defined_in_its_file_and_no_other() {
        use crate::driver::Kernel;
        let mut loaded: Vec<(&str, &str)> =
            Kernel::ALL.iter().map(|k| (k.file(), k.symbol())).collect();
        let mut sources: Vec<(&str, &str)> = KERNEL_SOURCES
            .iter()
            .flat_map(|&(file, src)| defined(src).into_iter().map(move |name| (file, name)))
            .collect();
        loaded.sort_unstable();
        sources.sort_unstable();
        assert_eq!(loaded, sources);
        assert!(loaded.contains(&("translate.cu", "unikv_translate_lanes")));
    }

    /// With NVRTC, each of those kernels is an entry point of its file's PTX.
    #[cfg(feature = "cuda")]
    #[test]
    fn every_kernel_a_driver_loads_is_an_entry_of_its_compiled_file() {
        use crate::driver::Kernel;
        for &(file, src) in KERNEL_SOURCES {
            let ptx = match compile(file, src, CHECK_ARCH) {
                Ok(ptx) => ptx.to_src(),
                Err(Error::NoNvrtc) => {
                    let required =
                        std::env::var("UNIKV_REQUIRE_NVRTC").is_ok_and(|v| v.trim() == "1");
                    assert!(!required, "UNIKV_REQUIRE_NVRTC=1 but libnvrtc is not found");
                    eprintln!("SKIPPED: libnvrtc not found");
                    return;
                }
                Err(e) => panic!("{e}"),
            };
            for kernel in Kernel::ALL.iter().filter(|k| k.file() == file) {
                let entry = format!(".entry {}(", kernel.symbol());
                assert!(ptx.contains(&entry), "{file}: no `{entry}` in its PTX");
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_broken_kernel_is_a_compile_error_that_carries_the_log() {
        let broken = "extern \"C\" __global__ void broken(int* out) { out[0] = undeclared; }";
        match compile("broken.cu", broken, CHECK_ARCH) {
            Err(Error::KernelCompile { file, log }) => {
                assert_eq!(file, "broken.cu");
                assert!(log.contains("undeclared"), "{log}");
            }
            Err(Error::NoNvrtc) => {
                let required = std::env::var("UNIKV_REQUIRE_NVRTC").is_ok_and(|v| v.trim() == "1");
                assert!(!required, "UNIKV_REQUIRE_NVRTC=1 but libnvrtc is not found");
                eprintln!("SKIPPED: libnvrtc not found");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_feature_nvrtc_reports_not_compiled_with_cuda() {
        assert!(matches!(compile_all(), Err(Error::NotCompiledWithCuda)));
        assert!(matches!(version(), Err(Error::NotCompiledWithCuda)));
    }
}
