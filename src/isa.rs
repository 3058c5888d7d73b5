//! Which instruction set the scheme kernels are compiled for: detected
//! once, cached in one enum, and a macro that compiles one kernel body for
//! each. Every version performs the same integer and IEEE operations in the
//! same order (no FMA, no reassociation), so every machine and kernel gives
//! the same bits; the tests compare each version this CPU can run.
//!
//! The 2-bit codec keeps its own hand-written AVX2 kernels (`codec::platform`).
//! Also here: when an out-of-place residual update streams its output
//! past the caches, and the stores that do it.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// The build's baseline target: runs everywhere.
    Baseline,
    /// x86-64 with AVX2 (8 float lanes), and the bit instructions every
    /// AVX2 CPU has: POPCNT, BMI1 and BMI2 (x86-64-v3's integer part).
    Avx2,
    /// x86-64 with AVX-512 F, BW, VL and DQ (16 float lanes).
    Avx512,
}

impl Isa {
    /// The widest set this CPU supports; detected on first use, then cached.
    /// `GRADPACK_KERNEL` caps it (`kernel_cap`: for benchmarks, and to run
    /// one machine as another).
    pub fn detect() -> Isa {
        static CHOICE: OnceLock<Isa> = OnceLock::new();
        *CHOICE.get_or_init(|| {
            let cap = kernel_cap();
            Isa::available().into_iter().rev().find(|&i| i as u8 <= cap as u8).unwrap_or(Isa::Baseline)
        })
    }

    /// Every set this CPU can run, narrowest first (tests compare them all).
    pub fn available() -> Vec<Isa> {
        [Isa::Baseline, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.is_supported()).collect()
    }

    /// The name `GRADPACK_KERNEL` gives this set ("portable", "avx2",
    /// "avx512"): what a node reports running.
    pub fn name(self) -> &'static str {
        self.c_name().to_str().expect("the names are ASCII")
    }

    /// `name` as a static C string (the C ABI's `gp_scheme_kernel_name`).
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            Isa::Baseline => c"portable",
            Isa::Avx2 => c"avx2",
            Isa::Avx512 => c"avx512",
        }
    }

    pub fn is_supported(self) -> bool {
        static FOUND: OnceLock<(bool, bool)> = OnceLock::new();
        let (avx2, avx512) = *FOUND.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let avx512 = is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512dq");
                let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("popcnt") && is_x86_feature_detected!("bmi1") && is_x86_feature_detected!("bmi2");
                (avx2, avx512 && avx2)
            }
            #[cfg(not(target_arch = "x86_64"))]
            (false, false)
        });
        match self {
            Isa::Baseline => true,
            Isa::Avx2 => avx2,
            Isa::Avx512 => avx512,
        }
    }
}

/// The widest set `GRADPACK_KERNEL` allows, read once: "portable" the
/// baseline (the 2-bit codec's portable kernel too), "avx2" AVX2, "avx512"
/// or unset any. Another value is named on stderr, once, and caps nothing.
pub fn kernel_cap() -> Isa {
    static CAP: OnceLock<Isa> = OnceLock::new();
    *CAP.get_or_init(|| {
        cap_of(std::env::var("GRADPACK_KERNEL").ok().as_deref()).unwrap_or_else(|why| {
            eprintln!("[gradpack] {why}");
            Isa::Avx512
        })
    })
}

fn cap_of(value: Option<&str>) -> Result<Isa, String> {
    match value {
        None | Some("") | Some("avx512") => Ok(Isa::Avx512),
        Some("avx2") => Ok(Isa::Avx2),
        Some("portable") => Ok(Isa::Baseline),
        Some(other) => Err(format!("GRADPACK_KERNEL={other:?} is not one of portable, avx2, avx512: the kernels run the widest set this CPU has")),
    }
}

