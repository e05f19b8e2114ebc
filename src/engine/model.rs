//! The decoder (Llama, Mistral, Qwen2, Qwen3) with layer taps over packed sequences.

use candle_core::{DType, Tensor};

use super::attention::{chunk_masks, sequence_attention, QUERY_CHUNK};
use super::config::ModelConfig;
use super::rope::Rope;
use super::weights::Weights;
use super::EngineError;

struct Linear {
    weight_t: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    fn load(w: &Weights, name: &str, out: usize, inp: usize, bias: bool) -> Result<Self, EngineError> {
        let weight = w.get(&format!("{name}.weight"), &[out, inp])?;
        let bias = w.get_opt(&format!("{name}.bias"), &[out], bias)?;
        // Stored transposed once so every forward is a plain [T, in] x [in, out] matmul.
        Ok(Linear { weight_t: weight.t()?.contiguous()?, bias })
    }

    /// One projection computing all of `parts` side by side (their outputs concatenated), so a
    /// single larger matmul replaces several.
    fn fuse(parts: Vec<Linear>) -> Result<Self, EngineError> {
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
        Ok(Linear { weight_t, bias })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = matmul(x, &self.weight_t)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x + y` for the residual stream: same dtypes, or an f32 stream plus a 16-bit sublayer output.
fn residual(x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.dtype() == DType::F32 && y.dtype() != DType::F32 {
        return super::cuda_ops::add_f32(x, y);
    }
    x + y
}

/// `a @ b`; bf16 on the CPU (which candle's CPU matmul lacks) accumulates in f32, as PyTorch does.
pub(crate) fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if a.dtype() == DType::BF16 && a.device().is_cpu() {
        a.to_dtype(DType::F32)?.matmul(&b.to_dtype(DType::F32)?)?.to_dtype(DType::BF16)
    } else {
        a.matmul(b)
    }
}

/// Optional phase timing (`LAYERTAP_PROFILE=1`): synchronises the device after each phase of
/// every layer and adds up the seconds, for finding where time goes. Off by default: the
/// synchronisations cost throughput.
pub mod profile {
    use std::sync::{Mutex, OnceLock};
    use std::time::Instant;

    pub const PHASES: [&str; 5] = ["norm_qkv", "rope", "attention", "o_proj_mlp", "host_copy"];
    static ON: OnceLock<bool> = OnceLock::new();
    static SECS: Mutex<[f64; 5]> = Mutex::new([0.0; 5]);

    pub fn enabled() -> bool {
        *ON.get_or_init(|| std::env::var("LAYERTAP_PROFILE").is_ok_and(|v| v == "1"))
    }

    /// Ends a phase: waits for the device, then charges the time since `since` to `phase`.
    pub fn mark(device: &candle_core::Device, phase: usize, since: &mut Instant) {
        if enabled() {
            let _ = device.synchronize();
            if let Ok(mut s) = SECS.lock() {
                s[phase] += since.elapsed().as_secs_f64();
            }
            *since = Instant::now();
        }
    }

    /// Seconds per phase so far, by name.
    pub fn totals() -> Vec<(&'static str, f64)> {
        let s = SECS.lock().map(|s| *s).unwrap_or_default();
        PHASES.iter().copied().zip(s).collect()
    }
}

struct RmsNorm {
    weight: Tensor,
    eps: f32,
}

impl RmsNorm {
    fn load(w: &Weights, name: &str, size: usize, eps: f64) -> Result<Self, EngineError> {
        Ok(RmsNorm { weight: w.get(&format!("{name}.weight"), &[size])?, eps: eps as f32 })
    }

    /// In the weight's dtype; an f32 input with a 16-bit weight (the f32 residual stream on
    /// CUDA) is normalised in f32 and rounded once.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if x.dtype() == DType::F32 && self.weight.dtype() != DType::F32 {
            return super::cuda_ops::rms_norm_f32(x, &self.weight, self.eps);
        }
        candle_nn::ops::rms_norm(x, &self.weight, self.eps)
    }
}

/// The q, k, v projections: separate (CPU, bit-for-bit the reference layout), or one fused
/// matmul on CUDA.
enum Qkv {
    Separate { q: Linear, k: Linear, v: Linear },
    Fused(Linear),
}

/// The MLP's gate and up projections: separate, or one fused matmul followed by the fused
/// `silu(gate) * up` kernel on CUDA.
enum GateUp {
    Separate {
        gate: Linear,
        up: Linear,
    },
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Fused(Linear),
}

struct Attention {
    qkv: Qkv,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

struct Mlp {
    gate_up: GateUp,
    down: Linear,
}

struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

/// Where each packed sequence sits in the token dimension, and the per-token rotary tables.
pub struct Packing {
    pub seqs: Vec<(usize, usize)>,
    /// Attention masks per distinct sequence length, shared by every layer.
    masks: std::collections::HashMap<usize, Vec<Tensor>>,
    /// The CUDA kernel's tile list, where the kernel serves this model (then `masks` is empty).
    #[cfg(feature = "cuda")]
    tiles: Option<(Tensor, usize)>,
    /// Sliding attention window, if the model has one.
    #[cfg(feature = "cuda")]
    window: Option<usize>,
    cos: Tensor,
    sin: Tensor,
}

pub struct Decoder {
    pub cfg: ModelConfig,
    /// Keep the residual stream in f32 while the model computes in bf16/f16 (CUDA; set
    /// `LAYERTAP_F32_RESIDUAL=0` to keep it in the compute dtype, as Hugging Face does).
    f32_residual: bool,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
}

impl Layer {
    fn load(w: &Weights, c: &ModelConfig, i: usize) -> Result<Self, EngineError> {
        let p = format!("layers.{i}");
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let a = format!("{p}.self_attn");
        let q = Linear::load(w, &format!("{a}.q_proj"), nq * hd, h, c.qkv_bias)?;
        let k = Linear::load(w, &format!("{a}.k_proj"), nkv * hd, h, c.qkv_bias)?;
        let v = Linear::load(w, &format!("{a}.v_proj"), nkv * hd, h, c.qkv_bias)?;
        // On CUDA, fewer and larger matmuls; on the CPU the layout stays as the reference's.
        let fuse = q.weight_t.device().is_cuda();
        let qkv = if fuse { Qkv::Fused(Linear::fuse(vec![q, k, v])?) } else { Qkv::Separate { q, k, v } };
        let attn = Attention {
            qkv,
            o: Linear::load(w, &format!("{a}.o_proj"), h, nq * hd, c.o_bias)?,
            q_norm: c.qk_norm.then(|| RmsNorm::load(w, &format!("{a}.q_norm"), hd, c.rms_norm_eps)).transpose()?,
            k_norm: c.qk_norm.then(|| RmsNorm::load(w, &format!("{a}.k_norm"), hd, c.rms_norm_eps)).transpose()?,
            heads: nq,
            kv_heads: nkv,
            head_dim: hd,
        };
        let m = format!("{p}.mlp");
        let gate = Linear::load(w, &format!("{m}.gate_proj"), c.intermediate_size, h, c.mlp_bias)?;
        let up = Linear::load(w, &format!("{m}.up_proj"), c.intermediate_size, h, c.mlp_bias)?;
        #[cfg(feature = "cuda")]
        let gate_up = if fuse && c.intermediate_size % 8 == 0 {
            GateUp::Fused(Linear::fuse(vec![gate, up])?)
        } else {
            GateUp::Separate { gate, up }
        };
        #[cfg(not(feature = "cuda"))]
        let gate_up = GateUp::Separate { gate, up };
        let mlp =
            Mlp { gate_up, down: Linear::load(w, &format!("{m}.down_proj"), h, c.intermediate_size, c.mlp_bias)? };
        Ok(Layer {
            input_norm: RmsNorm::load(w, &format!("{p}.input_layernorm"), h, c.rms_norm_eps)?,
            attn,
            post_norm: RmsNorm::load(w, &format!("{p}.post_attention_layernorm"), h, c.rms_norm_eps)?,
            mlp,
        })
    }

    fn forward(&self, x: &Tensor, pk: &Packing) -> candle_core::Result<Tensor> {
        let a = &self.attn;
        let dev = x.device();
        let mut since = std::time::Instant::now();
        let t = x.dim(0)?;
        let h = self.input_norm.forward(x)?;
        let (q, k, v) = match &a.qkv {
            Qkv::Separate { q, k, v } => (q.forward(&h)?, k.forward(&h)?, v.forward(&h)?),
            Qkv::Fused(l) => {
                let y = l.forward(&h)?;
                let (nq, nkv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
                (y.narrow(1, 0, nq)?, y.narrow(1, nq, nkv)?, y.narrow(1, nq + nkv, nkv)?.contiguous()?)
            }
        };
        let mut q = q.reshape((t, a.heads, a.head_dim))?;
        let mut k = k.reshape((t, a.kv_heads, a.head_dim))?;
        let v = v.reshape((t, a.kv_heads, a.head_dim))?;
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        profile::mark(dev, 0, &mut since);
        let q = candle_nn::rotary_emb::rope_thd(&q.unsqueeze(0)?.contiguous()?, &pk.cos, &pk.sin)?.squeeze(0)?;
        let k = candle_nn::rotary_emb::rope_thd(&k.unsqueeze(0)?.contiguous()?, &pk.cos, &pk.sin)?.squeeze(0)?;
        profile::mark(dev, 1, &mut since);
        let scale = 1.0 / (a.head_dim as f64).sqrt();
        #[cfg(feature = "cuda")]
        if let Some(tiles) = &pk.tiles {
            let attn = super::cuda_attention::packed_attention(&q, &k, &v, tiles, scale, pk.window)?
                .reshape((t, a.heads * a.head_dim))?;
            profile::mark(dev, 2, &mut since);
            return self.finish(x, &attn, dev, since);
        }
        let mut outs = Vec::with_capacity(pk.seqs.len());
        for &(start, len) in &pk.seqs {
            let masks =
                pk.masks.get(&len).ok_or_else(|| candle_core::Error::Msg(format!("no mask for length {len}")))?;
            outs.push(sequence_attention(
                &q.narrow(0, start, len)?,
                &k.narrow(0, start, len)?,
                &v.narrow(0, start, len)?,
                scale,
                masks,
            )?);
        }
        let attn = if outs.len() == 1 { outs.pop().unwrap_or_else(|| unreachable!()) } else { Tensor::cat(&outs, 0)? };
        profile::mark(dev, 2, &mut since);
        self.finish(x, &attn, dev, since)
    }

    /// Output projection, residual, and the MLP block.
    fn finish(
        &self,
        x: &Tensor,
        attn: &Tensor,
        dev: &candle_core::Device,
        mut since: std::time::Instant,
    ) -> candle_core::Result<Tensor> {
        let x = residual(x, &self.attn.o.forward(attn)?)?;
        let h = self.post_norm.forward(&x)?;
        let m = &self.mlp;
        let act = match &m.gate_up {
            GateUp::Separate { gate, up } => (candle_nn::ops::silu(&gate.forward(&h)?)? * up.forward(&h)?)?,
            #[cfg(feature = "cuda")]
            GateUp::Fused(l) => super::cuda_ops::silu_mul(&l.forward(&h)?)?,
            #[cfg(not(feature = "cuda"))]
            GateUp::Fused(_) => candle_core::bail!("fused gate/up needs the cuda feature"),
        };
        let out = residual(&x, &m.down.forward(&act)?)?;
        profile::mark(dev, 3, &mut since);
        Ok(out)
    }
}

impl Decoder {
    /// Loads every tensor the decoder needs (never `lm_head`), with a progress callback per layer.
    pub fn load(cfg: ModelConfig, w: &Weights, mut progress: impl FnMut(usize, usize)) -> Result<Self, EngineError> {
        let embed = w.get("embed_tokens.weight", &[cfg.vocab_size, cfg.hidden_size])?;
        let n = cfg.num_hidden_layers;
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            layers.push(Layer::load(w, &cfg, i)?);
            progress(i + 1, n);
        }
        let norm = RmsNorm::load(w, "norm", cfg.hidden_size, cfg.rms_norm_eps)?;
        let rope = Rope::new(&cfg);
        let f32_residual = cfg!(feature = "cuda")
            && embed.device().is_cuda()
            && embed.dtype() != DType::F32
            && !std::env::var("LAYERTAP_F32_RESIDUAL").is_ok_and(|v| v == "0");
        Ok(Decoder { cfg, embed, layers, norm, rope, f32_residual })
    }

    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    pub fn device(&self) -> &candle_core::Device {
        self.embed.device()
    }

    pub fn packing(&self, cu_seqlens: &[usize]) -> candle_core::Result<Packing> {
        let seqs: Vec<(usize, usize)> = cu_seqlens.windows(2).map(|w| (w[0], w[1] - w[0])).collect();
        let positions: Vec<u32> = seqs.iter().flat_map(|&(_, len)| 0..len as u32).collect();
        let (cos, sin) = self.rope.tables(&positions, self.dtype(), self.embed.device())?;
        let mut masks = std::collections::HashMap::new();
        #[cfg(feature = "cuda")]
        let tiles = if super::cuda_attention::supported(self.device(), self.dtype(), self.cfg.head_dim) {
            Some(super::cuda_attention::tiles(&seqs, self.device())?)
        } else {
            None
        };
        #[cfg(feature = "cuda")]
        let need_masks = tiles.is_none();
        #[cfg(not(feature = "cuda"))]
        let need_masks = true;
        for &(_, len) in seqs.iter().filter(|_| need_masks) {
            if let std::collections::hash_map::Entry::Vacant(e) = masks.entry(len) {
                e.insert(chunk_masks(len, self.cfg.sliding_window, QUERY_CHUNK, self.embed.device())?);
            }
        }
        Ok(Packing {
            seqs,
            masks,
            #[cfg(feature = "cuda")]
            tiles,
            #[cfg(feature = "cuda")]
            window: self.cfg.sliding_window,
            cos,
            sin,
        })
    }

    /// Runs the decoder on packed `ids` and returns, for each entry of `taps` (indices in
    /// `0..=L`, any order, repeats allowed), the `[T, hidden]` state Hugging Face reports as
    /// `hidden_states[i]`. Layers past the deepest tap are not run. `layers_run` counts the
    /// decoder layers executed.
    pub fn forward_taps(
        &self,
        ids: &Tensor,
        pk: &Packing,
        taps: &[usize],
        layers_run: &mut usize,
    ) -> candle_core::Result<Vec<Tensor>> {
        let n = self.layers.len();
        let deepest = taps.iter().copied().max().unwrap_or(0);
        let mut kept: Vec<Option<Tensor>> = vec![None; n + 1];
        let mut x = self.embed.index_select(ids, 0)?;
        if self.f32_residual {
            x = x.to_dtype(DType::F32)?;
        }
        if taps.contains(&0) {
            kept[0] = Some(x.clone());
        }
        for (i, layer) in self.layers.iter().enumerate().take(deepest) {
            x = layer.forward(&x, pk)?;
            *layers_run += 1;
            let idx = i + 1;
            if idx == n {
                x = self.norm.forward(&x)?;
            }
            if taps.contains(&idx) {
                kept[idx] = Some(x.clone());
            }
        }
        // States are returned in the compute dtype (the f32 stream rounded once).
        taps.iter()
            .map(|&i| {
                kept[i]
                    .as_ref()
                    .ok_or_else(|| candle_core::Error::Msg(format!("layer {i} was not computed")))
                    .and_then(|t| t.to_dtype(self.dtype()))
            })
            .collect()
    }
}
