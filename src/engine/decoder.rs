//! The decoder of every family: embeddings, one [`Block`] per layer (its mixer and
//! feed-forward chosen by the config's layer specs), the final norm, and the tap loop over
//! packed sequences, written once.

use candle_core::{DType, Tensor};

use super::batch::{BatchCtx, BatchKernels};
use super::config::{FfnKind, MixerKind, ModelConfig};
use super::layers::attention::{Attention, KeyValues};
use super::layers::gdn::GatedDeltaNet;
use super::layers::linear::residual;
use super::layers::mla::LatentAttention;
use super::layers::mlp::GatedMlp;
use super::layers::moe::SparseMoe;
use super::layers::norm::RmsNorm;
use super::layers::per_layer::{PerLayerEmbeddings, PerLayerInputGate};
use super::layers::rope::Rope;
use super::options::EngineOptions;
use super::profile::Phase;
use super::stages::{device_of, micro_batches, overlap_between, Stage};
use super::weights::Weights;
use super::{Cancel, EngineError};

pub enum Mixer {
    Attention(Attention),
    GatedDeltaNet(GatedDeltaNet),
    LatentAttention(LatentAttention),
}

pub enum Ffn {
    Dense(GatedMlp),
    Moe(SparseMoe),
    DenseAndMoe(Box<DenseAndMoe>),
}

/// A dense MLP and experts side by side ([`FfnKind::DenseAndMoe`]): `post_mlp(mlp(h)) +
/// post_moe(experts(pre_moe(x)))`, the experts routed from the residual stream `x` itself.
pub struct DenseAndMoe {
    mlp: GatedMlp,
    post_mlp: RmsNorm,
    pre_moe: RmsNorm,
    moe: SparseMoe,
    post_moe: RmsNorm,
}

/// The norms after each sublayer and the layer's scalar ([`ModelConfig::sandwich_norms`]).
struct Sandwich {
    post_attention: RmsNorm,
    post_ffn: RmsNorm,
    /// `layer_scalar` `[1]`, in the compute dtype.
    scalar: Tensor,
}

/// One decoder layer: `x + mixer(norm(x))`, then `x + ffn(norm(x))`; with sandwich norms
/// `x + post_attn(mixer(norm(x)))`, then `(x + post_ffn(ffn(pre_ffn(x)))) * layer_scalar`. With
/// per-layer inputs, the layer's input joins through its gate after the feed-forward block
/// (before the scalar); an attention layer may attend over an earlier layer's keys and values.
pub struct Block {
    input_norm: RmsNorm,
    mixer: Mixer,
    /// The earlier layer whose keys and values this one attends over ([`ModelConfig::kv_sources`]).
    kv_source: Option<usize>,
    /// A later layer attends over this one's keys and values: they are kept.
    keeps_kv: bool,
    per_layer: Option<PerLayerInputGate>,
    /// The norm before the feed-forward block (`post_attention_layernorm`, or
    /// `pre_feedforward_layernorm` with sandwich norms).
    post_norm: RmsNorm,
    ffn: Ffn,
    sandwich: Option<Sandwich>,
}

