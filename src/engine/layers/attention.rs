//! Softmax attention over packed sequences: q/k/v projections (fused on CUDA), optional q/k
//! RMSNorm, rotary embedding on the first `rotary_dim` dimensions of each head, causal
//! attention per sequence, an optional sigmoid output gate, and the output projection.

use candle_core::{Tensor, D};

use super::linear::{Linear, Projections};
use super::norm::RmsNorm;
use super::sdpa::sequence_attention;
use crate::engine::batch::BatchCtx;
use crate::engine::config::{MixerKind, ModelConfig};
use crate::engine::options::EngineOptions;
use crate::engine::profile::Phase;
use crate::engine::weights::Weights;
use crate::engine::EngineError;

/// A layer's keys and values as attention reads them, `[T, kv_heads, head_dim]` each: after
/// their norms and rotary embedding.
pub type KeyValues = (Tensor, Tensor);

pub struct Attention {
    /// The query projection, then the key and value ones where the layer computes its own.
    qkv: Projections,
    /// No key or value projections: the layer attends over the keys and values another layer
    /// computed ([`Attention::forward_with`]).
    reuses_kv: bool,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// A scale-free norm on each value head.
    v_norm: Option<RmsNorm>,
    /// No value projection: the values are the key projection's output (before the key norm).
    k_eq_v: bool,
    /// The rotary tables of the full-attention layers (`BatchCtx::full_tables`), not the
    /// model's default ones.
    full_rope: bool,
    /// The softmax scale.
    scale: f64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    /// `q_proj` holds, per head, the query then its output gate.
    gated: bool,
    /// Keys this many positions back or further are masked (a sliding-attention layer).
    window: Option<usize>,
    /// One logit per query head that joins each row's softmax and is dropped after it (f32): for
    /// the CPU's fused kernel, and as a tensor on the layer's device for the others.
    sinks: Option<(Vec<f32>, Tensor)>,
    /// The split, q/k norms and rotary embedding in one kernel, where it serves and
    /// `EngineOptions::fused_rope` leaves it on (chosen at load).
    #[cfg(feature = "cuda")]
    fused: Option<crate::engine::cuda::rope::QkvRope>,
}

impl Attention {
    /// The layer's weights, and its kernels as `o` chooses them. Whether the attention itself runs
    /// in the CUDA kernel is the decoder's choice, made with the same options, since every layer
    /// shares the batch's tile list ([`BatchCtx::tiles`]).
    pub fn load(
        w: &Weights,
        c: &ModelConfig,
        prefix: &str,
        mixer: MixerKind,
        o: &EngineOptions,
    ) -> Result<Self, EngineError> {
        Self::load_with(w, c, prefix, mixer, o, false)
    }

    /// A layer without key and value projections (or their norms) that attends over another
    /// layer's keys and values; the ones some checkpoints still carry are passed over, as
    /// transformers passes them over.
    pub fn load_reusing_kv(
        w: &Weights,
        c: &ModelConfig,
        prefix: &str,
        mixer: MixerKind,
        o: &EngineOptions,
    ) -> Result<Self, EngineError> {
        for part in ["k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "k_norm.weight", "v_norm.weight"] {
            w.pass_over(&format!("{prefix}.{part}"));
        }
        Self::load_with(w, c, prefix, mixer, o, true)
    }

