//! Next-token log-probabilities on CUDA: the logits of some rows through the output head in f32
//! (cuBLAS, inputs in the compute dtype, f32 accumulation and output), and the log-softmax with
//! its top k in a kernel of ours (`kernels/logprobs.cu`). See [`crate::engine::logprobs`] for the
//! precision of the whole path.

use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys};
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

use super::module::{fatbin, kernel, Module};
use super::{cuda_device, cuda_view, tensor};

/// `kernels/logprobs.cu`.
const LOGPROBS: Module = fatbin!("logprobs");

/// The kernel's block size (`LP_THREADS`) and largest k (`LP_MAX_K`).
const THREADS: u32 = 256;
const MAX_K: usize = 64;

/// `x @ head^T` as f32 `[rows, vocab]` for `x` `[rows, hidden]` and `head` `[vocab, hidden]` of
/// the same dtype (bf16, f16 or f32): cuBLAS multiplies the inputs as they are (a product of two
/// 16-bit floats is exact in f32) and accumulates in f32 (`CUBLAS_COMPUTE_32F`, never TF32 nor a
/// 16-bit reduction), writing f32, so the logits are never rounded to the compute dtype.
pub fn logits_f32(x: &Tensor, head: &Tensor) -> candle_core::Result<Tensor> {
    let dev = cuda_device(x, "logits_f32")?;
    let (x, head) = (x.contiguous()?, head.contiguous()?);
    let (rows, hidden) = x.dims2()?;
    let (vocab, h2) = head.dims2()?;
    if hidden != h2 || x.dtype() != head.dtype() {
        candle_core::bail!(
            "logits_f32: x {:?} {:?} and head {:?} {:?} do not fit",
            x.dims(),
            x.dtype(),
            head.dims(),
            head.dtype()
        );
    }
    let int = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("logits_f32: {what} {v} is past 2^31")))
    };
    let (m, n, k) = (int(vocab, "vocab")?, int(rows, "rows")?, int(hidden, "hidden")?);
    // SAFETY: the matmul writes every element (beta = 0).
    let mut out = unsafe { dev.alloc::<f32>(rows * vocab)? };
    let stream = dev.cuda_stream();
    let blas_handle = dev.cublas_handle();
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = head.storage_and_layout();
    let (alpha, beta) = (1f32, 0f32);
    macro_rules! gemm {
        ($t:ty, $cuda:expr) => {{
            let xv = cuda_view::<$t>(&xs, xl, "logits_f32: x")?;
            let wv = cuda_view::<$t>(&ws, wl, "logits_f32: head")?;
            let (a, _ga) = wv.device_ptr(&stream);
            let (b, _gb) = xv.device_ptr(&stream);
            let (c, _gc) = out.device_ptr_mut(&stream);
            // Column-major: C [vocab, rows] = head^T' ... i.e. C = op(A) B with A the head stored
            // [hidden, vocab] (so op = T gives [vocab, hidden]) and B the rows stored [hidden, rows];
            // C's columns are the rows of the row-major [rows, vocab] result.
            // SAFETY: the pointers are live device buffers of the sizes the dimensions say, on the
            // stream the handle is bound to; alpha and beta are f32 as CUBLAS_COMPUTE_32F needs.
            unsafe {
                blas::gemm_ex(
                    *blas_handle.handle(),
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    m,
                    n,
                    k,
                    (&alpha) as *const f32 as *const _,
                    a as *const _,
                    $cuda,
                    k,
                    b as *const _,
                    $cuda,
                    k,
                    (&beta) as *const f32 as *const _,
                    c as *mut _,
                    sys::cudaDataType_t::CUDA_R_32F,
                    m,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| candle_core::Error::Msg(format!("logits_f32: cuBLAS: {e:?}")))?;
        }};
    }
    if rows > 0 {
        match x.dtype() {
            DType::BF16 => gemm!(half::bf16, sys::cudaDataType_t::CUDA_R_16BF),
            DType::F16 => gemm!(half::f16, sys::cudaDataType_t::CUDA_R_16F),
            DType::F32 => gemm!(f32, sys::cudaDataType_t::CUDA_R_32F),
            d => candle_core::bail!("logits_f32: unsupported dtype {d:?}"),
        }
    }
    drop((xs, ws));
    Ok(tensor(out, dev, (rows, vocab)))
}

/// The top `k` (1..=64) log-probabilities of each row of f32 `logits` `[rows, vocab]`: ids `[rows,
/// k]` u32 and log-probabilities `[rows, k]` f32, best first with ties by ascending id, and
/// `[rows]` f32 the log-probability of `targets[row]` (`[rows]` i32; NaN where it is negative).
pub fn top_k_logprobs(logits: &Tensor, k: usize, targets: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let dev = cuda_device(logits, "top_k_logprobs")?;
    let logits = logits.contiguous()?;
    let targets = targets.contiguous()?;
    let (rows, vocab) = logits.dims2()?;
    if logits.dtype() != DType::F32 || targets.dtype() != DType::I32 || targets.dims() != [rows] {
        candle_core::bail!("top_k_logprobs: f32 logits [rows, vocab] and i32 targets [rows] expected");
    }
    if k == 0 || k > MAX_K.min(vocab) {
        candle_core::bail!("top_k_logprobs: k = {k} must be in 1..={}", MAX_K.min(vocab));
    }
    if rows > i32::MAX as usize {
        candle_core::bail!("top_k_logprobs: {rows} rows is past the grid's limit");
    }
    // SAFETY: the kernel writes every element of the three outputs (one block per row).
    let ids = unsafe { dev.alloc::<u32>(rows * k)? };
    let lps = unsafe { dev.alloc::<f32>(rows * k)? };
    let tgt = unsafe { dev.alloc::<f32>(rows)? };
    if rows > 0 {
        let (ls, ll) = logits.storage_and_layout();
        let (ts, tl) = targets.storage_and_layout();
        let lv = cuda_view::<f32>(&ls, ll, "top_k_logprobs: logits")?;
        let tv = cuda_view::<i32>(&ts, tl, "top_k_logprobs: targets")?;
        let func = kernel(dev, LOGPROBS, "topk_logprobs_f32")?;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let (v, kk) = (vocab, k as i32);
        let mut b = func.builder();
        b.arg(&lv);
        b.arg(&v);
        b.arg(&kk);
        b.arg(&tv);
        b.arg(&ids);
        b.arg(&lps);
        b.arg(&tgt);
        // SAFETY: argument types and order match the kernel (logits, size_t, int, targets, three
        // outputs).
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok((tensor(ids, dev, (rows, k)), tensor(lps, dev, (rows, k)), tensor(tgt, dev, rows)))
}