impl Block {
    fn load(w: &Weights, c: &ModelConfig, i: usize, o: &EngineOptions) -> Result<Self, EngineError> {
        let p = format!("layers.{i}");
        let spec = c.layers[i];
        let h = c.hidden_size;
        let norm = |n: &str| {
            let norm = RmsNorm::load_for(w, c, &format!("{p}.{n}"))?;
            Ok::<_, EngineError>(norm.fusing_add(o.fused_add_norm))
        };
        let kv_source = c.kv_source(i);
        let mixer = match spec.mixer {
            MixerKind::FullAttention | MixerKind::SlidingAttention if kv_source.is_some() => {
                Mixer::Attention(Attention::load_reusing_kv(w, c, &format!("{p}.self_attn"), spec.mixer, o)?)
            }
            MixerKind::FullAttention | MixerKind::SlidingAttention => {
                Mixer::Attention(Attention::load(w, c, &format!("{p}.self_attn"), spec.mixer, o)?)
            }
            _ if kv_source.is_some() => {
                return Err(EngineError::Load(format!("layer {i}: only attention layers reuse keys and values")))
            }
            MixerKind::LinearAttention => {
                Mixer::GatedDeltaNet(GatedDeltaNet::load(w, c, &format!("{p}.linear_attn"), o)?)
            }
            MixerKind::LatentAttention => {
                Mixer::LatentAttention(LatentAttention::load(w, c, &format!("{p}.self_attn"))?)
            }
        };
        let m = format!("{p}.mlp");
        let width = c.intermediate_size_of(i);
        let mlp = || Ok::<_, EngineError>(GatedMlp::load(w, &m, h, width, c.mlp_bias)?.activated(c.mlp_activation));
        let eps = c.rms_norm_eps;
        let ffn = match (spec.ffn, &c.moe) {
            (FfnKind::Dense, _) => Ffn::Dense(mlp()?),
            (FfnKind::Moe, Some(moe)) => Ffn::Moe(SparseMoe::load(w, &m, moe, h, eps, o)?),
            (FfnKind::DenseAndMoe, Some(moe)) => Ffn::DenseAndMoe(Box::new(DenseAndMoe {
                mlp: mlp()?,
                post_mlp: norm("post_feedforward_layernorm_1")?,
                pre_moe: norm("pre_feedforward_layernorm_2")?,
                moe: SparseMoe::load(w, &p, moe, h, eps, o)?,
                post_moe: norm("post_feedforward_layernorm_2")?,
            })),
            (FfnKind::Moe | FfnKind::DenseAndMoe, None) => {
                return Err(EngineError::Load(format!("layer {i}: MoE without num_experts")))
            }
        };
        let sandwich = match c.sandwich_norms {
            true => Some(Sandwich {
                post_attention: norm("post_attention_layernorm")?,
                post_ffn: norm("post_feedforward_layernorm")?,
                scalar: w.get(&format!("{p}.layer_scalar"), &[1])?,
            }),
            false => None,
        };
        let post_norm = norm(if c.sandwich_norms { "pre_feedforward_layernorm" } else { "post_attention_layernorm" })?;
        let per_layer = c.per_layer_inputs.as_ref().map(|pl| PerLayerInputGate::load(w, c, &p, pl)).transpose()?;
        Ok(Block {
            input_norm: norm("input_layernorm")?,
            mixer,
            kv_source,
            keeps_kv: c.kv_reused(i),
            per_layer,
            post_norm,
            ffn,
            sandwich,
        })
    }

    /// One layer on `x`, given `h`, its input norm of `x`, and what it takes from outside the
    /// stream: its per-layer input `[T, width]` and the keys and values it reuses. Returns the
    /// layer's output and, where `next` is given and one kernel does the last residual add with it
    /// (CUDA), that norm of the output (the post-attention norm comes with the first add the same
    /// way); and its keys and values where a later layer reuses them.
    fn forward(
        &self,
        x: &Tensor,
        h: &Tensor,
        next: Option<&RmsNorm>,
        ctx: &BatchCtx,
        input: Option<&Tensor>,
        reused: Option<&KeyValues>,
    ) -> candle_core::Result<(Tensor, Option<Tensor>, Option<KeyValues>)> {
        let profile = &ctx.profile;
        profile.restart();
        let (mixed, kv) = match &self.mixer {
            Mixer::Attention(a) => {
                let (y, kv) = a.forward_with(h, ctx, reused)?;
                (y, self.keeps_kv.then_some(kv))
            }
            Mixer::GatedDeltaNet(g) => (g.forward(h, ctx)?, None),
            Mixer::LatentAttention(a) => (a.forward(h, ctx)?, None),
        };
        let (x, h) = match &self.sandwich {
            Some(s) => self.post_norm.add_forward(x, &s.post_attention.forward(&mixed)?)?,
            None => self.post_norm.add_forward(x, &mixed)?,
        };
        let y = match &self.ffn {
            Ffn::Dense(m) => m.forward(&h)?,
            Ffn::Moe(m) => {
                profile.mark(Phase::OProjMlp);
                let y = m.forward(&h, profile)?;
                profile.mark(Phase::Moe);
                y
            }
            Ffn::DenseAndMoe(d) => {
                let dense = d.post_mlp.forward(&d.mlp.forward(&h)?)?;
                profile.mark(Phase::OProjMlp);
                let experts = d.moe.forward_routed(&d.pre_moe.forward(&x)?, &x, profile)?;
                profile.mark(Phase::Moe);
                (dense + d.post_moe.forward(&experts)?)?
            }
        };
        let per_layer = match (&self.per_layer, input) {
            (Some(p), Some(input)) => Some((p, input)),
            (None, _) => None,
            (Some(_), None) => candle_core::bail!("a layer with a per-layer input was given none"),
        };
        if let Some(s) = &self.sandwich {
            let mut out = residual(&x, &s.post_ffn.forward(&y)?)?;
            if let Some((p, input)) = per_layer {
                out = p.forward(&out, input)?;
            }
            let out = out.broadcast_mul(&s.scalar.to_dtype(out.dtype())?)?;
            profile.mark(Phase::OProjMlp);
            return Ok((out, None, kv));
        }
        // Where no kernel fuses them, the next norm waits for the next layer (this layer's
        // temporaries are gone by then, as they always were).
        let (out, normed) = match (next.filter(|n| n.fuses_add(&x, &y)), per_layer) {
            (_, Some((p, input))) => (p.forward(&residual(&x, &y)?, input)?, None),
            (Some(norm), None) => norm.add_forward(&x, &y).map(|(o, h)| (o, Some(h)))?,
            (None, None) => (residual(&x, &y)?, None),
        };
        profile.mark(Phase::OProjMlp);
        Ok((out, normed, kv))
    }
}

