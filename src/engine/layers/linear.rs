//! Dense projections (float, or block-wise FP8 with dynamically quantised inputs), the matmul
//! every layer uses, and the residual add.

use candle_core::{DType, Tensor};

use crate::engine::weights::Weights;
use crate::engine::EngineError;

pub struct Linear {
    pub(crate) weight_t: Tensor,
    bias: Option<Tensor>,
    /// An FP8 projection (W8A8 dynamic): `weight_t` is its dequantised weight in f32, and each
    /// input row is quantised to e4m3 per group of 128 and dequantised before the product
    /// ([`super::fp8`]).
    fp8: bool,
}

impl Linear {
    /// `{name}.weight` `[out, inp]` (and `{name}.bias`): float weights, or an FP8 projection
    /// where the checkpoint stores one.
    pub fn load(w: &Weights, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self, EngineError> {
        let (weight, shape) = (format!("{name}.weight"), [out, inp]);
        let bias = w.get_opt(&format!("{name}.bias"), &[out], bias)?;
        if let Some(weight_t) = w.get_fp8_transposed(&weight, &shape)? {
            return Ok(Linear { weight_t, bias, fp8: true });
        }
        match w.get_transposed_f32(&weight, &shape)? {
            Some(weight_t) => Ok(Linear { weight_t, bias, fp8: false }),
            None => Ok(Self::from_weight(w.get(&weight, &shape)?, bias)?),
        }
    }

    /// From an `[out, in]` weight, stored transposed once so every forward is a plain
    /// `[T, in] x [in, out]` matmul.
    pub fn from_weight(weight: Tensor, bias: Option<Tensor>) -> candle_core::Result<Self> {
        let weight_t = match super::cpu_ops::transposed(&weight)? {
            Some(t) => t,
            None => weight.t()?.contiguous()?,
        };
        Ok(Linear { weight_t, bias, fp8: false })
    }

    /// Whether `parts` can be computed as one matmul: all FP8 or all float.
    pub fn fusable(parts: &[Linear]) -> bool {
        parts.windows(2).all(|w| w[0].fp8 == w[1].fp8)
    }

    /// Whether this is an FP8 projection (its input quantised before the product).
    pub fn is_fp8(&self) -> bool {
        self.fp8
    }

    /// Output features.
    pub fn out_dim(&self) -> candle_core::Result<usize> {
        self.weight_t.dim(1)
    }

    /// One projection computing all of `parts` side by side (their outputs concatenated), so a
    /// single larger matmul replaces several.
    pub fn fuse(parts: Vec<Linear>) -> Result<Self, EngineError> {
        if !Self::fusable(&parts) {
            return Err(EngineError::Load("cannot fuse FP8 and float projections into one".into()));
        }
        let fp8 = parts.first().is_some_and(|p| p.fp8);
        let weights: Vec<&Tensor> = parts.iter().map(|p| &p.weight_t).collect();
        let weight_t = Tensor::cat(&weights, 1)?;
        let bias = if parts.iter().any(|p| p.bias.is_some()) {
            let b = parts
                .iter()
                .map(|p| match &p.bias {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros(p.weight_t.dim(1)?, p.weight_t.dtype(), p.weight_t.device()),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&b, 0)?)
        } else {
            None
        };
        Ok(Linear { weight_t, bias, fp8 })
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = if self.fp8 {
            let y = matmul(&super::fp8::quantise_activations(x)?, &self.weight_t)?;
            if y.dtype() == x.dtype() {
                y
            } else {
                y.to_dtype(x.dtype())?
            }
        } else {
            matmul(x, &self.weight_t)?
        };
        match &self.bias {
            Some(b) => crate::engine::large::map_rows(&y, |y| y.broadcast_add(b)),
            None => Ok(y),
        }
    }
}

/// Several projections of the same input: kept separate on the CPU (the reference's layout,
/// bit for bit) and fused into one matmul on CUDA; `forward` returns each part's output.
pub enum Projections {
    Separate(Vec<Linear>),
    Fused { linear: Linear, widths: Vec<usize> },
}

impl Projections {
    pub fn new(parts: Vec<Linear>, fuse: bool) -> Result<Self, EngineError> {
        if !fuse || parts.len() < 2 || !Linear::fusable(&parts) {
            return Ok(Projections::Separate(parts));
        }
        let widths = parts.iter().map(Linear::out_dim).collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Projections::Fused { linear: Linear::fuse(parts)?, widths })
    }

    /// The fused projections' output `[T, sum of widths]` unsplit, or None where they are separate.
    pub fn joined(&self, x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        match self {
            Projections::Separate(_) => Ok(None),
            Projections::Fused { linear, .. } => linear.forward(x).map(Some),
        }
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Projections::Fused { linear, widths } => {
                let y = linear.forward(x)?;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = split_part(&y, at, w);
                        at += w;
                        part
                    })
                    .collect()
            }
        }
    }
}

/// Columns `at..at + w` of the fused output `y` `[T, W]`, contiguous. Candle's copy indexes the
/// source in 32 bits, which wraps once `T * W` passes 2^32 (the Gated DeltaNet's four
/// projections of a 27B hybrid at 262,144 tokens); on CUDA past 2^31, a kernel of ours copies.
fn split_part(y: &Tensor, at: usize, w: usize) -> candle_core::Result<Tensor> {
    let part = y.narrow(1, at, w)?;
    #[cfg(feature = "cuda")]
    if y.device().is_cuda() && y.elem_count() > crate::engine::large::MAX_ELEMS {
        return crate::engine::cuda::ops::copy_rows(&part, None);
    }
    part.contiguous()
}

/// `x + y` for the residual stream: same dtypes, or an f32 stream plus a 16-bit sublayer output.
pub fn residual(x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.dtype() == DType::F32 && y.dtype() != DType::F32 {
        return crate::engine::cuda::ops::add_f32(x, y);
    }
    if x.rank() > 0 && x.dims() == y.dims() {
        let extent = crate::engine::large::row_extent(x).max(crate::engine::large::row_extent(y));
        let sum = |r0, n| x.narrow(0, r0, n)? + y.narrow(0, r0, n)?;
        if let Some(s) = crate::engine::large::by_rows(x.device(), x.dim(0)?, extent, sum)? {
            return Ok(s);
        }
    }
    x + y
}

/// `a @ b`; bf16 on the CPU (which candle's CPU matmul lacks) accumulates in f32, as PyTorch does.
pub fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if a.device().is_cpu() && a.rank() == 2 && a.dim(0)? == 1 {
        // The CPU matmul sums a one-row product in another order than its general kernel: the row
        // is computed as one of two, so a batch of one token gets the bits any larger batch gives it.
        return matmul(&Tensor::cat(&[a, a], 0)?, b)?.narrow(0, 0, 1);
    }
    if a.dtype() == DType::BF16 && a.device().is_cpu() {
        a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?.to_dtype(DType::BF16)
    } else {
        a.matmul(b)
    }
}
