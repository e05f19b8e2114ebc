//! Random weights for benchmarks (`--synthetic-weights`): the tensors a manifest names, with the
//! dtypes and shapes it gives, filled on first read with seeded random values, so a model whose
//! checkpoint cannot be written where the benchmark runs (a 122B model on a machine whose disk
//! and memory are smaller than it) loads at its real size with its real layout.
//!
//! The manifest, `synthetic-weights.json` beside the model's `config.json`, has the layout of a
//! safetensors header without the offsets: `{"name": {"dtype": "BF16", "shape": [..]}, ..}`
//! (`__metadata__` is ignored). Speed does not depend on the weights' values, and the values
//! are not a trained model's: hidden states from such weights mean nothing, which is why they
//! are served only when asked for by name.
//!
//! Tensors that differ only in their layer or expert number hold the same values (generated
//! once, kept for the life of the process), so host memory holds one layer's worth, while the
//! device gets every layer's own copy, as from a checkpoint. The values by name: e4m3 weights
//! from a normal distribution spread over the e4m3 range, their `weight_scale_inv` a constant
//! that makes the dequantised weights' deviation 0.02; norm weights 1, `dt_bias` 1, biases 0,
//! `A_log` uniform in [0, ln 16]; everything else normal with deviation 0.02.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::DType;
use rayon::prelude::*;

use super::EngineError;

/// The manifest's file name, beside `config.json`.
pub const MANIFEST: &str = "synthetic-weights.json";

/// Deviation of the e4m3 values (four deviations reach the e4m3 maximum, 448).
const E4M3_SIGMA: f32 = 112.0;
/// Deviation of the float weights, and of the dequantised FP8 weights.
const WEIGHT_SIGMA: f32 = 0.02;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    Normal(f32),
    Uniform(f32, f32),
    Const(f32),
    /// e4m3 bytes of normal values of deviation [`E4M3_SIGMA`], clamped to the e4m3 range.
    E4m3,
}

/// One manifest entry.
struct Entry {
    /// The dtype as the manifest spells it ("BF16", "F8_E4M3", ...).
    dtype_name: String,
    dtype: Option<DType>,
    shape: Vec<usize>,
    /// Index into [`SyntheticTensors::values`]: tensors equal but for their layer and expert
    /// numbers share it.
    key: usize,
}

/// A manifest tensor as read: its dtype (`None` for one no values are drawn in), the dtype as
/// the manifest names it, its shape and its bytes (none for such a dtype).
#[derive(Debug, PartialEq)]
pub struct Drawn<'a> {
    pub dtype: Option<DType>,
    pub dtype_name: &'a str,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// The tensors of a manifest, generated on first read.
pub struct SyntheticTensors {
    manifest: PathBuf,
    entries: HashMap<String, Entry>,
    /// Per key: the draw and the seed of its values, and the values once generated.
    keys: Vec<(Init, u64)>,
    values: Vec<OnceLock<Vec<u8>>>,
    total_bytes: usize,
}

/// The largest tensor a manifest may name (1 TiB): far past any real checkpoint's largest tensor,
/// and far below what overflows a size on a 64-bit machine.
const MAX_TENSOR_BYTES: usize = 1 << 40;

/// A manifest dtype that synthetic values are drawn in (floats and e4m3); `None` for any other.
fn parse_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "F64" => DType::F64,
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F8_E4M3" => DType::F8E4M3,
        _ => return None,
    })
}

/// `name` with every all-digit part (a layer or expert number) replaced by `*`.
fn canonical(name: &str) -> String {
    name.split('.')
        .map(|p| if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) { "*" } else { p })
        .collect::<Vec<_>>()
        .join(".")
}

/// How the tensor `name` of `dtype` is drawn (see the module's description).
fn init_for(name: &str, dtype: Option<DType>) -> Init {
    if dtype == Some(DType::F8E4M3) {
        return Init::E4m3;
    }
    let mut parts = name.rsplit('.');
    let (last, module) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match last {
        "weight_scale_inv" => Init::Const(WEIGHT_SIGMA / E4M3_SIGMA),
        "A_log" => Init::Uniform(0.0, 16f32.ln()),
        "dt_bias" => Init::Const(1.0),
        "bias" => Init::Const(0.0),
        "weight" if module.contains("norm") => Init::Const(1.0),
        _ => Init::Normal(WEIGHT_SIGMA),
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 65,536 standard normal values (Box-Muller on a fixed sequence), indexed by 16 random bits.
fn normal_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..32_768u64)
            .flat_map(|i| {
                let h = splitmix64(i);
                let u1 = ((h >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
                let u2 = ((h & 0xFF_FFFF) as f32 + 0.5) / (1u64 << 24) as f32;
                let r = (-2.0 * u1.ln()).sqrt();
                let t = std::f32::consts::TAU * u2;
                [r * t.cos(), r * t.sin()]
            })
            .collect()
    })
}

