//! RMSNorm in its two forms (`x * w` and the hybrids' zero-centred `x * (1 + w)`), and the
//! Gated DeltaNet's gated RMSNorm.

use candle_core::{DType, Tensor};

use super::linear::residual;
use crate::engine::config::ModelConfig;
use crate::engine::weights::Weights;
use crate::engine::EngineError;

pub struct RmsNorm {
    weight: Tensor,
    eps: f32,
    /// Norms computed in f32 keep their weight in f32 (zero-centred norms `1 + w`) and round
    /// once, to this dtype, at the end.
    zero_centred: Option<DType>,
    /// Whether [`RmsNorm::add_forward`] may run the fused kernel (`EngineOptions::fused_add_norm`,
    /// through [`RmsNorm::fusing_add`]; off unless set).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fuse_add: bool,
}

impl RmsNorm {
    pub fn load(w: &Weights, name: &str, size: usize, eps: f64, zero_centred: bool) -> Result<Self, EngineError> {
        let eps = eps as f32;
        if zero_centred {
            // Transformers computes `x_f32 * rsqrt(mean(x^2) + eps) * (1 + w_f32)`, then rounds.
            let weight = (w.get_f32(&format!("{name}.weight"), &[size])? + 1.0)?;
            return Ok(RmsNorm { weight, eps, zero_centred: Some(w.dtype), fuse_add: false });
        }
        Ok(RmsNorm { weight: w.get(&format!("{name}.weight"), &[size])?, eps, zero_centred: None, fuse_add: false })
    }

    /// `x_f32 * rsqrt(mean(x^2) + eps) * w_f32`, rounded once to the compute dtype (the weight
    /// read in f32).
    pub fn load_f32(w: &Weights, name: &str, size: usize, eps: f64) -> Result<Self, EngineError> {
        let weight = w.get_f32(&format!("{name}.weight"), &[size])?;
        Ok(RmsNorm { weight, eps: eps as f32, zero_centred: Some(w.dtype), fuse_add: false })
    }

    /// An RMSNorm without a weight, in f32, rounded once to the compute dtype.
    pub fn scale_free(w: &Weights, size: usize, eps: f64) -> Result<Self, EngineError> {
        let weight = Tensor::ones(size, DType::F32, &w.device)?;
        Ok(RmsNorm { weight, eps: eps as f32, zero_centred: Some(w.dtype), fuse_add: false })
    }

    /// A decoder norm of `hidden_size` (`{name}.weight`) as the config says: zero-centred, in
    /// f32 ([`ModelConfig::f32_norms`]), or plain.
    pub fn load_for(w: &Weights, c: &ModelConfig, name: &str) -> Result<Self, EngineError> {
        Self::load_sized_for(w, c, name, c.hidden_size)
    }

    /// [`RmsNorm::load_for`] of another size.
    pub fn load_sized_for(w: &Weights, c: &ModelConfig, name: &str, size: usize) -> Result<Self, EngineError> {
        if c.f32_norms && !c.zero_centred_norms {
            return Self::load_f32(w, name, size, c.rms_norm_eps);
        }
        Self::load(w, name, size, c.rms_norm_eps, c.zero_centred_norms)
    }

    /// The same norm, its residual add fused where the kernel serves when `on` (the norms a
    /// residual add feeds: each layer's two and the final one).
    pub fn fusing_add(self, on: bool) -> Self {
        RmsNorm { fuse_add: on, ..self }
    }

    /// The weight in f32 (`1 + w` for zero-centred norms) and epsilon, for fused kernels.
    pub fn f32_parts(&self) -> candle_core::Result<(Tensor, f32)> {
        Ok((self.weight.to_dtype(DType::F32)?, self.eps))
    }

    /// In the weight's dtype; an f32 input with a 16-bit weight (the f32 residual stream on
    /// CUDA) is normalised in f32 and rounded once.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // The f32 stream on CUDA: one kernel of ours, for zero-centred norms too (their `1 + w`
        // in f32, the result rounded once to their dtype).
        #[cfg(feature = "cuda")]
        if let Some(out) = self.f32_stream_kernel(x) {
            return crate::engine::cuda::ops::rms_norm_f32_to(x, &self.weight, self.eps, out);
        }
        // Candle's CUDA norm and casts index in 32 bits: long batches go in slices of rows.
        #[cfg(feature = "cuda")]
        if x.rank() > 0 {
            let slice = |r0, n| self.forward(&x.narrow(0, r0, n)?);
            if let Some(y) =
                crate::engine::large::by_rows(x.device(), x.dim(0)?, crate::engine::large::row_extent(x), slice)?
            {
                return Ok(y);
            }
        }
        if let Some(out) = self.zero_centred {
            return candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?, &self.weight, self.eps)?.to_dtype(out);
        }
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }

    /// The output dtype where the f32 stream's kernel normalises `x` (f32 on CUDA, with a
    /// 16-bit weight or a zero-centred norm's f32 `1 + w` and a 16-bit output).
    #[cfg(feature = "cuda")]
    fn f32_stream_kernel(&self, x: &Tensor) -> Option<DType> {
        let out = self.zero_centred.unwrap_or(self.weight.dtype());
        (x.device().is_cuda() && x.dtype() == DType::F32 && matches!(out, DType::BF16 | DType::F16)).then_some(out)
    }

    /// `x + y` (the residual add) and this norm of it. On CUDA, for the f32 stream and a 16-bit
    /// sublayer output of the norm's dtype, one kernel does both, bitwise as the two ops (unless
    /// [`RmsNorm::fusing_add`] turned it off, for comparison); elsewhere [`residual`] then
    /// [`RmsNorm::forward`].
    pub fn add_forward(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if self.fuses_add(x, y) {
            return crate::engine::cuda::ops::add_rms_norm_f32(x, y, &self.weight, self.eps);
        }
        let x = residual(x, y)?;
        let h = self.forward(&x)?;
        Ok((x, h))
    }

    /// Whether [`RmsNorm::add_forward`] runs the fused kernel for these inputs.
    pub fn fuses_add(&self, x: &Tensor, y: &Tensor) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.f32_stream_kernel(x) == Some(y.dtype()) && x.dims() == y.dims() && self.fuse_add
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (x, y);
            false
        }
    }
}

/// `rms_norm(x) * w * silu(z)` over the last dimension, in f32 (the weight may be stored in
/// f32 inside a 16-bit checkpoint and keeps that precision); the result is rounded once.
pub struct GatedRmsNorm {
    weight: Tensor,
    eps: f32,
}

impl GatedRmsNorm {
    pub fn load(w: &Weights, name: &str, size: usize, eps: f64) -> Result<Self, EngineError> {
        Ok(GatedRmsNorm { weight: w.get_f32(&format!("{name}.weight"), &[size])?, eps: eps as f32 })
    }

    /// The weight (f32) and epsilon, for the fused CUDA kernel.
    pub fn parts(&self) -> (&Tensor, f32) {
        (&self.weight, self.eps)
    }

    /// `x`, `z`: `[.., size]`; returns `out`-typed values of the same shape.
    pub fn forward(&self, x: &Tensor, z: &Tensor, out: DType) -> candle_core::Result<Tensor> {
        let normed = candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?, &self.weight, self.eps)?;
        (normed * candle_nn::ops::silu(&z.to_dtype(DType::F32)?)?)?.to_dtype(out)
    }
}
