//! Sparse mixture of experts: a router (f32) choosing k experts per token and their weights as
//! the config's [`Routing`] says (a softmax then the top k, renormalised when the config says
//! so; or the top k logits then their softmax), gated experts (SwiGLU or the clamped SwiGLU,
//! with or without biases) run once each over the rows routed to them, and an optional shared
//! expert scaled by `sigmoid(x . shared_expert_gate)`.

use candle_core::{DType, Tensor, D};

use super::linear::Linear;
use super::mlp::GatedMlp;
use crate::engine::config::{
    DeepseekRouting, ExpertActivation, ExpertsLayout, GroupScore, MoeConfig, Routing, ScoreFunction,
};
use crate::engine::options::EngineOptions;
use crate::engine::profile::Profiler;
use crate::engine::weights::Weights;
use crate::engine::EngineError;

/// The experts: one MLP each, or (CUDA, 16-bit) their weights stacked for the grouped kernel.
enum Experts {
    PerExpert(Vec<GatedMlp>),
    /// `gate_up` `[E, 2I, H]` (each expert's gate rows, then its up rows), `down` `[E, H, I]`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Stacked {
        gate_up: Tensor,
        down: Tensor,
    },
    /// FP8 experts for the grouped FP8 kernel: `gate_up` `[E, 2I, H]`, `down` `[E, H, I]` in e4m3
    /// with their block scales.
    #[cfg(feature = "cuda")]
    StackedFp8 {
        gate_up: crate::engine::cuda::moe::Fp8Experts,
        down: crate::engine::cuda::moe::Fp8Experts,
    },
}

/// The router's input transform and per-expert scales (`MoeConfig::router_norm`).
struct RouterNorm {
    norm: super::norm::RmsNorm,
    /// `router.scale` `[hidden]`, in the compute dtype.
    scale: Tensor,
    /// `hidden^-1/2`.
    root: f64,
    /// `router.per_expert_scale` `[experts]`, f32.
    per_expert: Tensor,
}

/// [`Routing::Deepseek`]'s parameters, the router's f32 weight transposed `[hidden, E]` and its
/// f32 score correction bias.
type DeepseekRouter = (DeepseekRouting, Tensor, Option<Vec<f32>>);

pub struct SparseMoe {
    router: Linear,
    router_norm: Option<RouterNorm>,
    experts: Experts,
    /// The shared expert and its gate's weight row `[1, hidden]`.
    shared: Option<(GatedMlp, Tensor)>,
    top_k: usize,
    norm_topk_prob: bool,
    routing: Routing,
    /// [`Routing::Deepseek`]: its parameters, the router's weight transposed `[hidden, E]` and
    /// its score correction bias, both f32 (transformers keeps them in f32 whatever the dtype).
    deepseek: Option<Box<DeepseekRouter>>,
    /// Shared experts added without a gate (`shared_experts`, DeepSeek).
    plain_shared: Option<Box<GatedMlp>>,
}

