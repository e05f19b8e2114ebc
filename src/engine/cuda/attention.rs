//! Attention over packed sequences on CUDA: one kernel launch per layer (`kernels/attention.cu`),
//! scores kept on chip, each sequence attending only to itself. Used for bf16 and f16 with head
//! dimensions 64, 128 and 256; other cases take the portable path in `attention.rs`.

use super::module::{fatbin, kernel, Module};
use super::{contiguous_view, cpu_fwd_cuda_only, cuda_view, kernel_name, KernelType};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Device, Layout, Shape, Tensor};

/// `kernels/attention.cu`.
const ATTENTION: Module = fatbin!("attention");

pub use crate::engine::options::AttentionKernel;

/// How each variant launches (`kernels/attention.cu`).
impl AttentionKernel {
    /// Query rows per block (`BM` in the kernel).
    pub fn rows(self) -> usize {
        match self {
            AttentionKernel::Simple | AttentionKernel::Pipelined4 => 64,
            AttentionKernel::Pipelined8 | AttentionKernel::Wide => 128,
        }
    }

    /// Threads per block for head dimension `d`.
    fn threads(self, d: usize) -> u32 {
        match self {
            AttentionKernel::Wide if d != 256 => 128,
            _ => 2 * self.rows() as u32,
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            AttentionKernel::Simple => "packed_attention",
            AttentionKernel::Pipelined4 => "pipelined_attention_w4",
            AttentionKernel::Pipelined8 => "pipelined_attention_w8",
            AttentionKernel::Wide => "wide_attention",
        }
    }

    /// Dynamic shared memory per block for head dimension `d` (16-bit elements): two stages of a
    /// K and a V tile of `keys(d)` rows of `d + 8`, and for the wide kernel the Q tile before
    /// them; the first kernel's is static.
    fn shared_bytes(self, d: usize) -> usize {
        match self {
            AttentionKernel::Simple => 0,
            AttentionKernel::Pipelined4 | AttentionKernel::Pipelined8 => 2 * 2 * keys(d) * (d + 8) * 2,
            AttentionKernel::Wide => (self.rows() + 2 * 2 * keys(d)) * (d + 8) * 2,
        }
    }
}

/// Keys per tile (`BN` in the kernel).
fn keys(d: usize) -> usize {
    if d == 256 {
        32
    } else {
        64
    }
}

/// The kernel's work list for one batch and variant.
pub struct Tiles {
    list: Tensor,
    n: usize,
    variant: AttentionKernel,
}

/// Whether the kernel covers this case (`EngineOptions::cuda_attention` can still turn it off).
pub fn supported(device: &Device, dtype: DType, head_dim: usize) -> bool {
    device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128 | 256)
}

/// The work list for a batch: one `(sequence start, sequence length, tile index)` triple per
/// tile of `variant.rows()` queries, the tiles with the most keys first so long sequences do not
/// finish last.
pub fn tiles_for(seqs: &[(usize, usize)], device: &Device, variant: AttentionKernel) -> candle_core::Result<Tiles> {
    let mut list: Vec<[u32; 3]> = Vec::new();
    for &(start, len) in seqs {
        for i in 0..len.div_ceil(variant.rows()) {
            list.push([start as u32, len as u32, i as u32]);
        }
    }
    list.sort_by_key(|t| std::cmp::Reverse(t[2]));
    let n = list.len();
    let flat: Vec<u32> = list.into_iter().flatten().collect();
    Ok(Tiles { list: Tensor::new(flat.as_slice(), device)?, n, variant })
}

/// `q`: `[T, heads, d]`, `k`, `v`: `[T, kv_heads, d]`, contiguous; `tiles` from [`tiles`].
/// `sinks`: one f32 logit per query head on q's device, joining every row's softmax and dropped
/// after it (gpt-oss). Returns `[T, heads, d]`.
pub fn packed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    tiles: &Tiles,
    scale: f64,
    window: Option<usize>,
    sinks: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    if let Some(s) = sinks {
        if s.dtype() != DType::F32 || s.dims() != [q.dim(1)?] || !s.device().same_device(q.device()) {
            candle_core::bail!(
                "packed attention: sinks {:?} {:?} for {} heads (one f32 per head on q's device)",
                s.dtype(),
                s.dims(),
                q.dim(1)?
            );
        }
    }
    let op = PackedAttention {
        tiles: tiles.list.clone(),
        n_tiles: tiles.n,
        variant: tiles.variant,
        scale: scale as f32,
        window,
        sinks: sinks.map(Tensor::contiguous).transpose()?,
    };
    q.contiguous()?.apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)
}

