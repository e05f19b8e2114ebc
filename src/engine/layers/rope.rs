//! Rotary position embedding tables, computed exactly as Hugging Face transformers does (f32).

use candle_core::{DType, Device, Tensor};

use crate::engine::config::{ModelConfig, RopeScaling};

pub struct Rope {
    /// Inverse frequencies, `rotary_dim / 2` of them.
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.rotary_dim;
        let base = cfg.rope_theta as f32;
        let mut inv_freq: Vec<f32> = (0..d).step_by(2).map(|i| 1.0f32 / base.powf(i as f32 / d as f32)).collect();
        match &cfg.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                let f = *factor as f32;
                inv_freq.iter_mut().for_each(|x| *x /= f);
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let (factor, low, high, old) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *original_max_position_embeddings as f32,
                );
                let low_freq_wavelen = old / low;
                let high_freq_wavelen = old / high;
                for x in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *x;
                    let scaled = if wavelen > low_freq_wavelen { *x / factor } else { *x };
                    let smooth = (old / wavelen - low) / (high - low);
                    let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
                    // Finite wavelengths: this is transformers' `~(w < high) & ~(w > low)`.
                    let medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
                    *x = if medium { smoothed } else { scaled };
                }
            }
        }
        Rope { inv_freq }
    }

    /// cos and sin tables `[positions.len(), rotary_dim / 2]` for the given positions.
    /// The inverse frequencies, scaling applied: angle `i` of position `p` is `p * inv_freq[i]`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn tables(&self, positions: &[u32], dtype: DType, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let h = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * h);
        let mut sin = Vec::with_capacity(positions.len() * h);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = f * p as f32;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let shape = (positions.len(), h);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}