/// The experts of `{prefix}.experts`, stored either fused (`gate_up_proj` [E, 2I, H] with the
/// gate rows first, `down_proj` [E, H, I]) or one module per expert; stacked for the experts'
/// CUDA kernels where they serve and `o.cuda_moe` leaves them on.
fn load_experts(
    w: &Weights,
    prefix: &str,
    m: &MoeConfig,
    hidden: usize,
    o: &EngineOptions,
) -> Result<Experts, EngineError> {
    #[cfg(not(feature = "cuda"))]
    let _ = o;
    if m.layout == ExpertsLayout::Interleaved {
        return Ok(Experts::PerExpert(load_interleaved(w, prefix, m, hidden)?));
    }
    if !grouped_kernels_compute(m) {
        return Ok(Experts::PerExpert(load_per_expert(w, prefix, m, hidden)?));
    }
    // FP8 experts (stored so, or quantised at load by `--quantize fp8`, fused ones included) run
    // in the grouped FP8 kernel where it serves (whole 128-blocks, a GPU with FP8 tensor cores,
    // the FP8 GEMMs on); otherwise one FP8 projection chain per expert.
    #[cfg(feature = "cuda")]
    if let Some(experts) = load_fp8_grouped(w, prefix, m, hidden, o)? {
        return Ok(experts);
    }
    #[cfg(feature = "cuda")]
    if o.cuda_moe
        && !w.is_fp8(&format!("{prefix}.experts.0.gate_proj.weight"))
        && !w.is_fp8(&format!("{prefix}.experts.gate_up_proj"))
        && crate::engine::cuda::moe::supported(
            &w.device,
            w.dtype,
            hidden,
            m.expert_intermediate_size,
            m.num_experts,
            m.experts_per_token,
        )
    {
        let (e, i) = (m.num_experts, m.expert_intermediate_size);
        let fused = format!("{prefix}.experts.gate_up_proj");
        if w.has(&fused) {
            let gate_up = w.get(&fused, &[e, 2 * i, hidden])?;
            let down = w.get(&format!("{prefix}.experts.down_proj"), &[e, hidden, i])?;
            return Ok(Experts::Stacked { gate_up, down });
        }
        if w.has(&format!("{prefix}.experts.0.gate_proj.weight")) {
            let one = |x: usize, n: &str, shape: &[usize]| w.get(&format!("{prefix}.experts.{x}.{n}.weight"), shape);
            let mut gate_up = Vec::with_capacity(e);
            let mut down = Vec::with_capacity(e);
            for x in 0..e {
                gate_up.push(Tensor::cat(&[one(x, "gate_proj", &[i, hidden])?, one(x, "up_proj", &[i, hidden])?], 0)?);
                down.push(one(x, "down_proj", &[hidden, i])?);
            }
            return Ok(Experts::Stacked { gate_up: Tensor::stack(&gate_up, 0)?, down: Tensor::stack(&down, 0)? });
        }
    }
    Ok(Experts::PerExpert(load_per_expert(w, prefix, m, hidden)?))
}

/// Whether the experts' grouped CUDA kernels compute this block as the reference does: they route
/// by a softmax over every expert then the top k, without biases, and join gate and up by SiLU.
/// Other blocks run one matmul chain per expert, whose ops compute every variant.
fn grouped_kernels_compute(m: &MoeConfig) -> bool {
    m.routing == Routing::SoftmaxTopK
        && !m.router_bias
        && !m.expert_bias
        && !m.router_norm
        && m.activation == ExpertActivation::Silu
}

/// How `/v1/info` and the start-up log name the grouped FP8 experts' path.
#[cfg(feature = "cuda")]
pub const FP8_GROUPED: &str =
    "experts' projections on the FP8 tensor cores (e4m3 weights, one grouped mma.sync kernel per projection)";

/// FP8 experts for the grouped FP8 kernel, where it serves: whole 128-blocks, a GPU with FP8
/// tensor cores, the FP8 GEMMs and the experts' kernels on. `None` where it does not (the
/// experts are then loaded as they would be without it); FP8 experts whose projections are not
/// all kept in e4m3 run one chain per expert.
#[cfg(feature = "cuda")]
fn load_fp8_grouped(
    w: &Weights,
    prefix: &str,
    m: &MoeConfig,
    hidden: usize,
    o: &EngineOptions,
) -> Result<Option<Experts>, EngineError> {
    use crate::engine::cuda::moe as cuda_moe;
    let fp8 = w.is_fp8(&format!("{prefix}.experts.0.gate_proj.weight"))
        || w.is_fp8(&format!("{prefix}.experts.gate_up_proj"));
    let (i, e, k) = (m.expert_intermediate_size, m.num_experts, m.experts_per_token);
    if !(fp8
        && o.cuda_moe
        && w.fp8_gemm
        && cuda_moe::supported(&w.device, w.dtype, hidden, i, e, k)
        && cuda_moe::fp8_supported(&w.device, w.dtype, hidden, i))
    {
        return Ok(None);
    }
    let experts = load_per_expert(w, prefix, m, hidden)?;
    let parts: Option<Vec<_>> = experts.iter().map(GatedMlp::fp8_weights).collect();
    let Some(parts) = parts else { return Ok(Some(Experts::PerExpert(experts))) };
    let gate_up: Vec<_> = parts.iter().map(|p| p.0).collect();
    let down: Vec<_> = parts.iter().map(|p| p.1).collect();
    // Each expert's gate, up and down were counted as cuBLASLt GEMMs when loaded.
    w.recount_fp8(super::linear::FP8_TENSOR_CORES, FP8_GROUPED, 3 * experts.len());
    Ok(Some(Experts::StackedFp8 {
        gate_up: cuda_moe::Fp8Experts::stack(&gate_up)?,
        down: cuda_moe::Fp8Experts::stack(&down)?,
    }))
}

