//! Multi-head latent attention (DeepSeek-V2 and later, GLM-4.7-Flash): queries from `q_proj`, or
//! through the low-rank `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`; a compressed latent from
//! `kv_a_proj_with_mqa`, normed and expanded per head by `kv_b_proj` into each head's unrotated
//! key part and its value; a rotated key part shared by every head. Keys and values are
//! expanded per head and attended as ordinary causal attention, with the value's own head size.
//!
//! DeepSeek's interleaved rotary layout (pairs `(x0, x1), (x2, x3), ...`) is read by permuting
//! the rotated rows of the projections that produce it at load (even dimensions first, then odd):
//! the rotation of the halves is then exactly the pairs' rotation, and since queries and keys are
//! permuted alike, their dot products are the same. Block-wise FP8 projections (DeepSeek-V3's
//! release) are read through [`Linear`], their rotated rows reordered in e4m3 within their blocks.

use candle_core::Tensor;

use super::linear::Linear;
use super::norm::RmsNorm;
use super::sdpa::sequence_attention;
use crate::engine::batch::BatchCtx;
use crate::engine::config::{MlaConfig, ModelConfig};
use crate::engine::profile::Phase;
use crate::engine::weights::Weights;
use crate::engine::EngineError;

/// transformers builds the latent norms with their class default epsilon, not the config's.
const LATENT_NORM_EPS: f64 = 1e-6;

