//! Named tensors from safetensors files or from memory (GGUF), checked for shape and cast to the
//! compute dtype and device.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Mutex;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use super::config::quant::{quantised_at_load, Quantization, FP8_BLOCK};
use super::stages::StageBytes;
use super::synthetic::SyntheticTensors;
use super::EngineError;

pub enum TensorSource {
    Safetensors { files: Vec<PathBuf>, tensors: Store },
    Gguf(super::gguf::GgufTensors),
}

/// Where named tensors in the safetensors layout come from: memory-mapped files, or the random
/// tensors of a manifest (`--synthetic-weights`).
pub enum Store {
    Files(MmapedSafetensors),
    Synthetic(std::sync::Arc<SyntheticTensors>),
}

/// A stored tensor: its dtype (`None` where the loader reads no such dtype), the dtype as the
/// file names it, its shape and bytes.
pub struct View<'a> {
    pub dtype: Option<DType>,
    pub dtype_name: String,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl Store {
    /// The tensor `name`, if stored.
    pub fn get(&self, name: &str) -> Option<View<'_>> {
        match self {
            Store::Files(t) => t.get(name).ok().map(|v| View {
                dtype: DType::try_from(v.dtype()).ok(),
                dtype_name: format!("{:?}", v.dtype()),
                shape: v.shape().to_vec(),
                data: v.data(),
            }),
            Store::Synthetic(s) => s.get(name).map(|d| View {
                dtype: d.dtype,
                dtype_name: d.dtype_name.to_string(),
                shape: d.shape.to_vec(),
                data: d.data,
            }),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.dtype(name).is_some()
    }

    /// The dtype and dtype name of `name`, if stored, without reading (or drawing) its values.
    pub fn dtype(&self, name: &str) -> Option<(Option<DType>, String)> {
        match self {
            Store::Files(t) => t.get(name).ok().map(|v| (DType::try_from(v.dtype()).ok(), format!("{:?}", v.dtype()))),
            Store::Synthetic(s) => s.dtype(name).map(|(d, n)| (d, n.to_string())),
        }
    }

    /// The shape of `name`, if stored, without reading (or drawing) its values.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self {
            Store::Files(t) => t.get(name).ok().map(|v| v.shape().to_vec()),
            Store::Synthetic(s) => s.shape(name).map(<[usize]>::to_vec),
        }
    }

    /// Every tensor's name, dtype and dtype name.
    pub fn list(&self) -> Vec<(String, Option<DType>, String)> {
        match self {
            Store::Files(t) => t
                .tensors()
                .into_iter()
                .map(|(n, v)| (n, DType::try_from(v.dtype()).ok(), format!("{:?}", v.dtype())))
                .collect(),
            Store::Synthetic(s) => s.list().map(|(n, d, dn)| (n.to_string(), d, dn.to_string())).collect(),
        }
    }

    /// The bytes `name` takes as stored, if stored, without reading (or drawing) its values.
    fn stored_bytes(&self, name: &str) -> Option<u64> {
        match self {
            Store::Files(t) => t.get(name).ok().map(|v| v.data().len() as u64),
            Store::Synthetic(s) => {
                let (dtype, _) = s.dtype(name)?;
                let elems: usize = s.shape(name)?.iter().product();
                Some((elems * dtype.map_or(1, |d| d.size_in_bytes())) as u64)
            }
        }
    }

    /// The tensor `name` on the CPU in its stored dtype.
    fn load_cpu(&self, name: &str) -> Result<Tensor, EngineError> {
        match self {
            Store::Files(t) => Ok(t.load(name, &Device::Cpu)?),
            Store::Synthetic(_) => {
                let v = self.get(name).ok_or_else(|| EngineError::Load(format!("no tensor {name:?}")))?;
                let dtype = v.dtype.ok_or_else(|| EngineError::Load(format!("{name:?}: {}", v.dtype_name)))?;
                Ok(Tensor::from_raw_buffer(v.data, dtype, &v.shape, &Device::Cpu)?)
            }
        }
    }
}

pub struct Weights {
    source: TensorSource,
    /// Prefix in front of every decoder tensor name ("model." in `*ForCausalLM` checkpoints).
    prefix: String,
    pub device: Device,
    pub dtype: DType,
    /// Full names of the tensors read so far, for [`Weights::check_unread`].
    read: Mutex<HashSet<String>>,
    /// Full names of tensors the model has no place for and leaves unread, as transformers does
    /// ([`Weights::pass_over`]).
    passed_over: Mutex<HashSet<String>>,
    /// The scheme config.json declares: which quantised tensors may be read, and how.
    quantization: Option<Quantization>,
    /// Whether FP8 projections may run as FP8 GEMMs where the GPU runs them
    /// (`EngineOptions::fp8_gemm`).
    pub fp8_gemm: bool,
    /// Whether an FP8 down projection quantises SiLU · up in the kernel that computes it
    /// (`EngineOptions::fp8_fused`).
    pub fp8_fused: bool,
    /// How many FP8 projections were loaded for each way of multiplying them.
    fp8_paths: Mutex<std::collections::BTreeMap<String, usize>>,
    /// Under [`Quantization::Fp8AtLoad`]: how many projections it names stayed in float, by
    /// reason ([`NOT_WHOLE_GROUPS`], or a Qwen3-Next `in_proj_qkvz` not in whole blocks).
    kept_float: Mutex<std::collections::BTreeMap<&'static str, usize>>,
}

/// Why `--quantize fp8` keeps a projection it names in float: its input cannot be quantised in
/// whole groups of 128.
const NOT_WHOLE_GROUPS: &str = "input features not a multiple of 128";
const _: () = assert!(FP8_BLOCK == 128, "NOT_WHOLE_GROUPS names the block size");

/// The dtypes the loader reads a parameter from: floating-point weights, cast to the compute
/// dtype. Anything else (FP8, packed integers, scales) needs arithmetic the loader does not do.
const FLOAT_DTYPES: &[DType] = &[DType::F32, DType::F16, DType::BF16, DType::F64];

/// Half of an MXFP4 experts tensor.
#[derive(Clone, Copy)]
enum Mxfp4Part {
    Blocks,
    Scales,
}

/// Half of an FP8 projection.
#[derive(Clone, Copy)]
enum Fp8Part {
    Weight,
    Scale,
}

/// An FP8 projection as the checkpoint stores it: e4m3 bytes `[n, k]` and the block scales
/// `[ceil(n/128), ceil(k/128)]` row-major, in f32.
pub struct Fp8Host<'a> {
    /// `[N, K]` e4m3 bytes, row-major: borrowed from the memory-mapped file, or owned where the
    /// loader rearranged or produced them.
    pub bytes: std::borrow::Cow<'a, [u8]>,
    pub scale: Vec<f32>,
    pub n: usize,
    pub k: usize,
}

