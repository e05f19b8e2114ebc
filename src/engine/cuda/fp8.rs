//! Block-wise FP8 projections on CUDA (W8A8 dynamic, Qwen's FP8 releases).
//!
//! Two paths, chosen per device and output dtype by trying one (`block_scaled`), not by the
//! device's name:
//! - **FP8 tensor cores** (cuBLASLt block scaling, CUDA 12.9 or newer, sm_90): the weight stays
//!   e4m3 `[N, K]` with its 128 x 128 block scales; each input row is quantised per group of 128
//!   by `kernels/fp8.cu` into e4m3 bytes and 1 x 128 scales, and cuBLASLt multiplies the bytes,
//!   applies both scales per block of K and sums in f32.
//! - **Dequantised**: elsewhere the weight is dequantised at load into the compute dtype, and the
//!   input is quantised and dequantised ([`qdq`]) before an ordinary matmul: the same arithmetic
//!   with the products rounded differently.
//!
//! cuBLASLt's layout for these scales (column-major, so the roles are swapped): its `A` is the
//! weight, `[K, N]` with leading dimension K, transposed; its scales are `[ceil(N/128), Kb4]` row
//! major, Kb4 = ceil(K/128) padded to a multiple of 4. Its `B` is the input `[K, M]` (row-major
//! `[M, K]`); its scales are `[K/128, M]`, each group's M scales contiguous. M is padded to a
//! multiple of 4 (zero rows), so that layout holds whatever cuBLASLt pads.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, DType, Device, Tensor};

use super::module::{fatbin, kernel, Module};
use super::{cuda_device, cuda_view, kernel_name, tensor, KernelType};
use crate::engine::config::quant::FP8_BLOCK;

/// `kernels/fp8.cu`.
const FP8: Module = fatbin!("fp8");

/// cuBLASLt's workspace: what NVIDIA recommends for Hopper.
const WORKSPACE: usize = 32 << 20;

/// An FP8 projection's weight on the GPU: `q` e4m3 bytes `[N, K]` (U8) and `scale` f32
/// `[ceil(N/128), Kb4]` (the checkpoint's `weight_scale_inv`, rows padded to a multiple of 4).
#[derive(Clone)]
pub struct Fp8Weight {
    pub q: Tensor,
    pub scale: Tensor,
}

impl Fp8Weight {
    /// The weight `bytes` (`[n, k]` e4m3) and its scales `[ceil(n/128), ceil(k/128)]` row-major,
    /// copied to `dev`.
    pub fn upload(dev: &Device, bytes: &[u8], scale: &[f32], n: usize, k: usize) -> candle_core::Result<Self> {
        let (nb, kb) = (n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK));
        let kb4 = kb.next_multiple_of(4);
        if bytes.len() != n * k || scale.len() != nb * kb {
            candle_core::bail!("fp8 weight: {} bytes and {} scales for [{n}, {k}]", bytes.len(), scale.len());
        }
        let mut padded = vec![1f32; nb * kb4];
        for (row, src) in padded.chunks_mut(kb4).zip(scale.chunks(kb)) {
            row[..kb].copy_from_slice(src);
        }
        let q = Tensor::from_raw_buffer(bytes, DType::U8, &[n, k], dev)?;
        let scale = Tensor::from_vec(padded, (nb, kb4), dev)?;
        Ok(Fp8Weight { q, scale })
    }

    pub fn out_dim(&self) -> usize {
        self.q.dims()[0]
    }

    /// Several weights of the same K side by side (outputs concatenated); each but the last must
    /// end on a block boundary (N a multiple of 128), or the blocks would straddle two of them.
    pub fn cat(parts: &[&Fp8Weight]) -> candle_core::Result<Self> {
        if parts.iter().rev().skip(1).any(|p| !p.out_dim().is_multiple_of(FP8_BLOCK)) {
            candle_core::bail!("fp8 weights join only on 128-row block boundaries");
        }
        let q: Vec<&Tensor> = parts.iter().map(|p| &p.q).collect();
        let s: Vec<&Tensor> = parts.iter().map(|p| &p.scale).collect();
        Ok(Fp8Weight { q: Tensor::cat(&q, 0)?, scale: Tensor::cat(&s, 0)? })
    }

    /// The weight dequantised, `[N, K]` in `dtype` (each element `e4m3 * scale`, rounded once).
    pub fn dequantise(&self, dtype: DType) -> candle_core::Result<Tensor> {
        let dev = cuda_device(&self.q, "fp8 dequantise")?;
        match dtype {
            DType::BF16 => dequantise_as::<half::bf16>(dev, self),
            DType::F16 => dequantise_as::<half::f16>(dev, self),
            DType::F32 => dequantise_as::<f32>(dev, self),
            d => candle_core::bail!("fp8 dequantise: no kernel for {d:?}"),
        }
    }
}

