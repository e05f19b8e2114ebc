//! What a batch returns, prepared on its device before anything is copied to the host: the rows
//! callers asked for (a selection of tokens), the rows to quantise to fp8 with one scale per
//! token per layer, and a screen for non-finite values in every returned row and layer.

use candle_core::{DType, Tensor, D};

use super::logprobs::{DeviceTopK, LogprobRows};
use super::EngineError;

/// The largest finite E4M3 value: a row scaled so its largest magnitude is this uses the whole
/// range of the format.
pub const FP8_MAX: f32 = 448.0;

/// Rows of a packed batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Every row, in order.
    All,
    /// These rows (indices into the batch's tokens), ascending; may be empty.
    Only(Vec<u32>),
}

impl Rows {
    pub fn none() -> Self {
        Rows::Only(Vec::new())
    }
}

/// Which rows of a batch come back, and in which form. The default: every row as computed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    /// Rows returned in the compute dtype.
    pub plain: Rows,
    /// Rows quantised to fp8 (E4M3) with a per-row, per-layer scale.
    pub fp8: Rows,
    /// Screen the returned rows for non-finite values (always, in the service; `layertap bench
    /// --no-screen` turns it off to measure what it costs, and then every flag reads 0).
    pub screen: bool,
    /// Rows whose next-token log-probabilities come back (see [`super::logprobs`]).
    pub logprobs: Option<LogprobRows>,
}

impl Default for Output {
    fn default() -> Self {
        Output { plain: Rows::All, fp8: Rows::none(), screen: true, logprobs: None }
    }
}

impl Output {
    /// Every row quantised to fp8 (nothing in the compute dtype).
    pub fn all_fp8() -> Self {
        Output { plain: Rows::none(), fp8: Rows::All, ..Output::default() }
    }

    /// The rows of each block: plain, fp8, log-probabilities (none when not asked).
    pub fn row_counts(&self, total: usize) -> (usize, usize, usize) {
        let count = |r: &Rows| match r {
            Rows::All => total,
            Rows::Only(r) => r.len(),
        };
        (count(&self.plain), count(&self.fp8), self.logprobs.as_ref().map_or(0, |l| count(&l.rows)))
    }

