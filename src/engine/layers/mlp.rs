//! The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.

use candle_core::Tensor;

use super::linear::Linear;
use crate::engine::config::ExpertActivation;
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
    /// What joins the gate and up projections.
    activation: ExpertActivation,
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
        Ok(GatedMlp { gate_up, down, fp8_fused: true, activation: ExpertActivation::Silu })
    }

    /// The same MLP with `activation` joining its gate and up projections.
    pub fn activated(self, activation: ExpertActivation) -> Self {
        GatedMlp { activation, ..self }
    }

    /// Separate gate, up and down projections joined by `activation`.
    pub fn with_activation(gate: Linear, up: Linear, down: Linear, activation: ExpertActivation) -> Self {
        GatedMlp { gate_up: GateUp::Separate { gate, up }, down, fp8_fused: true, activation }
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
        if let (GateUp::Fused(l), ExpertActivation::Silu) = (&self.gate_up, self.activation) {
            return self.down.forward_silu_mul(&l.forward(h)?, self.fp8_fused);
        }
        let (g, u) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(h)?, up.forward(h)?),
            // The fused projection's gate then up outputs, for an activation the fused kernel
            // does not compute.
            GateUp::Fused(l) => {
                let gu = l.forward(h)?;
                let inter = gu.dim(1)? / 2;
                (gu.narrow(1, 0, inter)?, gu.narrow(1, inter, inter)?)
            }
        };
        let act = match self.activation {
            ExpertActivation::Silu => match super::cpu_ops::silu_mul(&g, &u)? {
                Some(act) => act,
                None => (candle_nn::ops::silu(&g)? * u)?,
            },
            ExpertActivation::ClampedSwiglu { limit, alpha } => clamped_swiglu(&g, &u, limit, alpha)?,
            ExpertActivation::GeluTanh => (g.gelu()? * u)?,
        };
        self.down.forward(&act)
    }
}

/// `(u + 1) * g * sigmoid(alpha * g)` with `g = min(gate, limit)` and `u = clamp(up, -limit,
/// limit)`, in the inputs' dtype. A NaN stays NaN (candle's minimum and maximum would replace it
/// by the limit; the reference's clamp keeps it).
pub fn clamped_swiglu(gate: &Tensor, up: &Tensor, limit: f64, alpha: f64) -> candle_core::Result<Tensor> {
    let keep_nan = |x: &Tensor, clamped: Tensor| x.eq(x)?.where_cond(&clamped, x);
    let g = keep_nan(gate, gate.minimum(limit)?)?;
    let u = keep_nan(up, up.clamp(-limit, limit)?)?;
    let glu = (&g * candle_nn::ops::sigmoid(&g.affine(alpha, 0.0)?)?)?;
    (u + 1.0)? * glu
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Element by element as written out: the gate clamped above only, up on both sides, the
    /// `+ 1` on up; a NaN kept.
    #[test]
    fn the_clamped_swiglu_follows_its_formula() -> candle_core::Result<()> {
        let gate = [-9.0f32, -1.0, 0.5, 6.9, 8.0, 20.0, f32::NAN, 1.0];
        let up = [-9.0f32, 0.3, -0.4, 7.5, -8.0, 2.0, 1.0, f32::NAN];
        let dev = Device::Cpu;
        let got = clamped_swiglu(&Tensor::new(&gate, &dev)?, &Tensor::new(&up, &dev)?, 7.0, 1.702)?.to_vec1::<f32>()?;
        for (i, (&g, &u)) in gate.iter().zip(&up).enumerate() {
            let (g, u) = (g.min(7.0) as f64, u.clamp(-7.0, 7.0) as f64);
            let want = (u + 1.0) * g / (1.0 + (-1.702 * g).exp());
            if gate[i].is_nan() || up[i].is_nan() {
                assert!(got[i].is_nan(), "{i}: {}", got[i]);
            } else {
                assert!((got[i] as f64 - want).abs() <= 1e-6 * want.abs().max(1.0), "{i}: {} vs {want}", got[i]);
            }
        }
        Ok(())
    }
}
