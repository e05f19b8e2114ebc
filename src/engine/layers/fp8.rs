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

/// The e4m3 byte of `v`, a value of the e4m3 grid ([`round_e4m3`]'s result, `|v| <= 448`):
/// the conversion is exact, so it only encodes (what [`e4m3_byte`] is checked against).
#[cfg(test)]
fn e4m3_bits(v: f32) -> u8 {
    float8::F8E4M3::from_f32(v).to_bits()
}

/// The e4m3 byte of `x` rounded to the nearest e4m3 value, ties to even: what
/// `e4m3_bits(round_e4m3(x))` gives, for finite `|x| <= 448`, from the bits (no division, no
/// rounding call, no general conversion: the weights of a whole model go
/// through this at load under `--quantize fp8`). Normal values keep 3 of the 23 fraction bits,
/// rounded to nearest even on the bits themselves (a carry moves into the exponent as it should);
/// below `2^-6` the step is `2^-9`, so `|x| * 512`, exact, rounded to a whole number is the
/// subnormal's bits (8 rounds up to the smallest normal, `0x08`, as it should).
pub fn e4m3_byte(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7fff_ffff;
    if a < 0x3c80_0000 {
        // |x| < 2^-6: |x| * 2^9 < 8 is exact; round half to even by the bits as well.
        let m = f32::from_bits(a) * 512.0;
        let whole = m as u32; // truncation: 0..=7
        let rest = m - whole as f32; // exact
        let up = rest > 0.5 || (rest == 0.5 && whole & 1 == 1);
        return sign | (whole + u32::from(up)) as u8;
    }
    let rounded = (a + 0x7_ffff + ((a >> 20) & 1)) & !0xf_ffff;
    let exponent = (rounded >> 23) + 7 - 127; // 1..=15 for 2^-6 <= |x| <= 448
    sign | ((exponent << 3) | ((rounded >> 20) & 7)) as u8
}

/// The multiplier stored for a 128 x 128 block that is all zeros: any finite scale keeps its
/// zeros; 1.0 keeps the dequantisation `q * scale` trivially exact and finite on every path.
pub const ZERO_BLOCK_SCALE: f32 = 1.0;

/// A float weight `[n, k]` (`w(i)`: its element `i`, row-major) quantised to e4m3 in 128 x 128
/// blocks as Qwen's FP8 releases are made (transformers' fine-grained FP8 quantisation): per
/// block (edge blocks partial), `amax = max |w|` and `scale = amax / 448` in f32
/// ([`ZERO_BLOCK_SCALE`] for an all-zero block), `q = e4m3(clamp(w / scale, -448, 448))` rounded
/// to nearest, ties to even ([`round_e4m3`], torch's cast). Returns the `[n, k]` e4m3 bytes and
/// the `[ceil(n/128), ceil(k/128)]` scales, the dequantisation multipliers (`w ~ q * scale`),
/// row-major; `None` where the weight holds a non-finite value (it has no block scale). Row
/// blocks are quantised in parallel: a 27B model's projections go through this at load.
pub fn quantise_weight_with(n: usize, k: usize, w: impl Fn(usize) -> f32 + Sync) -> Option<(Vec<u8>, Vec<f32>)> {
    let kb = k.div_ceil(FP8_BLOCK);
    let mut bytes = vec![0u8; n * k];
    let mut scale = vec![0f32; n.div_ceil(FP8_BLOCK) * kb];
    if n == 0 || k == 0 {
        return Some((bytes, scale));
    }
    let block = |(rb, (q, s)): (usize, (&mut [u8], &mut [f32]))| -> Option<()> {
        let row0 = rb * FP8_BLOCK;
        let rows = q.len() / k;
        for (cb, s) in s.iter_mut().enumerate() {
            let cols = cb * FP8_BLOCK..((cb + 1) * FP8_BLOCK).min(k);
            let mut amax = 0f32;
            for r in 0..rows {
                for c in cols.clone() {
                    let v = w((row0 + r) * k + c);
                    if !v.is_finite() {
                        return None;
                    }
                    amax = amax.max(v.abs());
                }
            }
            *s = if amax == 0.0 { ZERO_BLOCK_SCALE } else { amax / E4M3_MAX };
            for r in 0..rows {
                for c in cols.clone() {
                    let v = (w((row0 + r) * k + c) / *s).clamp(-E4M3_MAX, E4M3_MAX);
                    q[r * k + c] = e4m3_byte(v);
                }
            }
        }
        Some(())
    };
    bytes.par_chunks_mut(FP8_BLOCK * k).zip(scale.par_chunks_mut(kb)).enumerate().try_for_each(block)?;
    Some((bytes, scale))
}

