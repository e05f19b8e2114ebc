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
    /// Whether an FP8 down projection quantises `silu(gate) * up` in the same kernel that
    /// computes it (`EngineOptions::fp8_fused`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fp8_fused: bool,
}

impl GatedMlp {
    /// `{prefix}.gate_proj`, `.up_proj`, `.down_proj`.
    pub fn load(w: &Weights, prefix: &str, hidden: usize, inter: usize, bias: bool) -> Result<Self, EngineError> {
        let gate = Linear::load(w, &format!("{prefix}.gate_proj"), inter, hidden, bias)?;
        let up = Linear::load(w, &format!("{prefix}.up_proj"), inter, hidden, bias)?;
        let down = Linear::load(w, &format!("{prefix}.down_proj"), hidden, inter, bias)?;
        let mut mlp = Self::new(gate, up, down, w.device.is_cuda())?;
        mlp.fp8_fused = w.fp8_fused;
        Ok(mlp)
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
        Ok(GatedMlp { gate_up, down, fp8_fused: true })
    }

    /// The fused gate·up weight (`[2I, H]`, gate rows first) and the down weight, where both are
    /// FP8 projections kept in e4m3 on the GPU (for the experts' grouped FP8 kernel).
    #[cfg(feature = "cuda")]
    pub fn fp8_weights(&self) -> Option<(&crate::engine::cuda::fp8::Fp8Weight, &crate::engine::cuda::fp8::Fp8Weight)> {
        match &self.gate_up {
            GateUp::Fused(l) => Some((l.fp8_weight()?, self.down.fp8_weight()?)),
            GateUp::Separate { .. } => None,
        }
    }

    pub fn forward(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let GateUp::Fused(l) = &self.gate_up {
            return self.down.forward_silu_mul(&l.forward(h)?, self.fp8_fused);
        }
        let act = match &self.gate_up {
            GateUp::Separate { gate, up } => {
                let (g, u) = (gate.forward(h)?, up.forward(h)?);
                match super::cpu_ops::silu_mul(&g, &u)? {
                    Some(act) => act,
                    None => (candle_nn::ops::silu(&g)? * u)?,
                }
            }
            GateUp::Fused(_) => candle_core::bail!("fused gate/up needs the cuda feature"),
        };
        self.down.forward(&act)
    }
}
