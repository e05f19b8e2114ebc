//! Dense projections (float, or block-wise FP8 with dynamically quantised inputs), the matmul
//! every layer uses, and the residual add.

use candle_core::{DType, Tensor};

use crate::engine::weights::Weights;
use crate::engine::EngineError;

/// How an FP8 projection multiplied by the FP8 tensor cores is described (`/v1/info`, the log).
pub const FP8_TENSOR_CORES: &str = "on the FP8 tensor cores (e4m3 weights, cuBLASLt block-scaled GEMMs)";

pub struct Linear {
    kind: Kind,
    bias: Option<Tensor>,
}

/// How a projection's weight is held and multiplied.
#[derive(Clone)]
enum Kind {
    /// A float weight, transposed once (`[in, out]`), so every forward is a plain matmul.
    Float(Tensor),
    /// An FP8 projection (W8A8 dynamic) held dequantised (`[in, out]`: f32 on the CPU, the
    /// compute dtype on a GPU without FP8 GEMMs); each input row is quantised to e4m3 per group
    /// of 128 and dequantised before the product ([`super::fp8`]).
    Fp8Dequantised(Tensor),
    /// An FP8 projection kept in e4m3 on the GPU and multiplied by the FP8 tensor cores
    /// (`cuda::fp8`).
    #[cfg(feature = "cuda")]
    Fp8(crate::engine::cuda::fp8::Fp8Weight),
    /// An MXFP4 projection (gpt-oss's experts) kept 4-bit on the GPU: `blocks` `[out, in / 2]` and
    /// `scales` `[out, in / 32]` (u8), dequantised into the compute dtype for each product (the
    /// released values exactly), then multiplied as a float projection.
    #[cfg(feature = "cuda")]
    Mxfp4 { blocks: Tensor, scales: Tensor },
}