impl Fp8Host<'_> {
    /// The projection whose rows are `ranges` of this one's, in that order, owned: each range
    /// starts on a 128-row block boundary and spans whole blocks (the last range may end at the
    /// last row), so its rows keep their block scales and the scale rows move with them. A range
    /// that cuts a block would need scales the checkpoint does not hold, and is an error.
    pub fn gather_rows(&self, ranges: &[std::ops::Range<usize>]) -> Result<Fp8Host<'static>, EngineError> {
        let blocks_k = self.k.div_ceil(FP8_BLOCK);
        let (mut bytes, mut scale) = (Vec::new(), Vec::new());
        for (i, r) in ranges.iter().enumerate() {
            let last = i + 1 == ranges.len() && r.end == self.n;
            let whole = r.start.is_multiple_of(FP8_BLOCK) && (r.end.is_multiple_of(FP8_BLOCK) || last);
            if r.start > r.end || r.end > self.n || !whole {
                return Err(EngineError::Load(format!(
                    "rows {r:?} of an FP8 projection with {} rows are not whole {FP8_BLOCK}-row blocks",
                    self.n
                )));
            }
            bytes.extend_from_slice(&self.bytes[r.start * self.k..r.end * self.k]);
            let (b0, b1) = (r.start / FP8_BLOCK, r.end.div_ceil(FP8_BLOCK));
            scale.extend_from_slice(&self.scale[b0 * blocks_k..b1 * blocks_k]);
        }
        let n = ranges.iter().map(|r| r.end - r.start).sum();
        Ok(Fp8Host { bytes: std::borrow::Cow::Owned(bytes), scale, n, k: self.k })
    }

    /// The projection whose row `r` is this one's row `order[r]`, owned: each row stays in its
    /// 128-row block, so the block scales apply unchanged to the reordered bytes. A row moved to
    /// another block would need scales the checkpoint does not hold, and is an error.
    pub fn permute_rows(&self, order: &[usize]) -> Result<Fp8Host<'static>, EngineError> {
        let k = self.k;
        if order.len() != self.n {
            return Err(EngineError::Load(format!("{} rows reordered as {}", self.n, order.len())));
        }
        if let Some((r, &from)) = order.iter().enumerate().find(|&(r, &from)| from / FP8_BLOCK != r / FP8_BLOCK) {
            return Err(EngineError::Load(format!(
                "row {from} of an FP8 projection would move to row {r}, another {FP8_BLOCK}-row block with \
                 another scale"
            )));
        }
        let bytes = order.iter().flat_map(|&from| &self.bytes[from * k..(from + 1) * k]).copied().collect();
        Ok(Fp8Host { bytes: std::borrow::Cow::Owned(bytes), scale: self.scale.clone(), n: self.n, k })
    }
}

/// A fused experts tensor `[E, parts * N, K]` quantised at load ([`Quantization::Fp8AtLoad`])
/// one `[N, K]` projection at a time, so only one expert's bytes are held besides the
/// memory-mapped floats.
pub struct Fp8Stacked<'a> {
    name: String,
    data: &'a [u8],
    dtype: DType,
    /// Projections per expert along the rows (2 for `gate_up_proj`: gate, then up).
    pub parts: usize,
    pub n: usize,
    pub k: usize,
}

impl Fp8Stacked<'_> {
    /// Part `part` of expert `expert` (rows `part * N .. (part + 1) * N` of its `[parts * N, K]`).
    pub fn get(&self, expert: usize, part: usize) -> Result<Fp8Host<'static>, EngineError> {
        let (n, k) = (self.n, self.k);
        let at = (expert * self.parts + part) * n * k;
        let (bytes, scale) = quantise_float(self.data, self.dtype, at, n, k).ok_or_else(|| non_finite(&self.name))?;
        Ok(Fp8Host { bytes: std::borrow::Cow::Owned(bytes), scale, n, k })
    }
}

/// Elements `at .. at + n * k` of the little-endian float tensor `data` (`dtype`: f32, f16,
/// bf16 or f64) as an `[n, k]` weight quantised to FP8 blocks
/// ([`crate::engine::layers::fp8::quantise_weight_with`]); `None` where a value is not finite
/// (or the dtype is not one of those, which the callers check first).
fn quantise_float(data: &[u8], dtype: DType, at: usize, n: usize, k: usize) -> Option<(Vec<u8>, Vec<f32>)> {
    use crate::engine::layers::fp8::quantise_weight_with as quantise;
    let bytes = |i: usize, size: usize| &data[(at + i) * size..(at + i + 1) * size];
    let two = |i: usize| u16::from_le_bytes([data[2 * (at + i)], data[2 * (at + i) + 1]]);
    match dtype {
        DType::F32 => quantise(n, k, |i| f32::from_le_bytes(bytes(i, 4).try_into().unwrap_or_default())),
        DType::BF16 => quantise(n, k, |i| half::bf16::from_bits(two(i)).to_f32()),
        DType::F16 => quantise(n, k, |i| half::f16::from_bits(two(i)).to_f32()),
        DType::F64 => quantise(n, k, |i| f64::from_le_bytes(bytes(i, 8).try_into().unwrap_or_default()) as f32),
        _ => None,
    }
}

/// A tensor of the checkpoint as stored: its full name and bytes.
struct RawPart<'a> {
    name: String,
    data: &'a [u8],
}

/// A float tensor of the checkpoint: its full name, little-endian bytes and dtype.
struct FloatTensor<'a> {
    full: String,
    data: &'a [u8],
    dtype: DType,
}

fn non_finite(full: &str) -> EngineError {
    EngineError::Load(format!(
        "tensor {full:?} holds a value that is not finite (NaN or infinity), so it has no FP8 block scale: \
         --quantize fp8 cannot quantise it"
    ))
}

/// Checkpoint parts outside the text decoder that are never read and may hold anything (a
/// vision tower, a multi-token-prediction head, the output head).
const IGNORED_PREFIXES: &[&str] = &[
    "mtp.",
    "model.mtp.",
    "model.visual.",
    "visual.",
    "model.vision_tower.",
    "vision_tower.",
    "model.vision_model.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "lm_head.",
];

/// Name parts of the tensors quantisation methods add (scales, packed weights, zero points).
const QUANT_MARKERS: &[&str] = &["_scale", "scale_inv", "qweight", "qzeros", "scales", "g_idx", "absmax", "quant_"];

/// Model parameters whose names carry a quantisation marker but which are plain floats (Gemma 4's
/// router multiplies each expert's weight by its `per_expert_scale`).
const FLOAT_PARAMETERS: &[&str] = &["per_expert_scale"];

/// Whether the last part of a tensor name marks it as quantisation data.
fn is_quant_data(full: &str) -> bool {
    full.rsplit('.')
        .next()
        .is_some_and(|last| !FLOAT_PARAMETERS.contains(&last) && QUANT_MARKERS.iter().any(|m| last.contains(m)))
}

/// The index of the first value of `data` (little-endian `dtype`) that is not finite: a float
/// whose exponent bits are all ones (an infinity or a NaN; E4M3 has no infinities, and its NaNs
/// are 0x7F and 0xFF). `None` where every value is finite, and for integer dtypes.
pub fn first_nonfinite(data: &[u8], dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 => {
            data.chunks_exact(4).position(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7F80_0000 == 0x7F80_0000)
        }
        DType::F64 => data.chunks_exact(8).position(|b| {
            u64::from_le_bytes(b.try_into().unwrap_or_default()) & 0x7FF0_0000_0000_0000 == 0x7FF0_0000_0000_0000
        }),
        DType::BF16 => data.chunks_exact(2).position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80),
        DType::F16 => data.chunks_exact(2).position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00),
        DType::F8E4M3 => data.iter().position(|&b| b & 0x7F == 0x7F),
        _ => None,
    }
}

/// [`first_nonfinite`] over every core: the first non-finite value's index.
fn first_nonfinite_par(data: &[u8], dtype: DType) -> Option<usize> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 20;
    let size = dtype.size_in_bytes();
    if data.len() <= CHUNK {
        return first_nonfinite(data, dtype);
    }
    let per = CHUNK / size * size;
    data.par_chunks(per)
        .enumerate()
        .filter_map(|(i, c)| first_nonfinite(c, dtype).map(|at| i * (per / size) + at))
        .min()
}

/// A checkpoint tensor holding a NaN or an infinity.
fn nonfinite_weight(full: &str, at: usize, shape: &[usize], where_from: &str) -> EngineError {
    EngineError::Load(format!(
        "tensor {full:?} in {where_from} holds a value that is not finite (NaN or infinity) at element {at} of \
         {shape:?}: the checkpoint is damaged (a bad download, a failed conversion or training run), and a model \
         with such a weight gives NaN or meaningless states; layertap refuses it rather than serve them"
    ))
}