fn dequantise_as<T: KernelType>(dev: &CudaDevice, w: &Fp8Weight) -> candle_core::Result<Tensor> {
    let (n, k) = w.q.dims2()?;
    let ld = w.scale.dim(1)?;
    // SAFETY: the kernel writes every element.
    let out = unsafe { dev.alloc::<T>(n * k)? };
    if n * k > 0 {
        let (qs, ql) = w.q.storage_and_layout();
        let (ss, sl) = w.scale.storage_and_layout();
        let qv = cuda_view::<u8>(&qs, ql, "fp8 dequantise: weight")?;
        let sv = cuda_view::<f32>(&ss, sl, "fp8 dequantise: scales")?;
        let func = kernel(dev, FP8, &kernel_name::<T>("fp8_dequantise"))?;
        let cfg = LaunchConfig {
            grid_dim: ((n * k).div_ceil(256).min(65535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&qv);
        b.arg(&sv);
        b.arg(&n);
        b.arg(&k);
        b.arg(&ld);
        b.arg(&out);
        // SAFETY: argument types and order match the kernel (bytes, scales, three size_t, output).
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok(tensor(out, dev, (n, k)))
}

/// The launch of one warp per (row, group of 128) over `rows` rows of `k` columns.
fn warp_per_group(rows: usize, k: usize) -> LaunchConfig {
    let warps = rows * (k / FP8_BLOCK);
    LaunchConfig { grid_dim: (warps.div_ceil(8).max(1) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

fn check_k(k: usize, what: &str) -> candle_core::Result<()> {
    if k == 0 || !k.is_multiple_of(FP8_BLOCK) {
        candle_core::bail!("{what}: {k} input features, not a positive multiple of {FP8_BLOCK}");
    }
    Ok(())
}

/// The input quantised for the FP8 GEMM: e4m3 bytes `[m_pad, K]` and scales `[K/128, m_pad]`.
struct Quantised {
    q: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    m_pad: usize,
}

/// What the GEMM's input is quantised from.
#[derive(Clone, Copy, PartialEq)]
enum Source {
    /// The input itself, `[M, K]`.
    Plain,
    /// `[M, 2K]`, the gate and up projections side by side: the input is `silu(gate) * up`,
    /// rounded to the dtype as `ops::silu_mul` rounds it, never written in that dtype.
    SiluMul,
}

fn quantise_from<T: KernelType>(dev: &CudaDevice, x: &Tensor, source: Source) -> candle_core::Result<Quantised> {
    let (m, cols) = x.dims2()?;
    let (k, name) = match source {
        Source::Plain => (cols, "fp8_quantise"),
        Source::SiluMul => {
            if !cols.is_multiple_of(2) {
                candle_core::bail!("fp8 silu_mul quantise: [{m}, {cols}] is not [rows, 2 * inter]");
            }
            (cols / 2, "fp8_silu_mul_quantise")
        }
    };
    check_k(k, "fp8 quantise")?;
    let m_pad = m.next_multiple_of(4).max(4);
    // SAFETY: the kernel writes every byte and scale (the padding rows included).
    let q = unsafe { dev.alloc::<u8>(m_pad * k)? };
    let scales = unsafe { dev.alloc::<f32>(m_pad * (k / FP8_BLOCK))? };
    let (xs, xl) = x.storage_and_layout();
    let xv = cuda_view::<T>(&xs, xl, "fp8 quantise: input")?;
    let func = kernel(dev, FP8, &kernel_name::<T>(name))?;
    let mut b = func.builder();
    b.arg(&xv);
    b.arg(&m);
    b.arg(&m_pad);
    b.arg(&k);
    b.arg(&q);
    b.arg(&scales);
    // SAFETY: argument types and order match the kernel (input, three size_t, two outputs).
    unsafe { b.launch(warp_per_group(m_pad, k)) }.w()?;
    Ok(Quantised { q, scales, m_pad })
}

/// `x` `[M, K]` with every row quantised to e4m3 per group of 128 and dequantised, in its own
/// dtype (the CPU path's `quantise_activations`, rounded to the dtype).
pub fn qdq(x: &Tensor) -> candle_core::Result<Tensor> {
    let dev = cuda_device(x, "fp8 qdq")?;
    let x = x.contiguous()?;
    match x.dtype() {
        DType::BF16 => qdq_as::<half::bf16>(dev, &x),
        DType::F16 => qdq_as::<half::f16>(dev, &x),
        DType::F32 => qdq_as::<f32>(dev, &x),
        d => candle_core::bail!("fp8 qdq: no kernel for {d:?}"),
    }
}

fn qdq_as<T: KernelType>(dev: &CudaDevice, x: &Tensor) -> candle_core::Result<Tensor> {
    let (m, k) = x.dims2()?;
    check_k(k, "fp8 qdq")?;
    // SAFETY: the kernel writes every element.
    let y = unsafe { dev.alloc::<T>(m * k)? };
    if m > 0 {
        let (xs, xl) = x.storage_and_layout();
        let xv = cuda_view::<T>(&xs, xl, "fp8 qdq: input")?;
        let func = kernel(dev, FP8, &kernel_name::<T>("fp8_qdq"))?;
        let mut b = func.builder();
        b.arg(&xv);
        b.arg(&m);
        b.arg(&k);
        b.arg(&y);
        // SAFETY: argument types and order match the kernel (input, two size_t, output).
        unsafe { b.launch(warp_per_group(m, k)) }.w()?;
    }
    Ok(tensor(y, dev, (m, k)))
}

/// `x` `[M, K]` (bf16 or f16) quantised as the FP8 GEMMs receive it, on the device: e4m3 bytes
/// `[m_pad, K]` (U8) and scales `[K/128, m_pad]` (f32; each group's scales contiguous), `m_pad`
/// M rounded up to a multiple of 4 (zero rows). For the experts' grouped FP8 kernel.
pub fn quantise(x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = cuda_device(x, "fp8 quantise")?;
    let x = x.contiguous()?;
    let k = x.dim(1)?;
    let qz = match x.dtype() {
        DType::BF16 => quantise_from::<half::bf16>(dev, &x, Source::Plain)?,
        DType::F16 => quantise_from::<half::f16>(dev, &x, Source::Plain)?,
        d => candle_core::bail!("fp8 quantise: no kernel for {d:?}"),
    };
    Ok((tensor(qz.q, dev, (qz.m_pad, k)), tensor(qz.scales, dev, (k / FP8_BLOCK, qz.m_pad))))
}

/// The input's quantisation as the GEMM receives it, copied to the host: bytes `[m_pad, K]` and
/// scales `[K/128, m_pad]` (for tests against the CPU quantiser).
pub fn quantise_to_host(x: &Tensor) -> candle_core::Result<(Vec<u8>, Vec<f32>, usize)> {
    to_host(x, Source::Plain)
}

/// As [`quantise_to_host`], for the input `silu(gate) * up` of `gu` `[M, 2I]` quantised in one
/// pass (the fused kernel [`silu_mul_matmul`] runs).
pub fn silu_mul_quantise_to_host(gu: &Tensor) -> candle_core::Result<(Vec<u8>, Vec<f32>, usize)> {
    to_host(gu, Source::SiluMul)
}

fn to_host(x: &Tensor, source: Source) -> candle_core::Result<(Vec<u8>, Vec<f32>, usize)> {
    let dev = cuda_device(x, "fp8 quantise")?;
    let x = x.contiguous()?;
    let qz = match x.dtype() {
        DType::BF16 => quantise_from::<half::bf16>(dev, &x, source)?,
        DType::F16 => quantise_from::<half::f16>(dev, &x, source)?,
        DType::F32 => quantise_from::<f32>(dev, &x, source)?,
        d => candle_core::bail!("fp8 quantise: no kernel for {d:?}"),
    };
    let stream = dev.cuda_stream();
    Ok((stream.clone_dtoh(&qz.q).w()?, stream.clone_dtoh(&qz.scales).w()?, qz.m_pad))
}

/// A cuBLASLt handle and workspace for one device context, and the algorithm its heuristic chose
/// for each problem size met so far.
struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: Mutex<HashMap<(usize, usize, usize, DType), sys::cublasLtMatmulAlgo_t>>,
    /// Per output dtype: whether block-scaled FP8 GEMMs run here (tried once).
    works: Mutex<HashMap<DType, bool>>,
}

// SAFETY: the handle is used under cuBLASLt's thread-safety rules (a handle may be shared; each
// call names its stream), and the workspace is only used on the device's one stream.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

fn lt_of(dev: &CudaDevice) -> candle_core::Result<Arc<Lt>> {
    static ALL: OnceLock<Mutex<HashMap<usize, Arc<Lt>>>> = OnceLock::new();
    let stream = dev.cuda_stream();
    let key = Arc::as_ptr(stream.context()) as usize;
    let mut all = ALL.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = all.get(&key) {
        return Ok(l.clone());
    }
    let handle = lt::create_handle().map_err(|e| candle_core::Error::Msg(format!("cuBLASLt: {e:?}")))?;
    let workspace = stream.alloc_zeros::<u8>(WORKSPACE).w()?;
    let l = Arc::new(Lt { handle, workspace, algos: Mutex::default(), works: Mutex::default() });
    all.insert(key, l.clone());
    Ok(l)
}

fn lt_err(
    what: &str,
) -> impl Fn(candle_core::cuda_backend::cudarc::cublaslt::result::CublasError) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("cuBLASLt block-scaled FP8 GEMM: {what}: {e:?}"))
}

/// Destroys cuBLASLt descriptors when the call ends, whichever way.
struct Descs {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: Vec<sys::cublasLtMatrixLayout_t>,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was created once and is destroyed once, here.
        unsafe {
            for l in &self.layouts {
                let _ = lt::destroy_matrix_layout(*l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn out_type(dtype: DType) -> candle_core::Result<sys::cudaDataType> {
    Ok(match dtype {
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        d => candle_core::bail!("fp8 matmul: no output type {d:?}"),
    })
}

/// `x @ w^T` for `x` `[M, K]` (bf16, f16 or f32) and an FP8 weight `[N, K]`: `[M, N]` in x's
/// dtype, through the FP8 tensor cores. Fails where block-scaled GEMMs do not run (see
/// [`block_scaled`]).
pub fn matmul(x: &Tensor, w: &Fp8Weight) -> candle_core::Result<Tensor> {
    matmul_from(x, w, Source::Plain)
}

/// `silu(gate) * up` of `gu` `[M, 2I]` (the gate projection's outputs, then the up
/// projection's) multiplied by the FP8 weight `[N, I]`: the same bytes, scales and product as
/// `matmul(&ops::silu_mul(gu)?, w)`, with the activation quantised straight from `gu`.
pub fn silu_mul_matmul(gu: &Tensor, w: &Fp8Weight) -> candle_core::Result<Tensor> {
    matmul_from(gu, w, Source::SiluMul)
}

fn matmul_from(x: &Tensor, w: &Fp8Weight, source: Source) -> candle_core::Result<Tensor> {
    let dev = cuda_device(x, "fp8 matmul")?;
    let x = x.contiguous()?;
    match x.dtype() {
        DType::BF16 => matmul_as::<half::bf16>(dev, &x, w, source),
        DType::F16 => matmul_as::<half::f16>(dev, &x, w, source),
        DType::F32 => matmul_as::<f32>(dev, &x, w, source),
        d => candle_core::bail!("fp8 matmul: no kernel for {d:?}"),
    }
}

fn matmul_as<T: KernelType>(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Fp8Weight,
    source: Source,
) -> candle_core::Result<Tensor> {
    let (m, cols) = x.dims2()?;
    let k = if source == Source::SiluMul { cols / 2 } else { cols };
    let (n, k2) = w.q.dims2()?;
    if k != k2 || (source == Source::SiluMul && cols != 2 * k) {
        candle_core::bail!("fp8 matmul: input [{m}, {cols}] and weight [{n}, {k2}] do not fit");
    }
    if m == 0 {
        return Tensor::zeros((0, n), x.dtype(), x.device());
    }
    let qx = quantise_from::<T>(dev, x, source)?;
    let m_pad = qx.m_pad;
    // SAFETY: the GEMM writes every element of D (beta = 0).
    let mut out = unsafe { dev.alloc::<T>(m_pad * n)? };
    let l = lt_of(dev)?;
    gemm(dev, &l, w, &qx, n, k, x.dtype(), &mut out)?;
    tensor(out, dev, (m_pad, n)).narrow(0, 0, m)
}

#[allow(clippy::too_many_arguments)]
fn gemm<T: KernelType>(
    dev: &CudaDevice,
    l: &Lt,
    w: &Fp8Weight,
    qx: &Quantised,
    n: usize,
    k: usize,
    dtype: DType,
    out: &mut CudaSlice<T>,
) -> candle_core::Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    let stream = dev.cuda_stream();
    let m_pad = qx.m_pad;
    let e4m3 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
    let otype = out_type(dtype)?;
    let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F)
        .map_err(lt_err("descriptor"))?;
    let mut d = Descs { desc, layouts: Vec::new() };
    for (rows, cols, ld, t) in [(k, n, k, e4m3), (k, m_pad, k, e4m3), (n, m_pad, n, otype)] {
        d.layouts.push(lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).map_err(lt_err("layout"))?);
    }
    let (ss, sl) = w.scale.storage_and_layout();
    let (qs, ql) = w.q.storage_and_layout();
    let wsv = cuda_view::<f32>(&ss, sl, "fp8 matmul: weight scales")?;
    let wqv = cuda_view::<u8>(&qs, ql, "fp8 matmul: weight")?;
    let (wq_ptr, _g1) = wqv.device_ptr(&stream);
    let (ws_ptr, _g2) = wsv.device_ptr(&stream);
    let (xq_ptr, _g3) = qx.q.device_ptr(&stream);
    let (xs_ptr, _g4) = qx.scales.device_ptr(&stream);
    let (o_ptr, _g5) = out.device_ptr_mut(&stream);
    let (wk_ptr, _g6) = l.workspace.device_ptr(&stream);
    let set = |attr: A, v: *const c_void, size: usize| {
        // SAFETY: `v` points at a value of the attribute's type and `size` bytes.
        unsafe { lt::set_matmul_desc_attribute(d.desc, attr, v, size) }.map_err(lt_err("attribute"))
    };
    use candle_core::cuda_backend::cudarc::cublas::sys::cublasOperation_t as Op;
    let (t, nt) = (Op::CUBLAS_OP_T, Op::CUBLAS_OP_N);
    set(A::CUBLASLT_MATMUL_DESC_TRANSA, &t as *const _ as _, std::mem::size_of_val(&t))?;
    set(A::CUBLASLT_MATMUL_DESC_TRANSB, &nt as *const _ as _, std::mem::size_of_val(&nt))?;
    let (blk, vec) = (
        sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
        sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
    );
    set(A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &blk as *const _ as _, std::mem::size_of_val(&blk))?;
    set(A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vec as *const _ as _, std::mem::size_of_val(&vec))?;
    set(A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws_ptr as *const _ as _, std::mem::size_of_val(&ws_ptr))?;
    set(A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs_ptr as *const _ as _, std::mem::size_of_val(&xs_ptr))?;
    let key = (m_pad, n, k, dtype);
    let cached = l.algos.lock().unwrap_or_else(|e| e.into_inner()).get(&key).copied();
    let algo = match cached {
        Some(a) => a,
        None => {
            let pref = lt::create_matmul_pref().map_err(lt_err("preference"))?;
            let ws_size = WORKSPACE as u64;
            // SAFETY: the attribute is a u64 byte count; `pref` lives until destroyed below.
            let r = unsafe {
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &ws_size as *const _ as _,
                    std::mem::size_of_val(&ws_size),
                )
            }
            .and_then(|_| {
                // SAFETY: every descriptor is alive.
                unsafe {
                    lt::get_matmul_algo_heuristic(
                        l.handle,
                        d.desc,
                        d.layouts[0],
                        d.layouts[1],
                        d.layouts[2],
                        d.layouts[2],
                        pref,
                    )
                }
            });
            // SAFETY: created above, destroyed once.
            let _ = unsafe { lt::destroy_matmul_pref(pref) };
            let a = r.map_err(lt_err("no algorithm"))?.algo;
            l.algos.lock().unwrap_or_else(|e| e.into_inner()).insert(key, a);
            a
        }
    };
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the pointers are live device buffers of the sizes the layouts describe, on the
    // device's stream; the workspace is WORKSPACE bytes.
    unsafe {
        lt::matmul(
            l.handle,
            d.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            wq_ptr as *const c_void,
            d.layouts[0],
            xq_ptr as *const c_void,
            d.layouts[1],
            o_ptr as *const c_void,
            d.layouts[2],
            o_ptr as *mut c_void,
            d.layouts[2],
            &algo,
            wk_ptr as *mut c_void,
            WORKSPACE,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(lt_err("matmul"))
}

/// Whether block-scaled FP8 GEMMs with `dtype` output run on `dev`: tried once per device and
/// dtype on a small problem (cuBLASLt 12.9+ on sm_90 runs them; elsewhere the heuristic finds
/// no algorithm). The answer is remembered.
pub fn block_scaled(device: &Device, dtype: DType) -> bool {
    let Device::Cuda(dev) = device else { return false };
    let Ok(l) = lt_of(dev) else { return false };
    if let Some(&w) = l.works.lock().unwrap_or_else(|e| e.into_inner()).get(&dtype) {
        return w;
    }
    let probe = || -> candle_core::Result<()> {
        let (n, k) = (128, 128);
        let w = Fp8Weight::upload(device, &vec![0x38u8; n * k], &[1.0], n, k)?; // 0x38 = 1.0
        let x = Tensor::ones((4, k), dtype, device)?;
        let y = matmul(&x, &w)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        // Each output is 128 products of 1 x 1 with the input's scale (1/448) times 448.
        if y.iter().flatten().all(|v| (v - 128.0).abs() < 1e-3) {
            Ok(())
        } else {
            candle_core::bail!("the probe's product is wrong")
        }
    };
    let works = match probe() {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, ?dtype, "block-scaled FP8 GEMMs do not run on this GPU");
            false
        }
    };
    l.works.lock().unwrap_or_else(|e| e.into_inner()).insert(dtype, works);
    works
}

/// The compute capability of the GPU `device` is (major, minor), or None elsewhere.
pub fn compute_capability(device: &Device) -> Option<(i32, i32)> {
    let Device::Cuda(dev) = device else { return None };
    dev.cuda_stream().context().compute_capability().ok()
}
