//! Per-layer inputs ([`PerLayerInputs`]): a second embedding table that gives every decoder layer
//! an input of its own for each token, mixed with a projection of the token's embeddings, and the
//! gated path by which a layer adds its input to the residual stream.

use candle_core::{DType, Tensor};

use super::linear::{residual, Linear};
use super::norm::RmsNorm;
use crate::engine::config::{ExpertActivation, ModelConfig, PerLayerInputs};
use crate::engine::weights::Weights;
use crate::engine::EngineError;

/// `x * s` as PyTorch multiplies a tensor by a Python float: in f32 (the scale rounded to f32),
/// a 16-bit tensor widened for the product and rounded once.
fn scaled(x: &Tensor, s: f64) -> candle_core::Result<Tensor> {
    match x.dtype() {
        DType::F32 => x.affine(s, 0.0),
        d => x.to_dtype(DType::F32)?.affine(s, 0.0)?.to_dtype(d),
    }
}

/// The table (`embed_tokens_per_layer`), the projection of the embeddings
/// (`per_layer_model_projection`) and its norm (`per_layer_projection_norm`).
pub struct PerLayerEmbeddings {
    /// `[rows, layers * width]` in the compute dtype.
    table: Tensor,
    /// The table's scale `[1]`, rounded to the compute dtype.
    table_scale: Tensor,
    projection: Linear,
    norm: RmsNorm,
    p: PerLayerInputs,
}

impl PerLayerEmbeddings {
    /// With `rows`, only those rows of the table: token `rows[i]` is then id `i` (as the
    /// decoder's embeddings are loaded for a few known sequences).
    pub fn load(w: &Weights, c: &ModelConfig, p: &PerLayerInputs, rows: Option<&[u32]>) -> Result<Self, EngineError> {
        let cols = p.layers * p.width;
        let name = "embed_tokens_per_layer.weight";
        let table = match rows {
            Some(rows) => w.get_rows(name, rows, &[p.vocab_size, cols])?,
            None => w.get(name, &[p.vocab_size, cols])?,
        };
        let table_scale = Tensor::new(&[p.embed_scale as f32], &w.device)?.to_dtype(w.dtype)?;
        Ok(PerLayerEmbeddings {
            table,
            table_scale,
            projection: Linear::load(w, "per_layer_model_projection", cols, c.hidden_size, false)?,
            norm: RmsNorm::load_sized_for(w, c, "per_layer_projection_norm", p.width)?,
            p: p.clone(),
        })
    }

    /// Every layer's input `[T, layers, width]` for the tokens `ids` `[T]` whose scaled
    /// embeddings are `embeds` `[T, hidden]`.
    pub fn forward(&self, ids: &Tensor, embeds: &Tensor) -> candle_core::Result<Tensor> {
        let t = ids.dim(0)?;
        let (layers, width) = (self.p.layers, self.p.width);
        let own = self.table.index_select(ids, 0)?.broadcast_mul(&self.table_scale)?.reshape((t, layers, width))?;
        let projected = scaled(&self.projection.forward(embeds)?, self.p.projection_scale)?;
        let projected = self.norm.forward(&projected.reshape((t, layers, width))?)?;
        scaled(&(projected + own)?, self.p.combine_scale)
    }
}

/// How a layer adds its input: `x + norm(projection(act(gate(x)) * input))`
/// (`per_layer_input_gate`, `per_layer_projection`, `post_per_layer_input_norm`).
pub struct PerLayerInputGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
    activation: ExpertActivation,
}

impl PerLayerInputGate {
    /// `{prefix}.per_layer_input_gate`, `{prefix}.per_layer_projection`,
    /// `{prefix}.post_per_layer_input_norm`.
    pub fn load(w: &Weights, c: &ModelConfig, prefix: &str, p: &PerLayerInputs) -> Result<Self, EngineError> {
        if matches!(p.activation, ExpertActivation::ClampedSwiglu { .. }) {
            return Err(EngineError::Load(
                "per-layer inputs: the clamped SwiGLU joins two projections, not one".into(),
            ));
        }
        let h = c.hidden_size;
        Ok(PerLayerInputGate {
            gate: Linear::load(w, &format!("{prefix}.per_layer_input_gate"), p.width, h, false)?,
            projection: Linear::load(w, &format!("{prefix}.per_layer_projection"), h, p.width, false)?,
            norm: RmsNorm::load_for(w, c, &format!("{prefix}.post_per_layer_input_norm"))?,
            activation: p.activation,
        })
    }

    /// `x` `[T, hidden]` plus the layer's input `input` `[T, width]` through the gate.
    pub fn forward(&self, x: &Tensor, input: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gate.forward(x)?;
        let act = match self.activation {
            ExpertActivation::GeluTanh => g.gelu()?,
            ExpertActivation::Silu => candle_nn::ops::silu(&g)?,
            ExpertActivation::ClampedSwiglu { .. } => candle_core::bail!("per-layer inputs: no clamped SwiGLU"),
        };
        let y = self.norm.forward(&self.projection.forward(&(act * input)?)?)?;
        residual(x, &y)
    }
}