/// The value of element `i` of a tensor drawn by `init` with `seed`.
fn value(init: Init, seed: u64, i: u64) -> f32 {
    let h = splitmix64(seed ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03));
    match init {
        Init::Normal(sigma) => sigma * normal_table()[(h >> 48) as usize],
        Init::E4m3 => (E4M3_SIGMA * normal_table()[(h >> 48) as usize]).clamp(-448.0, 448.0),
        Init::Uniform(a, b) => a + (b - a) * ((h >> 40) as f32 / (1u64 << 24) as f32),
        Init::Const(c) => c,
    }
}

/// `count` elements of `dtype` drawn by `init` with `seed`, as little-endian bytes.
fn generate(init: Init, seed: u64, dtype: DType, count: usize) -> Vec<u8> {
    let size = dtype.size_in_bytes();
    let mut out = vec![0u8; count * size];
    const CHUNK: usize = 1 << 16;
    let encode: fn(f32, &mut [u8]) = match dtype {
        DType::F32 => |v, b| b.copy_from_slice(&v.to_le_bytes()),
        DType::F64 => |v, b| b.copy_from_slice(&(v as f64).to_le_bytes()),
        DType::F16 => |v, b| b.copy_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        DType::BF16 => |v, b| b.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        _ => |v, b| b[0] = float8::F8E4M3::from_f32(v).to_bits(),
    };
    out.par_chunks_mut(CHUNK * size).enumerate().for_each(|(c, chunk)| {
        for (j, b) in chunk.chunks_exact_mut(size).enumerate() {
            encode(value(init, seed, (c * CHUNK + j) as u64), b);
        }
    });
    out
}

impl SyntheticTensors {
    /// Reads the manifest `dir/synthetic-weights.json`.
    pub fn open(dir: &Path) -> Result<Self, EngineError> {
        let manifest = dir.join(MANIFEST);
        let err = |m: String| EngineError::Load(format!("{}: {m}", manifest.display()));
        let text = std::fs::read_to_string(&manifest).map_err(|e| err(format!("cannot read it: {e}")))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let map = v.as_object().ok_or_else(|| err("not a JSON object of tensors".into()))?;
        let (mut entries, mut keys, mut key_of) = (HashMap::new(), Vec::new(), HashMap::new());
        let mut total = 0usize;
        for (name, t) in map.iter().filter(|(n, _)| n.as_str() != "__metadata__") {
            let dtype_name =
                t.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| err(format!("{name:?}: no \"dtype\"")))?;
            let shape = t
                .get("shape")
                .and_then(|s| s.as_array())
                .and_then(|s| s.iter().map(|d| d.as_u64().map(|d| d as usize)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| err(format!("{name:?}: \"shape\" is not a list of sizes")))?;
            let dtype = parse_dtype(dtype_name);
            // Sizes are checked before anything is drawn: a count or a byte size past what this
            // machine addresses is refused, never an allocation failure or an overflow.
            let bytes = shape
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .and_then(|n| n.checked_mul(dtype.map_or(0, |d| d.size_in_bytes())))
                .filter(|&b| b <= MAX_TENSOR_BYTES)
                .ok_or_else(|| {
                    err(format!(
                        "{name:?}: shape {shape:?} of {dtype_name} is larger than any tensor layertap loads (at most \
                         {} GiB a tensor)",
                        MAX_TENSOR_BYTES >> 30
                    ))
                })?;
            total = total.saturating_add(bytes);
            let canon = canonical(name);
            let next = keys.len();
            let key = *key_of.entry((canon.clone(), dtype_name.to_string(), shape.clone())).or_insert(next);
            if key == next {
                let seed = xxhash_rust::xxh64::xxh64(format!("{canon} {dtype_name} {shape:?}").as_bytes(), 0);
                keys.push((init_for(&canon, dtype), seed));
            }
            entries.insert(name.clone(), Entry { dtype_name: dtype_name.to_string(), dtype, shape, key });
        }
        if entries.is_empty() {
            return Err(err("names no tensors".into()));
        }
        let values = (0..keys.len()).map(|_| OnceLock::new()).collect();
        Ok(SyntheticTensors { manifest, entries, keys, values, total_bytes: total })
    }

    /// The bytes of every tensor the manifest names, in its dtypes: what a checkpoint of these
    /// tensors would hold.
    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    pub fn path(&self) -> &Path {
        &self.manifest
    }

    /// The names, dtypes (as candle reads them) and dtype names of every tensor.
    pub fn list(&self) -> impl Iterator<Item = (&str, Option<DType>, &str)> {
        self.entries.iter().map(|(n, e)| (n.as_str(), e.dtype, e.dtype_name.as_str()))
    }

    /// The dtype and dtype name of `name`, if the manifest has it.
    pub fn dtype(&self, name: &str) -> Option<(Option<DType>, &str)> {
        self.entries.get(name).map(|e| (e.dtype, e.dtype_name.as_str()))
    }

