//! The Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5 linear-attention layers): input
//! projections, a causal depthwise conv1d + SiLU over q, k and v that restarts at every
//! sequence, the gates (`beta = sigmoid(b)`, `g = -exp(A_log) * softplus(a + dt_bias)`), l2norm
//! of q and k, the chunked delta rule, the gated RMSNorm with `silu(z)`, the output projection.
//! Everything between the projections runs in f32.

use candle_core::{DType, Tensor, D};

use super::delta_rule;
use super::linear::{Linear, Projections};
use super::norm::GatedRmsNorm;
use crate::engine::batch::{BatchCtx, GdnPlan};
use crate::engine::config::{GdnLayout, LinearAttentionConfig, ModelConfig};
use crate::engine::options::EngineOptions;
use crate::engine::profile::Phase;
use crate::engine::weights::Weights;
use crate::engine::EngineError;

pub struct GatedDeltaNet {
    /// qkv `[conv_dim]` (q, k, v each head-major), z `[value_dim]`, b and a `[value_heads]`.
    proj: Projections,
    /// `taps[s]`: the conv weight applied to the token `s` positions back, `[conv_dim]` f32.
    taps: Vec<Tensor>,
    /// The conv weight `[conv_dim, kernel]` f32, for the CUDA kernels: present where they serve
    /// and `EngineOptions::cuda_gdn` leaves them on (chosen at load).
    #[cfg(feature = "cuda")]
    conv: Option<Tensor>,
    /// How the CUDA kernels compute the chunk products (`EngineOptions::gdn_tf32`).
    #[cfg(feature = "cuda")]
    products: crate::engine::cuda::gdn::Products,
    /// `-exp(A_log)`, f32 `[value_heads]`.
    neg_a: Tensor,
    dt_bias: Tensor,
    norm: GatedRmsNorm,
    out: Linear,
    dims: LinearAttentionConfig,
}

/// Rows `[q | k | v]` and `[z]` of Qwen3-Next's `in_proj_qkvz`, and `[b]`, `[a]` of
/// `in_proj_ba`: both are grouped per key head (group g: q_g, k_g, its value heads' v, their z;
/// then b_g, a_g), so the rows are regrouped once into the head-major layout of Qwen3.5. An FP8
/// `in_proj_qkvz` is regrouped as stored ([`split_fused_fp8`]).
fn split_fused(w: &Weights, p: &str, d: &LinearAttentionConfig, hidden: usize) -> Result<Vec<Linear>, EngineError> {
    let (nk, dk, dv) = (d.num_key_heads, d.key_head_dim, d.value_head_dim);
    let r = d.num_value_heads / nk;
    let group = 2 * dk + 2 * r * dv;
    let part = |t: &Tensor, at: usize, len: usize| t.narrow(1, at, len)?.reshape((nk * len, hidden));
    let float = |t: Tensor| Linear::from_weight(t, None).map_err(EngineError::from);
    let qkvz_name = format!("{p}.in_proj_qkvz.weight");
    let [qkv, z] = if let Some(pair) = split_fused_fp8(w, &qkvz_name, d, hidden)? {
        pair
    } else {
        let qkvz = w.get(&qkvz_name, &[nk * group, hidden])?.reshape((nk, group, hidden))?;
        let qkv = Tensor::cat(&[part(&qkvz, 0, dk)?, part(&qkvz, dk, dk)?, part(&qkvz, 2 * dk, r * dv)?], 0)?;
        let z = part(&qkvz, 2 * dk + r * dv, r * dv)?;
        [float(qkv)?, float(z)?]
    };
    let ba = w.get(&format!("{p}.in_proj_ba.weight"), &[nk * 2 * r, hidden])?.reshape((nk, 2 * r, hidden))?;
    Ok(vec![qkv, z, float(part(&ba, 0, r)?)?, float(part(&ba, r, r)?)?])
}

