//! The attention block's fused q/k/v split, per-head norms and rotary embedding for CUDA
//! (`qkv_rope` in `kernels/ops.cu`).

use super::module::kernel;
use super::ops::OPS;
use super::{contiguous_view, cpu_fwd_cuda_only, cuda_view, kernel_name, KernelType};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Shape, Tensor};

/// The attention block's q/k/v split, with the per-head q/k RMSNorm where the model has one and
/// the rotary embedding, in one pass (`qkv_rope` in `kernels/ops.cu`) instead of a copy per part,
/// a norm per part and a rotary pass per part (two more with partial rotary). Computed in f32
/// and rounded once.
pub struct QkvRope {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    /// `q_proj` holds, per head, the query then its output gate.
    pub gated: bool,
    /// The q and k norms' weights in f32 (`w`, or `1 + w` for zero-centred norms) and epsilon.
    pub norms: Option<(Tensor, Tensor, f32)>,
}

impl QkvRope {
    /// Whether the kernel serves this shape: 16-bit, head dim 64, 128 or 256, rotary dims a
    /// multiple of 64 whose rotary partners are a power-of-two number of lanes apart
    /// (`rotary_dim / 2 / (head_dim / 32)`; all but 192 of 256). `EngineOptions::fused_rope`
    /// can still turn it off (for comparison).
    pub fn supported(device: &candle_core::Device, dtype: DType, head_dim: usize, rotary_dim: usize) -> bool {
        device.is_cuda()
            && matches!(dtype, DType::BF16 | DType::F16)
            && matches!(head_dim, 64 | 128 | 256)
            && rotary_dim > 0
            && rotary_dim.is_multiple_of(64)
            && rotary_dim <= head_dim
            && (rotary_dim / 2 / (head_dim / 32)).is_power_of_two()
    }