impl Linear {
    /// `{name}.weight` `[out, inp]` (and `{name}.bias`): float weights, or an FP8 projection
    /// where the checkpoint stores one.
    pub fn load(w: &Weights, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self, EngineError> {
        let (weight, shape) = (format!("{name}.weight"), [out, inp]);
        let bias = w.get_opt(&format!("{name}.bias"), &[out], bias)?;
        if let Some(fp8) = w.get_fp8(&weight, &shape)? {
            return Ok(Linear { kind: Self::fp8_kind(w, fp8)?, bias });
        }
        match w.get_transposed_f32(&weight, &shape)? {
            Some(weight_t) => Ok(Linear { kind: Kind::Float(weight_t), bias }),
            None => Ok(Self::from_weight(w.get(&weight, &shape)?, bias)?),
        }
    }

    /// An FP8 projection (no bias) from its e4m3 bytes and block scales, placed as
    /// [`Linear::load`] places those it reads.
    pub fn from_fp8(w: &Weights, fp8: crate::engine::weights::Fp8Host<'_>) -> Result<Self, EngineError> {
        Ok(Linear { kind: Self::fp8_kind(w, fp8)?, bias: None })
    }

    /// Where an FP8 weight goes: dequantised to f32 on the CPU; on a GPU, kept in e4m3 where
    /// block-scaled FP8 GEMMs run for the compute dtype, else dequantised to it.
    fn fp8_kind(w: &Weights, fp8: crate::engine::weights::Fp8Host<'_>) -> Result<Kind, EngineError> {
        #[cfg(feature = "cuda")]
        if w.device.is_cuda() {
            use crate::engine::cuda::fp8 as cuda_fp8;
            let weight = cuda_fp8::Fp8Weight::upload(&w.device, &fp8.bytes, &fp8.scale, fp8.n, fp8.k)?;
            if !w.fp8_gemm {
                w.count_fp8(format!("dequantised to {} at load (LAYERTAP_FP8_GEMM=0)", w.dtype.as_str()));
            } else if cuda_fp8::block_scaled(&w.device, w.dtype) {
                w.count_fp8(FP8_TENSOR_CORES.into());
                return Ok(Kind::Fp8(weight));
            } else {
                w.count_fp8(format!(
                    "dequantised to {} at load (this GPU runs no block-scaled FP8 GEMM for it)",
                    w.dtype.as_str()
                ));
            }
            return Ok(Kind::Fp8Dequantised(weight.dequantise(w.dtype)?.t()?.contiguous()?));
        }
        w.count_fp8("dequantised to f32 at load (CPU)".into());
        let t = super::fp8::dequantised_transposed(&fp8.bytes, &fp8.scale, fp8.n, fp8.k);
        Ok(Kind::Fp8Dequantised(Tensor::from_vec(t, (fp8.k, fp8.n), &candle_core::Device::Cpu)?.to_device(&w.device)?))
    }

    /// An MXFP4 projection kept 4-bit on its GPU ([`Kind::Mxfp4`]): `blocks` `[out, in / 2]` and
    /// `scales` `[out, in / 32]`, u8, on the device.
    #[cfg(feature = "cuda")]
    pub fn from_mxfp4(blocks: Tensor, scales: Tensor, bias: Option<Tensor>) -> Self {
        Linear { kind: Kind::Mxfp4 { blocks, scales }, bias }
    }

    /// From an `[out, in]` weight, stored transposed once so every forward is a plain
    /// `[T, in] x [in, out]` matmul.
    pub fn from_weight(weight: Tensor, bias: Option<Tensor>) -> candle_core::Result<Self> {
        let weight_t = match super::cpu_ops::transposed(&weight)? {
            Some(t) => t,
            None => weight.t()?.contiguous()?,
        };
        Ok(Linear { kind: Kind::Float(weight_t), bias })
    }

    /// Whether `parts` can be computed as one matmul: all float, all FP8 held alike, and FP8
    /// weights in e4m3 joined only on 128-row block boundaries.
    pub fn fusable(parts: &[&Linear]) -> bool {
        let same = parts.windows(2).all(|w| std::mem::discriminant(&w[0].kind) == std::mem::discriminant(&w[1].kind));
        #[cfg(feature = "cuda")]
        let blocks = parts.iter().rev().skip(1).all(|p| match &p.kind {
            Kind::Fp8(w) => w.out_dim().is_multiple_of(super::fp8::FP8_BLOCK),
            _ => true,
        }) && !parts.iter().any(|p| matches!(p.kind, Kind::Mxfp4 { .. }));
        #[cfg(not(feature = "cuda"))]
        let blocks = true;
        same && blocks
    }

    /// Whether this is an FP8 projection (its input quantised before the product).
    pub fn is_fp8(&self) -> bool {
        match self.kind {
            Kind::Float(_) => false,
            Kind::Fp8Dequantised(_) => true,
            #[cfg(feature = "cuda")]
            Kind::Fp8(_) => true,
            #[cfg(feature = "cuda")]
            Kind::Mxfp4 { .. } => false,
        }
    }

    /// Output features.
    pub fn out_dim(&self) -> candle_core::Result<usize> {
        match &self.kind {
            Kind::Float(t) | Kind::Fp8Dequantised(t) => t.dim(1),
            #[cfg(feature = "cuda")]
            Kind::Fp8(w) => Ok(w.out_dim()),
            #[cfg(feature = "cuda")]
            Kind::Mxfp4 { blocks, .. } => blocks.dim(0),
        }
    }

    /// One projection computing all of `parts` side by side (their outputs concatenated), so a
    /// single larger matmul replaces several.
    pub fn fuse(parts: Vec<Linear>) -> Result<Self, EngineError> {
        if parts.is_empty() || !Self::fusable(&parts.iter().collect::<Vec<_>>()) {
            return Err(EngineError::Load("cannot fuse these projections into one".into()));
        }
        let kind = match &parts[0].kind {
            Kind::Float(_) | Kind::Fp8Dequantised(_) => {
                let weights = parts
                    .iter()
                    .map(|p| match &p.kind {
                        Kind::Float(t) | Kind::Fp8Dequantised(t) => Ok(t),
                        #[cfg(feature = "cuda")]
                        Kind::Fp8(_) | Kind::Mxfp4 { .. } => {
                            Err(EngineError::Load("cannot fuse projections held in different forms".into()))
                        }
                    })
                    .collect::<Result<Vec<_>, EngineError>>()?;
                let t = Tensor::cat(&weights, 1)?;
                match parts[0].kind {
                    Kind::Float(_) => Kind::Float(t),
                    _ => Kind::Fp8Dequantised(t),
                }
            }
            #[cfg(feature = "cuda")]
            Kind::Fp8(_) => {
                let weights = parts
                    .iter()
                    .map(|p| match &p.kind {
                        Kind::Fp8(w) => Ok(w),
                        _ => Err(EngineError::Load("cannot fuse FP8 and float projections".into())),
                    })
                    .collect::<Result<Vec<_>, EngineError>>()?;
                Kind::Fp8(crate::engine::cuda::fp8::Fp8Weight::cat(&weights)?)
            }
            #[cfg(feature = "cuda")]
            Kind::Mxfp4 { .. } => return Err(EngineError::Load("MXFP4 projections are not fused".into())),
        };
        let bias = if let Some(dt) = parts.iter().find_map(|p| p.bias.as_ref().map(Tensor::dtype)) {
            let b = parts
                .iter()
                .map(|p| match &p.bias {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros(p.out_dim()?, dt, p.device()),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Some(Tensor::cat(&b, 0)?)
        } else {
            None
        };
        Ok(Linear { kind, bias })
    }

    fn device(&self) -> &candle_core::Device {
        match &self.kind {
            Kind::Float(t) | Kind::Fp8Dequantised(t) => t.device(),
            #[cfg(feature = "cuda")]
            Kind::Fp8(w) => w.q.device(),
            #[cfg(feature = "cuda")]
            Kind::Mxfp4 { blocks, .. } => blocks.device(),
        }
    }

    /// The weight of an FP8 projection kept in e4m3 on the GPU, when this is one without a bias.
    #[cfg(feature = "cuda")]
    pub fn fp8_weight(&self) -> Option<&crate::engine::cuda::fp8::Fp8Weight> {
        match (&self.kind, &self.bias) {
            (Kind::Fp8(w), None) => Some(w),
            _ => None,
        }
    }

    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.kind {
            Kind::Float(w) => matmul(x, w)?,
            Kind::Fp8Dequantised(w) => {
                #[cfg(feature = "cuda")]
                if x.device().is_cuda() {
                    let y = matmul(&crate::engine::cuda::fp8::qdq(&x.to_dtype(w.dtype())?)?, w)?;
                    return self.add_bias(y.to_dtype(x.dtype())?);
                }
                let y = matmul(&super::fp8::quantise_activations(x)?, w)?;
                if y.dtype() == x.dtype() {
                    y
                } else {
                    y.to_dtype(x.dtype())?
                }
            }
            #[cfg(feature = "cuda")]
            Kind::Fp8(w) => crate::engine::cuda::fp8::matmul(x, w)?,
            #[cfg(feature = "cuda")]
            Kind::Mxfp4 { blocks, scales } => {
                matmul(x, &crate::engine::cuda::ops::mxfp4_dequantise(blocks, scales, x.dtype())?)?
            }
        };
        self.add_bias(y)
    }

    /// This projection of `silu(gate) * up`, for `gu` `[T, 2I]` holding the gate projection's
    /// outputs and then the up projection's (CUDA). An FP8 projection on the FP8 tensor cores
    /// quantises that product straight from `gu` in one kernel when `fused` (the same bytes as
    /// quantising the product written in the compute dtype); otherwise the product is written,
    /// then projected.
    #[cfg(feature = "cuda")]
    pub fn forward_silu_mul(&self, gu: &Tensor, fused: bool) -> candle_core::Result<Tensor> {
        match &self.kind {
            Kind::Fp8(w) if fused => self.add_bias(crate::engine::cuda::fp8::silu_mul_matmul(gu, w)?),
            _ => self.forward(&crate::engine::cuda::ops::silu_mul(gu)?),
        }
    }

    fn add_bias(&self, y: Tensor) -> candle_core::Result<Tensor> {
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
        if !fuse || parts.len() < 2 || !Linear::fusable(&parts.iter().collect::<Vec<_>>()) {
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

    /// Each part's output as a view of the fused output (columns of `[T, sum of widths]`, rows
    /// spaced by its width), with no copy: for kernels that read rows with a leading dimension.
    /// Separate projections give their own outputs.
    pub fn views(&self, x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Projections::Fused { linear, widths } => {
                let y = linear.forward(x)?;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(1, at, w);
                        at += w;
                        part
                    })
                    .collect()
            }
        }
    }

    /// Each part's output, contiguous.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Projections::Fused { .. } => self.views(x)?.iter().map(contiguous_part).collect(),
        }
    }
}

