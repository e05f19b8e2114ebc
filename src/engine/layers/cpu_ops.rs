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

/// `t.t().contiguous()` for a 2-D tensor on the CPU, in blocks on rayon's threads (candle's
/// strided copy walks the source column by column on one thread, which takes seconds for one
/// large projection); the same values, moved. `None` for other devices, ranks and dtypes.
pub fn transposed(t: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !t.device().is_cpu() || t.rank() != 2 {
        return Ok(None);
    }
    let t = t.contiguous()?;
    let (rows, cols) = t.dims2()?;
    let (s, l) = t.storage_and_layout();
    let at = l.start_offset();
    let out = match &*s {
        Storage::Cpu(CpuStorage::F32(x)) => CpuStorage::F32(transpose(&x[at..at + rows * cols], rows, cols)),
        Storage::Cpu(CpuStorage::BF16(x)) => CpuStorage::BF16(transpose(&x[at..at + rows * cols], rows, cols)),
        Storage::Cpu(CpuStorage::F16(x)) => CpuStorage::F16(transpose(&x[at..at + rows * cols], rows, cols)),
        _ => return Ok(None),
    };
    let dims = (cols, rows);
    Ok(Some(match out {
        CpuStorage::F32(v) => Tensor::from_vec(v, dims, &candle_core::Device::Cpu)?,
        CpuStorage::BF16(v) => Tensor::from_vec(v, dims, &candle_core::Device::Cpu)?,
        CpuStorage::F16(v) => Tensor::from_vec(v, dims, &candle_core::Device::Cpu)?,
        _ => return Ok(None),
    }))
}

/// `[rows, cols]` row-major to `[cols, rows]` row-major.
fn transpose<T: Copy + Default + Send + Sync>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    transpose_map(rows, cols, |i| x[i])
}

/// The `[cols, rows]` transpose of a `[rows, cols]` row-major source whose element `i` is
/// `at(i)`: a band of output rows per task, each band in square tiles so reads and writes both
/// stay in cache.
fn transpose_map<T: Copy + Default + Send + Sync>(rows: usize, cols: usize, at: impl Fn(usize) -> T + Sync) -> Vec<T> {
    const TILE: usize = 64;
    let mut out = vec![T::default(); rows * cols];
    out.par_chunks_mut(TILE * rows.max(1)).enumerate().for_each(|(band, o)| {
        let c0 = band * TILE;
        let width = o.len() / rows.max(1);
        for r0 in (0..rows).step_by(TILE) {
            for c in c0..c0 + width {
                let dst = &mut o[(c - c0) * rows..(c - c0 + 1) * rows];
                for (r, d) in dst.iter_mut().enumerate().take((r0 + TILE).min(rows)).skip(r0) {
                    *d = at(r * cols + c);
                }
            }
        }
    });
    out
}

/// The `[cols, rows]` f32 transpose of a `[rows, cols]` weight stored little-endian as `dtype`
/// (f32, bf16 or f16) in `bytes`, in one pass: what a projection on the CPU in f32 keeps, read
/// straight from a memory-mapped checkpoint (widening is exact: the values of candle's cast then
/// copy). `None` for other dtypes or a size that does not match.
pub fn transposed_f32_from_bytes(
    bytes: &[u8],
    dtype: DType,
    rows: usize,
    cols: usize,
) -> candle_core::Result<Option<Tensor>> {
    let n = rows * cols;
    let two = |i: usize| u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
    let v = match dtype {
        DType::F32 if bytes.len() == 4 * n => transpose_map(rows, cols, |i| {
            f32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]])
        }),
        DType::BF16 if bytes.len() == 2 * n => transpose_map(rows, cols, |i| half::bf16::from_bits(two(i)).to_f32()),
        DType::F16 if bytes.len() == 2 * n => transpose_map(rows, cols, |i| half::f16::from_bits(two(i)).to_f32()),
        _ => return Ok(None),
    };
    Ok(Some(Tensor::from_vec(v, (cols, rows), &candle_core::Device::Cpu)?))
}

/// A 16-bit float tensor on the CPU as f32, on rayon's threads (candle's cast runs on one);
/// widening is exact, so the values are candle's. `None` for anything else.
pub fn widened(t: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !t.device().is_cpu() || !matches!(t.dtype(), DType::BF16 | DType::F16) {
        return Ok(None);
    }
    let t = t.contiguous()?;
    let n = t.elem_count();
    let (s, l) = t.storage_and_layout();
    let at = l.start_offset();
    let mut out = vec![0f32; n];
    match &*s {
        Storage::Cpu(CpuStorage::BF16(x)) => out
            .par_chunks_mut(PIECE)
            .zip(x[at..at + n].par_chunks(PIECE))
            .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, x)| *o = x.to_f32())),
        Storage::Cpu(CpuStorage::F16(x)) => out
            .par_chunks_mut(PIECE)
            .zip(x[at..at + n].par_chunks(PIECE))
            .for_each(|(o, x)| o.iter_mut().zip(x).for_each(|(o, x)| *o = x.to_f32())),
        _ => return Ok(None),
    }
    Ok(Some(Tensor::from_vec(out, t.dims(), &candle_core::Device::Cpu)?))
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

    /// The blocked transpose and the threaded widening equal candle's copy and cast bit for bit,
    /// for shapes that are not multiples of the tile, views, and 16-bit dtypes.
    #[test]
    fn transposed_and_widened_equal_candles_ops() {
        let dev = Device::Cpu;
        let v: Vec<f32> = (0..(130 * 70)).map(|i| ((i as f32) * 0.173).sin() * 3.0).collect();
        let t = Tensor::from_vec(v, (130, 70), &dev).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for x in
            [t.clone(), t.narrow(1, 3, 61).unwrap(), t.to_dtype(DType::BF16).unwrap(), t.to_dtype(DType::F16).unwrap()]
        {
            let got = transposed(&x).unwrap().expect("served on the CPU");
            let want = x.t().unwrap().contiguous().unwrap();
            assert_eq!((got.dims(), got.dtype()), (want.dims(), want.dtype()));
            assert!(bits(&got).iter().zip(bits(&want)).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        for half in [t.to_dtype(DType::BF16).unwrap(), t.to_dtype(DType::F16).unwrap().narrow(0, 5, 100).unwrap()] {
            let got = widened(&half).unwrap().expect("16-bit on the CPU");
            let want = half.to_dtype(DType::F32).unwrap();
            assert_eq!(got.dims(), want.dims());
            assert!(bits(&got).iter().zip(bits(&want)).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        assert!(widened(&t).unwrap().is_none(), "f32 is already wide");
        for half in [t.clone(), t.to_dtype(DType::BF16).unwrap(), t.to_dtype(DType::F16).unwrap()] {
            let bytes: Vec<u8> = match half.dtype() {
                DType::F32 => {
                    half.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().flat_map(|x| x.to_le_bytes()).collect()
                }
                DType::BF16 => half
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::bf16>()
                    .unwrap()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
                _ => half
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<half::f16>()
                    .unwrap()
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
            };
            let got = transposed_f32_from_bytes(&bytes, half.dtype(), 130, 70).unwrap().expect("a float dtype");
            let want = half.to_dtype(DType::F32).unwrap().t().unwrap().contiguous().unwrap();
            assert_eq!(got.dims(), want.dims());
            assert!(bits(&got).iter().zip(bits(&want)).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
        assert!(transposed_f32_from_bytes(&[0; 10], DType::F32, 130, 70).unwrap().is_none(), "sizes are checked");
    }
}
