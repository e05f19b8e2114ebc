//! `--synthetic-weights`: random weights drawn from a manifest of the checkpoint's layout (for
//! benchmarks of shapes whose checkpoint is not at hand). They must go through the loader exactly
//! as a checkpoint holding the same values does (FP8 projections included), be served only when
//! asked for, and every inconsistency of the manifest must be refused as a checkpoint's would be.

mod common;

use std::path::Path;

use common::fixtures;
use layertap::engine::loader::{LoadedModel, ModelFiles};
use layertap::engine::synthetic::{SyntheticTensors, MANIFEST};
use layertap::engine::{Batch, DType, Device, Engine, OutDType};
use serde_json::{json, Map, Value};

/// The manifest of the fixture checkpoint `src` (its safetensors header: names, dtypes, shapes),
/// edited by `edit`, beside a copy of its config.json, in a new folder.
fn manifest_of(src: &Path, edit: impl Fn(&mut Map<String, Value>)) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), out.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut m = Map::new();
    for (name, v) in st.tensors() {
        m.insert(name, json!({"dtype": format!("{:?}", v.dtype()), "shape": v.shape()}));
    }
    edit(&mut m);
    std::fs::write(out.path().join(MANIFEST), serde_json::to_vec(&Value::Object(m)).unwrap()).unwrap();
    out
}

/// A checkpoint folder holding the values the manifest in `dir` draws, as a safetensors file.
fn materialised(dir: &Path) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), out.path().join("config.json")).unwrap();
    let s = SyntheticTensors::open(dir).unwrap();
    let manifest: Map<String, Value> = serde_json::from_slice(&std::fs::read(dir.join(MANIFEST)).unwrap()).unwrap();
    let owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = manifest
        .keys()
        .map(|name| {
            let d = s.get(name).unwrap();
            assert!(d.dtype.is_some(), "{name}: {}", d.dtype_name);
            let st_dtype = match d.dtype_name {
                "F32" => safetensors::Dtype::F32,
                "F16" => safetensors::Dtype::F16,
                "BF16" => safetensors::Dtype::BF16,
                "F8_E4M3" => safetensors::Dtype::F8_E4M3,
                other => panic!("{other}"),
            };
            (name.clone(), st_dtype, d.shape.to_vec(), d.data.to_vec())
        })
        .collect();
    let views: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::tensor::serialize_to_file(views, None, &out.path().join("model.safetensors")).unwrap();
    out
}

fn load(dir: &Path, synthetic: bool) -> LoadedModel {
    ModelFiles::locate_with(&dir.to_string_lossy(), synthetic).unwrap().load(&Device::Cpu, DType::F32).unwrap()
}

/// Every index of one 23-token sequence, in f32.
fn states(m: &mut LoadedModel) -> Vec<f32> {
    let all: Vec<usize> = (0..=m.info.num_layers + 1).collect();
    let seq: Vec<u32> = (0..23).map(|i| (i * 7 + 3) % 100).collect();
    let taps = m.engine.forward(&Batch::new(seq, vec![0, 23], all.clone())).unwrap();
    taps.gather(0, 23, &all, OutDType::Float32).unwrap().to_f32()
}

#[test]
fn synthetic_weights_load_as_a_checkpoint_of_the_same_values_does() {
    for name in [
        "tiny/qwen3_5_hybrid",
        "tiny/qwen3_5_moe_fused",
        "tiny/llama_headdim_bias_tied",
        "fp8/qwen3_5_moe_f32_scales",
        "fp8/qwen3_next_bf16_scales",
        "fp8/qwen3_bf16_scales",
    ] {
        let dir = manifest_of(&fixtures().join(name), |_| {});
        let mut synthetic = load(dir.path(), true);
        let real = materialised(dir.path());
        let mut checkpoint = load(real.path(), false);
        assert!(synthetic.info.model_id.ends_with(" (synthetic weights)"), "{}", synthetic.info.model_id);
        assert_eq!(synthetic.info.quantization, checkpoint.info.quantization, "{name}");
        if name.starts_with("fp8/") {
            let q = synthetic.info.quantization.clone().unwrap_or_default();
            assert!(q.contains("dequantised to f32 at load"), "{name}: {q}");
        }
        let (a, b) = (states(&mut synthetic), states(&mut checkpoint));
        assert!(a.iter().all(|v| v.is_finite()), "{name}: non-finite states");
        let spread = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(spread > 1e-3, "{name}: states all near zero ({spread})");
        let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
        assert_eq!(differ, 0, "{name}: {differ} of {} values differ from the materialised checkpoint", a.len());
        // Drawn again in a new process-wide load: the same values.
        assert_eq!(states(&mut load(dir.path(), true)), a, "{name}: a second load draws other values");
    }
}

