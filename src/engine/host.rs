//! Results in host memory: the bytes of hidden states (a vector or a page-locked buffer lent
//! by a device), the tensor the codec writes, and the taps of one batch with the cuts that
//! answers are written from.

use candle_core::Tensor;

use super::{EngineError, OutDType};

/// Hidden states of a batch in host memory, copied from the device once prepared there (rows
/// selected, screened, quantised: see [`super::output`]). `host` holds the rows returned in the
/// compute dtype, `[rows, layers.len(), hidden]` (every token of the batch unless a selection
/// left some out); `fp8` the rows quantised to fp8. [`Taps::gather`] cuts out one sequence's rows
/// and layers; it runs wherever the answer is encoded, off the device's thread.
pub struct Taps {
    /// The indices in the second dimension of `host` and `fp8`.
    pub layers: Vec<usize>,
    pub host: HostTensor,
    /// `[rows, layers]` for `host`: 1 where the row holds a NaN or an infinity at that layer.
    pub nonfinite: Vec<u8>,
    pub fp8: Option<Fp8Taps>,
    /// Next-token log-probabilities of the rows asked for them, in the order of their rows.
    pub logprobs: Option<super::logprobs::HostTopK>,
    /// Decoder layers actually run (early exit stops after the deepest requested index).
    pub layers_run: usize,
}

/// Rows quantised to fp8 (E4M3): values, one f32 scale per row and layer, and the non-finite
/// screen of the values before quantisation.
pub struct Fp8Taps {
    /// `[rows, layers, hidden]`, dtype [`OutDType::Float8E4M3`].
    pub host: HostTensor,
    /// `[rows, layers]`.
    pub scale: Vec<f32>,
    /// `[rows, layers]`.
    pub nonfinite: Vec<u8>,
}

/// Where the given layers sit among `have` (each must be there).
fn columns(have: &[usize], layers: &[usize]) -> Result<Vec<usize>, EngineError> {
    layers
        .iter()
        .map(|l| {
            have.iter()
                .position(|x| x == l)
                .ok_or_else(|| EngineError::InvalidInput(format!("layer {l} was not part of this batch")))
        })
        .collect()
}

/// `[rows, cols]` values of a per-row, per-layer table `[total, width]`, columns picked.
fn pick<T: Copy>(table: &[T], width: usize, start: usize, rows: usize, cols: &[usize]) -> Vec<T> {
    (start..start + rows).flat_map(|r| cols.iter().map(move |&c| table[r * width + c])).collect()
}

/// The rows `start..start + rows` of a `[total, width, hidden]` tensor, columns picked.
fn gather_rows(t: &HostTensor, start: usize, rows: usize, cols: &[usize]) -> Result<HostTensor, EngineError> {
    let [total, width, hidden] = t.shape[..] else {
        return Err(EngineError::InvalidInput("taps must be [tokens, layers, hidden]".into()));
    };
    if start + rows > total {
        return Err(EngineError::InvalidInput(format!("rows {start}..{} past {total} tokens", start + rows)));
    }
    let row_bytes = hidden * t.dtype.size_in_bytes();
    let mut data = Vec::with_capacity(rows * cols.len() * row_bytes);
    for r in start..start + rows {
        for &c in cols {
            let at = (r * width + c) * row_bytes;
            data.extend_from_slice(&t.data[at..at + row_bytes]);
        }
    }
    Ok(HostTensor { dtype: t.dtype, shape: vec![rows, cols.len(), hidden], data: data.into() })
}

impl Taps {
    /// Taps made on the host from the states of every row of a batch, `[tokens, layers, hidden]`,
    /// prepared as `output` asks on the CPU (what engines other than the model use, e.g. test fakes).
    pub fn from_host(
        layers: Vec<usize>,
        host: HostTensor,
        output: &super::output::Output,
        layers_run: usize,
    ) -> Result<Self, EngineError> {
        let t = Tensor::from_vec(host.to_f32(), host.shape.clone(), &candle_core::Device::Cpu)?
            .to_dtype(host.dtype.candle())?;
        let prepared = super::output::prepare(&t, output)?;
        Taps::from_prepared(layers, prepared, host.dtype, host.shape.get(2).copied().unwrap_or(0), layers_run)
    }