/// Whether each part of a key head's group in Qwen3-Next's `in_proj_qkvz` (q_g and k_g, v_g and
/// z_g) is a whole number of 128-row blocks, so FP8 rows regroup with their scales.
fn blocks_whole(d: &LinearAttentionConfig) -> bool {
    let r = d.num_value_heads / d.num_key_heads;
    d.key_head_dim.is_multiple_of(super::fp8::FP8_BLOCK) && (r * d.value_head_dim).is_multiple_of(super::fp8::FP8_BLOCK)
}

/// The FP8 `in_proj_qkvz` (`name`) regrouped into `[q | k | v]` and `[z]` as
/// [`split_fused`] regroups the float one, without dequantising: the e4m3 rows move in whole
/// 128-row blocks with their rows of block scales, so each block keeps the scale it was
/// quantised with and the product is the checkpoint's W8A8 exactly. That needs every part of a
/// key head's group (q_g and k_g: `linear_key_head_dim` rows; v_g and z_g: value heads per key
/// head x `linear_value_head_dim` rows) to be whole blocks, as in the releases (128 and 2 x 128);
/// other dimensions would split a block between two parts, and are refused. Under `--quantize
/// fp8` the stored rows are quantised as a release quantises them, then regrouped the same way;
/// where the parts are not whole blocks the projection stays in float (counted as such). `None`
/// where `name` is read as floats.
fn split_fused_fp8(
    w: &Weights,
    name: &str,
    d: &LinearAttentionConfig,
    hidden: usize,
) -> Result<Option<[Linear; 2]>, EngineError> {
    use super::fp8::FP8_BLOCK;
    let (nk, dk, dv) = (d.num_key_heads, d.key_head_dim, d.value_head_dim);
    let r = d.num_value_heads / nk;
    if !blocks_whole(d) && w.is_fp8(name) {
        if w.quantises_at_load() {
            w.keep_float("Qwen3-Next in_proj_qkvz whose per-key-head parts are not whole 128-row blocks", 1);
            return Ok(None);
        }
        return Err(EngineError::Load(format!(
            "{:?} is FP8, whose rows are regrouped per key head at load in whole {FP8_BLOCK}-row blocks (each \
             block keeps its scale); that needs linear_key_head_dim ({dk}) and the value rows per key head \
             (linear_num_value_heads / linear_num_key_heads x linear_value_head_dim = {r} x {dv} = {}) to be \
             multiples of {FP8_BLOCK}, as in Qwen3-Next's FP8 releases (128 and 2 x 128); layertap refuses this \
             checkpoint rather than regroup rows that share a block scale",
            w.full_name(name),
            r * dv
        )));
    }
    let group = 2 * dk + 2 * r * dv;
    let Some(fp8) = w.get_fp8(name, &[nk * group, hidden])? else { return Ok(None) };
    // `rows(at, len)`: rows `at..at + len` of each key head's group, group after group.
    let span = |g: usize, at: usize, len: usize| g * group + at..g * group + at + len;
    let rows = |at: usize, len: usize| (0..nk).map(move |g| span(g, at, len));
    let qkv: Vec<_> = rows(0, dk).chain(rows(dk, dk)).chain(rows(2 * dk, r * dv)).collect();
    let z: Vec<_> = rows(2 * dk + r * dv, r * dv).collect();
    Ok(Some([Linear::from_fp8(w, fp8.gather_rows(&qkv)?)?, Linear::from_fp8(w, fp8.gather_rows(&z)?)?]))
}

/// `ln(1 + y)` accurate for small `y` (where `ln` of the rounded `1 + y` loses most digits):
/// `y * ln(u) / (u - 1)` with `u = 1 + y` rounded, and `y` itself where `u` rounds to 1.
fn log1p(y: &Tensor) -> candle_core::Result<Tensor> {
    let u = (y + 1.0)?;
    let d = (&u - 1.0)?;
    let rounds_to_one = d.eq(0.0)?;
    let exact = ((u.log()? * y)? / rounds_to_one.where_cond(&d.ones_like()?, &d)?)?;
    rounds_to_one.where_cond(y, &exact)
}