impl Weights {
    pub fn new(source: TensorSource, device: Device, dtype: DType) -> Self {
        // Multimodal wrappers (`*ForConditionalGeneration`) keep the text decoder under
        // "model.language_model."; `*ForCausalLM` checkpoints name it "model."; bare decoder
        // checkpoints use no prefix. GGUF names are mapped without a prefix. Tensors outside
        // the decoder (vision tower, multi-token-prediction head) are never read.
        let prefix = match &source {
            TensorSource::Safetensors { tensors, .. } => ["model.language_model.", "model."]
                .into_iter()
                .find(|p| tensors.has(&format!("{p}embed_tokens.weight")))
                .unwrap_or(""),
            TensorSource::Gguf(_) => "",
        };
        Weights {
            source,
            prefix: prefix.into(),
            device,
            dtype,
            read: Mutex::default(),
            passed_over: Mutex::default(),
            quantization: None,
            fp8_gemm: true,
            fp8_fused: true,
            fp8_paths: Mutex::default(),
            kept_float: Mutex::default(),
        }
    }

    /// `read` with the tensors read onto `device` (a stage's), then the weights' own device again.
    pub fn on<T>(
        &mut self,
        device: &Device,
        read: impl FnOnce(&Weights) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let own = std::mem::replace(&mut self.device, device.clone());
        let r = read(self);
        self.device = own;
        r
    }

    /// The quantisation scheme the checkpoint's config declares.
    pub fn with_quantization(mut self, quantization: Option<Quantization>) -> Self {
        self.quantization = quantization;
        self
    }