    /// Copies prepared blocks (on the CPU, or any device by way of candle's own copy).
    pub(crate) fn from_prepared(
        layers: Vec<usize>,
        p: super::output::Prepared,
        dtype: OutDType,
        hidden: usize,
        layers_run: usize,
    ) -> Result<Self, EngineError> {
        let width = layers.len();
        let (host, nonfinite) = match p.plain {
            Some(b) => (HostTensor::from_tensor(&b.states, dtype)?, b.nonfinite.flatten_all()?.to_vec1::<u8>()?),
            None => (HostTensor::empty(dtype, width, hidden), Vec::new()),
        };
        let fp8 = match p.fp8 {
            Some(b) => {
                let scale = match &b.scale {
                    Some(s) => s.flatten_all()?.to_vec1::<f32>()?,
                    None => return Err(EngineError::InvalidInput("an fp8 block without scales".into())),
                };
                Some(Fp8Taps {
                    host: HostTensor::from_tensor(&b.states, OutDType::Float8E4M3)?,
                    scale,
                    nonfinite: b.nonfinite.flatten_all()?.to_vec1::<u8>()?,
                })
            }
            None => None,
        };
        let logprobs = p.logprobs.as_ref().map(|l| l.to_host()).transpose()?;
        Ok(Taps { layers, host, nonfinite, fp8, logprobs, layers_run })
    }

    /// The bytes of plain rows `start..start + rows` without copying, when they are already laid
    /// out as asked: the same layers in the same order and the same dtype. Otherwise `None`
    /// (use [`Taps::gather`]).
    pub fn view(&self, start: usize, rows: usize, layers: &[usize], dtype: OutDType) -> Option<&[u8]> {
        let [total, width, hidden] = self.host.shape[..] else { return None };
        if layers != self.layers.as_slice() || dtype != self.host.dtype || start + rows > total {
            return None;
        }
        let row = width * hidden * dtype.size_in_bytes();
        self.host.data.get(start * row..(start + rows) * row)
    }

    /// The bytes of plain rows `start..start + rows` as asked: borrowed from the batch's buffer
    /// when [`Taps::view`] can, a gathered copy otherwise. What every answer is written from.
    pub fn bytes(
        &self,
        start: usize,
        rows: usize,
        layers: &[usize],
        dtype: OutDType,
    ) -> Result<std::borrow::Cow<'_, [u8]>, EngineError> {
        match self.view(start, rows, layers, dtype) {
            Some(v) => Ok(std::borrow::Cow::Borrowed(v)),
            None => Ok(std::borrow::Cow::Owned(self.gather(start, rows, layers, dtype)?.data.into_vec())),
        }
    }

    /// `[rows, layers.len(), hidden]` for plain rows `start..start + rows`, layers in the given
    /// order (each must be one of `self.layers`), in `dtype`.
    pub fn gather(
        &self,
        start: usize,
        rows: usize,
        layers: &[usize],
        dtype: OutDType,
    ) -> Result<HostTensor, EngineError> {
        let cols = columns(&self.layers, layers)?;
        Ok(gather_rows(&self.host, start, rows, &cols)?.to_dtype(dtype))
    }

    fn fp8_block(&self) -> Result<&Fp8Taps, EngineError> {
        self.fp8.as_ref().ok_or_else(|| EngineError::InvalidInput("this batch has no fp8 rows".into()))
    }

    /// The fp8 bytes of quantised rows `start..start + rows`, layers in the given order: borrowed
    /// when the layout already matches.
    pub fn fp8_bytes(
        &self,
        start: usize,
        rows: usize,
        layers: &[usize],
    ) -> Result<std::borrow::Cow<'_, [u8]>, EngineError> {
        let b = self.fp8_block()?;
        let [total, width, hidden] = b.host.shape[..] else {
            return Err(EngineError::InvalidInput("fp8 taps must be [tokens, layers, hidden]".into()));
        };
        if layers == self.layers.as_slice() && start + rows <= total {
            let row = width * hidden;
            if let Some(v) = b.host.data.get(start * row..(start + rows) * row) {
                return Ok(std::borrow::Cow::Borrowed(v));
            }
        }
        let cols = columns(&self.layers, layers)?;
        Ok(std::borrow::Cow::Owned(gather_rows(&b.host, start, rows, &cols)?.data.into_vec()))
    }

    /// `[rows, layers.len()]` scales of quantised rows `start..start + rows`.
    pub fn fp8_scale(&self, start: usize, rows: usize, layers: &[usize]) -> Result<Vec<f32>, EngineError> {
        let b = self.fp8_block()?;
        let cols = columns(&self.layers, layers)?;
        if (start + rows) * self.layers.len() > b.scale.len() {
            return Err(EngineError::InvalidInput("fp8 rows past the end of the batch".into()));
        }
        Ok(pick(&b.scale, self.layers.len(), start, rows, &cols))
    }

    /// `[rows, layers.len()]`: 1 where the row (plain, or quantised when `fp8`) holds a NaN or an
    /// infinity at that layer as it is sent: plain rows in `dtype`, so a value finite in the
    /// compute dtype that the cast to a narrower `dtype` turns into an infinity (past 65,504 in
    /// float16) is flagged too.
    pub fn nonfinite(
        &self,
        fp8: bool,
        start: usize,
        rows: usize,
        layers: &[usize],
        dtype: OutDType,
    ) -> Result<Vec<u8>, EngineError> {
        let flags = if fp8 { &self.fp8_block()?.nonfinite } else { &self.nonfinite };
        let cols = columns(&self.layers, layers)?;
        if (start + rows) * self.layers.len() > flags.len() {
            return Err(EngineError::InvalidInput("rows past the end of the batch's screen".into()));
        }
        let mut picked = pick(flags, self.layers.len(), start, rows, &cols);
        if let (false, Some(limit)) = (fp8, cast_limit(self.host.dtype, dtype)) {
            overflow_flags(&self.host, start, rows, &cols, limit, &mut picked)?;
        }
        Ok(picked)
    }
}

