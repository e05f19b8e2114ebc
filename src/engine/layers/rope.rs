//! Rotary position embedding tables, computed exactly as Hugging Face transformers does (f32).

use candle_core::{DType, Device, Tensor};

use crate::engine::config::{ModelConfig, RopeScaling};

pub struct Rope {
    /// Inverse frequencies, `rotary_dim / 2` of them.
    inv_freq: Vec<f32>,
    /// What cos and sin are multiplied by (YaRN's attention factor; 1 otherwise).
    attention_factor: f32,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let d = cfg.rotary_dim;
        let base = cfg.rope_theta as f32;
        let pos_freqs: Vec<f32> = (0..d).step_by(2).map(|i| base.powf(i as f32 / d as f32)).collect();
        let mut inv_freq: Vec<f32> = pos_freqs.iter().map(|p| 1.0f32 / p).collect();
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
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            }) => {
                let (low, high) = yarn_ramp(
                    (*beta_fast, *beta_slow),
                    d as f64,
                    cfg.rope_theta,
                    *original_max_position_embeddings,
                    *truncate,
                );
                let f = *factor as f32;
                for (i, (x, p)) in inv_freq.iter_mut().zip(&pos_freqs).enumerate() {
                    let ramp = ((i as f32 - low as f32) / ((high - low) as f32)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let interpolated = 1.0 / (f * p);
                    *x = interpolated * (1.0 - extrapolation) + *x * extrapolation;
                }
            }
        }
        let attention_factor = cfg.rope_scaling.as_ref().map_or(1.0, |s| s.attention_factor() as f32);
        Rope { inv_freq, attention_factor }
    }

    /// The rotary embedding of the full-attention layers where the config shapes them apart
    /// ([`crate::engine::config::FullAttentionShape`]): `head_dim / 2` frequencies, the first
    /// `rotated_pairs` at `theta^(-2i / head_dim) / factor` (as transformers computes them, in
    /// f32), the rest zero (those pairs do not turn).
    pub fn full_attention(cfg: &ModelConfig) -> Option<Self> {
        let f = cfg.full_attention.as_ref()?;
        let (d, base, factor) = (f.head_dim, f.rope_theta as f32, f.rope_factor as f32);
        let inv_freq = (0..d / 2)
            .map(|i| if i < f.rotated_pairs { 1.0f32 / base.powf((2 * i) as f32 / d as f32) / factor } else { 0.0 })
            .collect();
        Some(Rope { inv_freq, attention_factor: 1.0 })
    }

    /// The inverse frequencies, scaling applied: angle `i` of position `p` is `p * inv_freq[i]`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// cos and sin tables `[positions.len(), rotary_dim / 2]` for the given positions.
    pub fn tables(&self, positions: &[u32], dtype: DType, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let h = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * h);
        let mut sin = Vec::with_capacity(positions.len() * h);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = f * p as f32;
                if self.attention_factor == 1.0 {
                    cos.push(a.cos());
                    sin.push(a.sin());
                } else {
                    cos.push(a.cos() * self.attention_factor);
                    sin.push(a.sin() * self.attention_factor);
                }
            }
        }
        let shape = (positions.len(), h);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}

/// The ends of YaRN's ramp over the `dim / 2` frequencies (transformers'
/// `find_correction_range`, in f64): the dimensions that turn `beta_fast` and `beta_slow` times
/// over `original` positions, rounded outwards when `truncate`, clamped to `[0, dim - 1]`, and
/// kept 0.001 apart.
fn yarn_ramp((beta_fast, beta_slow): (f64, f64), dim: f64, base: f64, original: f64, truncate: bool) -> (f64, f64) {
    let at = |rotations: f64| dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    let (mut low, mut high) = (at(beta_fast), at(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    (low, high)
}
