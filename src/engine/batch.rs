//! What every layer of one forward pass shares about the packed batch, built once per batch:
//! where each sequence sits, the rotary tables, the attention masks (or the CUDA kernel's tile
//! list) and, for linear-attention layers, the conv shifts and the chunk plan of the delta rule.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

pub use super::config::GDN_CHUNK;
use super::config::{MixerKind, ModelConfig};
use super::layers::rope::Rope;
use super::layers::sdpa::{chunk_masks, QUERY_CHUNK};
use super::options::AttentionKernel;
use super::profile::Profiler;

/// The kernels a decoder chose when it was loaded that its batches prepare for (CUDA; never
/// set elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchKernels {
    /// The attention kernel's variant, where the kernel serves the model's attention layers:
    /// each batch then gets its tile list instead of masks.
    pub attention: Option<AttentionKernel>,
    /// Whether the attention layers split q/k/v and rotate q and k in one kernel: each batch
    /// then gets the positions and frequencies instead of the rotary tables.
    pub fused_rope: bool,
}

pub struct BatchCtx {
    /// `(start, len)` of each sequence in the token dimension.
    pub seqs: Vec<(usize, usize)>,
    /// Attention masks per distinct sequence length and attention window, shared by every layer
    /// of that window.
    pub masks: HashMap<(usize, Option<usize>), Vec<Tensor>>,
    /// The CUDA kernel's tile list, where the kernel serves this model (then `masks` is empty).
    #[cfg(feature = "cuda")]
    pub tiles: Option<super::cuda::attention::Tiles>,
    /// The rotary tables `(cos, sin)`, `[T, rotary_dim / 2]`, where the fused CUDA kernel does
    /// not serve the model's attention.
    pub tables: Option<(Tensor, Tensor)>,
    /// The full-attention layers' own rotary tables, where the config shapes them apart
    /// (`[T, head_dim / 2]` of those layers).
    pub full_tables: Option<(Tensor, Tensor)>,
    /// For the fused CUDA kernel (`cuda::rope::QkvRope`), which computes the rotation itself: each
    /// token's position `[T]` (u32) and the inverse frequencies `[rotary_dim / 2]` (f32).
    #[cfg(feature = "cuda")]
    pub rope_inputs: Option<(Tensor, Tensor)>,
    /// Present when the model has linear-attention layers.
    pub gdn: Option<GdnPlan>,
    /// The forward pass's phase clock (off unless `EngineOptions::profile`).
    pub profile: Profiler,
}

/// Index tensors that let the Gated DeltaNet work on the whole packed batch at once while no
/// conv window, chunk or recurrent state ever crosses a sequence boundary.
pub struct GdnPlan {
    /// `shifts[s - 1]`: for each token, the row `s` positions earlier in its own sequence, or
    /// the zero row `T` (appended by the caller) before the sequence starts. `s` in `1..kernel`.
    pub shifts: Vec<Tensor>,
    /// For each slot of the chunk layout (`chunks * 64` rows), the token it holds, or the zero
    /// row `T` for the padding after a sequence's last token.
    pub gather: Tensor,
    /// For each token, its slot in the chunk layout.
    pub scatter: Tensor,
    /// The recurrent scan, step `j`: chunks `offset..offset + active` hold chunk `j` of the
    /// `active` longest sequences (sequences sorted by chunk count, longest first, so the
    /// sequences still running at a step are always a prefix).
    pub steps: Vec<(usize, usize)>,
    pub chunks: usize,
    /// `[1, 64, 64]` 0/1 masks of a chunk: `j <= i` (the decays) and `j < i` (the UT system).
    pub lower: Tensor,
    pub strict: Tensor,
    /// The CUDA kernels' tables, on a CUDA device.
    #[cfg(feature = "cuda")]
    pub cuda: Option<super::cuda::gdn::Tables>,
}