/// The smallest magnitude that becomes an infinity when a value of `from` is cast to `to`
/// (rounded to nearest even, as [`HostTensor::to_dtype`] casts); `None` where every finite value
/// of `from` stays finite in `to`. float16 ends at 65,504 and 65,520 is the midpoint to the next
/// power of two, which rounds to even, the infinity; bfloat16's largest value is 0x7F7F, and
/// f32 values from the midpoint 0x7F7F8000 on round to 0x7F80, the infinity.
pub fn cast_limit(from: OutDType, to: OutDType) -> Option<f32> {
    match (from, to) {
        (OutDType::Float32 | OutDType::Bfloat16, OutDType::Float16) => Some(65_520.0),
        (OutDType::Float32, OutDType::Bfloat16) => Some(f32::from_bits(0x7F7F_8000)),
        _ => None,
    }
}

/// Sets `flags[r * cols.len() + c]` where row `start + r` of `t` (`[total, width, hidden]`) holds
/// a value of magnitude `limit` or more at column `cols[c]`.
fn overflow_flags(
    t: &HostTensor,
    start: usize,
    rows: usize,
    cols: &[usize],
    limit: f32,
    flags: &mut [u8],
) -> Result<(), EngineError> {
    let [total, width, hidden] = t.shape[..] else {
        return Err(EngineError::InvalidInput("taps must be [tokens, layers, hidden]".into()));
    };
    if start + rows > total || flags.len() != rows * cols.len() {
        return Err(EngineError::InvalidInput(format!("rows {start}..{} past {total} tokens", start + rows)));
    }
    let size = t.dtype.size_in_bytes();
    for r in 0..rows {
        for (c, &col) in cols.iter().enumerate() {
            let at = ((start + r) * width + col) * hidden * size;
            let bytes = &t.data[at..at + hidden * size];
            let over = match t.dtype {
                OutDType::Float32 => {
                    bytes.chunks_exact(4).any(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).abs() >= limit)
                }
                OutDType::Bfloat16 => {
                    bytes.chunks_exact(2).any(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32().abs() >= limit)
                }
                OutDType::Float16 => {
                    bytes.chunks_exact(2).any(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32().abs() >= limit)
                }
                OutDType::Float8E4M3 => false,
            };
            if over {
                flags[r * cols.len() + c] = 1;
            }
        }
    }
    Ok(())
}

/// The bytes of 16-bit floats in memory order (one copy).
fn half_bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    const { assert!(std::mem::size_of::<T>() == 2) };
    // SAFETY: `T` is half::bf16 or half::f16, both `#[repr(transparent)]` over u16: plain 2-byte
    // values with no padding, so every byte of the slice is initialised and readable as u8.
    let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) };
    bytes.to_vec()
}

#[cfg(target_endian = "big")]
compile_error!("layertap writes little-endian safetensors from memory and needs a little-endian host");