    /// `qkv`: the fused projection `[T, W]`; `pos`: each token's position in its sequence `[T]`
    /// (u32); `inv_freq`: the rotary inverse frequencies `[rotary_dim / 2]` (f32). Returns q
    /// `[T, heads, head_dim]`, k and v `[T, kv_heads, head_dim]` and, if gated, the gate
    /// `[T, heads * head_dim]`, all contiguous.
    pub fn forward(
        &self,
        qkv: &Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
        let t = qkv.dim(0)?;
        let (nq, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let op = QkvRopeOp {
            nq,
            nkv,
            hd,
            rot: self.rotary_dim,
            gated: self.gated,
            norms: self.norms.clone(),
            pos: pos.clone(),
            inv_freq: inv_freq.clone(),
        };
        let flat = qkv.contiguous()?.apply_op1_no_bwd(&op)?;
        let part = |at: usize, heads: usize| flat.narrow(0, at * t * hd, heads * t * hd);
        let q = part(0, nq)?.reshape((t, nq, hd))?;
        let k = part(nq, nkv)?.reshape((t, nkv, hd))?;
        let v = part(nq + nkv, nkv)?.reshape((t, nkv, hd))?;
        let gate = if self.gated { Some(part(nq + 2 * nkv, nq)?.reshape((t, nq * hd))?) } else { None };
        Ok((q, k, v, gate))
    }
}

struct QkvRopeOp {
    nq: usize,
    nkv: usize,
    hd: usize,
    rot: usize,
    gated: bool,
    norms: Option<(Tensor, Tensor, f32)>,
    pos: Tensor,
    inv_freq: Tensor,
}

impl QkvRopeOp {
    fn launch<T: KernelType>(
        &self,
        dev: &CudaDevice,
        qkv: &CudaSlice<T>,
        l: &Layout,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (t, w) = l.shape().dims2()?;
        let (nq, nkv, hd) = (self.nq, self.nkv, self.hd);
        let q_width = if self.gated { 2 * nq * hd } else { nq * hd };
        if w != q_width + 2 * nkv * hd || self.pos.dims() != [t] || self.inv_freq.dims() != [self.rot / 2] {
            candle_core::bail!(
                "qkv_rope: qkv {:?}, positions {:?}, frequencies {:?} do not fit {nq}/{nkv} heads of {hd}",
                l.shape(),
                self.pos.dims(),
                self.inv_freq.dims()
            );
        }
        if !l.start_offset().is_multiple_of(8) {
            candle_core::bail!("qkv_rope: qkv must start 16-byte aligned (offset {})", l.start_offset());
        }
        let src = contiguous_view(qkv, l, "qkv_rope: qkv")?;
        let (ps, pl) = self.pos.storage_and_layout();
        let pos = cuda_view::<u32>(&ps, pl, "qkv_rope: the positions")?;
        let (fs, fl) = self.inv_freq.storage_and_layout();
        let freq = cuda_view::<f32>(&fs, fl, "qkv_rope: the frequencies")?;
        let norms = match &self.norms {
            Some((qn, kn, eps)) => {
                if qn.dims() != [hd] || kn.dims() != [hd] {
                    candle_core::bail!("qkv_rope: norm weights {:?} / {:?}, want [{hd}]", qn.dims(), kn.dims());
                }
                Some((qn.storage_and_layout(), kn.storage_and_layout(), *eps))
            }
            None => None,
        };
        let parts = nq + 2 * nkv + if self.gated { nq } else { 0 };
        // SAFETY: the kernel writes every element: each token's block covers all its head rows
        // (and the gate rows with them).
        let out = unsafe { dev.alloc::<T>(t * parts * hd)? };
        let func = kernel(dev, OPS, &format!("{}_d{hd}", kernel_name::<T>("qkv_rope")))?;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&pos);
        b.arg(&freq);
        // Without norms the kernel reads no weight: the frequencies stand in for the pointers.
        let (qv, kv, eps, norm);
        match &norms {
            Some(((qs, ql), (ks, kl), e)) => {
                qv = cuda_view::<f32>(qs, ql, "qkv_rope: the q norm")?;
                kv = cuda_view::<f32>(ks, kl, "qkv_rope: the k norm")?;
                eps = *e;
                norm = 1i32;
            }
            None => {
                qv = cuda_view::<f32>(&fs, fl, "qkv_rope: the frequencies")?;
                kv = cuda_view::<f32>(&fs, fl, "qkv_rope: the frequencies")?;
                eps = 0.0f32;
                norm = 0i32;
            }
        }
        b.arg(&qv);
        b.arg(&kv);
        b.arg(&norm);
        b.arg(&out);
        let (tokens, nq_i, nkv_i, rot, gated) = (t as i32, nq as i32, nkv as i32, self.rot as i32, self.gated as i32);
        b.arg(&tokens);
        b.arg(&nq_i);
        b.arg(&nkv_i);
        b.arg(&rot);
        b.arg(&gated);
        b.arg(&eps);
        let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        if t > 0 {
            // SAFETY: argument types and order match the kernel; every index it forms is inside
            // `qkv` (t rows of w), the t positions, rot / 2 frequencies, hd norm weights and `out`.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }
}

impl candle_core::CustomOp1 for QkvRopeOp {
    fn name(&self) -> &'static str {
        "qkv-rope"
    }

    cpu_fwd_cuda_only!(1);

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let slice = match &s.slice {
            CudaStorageSlice::BF16(x) => CudaStorageSlice::BF16(self.launch(dev, x, l)?),
            CudaStorageSlice::F16(x) => CudaStorageSlice::F16(self.launch(dev, x, l)?),
            _ => candle_core::bail!("qkv_rope: unsupported dtype {:?}", s.dtype()),
        };
        let t = l.shape().dims2()?.0;
        let parts = self.nq + 2 * self.nkv + if self.gated { self.nq } else { 0 };
        Ok((CudaStorage { slice, device: dev.clone() }, Shape::from(t * parts * self.hd)))
    }
}