/// A part of a fused output (a view of its columns), contiguous. Candle's copy indexes the
/// source in 32 bits, which wraps once the fused output passes 2^32 elements (the Gated
/// DeltaNet's four projections of a 27B hybrid at 262,144 tokens); on CUDA past 2^31, a kernel
/// of ours copies.
fn contiguous_part(part: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if part.device().is_cuda()
        && part.dim(0)?.saturating_mul(crate::engine::large::row_extent(part)) > crate::engine::large::MAX_ELEMS
    {
        return crate::engine::cuda::ops::copy_rows(part, None);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A fused projection's views are its parts' outputs, the same values as `forward`'s copies,
    /// read in place from the fused output (rows spaced by its whole width).
    #[test]
    fn views_are_the_fused_parts_in_place() {
        let dev = candle_core::Device::Cpu;
        let widths = [12usize, 8, 3, 3];
        let x = Tensor::randn(0f32, 1.0, (5, 16), &dev).unwrap();
        let parts: Vec<Linear> = widths
            .iter()
            .map(|&w| Linear::from_weight(Tensor::randn(0f32, 0.3, (w, 16), &dev).unwrap(), None).unwrap())
            .collect();
        let separate: Vec<Tensor> = parts.iter().map(|p| p.forward(&x).unwrap()).collect();
        let fused = Projections::new(parts, true).unwrap();
        assert!(matches!(fused, Projections::Fused { .. }));
        let (views, copies) = (fused.views(&x).unwrap(), fused.forward(&x).unwrap());
        for ((v, c), s) in views.iter().zip(&copies).zip(&separate) {
            assert_eq!(v.dims(), s.dims());
            assert!(!v.is_contiguous() && c.is_contiguous());
            assert_eq!(v.stride(), &[widths.iter().sum::<usize>(), 1]);
            assert_eq!(v.to_vec2::<f32>().unwrap(), c.to_vec2::<f32>().unwrap());
            let d = (v - s).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-5, "{d}");
        }
    }
}