    /// `name` as the checkpoint spells it (with the decoder prefix).
    pub fn full_name(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Whether the checkpoint has `name` (without the decoder prefix).
    pub fn has(&self, name: &str) -> bool {
        let full = self.full_name(name);
        match &self.source {
            TensorSource::Safetensors { tensors, .. } => tensors.has(&full),
            TensorSource::Gguf(g) => g.has(name),
        }
    }

    /// The checkpoint's weight bytes as stored, as a split into stages weighs them: each of the
    /// first `layers` decoder layers', the embeddings' and the final norm's and output head's
    /// (the embeddings again where `tied`: the last stage holds the head on its own device).
    /// Tensors outside the decoder (a vision tower, an MTP head) count nowhere.
    pub fn stage_bytes(&self, layers: usize, tied: bool) -> StageBytes {
        let stored: Vec<(String, u64)> = match &self.source {
            TensorSource::Safetensors { tensors, .. } => tensors
                .list()
                .into_iter()
                .filter_map(|(full, _, _)| {
                    let bytes = tensors.stored_bytes(&full)?;
                    Some((full.strip_prefix(self.prefix.as_str()).unwrap_or(&full).to_string(), bytes))
                })
                .collect(),
            TensorSource::Gguf(g) => g.stored_bytes(),
        };
        let mut out = StageBytes { layers: vec![0; layers], first: 0, last: 0 };
        for (name, bytes) in stored {
            if let Some(rest) = name.strip_prefix("layers.") {
                if let Some(i) = rest.split('.').next().and_then(|i| i.parse::<usize>().ok()).filter(|&i| i < layers) {
                    out.layers[i] += bytes;
                }
            } else if name.starts_with("embed_tokens.") {
                out.first += bytes;
                if tied {
                    out.last += bytes;
                }
            } else if name.starts_with("norm.") || name == "lm_head.weight" {
                out.last += bytes;
            }
        }
        out
    }

    /// The output head `lm_head.weight` (outside the decoder prefix; `output.weight` in GGUF) in
    /// the compute dtype, shape checked; `None` when the checkpoint has none.
    pub fn get_head(&self, shape: &[usize]) -> Result<Option<Tensor>, EngineError> {
        const HEAD: &str = "lm_head.weight";
        let t = match &self.source {
            TensorSource::Safetensors { tensors, .. } => {
                let Some((dtype, dtype_name)) = tensors.dtype(HEAD) else { return Ok(None) };
                if !dtype.is_some_and(|d| FLOAT_DTYPES.contains(&d)) {
                    return Err(self.unreadable(HEAD, &dtype_name));
                }
                self.check_shape(tensors, HEAD, shape)?;
                self.mark_read(HEAD);
                tensors.load_cpu(HEAD)?
            }
            TensorSource::Gguf(g) => match g.load(HEAD)? {
                Some(t) => t,
                None => return Ok(None),
            },
        };
        if t.dims() != shape {
            return Err(self.shape_mismatch(HEAD, t.dims(), shape));
        }
        Ok(Some(t.to_dtype(self.dtype)?.to_device(&self.device)?))
    }

    /// Whether the checkpoint holds an output head `lm_head.weight` (`output.weight` in GGUF).
    pub fn has_head(&self) -> bool {
        match &self.source {
            TensorSource::Safetensors { tensors, .. } => tensors.has("lm_head.weight"),
            TensorSource::Gguf(g) => g.has("lm_head.weight"),
        }
    }

    fn where_from(&self) -> String {
        match &self.source {
            TensorSource::Safetensors { files, .. } => {
                let names: Vec<_> =
                    files.iter().filter_map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned())).collect();
                names.join(", ")
            }
            TensorSource::Gguf(g) => g.describe(),
        }
    }

    /// Loads `name` (without the "model." prefix), checks its shape and casts it to the
    /// compute dtype.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        self.get_as(name, shape, self.dtype)
    }

    /// Loads `name` in f32 whatever the compute dtype: for the few tensors that are computed
    /// with in f32 (gate constants, zero-centred norm weights), so an f32 tensor inside a
    /// 16-bit checkpoint keeps its precision.
    pub fn get_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor, EngineError> {
        self.get_as(name, shape, DType::F32)
    }

    fn get_as(&self, name: &str, shape: &[usize], want: DType) -> Result<Tensor, EngineError> {
        let full = self.full_name(name);
        let t = match &self.source {
            TensorSource::Safetensors { tensors, .. } => {
                let Some((dtype, dtype_name)) = tensors.dtype(&full) else {
                    return Err(self.missing(&full));
                };
                let Some(stored) = dtype.filter(|d| FLOAT_DTYPES.contains(d)) else {
                    return Err(self.unreadable(&full, &dtype_name));
                };
                self.check_shape(tensors, &full, shape)?;
                self.mark_read(&full);
                if stored == want && !self.device.is_cpu() {
                    // Stored as computed: the bytes go to the device in one copy, straight from
                    // the file's mapping (or the drawn values), with no tensor on the host.
                    let v = tensors.get(&full).ok_or_else(|| self.missing(&full))?;
                    return Ok(Tensor::from_raw_buffer(v.data, stored, &v.shape, &self.device)?);
                }
                tensors.load_cpu(&full)?
            }
            TensorSource::Gguf(g) => {
                let t = g.load(name)?.ok_or_else(|| self.missing(&full))?;
                // Dequantised on the host: its values are checked here (safetensors files are
                // checked once loaded, by `check_finite`).
                let values = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                if let Some(at) = values.iter().position(|v| !v.is_finite()) {
                    return Err(nonfinite_weight(&full, at, t.dims(), &self.where_from()));
                }
                t
            }
        };
        if t.dims() != shape {
            return Err(self.shape_mismatch(&full, t.dims(), shape));
        }
        if want == DType::F32 && self.device.is_cpu() {
            if let Some(wide) = crate::engine::layers::cpu_ops::widened(&t)? {
                return Ok(wide);
            }
        }
        Ok(t.to_dtype(want)?.to_device(&self.device)?)
    }

    /// On the CPU in f32, the `[in, out]` transpose of the `[out, in]` safetensors weight `name`
    /// (shape checked): what a projection keeps, read, widened and transposed from the
    /// memory-mapped file in one pass on every core, so a large model's first layers load in
    /// seconds for the self-check's reference. `None` elsewhere (then [`Weights::get`]).
    pub fn get_transposed_f32(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>, EngineError> {
        let (TensorSource::Safetensors { tensors, .. }, [rows, cols], DType::F32, true) =
            (&self.source, shape, self.dtype, self.device.is_cpu())
        else {
            return Ok(None);
        };
        let (full, data, dtype) = self.float_view(tensors, name, shape)?;
        let t = crate::engine::layers::cpu_ops::transposed_f32_from_bytes(data, dtype, *rows, *cols)?;
        if t.is_some() {
            self.mark_read(&full);
        }
        Ok(t)
    }

    /// Rows `rows` of the `[n, cols]` tensor `name` (shape checked), in the compute dtype: only
    /// those rows are read from a safetensors file.
    pub fn get_rows(&self, name: &str, rows: &[u32], shape: &[usize]) -> Result<Tensor, EngineError> {
        let full = self.full_name(name);
        let [n, cols] = shape[..] else {
            return Err(EngineError::Load(format!("{full:?}: rows of a 2-D tensor only")));
        };
        if let Some(r) = rows.iter().find(|&&r| r as usize >= n) {
            return Err(EngineError::InvalidInput(format!("row {r} of {full:?} is past its {n} rows")));
        }
        let TensorSource::Safetensors { tensors, .. } = &self.source else {
            let ids = Tensor::new(rows, &self.device)?;
            return Ok(self.get_as(name, shape, self.dtype)?.index_select(&ids, 0)?);
        };
        self.check_shape(tensors, &full, shape)?;
        let view = tensors.get(&full).ok_or_else(|| self.missing(&full))?;
        let Some(dtype) = view.dtype.filter(|d| FLOAT_DTYPES.contains(d)) else {
            return Err(self.unreadable(&full, &view.dtype_name));
        };
        self.mark_read(&full);
        let row = cols * dtype.size_in_bytes();
        let bytes: Vec<u8> =
            rows.iter().flat_map(|&r| &view.data[r as usize * row..(r as usize + 1) * row]).copied().collect();
        let t = Tensor::from_raw_buffer(&bytes, dtype, &[rows.len(), cols], &Device::Cpu)?;
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    /// The stored shape of `full` is `want`, checked before its values are read (or drawn: a
    /// wrong shape in a synthetic manifest must not allocate anything).
    fn check_shape(&self, tensors: &Store, full: &str, want: &[usize]) -> Result<(), EngineError> {
        match tensors.shape(full) {
            None => Err(self.missing(full)),
            Some(have) if have != want => Err(self.shape_mismatch(full, &have, want)),
            Some(_) => Ok(()),
        }
    }

    fn shape_mismatch(&self, full: &str, have: &[usize], want: &[usize]) -> EngineError {
        EngineError::Load(format!(
            "tensor {full:?} in {} has shape {have:?}, but the model config implies {want:?}; the weights do not \
             match the model config",
            self.where_from(),
        ))
    }

    pub fn get_opt(&self, name: &str, shape: &[usize], present: bool) -> Result<Option<Tensor>, EngineError> {
        if present {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Leaves `name` unread where the checkpoint has it, without [`Weights::check_unread`]
    /// refusing it: a tensor transformers drops on load (the key and value projections a layer
    /// that reuses another's keys and values still carries in some checkpoints).
    pub fn pass_over(&self, name: &str) {
        if let Ok(mut passed) = self.passed_over.lock() {
            passed.insert(self.full_name(name));
        }
    }

    fn mark_read(&self, full: &str) {
        if let Ok(mut read) = self.read.lock() {
            read.insert(full.to_string());
        }
    }

    /// Before anything is loaded: refuses a checkpoint whose decoder holds a tensor in a dtype the
    /// loader does not read (FP8, packed integers) or quantisation data (a scale, packed weights,
    /// zero points) outside the parts that are never read ([`IGNORED_PREFIXES`]), naming the first.
    /// So a quantised checkpoint is refused at once, not after minutes of loading. Layers from
    /// `layers` on (past the config's `num_hidden_layers`) never run and are not checked; the
    /// `mtp_layers` right after them are the checkpoint's multi-token-prediction layers, ignored.
    pub fn check_before_load(&self, layers: usize, mtp_layers: usize) -> Result<(), EngineError> {
        let TensorSource::Safetensors { tensors, .. } = &self.source else {
            return Ok(());
        };
        let mut all = tensors.list();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        // Decoder layers past config.json's count: transformers refuses a checkpoint with
        // weights its model does not have, and serving the fewer layers would answer for
        // another model than the checkpoint holds.
        let extra: std::collections::BTreeSet<usize> =
            all.iter().filter_map(|(name, _, _)| self.layer_of(name)).filter(|&i| i >= layers + mtp_layers).collect();
        if let (Some(first), Some(last)) = (extra.first(), extra.last()) {
            let example = all.iter().find(|(name, _, _)| self.layer_of(name) == Some(*first)).map(|t| t.0.clone());
            return Err(EngineError::Load(format!(
                "{} holds decoder layers {first}..={last} ({} layers, e.g. {:?}) past the {layers} that config.json's \
                 num_hidden_layers says the model has (layers 0..={}); the checkpoint does not match its config, and \
                 layertap refuses it rather than serve a model with layers left out",
                self.where_from(),
                extra.len(),
                example.unwrap_or_default(),
                layers.saturating_sub(1)
            )));
        }
        let mut fp8_weights = 0;
        let mut mxfp4_blocks = 0;
        for (name, dtype, dtype_name) in &all {
            if !self.must_be_read(name, layers) {
                continue;
            }
            match self.mxfp4_part(tensors, name)? {
                Some(Mxfp4Part::Blocks) => {
                    mxfp4_blocks += 1;
                    continue;
                }
                Some(Mxfp4Part::Scales) => continue,
                None => {}
            }
            match self.fp8_part(tensors, name)? {
                Some(Fp8Part::Weight) => {
                    fp8_weights += 1;
                    continue;
                }
                Some(Fp8Part::Scale) => continue,
                None => {}
            }
            let float = dtype.is_some_and(|d| FLOAT_DTYPES.contains(&d));
            if !float || is_quant_data(name) {
                return Err(self.unreadable(name, dtype_name));
            }
        }
        if let (Some(q @ Quantization::Fp8Block { .. }), 0) = (&self.quantization, fp8_weights) {
            // transformers would quantise such weights as it loads them; layertap does so only when
            // asked (`--quantize fp8`), not because a config says so.
            return Err(EngineError::Load(format!(
                "config.json declares {} but no decoder weight in {} is stored as F8_E4M3 with a weight_scale_inv; \
                 layertap reads FP8 projections as the checkpoint stores them, so it refuses the checkpoint rather \
                 than compute something else than the config says (to quantise float weights at load, remove the \
                 quantization_config and pass --quantize fp8)",
                q.describe(),
                self.where_from()
            )));
        }
        if let (Some(q @ Quantization::Mxfp4 { .. }), 0) = (&self.quantization, mxfp4_blocks) {
            return Err(EngineError::Load(format!(
                "config.json declares {} but no decoder tensor in {} is an experts' *_blocks with its *_scales; \
                 layertap reads MXFP4 experts as the checkpoint stores them, so it refuses the checkpoint rather than \
                 compute something else than the config says (a bf16 release has no quantization_config)",
                q.describe(),
                self.where_from()
            )));
        }
        Ok(())
    }

    /// Under [`Quantization::Mxfp4`]: whether `full` is half of an MXFP4 experts tensor, the
    /// uint8 `{module}_blocks` of `mlp.experts.gate_up_proj` or `mlp.experts.down_proj` with its
    /// uint8 `{module}_scales`, or that scale; `None` for any other tensor. Either half without
    /// the other, in another dtype, or of another module, is refused.
    fn mxfp4_part(&self, tensors: &Store, full: &str) -> Result<Option<Mxfp4Part>, EngineError> {
        let Some(Quantization::Mxfp4 { .. }) = &self.quantization else { return Ok(None) };
        let (module, part) = if let Some(m) = full.strip_suffix("_blocks") {
            (m, Mxfp4Part::Blocks)
        } else if let Some(m) = full.strip_suffix("_scales") {
            (m, Mxfp4Part::Scales)
        } else {
            return Ok(None);
        };
        let (blocks, scales) = (format!("{module}_blocks"), format!("{module}_scales"));
        let is_u8 = |name: &str| matches!(tensors.dtype(name), Some((Some(DType::U8), _)));
        let experts = [".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"].iter().any(|e| module.ends_with(e));
        if !experts || !is_u8(&blocks) || !is_u8(&scales) {
            let got = |name: &str| tensors.dtype(name).map_or("missing".to_string(), |(_, d)| d);
            return Err(EngineError::Load(format!(
                "tensors {blocks:?} ({}) and {scales:?} ({}) in {}: layertap reads MXFP4 as uint8 *_blocks with \
                 their uint8 *_scales, for the experts' gate_up_proj and down_proj only, so it refuses the \
                 checkpoint rather than guess",
                got(&blocks),
                got(&scales),
                self.where_from()
            )));
        }
        Ok(Some(part))
    }

    /// The MXFP4 experts tensor `name` (`layers.N.mlp.experts.gate_up_proj` or `down_proj`)
    /// dequantised exactly ([`crate::engine::layers::mxfp4`]) to `[E, out, in]` (`shape`) in the
    /// compute dtype, from its `{name}_blocks` `[E, out, in / 32, 16]` and `{name}_scales`
    /// `[E, out, in / 32]`; `None` where the checkpoint stores no `{name}_blocks`.
    pub fn get_mxfp4(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>, EngineError> {
        let Some((blocks, scales)) = self.mxfp4_parts(name, shape)? else { return Ok(None) };
        let values = crate::engine::layers::mxfp4::dequantise(blocks.data, scales.data)
            .map_err(|why| self.damaged_mxfp4(&scales.name, &why))?;
        self.mark_read(&blocks.name);
        self.mark_read(&scales.name);
        let t = Tensor::from_vec(values, shape, &Device::Cpu)?;
        Ok(Some(t.to_dtype(self.dtype)?.to_device(&self.device)?))
    }

    /// The same MXFP4 experts kept 4-bit, as stored: the blocks `[E, out, in / 2]` and the scales
    /// `[E, out, in / 32]`, u8, on the weights' device (a scale that is NaN refused as
    /// [`Weights::get_mxfp4`] refuses it); `None` where the checkpoint stores no `{name}_blocks`.
    pub fn get_mxfp4_packed(&self, name: &str, shape: &[usize]) -> Result<Option<(Tensor, Tensor)>, EngineError> {
        use crate::engine::layers::mxfp4::{check_scales, BLOCK, BLOCK_BYTES};
        let Some((blocks, scales)) = self.mxfp4_parts(name, shape)? else { return Ok(None) };
        check_scales(scales.data).map_err(|why| self.damaged_mxfp4(&scales.name, &why))?;
        let &[e, out, inp] = shape else { unreachable!("checked by mxfp4_parts") };
        let b = Tensor::from_slice(blocks.data, (e, out, inp / BLOCK * BLOCK_BYTES), &self.device)?;
        let sc = Tensor::from_slice(scales.data, (e, out, inp / BLOCK), &self.device)?;
        self.mark_read(&blocks.name);
        self.mark_read(&scales.name);
        Ok(Some((b, sc)))
    }

    fn damaged_mxfp4(&self, scales: &str, why: &str) -> EngineError {
        EngineError::Load(format!("{scales:?} in {}: {why}; the checkpoint is damaged", self.where_from()))
    }

    /// `{name}_blocks` and `{name}_scales` of an MXFP4 experts tensor of `shape` `[E, out, in]`,
    /// their names, shapes and dtypes checked; `None` where the checkpoint stores no blocks.
    fn mxfp4_parts<'t>(
        &'t self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<(RawPart<'t>, RawPart<'t>)>, EngineError> {
        use crate::engine::layers::mxfp4::{BLOCK, BLOCK_BYTES};
        let TensorSource::Safetensors { tensors, .. } = &self.source else { return Ok(None) };
        let (blocks, scales) = (self.full_name(&format!("{name}_blocks")), self.full_name(&format!("{name}_scales")));
        if !tensors.has(&blocks) {
            return Ok(None);
        }
        let &[e, out, inp] = shape else {
            return Err(EngineError::Load(format!("{blocks:?}: MXFP4 experts are 3-D tensors")));
        };
        if !matches!(self.quantization, Some(Quantization::Mxfp4 { .. })) {
            return Err(self.unreadable(&blocks, "U8"));
        }
        if !inp.is_multiple_of(BLOCK) {
            return Err(EngineError::Load(format!(
                "{blocks:?}: {inp} input features are not whole MXFP4 blocks of {BLOCK}"
            )));
        }
        self.check_shape(tensors, &blocks, &[e, out, inp / BLOCK, BLOCK_BYTES])?;
        self.check_shape(tensors, &scales, &[e, out, inp / BLOCK])?;
        match (tensors.get(&blocks), tensors.get(&scales)) {
            (Some(b), Some(sc)) if b.dtype == Some(DType::U8) && sc.dtype == Some(DType::U8) => {
                Ok(Some((RawPart { name: blocks, data: b.data }, RawPart { name: scales, data: sc.data })))
            }
            _ => Err(self.unreadable(&blocks, "not uint8 blocks with uint8 scales")),
        }
    }

    /// With an FP8 scheme declared: whether `full` is half of an FP8 projection, an `F8_E4M3`
    /// `{module}.weight` with its `{module}.weight_scale_inv` (bf16, f16 or f32) or that scale;
    /// `None` for any other tensor. Either half without the other, a scale in another dtype, or
    /// an FP8 projection that config.json lists in `modules_to_not_convert`, is refused.
    fn fp8_part(&self, tensors: &Store, full: &str) -> Result<Option<Fp8Part>, EngineError> {
        let Some(q @ Quantization::Fp8Block { .. }) = &self.quantization else { return Ok(None) };
        let dtype = |name: &str| tensors.dtype(name);
        let (module, part) = if let Some(m) = full.strip_suffix(".weight_scale_inv") {
            (m, Fp8Part::Scale)
        } else if let Some(m) = full.strip_suffix(".weight") {
            (m, Fp8Part::Weight)
        } else {
            return Ok(None);
        };
        let (weight, scale) = (format!("{module}.weight"), format!("{module}.weight_scale_inv"));
        let weight_dtype = dtype(&weight);
        let is_fp8 = matches!(weight_dtype, Some((Some(DType::F8E4M3), _)));
        match (part, is_fp8, dtype(&scale)) {
            (Fp8Part::Weight, false, _) => Ok(None),
            (_, true, None) => Err(EngineError::Load(format!(
                "tensor {weight:?} (F8_E4M3) in {} has no {scale:?}: an FP8 weight without its block scales cannot \
                 be read, so layertap refuses the checkpoint rather than return wrong hidden states",
                self.where_from()
            ))),
            (_, true, Some((Some(DType::F32 | DType::F16 | DType::BF16), _))) => {
                if q.not_converted(module) {
                    return Err(EngineError::Load(format!(
                        "tensor {weight:?} is stored as F8_E4M3 with its weight_scale_inv, but config.json's \
                         quantization_config.modules_to_not_convert lists {module:?} as unquantised: the checkpoint \
                         contradicts its config, so layertap refuses it"
                    )));
                }
                Ok(Some(part))
            }
            (_, true, Some((_, scale_dtype))) => Err(EngineError::Load(format!(
                "tensor {scale:?} ({scale_dtype}) in {}: layertap reads FP8 block scales stored as float32, \
                 float16 or bfloat16",
                self.where_from()
            ))),
            (Fp8Part::Scale, false, _) => Err(EngineError::Load(format!(
                "tensor {scale:?} in {} scales {weight:?}, which is {}, not an F8_E4M3 weight; layertap refuses the \
                 checkpoint rather than guess what the scale means",
                self.where_from(),
                weight_dtype.map_or("missing".to_string(), |(_, d)| d)
            ))),
        }
    }

    /// For the FP8 projection `name` (an `F8_E4M3` `[N, K]` weight with its `weight_scale_inv`
    /// `[ceil(N/128), ceil(K/128)]`): its bytes and its scales in f32, checked. Under
    /// [`Quantization::Fp8AtLoad`], the float weight `name` quantised, where
    /// [`quantised_at_load`] names it and its input features are a multiple of 128. `None` where
    /// `name` is to be read as floats.
    pub fn get_fp8(&self, name: &str, shape: &[usize]) -> Result<Option<Fp8Host<'_>>, EngineError> {
        let TensorSource::Safetensors { tensors, .. } = &self.source else { return Ok(None) };
        match &self.quantization {
            None | Some(Quantization::Mxfp4 { .. }) => Ok(None),
            Some(Quantization::Fp8AtLoad) => self.quantise_at_load(tensors, name, shape),
            Some(Quantization::Fp8Block { .. }) => self.read_fp8(tensors, name, shape),
        }
    }

    /// The float `[N, K]` weight `name` quantised to FP8 blocks, where `--quantize fp8` quantises
    /// it (see [`Weights::get_fp8`]); a projection it names whose `K` is not a multiple of 128 is
    /// counted as kept in float.
    fn quantise_at_load(
        &self,
        tensors: &Store,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Fp8Host<'static>>, EngineError> {
        let Some(FloatTensor { full, data, dtype }) = self.float_to_quantise(tensors, name, shape)? else {
            return Ok(None);
        };
        let &[n, k] = shape else {
            return Err(EngineError::Load(format!("{full:?}: FP8 weights of 2-D projections only")));
        };
        if !k.is_multiple_of(FP8_BLOCK) {
            self.keep_float(NOT_WHOLE_GROUPS, 1);
            return Ok(None);
        }
        let (bytes, scale) = quantise_float(data, dtype, 0, n, k).ok_or_else(|| non_finite(&full))?;
        self.mark_read(&full);
        Ok(Some(Fp8Host { bytes: std::borrow::Cow::Owned(bytes), scale, n, k }))
    }

    /// Under [`Quantization::Fp8AtLoad`]: the experts fused into the 3-D tensor `name`
    /// (`[E, parts * N, K]`: `gate_up_proj` with `parts` 2, `down_proj` with 1), to be quantised
    /// one projection of one expert at a time, as the releases store them. `None` elsewhere, and
    /// where `K` is not a multiple of 128 (its `E * parts` projections counted as kept in float).
    pub fn get_fp8_stacked(
        &self,
        name: &str,
        shape: &[usize],
        parts: usize,
    ) -> Result<Option<Fp8Stacked<'_>>, EngineError> {
        let TensorSource::Safetensors { tensors, .. } = &self.source else { return Ok(None) };
        if !self.quantises_at_load() {
            return Ok(None);
        }
        let Some(FloatTensor { full, data, dtype }) = self.float_to_quantise(tensors, name, shape)? else {
            return Ok(None);
        };
        let &[e, rows, k] = shape else {
            return Err(EngineError::Load(format!("{full:?}: experts fused into a 3-D tensor only")));
        };
        if parts == 0 || !rows.is_multiple_of(parts) {
            return Err(EngineError::Load(format!("{full:?}: {rows} rows do not split into {parts} projections")));
        }
        if !k.is_multiple_of(FP8_BLOCK) {
            self.keep_float(NOT_WHOLE_GROUPS, e * parts);
            return Ok(None);
        }
        self.mark_read(&full);
        Ok(Some(Fp8Stacked { name: full, data, dtype, parts, n: rows / parts, k }))
    }

    /// The float tensor `name` that `--quantize fp8` quantises (shape checked): its full name,
    /// bytes and dtype; `None` where [`quantised_at_load`] does not name it.
    fn float_to_quantise<'t>(
        &self,
        tensors: &'t Store,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<FloatTensor<'t>>, EngineError> {
        if !quantised_at_load(name) {
            return Ok(None);
        }
        let (full, data, dtype) = self.float_view(tensors, name, shape)?;
        Ok(Some(FloatTensor { full, data, dtype }))
    }

    /// The tensor `name` as the file stores it: its full name, bytes and float dtype, checked
    /// to be a float tensor of `shape`.
    fn float_view<'t>(
        &self,
        tensors: &'t Store,
        name: &str,
        shape: &[usize],
    ) -> Result<(String, &'t [u8], DType), EngineError> {
        let full = self.full_name(name);
        let (dtype, dtype_name) = tensors.dtype(&full).ok_or_else(|| self.missing(&full))?;
        let Some(dtype) = dtype.filter(|d| FLOAT_DTYPES.contains(d)) else {
            return Err(self.unreadable(&full, &dtype_name));
        };
        self.check_shape(tensors, &full, shape)?;
        let view = tensors.get(&full).ok_or_else(|| self.missing(&full))?;
        Ok((full, view.data, dtype))
    }

    /// The checkpoint's FP8 projection `name` (see [`Weights::get_fp8`]).
    fn read_fp8<'t>(
        &self,
        tensors: &'t Store,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Fp8Host<'t>>, EngineError> {
        let full = self.full_name(name);
        let (dtype, _) = tensors.dtype(&full).ok_or_else(|| self.missing(&full))?;
        if dtype != Some(DType::F8E4M3) {
            return Ok(None);
        }
        self.check_shape(tensors, &full, shape)?;
        let view = tensors.get(&full).ok_or_else(|| self.missing(&full))?;
        let &[n, k] = shape else {
            return Err(EngineError::Load(format!("{full:?}: FP8 weights of 2-D projections only")));
        };
        if !k.is_multiple_of(FP8_BLOCK) {
            return Err(EngineError::Load(format!(
                "{full:?}: an FP8 projection with {k} input features, not a multiple of {FP8_BLOCK}: its input \
                 cannot be quantised in whole groups of {FP8_BLOCK}"
            )));
        }
        let scale_name = format!("{full}_scale_inv");
        let want = [n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK)];
        self.check_shape(tensors, &scale_name, &want)?;
        let sview = tensors.get(&scale_name).ok_or_else(|| self.missing(&scale_name))?;
        let Some(sdtype) = sview.dtype.filter(|d| [DType::F32, DType::F16, DType::BF16].contains(d)) else {
            return Err(self.unreadable(&scale_name, &sview.dtype_name));
        };
        let scale = Tensor::from_raw_buffer(sview.data, sdtype, &want, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        self.mark_read(&full);
        self.mark_read(&scale_name);
        Ok(Some(Fp8Host { bytes: std::borrow::Cow::Borrowed(view.data), scale, n, k }))
    }

    /// Accepts the tensor `name` without reading it, where the checkpoint stores it: its shape
    /// checked against `shape`, then counted as read ([`Weights::check_unread`]). For parameters
    /// of a part the model holds but never computes with (sparse attention's indexer, see
    /// `config::KeyIndexer`).
    pub fn accept_unread(&self, name: &str, shape: &[usize]) -> Result<(), EngineError> {
        let TensorSource::Safetensors { tensors, .. } = &self.source else { return Ok(()) };
        let full = self.full_name(name);
        if !tensors.has(&full) {
            return Ok(());
        }
        self.check_shape(tensors, &full, shape)?;
        self.mark_read(&full);
        let scale = format!("{full}_scale_inv");
        if tensors.has(&scale) {
            self.mark_read(&scale);
        }
        Ok(())
    }

    /// Whether the projections are quantised at load (`--quantize fp8`), not read as stored.
    pub fn quantises_at_load(&self) -> bool {
        self.quantization == Some(Quantization::Fp8AtLoad)
    }

    /// Records that `--quantize fp8` kept `n` projections it names in float, and why.
    pub fn keep_float(&self, reason: &'static str, n: usize) {
        if let Ok(mut k) = self.kept_float.lock() {
            *k.entry(reason).or_default() += n;
        }
    }

    /// Records that one FP8 projection was loaded to be multiplied by `path`.
    pub fn count_fp8(&self, path: String) {
        if let Ok(mut p) = self.fp8_paths.lock() {
            *p.entry(path).or_default() += 1;
        }
    }

    /// Moves `n` of the FP8 projections counted under `from` to `to` (the experts' projections,
    /// loaded one by one and then stacked for the grouped FP8 kernel).
    pub fn recount_fp8(&self, from: &str, to: &str, n: usize) {
        if let Ok(mut p) = self.fp8_paths.lock() {
            let left = p.get(from).copied().unwrap_or(0).saturating_sub(n);
            if left == 0 {
                p.remove(from);
            } else {
                p.insert(from.to_string(), left);
            }
            *p.entry(to.to_string()).or_default() += n;
        }
    }

    /// How the FP8 projections loaded so far are multiplied ("196 on the FP8 tensor cores
    /// (...)"), and under `--quantize fp8` how many of the projections it names stayed in float
    /// ("…, 12 kept in float (input features not a multiple of 128)"); None where there are none.
    pub fn fp8_summary(&self) -> Option<String> {
        let p = self.fp8_paths.lock().ok()?;
        let mut paths: Vec<String> = p.iter().map(|(path, n)| format!("{n} {path}")).collect();
        let kept = self.kept_float.lock().ok()?;
        paths.extend(kept.iter().map(|(reason, n)| format!("{n} kept in float ({reason})")));
        (!paths.is_empty()).then(|| paths.join(", "))
    }

    /// Whether `name` is an FP8 projection's weight: `F8_E4M3` under the checkpoint's FP8
    /// scheme, or under `--quantize fp8` a float weight it quantises (named by
    /// [`quantised_at_load`], its input features a multiple of 128; a fused experts tensor
    /// included).
    pub fn is_fp8(&self, name: &str) -> bool {
        let TensorSource::Safetensors { tensors, .. } = &self.source else { return false };
        let full = self.full_name(name);
        let Some((dtype, _)) = tensors.dtype(&full) else { return false };
        match &self.quantization {
            None | Some(Quantization::Mxfp4 { .. }) => false,
            Some(Quantization::Fp8Block { .. }) => dtype == Some(DType::F8E4M3),
            Some(Quantization::Fp8AtLoad) => {
                quantised_at_load(name)
                    && dtype.is_some_and(|d| FLOAT_DTYPES.contains(&d))
                    && tensors.shape(&full).and_then(|s| s.last().copied()).is_some_and(|k| k.is_multiple_of(FP8_BLOCK))
            }
        }
    }

    /// Once the decoder is loaded: refuses a checkpoint where a tensor the decoder read holds a
    /// NaN or an infinity, naming the first (by name) and the element. One pass over the read
    /// tensors' bytes on every core, from the files' mapping (the pages loading brought in).
    /// Drawn tensors (`--synthetic-weights`) are finite by construction and GGUF tensors are
    /// checked as they are dequantised; neither is read again here.
    pub fn check_finite(&self) -> Result<(), EngineError> {
        let TensorSource::Safetensors { tensors: store @ Store::Files(_), .. } = &self.source else {
            return Ok(());
        };
        let mut names: Vec<String> = self.read.lock().map(|r| r.iter().cloned().collect()).unwrap_or_default();
        names.sort();
        let start = std::time::Instant::now();
        let mut bytes = 0usize;
        for name in &names {
            let Some(v) = store.get(name) else { continue };
            let Some(dtype) = v.dtype else { continue };
            bytes += v.data.len();
            if let Some(at) = first_nonfinite_par(v.data, dtype) {
                return Err(nonfinite_weight(name, at, &v.shape, &self.where_from()));
            }
        }
        tracing::info!(
            tensors = names.len(),
            gib = format!("{:.2}", bytes as f64 / (1u64 << 30) as f64),
            seconds = format!("{:.3}", start.elapsed().as_secs_f64()),
            "weights checked: every value read is finite"
        );
        Ok(())
    }

    /// Once the decoder is loaded: the checkpoint's tensors that nothing read are listed (debug),
    /// and refused when one belongs to the decoder (a layer, the embeddings or the final norm):
    /// the decoder would run without something its checkpoint says it needs. GGUF files are read
    /// by name mapping and dequantised whole; they are not checked. Layers from `layers` on never
    /// run and are only listed.
    pub fn check_unread(&self, layers: usize) -> Result<(), EngineError> {
        let TensorSource::Safetensors { tensors, .. } = &self.source else {
            return Ok(());
        };
        let read = self.read.lock().map(|r| r.clone()).unwrap_or_default();
        let passed = self.passed_over.lock().map(|r| r.clone()).unwrap_or_default();
        let mut unread: Vec<(String, String)> = tensors
            .list()
            .into_iter()
            .filter(|(name, _, _)| !read.contains(name) && !passed.contains(name))
            .map(|(name, _, dtype_name)| (name, dtype_name))
            .collect();
        unread.sort();
        if unread.is_empty() {
            return Ok(());
        }
        tracing::debug!(
            count = unread.len(),
            tensors = ?unread.iter().map(|(n, d)| format!("{n} ({d})")).collect::<Vec<_>>(),
            "checkpoint tensors not read (outside the text decoder)"
        );
        match unread.iter().find(|(name, _)| self.must_be_read(name, layers)) {
            None => Ok(()),
            Some((name, dtype)) if self.is_float_parameter(tensors, name) => Err(self.not_in_model(name, dtype)),
            Some((name, dtype)) => Err(self.unreadable(name, dtype)),
        }
    }

    /// Whether `full` is stored in a dtype the loader reads parameters from, and is no
    /// quantisation data: a parameter it could read, had the model asked for it.
    fn is_float_parameter(&self, tensors: &Store, full: &str) -> bool {
        tensors.dtype(full).is_some_and(|(d, _)| d.is_some_and(|d| FLOAT_DTYPES.contains(&d))) && !is_quant_data(full)
    }

    /// A readable decoder tensor that the model built from config.json has no place for.
    fn not_in_model(&self, name: &str, dtype: &str) -> EngineError {
        let part = match self.layer_of(name) {
            Some(i) => format!("of decoder layer {i} (which runs)"),
            None => "of the decoder".to_string(),
        };
        EngineError::Load(format!(
            "tensor {name:?} ({dtype}) {part} in {} is not a parameter of the model config.json describes: no \
             layer of this architecture and configuration reads it (a config option the checkpoint was trained \
             with may be missing or different, or the checkpoint belongs to another architecture), so layertap \
             refuses the checkpoint rather than run the layer without it",
            self.where_from(),
        ))
    }

    fn unreadable(&self, name: &str, dtype: &str) -> EngineError {
        let part = match self.layer_of(name) {
            Some(i) => format!("of decoder layer {i} (which runs)"),
            None if name.starts_with(&self.prefix) && !is_quant_data(name) => "of the decoder".to_string(),
            None => "(quantisation data)".to_string(),
        };
        EngineError::Load(format!(
            "tensor {name:?} ({dtype}) {part} in {} cannot be read: layertap reads decoder parameters stored as \
             float32, float16 or bfloat16 and no quantisation data (FP8 weights, scales, packed integers, zero \
             points), so it refuses the checkpoint rather than return wrong hidden states",
            self.where_from(),
        ))
    }

    /// The decoder layer a full tensor name belongs to, if any.
    fn layer_of(&self, full: &str) -> Option<usize> {
        let rest = full.strip_prefix(&self.prefix)?.strip_prefix("layers.")?;
        rest.split('.').next()?.parse().ok()
    }

    /// Whether `full` is something the decoder of `layers` layers must read (or else refuse).
    fn must_be_read(&self, full: &str, layers: usize) -> bool {
        // A buffer some older checkpoints saved, recomputed by every implementation.
        if full.ends_with(".rotary_emb.inv_freq") {
            return false;
        }
        if self.layer_of(full).is_some_and(|i| i >= layers) {
            return false;
        }
        let decoder = ["layers.", "embed_tokens.", "norm.", "embed_tokens_per_layer.", "per_layer_"]
            .iter()
            .any(|p| full.starts_with(&format!("{}{p}", self.prefix)));
        if decoder {
            return true;
        }
        if IGNORED_PREFIXES.iter().any(|p| full.starts_with(p)) {
            return false;
        }
        is_quant_data(full)
    }

    fn missing(&self, full: &str) -> EngineError {
        EngineError::Load(format!(
            "tensor {full:?} is missing from {}; the checkpoint is incomplete or does not match config.json",
            self.where_from()
        ))
    }
}

