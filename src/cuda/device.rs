//! The CUDA implementation (feature `cuda`): `kernels.cu` compiled by NVRTC
//! once per device, launched through cudarc's driver API.
//!
//! Two layers. `Ops` launches kernels on raw device pointers and a stream;
//! its functions are `unsafe` (a raw pointer's allocation cannot be proven
//! live) and check everything else: lengths, ranges against the allocation
//! (`cuMemGetAddressRange`), the device of every pointer, overlaps.
//! `Gpu` is the safe API over cudarc's `CudaSlice`s, whose lengths and
//! contexts it checks before taking their pointers.
//!
//! Every operation validates first and mutates after: a kernel that can
//! find bad input writes only to scratch buffers, and the caller's buffers
//! change only once the error flag has been read back as clear.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as drv, sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nvrtc::{self, CompileOptions, Ptx};

use crate::codec::{self, check_len, Thresholds};
use crate::error::{Dtype, Error, Result};
use super::Buf;
use crate::quant::{noise, qsgd};

/// The kernels' CUDA C++ source.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel in `SOURCE`.
pub const KERNELS: [&str; 14] = [
    "gp_check_finite",
    "gp_check_index",
    "gp_2bit_quantize_to",
    "gp_2bit_quantize",
    "gp_2bit_check",
    "gp_2bit_dequantize",
    "gp_noise_fill",
    "gp_qsgd_quantize",
    "gp_qsgd_decode",
    "gp_max_abs",
    "gp_1bit_quantize",
    "gp_1bit_decode",
    "gp_gather",
    "gp_scatter",
];

/// Threads per block (a multiple of 32: the 2-bit words are built by warp shuffles).
const BLOCK: u32 = 256;

fn cuda_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Cuda(format!("{what}: {e}"))
}

/// Ok when the driver library can be loaded. cudarc panics on its first call
/// when it cannot, so every entry point asks this first.
pub fn driver_available() -> Result<()> {
    // SAFETY: only dlopen()s the library by name; no symbol of it is called.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable("no CUDA driver library (libcuda.so) could be loaded: this machine has no NVIDIA driver".into()))
    }
}

/// Ok when NVRTC can be loaded (it compiles the kernels; no GPU needed).
pub fn nvrtc_available() -> Result<()> {
    // SAFETY: as in `driver_available`.
    if unsafe { nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::CudaUnavailable(
            "NVRTC (libnvrtc.so.12 or libnvrtc.so) could not be loaded: install the PyPI package nvidia-cuda-nvrtc-cu12 and put its nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH".into(),
        ))
    }
}

/// Compiles `SOURCE` to PTX for `arch` (`sm_70`, `compute_90`, ...), with
/// float contraction off so that results match the CPU's bit for bit.
pub fn compile_ptx(arch: &'static str) -> Result<Ptx> {
    nvrtc_available()?;
    let opts = CompileOptions {
        arch: Some(arch),
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        name: Some("gradpack_kernels.cu".into()),
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| cuda_err(&format!("NVRTC compiling the kernels for {arch}"), e))
}

/// The loaded kernels of one device.
struct Kernels {
    f: HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    fn get(&self, name: &'static str) -> &CudaFunction {
        &self.f[name] // every name of KERNELS is loaded by `load`
    }

    fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        let (major, minor) = ctx.compute_capability().map_err(|e| cuda_err("compute capability", e))?;
        // One leaked string per device kind: cudarc takes the arch as &'static str.
        let arch: &'static str = Box::leak(format!("compute_{major}{minor}").into_boxed_str());
        let module = ctx.load_module(compile_ptx(arch)?).map_err(|e| cuda_err("loading the kernels' PTX", e))?;
        let mut f = HashMap::new();
        for name in KERNELS {
            f.insert(name, module.load_function(name).map_err(|e| cuda_err(name, e))?);
        }
        Ok(Kernels { f })
    }
}

/// A device's context and its loaded kernels.
type Device = (Arc<CudaContext>, Arc<Kernels>);

/// The context and kernels of device `ordinal`, compiled once per process.
fn device(ordinal: usize) -> Result<Device> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::CudaUnavailable(format!("GPU {ordinal} was asked for; this machine has {count}")));
    }
    static CACHE: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = cache.get(&ordinal) {
        return Ok(d.clone());
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err(&format!("opening GPU {ordinal}"), e))?;
    let k = Arc::new(Kernels::load(&ctx)?);
    cache.insert(ordinal, (ctx.clone(), k.clone()));
    Ok((ctx, k))
}

/// Number of GPUs the driver sees (an error without a driver).
pub fn device_count() -> Result<usize> {
    driver_available()?;
    CudaContext::device_count().map(|c| c.max(0) as usize).map_err(|e| Error::CudaUnavailable(format!("the driver found no usable GPU ({e})")))
}

/// A kernel argument: every one fits 8 bytes, passed by address.
#[derive(Clone, Copy)]
enum Arg {
    P(u64),
    U64(u64),
    U32(u32),
    I32(i32),
    F32(f32),
    F64(f64),
}

impl Arg {
    /// The argument's bytes at the start of a little-endian 8-byte slot (the
    /// driver reads as many as the kernel's parameter has).
    fn slot(self) -> u64 {
        match self {
            Arg::P(x) | Arg::U64(x) => x,
            Arg::U32(x) => x as u64,
            Arg::I32(x) => x as u32 as u64,
            Arg::F32(x) => x.to_bits() as u64,
            Arg::F64(x) => x.to_bits(),
        }
    }
}