/// [`quantise_weight_with`] of the row-major `[n, k]` weight `w`.
pub fn quantise_weight(w: &[f32], n: usize, k: usize) -> Option<(Vec<u8>, Vec<f32>)> {
    assert_eq!(w.len(), n * k, "a [{n}, {k}] weight");
    quantise_weight_with(n, k, |i| w[i])
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

    /// Each block's largest magnitude becomes 448 exactly, every value lands within half an
    /// e4m3 step of `w / scale`, partial edge blocks and all-zero blocks included; a non-finite
    /// value is refused.
    #[test]
    fn weights_quantise_per_block_to_the_e4m3_grid() {
        let (n, k) = (200, 300);
        let mut w: Vec<f32> =
            (0..n * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3 * (1 + i % 13) as f32).collect();
        // Block (1, 2) all zeros.
        for r in 128..200 {
            for c in 256..300 {
                w[r * k + c] = 0.0;
            }
        }
        let (q, s) = quantise_weight(&w, n, k).unwrap();
        assert_eq!(s.len(), 2 * 3);
        assert_eq!(s[5], ZERO_BLOCK_SCALE);
        let table = e4m3_table();
        for (rb, cb) in [(0, 0), (0, 2), (1, 0), (1, 1)] {
            let (rows, cols) = (rb * 128..(rb * 128 + 128).min(n), cb * 128..(cb * 128 + 128).min(k));
            let scale = s[rb * 3 + cb];
            let amax = rows
                .clone()
                .flat_map(|r| cols.clone().map(move |c| (r, c)))
                .fold(0f32, |m, (r, c)| m.max(w[r * k + c].abs()));
            assert_eq!(scale, amax / E4M3_MAX);
            let mut largest = 0f32;
            for r in rows {
                for c in cols.clone() {
                    let v = table[q[r * k + c] as usize];
                    assert_eq!(v, round_e4m3((w[r * k + c] / scale).clamp(-E4M3_MAX, E4M3_MAX)));
                    largest = largest.max(v.abs());
                }
            }
            assert_eq!(largest, E4M3_MAX);
        }
        assert!((128..200).all(|r| (256..300).all(|c| table[q[r * k + c] as usize] == 0.0)));
        w[12345] = f32::NAN;
        assert!(quantise_weight(&w, n, k).is_none());
    }

    #[test]
    fn a_nan_activation_stays_nan_and_its_group_keeps_its_scale() {
        let mut row: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) / 16.0).collect();
        let mut clean = row.clone();
        row[130] = f32::NAN;
        quantise_row(&mut row);
        quantise_row(&mut clean);
        assert!(row[130].is_nan());
        for (i, (a, b)) in row.iter().zip(&clean).enumerate().filter(|&(i, _)| i != 130) {
            assert_eq!(a.to_bits(), b.to_bits(), "element {i}");
        }
    }

    /// The bit-level conversion gives the bytes of the rounding and the general conversion: at
    /// every e4m3 value, every midpoint between neighbours and one step either side of it, both
    /// signs and zeros, and a sweep over the f32 values up to 448 (every 1,021st bit pattern).
    #[test]
    fn the_bit_level_byte_equals_the_rounding_and_conversion() {
        let reference = |x: f32| e4m3_bits(round_e4m3(x));
        let table = e4m3_table();
        let mut values: Vec<f32> = table.iter().copied().filter(|v| v.is_finite() && *v >= 0.0).collect();
        values.sort_by(f32::total_cmp);
        values.dedup();
        let mut probes = vec![0.0f32, -0.0, E4M3_MAX, -E4M3_MAX, f32::MIN_POSITIVE, 1e-30];
        probes.extend(values.iter().copied());
        for w in values.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            probes.extend([mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)]);
        }
        for x in probes.iter().flat_map(|&x| [x, -x]) {
            assert_eq!(e4m3_byte(x), reference(x), "{x:e} ({:#010x})", x.to_bits());
        }
        let mut checked = 0u64;
        for b in (0..=E4M3_MAX.to_bits()).step_by(1021) {
            for x in [f32::from_bits(b), -f32::from_bits(b)] {
                assert_eq!(e4m3_byte(x), reference(x), "{x:e} ({:#010x})", x.to_bits());
                checked += 1;
            }
        }
        assert!(checked > 2_000_000, "{checked}");
    }

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