#[cfg(test)]
mod tests {

    /// A tensor whose stored shape is not the one the model asks for is refused before its
    /// values are read: a synthetic manifest's wrong shape draws nothing.
    #[test]
    fn a_wrong_shape_is_refused_before_anything_is_drawn() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(crate::engine::synthetic::MANIFEST),
            r#"{"model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [4096, 4096]},
                "model.embed_tokens.weight": {"dtype": "F32", "shape": [16, 8]},
                "model.norm.weight": {"dtype": "F32", "shape": [8]}}"#,
        )
        .unwrap();
        let s = std::sync::Arc::new(SyntheticTensors::open(dir.path()).unwrap());
        let source = TensorSource::Safetensors { files: vec![], tensors: Store::Synthetic(s.clone()) };
        let w = Weights::new(source, Device::Cpu, DType::F32);
        for e in [
            w.get("layers.0.mlp.up_proj.weight", &[8, 8]).err(),
            w.get_rows("layers.0.mlp.up_proj.weight", &[0], &[8, 8]).err(),
            w.get_transposed_f32("layers.0.mlp.up_proj.weight", &[8, 8]).err(),
        ] {
            let e = e.expect("refused").to_string();
            assert!(e.contains("has shape [4096, 4096]"), "{e}");
        }
        assert!(!s.is_drawn("model.layers.0.mlp.up_proj.weight"), "nothing drawn for a refused tensor");
        assert_eq!(w.get("norm.weight", &[8]).unwrap().dims(), &[8]);
        assert!(s.is_drawn("model.norm.weight"));
    }

    /// The finite screen reads each dtype's exponent bits: infinities and NaNs found, the
    /// largest finite values and zeros of either sign not.
    #[test]
    fn non_finite_values_are_found_in_every_stored_dtype() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(first_nonfinite(&f32s(&[0.0, -0.0, f32::MAX, f32::MIN, 1e-45]), DType::F32), None);
        assert_eq!(first_nonfinite(&f32s(&[1.0, 2.0, f32::NAN]), DType::F32), Some(2));
        assert_eq!(first_nonfinite(&f32s(&[f32::NEG_INFINITY]), DType::F32), Some(0));
        let bf = |v: &[half::bf16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(first_nonfinite(&bf(&[half::bf16::MAX, half::bf16::MIN]), DType::BF16), None);
        assert_eq!(first_nonfinite(&bf(&[half::bf16::ONE, half::bf16::NAN]), DType::BF16), Some(1));
        let f16 = |v: &[half::f16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(first_nonfinite(&f16(&[half::f16::MAX, half::f16::MIN]), DType::F16), None);
        assert_eq!(first_nonfinite(&f16(&[half::f16::INFINITY]), DType::F16), Some(0));
        let f64s: Vec<u8> = [1.0f64, f64::NAN].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(first_nonfinite(&f64s, DType::F64), Some(1));
        // E4M3: 0x7E is 448, 0xFE -448; 0x7F and 0xFF are NaN.
        assert_eq!(first_nonfinite(&[0x00, 0x7E, 0xFE, 0x80], DType::F8E4M3), None);
        assert_eq!(first_nonfinite(&[0x01, 0xFF], DType::F8E4M3), Some(1));
        // Across the parallel chunks, the first by index.
        let mut big = vec![0u8; 3 << 20];
        big[(2 << 20) + 6..(2 << 20) + 8].copy_from_slice(&half::bf16::NAN.to_le_bytes());
        big[(2 << 20) + 1000..(2 << 20) + 1002].copy_from_slice(&half::bf16::INFINITY.to_le_bytes());
        assert_eq!(first_nonfinite_par(&big, DType::BF16), Some(((2 << 20) + 6) / 2));
        assert_eq!(first_nonfinite_par(&big[..2 << 20], DType::BF16), None);
    }
    use super::*;

    /// An FP8 projection of `n` rows (at most 8 blocks) and 128 columns whose bytes in row i are
    /// `32 * block + i % 32`, and whose block scales are the block indices.
    fn numbered(n: usize) -> Fp8Host<'static> {
        let bytes = (0..n).flat_map(|i| vec![(32 * (i / FP8_BLOCK) + i % 32) as u8; FP8_BLOCK]).collect();
        let scale = (0..n.div_ceil(FP8_BLOCK)).map(|b| b as f32).collect();
        Fp8Host { bytes: std::borrow::Cow::Owned(bytes), scale, n, k: FP8_BLOCK }
    }

    #[test]
    fn gathered_rows_move_with_their_block_scales() {
        let w = numbered(4 * FP8_BLOCK + 5);
        let g = w.gather_rows(&[256..384, 0..128, 512..517]).unwrap();
        assert_eq!((g.n, g.k), (261, FP8_BLOCK));
        assert_eq!(g.scale, [2.0, 0.0, 4.0]);
        let first_of_row = |i: usize| g.bytes[i * FP8_BLOCK];
        assert_eq!([first_of_row(0), first_of_row(127), first_of_row(128), first_of_row(260)], [64, 95, 0, 132]);
        assert_eq!(g.bytes[..FP8_BLOCK * FP8_BLOCK], w.bytes[256 * FP8_BLOCK..384 * FP8_BLOCK]);
        assert_eq!(g.bytes[2 * FP8_BLOCK * FP8_BLOCK..], w.bytes[512 * FP8_BLOCK..]);
        // Rows that cut a block, a partial block anywhere but last, or rows past the end, are refused.
        for bad in [[0..128, 64..192], [0..100, 128..256], [512..517, 0..128], [0..128, 0..1000]] {
            assert!(w.gather_rows(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn rows_reordered_within_their_blocks_keep_the_block_scales() {
        let w = numbered(FP8_BLOCK + 16);
        // The last, ragged block's 16 rows: even ones first, then odd ones (the interleaved rotary
        // reordering); row 0 and row 1 swapped in the first block.
        let mut order: Vec<usize> = (0..w.n).collect();
        order.swap(0, 1);
        for j in 0..8 {
            order[FP8_BLOCK + j] = FP8_BLOCK + 2 * j;
            order[FP8_BLOCK + 8 + j] = FP8_BLOCK + 2 * j + 1;
        }
        let p = w.permute_rows(&order).unwrap();
        assert_eq!((p.n, p.k, &p.scale), (w.n, w.k, &w.scale));
        for (r, &from) in order.iter().enumerate() {
            assert_eq!(p.bytes[r * FP8_BLOCK..(r + 1) * FP8_BLOCK], w.bytes[from * FP8_BLOCK..(from + 1) * FP8_BLOCK]);
        }
        // A row moved to another block (whose scale is another), or an order of another length.
        order.swap(127, 128);
        assert!(w.permute_rows(&order).is_err());
        assert!(w.permute_rows(&order[..10]).is_err());
    }
}