/// The queries' projections.
enum Query {
    Plain(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

pub struct LatentAttention {
    q: Query,
    kv_a: Linear,
    kv_a_norm: RmsNorm,
    kv_b: Linear,
    o: Linear,
    heads: usize,
    m: MlaConfig,
}

/// The projection `{name}.weight` `[out, inp]` (no bias); when `interleaved`, each block of `rope`
/// rows starting at one of `blocks` reordered: its even rows first, then its odd ones. An FP8
/// projection has its e4m3 rows reordered, each within its 128-row block, so its block scales
/// hold as stored (a rotary block that straddles two blocks is refused).
fn load_permuted(
    w: &Weights,
    name: &str,
    out: usize,
    inp: usize,
    blocks: &[usize],
    rope: usize,
    interleaved: bool,
) -> Result<Linear, EngineError> {
    if !interleaved {
        return Linear::load(w, name, out, inp, false);
    }
    let mut order: Vec<usize> = (0..out).collect();
    for &start in blocks {
        for j in 0..rope / 2 {
            order[start + j] = start + 2 * j;
            order[start + rope / 2 + j] = start + 2 * j + 1;
        }
    }
    let weight = format!("{name}.weight");
    if let Some(fp8) = w.get_fp8(&weight, &[out, inp])? {
        let permuted = fp8.permute_rows(&order).map_err(|e| {
            EngineError::Load(format!("{weight:?}: the interleaved rotary rows cannot be reordered: {e}"))
        })?;
        return Linear::from_fp8(w, permuted);
    }
    let weight = w.get(&weight, &[out, inp])?;
    let order: Vec<u32> = order.iter().map(|&i| i as u32).collect();
    let idx = Tensor::new(order.as_slice(), weight.device())?;
    Ok(Linear::from_weight(weight.index_select(&idx, 0)?.contiguous()?, None)?)
}

impl LatentAttention {
    pub fn load(w: &Weights, c: &ModelConfig, prefix: &str) -> Result<Self, EngineError> {
        let m = c.mla.clone().ok_or_else(|| EngineError::Load("latent attention without its dimensions".into()))?;
        let (h, nq) = (c.hidden_size, c.num_attention_heads);
        let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let rope = m.qk_rope_head_dim;
        if m.rope_interleaved && !rope.is_multiple_of(2) {
            return Err(EngineError::Load(format!("qk_rope_head_dim {rope} must be even")));
        }
        let q_blocks: Vec<usize> = (0..nq).map(|i| i * qk + m.qk_nope_head_dim).collect();
        let q = match m.q_lora_rank {
            None => Query::Plain(load_permuted(
                w,
                &format!("{prefix}.q_proj"),
                nq * qk,
                h,
                &q_blocks,
                rope,
                m.rope_interleaved,
            )?),
            Some(r) => Query::LowRank {
                a: Linear::load(w, &format!("{prefix}.q_a_proj"), r, h, false)?,
                norm: RmsNorm::load(w, &format!("{prefix}.q_a_layernorm"), r, LATENT_NORM_EPS, false)?,
                b: load_permuted(w, &format!("{prefix}.q_b_proj"), nq * qk, r, &q_blocks, rope, m.rope_interleaved)?,
            },
        };
        let kv_a = load_permuted(
            w,
            &format!("{prefix}.kv_a_proj_with_mqa"),
            m.kv_lora_rank + rope,
            h,
            &[m.kv_lora_rank],
            rope,
            m.rope_interleaved,
        )?;
        if let Some(ix) = &m.indexer {
            // Sparse attention's indexer: its weights are checked and left unread (see
            // `KeyIndexer`); a layer that shares another's selection stores none.
            let q_rank = m.q_lora_rank.unwrap_or(h);
            for (name, shape) in [
                ("wq_b.weight", vec![ix.heads * ix.head_dim, q_rank]),
                ("wk.weight", vec![ix.head_dim, h]),
                ("k_norm.weight", vec![ix.head_dim]),
                ("k_norm.bias", vec![ix.head_dim]),
                ("weights_proj.weight", vec![ix.heads, h]),
            ] {
                w.accept_unread(&format!("{prefix}.indexer.{name}"), &shape)?;
            }
        }
        Ok(LatentAttention {
            q,
            kv_a,
            kv_a_norm: RmsNorm::load(w, &format!("{prefix}.kv_a_layernorm"), m.kv_lora_rank, LATENT_NORM_EPS, false)?,
            kv_b: Linear::load(
                w,
                &format!("{prefix}.kv_b_proj"),
                nq * (m.qk_nope_head_dim + m.v_head_dim),
                m.kv_lora_rank,
                false,
            )?,
            o: Linear::load(w, &format!("{prefix}.o_proj"), h, nq * m.v_head_dim, false)?,
            heads: nq,
            m,
        })
    }

    /// Rotary embedding of `[T, heads, rope]` (the halves' rotation).
    fn rope(x: &Tensor, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        let (cos, sin) = ctx.tables.as_ref().ok_or_else(|| candle_core::Error::Msg("no rotary tables".into()))?;
        candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, cos, sin)?.squeeze(0)
    }

    /// `h`: the normed input `[T, hidden]`; returns the attention block's output `[T, hidden]`.
    pub fn forward(&self, h: &Tensor, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        let t = h.dim(0)?;
        let (nq, m) = (self.heads, &self.m);
        let (nope, rope, vd) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        let q = match &self.q {
            Query::Plain(p) => p.forward(h)?,
            Query::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(h)?)?)?,
        };
        let q = q.reshape((t, nq, nope + rope))?;
        let kv = self.kv_a.forward(h)?;
        let latent = self.kv_a_norm.forward(&kv.narrow(1, 0, m.kv_lora_rank)?.contiguous()?)?;
        let k_rot = kv.narrow(1, m.kv_lora_rank, rope)?.reshape((t, 1, rope))?;
        ctx.profile.mark(Phase::NormQkv);
        let q_rot = Self::rope(&q.narrow(2, nope, rope)?, ctx)?;
        let k_rot = Self::rope(&k_rot, ctx)?;
        ctx.profile.mark(Phase::Rope);
        let kvb = self.kv_b.forward(&latent)?.reshape((t, nq, nope + vd))?;
        let q = Tensor::cat(&[&q.narrow(2, 0, nope)?, &q_rot], 2)?;
        let k = Tensor::cat(&[&kvb.narrow(2, 0, nope)?, &k_rot.broadcast_as((t, nq, rope))?], 2)?;
        let v = kvb.narrow(2, nope, vd)?;
        // One head size for all three: zeros added to the shorter side change no dot product
        // and no weighted sum, and the padded output columns are dropped.
        let d = (nope + rope).max(vd);
        let pad = |x: Tensor| -> candle_core::Result<Tensor> {
            let have = x.dim(2)?;
            if have == d {
                return x.contiguous();
            }
            Tensor::cat(&[&x, &Tensor::zeros((t, nq, d - have), x.dtype(), x.device())?], 2)?.contiguous()
        };
        let (q, k, v) = (pad(q)?, pad(k)?, pad(v)?);
        let attn = self.attend(&q, &k, &v, ctx)?;
        let attn = if d == vd { attn } else { attn.reshape((t, nq, d))?.narrow(2, 0, vd)?.reshape((t, nq * vd))? };
        ctx.profile.mark(Phase::Attention);
        self.o.forward(&attn)
    }

    /// `[T, heads * d]`: the fused CPU kernel for f32 on the CPU, otherwise one portable pass per
    /// sequence.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if ctx.tiles.is_some() {
            candle_core::bail!("multi-head latent attention is not computed by the CUDA attention kernel");
        }
        let scale = self.m.softmax_scale;
        if super::cpu_attention::supported(q) {
            return super::cpu_attention::packed_attention(q, k, v, &ctx.seqs, scale as f32, None, None);
        }
        let mut outs = Vec::with_capacity(ctx.seqs.len());
        for &(start, len) in &ctx.seqs {
            let masks = ctx
                .masks
                .get(&(len, None))
                .ok_or_else(|| candle_core::Error::Msg(format!("no mask for length {len}")))?;
            let part = |x: &Tensor| x.narrow(0, start, len);
            outs.push(sequence_attention(&part(q)?, &part(k)?, &part(v)?, scale, masks, None)?);
        }
        if outs.len() == 1 {
            return Ok(outs.swap_remove(0));
        }
        Tensor::cat(&outs, 0)
    }
}