fn refusal(dir: &Path, synthetic: bool) -> String {
    let r = ModelFiles::locate_with(&dir.to_string_lossy(), synthetic)
        .and_then(|f| f.load(&Device::Cpu, DType::F32).map(|_| ()));
    r.err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{} must be refused", dir.display()))
}

#[test]
fn synthetic_weights_are_served_only_when_asked_for_and_a_bad_manifest_is_refused() {
    let src = fixtures().join("fp8/qwen3_5_moe_f32_scales");
    let dir = manifest_of(&src, |_| {});
    let e = refusal(dir.path(), false);
    assert!(e.contains("--synthetic-weights") && e.contains("neither model.safetensors"), "{e}");
    // The flag on a folder with no manifest (a real checkpoint) is refused, not ignored.
    let e = refusal(&src, true);
    assert!(e.contains(MANIFEST), "{e}");

    const LAYER0: &str = "model.layers.0.mlp.shared_expert.down_proj";
    type Edit = Box<dyn Fn(&mut Map<String, Value>)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|m| m[&format!("{LAYER0}.weight")]["shape"] = json!([128, 256])), "has shape"),
        (Box::new(|m| drop(m.remove("model.norm.weight"))), "is missing"),
        (Box::new(|m| drop(m.remove(&format!("{LAYER0}.weight_scale_inv")))), "has no"),
        (Box::new(|m| m["model.norm.weight"]["dtype"] = json!("I8")), "cannot be read"),
        (Box::new(|m| m["model.norm.weight"]["shape"] = json!("wide")), "not a list of sizes"),
    ];
    for (edit, want) in cases {
        let e = refusal(manifest_of(&src, edit).path(), true);
        assert!(e.contains(want), "want {want:?} in: {e}");
    }
}

/// Sizes no machine serves are refused with a message before anything is drawn or allocated,
/// never by an allocation failure or an overflow: a tensor past what a size can address, a
/// manifest larger than the device's memory, a vocabulary larger than any model's.
#[test]
fn sizes_past_any_machine_are_refused_with_a_message() {
    let src = fixtures().join("tiny/qwen3_qknorm");
    let huge = manifest_of(&src, |m| {
        m["model.embed_tokens.weight"]["shape"] = json!([1u64 << 41, 1u64 << 40]);
    });
    let e = refusal(huge.path(), true);
    assert!(e.contains("model.embed_tokens.weight") && e.contains("larger than any tensor"), "{e}");
    // Each tensor addressable, all of them together more than this host's memory.
    let big = manifest_of(&src, |m| {
        for i in 0..8 {
            m.insert(format!("model.unused.{i}.weight"), json!({"dtype": "F32", "shape": [1u64 << 36, 2]}));
        }
    });
    let e = refusal(big.path(), true);
    assert!(e.contains("more than the host's") && e.contains("cannot load here"), "{e}");
    // A vocabulary past any real model's, with a manifest to match.
    let vocab = manifest_of(&src, |m| {
        m["model.embed_tokens.weight"]["shape"] = json!([1u64 << 40, 64]);
        m["lm_head.weight"]["shape"] = json!([1u64 << 40, 64]);
    });
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(vocab.path().join("config.json")).unwrap()).unwrap();
    cfg["vocab_size"] = json!(1u64 << 40);
    std::fs::write(vocab.path().join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = refusal(vocab.path(), true);
    assert!(e.contains("vocab_size") && e.contains("larger than layertap serves"), "{e}");
}