pub struct Decoder {
    pub cfg: ModelConfig,
    /// The switches it was loaded with.
    options: EngineOptions,
    /// Keep the residual stream in f32 while the model computes in bf16/f16 (CUDA, unless
    /// `EngineOptions::f32_residual` is off: then in the compute dtype, as Hugging Face does).
    f32_residual: bool,
    /// The kernels chosen at load that each batch prepares for.
    kernels: BatchKernels,
    embed: Tensor,
    layers: Vec<Block>,
    norm: RmsNorm,
    rope: Rope,
    /// The full-attention layers' own rotary embedding, where the config shapes them apart.
    full_rope: Option<Rope>,
    /// What the embeddings are multiplied by (`[1]`, in the compute dtype).
    embed_scale: Option<Tensor>,
    /// Every layer's own input per token ([`crate::engine::config::PerLayerInputs`]).
    per_layer: Option<PerLayerEmbeddings>,
    /// The output head `[vocab, hidden]` (the embeddings where the model ties them); `None` for
    /// a checkpoint that has none, or a decoder loaded for a few tokens only.
    head: Option<Tensor>,
    /// The stages the layers are split into, each with its device (one stage: every layer).
    stages: Vec<Stage>,
}

/// One batch on its way through the stages: what it asked for, what it has kept, and the
/// residual stream with what goes along with it from stage to stage.
struct Pass<'a> {
    cu_seqlens: &'a [usize],
    taps: &'a [usize],
    /// The decoder layers to run: those up to the deepest tap.
    deepest: usize,
    /// The states kept so far, by index (each on the device of the stage that made it).
    kept: Vec<Option<Tensor>>,
    /// The residual stream.
    x: Tensor,
    /// The next layer's input norm of `x`, where the layer before made it with its last add
    /// (only ever within a stage: the next norm's weights sit on the stage's device).
    normed: Option<Tensor>,
    /// The batch's context, and the device it was built on.
    ctx: Option<(candle_core::Device, BatchCtx)>,
    /// Every layer's own input `[T, L, width]` (on the first stage's device), where the model has them.
    per_layer: Option<Tensor>,
    /// The keys and values of the layers whose ones a later layer reuses.
    kept_kv: Vec<Option<KeyValues>>,
}

impl<'a> Pass<'a> {
    /// A pass for the batch of `cu_seqlens` whose residual stream is `x` (the embeddings).
    fn new(
        cu_seqlens: &'a [usize],
        taps: &'a [usize],
        deepest: usize,
        n: usize,
        x: Tensor,
        per_layer: Option<Tensor>,
    ) -> Self {
        let mut kept = vec![None; n + 2];
        if taps.contains(&0) {
            kept[0] = Some(x.clone());
        }
        Pass { cu_seqlens, taps, deepest, kept, x, normed: None, ctx: None, per_layer, kept_kv: vec![None; n] }
    }
}

