//! [`thread_cpu_time`]: the calling thread's CPU time, for step timers that must not
//! count preemption on a shared machine.

use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// The origin of the fallback's readings.
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// CPU time the calling thread has run (`CLOCK_THREAD_CPUTIME_ID`): time it waited to be
/// scheduled does not count, so an interval timed with it costs what its work costs. Only
/// differences of two readings on one thread mean anything. Each reading is a system
/// call (0.1–1 µs), so it suits per-step timing, not per-op. Wall time where the platform
/// has no thread CPU clock.
///
/// ```
/// let before = unikv_kernels::thread_cpu_time();
/// let spin: u64 = (0..100_000u64).map(std::hint::black_box).sum();
/// assert!(spin > 0 && unikv_kernels::thread_cpu_time() >= before);
/// ```
pub fn thread_cpu_time() -> Duration {
    thread_cpu().unwrap_or_else(|| EPOCH.elapsed())
}

/// What one [`thread_cpu_time`] reading adds to an interval it closes: the least of a
/// few back-to-back differences, measured once per process. A step timer subtracts it so
/// that an empty interval reads about zero.
pub fn thread_cpu_time_overhead() -> Duration {
    static OVERHEAD: LazyLock<Duration> = LazyLock::new(|| {
        (0..32)
            .map(|_| {
                let a = thread_cpu_time();
                thread_cpu_time().saturating_sub(a)
            })
            .min()
            .unwrap_or_default()
    });
    *OVERHEAD
}

#[cfg(unix)]
fn thread_cpu() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable `timespec` for the call's duration, and
    // `CLOCK_THREAD_CPUTIME_ID` is a clock id the platform defines.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(not(unix))]
fn thread_cpu() -> Option<Duration> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sleeping_costs_no_thread_cpu_time() {
        let (wall, cpu) = (Instant::now(), thread_cpu_time());
        std::thread::sleep(Duration::from_millis(30));
        let slept_cpu = thread_cpu_time() - cpu;
        assert!(wall.elapsed() >= Duration::from_millis(30));
        if cfg!(unix) {
            assert!(slept_cpu < Duration::from_millis(10), "{slept_cpu:?}");
        }
    }
}
