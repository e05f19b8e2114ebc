//! Qwen's block-wise FP8 checkpoints (quant_method "fp8", e4m3, 128 x 128 weight blocks, dynamic
//! per-token activations) on the CPU: every index against transformers on tiny random
//! checkpoints in the releases' layout (tests/fixtures/fp8, made by scripts/make_fp8_fixtures.py),
//! the activation quantiser against torch's cast, packing, and the refusal of every other scheme
//! and of checkpoints that contradict their config.

mod common;

use std::path::{Path, PathBuf};

use common::{edited_fixture, fixtures, read_safetensors, refusal, with_config, with_tensors, worst_per_index};
use layertap::engine::layers::fp8::quantise_row;
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, ModelEngine, OutDType};
use safetensors::tensor::Dtype;
use serde_json::{json, Value};

/// The references run W8A8 in f32 as the engine does; only the order of f32 sums differs.
const TOLERANCE: f64 = 1e-4;

const BF16_SCALES: &str = "fp8/qwen3_bf16_scales";
const NEXT: &str = "fp8/qwen3_next_bf16_scales";
const SUPPORTED: &str =
    "supported quantisation: quant_method \"fp8\" with fmt \"e4m3\", activation_scheme \"dynamic\" \
                         and weight_block_size [128, 128]";

fn models() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures().join("fp8"))
        .expect("tests/fixtures/fp8 exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("reference.safetensors").is_file())
        .collect();
    v.sort();
    v
}

/// `field` of the fixture's reference.json.
fn described(dir: &Path, field: &str) -> String {
    let r: Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    r[field].as_str().unwrap().to_string()
}

fn load(dir: &Path) -> (ModelEngine, usize) {
    let files = ModelFiles::locate(&dir.to_string_lossy()).expect("locate fixture");
    let m = files.load(&Device::Cpu, DType::F32).expect("load fixture");
    let described = m.info.quantization.clone().unwrap_or_default();
    assert!(described.contains("fp8 e4m3") && described.contains("128x128"), "{described:?}");
    (m.engine, m.info.num_layers)
}

/// States `[T, layers.len(), H]` of sequences packed in one batch, per sequence.
fn run(engine: &mut ModelEngine, seqs: &[Vec<u32>], layers: &[usize]) -> Vec<Vec<f32>> {
    let mut cu = vec![0];
    for s in seqs {
        cu.push(cu.last().unwrap() + s.len());
    }
    let taps = engine.forward(&Batch::new(seqs.concat(), cu.clone(), layers.to_vec())).expect("forward");
    (0..seqs.len())
        .map(|i| taps.gather(cu[i], seqs[i].len(), layers, OutDType::Float32).expect("gather").to_f32())
        .collect()
}

#[test]
fn every_fp8_checkpoint_matches_transformers_at_every_index_and_final_prenorm() {
    let dirs = models();
    let dtypes: Vec<String> = dirs.iter().map(|d| described(d, "scale_dtype")).collect();
    for want in ["bfloat16", "float32", "float16"] {
        assert!(dtypes.iter().any(|d| d == want), "a fixture with {want} scales: {dtypes:?}");
    }
    let classes: Vec<String> = dirs.iter().map(|d| described(d, "model_class")).collect();
    for want in [
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
    ] {
        assert!(classes.iter().any(|c| c == want), "a {want} fixture: {classes:?}");
    }
    let mut failures = Vec::new();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let (mut engine, n) = load(&dir);
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let (worst, failed) = worst_per_index(&mut engine, &reference, n, TOLERANCE);
        failures.extend(failed.into_iter().map(|f| format!("{name} {f}")));
        let per_index: Vec<String> = worst.iter().map(|e| format!("{e:.1e}")).collect();
        println!("{name}: worst relative error per index 0..={n}, final_prenorm: {}", per_index.join(" "));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn packed_fp8_sequences_equal_solo_runs_bitwise() {
    for dir in models() {
        let (mut engine, n) = load(&dir);
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let seqs: Vec<Vec<u32>> =
            (0..3).map(|i| reference[&format!("seq{i}.input_ids")].i64.iter().map(|&x| x as u32).collect()).collect();
        let layers = vec![n + 1, 0, 1, n];
        let packed = run(&mut engine, &[seqs[2].clone(), seqs[0].clone(), seqs[1].clone()], &layers);
        let solo: Vec<Vec<f32>> =
            seqs.iter().map(|s| run(&mut engine, std::slice::from_ref(s), &layers).remove(0)).collect();
        for (p, s) in [(0, 2), (1, 0), (2, 1)] {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&packed[p]), bits(&solo[s]), "{}: sequence {s} differs when packed", dir.display());
        }
    }
}