    /// Checks the rows against a batch of `total` tokens: ascending, in range.
    pub fn check(&self, total: usize) -> Result<(), EngineError> {
        let lp = self.logprobs.as_ref().map(|l| &l.rows);
        if let Some(l) = &self.logprobs {
            if l.top_k == 0 || l.top_k > super::logprobs::MAX_TOP_K {
                return Err(EngineError::InvalidInput(format!(
                    "top_k must be in 1..={}, got {}",
                    super::logprobs::MAX_TOP_K,
                    l.top_k
                )));
            }
        }
        for rows in [&self.plain, &self.fp8].into_iter().chain(lp) {
            if let Rows::Only(r) = rows {
                if r.windows(2).any(|w| w[1] <= w[0]) || r.last().is_some_and(|&x| x as usize >= total) {
                    return Err(EngineError::InvalidInput(format!(
                        "selected rows must be ascending and below the batch's {total} tokens"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// One group of returned rows on the device.
pub struct ReturnedRows {
    /// `[rows, layers, hidden]`: the compute dtype, or F8E4M3 for a quantised block.
    pub states: Tensor,
    /// `[rows, layers]` f32 scales of a quantised block (`states * scale` restores the values).
    pub scale: Option<Tensor>,
    /// `[rows, layers]` u8: 1 where the row holds a NaN or an infinity at that layer.
    pub nonfinite: Tensor,
}

/// The blocks of a batch: `None` where no row was selected.
pub struct Prepared {
    pub plain: Option<ReturnedRows>,
    pub fp8: Option<ReturnedRows>,
    /// The log-probabilities of the rows asked for them.
    pub logprobs: Option<DeviceTopK>,
}

fn select(stacked: &Tensor, rows: &Rows) -> candle_core::Result<Option<Tensor>> {
    match rows {
        Rows::All if stacked.dim(0)? == 0 => Ok(None),
        Rows::All => Ok(Some(stacked.clone())),
        Rows::Only(r) if r.is_empty() => Ok(None),
        Rows::Only(r) => {
            let idx = Tensor::new(r.as_slice(), stacked.device())?;
            // Candle's gather indexes its source in 32 bits, which wraps once the stacked taps
            // pass 2^31 elements; a kernel of ours copies the rows there.
            #[cfg(feature = "cuda")]
            if stacked.device().is_cuda() && stacked.elem_count() > super::large::MAX_ELEMS {
                let (rows, layers, hidden) = stacked.dims3()?;
                let flat = stacked.reshape((rows, layers * hidden))?;
                return Ok(Some(super::cuda::ops::copy_rows(&flat, Some(&idx))?.reshape((r.len(), layers, hidden))?));
            }
            Ok(Some(stacked.index_select(&idx, 0)?))
        }
    }
}

/// `[rows, layers]` u8, 1 where a row's values at a layer are not all finite. On a GPU, one
/// kernel reads each value's exponent bits once (`cuda::ops::nonfinite_rows`). Elsewhere,
/// multiplying by zero keeps finite values at exactly 0 and turns an infinity or a NaN into NaN,
/// which the sum keeps; NaN is the only value not equal to itself. One layer at a time, so the
/// temporaries stay a fraction of the taps.
pub fn nonfinite(states: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, layers, hidden) = states.dims3()?;
    #[cfg(feature = "cuda")]
    if states.device().is_cuda() && matches!(states.dtype(), DType::BF16 | DType::F16 | DType::F32) {
        // One pass reading the exponent bits, flags equal to the ops' below.
        return super::cuda::ops::nonfinite_rows(&states.reshape((rows * layers, hidden))?)?.reshape((rows, layers));
    }
    // Candle's kernels index in 32 bits: long batches are screened in slices of rows.
    let slice = |r0, n| nonfinite(&states.narrow(0, r0, n)?);
    if let Some(flags) = super::large::by_rows(states.device(), rows, layers * hidden, slice)? {
        return Ok(flags);
    }
    let cols = (0..layers)
        .map(|c| {
            let s = states.narrow(1, c, 1)?.affine(0.0, 0.0)?.sum(D::Minus1)?.to_dtype(DType::F32)?;
            s.ne(&s)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&cols, 1)
}

/// Quantises `[rows, layers, hidden]` to E4M3 with one scale per row and layer: the largest
/// magnitude maps to 448. Returns the fp8 values and the f32 scales `[rows, layers]` (0 for an
/// all-zero row). One layer at a time, so the f32 temporaries stay a fraction of the taps.
pub fn quantize_fp8(states: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (rows, layers, hidden) = states.dims3()?;
    // Candle's kernels index in 32 bits: long batches are quantised in slices of rows (each row's
    // scale is its own, so the values are the same).
    if let Some(slices) = super::large::slices(states.device(), rows, layers * hidden) {
        let (mut qs, mut scales) = (Vec::with_capacity(slices.len()), Vec::with_capacity(slices.len()));
        for (r0, n) in slices {
            let (q, s) = quantize_fp8(&states.narrow(0, r0, n)?)?;
            qs.push(q);
            scales.push(s);
        }
        return Ok((Tensor::cat(&qs, 0)?, Tensor::cat(&scales, 0)?));
    }
    let max = Tensor::new(FP8_MAX, states.device())?;
    let (mut qs, mut scales) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
    for c in 0..layers {
        let x = states.narrow(1, c, 1)?.to_dtype(DType::F32)?;
        let amax = x.abs()?.max_keepdim(D::Minus1)?;
        // Rows whose largest magnitude is below 1e-30 (zero, in practice) are scaled as if it
        // were 1e-30; the scale stored is then 0 for an all-zero row, and consistent otherwise.
        // True divisions (not products with reciprocals): the scale is exactly amax / 448.
        let floor = amax.maximum(1e-30)?;
        let inv = max.broadcast_div(&floor)?;
        qs.push(to_fp8(&x.broadcast_mul(&inv)?)?);
        let nonzero = amax.gt(0.0)?.to_dtype(DType::F32)?;
        scales.push((floor.broadcast_div(&max)? * nonzero)?.squeeze(D::Minus1)?);
    }
    Ok((Tensor::cat(&qs, 1)?, Tensor::cat(&scales, 1)?))
}

/// f32 values (already scaled) as E4M3, rounded to nearest even.
fn to_fp8(x: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return super::cuda::ops::f32_to_fp8(x);
    }
    x.to_dtype(DType::F8E4M3)
}

/// Selects, screens and quantises the stacked taps `[tokens, layers, hidden]` on their device.
pub fn prepare(stacked: &Tensor, out: &Output) -> candle_core::Result<Prepared> {
    let screen = |states: &Tensor| -> candle_core::Result<Tensor> {
        if out.screen {
            nonfinite(states)
        } else {
            let (rows, layers, _) = states.dims3()?;
            Tensor::zeros((rows, layers), DType::U8, states.device())
        }
    };
    let plain = match select(stacked, &out.plain)? {
        Some(states) => {
            let nonfinite = screen(&states)?;
            Some(ReturnedRows { states, scale: None, nonfinite })
        }
        None => None,
    };
    let fp8 = match select(stacked, &out.fp8)? {
        Some(states) => {
            let nonfinite = screen(&states)?;
            let (q, scale) = quantize_fp8(&states)?;
            Some(ReturnedRows { states: q, scale: Some(scale), nonfinite })
        }
        None => None,
    };
    Ok(Prepared { plain, fp8, logprobs: None })
}
