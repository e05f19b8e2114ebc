//! Fused element-wise kernels for CUDA (`kernels/ops.cu`).

use super::cuda_module::{kernel, OPS};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Shape, Tensor};

/// `silu(gate) * up` where `gu` is `[rows, 2 * inter]` holding the gate projection then the up
/// projection (one matmul makes both). Returns `[rows, inter]`. `inter` must be a multiple of 8.
pub fn silu_mul(gu: &Tensor) -> candle_core::Result<Tensor> {
    gu.contiguous()?.apply_op1_no_bwd(&SiluMul)
}

struct SiluMul;

impl SiluMul {
    fn launch<T: DeviceRepr>(
        dev: &CudaDevice,
        name: &str,
        gu: &CudaSlice<T>,
        l: &Layout,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (rows, two_inter) = l.shape().dims2()?;
        let inter = two_inter / 2;
        let vec = 16 / std::mem::size_of::<T>();
        let start = match l.contiguous_offsets() {
            Some((a, _)) if two_inter % 2 == 0 && inter % 8 == 0 && a % vec == 0 => a,
            _ => candle_core::bail!(
                "silu_mul: [rows, 2*inter] contiguous with inter a multiple of 8, got {:?}",
                l.shape()
            ),
        };
        let src = gu.slice(start..start + rows * two_inter);
        // SAFETY: the kernel writes every element of the output.
        let out = unsafe { dev.alloc::<T>(rows * inter)? };
        let func = kernel(dev, OPS, name)?;
        let vecs = (rows * inter / vec) as u32;
        let cfg = LaunchConfig {
            grid_dim: (vecs.div_ceil(256).clamp(1, 65535 * 8), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&out);
        let (r, i) = (rows, inter);
        b.arg(&r);
        b.arg(&i);
        if rows * inter > 0 {
            // SAFETY: argument types and order match the kernel (pointers, then two size_t).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }
}

impl candle_core::CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("silu_mul runs on CUDA devices only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let slice = match &s.slice {
            CudaStorageSlice::BF16(x) => CudaStorageSlice::BF16(Self::launch(dev, "silu_mul_bf16", x, l)?),
            CudaStorageSlice::F16(x) => CudaStorageSlice::F16(Self::launch(dev, "silu_mul_f16", x, l)?),
            CudaStorageSlice::F32(x) => CudaStorageSlice::F32(Self::launch(dev, "silu_mul_f32", x, l)?),
            _ => candle_core::bail!("silu_mul: unsupported dtype {:?}", s.dtype()),
        };
        let (rows, two_inter) = l.shape().dims2()?;
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from((rows, two_inter / 2))))
    }
}

/// `x + y` in f32, for `x` f32 (the residual stream) and `y` bf16 or f16 (a sublayer's output).
pub fn add_f32(x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    if x.dims() != y.dims() {
        candle_core::bail!("add_f32: shapes {:?} and {:?} differ", x.dims(), y.dims());
    }
    x.contiguous()?.apply_op2_no_bwd(&y.contiguous()?, &AddF32)
}

/// RMSNorm of an f32 `[rows, cols]` tensor with a bf16/f16 weight `[cols]`, in the weight's type.
pub fn rms_norm_f32(x: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<Tensor> {
    let cols = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / cols.max(1);
    let y = x.contiguous()?.reshape((rows, cols))?.apply_op2_no_bwd(w, &RmsNormF32 { eps })?;
    y.reshape(x.dims())
}

fn contiguous<'a, T: DeviceRepr>(
    s: &'a CudaSlice<T>,
    l: &Layout,
    what: &str,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.slice(a..b)),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

struct AddF32;

