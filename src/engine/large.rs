//! Long batches on CUDA. Candle's CUDA kernels (element-wise, cast, affine, where, index_select,
//! copy, reductions, rms_norm) index with 32-bit integers, and their launches size the grid from
//! a 32-bit count: past 2^31 elements their indices wrap. A batch of 262,144 tokens of a
//! 5,120-wide model, or the taps stacked over its layers, passes that. These helpers run such an
//! op on slices of rows each small enough, and join the results along the rows; every op they
//! are used for treats rows independently, so the values are those of one whole launch. Below
//! the limit, and on the CPU, the op runs whole, as before.

use candle_core::{Device, Result, Tensor};

/// The most elements one candle CUDA op may span (its 32-bit signed indices stay exact below).
pub const MAX_ELEMS: usize = i32::MAX as usize;

/// The row ranges `(first, rows)` to run an op on in turn, where `rows` rows of `row_extent`
/// elements each (the widest any input or output spans per row, strides included) would pass
/// [`MAX_ELEMS`] on a CUDA device; `None` where the op may run whole.
pub fn slices(device: &Device, rows: usize, row_extent: usize) -> Option<Vec<(usize, usize)>> {
    slices_of(device.is_cuda(), rows, row_extent, MAX_ELEMS, SLICE_ELEMS)
}

/// Elements per slice (well below [`MAX_ELEMS`], so a slice's temporaries stay small next to the
/// whole tensor).
const SLICE_ELEMS: usize = 1 << 28;

fn slices_of(cuda: bool, rows: usize, row_extent: usize, limit: usize, slice: usize) -> Option<Vec<(usize, usize)>> {
    if !cuda || rows.saturating_mul(row_extent) <= limit {
        return None;
    }
    let step = (slice.min(limit) / row_extent.max(1)).max(1);
    Some((0..rows).step_by(step).map(|r0| (r0, step.min(rows - r0))).collect())
}

/// `f(first, rows)` for each slice, written in turn into one tensor of all the rows (each part
/// freed once copied, so at most one part is held next to the whole). Each part is at most
/// [`MAX_ELEMS`] elements: candle copies a part into its rows as one run of its elements at an
/// offset taken on the host, which stays exact for any total.
fn assemble(slices: &[(usize, usize)], mut f: impl FnMut(usize, usize) -> Result<Tensor>) -> Result<Tensor> {
    let rows: usize = slices.iter().map(|s| s.1).sum();
    let mut out: Option<Tensor> = None;
    for &(r0, n) in slices {
        let part = f(r0, n)?.contiguous()?;
        if part.rank() == 0 || part.dim(0)? != n {
            candle_core::bail!("a slice of {n} rows gave {:?}", part.shape());
        }
        let whole = match &out {
            Some(o) => o,
            None => {
                let mut dims = part.dims().to_vec();
                dims[0] = rows;
                // SAFETY: the slices cover every row once, and each is written below before
                // anything reads the tensor.
                out.insert(unsafe { Tensor::empty(dims, part.dtype(), part.device())? })
            }
        };
        whole.slice_set(&part, 0, r0)?;
    }
    out.ok_or_else(|| candle_core::Error::Msg("no rows to assemble".into()))
}

/// `f(first, rows)` on slices of `rows` rows (see [`slices`]), joined; `None` where the op may
/// run whole (then the caller runs it as before).
pub fn by_rows(
    device: &Device,
    rows: usize,
    row_extent: usize,
    mut f: impl FnMut(usize, usize) -> Result<Tensor>,
) -> Result<Option<Tensor>> {
    match slices(device, rows, row_extent) {
        Some(s) => assemble(&s, &mut f).map(Some),
        None => Ok(None),
    }
}

/// The elements one row of `x` spans along dimension 0: its stride there, or the row's size.
pub fn row_extent(x: &Tensor) -> usize {
    let rows = x.dims().first().copied().unwrap_or(1).max(1);
    let size = x.elem_count() / rows;
    x.stride().first().copied().unwrap_or(size).max(size)
}

/// `f(x)`, run on slices of `x`'s rows where `x` is too large for candle's CUDA kernels; `f`
/// must treat rows independently and give rows no wider than `x`'s.
pub fn map_rows(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if x.rank() == 0 {
        return f(x);
    }
    match by_rows(x.device(), x.dim(0)?, row_extent(x), |r0, n| f(&x.narrow(0, r0, n)?))? {
        Some(y) => Ok(y),
        None => f(x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slices_cover_every_row_once_within_the_limit() {
        assert_eq!(slices_of(false, 1 << 20, 1 << 20, MAX_ELEMS, SLICE_ELEMS), None);
        assert_eq!(slices_of(true, 100, 10, 1000, 1000), None);
        let s = slices_of(true, 1001, 10, 1000, 300).expect("past the limit");
        assert_eq!(s.len(), 34);
        assert!(s.iter().all(|&(_, n)| n <= 30));
        assert_eq!(s.last(), Some(&(990, 11)));
        // Rows wider than a slice go one at a time.
        assert_eq!(slices_of(true, 3, 5000, 1000, 1000), Some(vec![(0, 1), (1, 1), (2, 1)]));
        let s = slices_of(true, 262_144, 16_480, MAX_ELEMS, SLICE_ELEMS).expect("past the limit");
        assert!(s.iter().all(|&(_, n)| n * 16_480 <= SLICE_ELEMS));
        assert!(s.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
        assert_eq!(s.iter().map(|&(_, n)| n).sum::<usize>(), 262_144);
    }
}
