//! The Rust half of `bindings/python/bench.py`: the same decode step the script times
//! through Python (`alloc_decode` for the batch, the step metadata with its host image,
//! the step boundary), timed here through the facade, in the same process.

use crate::errors::{guarded, invalid, to_py};
use pyo3::prelude::*;
use std::time::Instant;
use unikv::{HybridCache, ModelSpec, StepMetadata, TokenId};

/// Builds a cache of `model` (`memory` bytes, page size `page_size`, unified, on
/// `device`: `"cpu"` or `"none"`), admits
/// `batch` requests of `prompt` distinct tokens, prefills them, then times `warmup +
/// steps` decode steps and returns the last `steps` step times in nanoseconds (wall
/// clock, as the script measures Python's).
#[pyfunction]
#[pyo3(signature = (*, model, memory, page_size, batch, prompt, warmup, steps, device = "cpu"))]
#[allow(clippy::too_many_arguments)]
pub fn _rust_decode_steps(
    py: Python<'_>,
    model: &str,
    memory: u64,
    page_size: u32,
    batch: usize,
    prompt: usize,
    warmup: usize,
    steps: usize,
    device: &str,
) -> PyResult<Vec<u64>> {
    let device = crate::device(device)?;
    let spec =
        ModelSpec::by_name(model).ok_or_else(|| invalid(format!("unknown model {model:?}")))?;
    let run = || -> Result<Vec<u64>, unikv::Error> {
        let mut cache = HybridCache::builder()
            .model(spec)
            .page_size(page_size)
            .memory_bytes(memory)
            .device(device)
            .build()?;
        let mut requests = Vec::with_capacity(batch);
        for r in 0..batch as u32 {
            let tokens: Vec<TokenId> = (0..prompt as u32)
                .map(|t| TokenId(r * 1_000_000 + t))
                .collect();
            let hit = cache.match_prefix(tokens);
            let mut req = cache.admit(hit)?;
            cache.alloc_extend(&mut req, prompt)?;
            requests.push(req);
        }
        cache.step_boundary()?;
        let mut meta = StepMetadata::new();
        let mut times = Vec::with_capacity(steps);
        for step in 0..warmup + steps {
            let next = vec![TokenId(step as u32); batch];
            let start = Instant::now();
            let mut refs: Vec<&mut unikv::Request> = requests.iter_mut().collect();
            cache.alloc_decode(&mut refs, &next)?;
            let shape: Vec<(&unikv::Request, usize)> = requests.iter().map(|r| (r, 1)).collect();
            cache.build_step_metadata(&mut meta, &shape)?;
            std::hint::black_box(cache.step_view(&meta)?.host_image().len());
            cache.step_boundary()?;
            if step >= warmup {
                times.push(start.elapsed().as_nanos() as u64);
            }
        }
        for req in requests {
            cache.release(req)?;
        }
        Ok(times)
    };
    guarded(|| Ok(py.detach(run)))?.map_err(|e| to_py(py, e))
}