/// The largest data or unified cache this CPU reports (Linux's
/// `/sys/devices/system/cpu/cpu0/cache`), in bytes; read once. None where
/// the system does not say. Kernels that would write past it stream their
/// output (non-temporal stores); below it, their output stays in cache.
pub fn last_level_cache() -> Option<usize> {
    static FOUND: OnceLock<Option<usize>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        dir.filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
            .filter(|e| std::fs::read_to_string(e.path().join("type")).is_ok_and(|t| t.trim() != "Instruction"))
            .filter_map(|e| cache_size(&std::fs::read_to_string(e.path().join("size")).ok()?))
            .max()
    })
}

/// Residuals of at least this many elements (16 MiB) may be written with
/// non-temporal stores by the out-of-place kernels: streaming saves the
/// read for ownership of lines that would not stay in cache anyway.
const STREAM_ELEMS: usize = 4 << 20;

/// Whether an out-of-place residual update of `n` elements (the 2-bit
/// codec's `quantize_2bit_to`, the 1-bit and 2-bit packed quantizers)
/// streams its next residual: when its working set (gradient, residual and
/// next, 12 B an element) exceeds the last-level cache too. Below that, the
/// residual would stay in cache for the next push, and streaming it out
/// cost 35% (16 Mi elements in a 300 MiB L3: 6.6 ms against 4.1-4.3).
pub fn residual_streams(n: usize) -> bool {
    residual_streams_with(n, last_level_cache())
}

fn residual_streams_with(n: usize, last_level_cache: Option<usize>) -> bool {
    n >= STREAM_ELEMS && last_level_cache.is_none_or(|llc| n as u128 * 12 > llc as u128)
}

/// Writes `values` to `dst`: with `STREAM`, past the caches when `dst` is
/// 16-byte aligned (non-temporal stores; the kernel calls `fence` before it
/// returns), else a plain copy. The same bits either way.
#[inline(always)]
pub fn store<const STREAM: bool, const N: usize>(dst: &mut [f32; N], values: &[f32; N]) {
    #[cfg(target_arch = "x86_64")]
    if STREAM && N.is_multiple_of(4) && dst.as_ptr().cast::<u8>().align_offset(16) == 0 {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_stream_ps};
        for i in (0..N).step_by(4) {
            // SAFETY: SSE is part of every x86-64 CPU; `i + 4 <= N` (N is a
            // multiple of 4), and `dst + i` is 16-byte aligned as `dst` is.
            unsafe { _mm_stream_ps(dst.as_mut_ptr().add(i), _mm_loadu_ps(values.as_ptr().add(i))) };
        }
        return;
    }
    dst.copy_from_slice(values);
}