#[test]
fn the_activation_quantiser_gives_torchs_bits_on_ties_subnormals_zeros_and_the_clamp() {
    let cases = read_safetensors(&fixtures().join("fp8/activation_quant.safetensors"));
    let (input, want) = (&cases["input"], &cases["output"]);
    let mut got = input.f32.clone();
    got.chunks_mut(input.shape[1]).for_each(quantise_row);
    for (i, (g, w)) in got.iter().zip(&want.f32).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "element {i} (input {}): {g} vs torch's {w}", input.f32[i]);
    }
    // The cases are not trivial: ties went both ways and values were rounded away.
    let changed = got.iter().zip(&input.f32).filter(|(g, x)| g != x).count();
    assert!(changed > got.len() / 2, "only {changed} of {} values changed", got.len());
}

#[test]
fn every_other_quantisation_scheme_is_refused_naming_the_one_supported() {
    let fp8 = |edit: Value| {
        let mut q = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]});
        for (k, v) in edit.as_object().unwrap() {
            q[k] = v.clone();
        }
        q
    };
    let cases = [
        (json!({"quant_method": "compressed-tensors", "format": "float-quantized"}), "\"compressed-tensors\""),
        (fp8(json!({"activation_scheme": "static"})), "activation_scheme \"static\""),
        (fp8(json!({"activation_scheme": null})), "activation_scheme missing"),
        (fp8(json!({"weight_block_size": [64, 64]})), "weight_block_size [64,64]"),
        (fp8(json!({"weight_block_size": null})), "per-tensor"),
        (fp8(json!({"fmt": "e5m2"})), "fmt \"e5m2\""),
        (fp8(json!({"scale_fmt": "ue8m0"})), "scale_fmt \"ue8m0\""),
        (json!({"quant_method": "gptq", "bits": 4, "group_size": 128}), "\"gptq\""),
        (json!({"quant_method": "awq", "bits": 4}), "\"awq\""),
        (json!({"quant_method": "mxfp4"}), "\"mxfp4\""),
        (json!({"quant_method": "fbgemm_fp8"}), "\"fbgemm_fp8\""),
    ];
    for (q, names) in cases {
        let dir = with_config(BF16_SCALES, |c| c["quantization_config"] = q.clone());
        let msg = refusal(dir.path()).unwrap_or_else(|| panic!("{q} must be refused"));
        assert!(msg.contains(names) && msg.contains(SUPPORTED), "{q}: {msg}");
    }
    // compressed-tensors' older key, whatever it says.
    let dir = with_config(BF16_SCALES, |c| c["compression_config"] = json!({"quant_method": "fp8"}));
    assert!(refusal(dir.path()).is_some_and(|m| m.contains("compression_config") && m.contains(SUPPORTED)));
    // Declared twice, the two must agree; the same scheme twice loads.
    let dir = with_config(BF16_SCALES, |c| {
        c["text_config"] = c.clone();
        c["text_config"]["quantization_config"]["weight_block_size"] = json!([128, 64]);
    });
    assert!(refusal(dir.path()).is_some());
}

