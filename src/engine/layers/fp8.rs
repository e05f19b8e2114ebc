//! Block-wise FP8 (e4m3) projections on the CPU, W8A8 with dynamic activation scales, exactly:
//! the weight is dequantised once at load (`w_q * scale_inv` per block, in f32), and each input
//! row is quantised and dequantised in groups of [`FP8_BLOCK`] before an f32 matmul, so every
//! product is `(x_q * s_x) * (w_q * s_w)` summed in f32.

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

pub use crate::engine::config::quant::FP8_BLOCK;

/// The largest finite e4m3 (`fn`) value.
pub const E4M3_MAX: f32 = 448.0;

/// The floor under a group's largest magnitude, so an all-zero group has a finite scale.
const MIN_AMAX: f32 = 1e-10;

/// `v` rounded to the nearest e4m3 value, ties to even (torch's cast to `float8_e4m3fn`), for
/// `|v| <= 448`. Normal e4m3 values have 3 fraction bits, so the step in `[2^e, 2^(e+1))` is
/// `2^(e-3)`; below `2^-6` (the subnormals) it stays `2^-9`. Dividing by a power of two is exact,
/// and so is the rounding to a whole number of steps.
pub fn round_e4m3(v: f32) -> f32 {
    let a = v.abs();
    if a == 0.0 || !a.is_finite() {
        return v;
    }
    let exponent = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let step = f32::from_bits(((exponent - 3 + 127) as u32) << 23);
    (v / step).round_ties_even() * step
}

/// The e4m3 (`fn`: no infinities, 0x7f / 0xff are NaN) value of each byte.
fn e4m3_table() -> [f32; 256] {
    std::array::from_fn(|b| float8::F8E4M3::from_bits(b as u8).to_f32())
}

/// One row's groups of [`FP8_BLOCK`] quantised to e4m3 and dequantised, in place:
/// `s = max(amax, 1e-10) / 448`, `x <- e4m3(clamp(x / s, -448, 448)) * s`.
pub fn quantise_row(row: &mut [f32]) {
    for g in row.chunks_mut(FP8_BLOCK) {
        let amax = g.iter().fold(0f32, |m, x| m.max(x.abs()));
        let s = amax.max(MIN_AMAX) / E4M3_MAX;
        for x in g.iter_mut() {
            *x = round_e4m3((*x / s).clamp(-E4M3_MAX, E4M3_MAX)) * s;
        }
    }
}

/// `x` `[T, K]` with every row quantised per group of [`FP8_BLOCK`] and dequantised
/// ([`quantise_row`]), in f32 on the CPU.
pub fn quantise_activations(x: &Tensor) -> candle_core::Result<Tensor> {
    let (t, k) = x.dims2()?;
    if !x.device().is_cpu() {
        candle_core::bail!("fp8 activations: the CPU path only");
    }
    let mut v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if k > 0 {
        v.par_chunks_mut(k).for_each(quantise_row);
    }
    Tensor::from_vec(v, (t, k), &Device::Cpu)
}

/// The `[K, N]` f32 transpose of the dequantised `[N, K]` weight: `w[n][k] = e4m3(bytes[n * K + k])
/// * scale[n / 128][k / 128]`, with `scale` `[ceil(N/128), ceil(K/128)]` row-major.
pub fn dequantised_transposed(bytes: &[u8], scale: &[f32], n: usize, k: usize) -> Vec<f32> {
    let table = e4m3_table();
    let kb = k.div_ceil(FP8_BLOCK);
    let mut out = vec![0f32; n * k];
    out.par_chunks_mut(n.max(1)).enumerate().for_each(|(col, o)| {
        let sc = col / FP8_BLOCK;
        for (row, y) in o.iter_mut().enumerate() {
            *y = table[bytes[row * k + col] as usize] * scale[(row / FP8_BLOCK) * kb + sc];
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_matches_the_e4m3_grid_with_ties_to_even() {
        // Every finite e4m3 value rounds to itself; the midpoints between neighbours go to the
        // one whose last bit is zero.
        let table = e4m3_table();
        let mut values: Vec<f32> = table.iter().copied().filter(|v| v.is_finite() && *v >= 0.0).collect();
        values.sort_by(f32::total_cmp);
        values.dedup();
        for v in &values {
            assert_eq!(round_e4m3(*v), *v);
            assert_eq!(round_e4m3(-*v), -*v);
        }
        for (i, w) in values.windows(2).enumerate() {
            let mid = (w[0] + w[1]) / 2.0;
            let even = if i % 2 == 0 { w[0] } else { w[1] };
            assert_eq!(round_e4m3(mid), even, "tie between {} and {}", w[0], w[1]);
            assert_eq!(round_e4m3(f32::from_bits(mid.to_bits() - 1)), w[0]);
            assert_eq!(round_e4m3(f32::from_bits(mid.to_bits() + 1)), w[1]);
        }
    }
}