impl Decoder {
    /// Loads every tensor the decoder needs and its output head (for next-token
    /// log-probabilities: `lm_head`, or the embeddings where the model ties them; never a vision
    /// tower or MTP head), with a progress callback per layer. Each layer picks its kernels now,
    /// as `options` say. Each stage's layers are read onto its device, the embeddings onto the
    /// first stage's and the final norm and head onto the last's (one stage: every part on one
    /// device).
    pub fn load(
        cfg: ModelConfig,
        w: &mut Weights,
        stages: Vec<Stage>,
        options: &EngineOptions,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        let shape = [cfg.vocab_size, cfg.hidden_size];
        let embed = w.on(&device_of(&stages, 0)?, |w| w.get("embed_tokens.weight", &shape))?;
        let mut d = Self::load_with(cfg, w, embed, None, stages, options, progress)?;
        let last = d.output_device().clone();
        d.head = match d.cfg.tie_word_embeddings {
            true => Some(d.embed.to_device(&last)?),
            false => w.on(&last, |w| w.get_head(&shape))?,
        };
        Ok(d)
    }

    /// [`Decoder::load`] with only the embedding rows of `tokens`, in one stage on the weights'
    /// device: token `tokens[i]` is then id `i` (for a decoder that runs a few known sequences,
    /// such as the self-check's reference).
    pub fn load_for_tokens(
        cfg: ModelConfig,
        w: &mut Weights,
        tokens: &[u32],
        options: &EngineOptions,
    ) -> Result<Self, EngineError> {
        let embed = w.get_rows("embed_tokens.weight", tokens, &[cfg.vocab_size, cfg.hidden_size])?;
        let bytes = w.stage_bytes(cfg.num_hidden_layers, cfg.tie_word_embeddings);
        let stages = super::stages::plan(&bytes, std::slice::from_ref(&w.device))?;
        Self::load_with(cfg, w, embed, Some(tokens), stages, options, |_, _| {})
    }