    fn load_with(
        w: &Weights,
        c: &ModelConfig,
        prefix: &str,
        mixer: MixerKind,
        o: &EngineOptions,
        reuses_kv: bool,
    ) -> Result<Self, EngineError> {
        let window = (mixer == MixerKind::SlidingAttention).then_some(c.sliding_window).flatten();
        let (nkv, hd, rotary_dim, k_eq_v, full_rope) = c.attention_shape(mixer);
        let h = c.hidden_size;
        let nq = c.num_attention_heads;
        let q_out = if c.attn_output_gate { 2 * nq * hd } else { nq * hd };
        let q = Linear::load(w, &format!("{prefix}.q_proj"), q_out, h, c.qkv_bias)?;
        let mut qkv = vec![q];
        if !reuses_kv {
            qkv.push(Linear::load(w, &format!("{prefix}.k_proj"), nkv * hd, h, c.qkv_bias)?);
            if !k_eq_v {
                qkv.push(Linear::load(w, &format!("{prefix}.v_proj"), nkv * hd, h, c.qkv_bias)?);
            }
        }
        let norm = |n: &str| match c.f32_norms && !c.zero_centred_norms {
            true => RmsNorm::load_f32(w, &format!("{prefix}.{n}"), hd, c.rms_norm_eps),
            false => RmsNorm::load(w, &format!("{prefix}.{n}"), hd, c.rms_norm_eps, c.zero_centred_norms),
        };
        let q_norm = c.qk_norm.then(|| norm("q_norm")).transpose()?;
        let k_norm = (c.qk_norm && !reuses_kv).then(|| norm("k_norm")).transpose()?;
        let v_norm = (c.v_norm && !reuses_kv).then(|| RmsNorm::scale_free(w, hd, c.rms_norm_eps)).transpose()?;
        let sinks = match c.attention_sinks {
            true => {
                let t = w.get_f32(&format!("{prefix}.sinks"), &[nq])?;
                Some((t.to_device(&candle_core::Device::Cpu)?.to_vec1()?, t))
            }
            false => None,
        };
        #[cfg(not(feature = "cuda"))]
        let _ = o;
        #[cfg(feature = "cuda")]
        let fused = if o.fused_rope
            && !reuses_kv
            && v_norm.is_none()
            && !k_eq_v
            && !full_rope
            && crate::engine::cuda::rope::QkvRope::supported(&w.device, w.dtype, hd, c.rotary_dim)
        {
            let norms = match (&q_norm, &k_norm) {
                (Some(qn), Some(kn)) => {
                    let ((qw, eps), (kw, _)) = (qn.f32_parts()?, kn.f32_parts()?);
                    Some((qw, kw, eps))
                }
                _ => None,
            };
            Some(crate::engine::cuda::rope::QkvRope {
                heads: nq,
                kv_heads: nkv,
                head_dim: hd,
                rotary_dim: c.rotary_dim,
                gated: c.attn_output_gate,
                norms,
            })
        } else {
            None
        };
        Ok(Attention {
            // On CUDA, fewer and larger matmuls; on the CPU the layout stays as the reference's.
            qkv: Projections::new(qkv, w.device.is_cuda())?,
            reuses_kv,
            o: Linear::load(w, &format!("{prefix}.o_proj"), h, nq * hd, c.o_bias)?,
            q_norm,
            k_norm,
            v_norm,
            k_eq_v,
            full_rope,
            scale: c.attention_scale.unwrap_or(1.0 / (hd as f64).sqrt()),
            heads: nq,
            kv_heads: nkv,
            head_dim: hd,
            rotary_dim,
            gated: c.attn_output_gate,
            window,
            sinks,
            #[cfg(feature = "cuda")]
            fused,
        })
    }

    /// Rotary embedding of `[T, heads, head_dim]` on the first `rotary_dim` dimensions.
    fn rope(&self, x: &Tensor, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        let tables = if self.full_rope { ctx.full_tables.as_ref() } else { ctx.tables.as_ref() };
        let (cos, sin) = tables.ok_or_else(|| candle_core::Error::Msg("no rotary tables".into()))?;
        let rot = |x: &Tensor| candle_nn::rotary_emb::rope_thd(&x.unsqueeze(0)?.contiguous()?, cos, sin)?.squeeze(0);
        if self.rotary_dim == self.head_dim {
            return rot(x);
        }
        let pass = x.narrow(D::Minus1, self.rotary_dim, self.head_dim - self.rotary_dim)?;
        Tensor::cat(&[rot(&x.narrow(D::Minus1, 0, self.rotary_dim)?)?, pass], D::Minus1)
    }

    /// `h`: the normed input `[T, hidden]`; returns the attention block's output `[T, hidden]`.
    pub fn forward(&self, h: &Tensor, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        Ok(self.forward_with(h, ctx, None)?.0)
    }

    /// [`Attention::forward`], over `reused` (another layer's keys and values) where this layer
    /// reuses them; returns also the keys and values it attended over.
    pub fn forward_with(
        &self,
        h: &Tensor,
        ctx: &BatchCtx,
        reused: Option<&KeyValues>,
    ) -> candle_core::Result<(Tensor, KeyValues)> {
        #[cfg(feature = "cuda")]
        if let (Some(fused), Some((pos, inv_freq))) = (&self.fused, &ctx.rope_inputs) {
            if let Some(qkv) = self.qkv.joined(h)? {
                ctx.profile.mark(Phase::NormQkv);
                let (q, k, v, gate) = fused.forward(&qkv, pos, inv_freq)?;
                ctx.profile.mark(Phase::Rope);
                return Ok((self.finish(&q, &k, &v, gate, ctx)?, (k, v)));
            }
        }
        let t = h.dim(0)?;
        let hd = self.head_dim;
        let mut parts = self.qkv.forward(h)?.into_iter();
        let Some(q) = parts.next() else {
            candle_core::bail!("attention: the q/k/v projections returned nothing");
        };
        let (mut q, gate) = self.split_gate(q, t)?;
        if self.reuses_kv {
            let Some((k, v)) = reused else {
                candle_core::bail!("attention: a layer that reuses keys and values was given none");
            };
            if let Some(qn) = &self.q_norm {
                q = qn.forward(&q)?;
            }
            ctx.profile.mark(Phase::NormQkv);
            let q = self.rope(&q, ctx)?;
            ctx.profile.mark(Phase::Rope);
            return Ok((self.finish(&q, k, v, gate, ctx)?, (k.clone(), v.clone())));
        }
        let Some(k) = parts.next() else {
            candle_core::bail!("attention: the q/k/v projections returned no keys");
        };
        let v = match (self.k_eq_v, parts.next()) {
            (true, _) => k.clone(),
            (false, Some(v)) => v,
            (false, None) => candle_core::bail!("attention: the q/k/v projections returned no values"),
        };
        let mut k = k.reshape((t, self.kv_heads, hd))?;
        let mut v = v.reshape((t, self.kv_heads, hd))?;
        if let Some(vn) = &self.v_norm {
            v = vn.forward(&v)?;
        }
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        ctx.profile.mark(Phase::NormQkv);
        let q = self.rope(&q, ctx)?;
        let k = self.rope(&k, ctx)?;
        ctx.profile.mark(Phase::Rope);
        let v = v.contiguous()?;
        Ok((self.finish(&q, &k, &v, gate, ctx)?, (k, v)))
    }