/// After a kernel's `store::<true, _>`: its stores are seen before the
/// caller's next step (another thread's read included).
#[inline(always)]
pub fn fence<const STREAM: bool>() {
    #[cfg(target_arch = "x86_64")]
    if STREAM {
        // SAFETY: SFENCE is SSE, part of every x86-64 CPU.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

/// A cache size as sysfs writes it ("48K", "300M", "1G"; a bare number is bytes).
fn cache_size(text: &str) -> Option<usize> {
    let t = text.trim();
    let (digits, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => t.split_at(at),
        None => (t, ""),
    };
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

/// `multiversion! { pub fn name[<generics>][<generic args>](args) -> R = body; }`
/// defines `name(isa: Isa, args) -> R`, which runs `body` (an
/// `#[inline(always)]` function of safe Rust) compiled for `isa`. It asserts
/// that this CPU supports `isa`, the one precondition of the `unsafe` calls.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident [$($g:tt)*] [$($ga:tt)*] ($($a:ident: $t:ty),* $(,)?) -> $r:ty = $body:ident;) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$($g)*>(isa: $crate::isa::Isa, $($a: $t),*) -> $r {
            assert!(isa.is_supported(), "{isa:?} kernel requested on a CPU without it");
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,popcnt,bmi1,bmi2")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2<$($g)*>($($a: $t),*) -> $r {
                    $body::<$($ga)*>($($a),*)
                }
                #[target_feature(enable = "avx2,popcnt,bmi1,bmi2,avx512f,avx512bw,avx512vl,avx512dq")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512<$($g)*>($($a: $t),*) -> $r {
                    $body::<$($ga)*>($($a),*)
                }
                match isa {
                    // SAFETY: the assert above checked AVX2, POPCNT, BMI1 and BMI2 on this CPU; the body is safe Rust.
                    $crate::isa::Isa::Avx2 => return unsafe { avx2::<$($ga)*>($($a),*) },
                    // SAFETY: the assert above checked AVX-512 F/BW/VL/DQ and AVX2's set; the body is safe Rust.
                    $crate::isa::Isa::Avx512 => return unsafe { avx512::<$($ga)*>($($a),*) },
                    $crate::isa::Isa::Baseline => {}
                }
            }
            $body::<$($ga)*>($($a),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::{cache_size, cap_of, last_level_cache, residual_streams_with, store, Isa, STREAM_ELEMS};

    #[test]
    fn the_next_residual_streams_only_past_the_last_level_cache() {
        let mib = 1usize << 20;
        // small arrays never; big ones when the cache is unknown (as before)
        assert!(!residual_streams_with(STREAM_ELEMS - 1, None) && residual_streams_with(STREAM_ELEMS, None));
        // 16 Mi elements (192 MiB of traffic): streamed past a 32 MiB L3, kept in a 300 MiB one
        assert!(residual_streams_with(16 * mib, Some(32 * mib)));
        assert!(!residual_streams_with(16 * mib, Some(300 * mib)));
        assert!(residual_streams_with(26 * mib, Some(300 * mib)));
        assert!(!residual_streams_with(STREAM_ELEMS - 1, Some(0)));
    }

    #[test]
    fn streamed_stores_write_the_same_bits_aligned_or_not() {
        let values: [f32; 16] = std::array::from_fn(|i| i as f32 * -0.7 + 0.1);
        let mut buf = [f32::NAN; 16 + 6];
        let aligned = buf.as_ptr().cast::<u8>().align_offset(16) / 4;
        for at in aligned..aligned + 3 {
            buf.fill(f32::NAN);
            store::<true, 16>((&mut buf[at..at + 16]).try_into().unwrap(), &values);
            super::fence::<true>();
            assert_eq!(buf[at..at + 16].iter().map(|x| x.to_bits()).collect::<Vec<_>>(), values.map(f32::to_bits), "offset {at}");
        }
    }

    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(cache_size("48K\n"), Some(48 << 10));
        assert_eq!(cache_size("307200K"), Some(300 << 20));
        assert_eq!(cache_size("32M"), Some(32 << 20));
        assert_eq!(cache_size("1G"), Some(1 << 30));
        assert_eq!(cache_size("4096"), Some(4096));
        for bad in ["", "K", "12Q", "-3K", "99999999999999999999G", "1.5M"] {
            assert_eq!(cache_size(bad), None, "{bad:?}");
        }
        eprintln!("last-level cache here: {:?} bytes", last_level_cache());
    }

    #[test]
    fn the_detected_set_is_supported_and_the_baseline_always_is() {
        assert!(Isa::detect().is_supported());
        assert_eq!(Isa::available()[0], Isa::Baseline);
        // Say which versions these tests compare: a machine without AVX-512
        // compares two, and a reader of the log should know.
        eprintln!("scheme kernels compared on this CPU: {:?}", Isa::available());
    }

    #[test]
    fn gradpack_kernel_caps_by_name_and_names_a_value_it_does_not_know() {
        for (value, cap) in [(None, Isa::Avx512), (Some(""), Isa::Avx512), (Some("avx512"), Isa::Avx512), (Some("avx2"), Isa::Avx2), (Some("portable"), Isa::Baseline)] {
            assert_eq!(cap_of(value), Ok(cap), "{value:?}");
        }
        let why = cap_of(Some("portble")).unwrap_err();
        assert!(why.contains("GRADPACK_KERNEL=\"portble\"") && why.contains("portable, avx2, avx512"), "{why}");
    }

    #[test]
    fn each_set_is_named_as_gradpack_kernel_names_it() {
        let names: Vec<&str> = [Isa::Baseline, Isa::Avx2, Isa::Avx512].iter().map(|i| i.name()).collect();
        assert_eq!(names, ["portable", "avx2", "avx512"]);
    }
}