impl Buf {
    fn bytes(&self) -> Result<u64> {
        (self.len as u64).checked_mul(self.elem as u64).ok_or_else(|| Error::InvalidParam { key: self.what.into(), problem: format!("{} elements overflow a byte count", self.len) })
    }

    fn end(&self) -> Result<u64> {
        self.ptr.checked_add(self.bytes()?).ok_or_else(|| Error::InvalidParam { key: self.what.into(), problem: "pointer + length wraps".into() })
    }
}

/// Kernel launches on one stream. The functions taking raw `Buf`s are
/// `unsafe`: see `Ops::check`.
pub struct Ops<'a> {
    ctx: &'a Arc<CudaContext>,
    k: &'a Kernels,
    s: &'a Arc<CudaStream>,
}

/// The kernels' code for a gradient type: 0 float32, 1 float16, 2 bfloat16.
fn dtype_arg(dtype: Dtype) -> Arg {
    Arg::I32(match dtype {
        Dtype::F32 => 0,
        Dtype::F16 => 1,
        Dtype::Bf16 => 2,
    })
}

/// Whether four gradient elements load at once: 16 bytes of float32, 8 of a 16-bit type.
fn grad_aligned(g: Buf) -> bool {
    g.ptr.is_multiple_of(4 * g.elem as u64)
}

/// Threads for kernels that take four elements each.
fn quads(n: usize) -> u64 {
    (n as u64).div_ceil(4)
}

/// The `vec` argument: 1 when every buffer is 16-byte aligned (float4 access).
fn aligned(bufs: &[Buf]) -> Arg {
    Arg::I32(bufs.iter().all(|b| b.ptr.is_multiple_of(16)) as i32)
}