/// `taps[s]`: the conv weight column that multiplies the token `s` positions back (`conv`:
/// `[conv_dim, kernel]`, tap `j` of the kernel multiplies the token `kernel - 1 - j` back).
pub fn conv_taps(conv: &Tensor) -> candle_core::Result<Vec<Tensor>> {
    let kernel = conv.dim(1)?;
    (0..kernel).map(|s| conv.narrow(1, kernel - 1 - s, 1)?.squeeze(1)?.contiguous()).collect()
}

/// Causal depthwise conv over each sequence (zeros before its first token), then SiLU.
fn conv(x: &Tensor, taps: &[Tensor], plan: &GdnPlan) -> candle_core::Result<Tensor> {
    let padded = Tensor::cat(&[x, &Tensor::zeros((1, x.dim(1)?), DType::F32, x.device())?], 0)?;
    let mut y = x.broadcast_mul(&taps[0])?;
    for (s, tap) in taps.iter().enumerate().skip(1) {
        y = (y + padded.index_select(&plan.shifts[s - 1], 0)?.broadcast_mul(tap)?)?;
    }
    candle_nn::ops::silu(&y)
}

/// The portable path from the projections' outputs (`qkv` `[T, conv_dim]`, `b`, `a`
/// `[T, value_heads]`, compute dtype) to the delta rule's output `[T, value_heads, dv]` f32:
/// conv + SiLU, l2norm of q and k, the gates, the chunked delta rule. The CUDA kernels compute
/// the same and are tested against it.
#[allow(clippy::too_many_arguments)]
pub fn mix_portable(
    qkv: &Tensor,
    b: &Tensor,
    a: &Tensor,
    taps: &[Tensor],
    neg_a: &Tensor,
    dt_bias: &Tensor,
    plan: &GdnPlan,
    d: &LinearAttentionConfig,
) -> candle_core::Result<Tensor> {
    let t = qkv.dim(0)?;
    let (nk, nv, dk, dv) = (d.num_key_heads, d.num_value_heads, d.key_head_dim, d.value_head_dim);
    let mixed = conv(&qkv.to_dtype(DType::F32)?, taps, plan)?;
    let l2 = |x: Tensor| -> candle_core::Result<Tensor> {
        x.broadcast_div(&(x.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?)
    };
    let q = (l2(mixed.narrow(1, 0, nk * dk)?.reshape((t, nk, dk))?)? * (dk as f64).powf(-0.5))?;
    let k = l2(mixed.narrow(1, nk * dk, nk * dk)?.reshape((t, nk, dk))?)?;
    let v = mixed.narrow(1, 2 * nk * dk, nv * dv)?.reshape((t, nv, dv))?;
    // Value head i reads key head i / (nv / nk).
    let r = nv / nk;
    let widen = |x: Tensor| -> candle_core::Result<Tensor> {
        if r == 1 {
            return Ok(x);
        }
        x.unsqueeze(2)?.broadcast_as((t, nk, r, dk))?.reshape((t, nv, dk))
    };
    let (q, k) = (widen(q)?, widen(k)?);
    // sigmoid in f32, rounded once to the compute dtype (as PyTorch computes it there).
    let beta = candle_nn::ops::sigmoid(&b.to_dtype(DType::F32)?)?.to_dtype(b.dtype())?.to_dtype(DType::F32)?;
    let x = a.to_dtype(DType::F32)?.broadcast_add(dt_bias)?;
    // softplus with PyTorch's threshold: x itself above 20, log1p(exp(x)) below.
    let softplus = x.gt(20.0)?.where_cond(&x, &log1p(&x.clamp(f32::MIN, 20.0)?.exp()?)?)?;
    let g = softplus.broadcast_mul(neg_a)?;
    let core = delta_rule::chunked(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, &beta, &g, plan)?;
    Ok(core)
}

impl GatedDeltaNet {
    pub fn load(w: &Weights, c: &ModelConfig, p: &str, o: &EngineOptions) -> Result<Self, EngineError> {
        let d = c
            .linear_attention
            .clone()
            .ok_or_else(|| EngineError::Load("a linear-attention layer without linear_* dimensions".into()))?;
        let h = c.hidden_size;
        let (conv_dim, value_dim, nv) = (d.conv_dim(), d.num_value_heads * d.value_head_dim, d.num_value_heads);
        let parts = match d.layout {
            GdnLayout::Fused => split_fused(w, p, &d, h)?,
            GdnLayout::Separate => vec![
                Linear::load(w, &format!("{p}.in_proj_qkv"), conv_dim, h, false)?,
                Linear::load(w, &format!("{p}.in_proj_z"), value_dim, h, false)?,
                Linear::load(w, &format!("{p}.in_proj_b"), nv, h, false)?,
                Linear::load(w, &format!("{p}.in_proj_a"), nv, h, false)?,
            ],
        };
        let conv = w.get_f32(&format!("{p}.conv1d.weight"), &[conv_dim, 1, d.conv_kernel])?.squeeze(1)?;
        let taps = conv_taps(&conv)?;
        #[cfg(not(feature = "cuda"))]
        let _ = o;
        #[cfg(feature = "cuda")]
        let conv = if o.cuda_gdn && crate::engine::cuda::gdn::supported(&w.device, &d) {
            Some(conv.contiguous()?.copy()?)
        } else {
            None
        };
        Ok(GatedDeltaNet {
            proj: Projections::new(parts, w.device.is_cuda())?,
            taps,
            #[cfg(feature = "cuda")]
            conv,
            #[cfg(feature = "cuda")]
            products: crate::engine::cuda::gdn::Products::for_dtype(w.dtype, o.gdn_tf32),
            neg_a: w.get_f32(&format!("{p}.A_log"), &[nv])?.exp()?.neg()?,
            dt_bias: w.get_f32(&format!("{p}.dt_bias"), &[nv])?,
            norm: GatedRmsNorm::load(w, &format!("{p}.norm"), d.value_head_dim, c.rms_norm_eps)?,
            out: Linear::load(w, &format!("{p}.out_proj"), h, value_dim, false)?,
            dims: d,
        })
    }

    /// `h`: the normed input `[T, hidden]`; returns the mixer's output `[T, hidden]`.
    pub fn forward(&self, h: &Tensor, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        let plan = ctx.gdn.as_ref().ok_or_else(|| candle_core::Error::Msg("no linear-attention plan".into()))?;
        let t = h.dim(0)?;
        let d = &self.dims;
        let (nv, dv) = (d.num_value_heads, d.value_head_dim);
        // The CUDA kernels read the fused projection's parts in place (rows with a leading
        // dimension); the portable path gets each part contiguous.
        #[cfg(feature = "cuda")]
        if let (Some(conv), Some(tables)) = (&self.conv, &plan.cuda) {
            let [qkv, z, b, a] = four(self.proj.views(h)?)?;
            ctx.profile.mark(Phase::GdnProj);
            let w = crate::engine::cuda::gdn::GdnWeights {
                conv,
                neg_a: &self.neg_a,
                dt_bias: &self.dt_bias,
                products: self.products,
            };
            let core = crate::engine::cuda::gdn::forward(&qkv, &b, &a, &w, tables, d, &ctx.profile)?;
            ctx.profile.mark(Phase::GdnKernels);
            let (weight, eps) = self.norm.parts();
            let normed = crate::engine::cuda::gdn::gated_norm(&core, &z, weight, eps)?;
            ctx.profile.mark(Phase::GdnCore);
            return self.out.forward(&normed.reshape((t, nv * dv))?);
        }
        let [qkv, z, b, a] = four(self.proj.forward(h)?)?;
        ctx.profile.mark(Phase::GdnProj);
        let core = mix_portable(&qkv, &b, &a, &self.taps, &self.neg_a, &self.dt_bias, plan, d)?;
        let normed = self.norm.forward(&core, &z.reshape((t, nv, dv))?, h.dtype())?;
        ctx.profile.mark(Phase::GdnCore);
        self.out.forward(&normed.reshape((t, nv * dv))?)
    }
}

/// The four parts of the input projections: qkv, z, b, a.
fn four(parts: Vec<Tensor>) -> candle_core::Result<[Tensor; 4]> {
    let n = parts.len();
    parts
        .try_into()
        .map_err(|_| candle_core::Error::Msg(format!("gated deltanet: the projections returned {n} parts, not 4")))
}
