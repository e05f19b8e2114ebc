//! Element-wise passes over f32 CPU tensors, fused and run on rayon's threads. Each computes the
//! same operations, in the same order, as candle's separate ops (which run on one thread), so
//! the results are the same bits.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;

/// Elements per parallel piece: the split never changes a value, only who computes it.
const PIECE: usize = 1 << 14;

/// The `n` elements from `start` of an f32 CPU storage.
pub(crate) fn f32s(s: &Storage, start: usize, n: usize) -> candle_core::Result<&[f32]> {
    match s {
        Storage::Cpu(CpuStorage::F32(x)) if x.len() >= start + n => Ok(&x[start..start + n]),
        _ => candle_core::bail!("cpu ops: f32 tensors on the CPU expected"),
    }
}

/// `silu(gate) * up` in one pass, for f32 CPU tensors of one shape; `None` for anything else
/// (the caller then uses candle's ops).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !gate.device().is_cpu() || gate.dtype() != DType::F32 || up.dtype() != DType::F32 || gate.dims() != up.dims() {
        return Ok(None);
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    let n = gate.elem_count();
    let (gs, gl) = gate.storage_and_layout();
    let (us, ul) = up.storage_and_layout();
    let g = f32s(&gs, gl.start_offset(), n)?;
    let u = f32s(&us, ul.start_offset(), n)?;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(PIECE).zip(g.par_chunks(PIECE).zip(u.par_chunks(PIECE))).for_each(|(o, (g, u))| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            // candle's silu, then its mul.
            let s = g / (1.0 + (-g).exp());
            *o = s * u;
        }
    });
    Ok(Some(Tensor::from_vec(out, gate.dims(), gate.device())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The fused pass equals candle's silu then mul bit for bit, across pieces and for views.
    #[test]
    fn silu_mul_equals_candles_ops() {
        let dev = Device::Cpu;
        let n = 3 * PIECE + 77;
        let g: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 12.0).collect();
        let u: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.11).cos() * 3.0).collect();
        let g = Tensor::from_vec(g, (n / 7, 7), &dev).unwrap();
        let u = Tensor::from_vec(u, (n / 7, 7), &dev).unwrap();
        for (g, u) in [(g.clone(), u.clone()), (g.narrow(1, 1, 5).unwrap(), u.narrow(1, 2, 5).unwrap())] {
            let want = (candle_nn::ops::silu(&g).unwrap() * &u).unwrap();
            let got = silu_mul(&g, &u).unwrap().expect("f32 on the CPU is served");
            assert_eq!(got.dims(), want.dims());
            let (a, b) = (
                got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "fused silu*mul differs from candle's");
        }
        let half = g.to_dtype(DType::BF16).unwrap();
        assert!(silu_mul(&half, &half).unwrap().is_none(), "other dtypes go to candle's ops");
    }
}