fn load_per_expert(w: &Weights, prefix: &str, m: &MoeConfig, hidden: usize) -> Result<Vec<GatedMlp>, EngineError> {
    let (e, i) = (m.num_experts, m.expert_intermediate_size);
    let fuse = w.device.is_cuda();
    let fused = format!("{prefix}.experts.gate_up_proj");
    if w.has(&fused) {
        let gate_up = Fused::load(w, &fused, &[e, 2 * i, hidden], 2)?;
        let down = Fused::load(w, &format!("{prefix}.experts.down_proj"), &[e, hidden, i], 1)?;
        return (0..e)
            .map(|x| {
                let (gate, up) = (gate_up.projection(w, x, 0)?, gate_up.projection(w, x, 1)?);
                Ok(GatedMlp::new(gate, up, down.projection(w, x, 0)?, fuse)?.activated(m.activation))
            })
            .collect();
    }
    if !w.has(&format!("{prefix}.experts.0.gate_proj.weight")) {
        let p = w.full_name(prefix);
        return Err(EngineError::Load(format!(
            "the experts of {p} are missing: expected {p}.experts.gate_up_proj (fused) or \
             {p}.experts.N.gate_proj.weight (one per expert); the checkpoint is incomplete or does not match \
             config.json"
        )));
    }
    (0..e)
        .map(|x| Ok(GatedMlp::load(w, &format!("{prefix}.experts.{x}"), hidden, i, false)?.activated(m.activation)))
        .collect()
}