    /// The queries `[T, heads, head_dim]` and, where `q_proj` emits one, the output gate
    /// `[T, heads * head_dim]`.
    fn split_gate(&self, q: Tensor, t: usize) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let (hd, nq) = (self.head_dim, self.heads);
        Ok(if self.gated {
            // Per head: the query, then its gate (interleaved by head, not two halves).
            let qg = q.reshape((t, nq, 2 * hd))?;
            let half = |at| crate::engine::large::map_rows(&qg.narrow(2, at, hd)?, |h| h.contiguous());
            (half(0)?, Some(half(hd)?.reshape((t, nq * hd))?))
        } else {
            (q.reshape((t, nq, hd))?, None)
        })
    }

    /// Attention of the rotated `q`, `k` and `v`, the output gate and the output projection.
    fn finish(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        gate: Option<Tensor>,
        ctx: &BatchCtx,
    ) -> candle_core::Result<Tensor> {
        let attn = self.attend(q, k, v, self.scale, ctx)?;
        ctx.profile.mark(Phase::Attention);
        let attn = match gate {
            Some(g) => gate_output(&attn, &g)?,
            None => attn,
        };
        self.o.forward(&attn)
    }

    /// `[T, heads * head_dim]`: the CUDA kernel over the whole batch where it serves, the fused
    /// CPU kernel for f32 on the CPU, otherwise one portable pass per sequence.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, ctx: &BatchCtx) -> candle_core::Result<Tensor> {
        let t = q.dim(0)?;
        #[cfg(feature = "cuda")]
        if let Some(tiles) = &ctx.tiles {
            let sinks = self.sinks.as_ref().map(|(_, t)| t);
            return crate::engine::cuda::attention::packed_attention(q, k, v, tiles, scale, self.window, sinks)?
                .reshape((t, self.heads * self.head_dim));
        }
        if super::cpu_attention::supported(q) {
            let sinks = self.sinks.as_ref().map(|(s, _)| s.as_slice());
            return super::cpu_attention::packed_attention(q, k, v, &ctx.seqs, scale as f32, self.window, sinks);
        }
        let sinks = self.sinks.as_ref().map(|(_, t)| t);
        let mut outs = Vec::with_capacity(ctx.seqs.len());
        for &(start, len) in &ctx.seqs {
            let masks = ctx.masks.get(&(len, self.window)).ok_or_else(|| {
                candle_core::Error::Msg(format!("no mask for length {len}, window {:?}", self.window))
            })?;
            outs.push(sequence_attention(
                &q.narrow(0, start, len)?,
                &k.narrow(0, start, len)?,
                &v.narrow(0, start, len)?,
                scale,
                masks,
                sinks,
            )?);
        }
        let out = if outs.len() == 1 { outs.swap_remove(0) } else { Tensor::cat(&outs, 0)? };
        debug_assert_eq!(out.dim(0)?, t);
        Ok(out)
    }
}

/// `attn * sigmoid(gate)`, both `[T, heads * head_dim]`; on CUDA past 2^31 elements in slices
/// of rows (candle's element-wise kernels index in 32 bits).
fn gate_output(attn: &Tensor, gate: &Tensor) -> candle_core::Result<Tensor> {
    use crate::engine::large;
    let gated = |a: &Tensor, g: &Tensor| a * candle_nn::ops::sigmoid(g)?;
    let extent = large::row_extent(attn).max(large::row_extent(gate));
    let slice = |r0, n| gated(&attn.narrow(0, r0, n)?, &gate.narrow(0, r0, n)?);
    match large::by_rows(attn.device(), attn.dim(0)?, extent, slice)? {
        Some(y) => Ok(y),
        None => gated(attn, gate),
    }
}