struct PackedAttention {
    tiles: Tensor,
    n_tiles: usize,
    variant: AttentionKernel,
    scale: f32,
    window: Option<usize>,
    sinks: Option<Tensor>,
}

impl PackedAttention {
    fn launch<T: KernelType>(
        &self,
        dev: &CudaDevice,
        q: (&CudaSlice<T>, &Layout),
        k: (&CudaSlice<T>, &Layout),
        v: (&CudaSlice<T>, &Layout),
        tiles: &CudaView<'_, u32>,
    ) -> candle_core::Result<CudaSlice<T>> {
        let (t, heads, d) = q.1.shape().dims3()?;
        let (tk, kv_heads, dk) = k.1.shape().dims3()?;
        if tk != t || dk != d || v.1.shape() != k.1.shape() || kv_heads == 0 || heads % kv_heads != 0 {
            candle_core::bail!(
                "packed attention: q {:?}, k {:?}, v {:?} do not fit",
                q.1.shape(),
                k.1.shape(),
                v.1.shape()
            );
        }
        if [q.1, k.1, v.1].iter().any(|l| l.start_offset() % 8 != 0) {
            candle_core::bail!("packed attention: q, k and v must start 16-byte aligned");
        }
        let qv = contiguous_view(q.0, q.1, "packed attention: q")?;
        let kv = contiguous_view(k.0, k.1, "packed attention: k")?;
        let vv = contiguous_view(v.0, v.1, "packed attention: v")?;
        let func = kernel(dev, ATTENTION, &format!("{}_d{d}", kernel_name::<T>(self.variant.prefix())))?;
        let shared = self.variant.shared_bytes(d);
        if shared > 0 {
            func.max_dynamic_shared(shared)?;
        }
        // SAFETY: every row of every sequence is written by the kernel (each token belongs to a
        // sequence and each sequence's tiles cover all of its rows for every head).
        let out = unsafe { dev.alloc::<T>(t * heads * d)? };
        let mut b = func.builder();
        b.arg(&qv);
        b.arg(&kv);
        b.arg(&vv);
        b.arg(&out);
        b.arg(tiles);
        let (h, kvh) = (heads as i32, kv_heads as i32);
        let scale_log2 = self.scale * std::f32::consts::LOG2_E;
        let window = self.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
        b.arg(&h);
        b.arg(&kvh);
        b.arg(&scale_log2);
        b.arg(&window);
        let sinks_storage = self.sinks.as_ref().map(Tensor::storage_and_layout);
        let sinks = match &sinks_storage {
            Some((storage, layout)) => Some(cuda_view::<f32>(storage, layout, "packed attention: the sinks")?),
            None => None,
        };
        let no_sinks: u64 = 0; // a null pointer: no sink in any row
        match &sinks {
            Some(view) => b.arg(view),
            None => b.arg(&no_sinks),
        };
        let cfg = LaunchConfig {
            grid_dim: (self.n_tiles as u32, heads as u32, 1),
            block_dim: (self.variant.threads(d), 1, 1),
            shared_mem_bytes: shared as u32,
        };
        if self.n_tiles > 0 {
            // SAFETY: argument types and order match the kernel's signature; the tile list was
            // built from this batch's packing, so every index the kernel forms is inside q/k/v/out.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(out)
    }
}

impl candle_core::CustomOp3 for PackedAttention {
    fn name(&self) -> &'static str {
        "packed-attention"
    }

    cpu_fwd_cuda_only!(3);

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let dev = q.device();
        let (tiles_storage, tiles_layout) = self.tiles.storage_and_layout();
        let tiles = cuda_view::<u32>(&tiles_storage, tiles_layout, "packed attention: the tile list")?;
        let slice = match (&q.slice, &k.slice, &v.slice) {
            (CudaStorageSlice::BF16(qs), CudaStorageSlice::BF16(ks), CudaStorageSlice::BF16(vs)) => {
                CudaStorageSlice::BF16(self.launch(dev, (qs, ql), (ks, kl), (vs, vl), &tiles)?)
            }
            (CudaStorageSlice::F16(qs), CudaStorageSlice::F16(ks), CudaStorageSlice::F16(vs)) => {
                CudaStorageSlice::F16(self.launch(dev, (qs, ql), (ks, kl), (vs, vl), &tiles)?)
            }
            _ => candle_core::bail!("packed attention: q, k, v must all be bf16 or all f16, got {:?}", q.dtype()),
        };
        Ok((CudaStorage { slice, device: dev.clone() }, ql.shape().clone()))
    }
}