/// The experts of [`ExpertsLayout::Interleaved`]: `gate_up_proj` and `down_proj` from their
/// MXFP4 blocks (rows `out`: `[E, 2I, H]`, `[E, H, I]`) or as floats multiplied as `x W`
/// (`[E, H, 2I]`, `[E, I, H]`); each expert's gate is column (or row) `2j` of `gate_up_proj`, its
/// up `2j + 1`, and so are the halves of `gate_up_proj_bias` `[E, 2I]`; `down_proj_bias` `[E, H]`.
fn load_interleaved(w: &Weights, prefix: &str, m: &MoeConfig, hidden: usize) -> Result<Vec<GatedMlp>, EngineError> {
    let (e, i) = (m.num_experts, m.expert_intermediate_size);
    let p = format!("{prefix}.experts");
    let bias = |name: &str, n: usize| w.get_opt(&format!("{p}.{name}"), &[e, n], m.expert_bias);
    let (gate_up_bias, down_bias) = (bias("gate_up_proj_bias", 2 * i)?, bias("down_proj_bias", hidden)?);
    // Row (or bias entry) `2j + part` of `[2I, ..]` as `[I, ..]`.
    let half = |t: Tensor, part: usize| -> candle_core::Result<Tensor> {
        let mut dims = t.dims().to_vec();
        dims[0] = i;
        dims.insert(1, 2);
        t.contiguous()?.reshape(dims)?.narrow(1, part, 1)?.squeeze(1)?.contiguous()
    };
    // On a GPU, MXFP4 experts stay 4-bit (a quarter of their bf16 bytes: gpt-oss-120b's fit one
    // 80 GB card) and are dequantised into the compute dtype for each product.
    #[cfg(feature = "cuda")]
    if w.device.is_cuda() {
        if let Some((gu_blocks, gu_scales)) = w.get_mxfp4_packed(&format!("{p}.gate_up_proj"), &[e, 2 * i, hidden])? {
            let Some((d_blocks, d_scales)) = w.get_mxfp4_packed(&format!("{p}.down_proj"), &[e, hidden, i])? else {
                return Err(EngineError::Load(format!(
                    "{}: gate_up_proj is stored in MXFP4 and down_proj is not; both or neither",
                    w.full_name(&p)
                )));
            };
            return (0..e)
                .map(|x| {
                    let gu_bias = gate_up_bias.as_ref().map(|b| b.get(x)).transpose()?;
                    let part = |k: usize| -> Result<Linear, EngineError> {
                        let b = gu_bias.clone().map(|b| half(b, k)).transpose()?;
                        Ok(Linear::from_mxfp4(half(gu_blocks.get(x)?, k)?, half(gu_scales.get(x)?, k)?, b))
                    };
                    let d_bias = down_bias.as_ref().map(|b| b.get(x)).transpose()?;
                    let down =
                        Linear::from_mxfp4(d_blocks.get(x)?.contiguous()?, d_scales.get(x)?.contiguous()?, d_bias);
                    Ok(GatedMlp::with_activation(part(0)?, part(1)?, down, m.activation))
                })
                .collect();
        }
    }
    // Both as `[E, out, in]` (a transposed view of the float tensors).
    let rows = |name: &str, out: usize, inp: usize| -> Result<Tensor, EngineError> {
        let name = format!("{p}.{name}");
        match w.get_mxfp4(&name, &[e, out, inp])? {
            Some(t) => Ok(t),
            None => Ok(w.get(&name, &[e, inp, out])?.transpose(1, 2)?),
        }
    };
    let gate_up = rows("gate_up_proj", 2 * i, hidden)?;
    let down = rows("down_proj", hidden, i)?;
    (0..e)
        .map(|x| {
            let gu = gate_up.get(x)?;
            let gu_bias = gate_up_bias.as_ref().map(|b| b.get(x)).transpose()?;
            let part = |k: usize| -> Result<Linear, EngineError> {
                let bias = gu_bias.clone().map(|b| half(b, k)).transpose()?;
                Ok(Linear::from_weight(half(gu.clone(), k)?, bias)?)
            };
            let down_bias = down_bias.as_ref().map(|b| b.get(x)).transpose()?;
            let down = Linear::from_weight(down.get(x)?.contiguous()?, down_bias)?;
            Ok(GatedMlp::with_activation(part(0)?, part(1)?, down, m.activation))
        })
        .collect()
}

/// A tensor of experts fused along its first dimension (`[E, parts * N, K]`: `gate_up_proj`
/// holds each expert's gate rows then its up rows, `down_proj` one projection per expert).
enum Fused<'a> {
    Float {
        t: Tensor,
        n: usize,
    },
    /// Quantised at load (`--quantize fp8`), one projection of one expert at a time.
    Fp8(crate::engine::weights::Fp8Stacked<'a>),
}

impl<'a> Fused<'a> {
    fn load(w: &'a Weights, name: &str, shape: &[usize], parts: usize) -> Result<Self, EngineError> {
        Ok(match w.get_fp8_stacked(name, shape, parts)? {
            Some(q) => Fused::Fp8(q),
            None => Fused::Float { t: w.get(name, shape)?, n: shape[1] / parts },
        })
    }

    /// Part `part` of expert `x` as a projection.
    fn projection(&self, w: &Weights, x: usize, part: usize) -> Result<Linear, EngineError> {
        match self {
            Fused::Float { t, n } => Ok(Linear::from_weight(t.get(x)?.narrow(0, part * n, *n)?, None)?),
            Fused::Fp8(q) => Linear::from_fp8(w, q.get(x, part)?),
        }
    }
}