impl GdnPlan {
    pub fn new(seqs: &[(usize, usize)], kernel: usize, device: &Device) -> candle_core::Result<Self> {
        let total: usize = seqs.iter().map(|s| s.1).sum();
        let zero = total as u32;
        let shifts = (1..kernel)
            .map(|s| {
                let idx: Vec<u32> = seqs
                    .iter()
                    .flat_map(|&(start, len)| (0..len).map(move |p| if p >= s { (start + p - s) as u32 } else { zero }))
                    .collect();
                Tensor::new(idx.as_slice(), device)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(seqs[i].1.div_ceil(GDN_CHUNK)));
        let max_chunks = seqs.iter().map(|s| s.1.div_ceil(GDN_CHUNK)).max().unwrap_or(0);
        let mut gather = Vec::new();
        let mut scatter = vec![0u32; total];
        let mut steps = Vec::with_capacity(max_chunks);
        let mut chunk = 0;
        for j in 0..max_chunks {
            let offset = chunk;
            for &i in order.iter().take_while(|&&i| seqs[i].1.div_ceil(GDN_CHUNK) > j) {
                let (start, len) = seqs[i];
                for r in 0..GDN_CHUNK {
                    let p = j * GDN_CHUNK + r;
                    if p < len {
                        scatter[start + p] = (chunk * GDN_CHUNK + r) as u32;
                        gather.push((start + p) as u32);
                    } else {
                        gather.push(zero);
                    }
                }
                chunk += 1;
            }
            steps.push((offset, chunk - offset));
        }
        let n = GDN_CHUNK;
        let mask = |keep: fn(usize, usize) -> bool| -> Vec<f32> {
            (0..n * n).map(|x| if keep(x / n, x % n) { 1.0 } else { 0.0 }).collect()
        };
        Ok(GdnPlan {
            lower: Tensor::from_vec(mask(|i, j| j <= i), (1, n, n), device)?,
            strict: Tensor::from_vec(mask(|i, j| j < i), (1, n, n), device)?,
            shifts,
            gather: Tensor::new(gather.as_slice(), device)?,
            scatter: Tensor::new(scatter.as_slice(), device)?,
            steps,
            chunks: chunk,
            #[cfg(feature = "cuda")]
            cuda: if device.is_cuda() { Some(super::cuda::gdn::Tables::new(seqs, device)?) } else { None },
        })
    }
}

impl BatchCtx {
    pub fn new(
        cfg: &ModelConfig,
        (rope, full_rope): (&Rope, Option<&Rope>),
        cu_seqlens: &[usize],
        dtype: DType,
        device: &Device,
        kernels: BatchKernels,
        profile: bool,
    ) -> candle_core::Result<Self> {
        let seqs: Vec<(usize, usize)> = cu_seqlens.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
        let positions: Vec<u32> = seqs.iter().flat_map(|&(_, len)| 0..len as u32).collect();
        let has = |m: MixerKind| cfg.layers.iter().any(|l| l.mixer == m);
        #[cfg(not(feature = "cuda"))]
        let _ = kernels;
        #[cfg(feature = "cuda")]
        let rope_inputs = if kernels.fused_rope {
            Some((Tensor::new(positions.as_slice(), device)?, Tensor::new(rope.inv_freq(), device)?))
        } else {
            None
        };
        #[cfg(feature = "cuda")]
        let tables = if rope_inputs.is_none() { Some(rope.tables(&positions, dtype, device)?) } else { None };
        #[cfg(not(feature = "cuda"))]
        let tables = Some(rope.tables(&positions, dtype, device)?);
        let full_tables = match full_rope.filter(|_| has(MixerKind::FullAttention)) {
            Some(r) => Some(r.tables(&positions, dtype, device)?),
            None => None,
        };
        let mut masks = HashMap::new();
        #[cfg(feature = "cuda")]
        let tiles = match kernels.attention {
            Some(variant) => Some(super::cuda::attention::tiles_for(&seqs, device, variant)?),
            None => None,
        };
        // The fused CPU kernel (f32 on the CPU) needs no masks either.
        let fused_cpu = device.is_cpu() && dtype == DType::F32;
        #[cfg(feature = "cuda")]
        let need_masks = tiles.is_none() && !fused_cpu;
        #[cfg(not(feature = "cuda"))]
        let need_masks = !fused_cpu;
        // The windows of the model's attention layers (None: full attention).
        let mut windows: Vec<Option<usize>> =
            cfg.layers.iter().filter(|l| l.mixer.is_attention()).map(|l| cfg.window_of(l)).collect();
        windows.sort_unstable();
        windows.dedup();
        for &(_, len) in seqs.iter().filter(|_| need_masks) {
            for &window in &windows {
                if let std::collections::hash_map::Entry::Vacant(e) = masks.entry((len, window)) {
                    e.insert(chunk_masks(len, window, QUERY_CHUNK, device)?);
                }
            }
        }
        let gdn = match &cfg.linear_attention {
            Some(la) if has(MixerKind::LinearAttention) => Some(GdnPlan::new(&seqs, la.conv_kernel, device)?),
            _ => None,
        };
        Ok(BatchCtx {
            seqs,
            masks,
            #[cfg(feature = "cuda")]
            tiles,
            tables,
            full_tables,
            #[cfg(feature = "cuda")]
            rope_inputs,
            gdn,
            profile: Profiler::new(device, profile),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every token lands in exactly one slot of its own sequence's chunks, in order, and the
    /// scan steps list chunk j of every sequence that has one.
    #[test]
    fn the_chunk_plan_keeps_sequences_apart() -> candle_core::Result<()> {
        let seqs = [(0, 3), (3, 130), (133, 64), (197, 65)];
        let plan = GdnPlan::new(&seqs, 4, &Device::Cpu)?;
        let gather = plan.gather.to_vec1::<u32>()?;
        let scatter = plan.scatter.to_vec1::<u32>()?;
        assert_eq!(plan.chunks, 1 + 3 + 1 + 2);
        assert_eq!(gather.len(), plan.chunks * GDN_CHUNK);
        for (t, &slot) in scatter.iter().enumerate() {
            assert_eq!(gather[slot as usize] as usize, t, "token {t}");
        }
        // Sorted by chunk count: 130 (3 chunks), 65 (2), then 3 and 64 (1 each).
        assert_eq!(plan.steps, vec![(0, 4), (4, 2), (6, 1)]);
        // A token's shifted rows stay inside its sequence: position 0 reads the zero row.
        let back1 = plan.shifts[0].to_vec1::<u32>()?;
        assert_eq!(back1[3], 262, "the first token of a sequence reads zeros");
        assert_eq!(back1[4], 3);
        let back3 = plan.shifts[2].to_vec1::<u32>()?;
        assert_eq!(&back3[0..3], &[262, 262, 262]);
        assert_eq!(back3[6], 3);
        Ok(())
    }
}