    /// `rows`: the tokens whose rows of the embedding tables were loaded, where not all were.
    fn load_with(
        cfg: ModelConfig,
        w: &mut Weights,
        embed: Tensor,
        rows: Option<&[u32]>,
        stages: Vec<Stage>,
        options: &EngineOptions,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self, EngineError> {
        let n = cfg.num_hidden_layers;
        let covered = stages.first().is_some_and(|s| s.layers.start == 0)
            && stages.last().is_some_and(|s| s.layers.end == n)
            && stages.windows(2).all(|p| p[0].layers.end == p[1].layers.start)
            && stages.iter().all(|s| !s.layers.is_empty());
        if !covered {
            let ranges: Vec<_> = stages.iter().map(|s| s.layers.clone()).collect();
            return Err(EngineError::Load(format!(
                "stages {ranges:?} do not split the {n} decoder layers into consecutive non-empty ranges"
            )));
        }
        let mut layers = Vec::with_capacity(n);
        for s in &stages {
            w.on(&s.device, |w| {
                for i in s.layers.clone() {
                    layers.push(Block::load(w, &cfg, i, options)?);
                    progress(i + 1, n);
                }
                Ok(())
            })?;
        }
        let last = device_of(&stages, stages.len() - 1)?;
        let norm = w.on(&last, |w| RmsNorm::load_for(w, &cfg, "norm"))?.fusing_add(options.fused_add_norm);
        // The per-layer tables go with the embeddings (the first stage); each layer's share of
        // what they give moves to its stage.
        let per_layer = match cfg.per_layer_inputs.as_ref() {
            Some(p) => Some(w.on(&device_of(&stages, 0)?, |w| PerLayerEmbeddings::load(w, &cfg, p, rows))?),
            None => None,
        };
        let rope = Rope::new(&cfg);
        let full_rope = Rope::full_attention(&cfg);
        let embed_scale = match cfg.embed_scale {
            // Rounded to the compute dtype first, as transformers does.
            Some(s) => Some(Tensor::new(&[s as f32], embed.device())?.to_dtype(embed.dtype())?),
            None => None,
        };
        let f32_residual =
            cfg!(feature = "cuda") && embed.device().is_cuda() && embed.dtype() != DType::F32 && options.f32_residual;
        let kernels = batch_kernels(&cfg, embed.device(), embed.dtype(), options);
        Ok(Decoder {
            cfg,
            options: options.clone(),
            embed,
            layers,
            norm,
            rope,
            full_rope,
            embed_scale,
            per_layer,
            f32_residual,
            kernels,
            head: None,
            stages,
        })
    }

    /// The output head `[vocab, hidden]`, where the model has one (on the last stage's device).
    pub fn head(&self) -> Option<&Tensor> {
        self.head.as_ref()
    }

    /// The switches the decoder was loaded with.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// The first stage's device: where the token ids and the embeddings are.
    pub fn device(&self) -> &candle_core::Device {
        self.embed.device()
    }

    /// The last stage's device: where the final norm and the head are, and where the states a
    /// batch asked for are gathered and prepared for the host.
    pub fn output_device(&self) -> &candle_core::Device {
        self.stages.last().map_or(self.embed.device(), |s| &s.device)
    }

    /// The stages, in order (one for a decoder on one device).
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    fn packing(&self, cu_seqlens: &[usize], device: &candle_core::Device) -> candle_core::Result<BatchCtx> {
        BatchCtx::new(
            &self.cfg,
            (&self.rope, self.full_rope.as_ref()),
            cu_seqlens,
            self.dtype(),
            device,
            self.kernels,
            self.options.profile,
        )
    }

    /// Runs the decoder on packed `ids` (on the first stage's device; sequence `i` is
    /// `cu_seqlens[i]..cu_seqlens[i + 1]`) and returns, for each entry of `taps` (indices in
    /// `0..=L + 1`, any order, repeats allowed), the `[T, hidden]` state Hugging Face reports as
    /// `hidden_states[i]` (and for `L + 1` the last layer's output before the final norm, which
    /// it does not report), on [`Decoder::output_device`]. Layers past the deepest tap are not
    /// run, and stages past it not entered. `layers_run` counts the decoder layers executed.
    /// Before each layer `cancel` is asked whether the batch is still wanted; once it is not, the
    /// loop stops with [`EngineError::Cancelled`] (on a GPU the kernels already queued finish on
    /// their own and their results are dropped). A batch of several sequences crosses stages on
    /// devices of their own (or the CPU) as micro-batches, the stages at work at once
    /// ([`micro_batches`]); otherwise the stages run one after the other.
    pub fn forward_taps(
        &self,
        ids: &Tensor,
        cu_seqlens: &[usize],
        taps: &[usize],
        layers_run: &mut usize,
        cancel: &Cancel,
    ) -> Result<Vec<Tensor>, EngineError> {
        let n = self.layers.len();
        let mut x = embed(&self.embed, ids)?;
        if let Some(s) = &self.embed_scale {
            x = x.broadcast_mul(s)?;
        }
        // Every layer's own input, from the tokens and their scaled embeddings.
        let per_layer = self.per_layer.as_ref().map(|p| p.forward(ids, &x)).transpose()?;
        if self.f32_residual {
            x = super::large::map_rows(&x, |x| x.to_dtype(DType::F32))?;
        }
        // Index n + 1 is the last layer's output before the final norm: every layer runs.
        let deepest = taps.iter().copied().max().unwrap_or(0).min(n);
        let stages: Vec<&Stage> = self.stages.iter().take_while(|s| s.layers.start < deepest).collect();
        let parts = micro_batches(cu_seqlens, stages.len());
        let out = self.output_device();
        // States are returned in the compute dtype (the f32 stream rounded once, before it moves:
        // fewer bytes to copy), on the output device.
        let finish = |t: &Tensor| -> Result<Tensor, EngineError> {
            Ok(super::large::map_rows(t, |t| t.to_dtype(self.dtype()))?.to_device(out)?)
        };
        let missing = |i: usize| EngineError::from(candle_core::Error::Msg(format!("layer {i} was not computed")));
        if parts.len() < 2 || !overlap_between(&stages) {
            let mut pass = Pass::new(cu_seqlens, taps, deepest, n, x, per_layer);
            for stage in stages {
                self.forward_stage(stage, &mut pass, layers_run, cancel)?;
            }
            return taps
                .iter()
                .map(|&i| finish(pass.kept.get(i).and_then(|k| k.as_ref()).ok_or_else(|| missing(i))?))
                .collect();
        }
        // Micro-batches through the stages at once: stage k runs micro-batch j while stage k + 1
        // runs j - 1. Each micro-batch holds whole sequences, so its states are those it has in
        // the whole batch; they are put back in order.
        let cus: Vec<Vec<usize>> = parts
            .iter()
            .map(|r| cu_seqlens[r.start..=r.end].iter().map(|&c| c - cu_seqlens[r.start]).collect())
            .collect();
        let mut passes = Vec::with_capacity(parts.len());
        for (r, cu) in parts.iter().zip(&cus) {
            let (t0, len) = (cu_seqlens[r.start], cu_seqlens[r.end] - cu_seqlens[r.start]);
            let pl = per_layer.as_ref().map(|t| t.narrow(0, t0, len)).transpose()?;
            passes.push(Pass::new(cu, taps, deepest, n, x.narrow(0, t0, len)?, pl));
        }
        let done = self.forward_overlapped(&stages, passes, cancel)?;
        *layers_run += deepest;
        taps.iter()
            .map(|&i| {
                if i == 0 {
                    return finish(&x);
                }
                let rows = done
                    .iter()
                    .map(|p| finish(p.kept.get(i).and_then(|k| k.as_ref()).ok_or_else(|| missing(i))?))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Tensor::cat(&rows, 0)?)
            })
            .collect()
    }

