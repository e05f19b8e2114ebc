//! Fused element-wise kernels for CUDA (`kernels/ops.cu`).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Layout, Shape, Tensor};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ops.ptx"));

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
        let func = dev.get_or_load_custom_func(name, "layertap_ops", PTX)?;
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
