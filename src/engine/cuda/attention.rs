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

/// The kernel's variants (`kernels/attention.cu`). They give bitwise the same output: each query
/// row meets the same key tiles in the same order; they differ in how the tiles reach the
/// tensor cores and in how many query rows a block holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    /// The first kernel: 64 query rows per block, K/V tiles loaded through registers.
    Simple,
    /// K/V tiles streamed by cp.async in two stages and read by ldmatrix; 4 warps, 64 rows.
    Pipelined4,
    /// The same with 8 warps, 128 rows: each K/V tile serves twice as many queries.
    Pipelined8,
    /// 128 rows, each warp holding 32 of them (two groups of 16 sharing every K/V fragment it
    /// reads), Q staged in shared memory; for head dim 256, 8 warps of 16 rows.
    Wide,
}

impl Variant {
    pub const ALL: [Variant; 4] = [Variant::Simple, Variant::Pipelined4, Variant::Pipelined8, Variant::Wide];

    /// `LAYERTAP_ATTENTION_KERNEL=simple|w4|w8|wide` picks one (for comparing them); otherwise
    /// [`Variant::default_for`] the head dimension.
    pub fn chosen(head_dim: usize) -> Variant {
        static CHOSEN: std::sync::OnceLock<Option<Variant>> = std::sync::OnceLock::new();
        let picked = *CHOSEN.get_or_init(|| match std::env::var("LAYERTAP_ATTENTION_KERNEL").as_deref() {
            Ok("simple") => Some(Variant::Simple),
            Ok("w4") => Some(Variant::Pipelined4),
            Ok("w8") => Some(Variant::Pipelined8),
            Ok("wide") => Some(Variant::Wide),
            _ => None,
        });
        picked.unwrap_or(Variant::default_for(head_dim))
    }

    /// The wide kernel for head dims 64 and 128 (measured on the dense 8B shape: +4 % end to end
    /// over the 4-warp pipelined kernel); the 4-warp pipelined kernel for 256 (Qwen3.5/3.6's
    /// full-attention layers), where the wide one has 8 warps of 16 rows and was not measured.
    pub fn default_for(head_dim: usize) -> Variant {
        if head_dim == 256 {
            Variant::Pipelined4
        } else {
            Variant::Wide
        }
    }

    /// Query rows per block (`BM` in the kernel).
    pub fn rows(self) -> usize {
        match self {
            Variant::Simple | Variant::Pipelined4 => 64,
            Variant::Pipelined8 | Variant::Wide => 128,
        }
    }

    /// Threads per block for head dimension `d`.
    fn threads(self, d: usize) -> u32 {
        match self {
            Variant::Wide if d != 256 => 128,
            _ => 2 * self.rows() as u32,
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Variant::Simple => "packed_attention",
            Variant::Pipelined4 => "pipelined_attention_w4",
            Variant::Pipelined8 => "pipelined_attention_w8",
            Variant::Wide => "wide_attention",
        }
    }

    /// Dynamic shared memory per block for head dimension `d` (16-bit elements): two stages of a
    /// K and a V tile of `keys(d)` rows of `d + 8`, and for the wide kernel the Q tile before
    /// them; the first kernel's is static.
    fn shared_bytes(self, d: usize) -> usize {
        match self {
            Variant::Simple => 0,
            Variant::Pipelined4 | Variant::Pipelined8 => 2 * 2 * keys(d) * (d + 8) * 2,
            Variant::Wide => (self.rows() + 2 * 2 * keys(d)) * (d + 8) * 2,
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
    variant: Variant,
}

/// Whether the kernel covers this case. `LAYERTAP_CUDA_ATTENTION=0` turns it off (the portable
/// path then runs on the GPU too), for comparing the two.
pub fn supported(device: &Device, dtype: DType, head_dim: usize) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("LAYERTAP_CUDA_ATTENTION").is_ok_and(|v| v == "0"));
    !off && device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16) && matches!(head_dim, 64 | 128 | 256)
}

/// The work list for a batch, for the variant chosen for this head dimension ([`Variant::chosen`]).
pub fn tiles(seqs: &[(usize, usize)], device: &Device, head_dim: usize) -> candle_core::Result<Tiles> {
    tiles_for(seqs, device, Variant::chosen(head_dim))
}

/// The work list for a batch: one `(sequence start, sequence length, tile index)` triple per
/// tile of `variant.rows()` queries, the tiles with the most keys first so long sequences do not
/// finish last.
pub fn tiles_for(seqs: &[(usize, usize)], device: &Device, variant: Variant) -> candle_core::Result<Tiles> {
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
/// Returns `[T, heads, d]`.
pub fn packed_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    tiles: &Tiles,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    let op = PackedAttention {
        tiles: tiles.list.clone(),
        n_tiles: tiles.n,
        variant: tiles.variant,
        scale: scale as f32,
        window,
    };
    q.contiguous()?.apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)
}

struct PackedAttention {
    tiles: Tensor,
    n_tiles: usize,
    variant: Variant,
    scale: f32,
    window: Option<usize>,
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