impl candle_core::CustomOp2 for AddF32 {
    fn name(&self) -> &'static str {
        "add-f32"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("add_f32 runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ys: &CudaStorage,
        yl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = xs.device();
        let n = xl.shape().elem_count();
        let x = match &xs.slice {
            CudaStorageSlice::F32(x) => contiguous(x, xl, "add_f32: x")?,
            _ => candle_core::bail!("add_f32: x must be f32"),
        };
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<f32>(n)? };
        let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        match &ys.slice {
            CudaStorageSlice::BF16(y) => {
                let y = contiguous(y, yl, "add_f32: y")?;
                let func = kernel(dev, OPS, "add_f32_bf16")?;
                let mut b = func.builder();
                b.arg(&x);
                b.arg(&y);
                b.arg(&out);
                b.arg(&n);
                // SAFETY: argument types and order match the kernel.
                unsafe { b.launch(cfg) }.w()?;
            }
            CudaStorageSlice::F16(y) => {
                let y = contiguous(y, yl, "add_f32: y")?;
                let func = kernel(dev, OPS, "add_f32_f16")?;
                let mut b = func.builder();
                b.arg(&x);
                b.arg(&y);
                b.arg(&out);
                b.arg(&n);
                // SAFETY: argument types and order match the kernel.
                unsafe { b.launch(cfg) }.w()?;
            }
            _ => candle_core::bail!("add_f32: y must be bf16 or f16"),
        }
        Ok((CudaStorage { slice: CudaStorageSlice::F32(out), device: dev.clone() }, xl.shape().clone()))
    }
}

struct RmsNormF32 {
    eps: f32,
}

impl candle_core::CustomOp2 for RmsNormF32 {
    fn name(&self) -> &'static str {
        "rms-norm-f32"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("rms_norm_f32 runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = xs.device();
        let (rows, cols) = xl.shape().dims2()?;
        if wl.shape().elem_count() != cols {
            candle_core::bail!("rms_norm_f32: weight {:?} for rows of {cols}", wl.shape());
        }
        let x = match &xs.slice {
            CudaStorageSlice::F32(x) => contiguous(x, xl, "rms_norm_f32: x")?,
            _ => candle_core::bail!("rms_norm_f32: x must be f32"),
        };
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (c, eps) = (cols as i32, self.eps);
        let slice = match &ws.slice {
            CudaStorageSlice::BF16(w) => {
                let w = contiguous(w, wl, "rms_norm_f32: w")?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<half::bf16>(rows * cols)? };
                let func = kernel(dev, OPS, "rms_norm_f32_bf16")?;
                let mut b = func.builder();
                b.arg(&x);
                b.arg(&w);
                b.arg(&out);
                b.arg(&c);
                b.arg(&eps);
                if rows > 0 {
                    // SAFETY: argument types and order match the kernel.
                    unsafe { b.launch(cfg) }.w()?;
                }
                CudaStorageSlice::BF16(out)
            }
            CudaStorageSlice::F16(w) => {
                let w = contiguous(w, wl, "rms_norm_f32: w")?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<half::f16>(rows * cols)? };
                let func = kernel(dev, OPS, "rms_norm_f32_f16")?;
                let mut b = func.builder();
                b.arg(&x);
                b.arg(&w);
                b.arg(&out);
                b.arg(&c);
                b.arg(&eps);
                if rows > 0 {
                    // SAFETY: argument types and order match the kernel.
                    unsafe { b.launch(cfg) }.w()?;
                }
                CudaStorageSlice::F16(out)
            }
            _ => candle_core::bail!("rms_norm_f32: the weight must be bf16 or f16"),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, xl.shape().clone()))
    }
}

/// f32 values as fp8 (E4M3): round to nearest even, saturating at ±448, NaN kept. (Candle's own
/// cast to F8E4M3 on CUDA looks up a kernel name its kernels do not define.)
pub fn f32_to_fp8(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&F32ToFp8)
}

struct F32ToFp8;

impl candle_core::CustomOp1 for F32ToFp8 {
    fn name(&self) -> &'static str {
        "f32-to-fp8"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("f32_to_fp8 runs on CUDA devices only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let x = match &s.slice {
            CudaStorageSlice::F32(x) => contiguous(x, l, "f32_to_fp8: x")?,
            _ => candle_core::bail!("f32_to_fp8: x must be f32"),
        };
        let n = l.shape().elem_count();
        // SAFETY: the kernel writes every element of the output.
        let out = unsafe { dev.alloc::<float8::F8E4M3>(n)? };
        let func = kernel(dev, OPS, "f32_to_fp8_e4m3")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).clamp(1, 65535 * 8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&out);
        b.arg(&n);
        if n > 0 {
            // SAFETY: argument types and order match the kernel (two pointers, then a size_t).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((CudaStorage { slice: CudaStorageSlice::F8E4M3(out), device: dev.clone() }, l.shape().clone()))
    }
}