    /// Runs `passes` through `stages` with one thread per stage, each pass handed on to the next
    /// stage as soon as its stage is done with it; the passes come back in order. A failure
    /// (cancellation included) stops every stage after the pass it is on.
    fn forward_overlapped<'a>(
        &self,
        stages: &[&Stage],
        passes: Vec<Pass<'a>>,
        cancel: &Cancel,
    ) -> Result<Vec<Pass<'a>>, EngineError> {
        use std::sync::mpsc::channel;
        type Item<'a> = Result<Pass<'a>, EngineError>;
        let count = passes.len();
        std::thread::scope(|scope| {
            let (first_tx, mut rx) = channel::<Item<'a>>();
            for p in passes {
                first_tx
                    .send(Ok(p))
                    .map_err(|_| EngineError::from(candle_core::Error::Msg("pipeline stopped".into())))?;
            }
            drop(first_tx);
            for &stage in stages {
                let (tx, next_rx) = channel::<Item<'a>>();
                let input = std::mem::replace(&mut rx, next_rx);
                scope.spawn(move || {
                    let mut run = stage.layers.start;
                    for item in input {
                        let item = item.and_then(|mut p| {
                            self.forward_stage(stage, &mut p, &mut run, cancel)?;
                            Ok(p)
                        });
                        let failed = item.is_err();
                        if tx.send(item).is_err() || failed {
                            return;
                        }
                    }
                });
            }
            let mut done = Vec::with_capacity(count);
            for item in rx {
                done.push(item?);
            }
            if done.len() != count {
                return Err(candle_core::Error::Msg("a pipeline stage stopped early".into()).into());
            }
            Ok(done)
        })
    }

    /// Runs `stage`'s layers (those up to the deepest tap) on the pass, keeping the taps they
    /// produce. Only the residual stream moves into the stage (`to_device`: nothing on the same
    /// device); the batch's context is built again on the stage's device where that differs.
    fn forward_stage(
        &self,
        stage: &Stage,
        p: &mut Pass,
        layers_run: &mut usize,
        cancel: &Cancel,
    ) -> Result<(), EngineError> {
        let n = self.layers.len();
        p.x = p.x.to_device(&stage.device)?;
        if let Some(h) = p.normed.take() {
            p.normed = Some(h.to_device(&stage.device)?);
        }
        let ctx = match p.ctx.take() {
            Some((d, ctx)) if d.same_device(&stage.device) => (d, ctx),
            _ => (stage.device.clone(), self.packing(p.cu_seqlens, &stage.device)?),
        };
        let end = stage.layers.end.min(p.deepest);
        for (i, layer) in self.layers.iter().enumerate().take(end).skip(stage.layers.start) {
            cancel.check(*layers_run)?;
            let idx = i + 1;
            let h = match p.normed.take() {
                Some(h) => h,
                None => layer.input_norm.forward(&p.x)?,
            };
            // The norm after this layer: the next one's input norm (within this stage), or the
            // final norm after the last.
            let next = if idx == n {
                Some(&self.norm)
            } else if idx < end {
                Some(&self.layers[idx].input_norm)
            } else {
                None
            };
            let input = match p.per_layer.as_ref() {
                Some(t) => Some(t.narrow(1, i, 1)?.squeeze(1)?.to_device(&stage.device)?),
                None => None,
            };
            let reused = match layer.kv_source {
                Some(j) => {
                    let (k, v) = p.kept_kv[j].as_ref().ok_or_else(|| {
                        candle_core::Error::Msg(format!("layer {i} reuses the keys and values of layer {j}, not kept"))
                    })?;
                    Some((k.to_device(&stage.device)?, v.to_device(&stage.device)?))
                }
                None => None,
            };
            let (out, h_next, kv) = layer.forward(&p.x, &h, next, &ctx.1, input.as_ref(), reused.as_ref())?;
            if kv.is_some() {
                p.kept_kv[i] = kv;
            }
            p.x = out;
            *layers_run += 1;
            if idx == n {
                if p.taps.contains(&(n + 1)) {
                    p.kept[n + 1] = Some(p.x.clone());
                }
                p.x = match h_next {
                    Some(h) => h,
                    None => self.norm.forward(&p.x)?,
                };
            } else {
                p.normed = h_next;
            }
            if p.taps.contains(&idx) {
                p.kept[idx] = Some(p.x.clone());
            }
        }
        p.ctx = Some(ctx);
        Ok(())
    }
}

