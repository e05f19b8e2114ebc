//! The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.

use candle_core::Tensor;

use super::linear::Linear;
use crate::engine::weights::Weights;
use crate::engine::EngineError;

/// The gate and up projections: separate, or one fused matmul followed by the fused
/// `silu(gate) * up` kernel on CUDA.
enum GateUp {
    Separate {
        gate: Linear,
        up: Linear,
    },
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Fused(Linear),
}

pub struct GatedMlp {
    gate_up: GateUp,
    down: Linear,
}

impl GatedMlp {
    /// `{prefix}.gate_proj`, `.up_proj`, `.down_proj`.
    pub fn load(w: &Weights, prefix: &str, hidden: usize, inter: usize, bias: bool) -> Result<Self, EngineError> {
        let gate = Linear::load(w, &format!("{prefix}.gate_proj"), inter, hidden, bias)?;
        let up = Linear::load(w, &format!("{prefix}.up_proj"), inter, hidden, bias)?;
        let down = Linear::load(w, &format!("{prefix}.down_proj"), hidden, inter, bias)?;
        Self::new(gate, up, down, w.device.is_cuda())
    }

    pub fn new(gate: Linear, up: Linear, down: Linear, fuse: bool) -> Result<Self, EngineError> {
        #[cfg(feature = "cuda")]
        let gate_up = if fuse && gate.out_dim()? % 8 == 0 && Linear::fusable(&[&gate, &up]) {
            GateUp::Fused(Linear::fuse(vec![gate, up])?)
        } else {
            GateUp::Separate { gate, up }
        };
        #[cfg(not(feature = "cuda"))]
        let gate_up = {
            let _ = fuse;
            GateUp::Separate { gate, up }
        };
        Ok(GatedMlp { gate_up, down })
    }

    pub fn forward(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let act = match &self.gate_up {
            GateUp::Separate { gate, up } => {
                let (g, u) = (gate.forward(h)?, up.forward(h)?);
                match super::cpu_ops::silu_mul(&g, &u)? {
                    Some(act) => act,
                    None => (candle_nn::ops::silu(&g)? * u)?,
                }
            }
            #[cfg(feature = "cuda")]
            GateUp::Fused(l) => crate::engine::cuda::ops::silu_mul(&l.forward(h)?)?,
            #[cfg(not(feature = "cuda"))]
            GateUp::Fused(_) => candle_core::bail!("fused gate/up needs the cuda feature"),
        };
        self.down.forward(&act)
    }
}