impl Ops<'_> {
    /// Launches `name` over `threads` threads (at least one block).
    ///
    /// # Safety
    /// `args` must match the kernel's parameters, and every pointer among
    /// them must be valid for what the kernel touches given the other args.
    unsafe fn launch(&self, name: &'static str, threads: u64, args: &[Arg]) -> Result<()> {
        let blocks = threads.div_ceil(BLOCK as u64).max(1);
        if blocks > i32::MAX as u64 {
            return Err(Error::InvalidParam { key: "size".into(), problem: format!("{threads} elements exceed one launch ({} blocks at most)", i32::MAX) });
        }
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| (s as *mut u64).cast::<c_void>()).collect();
        self.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: the caller's precondition; `slots` outlive the call (the
        // driver copies parameters at launch).
        unsafe { drv::launch_kernel(self.k.get(name).cu_function(), (blocks as u32, 1, 1), (BLOCK, 1, 1), 0, self.s.cu_stream(), &mut params) }.map_err(|e| cuda_err(name, e))
    }

    /// A zeroed error flag of `n` words on this stream.
    fn flag(&self, n: usize) -> Result<CudaSlice<u64>> {
        self.s.alloc_zeros::<u64>(n).map_err(|e| cuda_err("allocating an error flag", e))
    }

    fn read(&self, flag: &CudaSlice<u64>) -> Result<Vec<u64>> {
        self.s.clone_dtoh(flag).map_err(|e| cuda_err("reading an error flag", e))
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        let (p, _sync) = s.device_ptr(self.s);
        p
    }

    /// Copies `out.len()` values at device address `ptr` to the host, once
    /// the stream has run up to here.
    ///
    /// # Safety
    /// `ptr` must be readable device memory of this context for `out`'s bytes.
    unsafe fn fetch<T>(&self, ptr: u64, out: &mut [T]) -> Result<()> {
        // SAFETY: the caller's precondition.
        unsafe { drv::memcpy_dtoh_async(out, ptr, self.s.cu_stream()) }.map_err(|e| cuda_err("reading device memory", e))?;
        self.sync()
    }

    /// One element of device memory, of type `dtype`, widened (for an error message).
    ///
    /// # Safety
    /// Element `i` of `b` must be readable device memory of this context.
    unsafe fn element(&self, b: Buf, i: usize, dtype: Dtype) -> Result<f32> {
        let mut out = [0u8; 4];
        let size = dtype.size();
        // SAFETY: the caller's precondition; `size` bytes into a 4-byte buffer.
        unsafe { self.fetch(b.ptr + (size * i) as u64, &mut out[..size])? };
        Ok(match dtype {
            Dtype::F32 => f32::from_le_bytes(out),
            Dtype::F16 => half::f16::from_le_bytes([out[0], out[1]]).to_f32(),
            Dtype::Bf16 => half::bf16::from_le_bytes([out[0], out[1]]).to_f32(),
        })
    }

    /// Checks raw buffers before any kernel sees them: each non-empty one
    /// lies inside one allocation of this device, and no two overlap (the
    /// kernels' inputs and outputs never alias). This is everything that
    /// can be checked about a raw pointer; that the allocation stays live
    /// until the stream has run is the caller's.
    pub fn check(&self, bufs: &[Buf]) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
        for b in bufs {
            let end = b.end()?;
            if b.len == 0 {
                continue;
            }
            if b.ptr == 0 {
                return Err(Error::NullPointer { what: b.what });
            }
            let (mut base, mut size) = (0u64, 0usize);
            // SAFETY: out-pointers to locals; the driver only looks the address up.
            let found = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, b.ptr) };
            if found != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::InvalidParam { key: b.what.into(), problem: format!("{:#x} is not device memory of this context ({found:?})", b.ptr) });
            }
            if end > base + size as u64 {
                return Err(Error::InvalidParam { key: b.what.into(), problem: format!("{} bytes at {:#x} run past the end of its allocation ({size} bytes at {base:#x})", end - b.ptr, b.ptr) });
            }
            let ordinal = pointer_device(b.ptr).map_err(|e| Error::InvalidParam { key: b.what.into(), problem: e.to_string() })?;
            if ordinal != self.ctx.ordinal() {
                return Err(Error::InvalidParam { key: b.what.into(), problem: format!("lives on GPU {ordinal}, not GPU {}", self.ctx.ordinal()) });
            }
        }
        for (i, a) in bufs.iter().enumerate() {
            for b in &bufs[i + 1..] {
                if a.len > 0 && b.len > 0 && a.ptr < b.end()? && b.ptr < a.end()? {
                    return Err(Error::OverlappingBuffers { a: a.what, b: b.what });
                }
            }
        }
        Ok(())
    }

    /// The first non-finite `r + g` (or `g` when `r` is `None`): `Err(NonFinite)`.
    ///
    /// # Safety
    /// `g` and `r` checked by `check`, and live until the stream has run.
    unsafe fn check_finite(&self, what: &str, g: Buf, dtype: Dtype, r: Option<Buf>) -> Result<()> {
        // SAFETY: the caller's precondition.
        let bad = unsafe { self.non_finite_flag(g, dtype, r)? };
        self.first_non_finite(what, g, dtype, r, bad)
    }

    /// The `gp_check_finite` flag: `n - i` of the first non-finite `r + g`
    /// (or `g`), or 0.
    ///
    /// # Safety
    /// As `check_finite`.
    unsafe fn non_finite_flag(&self, g: Buf, dtype: Dtype, r: Option<Buf>) -> Result<u64> {
        let flag = self.flag(1)?;
        let n = g.len as u64;
        // SAFETY: the caller's precondition; the kernel reads n elements of each.
        unsafe { self.launch("gp_check_finite", n, &[Arg::P(g.ptr), Arg::P(r.map_or(0, |r| r.ptr)), Arg::U64(n), Arg::P(self.ptr(&flag)), dtype_arg(dtype)])? };
        Ok(self.read(&flag)?[0])
    }

    /// The error for flag value `bad` (`n - i` of the first bad element, or 0).
    unsafe fn first_non_finite(&self, what: &str, g: Buf, dtype: Dtype, r: Option<Buf>, bad: u64) -> Result<()> {
        if bad == 0 {
            return Ok(());
        }
        let i = g.len - bad as usize;
        // As the kernels add: residual + gradient, in float32.
        // SAFETY: i < len of both (the caller's precondition).
        let value = unsafe { r.map_or(Ok(0.0), |r| self.element(r, i, Dtype::F32))? + self.element(g, i, dtype)? };
        Err(Error::NonFinite { what: what.into(), index: i, value })
    }

    /// 2-bit quantize in place (`codec::quantize_2bit`): validates that
    /// `residual + grad` is finite first, so on error nothing is written.
    ///
    /// # Safety
    /// Every buffer as in `check` (which this calls), live until the stream has run.
    pub unsafe fn quantize_2bit(&self, grad: Buf, dtype: Dtype, residual: Buf, compr: Buf, th: Thresholds) -> Result<()> {
        check_len("gradient element bytes", dtype.size(), grad.elem)?;
        let n = grad.len;
        check_len("residual", n, residual.len)?;
        check_len("compressed array", codec::compressed_len(n), compr.len)?;
        self.check(&[grad, residual, compr])?;
        // SAFETY: checked above; the kernels touch n elements and compressed_len(n) floats.
        unsafe {
            self.check_finite("gradient", grad, dtype, Some(residual))?;
            self.launch_2bit(grad, dtype, residual, compr, th)
        }
    }

    /// Launches the one-pass 2-bit kernel (lengths and buffers checked by the caller).
    ///
    /// # Safety
    /// Every buffer checked by `check` with the lengths `quantize_2bit_to` checks.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_2bit_to(&self, grad: Buf, dtype: Dtype, residual: Buf, next: Buf, compr: Buf, th: Thresholds, flag: &CudaSlice<u64>) -> Result<()> {
        let n = grad.len as u64;
        let vec = Arg::I32((grad_aligned(grad) && residual.ptr.is_multiple_of(16) && next.ptr.is_multiple_of(16)) as i32);
        let args = [Arg::P(grad.ptr), Arg::P(residual.ptr), Arg::P(next.ptr), Arg::P(compr.ptr), Arg::U64(n), Arg::F32(th.neg()), Arg::F32(th.pos()), Arg::F32(n as f32), Arg::P(self.ptr(flag)), vec, dtype_arg(dtype)];
        // SAFETY: the caller's precondition; the kernel touches n elements and compressed_len(n) floats.
        unsafe { self.launch("gp_2bit_quantize_to", quads(grad.len), &args) }
    }

    /// Launches the in-place 2-bit kernel on input `check_finite` accepted.
    ///
    /// # Safety
    /// As `launch_2bit_to`.
    unsafe fn launch_2bit(&self, grad: Buf, dtype: Dtype, residual: Buf, compr: Buf, th: Thresholds) -> Result<()> {
        let n = grad.len as u64;
        let vec = Arg::I32((grad_aligned(grad) && residual.ptr.is_multiple_of(16)) as i32);
        let args = [Arg::P(grad.ptr), Arg::P(residual.ptr), Arg::P(compr.ptr), Arg::U64(n), Arg::F32(th.neg()), Arg::F32(th.pos()), Arg::F32(n as f32), vec, dtype_arg(dtype)];
        // SAFETY: the caller's precondition.
        unsafe { self.launch("gp_2bit_quantize", quads(grad.len), &args) }
    }

    /// 2-bit quantize out of place in one pass (`codec::quantize_2bit_to`):
    /// `residual` is only read; on error `next` and `compr` hold garbage.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn quantize_2bit_to(&self, grad: Buf, dtype: Dtype, residual: Buf, next: Buf, compr: Buf, th: Thresholds) -> Result<()> {
        check_len("gradient element bytes", dtype.size(), grad.elem)?;
        let n = grad.len;
        check_len("residual", n, residual.len)?;
        check_len("next residual", n, next.len)?;
        check_len("compressed array", codec::compressed_len(n), compr.len)?;
        self.check(&[grad, residual, next, compr])?;
        let flag = self.flag(1)?;
        // SAFETY: checked above.
        unsafe {
            self.launch_2bit_to(grad, dtype, residual, next, compr, th, &flag)?;
            self.first_non_finite("gradient", grad, dtype, Some(residual), self.read(&flag)?[0])
        }
    }

    /// Checks a compressed array for `n` outputs exactly as
    /// `codec::check_compressed` does (header, codes, padding); returns its
    /// thresholds.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    unsafe fn check_compressed(&self, compr: Buf, n: usize) -> Result<Thresholds> {
        check_len("compressed array", codec::compressed_len(n), compr.len)?;
        let mut header = [0f32; codec::HEADER_LEN];
        // SAFETY: compr holds at least the header (its length was checked).
        unsafe { self.fetch(compr.ptr, &mut header)? };
        let th = codec::check_header(&header, n)?;
        let nwords = compr.len - codec::HEADER_LEN;
        let flag = self.flag(2)?;
        // SAFETY: the kernel reads nwords words after the header.
        unsafe { self.launch("gp_2bit_check", nwords as u64, &[Arg::P(compr.ptr + 4 * codec::HEADER_LEN as u64), Arg::U64(nwords as u64), Arg::U64(n as u64), Arg::P(self.ptr(&flag))])? };
        let bad = self.read(&flag)?;
        if bad[0] != 0 {
            let block = nwords - bad[0] as usize;
            let mut w = [0u32];
            // SAFETY: block < nwords.
            unsafe { self.fetch(compr.ptr + 4 * (codec::HEADER_LEN + block) as u64, &mut w)? };
            return Err(codec::corrupt_code(block, w[0]));
        }
        if bad[1] != 0 {
            return Err(Error::CorruptPadding { block: nwords - 1, n });
        }
        Ok(th)
    }

    /// `out = decode(compr)`, or `out += decode(compr)` with `add`
    /// (`codec::dequantize_2bit[_add]`); on error nothing is written.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn dequantize_2bit(&self, compr: Buf, out: Buf, add: bool) -> Result<()> {
        self.check(&[compr, out])?;
        // SAFETY: checked above.
        unsafe {
            let th = self.check_compressed(compr, out.len)?;
            self.launch("gp_2bit_dequantize", quads(out.len), &[Arg::P(compr.ptr + 4 * codec::HEADER_LEN as u64), Arg::P(out.ptr), Arg::U64(out.len as u64), Arg::F32(th.neg()), Arg::F32(th.pos()), Arg::I32(add as i32), aligned(&[out])])
        }
    }

    /// `max |x|` (`qsgd::max_abs`), or `None` when an element is not finite.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn max_abs(&self, x: Buf) -> Result<Option<f32>> {
        self.check(&[x])?;
        let (m, flag) = (self.s.alloc_zeros::<u32>(1).map_err(|e| cuda_err("allocating", e))?, self.flag(1)?);
        // Enough blocks to fill the GPU; each thread strides over the rest.
        let threads = quads(x.len).min(1 << 20);
        // SAFETY: checked above; the kernel reads x.len elements.
        unsafe { self.launch("gp_max_abs", threads, &[Arg::P(x.ptr), Arg::U64(x.len as u64), Arg::P(self.ptr(&m)), Arg::P(self.ptr(&flag)), aligned(&[x])])? };
        let bits = self.s.clone_dtoh(&m).map_err(|e| cuda_err("reading max", e))?[0];
        Ok((self.read(&flag)?[0] == 0).then_some(f32::from_bits(bits)))
    }

    /// QSGD codes of `grad` at one scale (`qsgd::quantize`), elements
    /// `offset..` of the noise stream `seed`; added into `codes` with `add`.
    /// Errors (before writing) as `qsgd::quantize_at`.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn qsgd_quantize(&self, grad: Buf, scale: f32, bits: u32, seed: u64, offset: usize, codes: Buf, add: bool) -> Result<()> {
        let s = qsgd::levels(bits)?;
        check_len("codes", grad.len, codes.len)?;
        qsgd::check_scale(scale)?;
        // SAFETY: the caller's precondition (max_abs checks x).
        let Some(max) = (unsafe { self.max_abs(grad)? }) else {
            // SAFETY: as above.
            unsafe {
                let i = grad.len - self.non_finite_flag(grad, Dtype::F32, None)? as usize;
                return Err(Error::InvalidParam { key: "gradient".into(), problem: format!("element {i} is {}", self.element(grad, i, Dtype::F32)?) });
            }
        };
        if max > scale {
            return Err(Error::InvalidParam { key: "scale".into(), problem: format!("{scale} is below the gradient's max |g| = {max}") });
        }
        self.check(&[grad, codes])?;
        let f = qsgd::factor(s, scale);
        let mut result = Ok(());
        noise::spans(seed, offset, grad.len, |k, first, r| {
            if result.is_ok() {
                let (k0, k1) = k.parts();
                let (g, c) = (grad.ptr + 4 * r.start as u64, codes.ptr + 4 * r.start as u64);
                // SAFETY: r lies within both buffers (checked above).
                result = unsafe {
                    let vec = Arg::I32((g.is_multiple_of(16) && c.is_multiple_of(16)) as i32);
                    self.launch("gp_qsgd_quantize", quads(r.len()), &[Arg::P(g), Arg::P(c), Arg::U64(r.len() as u64), Arg::U32(k0), Arg::U32(k1), Arg::U32(first), Arg::F32(f), Arg::F32(s as f32), Arg::I32(add as i32), vec])
                };
            }
        });
        result
    }

    /// `out = codes * scale / (2^bits - 1)` (`qsgd::decode_at`, one scale).
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn qsgd_decode(&self, codes: Buf, scale: f32, bits: u32, out: Buf) -> Result<()> {
        let s = qsgd::levels(bits)?;
        check_len("output", codes.len, out.len)?;
        qsgd::check_scale(scale)?;
        self.check(&[codes, out])?;
        // SAFETY: checked above.
        unsafe { self.launch("gp_qsgd_decode", out.len as u64, &[Arg::P(codes.ptr), Arg::P(out.ptr), Arg::U64(out.len as u64), Arg::F64(scale as f64 / s as f64)]) }
    }

    /// 1-bit quantize with error feedback (`onebit::quantize`), after
    /// checking `residual + grad` is finite: on error nothing is written.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn onebit_quantize(&self, grad: Buf, residual: Buf, threshold: f32, bits: Buf, add: bool) -> Result<()> {
        crate::quant::onebit::check_threshold(threshold)?;
        check_len("residual", grad.len, residual.len)?;
        check_len("bits", grad.len, bits.len)?;
        self.check(&[grad, residual, bits])?;
        // SAFETY: checked above.
        unsafe {
            self.check_finite("gradient", grad, Dtype::F32, Some(residual))?;
            self.launch("gp_1bit_quantize", quads(grad.len), &[Arg::P(grad.ptr), Arg::P(residual.ptr), Arg::P(bits.ptr), Arg::U64(grad.len as u64), Arg::F32(threshold), Arg::I32(add as i32), aligned(&[grad, residual, bits])])
        }
    }

    /// `out = 2 counts - workers` (the 1-bit scheme's decode).
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn onebit_decode(&self, counts: Buf, workers: u32, out: Buf) -> Result<()> {
        check_len("output", counts.len, out.len)?;
        if workers == 0 || workers > i32::MAX as u32 / 2 {
            return Err(Error::InvalidParam { key: "workers".into(), problem: format!("must be 1 to {}, got {workers}", i32::MAX / 2) });
        }
        self.check(&[counts, out])?;
        // SAFETY: checked above.
        unsafe { self.launch("gp_1bit_decode", out.len as u64, &[Arg::P(counts.ptr), Arg::P(out.ptr), Arg::U64(out.len as u64), Arg::I32(workers as i32)]) }
    }

    /// Errors unless every index is below `n`.
    unsafe fn check_index(&self, idx: Buf, n: usize) -> Result<()> {
        let flag = self.flag(1)?;
        // SAFETY: the caller's precondition; the kernel reads idx.len indices.
        unsafe { self.launch("gp_check_index", idx.len as u64, &[Arg::P(idx.ptr), Arg::U64(idx.len as u64), Arg::U64(n as u64), Arg::P(self.ptr(&flag))])? };
        match self.read(&flag)?[0] {
            0 => Ok(()),
            bad => Err(Error::InvalidParam { key: "indices".into(), problem: format!("index {} is out of range for {n} elements", idx.len - bad as usize) }),
        }
    }

    /// `out[j] = x[idx[j]]` (random-K's gather).
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn gather(&self, x: Buf, idx: Buf, out: Buf) -> Result<()> {
        check_len("output", idx.len, out.len)?;
        self.check(&[x, idx, out])?;
        // SAFETY: checked above, indices below x.len by check_index.
        unsafe {
            self.check_index(idx, x.len)?;
            self.launch("gp_gather", idx.len as u64, &[Arg::P(x.ptr), Arg::P(idx.ptr), Arg::P(out.ptr), Arg::U64(idx.len as u64)])
        }
    }

    /// `out = 0; out[idx[j]] = v[j]` (random-K's decode; with repeated
    /// indices, one of the values lands).
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn scatter(&self, v: Buf, idx: Buf, out: Buf) -> Result<()> {
        check_len("values", idx.len, v.len)?;
        self.check(&[v, idx, out])?;
        // SAFETY: checked above, indices below out.len by check_index.
        unsafe {
            self.check_index(idx, out.len)?;
            drv::memset_d8_async(out.ptr, 0, out.len * 4, self.s.cu_stream()).map_err(|e| cuda_err("zeroing the output", e))?;
            self.launch("gp_scatter", idx.len as u64, &[Arg::P(v.ptr), Arg::P(idx.ptr), Arg::P(out.ptr), Arg::U64(idx.len as u64)])
        }
    }

    /// `out[j] = noise::unit` of elements `offset..` of stream `seed`.
    ///
    /// # Safety
    /// As `quantize_2bit`.
    pub unsafe fn noise(&self, seed: u64, offset: usize, out: Buf) -> Result<()> {
        self.check(&[out])?;
        let mut result = Ok(());
        noise::spans(seed, offset, out.len, |k, first, r| {
            if result.is_ok() {
                let (k0, k1) = k.parts();
                // SAFETY: r lies within out (checked above).
                result = unsafe { self.launch("gp_noise_fill", r.len() as u64, &[Arg::U32(k0), Arg::U32(k1), Arg::U32(first), Arg::P(out.ptr + 4 * r.start as u64), Arg::U64(r.len() as u64)]) };
            }
        });
        result
    }

    fn sync(&self) -> Result<()> {
        self.s.synchronize().map_err(|e| cuda_err("synchronizing the stream", e))
    }

    /// `f` on this stream, then a synchronization: the result is known when this returns.
    fn run<T>(&self, f: impl FnOnce(&Ops) -> Result<T>) -> Result<T> {
        let out = f(self)?;
        self.sync()?;
        Ok(out)
    }
}

