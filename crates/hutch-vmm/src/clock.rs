//! The guest's clock rate. Under TCG, QEMU gives the guest the *host's* TSC (`rdtsc`
//! returns the host counter plus an offset), so the guest kernel must be told the
//! host's TSC frequency: with a made-up one (hutch used to pass 3 GHz on a 2.6 GHz host)
//! the guest clock runs at the ratio of the two and fell 13% behind the host (measured:
//! 0.78 s per 5.8 s). We measure the host's TSC against `CLOCK_MONOTONIC` (which follows
//! the host's NTP-disciplined rate) and hand it to the kernel as `tsc_early_khz`; the
//! kernel also skips its calibration, which under TCG hung about half the boots.

use std::path::Path;
use std::time::Duration;

/// Used when the host's TSC cannot be measured (not x86-64, or an implausible answer).
pub const FALLBACK_TSC_KHZ: u32 = 3_000_000;

/// How long the measurement counts: the error of each end is ~1 µs, so this gives
/// ~20 ppm (~1 ms a minute).
const WINDOW: Duration = Duration::from_millis(50);

/// The host's TSC rate in kHz, measured once per process, or read from `cache` when it
/// was measured since the host booted (the rate is fixed until a reboot).
pub fn host_tsc_khz(cache: Option<&Path>) -> u32 {
    static MEASURED: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *MEASURED.get_or_init(|| match cache {
        Some(file) => cached(file),
        None => measure().unwrap_or(FALLBACK_TSC_KHZ),
    })
}

fn cached(file: &Path) -> u32 {
    let boot = crate::accel::boot_id();
    if let Ok(text) = std::fs::read_to_string(file) {
        let mut lines = text.lines();
        if let (Some(b), Some(khz)) = (lines.next(), lines.next().and_then(|k| k.parse::<u32>().ok())) {
            if b == boot && !boot.is_empty() && plausible(khz) {
                return khz;
            }
        }
    }
    match measure() {
        Some(khz) => {
            let _ = std::fs::write(file, format!("{boot}\n{khz}\n"));
            khz
        }
        None => FALLBACK_TSC_KHZ,
    }
}

fn plausible(khz: u32) -> bool {
    (100_000..=10_000_000).contains(&khz)
}

/// One (TSC, monotonic ns) pair, from the tightest of a few tries: a try that was
/// preempted between the two reads shows a wide gap and loses.
#[cfg(target_arch = "x86_64")]
fn sample() -> (u64, u128) {
    let now = || nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map(|t| t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128).unwrap_or(0);
    let mut best = (u128::MAX, 0u64, 0u128);
    for _ in 0..16 {
        let before = now();
        // SAFETY: `rdtsc` only reads the time-stamp counter; it has no memory effects.
        let tsc = unsafe { core::arch::x86_64::_rdtsc() };
        let after = now();
        if after - before < best.0 {
            best = (after - before, tsc, before + (after - before) / 2);
        }
    }
    (best.1, best.2)
}

/// Measures the host's TSC rate in kHz.
#[cfg(target_arch = "x86_64")]
pub fn measure() -> Option<u32> {
    let (tsc0, ns0) = sample();
    std::thread::sleep(WINDOW);
    let (tsc1, ns1) = sample();
    let khz = u128::from(tsc1.checked_sub(tsc0)?) * 1_000_000 / ns1.checked_sub(ns0).filter(|d| *d > 0)?;
    u32::try_from(khz).ok().filter(|k| plausible(*k))
}

#[cfg(not(target_arch = "x86_64"))]
pub fn measure() -> Option<u32> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_tsc_rate_is_plausible_and_repeatable() {
        let (Some(a), Some(b)) = (measure(), measure()) else { return };
        // Two measurements of a fixed-rate counter agree within 0.1%.
        assert!((f64::from(a) - f64::from(b)).abs() / f64::from(a) < 1e-3, "{a} vs {b} kHz");
    }

    #[test]
    fn a_cache_from_another_boot_is_measured_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("host-tsc");
        std::fs::write(&file, "not-this-boot\n1234567\n").expect("write");
        let khz = cached(&file);
        assert_ne!(khz, 1_234_567);
        let text = std::fs::read_to_string(&file).expect("read");
        assert_eq!(text.lines().next(), Some(crate::accel::boot_id().as_str()));
    }
}