impl SparseMoe {
    /// `{prefix}` is the layer's `mlp`: router `gate`, `experts`, `shared_expert(_gate)` (or the
    /// layer itself, for experts beside a dense MLP: `router`, `experts`). `eps`: the router
    /// norm's epsilon.
    pub fn load(
        w: &Weights,
        prefix: &str,
        m: &MoeConfig,
        hidden: usize,
        eps: f64,
        o: &EngineOptions,
    ) -> Result<Self, EngineError> {
        if m.routing == Routing::Deepseek && w.device.is_cuda() {
            return Err(EngineError::Load("DeepSeek's routing is not computed on a CUDA device".into()));
        }
        let deepseek = match (&m.deepseek, m.routing) {
            (Some(r), Routing::Deepseek) => {
                let router = w.get_f32(&format!("{prefix}.{}.weight", m.router), &[m.num_experts, hidden])?;
                let bias = match r.correction_bias {
                    true => Some(
                        w.get_f32(&format!("{prefix}.{}.e_score_correction_bias", m.router), &[m.num_experts])?
                            .to_device(&candle_core::Device::Cpu)?
                            .to_vec1()?,
                    ),
                    false => None,
                };
                Some(Box::new((r.clone(), router.t()?.contiguous()?, bias)))
            }
            (None, Routing::Deepseek) => {
                return Err(EngineError::Load("DeepSeek's routing without its parameters".into()));
            }
            _ => None,
        };
        let plain_shared = match (m.ungated_shared_experts, m.shared_expert_intermediate_size) {
            (true, Some(s)) => {
                Some(Box::new(GatedMlp::load(w, &format!("{prefix}.shared_experts"), hidden, s, false)?))
            }
            _ => None,
        };
        let shared = match m.shared_expert_intermediate_size.filter(|_| !m.ungated_shared_experts) {
            Some(s) => Some((
                GatedMlp::load(w, &format!("{prefix}.shared_expert"), hidden, s, false)?,
                w.get(&format!("{prefix}.shared_expert_gate.weight"), &[1, hidden])?,
            )),
            None => None,
        };
        let router_norm = match m.router_norm {
            true => Some(RouterNorm {
                norm: super::norm::RmsNorm::scale_free(w, hidden, eps)?,
                scale: w.get(&format!("{prefix}.router.scale"), &[hidden])?,
                root: (hidden as f64).powf(-0.5),
                per_expert: w.get_f32(&format!("{prefix}.router.per_expert_scale"), &[m.num_experts])?,
            }),
            false => None,
        };
        Ok(SparseMoe {
            router: Linear::load(w, &format!("{prefix}.{}", m.router), m.num_experts, hidden, m.router_bias)?,
            router_norm,
            experts: load_experts(w, prefix, m, hidden, o)?,
            shared,
            top_k: m.experts_per_token,
            norm_topk_prob: m.norm_topk_prob,
            routing: m.routing,
            deepseek,
            plain_shared,
        })
    }

    /// DeepSeek's routing ([`DeepseekRouting`]), row by row in f32 on the host: `[T, k]` expert
    /// indices and weights (in `x`'s dtype). A row with a non-finite logit gets NaN weights, so
    /// its output is NaN as the reference's.
    fn route_deepseek(
        &self,
        x: &Tensor,
        r: &DeepseekRouting,
        router_t: &Tensor,
        bias: Option<&[f32]>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let k = self.top_k;
        let logits = x.to_dtype(DType::F32)?.matmul(router_t)?.to_vec2::<f32>()?;
        let mut idx = Vec::with_capacity(logits.len() * k);
        let mut weights = Vec::with_capacity(logits.len() * k);
        for row in &logits {
            let (chosen, w) = deepseek_choice(row, r, bias, k, self.norm_topk_prob);
            idx.extend(chosen);
            weights.extend(w);
        }
        let t = logits.len();
        let dev = x.device();
        let idx = Tensor::from_vec(idx, (t, k), dev)?;
        let weights = Tensor::from_vec(weights, (t, k), dev)?.to_dtype(x.dtype())?;
        Ok((idx, weights))
    }