/// A stream owned by someone else (a C caller, CuPy, MXNet) on one device.
pub struct Borrowed {
    ctx: Arc<CudaContext>,
    k: Arc<Kernels>,
    s: Arc<CudaStream>,
}

impl Borrowed {
    /// # Safety
    /// `stream` must be null (the legacy default stream) or a live stream
    /// of device `ordinal`'s primary context, for as long as this lives.
    pub unsafe fn new(ordinal: usize, stream: super::RawStream) -> Result<Borrowed> {
        let (ctx, k) = device(ordinal)?;
        ctx.bind_to_thread().map_err(|e| cuda_err("binding the context", e))?;
        // SAFETY: the caller's precondition; the wrapper does not destroy it.
        let s = unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) };
        Ok(Borrowed { ctx, k, s })
    }

    pub fn ops(&self) -> Ops<'_> {
        Ops { ctx: &self.ctx, k: &self.k, s: &self.s }
    }
}

/// Runs `f` with the `Ops` of device `ordinal` on a borrowed stream, then
/// synchronizes that stream.
///
/// # Safety
/// As `Borrowed::new`.
pub unsafe fn with_borrowed_stream<T>(ordinal: usize, stream: super::RawStream, f: impl FnOnce(&Ops) -> Result<T>) -> Result<T> {
    // SAFETY: the caller's precondition.
    let b = unsafe { Borrowed::new(ordinal, stream)? };
    b.ops().run(f)
}