/// The kernels the batches of a model with `cfg` prepare for on `device` in `dtype`: those its
/// attention layers chose at load ([`Attention::load`] asks the same questions).
fn batch_kernels(cfg: &ModelConfig, device: &candle_core::Device, dtype: DType, o: &EngineOptions) -> BatchKernels {
    #[cfg(feature = "cuda")]
    if cfg.layers.iter().any(|l| l.mixer.is_attention()) {
        use super::cuda::{attention, rope::QkvRope};
        let hd = cfg.head_dim;
        // The batch's tile list serves every softmax-attention layer, so the kernel runs only
        // where it takes each of their head sizes (full-attention layers may have their own).
        let every_head_size = cfg
            .layers
            .iter()
            .filter(|l| l.mixer.is_attention() && l.mixer != MixerKind::LatentAttention)
            .all(|l| attention::supported(device, dtype, cfg.attention_shape(l.mixer).1));
        // The fused rotation replaces the rotary tables for the whole batch: only where no layer
        // rotating by them takes the other path (a value norm, or keys and values of another
        // layer), and where the tables are not scaled (YaRN's attention factor: the fused
        // rotation computes the unscaled angles from the inverse frequencies alone).
        let every_layer_fuses = !cfg.v_norm
            && cfg.kv_sources.iter().all(Option::is_none)
            && cfg.rope_scaling.as_ref().is_none_or(|s| s.attention_factor() == 1.0);
        return BatchKernels {
            attention: (o.cuda_attention && every_head_size)
                .then(|| o.attention_kernel.unwrap_or(super::AttentionKernel::default_for(hd))),
            fused_rope: o.fused_rope && every_layer_fuses && QkvRope::supported(device, dtype, hd, cfg.rotary_dim),
        };
    }
    let _ = (cfg, device, dtype, o);
    BatchKernels::default()
}

/// The embedding rows of `ids`. Candle's gather indexes its output in 32 bits; past that (a
/// million tokens of a 4,096-wide model) a kernel of ours on CUDA copies the rows.
fn embed(table: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() && ids.elem_count().saturating_mul(table.dim(1)?) > super::large::MAX_ELEMS {
        return super::cuda::ops::copy_rows(table, Some(ids));
    }
    table.index_select(ids, 0)
}