    /// `[T, k]` expert indices and routing weights (in `x`'s dtype), best first.
    fn route(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        if let Some((r, router_t, bias)) = self.deepseek.as_deref() {
            return self.route_deepseek(x, r, router_t, bias.as_deref());
        }
        let logits = match &self.router_norm {
            // norm(x) * scale (in the compute dtype), then * hidden^-1/2 (in f32, rounded once).
            Some(r) => {
                let scaled = r.norm.forward(x)?.broadcast_mul(&r.scale)?;
                let scaled = scaled.to_dtype(DType::F32)?.affine(r.root, 0.0)?.to_dtype(x.dtype())?;
                self.router.forward(&scaled)?
            }
            None => self.router.forward(x)?,
        }
        .to_dtype(DType::F32)?;
        if self.routing == Routing::TopKSoftmax {
            // The k largest logits (a NaN sorted below every logit, as below), then a softmax
            // over those k, gathered from the logits themselves so a NaN row stays NaN.
            let keys = logits.eq(&logits)?.where_cond(&logits, &logits.ones_like()?.affine(0.0, f64::NEG_INFINITY)?)?;
            let idx = keys.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, self.top_k)?.contiguous()?;
            let top = candle_nn::ops::softmax_last_dim(&logits.gather(&idx, D::Minus1)?)?;
            return Ok((idx, top.to_dtype(x.dtype())?));
        }
        let probs = candle_nn::ops::softmax_last_dim(&logits)?;
        // A non-finite state makes its row's probabilities NaN. The sort's keys put a NaN below
        // every probability (a NaN is unordered, and a comparison that is no total order may
        // panic), while the weights are gathered from `probs`, so they stay NaN and the row's
        // output is NaN, as the reference's.
        let keys = probs.eq(&probs)?.where_cond(&probs, &probs.ones_like()?.neg()?)?;
        let idx = keys.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, self.top_k)?.contiguous()?;
        let mut top = probs.gather(&idx, D::Minus1)?;
        if self.norm_topk_prob {
            top = top.broadcast_div(&top.sum_keepdim(D::Minus1)?)?;
        }
        if let Some(r) = &self.router_norm {
            let (t, k) = idx.dims2()?;
            top = (top * r.per_expert.index_select(&idx.flatten_all()?, 0)?.reshape((t, k))?)?;
        }
        Ok((idx, top.to_dtype(x.dtype())?))
    }

    /// `x`: the normed input `[T, hidden]`; returns the block's output `[T, hidden]`.
    /// `profile`: the forward pass's clock, whose phase the CUDA kernels' path splits (it marks
    /// `moe_route`, `moe_experts` and `moe_combine` on a clock of its own).
    pub fn forward(&self, x: &Tensor, profile: &Profiler) -> candle_core::Result<Tensor> {
        self.forward_routed(x, x, profile)
    }

    /// As [`SparseMoe::forward`], the tokens routed by `r` (`[T, hidden]`; the router's own
    /// input where it differs from the experts').
    pub fn forward_routed(&self, x: &Tensor, r: &Tensor, profile: &Profiler) -> candle_core::Result<Tensor> {
        if self.router_norm.is_some() && !matches!(self.experts, Experts::PerExpert(_)) {
            candle_core::bail!("the normed router runs with the per-expert path only");
        }
        match &self.experts {
            #[cfg(feature = "cuda")]
            Experts::Stacked { gate_up, down } => self.forward_stacked(x, gate_up, down, profile),
            #[cfg(not(feature = "cuda"))]
            Experts::Stacked { .. } => {
                let _ = profile;
                candle_core::bail!("stacked experts need the cuda feature")
            }
            #[cfg(feature = "cuda")]
            Experts::StackedFp8 { gate_up, down } => self.forward_stacked_fp8(x, gate_up, down, profile),
            Experts::PerExpert(experts) => self.forward_per_expert(x, r, experts),
        }
    }

    /// The CUDA kernels' path (`cuda::moe`): routing, sorting by expert, both projections and
    /// the weighted sum (with the shared expert's gate) stay on the device. The weighted sum runs
    /// over the slots, best first, in f32, as on the other path; the routing weights stay f32.
    #[cfg(feature = "cuda")]
    fn forward_stacked(
        &self,
        x: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        profile: &Profiler,
    ) -> candle_core::Result<Tensor> {
        use crate::engine::cuda::moe as cuda_moe;
        let experts = down.dim(0)?;
        let tile_rows = cuda_moe::tile_rows(x.dim(0)? * self.top_k, experts);
        self.forward_grouped(x, experts, tile_rows, profile, |plan| {
            cuda_moe::grouped_matmul(&cuda_moe::grouped_swiglu(x, gate_up, plan)?, down, plan)
        })
    }

    /// The grouped FP8 kernel's path: as [`SparseMoe::forward_stacked`], with the tokens
    /// quantised once (per token, groups of 128, as every FP8 projection quantises its input),
    /// both projections in e4m3 with their block scales, and `silu(gate) * up` rounded to the
    /// compute dtype and quantised again for the down projection (as the per-expert chain does).
    #[cfg(feature = "cuda")]
    fn forward_stacked_fp8(
        &self,
        x: &Tensor,
        gate_up: &crate::engine::cuda::moe::Fp8Experts,
        down: &crate::engine::cuda::moe::Fp8Experts,
        profile: &Profiler,
    ) -> candle_core::Result<Tensor> {
        use crate::engine::cuda::{fp8 as cuda_fp8, moe as cuda_moe};
        self.forward_grouped(x, down.q.dim(0)?, cuda_moe::TILE_ROWS[0], profile, |plan| {
            let (xq, xs) = cuda_fp8::quantise(x)?;
            let h = cuda_moe::grouped_fp8_swiglu(&xq, &xs, gate_up, plan, x.dtype())?;
            let (hq, hs) = cuda_fp8::quantise(&h)?;
            cuda_moe::grouped_fp8_matmul(&hq, &hs, down, plan, x.dtype())
        })
    }

    /// Routing and sorting of `x`'s tokens over `experts` experts (in tiles of `tile_rows`
    /// rows), `experts_out` (the experts'
    /// outputs `[T k, H]` in the plan's row order), then the weighted sum with the shared expert,
    /// all on the device; the phases marked on a clock of their own.
    #[cfg(feature = "cuda")]
    fn forward_grouped(
        &self,
        x: &Tensor,
        experts: usize,
        tile_rows: usize,
        profile: &Profiler,
        experts_out: impl FnOnce(&crate::engine::cuda::moe::Plan) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        use crate::engine::cuda::moe as cuda_moe;
        use crate::engine::profile::Phase;
        if x.dim(0)? == 0 {
            return x.zeros_like();
        }
        let profile = profile.nested();
        let (idx, weights) = cuda_moe::route(&self.router.forward(x)?, self.top_k, self.norm_topk_prob)?;
        let plan = cuda_moe::plan(&idx, experts, tile_rows)?;
        profile.mark(Phase::MoeRoute);
        let ys = experts_out(&plan)?;
        profile.mark(Phase::MoeExperts);
        let out = match &self.shared {
            Some((mlp, gate)) => cuda_moe::combine(&ys, &plan, &weights, Some((&mlp.forward(x)?, x, gate)))?,
            None => cuda_moe::combine(&ys, &plan, &weights, None)?,
        };
        profile.mark(Phase::MoeCombine);
        Ok(out)
    }

    /// One matmul chain per expert (CPU, f32 on CUDA, or `LAYERTAP_CUDA_MOE=0`:
    /// `EngineOptions::cuda_moe`).
    ///
    /// The `(token, slot)` pairs are sorted by expert (stably) and the tokens gathered once in
    /// that order, so each expert runs one matmul chain over a contiguous block of rows; the
    /// results are gathered back slot by slot and summed over the slots, best first, in f32 (a
    /// fixed order: a token's sum does not depend on its batch mates).
    fn forward_per_expert(&self, x: &Tensor, r: &Tensor, experts: &[GatedMlp]) -> candle_core::Result<Tensor> {
        let t = x.dim(0)?;
        let k = self.top_k;
        let (idx, weights) = self.route(r)?;
        let choices = idx.to_vec2::<u32>()?;
        let mut counts = vec![0usize; experts.len()];
        for &e in choices.iter().flatten() {
            *counts.get_mut(e as usize).ok_or_else(|| candle_core::Error::Msg(format!("expert {e}")))? += 1;
        }
        let starts: Vec<usize> = counts.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let mut next = starts.clone();
        // tokens[r]: the token of sorted row r; row_of[slot * T + tok]: that pair's sorted row
        // (slot-major, so each slot's rows come back as one contiguous block).
        let mut tokens = vec![0u32; t * k];
        let mut row_of = vec![0u32; t * k];
        for (tok, choice) in choices.iter().enumerate() {
            for (j, &e) in choice.iter().enumerate() {
                let r = next[e as usize];
                next[e as usize] += 1;
                tokens[r] = tok as u32;
                row_of[j * t + tok] = r as u32;
            }
        }
        let dev = x.device();
        let sorted = x.index_select(&Tensor::new(tokens.as_slice(), dev)?, 0)?;
        let mut outs = Vec::new();
        for (e, expert) in experts.iter().enumerate().filter(|(e, _)| counts[*e] > 0) {
            outs.push(expert.forward(&sorted.narrow(0, starts[e], counts[e])?)?);
        }
        let out = if outs.is_empty() {
            x.zeros_like()?
        } else {
            let back = Tensor::cat(&outs, 0)?.index_select(&Tensor::new(row_of.as_slice(), dev)?, 0)?; // [k * T, H]
            let w = weights.to_dtype(DType::F32)?;
            let mut acc: Option<Tensor> = None;
            for j in 0..k {
                let term = back.narrow(0, j * t, t)?.to_dtype(DType::F32)?.broadcast_mul(&w.narrow(1, j, 1)?)?;
                acc = Some(match acc {
                    None => term,
                    Some(a) => (a + term)?,
                });
            }
            acc.ok_or_else(|| candle_core::Error::Msg("no experts per token".into()))?.to_dtype(x.dtype())?
        };
        match &self.shared {
            Some((mlp, gate)) => {
                // A one-column matmul takes a different summation path for different row
                // counts on the CPU; a row-wise dot product gives every token the same bits
                // whatever else is in the batch.
                let logit = x.broadcast_mul(gate)?.sum_keepdim(1)?;
                out + mlp.forward(x)?.broadcast_mul(&candle_nn::ops::sigmoid(&logit)?)?
            }
            None => match &self.plain_shared {
                Some(mlp) => out + mlp.forward(x)?,
                None => Ok(out),
            },
        }
    }
}