/// A host buffer lent by a device (page-locked memory that goes back to its pool when dropped).
pub trait LentBuffer: Send + Sync {
    fn bytes(&self) -> &[u8];
}

/// Bytes in host memory: a vector, or a buffer lent by a device.
pub enum HostBytes {
    Vec(Vec<u8>),
    Lent(Box<dyn LentBuffer>),
}

impl std::ops::Deref for HostBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            HostBytes::Vec(v) => v,
            HostBytes::Lent(b) => b.bytes(),
        }
    }
}

impl HostBytes {
    /// The bytes as a vector (no copy when they already are one).
    pub fn into_vec(self) -> Vec<u8> {
        match self {
            HostBytes::Vec(v) => v,
            lent => lent.to_vec(),
        }
    }
}

impl From<Vec<u8>> for HostBytes {
    fn from(v: Vec<u8>) -> Self {
        HostBytes::Vec(v)
    }
}

impl Clone for HostBytes {
    fn clone(&self) -> Self {
        HostBytes::Vec(self.to_vec())
    }
}

impl PartialEq for HostBytes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBytes({} bytes)", self.len())
    }
}

/// A dense tensor in host memory as little-endian bytes: what the codec writes out.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub dtype: OutDType,
    pub shape: Vec<usize>,
    pub data: HostBytes,
}

impl HostTensor {
    pub(crate) fn from_tensor(t: &Tensor, dtype: OutDType) -> Result<Self, EngineError> {
        let flat = t.flatten_all()?;
        // Little-endian host (checked at compile time below): memory order is the file order.
        let data = match dtype {
            OutDType::Float32 => bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
            OutDType::Bfloat16 => half_bytes(&flat.to_vec1::<half::bf16>()?),
            OutDType::Float16 => half_bytes(&flat.to_vec1::<half::f16>()?),
            OutDType::Float8E4M3 => flat.to_vec1::<float8::F8E4M3>()?.iter().map(|x| x.to_bits()).collect(),
        };
        Ok(HostTensor { dtype, shape: t.dims().to_vec(), data: data.into() })
    }

    /// `[0, layers, hidden]`: no rows.
    pub fn empty(dtype: OutDType, layers: usize, hidden: usize) -> Self {
        Self::no_layers(dtype, 0, layers, hidden)
    }

    /// `[rows, layers, hidden]` with no values (`rows` or `layers` 0).
    pub fn no_layers(dtype: OutDType, rows: usize, layers: usize, hidden: usize) -> Self {
        HostTensor { dtype, shape: vec![rows, layers, hidden], data: Vec::new().into() }
    }

    /// `[..]` f32 values as a host tensor (for engines other than the model, e.g. test fakes).
    pub fn from_f32(values: &[f32], shape: Vec<usize>) -> Self {
        HostTensor { dtype: OutDType::Float32, shape, data: bytemuck::cast_slice(values).to_vec().into() }
    }

    /// The same values in another dtype (round to nearest even when narrowing).
    pub fn to_dtype(self, dtype: OutDType) -> Self {
        if dtype == self.dtype {
            return self;
        }
        let v = self.to_f32();
        let data = match dtype {
            OutDType::Float32 => bytemuck::cast_slice(&v).to_vec(),
            OutDType::Bfloat16 => half_bytes(&v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>()),
            OutDType::Float16 => half_bytes(&v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>()),
            // The values as they are, not scaled: only meaningful for values already in range.
            OutDType::Float8E4M3 => v.iter().map(|&x| float8::F8E4M3::from_f32(x).to_bits()).collect(),
        };
        HostTensor { dtype, shape: self.shape, data: data.into() }
    }