#[test]
fn checkpoints_that_contradict_their_fp8_config_are_refused_naming_the_tensor() {
    let q_proj = "model.layers.0.self_attn.q_proj";
    // An F8 weight without its scale.
    let dir = with_tensors(BF16_SCALES, |ts| ts.retain(|t| t.0 != format!("{q_proj}.weight_scale_inv")));
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(
        msg.contains(&format!("{q_proj}.weight")) && msg.contains("has no") && msg.contains("weight_scale_inv"),
        "{msg}"
    );
    // An F8 projection the config lists as unquantised.
    let dir = with_config(BF16_SCALES, |c| {
        c["quantization_config"]["modules_to_not_convert"] = json!(["lm_head", q_proj]);
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains(q_proj) && msg.contains("modules_to_not_convert"), "{msg}");
    // A scale beside a bf16 weight.
    let down = "model.layers.1.mlp.down_proj";
    let dir = with_tensors(BF16_SCALES, |ts| {
        ts.push((format!("{down}.weight_scale_inv"), Dtype::BF16, vec![1, 3], vec![0x3c; 6]));
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains(&format!("{down}.weight_scale_inv")) && msg.contains("BF16"), "{msg}");
    // A scale in a dtype other than bf16, f16 or f32.
    let dir = with_tensors(BF16_SCALES, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == format!("{q_proj}.weight_scale_inv")).unwrap();
        (t.1, t.3) = (Dtype::F8_E8M0, vec![0x7f; 2]);
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains(&format!("{q_proj}.weight_scale_inv")) && msg.contains("F8_E8M0"), "{msg}");
    // A scale of the wrong shape.
    let dir = with_tensors(BF16_SCALES, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == format!("{q_proj}.weight_scale_inv")).unwrap();
        t.2 = vec![1, 2];
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains(&format!("{q_proj}.weight_scale_inv")) && msg.contains("[2, 1]"), "{msg}");
    // An F8 norm (or embedding) is still a dtype the loader does not read.
    let norm = "model.layers.0.input_layernorm.weight";
    let dir = with_tensors(BF16_SCALES, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == norm).unwrap();
        (t.1, t.3) = (Dtype::F8_E4M3, vec![0x38; 128]);
        ts.push(("model.layers.0.input_layernorm.weight_scale_inv".into(), Dtype::BF16, vec![1], vec![0x3c; 2]));
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains(norm) && msg.contains("F8_E4M3"), "{msg}");
    // FP8 experts fused into 3-D tensors (the per-expert layout is what the releases hold).
    let moe = "fp8/qwen3_moe_bf16_scales";
    let experts = "model.layers.1.mlp.experts";
    let dir = with_tensors(moe, |ts| {
        let n = ts.len();
        ts.retain(|t| !t.0.starts_with(&format!("{experts}.")));
        assert_eq!(n - ts.len(), 4 * 3 * 2);
        ts.push((format!("{experts}.gate_up_proj"), Dtype::F8_E4M3, vec![4, 512, 128], vec![0x38; 4 * 512 * 128]));
        ts.push((format!("{experts}.down_proj"), Dtype::F8_E4M3, vec![4, 128, 256], vec![0x38; 4 * 128 * 256]));
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains(&format!("{experts}.down_proj")) && msg.contains("F8_E4M3"), "{msg}");
    // An FP8 config over float weights: transformers would quantise them as it loads; layertap
    // does not quantise, whatever the family.
    for tiny in ["tiny/qwen3_qknorm", "tiny/qwen3_next_per_expert"] {
        let dir = edited_fixture(
            &fixtures().join(tiny),
            |_| {},
            |c| {
                c["quantization_config"] = json!({"quant_method": "fp8", "fmt": "e4m3",
                                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
            },
        );
        let msg = refusal(dir.path()).unwrap_or_default();
        assert!(msg.contains("no decoder weight") && msg.contains("F8_E4M3"), "{tiny}: {msg}");
    }
    // The fixtures themselves load (the edits above are what is refused).
    assert_eq!(refusal(&fixtures().join(BF16_SCALES)), None);
}

/// A Qwen3-Next FP8 checkpoint's fused `in_proj_qkvz` is regrouped per key head in whole 128-row
/// blocks; dimensions that would split a block between q, k, v and z (a key head dim, or value
/// rows per key head, not a multiple of 128) are refused at load, naming them.
#[test]
fn qwen3_next_fp8_whose_groups_split_a_block_is_refused_naming_the_dimensions() {
    let qkvz = "model.layers.0.linear_attn.in_proj_qkvz";
    // (linear_key_head_dim, linear_num_value_heads, linear_value_head_dim) over 2 key heads, and
    // what the message says of them.
    let cases = [
        (64, 4, 128, ["linear_key_head_dim (64)", "2 x 128 = 256"]),
        (128, 2, 64, ["linear_key_head_dim (128)", "1 x 64 = 64"]),
    ];
    for (dk, nv, dv, said) in cases {
        // The config and in_proj_qkvz agree with each other (the other tensors are never reached).
        let rows = 2 * (2 * dk + 2 * (nv / 2) * dv);
        let dir = edited_fixture(
            &fixtures().join(NEXT),
            |ts| {
                let w = ts.iter_mut().find(|t| t.0 == format!("{qkvz}.weight")).unwrap();
                (w.2, w.3) = (vec![rows, 128], vec![0x38; rows * 128]);
                let s = ts.iter_mut().find(|t| t.0 == format!("{qkvz}.weight_scale_inv")).unwrap();
                (s.2, s.3) = (vec![rows.div_ceil(128), 1], vec![0x3c; 2 * rows.div_ceil(128)]);
            },
            |c| {
                c["linear_key_head_dim"] = json!(dk);
                c["linear_num_value_heads"] = json!(nv);
                c["linear_value_head_dim"] = json!(dv);
            },
        );
        let msg = refusal(dir.path()).unwrap_or_default();
        assert!(msg.contains(qkvz) && msg.contains("128-row blocks"), "{msg}");
        for s in said {
            assert!(msg.contains(s), "{s:?} in {msg}");
        }
    }
    assert_eq!(refusal(&fixtures().join(NEXT)), None);
}