/// One token's experts and weights under DeepSeek's routing, from its f32 router logits:
/// scores (sigmoid or softmax), the correction bias added for choosing only, the best
/// `topk_group` groups kept (ties to the lower index), the `k` best experts among them, their
/// scores as weights (over their sum plus 1e-20 when `norm`), times `routed_scaling_factor`.
fn deepseek_choice(
    logits: &[f32],
    r: &DeepseekRouting,
    bias: Option<&[f32]>,
    k: usize,
    norm: bool,
) -> (Vec<u32>, Vec<f32>) {
    let e = logits.len();
    if logits.iter().any(|l| !l.is_finite()) {
        return ((0..k as u32).collect(), vec![f32::NAN; k]);
    }
    let scores: Vec<f32> = match r.scores {
        ScoreFunction::Sigmoid => logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect(),
        ScoreFunction::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            exps.iter().map(|&x| x / sum).collect()
        }
    };
    let mut choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    // Best first; ties to the lower index.
    let best = |v: &[f32], n: usize| -> Vec<usize> {
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        order.truncate(n);
        order
    };
    if let Some((groups, topk_group, how)) = r.groups {
        let size = e / groups;
        let group_scores: Vec<f32> = choice
            .chunks(size)
            .map(|g| {
                let top = best(g, 2);
                match how {
                    GroupScore::Max => g[top[0]],
                    GroupScore::TopTwoSum => g[top[0]] + g[top[1]],
                }
            })
            .collect();
        let kept = best(&group_scores, topk_group);
        for (gi, g) in choice.chunks_mut(size).enumerate() {
            if !kept.contains(&gi) {
                g.iter_mut().for_each(|c| *c = f32::NEG_INFINITY);
            }
        }
    }
    let chosen = best(&choice, k);
    let mut w: Vec<f32> = chosen.iter().map(|&i| scores[i]).collect();
    if norm {
        let denominator = w.iter().sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|x| *x /= denominator);
    }
    let scale = r.routed_scaling_factor as f32;
    w.iter_mut().for_each(|x| *x *= scale);
    (chosen.into_iter().map(|i| i as u32).collect(), w)
}