    /// Values as f32 (for tests and JSON output).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            OutDType::Float32 => {
                self.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            OutDType::Bfloat16 => {
                self.data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
            OutDType::Float16 => {
                self.data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
            OutDType::Float8E4M3 => self.data.iter().map(|&b| float8::F8E4M3::from_bits(b).to_f32()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taps() -> Taps {
        // 3 tokens, layers [3, 1], hidden 2: value = token * 100 + layer * 10 + component.
        let v: Vec<f32> = (0..3)
            .flat_map(|t| [3usize, 1].into_iter().flat_map(move |l| (0..2).map(move |h| (t * 100 + l * 10 + h) as f32)))
            .collect();
        Taps::from_host(vec![3, 1], HostTensor::from_f32(&v, vec![3, 2, 2]), &Default::default(), 3).unwrap()
    }

    /// The cast limits are exactly where the casts the answers use start giving infinities.
    #[test]
    fn cast_limits_are_where_the_casts_overflow() {
        let f16_limit = cast_limit(OutDType::Float32, OutDType::Float16).unwrap();
        assert!(half::f16::from_f32(f16_limit).is_infinite());
        assert!(half::f16::from_f32(-f16_limit).is_infinite());
        assert!(half::f16::from_f32(f32::from_bits(f16_limit.to_bits() - 1)).is_finite());
        assert_eq!(cast_limit(OutDType::Bfloat16, OutDType::Float16), Some(f16_limit));
        let bf16_limit = cast_limit(OutDType::Float32, OutDType::Bfloat16).unwrap();
        assert!(half::bf16::from_f32(bf16_limit).is_infinite());
        assert!(half::bf16::from_f32(f32::from_bits(bf16_limit.to_bits() - 1)).is_finite());
        for (from, to) in [
            (OutDType::Float16, OutDType::Float32),
            (OutDType::Float16, OutDType::Bfloat16),
            (OutDType::Bfloat16, OutDType::Float32),
            (OutDType::Float32, OutDType::Float32),
        ] {
            assert_eq!(cast_limit(from, to), None, "{from:?} -> {to:?}");
        }
    }

    /// A row finite in the compute dtype that overflows in the answer's dtype is flagged for
    /// that dtype only, at its layer only.
    #[test]
    fn the_screen_flags_what_the_cast_to_the_answers_dtype_overflows() {
        // 2 tokens, layers [3, 1], hidden 2; token 1's layer 1 holds 70,000.
        let v = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 70_000.0, -1.0];
        let t = Taps::from_host(vec![3, 1], HostTensor::from_f32(&v, vec![2, 2, 2]), &Default::default(), 3).unwrap();
        assert_eq!(t.nonfinite(false, 0, 2, &[3, 1], OutDType::Float32).unwrap(), vec![0, 0, 0, 0]);
        assert_eq!(t.nonfinite(false, 0, 2, &[3, 1], OutDType::Bfloat16).unwrap(), vec![0, 0, 0, 0]);
        assert_eq!(t.nonfinite(false, 0, 2, &[3, 1], OutDType::Float16).unwrap(), vec![0, 0, 0, 1]);
        assert_eq!(t.nonfinite(false, 1, 1, &[1], OutDType::Float16).unwrap(), vec![1]);
        assert_eq!(t.nonfinite(false, 0, 1, &[3, 1], OutDType::Float16).unwrap(), vec![0, 0]);
        // and the gathered float16 values are indeed infinite there
        let sent = t.gather(1, 1, &[1], OutDType::Float16).unwrap().to_f32();
        assert!(sent[0].is_infinite());
    }

    /// A view is offered exactly when the batch already holds the rows as asked, and then it
    /// is the same bytes a gather would copy.
    #[test]
    fn view_only_when_the_layout_matches_and_then_equals_gather() {
        let t = taps();
        let v = t.view(1, 2, &[3, 1], OutDType::Float32).expect("same layers, same dtype");
        assert_eq!(v, &t.gather(1, 2, &[3, 1], OutDType::Float32).unwrap().data[..]);
        let first: Vec<f32> = v[..8].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(first, vec![130.0, 131.0]);
        assert!(t.view(1, 2, &[1, 3], OutDType::Float32).is_none(), "other layer order");
        assert!(t.view(1, 2, &[3], OutDType::Float32).is_none(), "a subset of layers");
        assert!(t.view(1, 2, &[3, 1], OutDType::Bfloat16).is_none(), "another dtype");
        assert!(t.view(2, 2, &[3, 1], OutDType::Float32).is_none(), "rows past the end");
        // `bytes` borrows exactly when a view exists, and copies the gathered rows otherwise.
        assert!(matches!(t.bytes(1, 2, &[3, 1], OutDType::Float32).unwrap(), std::borrow::Cow::Borrowed(_)));
        let owned = t.bytes(1, 2, &[1, 3], OutDType::Float32).unwrap();
        assert!(matches!(owned, std::borrow::Cow::Owned(_)));
        assert_eq!(&owned[..], &t.gather(1, 2, &[1, 3], OutDType::Float32).unwrap().data[..]);
    }
}