    /// The shape of `name`, if the manifest has it.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.entries.get(name).map(|e| e.shape.as_slice())
    }

    /// Whether the values of `name` have been drawn (by a read of it or of a tensor sharing
    /// them).
    pub fn is_drawn(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|e| self.values[e.key].get().is_some())
    }

    /// The dtype, shape and bytes of `name` (generated on the first read of its key); for a
    /// dtype no values are drawn in, `None` and no bytes (the loader refuses such a tensor).
    pub fn get(&self, name: &str) -> Option<Drawn<'_>> {
        let e = self.entries.get(name)?;
        let data = match e.dtype {
            None => &[][..],
            Some(dtype) => {
                let (init, seed) = self.keys[e.key];
                self.values[e.key].get_or_init(|| generate(init, seed, dtype, e.shape.iter().product()))
            }
        };
        Some(Drawn { dtype: e.dtype, dtype_name: &e.dtype_name, shape: &e.shape, data })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(dir: &Path, body: &str) -> SyntheticTensors {
        std::fs::write(dir.join(MANIFEST), body).unwrap();
        SyntheticTensors::open(dir).unwrap()
    }

    #[test]
    fn layers_share_values_and_draws_follow_the_names() {
        let dir = std::env::temp_dir().join(format!("layertap-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = manifest(
            &dir,
            r#"{"__metadata__": {"format": "pt"},
                "model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [256, 512]},
                "model.layers.7.mlp.up_proj.weight": {"dtype": "BF16", "shape": [256, 512]},
                "model.layers.7.mlp.down_proj.weight": {"dtype": "F8_E4M3", "shape": [256, 512]},
                "model.layers.7.mlp.down_proj.weight_scale_inv": {"dtype": "F32", "shape": [2, 4]},
                "model.layers.0.input_layernorm.weight": {"dtype": "F32", "shape": [512]},
                "model.layers.0.linear_attn.A_log": {"dtype": "F32", "shape": [4096]},
                "model.layers.0.odd": {"dtype": "I4", "shape": [4]}}"#,
        );
        let Drawn { dtype: d0, shape: s0, data: b0, .. } = s.get("model.layers.0.mlp.up_proj.weight").unwrap();
        let b7 = s.get("model.layers.7.mlp.up_proj.weight").unwrap().data;
        assert_eq!((d0, s0), (Some(DType::BF16), &[256usize, 512][..]));
        assert_eq!(b0.as_ptr(), b7.as_ptr(), "layers differing by number only share their values");
        let w: Vec<f32> = b0.chunks(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        let mean = w.iter().sum::<f32>() / w.len() as f32;
        let sd = (w.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / w.len() as f32).sqrt();
        assert!(mean.abs() < 1e-3 && (sd - WEIGHT_SIGMA).abs() < 1e-3, "mean {mean}, deviation {sd}");
        let distinct: std::collections::HashSet<u16> = b0.chunks(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
        assert!(distinct.len() > 1000, "{} distinct values", distinct.len());

        let q = s.get("model.layers.7.mlp.down_proj.weight").unwrap().data;
        let sc = s.get("model.layers.7.mlp.down_proj.weight_scale_inv").unwrap().data;
        let scale = f32::from_le_bytes(sc[..4].try_into().unwrap());
        let deq: Vec<f32> = q.iter().map(|&b| float8::F8E4M3::from_bits(b).to_f32() * scale).collect();
        assert!(deq.iter().all(|v| v.is_finite()));
        let sd = (deq.iter().map(|v| v * v).sum::<f32>() / deq.len() as f32).sqrt();
        assert!((sd - WEIGHT_SIGMA).abs() < 2e-3, "dequantised deviation {sd}");

        let norm = s.get("model.layers.0.input_layernorm.weight").unwrap().data;
        assert!(norm.chunks(4).all(|b| f32::from_le_bytes(b.try_into().unwrap()) == 1.0));
        let a = s.get("model.layers.0.linear_attn.A_log").unwrap().data;
        let a: Vec<f32> = a.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert!(a.iter().all(|v| (0.0..=16f32.ln()).contains(v)) && a.iter().any(|v| *v > 2.0));

        let odd = Drawn { dtype: None, dtype_name: "I4", shape: &[4], data: &[] };
        assert_eq!(s.get("model.layers.0.odd"), Some(odd));
        assert!(s.get("model.layers.1.mlp.up_proj.weight").is_none());
        assert_eq!(s.dtype("model.layers.0.odd"), Some((None, "I4")));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_manifest_is_refused_with_its_reason() {
        let dir = std::env::temp_dir().join(format!("layertap-synthetic-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (body, why) in [
            ("[1, 2]", "not a JSON object"),
            ("{}", "names no tensors"),
            (r#"{"a": {"shape": [1]}}"#, "no \"dtype\""),
            (r#"{"a": {"dtype": "F32", "shape": [-1]}}"#, "not a list of sizes"),
            ("{", "not valid JSON"),
        ] {
            std::fs::write(dir.join(MANIFEST), body).unwrap();
            let e = SyntheticTensors::open(&dir).err().unwrap().to_string();
            assert!(e.contains(why), "{body}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