/// The GPU that device pointer `ptr` belongs to.
pub fn pointer_device(ptr: u64) -> Result<usize> {
    driver_available()?;
    let mut ordinal = -1i32;
    // SAFETY: the attribute is an int, written to a local; the driver only looks the address up.
    let ok = unsafe { sys::cuPointerGetAttribute((&mut ordinal as *mut i32).cast(), sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr) };
    if ok != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
        return Err(Error::InvalidParam { key: "pointer".into(), problem: format!("{ptr:#x} is not device memory ({ok:?})") });
    }
    Ok(ordinal as usize)
}

/// One GPU with a stream of its own: the safe API over cudarc's `CudaSlice`.
/// Every method checks lengths and that each slice belongs to this GPU,
/// then runs, and returns once the result (or the error) is known.
#[derive(Clone)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    k: Arc<Kernels>,
    stream: Arc<CudaStream>,
}

impl Gpu {
    /// GPU `ordinal` with a new stream; "CUDA not available" without a
    /// driver or such a GPU.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let (ctx, k) = device(ordinal)?;
        let stream = ctx.new_stream().map_err(|e| cuda_err("creating a stream", e))?;
        Ok(Gpu { ctx, k, stream })
    }

    /// Another stream on the same GPU (a second "member" of a device store).
    pub fn fork(&self) -> Result<Gpu> {
        let stream = self.ctx.new_stream().map_err(|e| cuda_err("creating a stream", e))?;
        Ok(Gpu { ctx: self.ctx.clone(), k: self.k.clone(), stream })
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn name(&self) -> Result<String> {
        self.ctx.name().map_err(|e| cuda_err("device name", e))
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn ops(&self) -> Ops<'_> {
        Ops { ctx: &self.ctx, k: &self.k, s: &self.stream }
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(host).map_err(|e| cuda_err("copying to the GPU", e))
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        self.stream.clone_dtoh(dev).map_err(|e| cuda_err("copying from the GPU", e))
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(n).map_err(|e| cuda_err(&format!("allocating {n} elements"), e))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.ops().sync()
    }

    /// The raw parts of a slice of this GPU (an error for another GPU's).
    fn buf<T>(&self, what: &'static str, s: &CudaSlice<T>) -> Result<Buf> {
        if s.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::InvalidParam { key: what.into(), problem: format!("lives on GPU {}, not GPU {}", s.context().ordinal(), self.ordinal()) });
        }
        let (ptr, _sync) = s.device_ptr(&self.stream);
        Ok(Buf { what, ptr, len: s.len(), elem: std::mem::size_of::<T>() })
    }

    fn buf_mut<T>(&self, what: &'static str, s: &mut CudaSlice<T>) -> Result<Buf> {
        let b = self.buf(what, s)?;
        let (_ptr, _sync) = s.device_ptr_mut(&self.stream);
        Ok(b)
    }

    fn run<T>(&self, f: impl FnOnce(&Ops) -> Result<T>) -> Result<T> {
        self.ops().run(f)
    }

    /// `codec::quantize_2bit` on the GPU (float32, float16 or bfloat16
    /// gradients): bit-identical blocks and residual.
    pub fn quantize_2bit<G: GpuGradient>(&self, grad: &CudaSlice<G>, residual: &mut CudaSlice<f32>, compr: &mut CudaSlice<f32>, th: Thresholds) -> Result<()> {
        let (g, r, c) = (self.buf("gradient", grad)?, self.buf_mut("residual", residual)?, self.buf_mut("compressed array", compr)?);
        // SAFETY: borrowed CudaSlices of this GPU: live, distinct allocations of their stated lengths.
        self.run(|o| unsafe { o.quantize_2bit(g, G::DTYPE, r, c, th) })
    }

    /// `codec::quantize_2bit_to` on the GPU: one pass; on error `next` and `compr` hold garbage.
    pub fn quantize_2bit_to<G: GpuGradient>(&self, grad: &CudaSlice<G>, residual: &CudaSlice<f32>, next: &mut CudaSlice<f32>, compr: &mut CudaSlice<f32>, th: Thresholds) -> Result<()> {
        let (g, r) = (self.buf("gradient", grad)?, self.buf("residual", residual)?);
        let (x, c) = (self.buf_mut("next residual", next)?, self.buf_mut("compressed array", compr)?);
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.quantize_2bit_to(g, G::DTYPE, r, x, c, th) })
    }

    /// `codec::dequantize_2bit` on the GPU.
    pub fn dequantize_2bit(&self, compr: &CudaSlice<f32>, out: &mut CudaSlice<f32>) -> Result<()> {
        let (c, o) = (self.buf("compressed array", compr)?, self.buf_mut("output", out)?);
        // SAFETY: as in quantize_2bit.
        self.run(|ops| unsafe { ops.dequantize_2bit(c, o, false) })
    }

    /// `codec::dequantize_2bit_add` on the GPU.
    pub fn dequantize_2bit_add(&self, compr: &CudaSlice<f32>, sum: &mut CudaSlice<f32>) -> Result<()> {
        let (c, o) = (self.buf("compressed array", compr)?, self.buf_mut("sum", sum)?);
        // SAFETY: as in quantize_2bit.
        self.run(|ops| unsafe { ops.dequantize_2bit(c, o, true) })
    }

    /// `qsgd::max_abs` on the GPU.
    pub fn max_abs(&self, x: &CudaSlice<f32>) -> Result<Option<f32>> {
        let b = self.buf("values", x)?;
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.max_abs(b) })
    }

    /// `qsgd::quantize` on the GPU (elements `offset..` of the noise stream;
    /// 0 for a whole gradient); codes added in with `add`.
    #[allow(clippy::too_many_arguments)]
    pub fn qsgd_quantize(&self, grad: &CudaSlice<f32>, scale: f32, bits: u32, seed: u64, offset: usize, codes: &mut CudaSlice<i32>, add: bool) -> Result<()> {
        let (g, c) = (self.buf("gradient", grad)?, self.buf_mut("codes", codes)?);
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.qsgd_quantize(g, scale, bits, seed, offset, c, add) })
    }

    /// `qsgd::decode_at` with one scale, on the GPU.
    pub fn qsgd_decode(&self, codes: &CudaSlice<i32>, scale: f32, bits: u32, out: &mut CudaSlice<f32>) -> Result<()> {
        let (c, o) = (self.buf("codes", codes)?, self.buf_mut("output", out)?);
        // SAFETY: as in quantize_2bit.
        self.run(|ops| unsafe { ops.qsgd_decode(c, scale, bits, o) })
    }

    /// `onebit::quantize` on the GPU, refusing a non-finite `residual + grad` first.
    pub fn onebit_quantize(&self, grad: &CudaSlice<f32>, residual: &mut CudaSlice<f32>, threshold: f32, bits: &mut CudaSlice<i32>, add: bool) -> Result<()> {
        let (g, r, b) = (self.buf("gradient", grad)?, self.buf_mut("residual", residual)?, self.buf_mut("bits", bits)?);
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.onebit_quantize(g, r, threshold, b, add) })
    }

    /// The 1-bit scheme's decode: `out = 2 counts - workers`.
    pub fn onebit_decode(&self, counts: &CudaSlice<i32>, workers: u32, out: &mut CudaSlice<f32>) -> Result<()> {
        let (c, o) = (self.buf("counts", counts)?, self.buf_mut("output", out)?);
        // SAFETY: as in quantize_2bit.
        self.run(|ops| unsafe { ops.onebit_decode(c, workers, o) })
    }

    /// Random-K's gather: `out[j] = x[idx[j]]`, every index checked.
    pub fn gather(&self, x: &CudaSlice<f32>, idx: &CudaSlice<u64>, out: &mut CudaSlice<f32>) -> Result<()> {
        let (xb, ib, ob) = (self.buf("values", x)?, self.buf("indices", idx)?, self.buf_mut("output", out)?);
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.gather(xb, ib, ob) })
    }

    /// Random-K's decode: `out = 0; out[idx[j]] = v[j]`, every index checked.
    pub fn scatter(&self, v: &CudaSlice<f32>, idx: &CudaSlice<u64>, out: &mut CudaSlice<f32>) -> Result<()> {
        let (vb, ib, ob) = (self.buf("values", v)?, self.buf("indices", idx)?, self.buf_mut("output", out)?);
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.scatter(vb, ib, ob) })
    }

    /// `noise::unit` of elements `offset..offset + out.len()` of stream `seed`.
    pub fn noise(&self, seed: u64, offset: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        let b = self.buf_mut("output", out)?;
        // SAFETY: as in quantize_2bit.
        self.run(|o| unsafe { o.noise(seed, offset, b) })
    }
}

