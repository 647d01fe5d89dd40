// diag.cu: diagnostics, not data-plane kernels.
// Plain C types only: NVRTC compiles this without any CUDA toolkit header.

// The SM's 64-bit cycle counter, read by inline PTX (no header needed).
static __device__ unsigned long long unikv_clock64()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
    return t;
}

// Keeps one thread busy for about `cycles` SM clock cycles: a stream holding this kernel
// cannot reach later work until it ends, so a host call that returns while it still
// runs provably did not wait for the stream (the no-sync proof of `cargo xtask gpu`).
extern "C" __global__ void unikv_spin(unsigned long long cycles)
{
    unsigned long long start = unikv_clock64();
    while (unikv_clock64() - start < cycles) {
    }
}