/// One member of a compressed reduce: a GPU (and its stream), its gradient
/// and its residual.
pub struct Member<'a, G: GpuGradient = f32> {
    pub gpu: &'a Gpu,
    pub grad: &'a CudaSlice<G>,
    pub residual: &'a mut CudaSlice<f32>,
}

/// A gradient element type the GPU kernels take (as `codec::Gradient`).
pub trait GpuGradient: DeviceRepr {
    const DTYPE: Dtype;
}

impl GpuGradient for f32 {
    const DTYPE: Dtype = Dtype::F32;
}

impl GpuGradient for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}

impl GpuGradient for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}

/// The device store's compressed Reduce across GPUs (the proposal's
/// design): each member quantizes with its own residual on its own stream,
/// the compressed arrays go to `merge`, which decodes and sums them in
/// member order into `sum`. Bit-identical to `codec::quantize_2bit_reduce`.
/// On error, a non-finite `residual + grad` of any member included, nothing
/// is written.
pub fn reduce_2bit<G: GpuGradient>(members: &mut [Member<G>], merge: &Gpu, sum: &mut CudaSlice<f32>, th: Thresholds) -> Result<()> {
    let mut raw = Vec::with_capacity(members.len());
    for m in members.iter_mut() {
        raw.push((m.gpu.ops(), m.gpu.buf("gradient", m.grad)?, m.gpu.buf_mut("residual", m.residual)?));
    }
    let out = merge.buf_mut("sum", sum)?;
    // SAFETY: borrowed CudaSlices of their GPUs, live for this call.
    unsafe { reduce_2bit_raw(&raw, G::DTYPE, &merge.ops(), out, th) }
}

/// `reduce_2bit` on raw buffers: member `d` is `(its stream's Ops, gradient,
/// residual)`. Every member is checked, then validated (residual + gradient
/// finite), before any residual is quantized in place; then the merge
/// stream decodes and sums, in member order. Returns once `sum` is written.
///
/// # Safety
/// Every buffer lives, with its stated length, on its Ops' device until
/// the call returns (`check` verifies everything else).
pub unsafe fn reduce_2bit_raw(members: &[(Ops, Buf, Buf)], dtype: Dtype, merge: &Ops, sum: Buf, th: Thresholds) -> Result<()> {
    let n = sum.len;
    if members.is_empty() {
        return Err(Error::SizeMismatch { what: "list of device gradients", expected: 1, got: 0 });
    }
    merge.check(&[sum])?;
    for (ops, g, r) in members {
        check_len("gradient", n, g.len)?;
        check_len("gradient element bytes", dtype.size(), g.elem)?;
        check_len("residual", n, r.len)?;
        if ops.ctx.cu_ctx() == merge.ctx.cu_ctx() {
            ops.check(&[*g, *r, sum])?;
        } else {
            ops.check(&[*g, *r])?;
        }
    }
    // Two members may not share a residual or write each other's gradient.
    for (i, (a, ga, ra)) in members.iter().enumerate() {
        for (b, gb, rb) in &members[i + 1..] {
            if a.ctx.cu_ctx() == b.ctx.cu_ctx() {
                a.check(&[*ra, *rb])?;
                a.check(&[*ra, *gb])?;
                a.check(&[*ga, *rb])?;
            }
        }
    }
    // Every member's verdict before anything changes.
    for (d, (ops, g, r)) in members.iter().enumerate() {
        // SAFETY: checked above.
        unsafe { ops.check_finite(&format!("pushed value {d}"), *g, dtype, Some(*r))? };
    }
    // Quantize on every member's stream (they run concurrently).
    let mut comprs = Vec::with_capacity(members.len());
    for (ops, g, r) in members {
        let compr = ops.s.alloc_zeros::<f32>(codec::compressed_len(n)).map_err(|e| cuda_err("allocating a compressed array", e))?;
        let c = Buf { what: "compressed array", ptr: ops.ptr(&compr), len: compr.len(), elem: 4 };
        // SAFETY: checked above; accepted by check_finite.
        unsafe { ops.launch_2bit(*g, dtype, *r, c, th)? };
        comprs.push((c, compr));
    }
    // Decode and sum on the merge stream, in member order.
    let mut copies = Vec::new(); // live until the merge stream has run
    for (d, ((ops, _, _), (c, _compr))) in members.iter().zip(&comprs).enumerate() {
        ops.sync()?;
        let c = if ops.ctx.cu_ctx() == merge.ctx.cu_ctx() {
            *c
        } else {
            let copy = merge.s.alloc_zeros::<f32>(c.len).map_err(|e| cuda_err("allocating a compressed array", e))?;
            let dst = Buf { what: "compressed array", ptr: merge.ptr(&copy), len: c.len, elem: 4 };
            // SAFETY: both are live allocations of c.len floats in their contexts.
            unsafe { drv::memcpy_peer_async(merge.ctx.cu_ctx(), dst.ptr, ops.ctx.cu_ctx(), c.ptr, 4 * c.len, merge.s.cu_stream()) }.map_err(|e| cuda_err("copying between GPUs", e))?;
            copies.push(copy);
            dst
        };
        // SAFETY: c and sum live on the merge GPU.
        unsafe { merge.dequantize_2bit(c, sum, d > 0)? };
    }
    merge.sync()
}
