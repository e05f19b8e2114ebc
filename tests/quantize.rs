//! `--quantize fp8`: a float checkpoint's projections quantised at load to Qwen's block-wise FP8
//! (e4m3, 128 x 128 weight blocks, dynamic per-token activations). The quantiser against the FP8
//! fixtures' own bytes and scales, end to end against their references, which projections are
//! quantised, the refusals, and how far the answers move from the float model.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::{edited_fixture, fixture_models, fixtures, read_safetensors, rel_err, worst_per_index, OwnedTensor};
use layertap::engine::layers::fp8::quantise_weight;
use layertap::engine::loader::{LoadedModel, ModelFiles};
use layertap::engine::{Batch, DType, Device, Engine, OutDType, Quantize};
use safetensors::tensor::Dtype;
use serde_json::Value;

/// The FP8 fixtures' references run W8A8 in f32 as the engine does; only the order of f32 sums
/// differs (as in tests/fp8.rs).
const TOLERANCE: f64 = 1e-4;

/// The FP8 fixtures whose scales are f32: made from float weights with `scale = amax / 448` in
/// f32, so each block's largest |q| is 448 and quantising the dequantised weights again gives the
/// same blocks.
const F32_SCALES: &[&str] = &["fp8/qwen3_f32_scales", "fp8/qwen3_5_f32_scales"];

const AT_LOAD: &str = "fp8 e4m3 weights in 128x128 blocks quantised at load (--quantize fp8), dynamic per-token fp8 \
                       activations";

fn e4m3(b: u8) -> f32 {
    float8::F8E4M3::from_bits(b).to_f32()
}

fn floats(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => panic!("not a float dtype: {other:?}"),
    }
}

/// The `[n, k]` weight `q * scale` per 128 x 128 block, in f32 (`scale` `[ceil(n/128), ceil(k/128)]`).
fn dequantised(q: &[u8], scale: &[f32], n: usize, k: usize) -> Vec<f32> {
    let kb = k.div_ceil(128);
    (0..n * k).map(|i| e4m3(q[i]) * scale[(i / k / 128) * kb + (i % k) / 128]).collect()
}

/// Every tensor of an FP8 checkpoint in float32, each FP8 projection dequantised (its scale
/// dropped).
fn to_float32(ts: &mut Vec<OwnedTensor>) {
    let scales: HashMap<String, Vec<f32>> = ts
        .iter()
        .filter(|t| t.0.ends_with(".weight_scale_inv"))
        .map(|t| (t.0.trim_end_matches("_scale_inv").to_string(), floats(t.1, &t.3)))
        .collect();
    ts.retain(|t| !t.0.ends_with(".weight_scale_inv"));
    for (name, dtype, shape, bytes) in ts.iter_mut() {
        let v = if *dtype == Dtype::F8_E4M3 {
            dequantised(bytes, &scales[name.as_str()], shape[0], shape[1])
        } else {
            floats(*dtype, bytes)
        };
        *dtype = Dtype::F32;
        *bytes = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    }
}

fn without_quantization(c: &mut Value) {
    c.as_object_mut().unwrap().remove("quantization_config");
    if let Some(text) = c.get_mut("text_config").and_then(Value::as_object_mut) {
        text.remove("quantization_config");
    }
}

/// A float32 copy of the FP8 fixture `name`: its projections dequantised, no quantization_config.
fn float_copy(name: &str) -> tempfile::TempDir {
    edited_fixture(&fixtures().join(name), to_float32, without_quantization)
}

fn load(dir: &Path, quantize: Option<Quantize>) -> LoadedModel {
    let files = ModelFiles::locate(&dir.to_string_lossy()).unwrap().quantize(quantize).unwrap();
    files.load(&Device::Cpu, DType::F32).unwrap()
}

/// The error of `--quantize fp8` on the model at `spec`, at locating or loading.
fn refusal(spec: &Path) -> String {
    let r = ModelFiles::locate(&spec.to_string_lossy())
        .and_then(|f| f.quantize(Some(Quantize::Fp8)))
        .and_then(|f| f.load(&Device::Cpu, DType::F32).map(|_| ()));
    r.err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{} must be refused", spec.display()))
}

/// An F8_E4M3 weight `[n, k]` of a checkpoint, with its scales in f32.
struct Fp8Weight {
    name: String,
    n: usize,
    k: usize,
    q: Vec<u8>,
    scale: Vec<f32>,
}

/// The F8_E4M3 weights of the checkpoint at `dir`, by name.
fn fp8_weights(dir: &Path) -> Vec<Fp8Weight> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .filter(|(_, v)| v.dtype() == Dtype::F8_E4M3)
        .map(|(name, v)| {
            let s = st.tensor(&format!("{name}_scale_inv")).unwrap();
            let (n, k, q) = (v.shape()[0], v.shape()[1], v.data().to_vec());
            Fp8Weight { name, n, k, q, scale: floats(s.dtype(), s.data()) }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[test]
fn quantising_the_dequantised_fixtures_gives_back_their_bytes_scales_and_states() {
    for name in F32_SCALES {
        let weights = fp8_weights(&fixtures().join(name));
        assert!(weights.len() >= 10, "{name}: {} FP8 weights", weights.len());
        for Fp8Weight { name: tensor, n, k, q, scale } in &weights {
            let (ours, our_scale) = quantise_weight(&dequantised(q, scale, *n, *k), *n, *k).unwrap();
            let differ = ours.iter().zip(q).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{name} {tensor}: {differ} of {} e4m3 bytes differ", q.len());
            // amax of the dequantised block is fl(448 * s), and fl(fl(448 * s) / 448) gives s back
            // exactly for s = fl(a / 448): the scales come back bit for bit.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&our_scale), bits(scale), "{name} {tensor}: scales");
        }
        let dir = float_copy(name);
        let m = load(dir.path(), Some(Quantize::Fp8));
        let want = format!("{AT_LOAD}; projections: {} dequantised to f32 at load (CPU)", weights.len());
        assert_eq!(m.info.quantization.as_deref(), Some(want.as_str()), "{name}");
        let (mut engine, n) = (m.engine, m.info.num_layers);
        let reference = read_safetensors(&fixtures().join(name).join("reference.safetensors"));
        let (worst, failed) = worst_per_index(&mut engine, &reference, n, TOLERANCE);
        let per_index: Vec<String> = worst.iter().map(|e| format!("{e:.1e}")).collect();
        println!("{name} float copy, --quantize fp8: worst relative error per index: {}", per_index.join(" "));
        assert!(failed.is_empty(), "{name}: {}", failed.join("\n"));
        // The same float copy without --quantize is the float model (no activation quantisation):
        // farther from the W8A8 reference than the tolerance, so the comparison tells them apart.
        let m = load(dir.path(), None);
        assert_eq!(m.info.quantization, None);
        let (mut engine, n) = (m.engine, m.info.num_layers);
        let (worst, _) = worst_per_index(&mut engine, &reference, n, TOLERANCE);
        let deepest = worst.iter().copied().fold(0f64, f64::max);
        assert!(deepest > 10.0 * TOLERANCE, "{name}: the float model is within {deepest:.1e} of the W8A8 reference");
    }
}

#[test]
fn the_weight_quantiser_rounds_as_torchs_cast_on_ties_subnormals_zeros_and_the_clamp() {
    // torch's quantise-dequantise of rows in groups of 128 with s = max(amax, 1e-10) / 448: for a
    // weight of one row, a block is one such group, with the same scale wherever amax >= 1e-10.
    let cases = read_safetensors(&fixtures().join("fp8/activation_quant.safetensors"));
    let (input, want) = (&cases["input"], &cases["output"]);
    let k = input.shape[1];
    let mut checked = 0;
    for (row, torch) in input.f32.chunks(k).zip(want.f32.chunks(k)) {
        let (q, scale) = quantise_weight(row, 1, k).unwrap();
        let amax = |g: &[f32]| g.iter().fold(0f32, |m, x| m.max(x.abs()));
        if row.chunks(128).any(|g| amax(g) != 0.0 && amax(g) < 1e-10) {
            continue;
        }
        for (i, (&b, t)) in q.iter().zip(torch).enumerate() {
            let ours = e4m3(b) * scale[i / 128];
            assert_eq!(ours.to_bits(), t.to_bits(), "element {i} ({}): {ours} vs torch's {t}", row[i]);
        }
        checked += 1;
    }
    assert!(checked >= 8, "{checked} rows");
}

/// The summary of how the projections were loaded (after "; projections: ").
fn projections(m: &LoadedModel) -> String {
    let q = m.info.quantization.clone().unwrap_or_default();
    assert!(q.starts_with(AT_LOAD), "{q}");
    q.split_once("; projections: ").map(|(_, p)| p.to_string()).unwrap_or_default()
}

#[test]
fn quantize_fp8_quantises_the_projections_the_releases_quantise_and_nothing_else() {
    // Every FP8 fixture (hidden size 128: the router, in_proj_a and in_proj_b have 128 input
    // features too): the float copy has exactly the projections the fixture stores in FP8
    // quantised, plus layer 1's down_proj that qwen3_bf16_scales keeps in bf16 on purpose (a
    // release's modules_to_not_convert is its own choice; --quantize follows the releases' list).
    for name in [
        "fp8/llama_f16_scales",
        "fp8/qwen3_bf16_scales",
        "fp8/qwen3_f32_scales",
        "fp8/qwen3_moe_bf16_scales",
        "fp8/qwen3_5_f32_scales",
    ] {
        let fp8 = fp8_weights(&fixtures().join(name)).len() + usize::from(name == "fp8/qwen3_bf16_scales");
        let dir = float_copy(name);
        let m = load(dir.path(), Some(Quantize::Fp8));
        assert_eq!(projections(&m), format!("{fp8} dequantised to f32 at load (CPU)"), "{name}");
    }
}

#[test]
fn quantize_fp8_quantises_qwen3_nexts_fused_in_proj_qkvz_in_stored_order_then_regroups_its_blocks() {
    // The float copy of the Qwen3-Next FP8 fixture (one linear-attention layer, key heads of 128,
    // 2 x 128 value rows per key head): in_proj_qkvz is quantised in its stored order, as the
    // release's is, and its blocks regrouped into [q | k | v] and [z] (two projections), so every
    // projection the fixture stores in FP8 is quantised, in_proj_qkvz counting twice.
    let name = "fp8/qwen3_next_bf16_scales";
    let fp8 = fp8_weights(&fixtures().join(name)).len() + 1;
    let dir = float_copy(name);
    let m = load(dir.path(), Some(Quantize::Fp8));
    assert_eq!(projections(&m), format!("{fp8} dequantised to f32 at load (CPU)"));
    // Quantising the dequantised rows in their stored order gives the fixture's blocks back, so
    // the states are the W8A8 reference's (2.0e-7 measured), as for the other FP8 fixtures.
    let reference = read_safetensors(&fixtures().join(name).join("reference.safetensors"));
    let (mut engine, n) = (m.engine, m.info.num_layers);
    let (worst, _) = worst_per_index(&mut engine, &reference, n, f64::INFINITY);
    let deepest = worst.iter().copied().fold(0f64, f64::max);
    println!("{name} float copy, --quantize fp8: worst relative error {deepest:.2e}");
    assert!(deepest <= TOLERANCE, "{deepest:.3e}");
    // The same weights read as 4 key heads of 64 (the same tensor shapes): q_g and k_g are half
    // blocks, so in_proj_qkvz stays in float, counted as such (an FP8 checkpoint of that shape is
    // refused: tests/fp8.rs), and every other projection is quantised.
    let narrow = edited_fixture(&fixtures().join(name), to_float32, |c| {
        without_quantization(c);
        c["linear_num_key_heads"] = 4.into();
        c["linear_key_head_dim"] = 64.into();
    });
    let m = load(narrow.path(), Some(Quantize::Fp8));
    assert_eq!(
        projections(&m),
        format!(
            "{} dequantised to f32 at load (CPU), 1 kept in float (Qwen3-Next in_proj_qkvz whose per-key-head parts \
             are not whole 128-row blocks)",
            fp8 - 2
        )
    );
    // Tiny float fixtures: hidden 64, intermediate 128, 4 heads of 32: per layer o_proj and
    // down_proj (128 input features) are quantised, q/k/v, gate and up (64) stay in float.
    let m = load(&fixtures().join("tiny/qwen3_qknorm"), Some(Quantize::Fp8));
    assert_eq!(
        projections(&m),
        "6 dequantised to f32 at load (CPU), 15 kept in float (input features not a multiple of 128)"
    );
    // Hidden 32: nothing can be quantised. Qwen3-MoE: 4 layers of 4 attention projections, 2 of
    // them with 8 experts of 3 (decoder_sparse_step 2), 2 with a dense MLP of 3; Qwen3.5: 3
    // linear-attention layers (in_proj_qkv, in_proj_z, out_proj; not in_proj_a / in_proj_b) and 1
    // full-attention layer (4), each with an MLP of 3; Qwen3.5-MoE: 2 and 2, each layer with 8
    // fused experts (gate, up and down apart) and a shared expert of 3.
    for (model, kept) in [
        ("tiny/qwen3_moe", 4 * 4 + 2 * 8 * 3 + 2 * 3),
        ("tiny/qwen3_5_text", 3 * 3 + 4 + 4 * 3),
        ("tiny/qwen3_5_moe_fused", 2 * 3 + 2 * 4 + 4 * (8 * 3 + 3)),
    ] {
        let m = load(&fixtures().join(model), Some(Quantize::Fp8));
        assert_eq!(projections(&m), format!("{kept} kept in float (input features not a multiple of 128)"), "{model}");
    }
}

/// The MoE fixture's float copy with its experts fused into `experts.gate_up_proj` `[E, 2I, H]`
/// and `experts.down_proj` `[E, H, I]`, each expert's projections cut to their first `i` rows (gate,
/// up) and columns (down).
fn moe_copy(fused: bool, i: usize) -> tempfile::TempDir {
    let edit = move |ts: &mut Vec<OwnedTensor>| {
        to_float32(ts);
        let experts = "model.layers.1.mlp.experts.";
        let mut per: Vec<OwnedTensor> = Vec::new();
        ts.retain(|t| {
            let keep = !t.0.starts_with(experts);
            if !keep {
                per.push(t.clone());
            }
            keep
        });
        let f = |t: &OwnedTensor| floats(t.1, &t.3);
        let get = |e: usize, p: &str| f(per.iter().find(|t| t.0 == format!("{experts}{e}.{p}.weight")).unwrap());
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (h, full) = (128, 256);
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..4 {
            let (g, u, d) = (get(e, "gate_proj"), get(e, "up_proj"), get(e, "down_proj"));
            let (g, u) = (g[..i * h].to_vec(), u[..i * h].to_vec());
            let d: Vec<f32> = (0..h).flat_map(|r| d[r * full..r * full + i].to_vec()).collect();
            if fused {
                gate_up.extend(g.iter().chain(&u));
                down.extend(d);
            } else {
                let name = |p: &str| format!("{experts}{e}.{p}.weight");
                ts.push((name("gate_proj"), Dtype::F32, vec![i, h], bytes(&g)));
                ts.push((name("up_proj"), Dtype::F32, vec![i, h], bytes(&u)));
                ts.push((name("down_proj"), Dtype::F32, vec![h, i], bytes(&d)));
            }
        }
        if fused {
            ts.push((format!("{experts}gate_up_proj"), Dtype::F32, vec![4, 2 * i, h], bytes(&gate_up)));
            ts.push((format!("{experts}down_proj"), Dtype::F32, vec![4, h, i], bytes(&down)));
        }
    };
    edited_fixture(&fixtures().join("fp8/qwen3_moe_bf16_scales"), edit, move |c| {
        without_quantization(c);
        c["moe_intermediate_size"] = i.into();
    })
}

#[test]
fn fused_experts_are_quantised_per_expert_and_projection_as_one_module_per_expert_is() {
    // I = 256: every expert projection quantised. I = 64: gate and up [64, 128] each one partial
    // row block of their own (quantising the fused [128, 128] as one block would share a scale
    // between them), down_proj (64 input features) kept in float.
    for (i, summary) in [
        (256, "23 dequantised to f32 at load (CPU)"),
        (64, "19 dequantised to f32 at load (CPU), 4 kept in float (input features not a multiple of 128)"),
    ] {
        let reference = read_safetensors(&fixtures().join("fp8/qwen3_moe_bf16_scales/reference.safetensors"));
        let ids: Vec<u32> = reference["seq2.input_ids"].i64.iter().map(|&x| x as u32).collect();
        let all: Vec<usize> = (0..=3).collect();
        let mut states = Vec::new();
        for fused in [false, true] {
            let dir = moe_copy(fused, i);
            let mut m = load(dir.path(), Some(Quantize::Fp8));
            assert_eq!(projections(&m), summary, "I = {i}, fused {fused}");
            let taps = m.engine.forward(&Batch::new(ids.clone(), vec![0, ids.len()], all.clone())).unwrap();
            states.push(taps.gather(0, ids.len(), &all, OutDType::Float32).unwrap().to_f32());
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&states[0]), bits(&states[1]), "I = {i}: fused experts differ from one module per expert");
    }
}

/// A GGUF file of a tiny Llama (one layer, width 8): enough for the loader to read its config.
fn tiny_gguf(dir: &Path) -> std::path::PathBuf {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let path = dir.join("tiny.gguf");
    let t = |shape: &[usize]| {
        let x = candle_core::Tensor::zeros(shape, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        QTensor::quantize(&x, GgmlDType::F32).unwrap()
    };
    let embed = t(&[16, 8]);
    let meta = [
        ("general.architecture", gguf_file::Value::String("llama".into())),
        ("llama.embedding_length", gguf_file::Value::U32(8)),
        ("llama.attention.head_count", gguf_file::Value::U32(2)),
        ("llama.block_count", gguf_file::Value::U32(1)),
        ("llama.feed_forward_length", gguf_file::Value::U32(16)),
    ];
    let meta: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &meta, &[("token_embd.weight", &embed)]).unwrap();
    path
}

#[test]
fn quantize_refuses_quantised_checkpoints_and_gguf_files() {
    // A checkpoint that declares its own quantisation.
    for name in ["fp8/qwen3_f32_scales", "fp8/qwen3_moe_bf16_scales"] {
        let msg = refusal(&fixtures().join(name));
        assert!(
            msg.contains("--quantize fp8") && msg.contains("already declares") && msg.contains("fp8 e4m3"),
            "{msg}"
        );
    }
    // A GGUF file (the default model is one).
    let dir = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(dir.path());
    ModelFiles::locate(&gguf.to_string_lossy()).expect("the GGUF file itself is read");
    let msg = refusal(&gguf);
    assert!(msg.contains("--quantize fp8 reads safetensors checkpoints") && msg.contains("GGUF"), "{msg}");
    // Without --quantize both are read as before.
    assert!(ModelFiles::locate(&gguf.to_string_lossy()).unwrap().quantize(None).is_ok());
}

fn layertap(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_layertap"));
    c.args(args).env_remove("LAYERTAP_QUANTIZE");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn the_cli_takes_quantize_fp8_on_serve_extract_and_bench_and_refuses_the_rest() {
    use clap::Parser;
    use layertap::cli::{Cli, Command};
    for sub in ["serve", "extract", "bench"] {
        let mut args = vec!["layertap", sub, "--model", "m", "--quantize", "fp8"];
        if sub == "extract" {
            args.extend(["--layers", "1", "--out", "x"]);
        }
        let q = match Cli::try_parse_from(&args).unwrap().command {
            Command::Serve(a) => a.quantize,
            Command::Extract(a) => a.quantize,
            Command::Bench(a) => a.quantize,
            _ => None,
        };
        assert_eq!(q, Some(Quantize::Fp8), "{sub}");
        args[5] = "int8";
        let e = Cli::try_parse_from(&args).unwrap_err().to_string();
        assert!(e.contains("invalid value 'int8'") && e.contains("fp8"), "{sub}: {e}");
    }
    // The binary: an unknown value is a usage error; a GGUF file and a quantised checkpoint are
    // refused with the reason, from the flag or from LAYERTAP_QUANTIZE.
    let o = layertap(&["serve", "--model", "m", "--quantize", "int8"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("possible values: fp8"));
    let dir = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(dir.path()).to_string_lossy().to_string();
    let fp8 = fixtures().join("fp8/qwen3_f32_scales").to_string_lossy().to_string();
    let serve = ["serve", "--host", "127.0.0.1", "--port", "0", "--model"];
    let cases = [
        ([&serve[..], &[&gguf, "--quantize", "fp8"]].concat(), vec![], "reads safetensors checkpoints"),
        ([&serve[..], &[&fp8]].concat(), vec![("LAYERTAP_QUANTIZE", "fp8")], "already declares"),
        (
            vec![
                "extract",
                "--model",
                &gguf,
                "--quantize",
                "fp8",
                "--layers",
                "1",
                "--input-ids",
                "1",
                "--out",
                "/dev/null",
            ],
            vec![],
            "reads safetensors checkpoints",
        ),
        (vec!["bench", "--model", &fp8, "--quantize", "fp8"], vec![], "already declares"),
    ];
    for (args, env, want) in cases {
        let o = layertap(&args, &env);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && stderr.contains(want), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_with_quantize_says_so_in_v1_info() {
    let dir = float_copy("fp8/qwen3_f32_scales");
    let (mut child, base) = common::serve_binary(dir.path(), &["--quantize", "fp8"], |_| {}).await;
    let info: Value = common::client().get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(info["quantization"], AT_LOAD, "{info}");
    assert_eq!(info["selfcheck"]["passed"], true, "{info}");
}

/// Per index 0..=n and final_prenorm: the largest absolute difference and the relative (L2)
/// error of `engine`'s states from the reference's, over its sequences.
fn distances(engine: &mut impl Engine, reference: &HashMap<String, common::Read>, n: usize) -> Vec<(f64, f64)> {
    let all: Vec<usize> = (0..=n + 1).collect();
    let mut worst = vec![(0f64, 0f64); n + 2];
    for i in 0.. {
        let Some(ids) = reference.get(&format!("seq{i}.input_ids")) else { break };
        let hs = &reference[&format!("seq{i}.hidden_states")];
        let prenorm = &reference[&format!("seq{i}.final_prenorm")].f32;
        let (t, h) = (hs.shape[1], hs.shape[2]);
        let seq: Vec<u32> = ids.i64.iter().map(|&x| x as u32).collect();
        let taps = engine.forward(&Batch::new(seq, vec![0, t], all.clone())).unwrap();
        let got = taps.gather(0, t, &all, OutDType::Float32).unwrap().to_f32();
        for (layer, w) in worst.iter_mut().enumerate() {
            let want = if layer <= n { &hs.f32[layer * t * h..(layer + 1) * t * h] } else { &prenorm[..] };
            let ours: Vec<f32> = (0..t).flat_map(|r| got[(r * (n + 2) + layer) * h..][..h].to_vec()).collect();
            let abs = ours.iter().zip(want).map(|(a, b)| f64::from((a - b).abs())).fold(0f64, f64::max);
            *w = (w.0.max(abs), w.1.max(rel_err(&ours, want)));
        }
    }
    worst
}

#[test]
fn quantize_fp8_answers_stay_near_the_float_models() {
    // The tiny float fixtures against transformers' f32 states: only projections with 128 input
    // features are quantised there (none at hidden size 32), so most move little or not at all.
    let mut report = Vec::new();
    for dir in fixture_models() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut m = load(&dir, Some(Quantize::Fp8));
        let summary = projections(&m);
        let reference = read_safetensors(&dir.join("reference.safetensors"));
        let d = distances(&mut m.engine, &reference, m.info.num_layers);
        report.push((name, summary, d));
    }
    // The FP8 fixtures' float copies with every projection weight moved off the e4m3 grid (by a
    // fixed pattern of up to 1/16 of itself): every projection quantised, against the same model
    // in float (the engine's f32 path, which matches transformers).
    for name in ["fp8/qwen3_f32_scales", "fp8/qwen3_moe_bf16_scales", "fp8/qwen3_5_f32_scales"] {
        let projections_of = fp8_weights(&fixtures().join(name)).into_iter().map(|w| w.name).collect::<Vec<_>>();
        let dir = edited_fixture(
            &fixtures().join(name),
            move |ts| {
                to_float32(ts);
                for t in ts.iter_mut().filter(|t| projections_of.contains(&t.0)) {
                    let v: Vec<f32> = floats(t.1, &t.3)
                        .iter()
                        .enumerate()
                        .map(|(i, x)| x * (1.0 + ((i * 2654435761) % 1000) as f32 / 16000.0))
                        .collect();
                    t.3 = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                }
            },
            without_quantization,
        );
        let float = load(dir.path(), None);
        let mut reference = HashMap::new();
        let source = read_safetensors(&fixtures().join(name).join("reference.safetensors"));
        let (mut engine, n) = (float.engine, float.info.num_layers);
        let all: Vec<usize> = (0..=n + 1).collect();
        for i in 0.. {
            let Some(ids) = source.get(&format!("seq{i}.input_ids")) else { break };
            let seq: Vec<u32> = ids.i64.iter().map(|&x| x as u32).collect();
            let t = seq.len();
            let taps = engine.forward(&Batch::new(seq, vec![0, t], all.clone())).unwrap();
            let got = taps.gather(0, t, &all, OutDType::Float32).unwrap().to_f32();
            let h = got.len() / t / (n + 2);
            let index = |l: usize| (0..t).flat_map(|r| got[(r * (n + 2) + l) * h..][..h].to_vec()).collect::<Vec<_>>();
            let read = |f32: Vec<f32>, shape: Vec<usize>| common::Read { shape, f32, i64: vec![], f64: vec![] };
            reference.insert(format!("seq{i}.input_ids"), ids.clone());
            reference
                .insert(format!("seq{i}.hidden_states"), read((0..=n).flat_map(index).collect(), vec![n + 1, t, h]));
            reference.insert(format!("seq{i}.final_prenorm"), read(index(n + 1), vec![t, h]));
        }
        let mut m = load(dir.path(), Some(Quantize::Fp8));
        let summary = projections(&m);
        let d = distances(&mut m.engine, &reference, m.info.num_layers);
        report.push((format!("{name} (float, off the grid)"), summary, d));
    }
    let mut failures = Vec::new();
    for (name, summary, d) in &report {
        let abs: Vec<String> = d.iter().map(|e| format!("{:.1e}", e.0)).collect();
        let rel: Vec<String> = d.iter().map(|e| format!("{:.1e}", e.1)).collect();
        println!("{name} [{summary}]\n  max abs per index: {}\n  relative per index: {}", abs.join(" "), rel.join(" "));
        if d.iter().any(|e| e.1.is_nan() || e.1 >= 0.1) {
            failures.push(format!("{name}: relative error per index {}", rel.join(" ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// On the GPU (CUDA builds, where a device is visible): the float copies loaded with
/// `--quantize fp8` run on the FP8 tensor cores and match the FP8 fixtures' references as the
/// FP8 checkpoints themselves do there (tests/cuda_fp8.rs: f32 within 2e-3, bf16 within 3e-2).
#[cfg(feature = "cuda")]
#[test]
fn quantize_fp8_on_the_gpu_matches_the_fp8_references() {
    let Some(dev) = common::cuda_device() else { return };
    let mut names = F32_SCALES.to_vec();
    names.push("fp8/qwen3_5_moe_f32_scales");
    for name in names {
        let dir = float_copy(name);
        let files = ModelFiles::locate(&dir.path().to_string_lossy()).unwrap().quantize(Some(Quantize::Fp8)).unwrap();
        let reference = read_safetensors(&fixtures().join(name).join("reference.safetensors"));
        for (dtype, allowed) in [(DType::F32, 2e-3), (DType::BF16, 3e-2)] {
            let mut m = files.load(&dev, dtype).unwrap();
            let described = m.info.quantization.clone().unwrap_or_default();
            assert!(described.starts_with(AT_LOAD), "{described}");
            let (worst, _) = worst_per_index(&mut m.engine, &reference, m.info.num_layers, f64::INFINITY);
            let per_index: Vec<String> = worst.iter().map(|e| format!("{e:.1e}")).collect();
            println!("{name} {dtype:?} ({described}): worst per index {}", per_index.join(" "));
            for (i, e) in worst.iter().enumerate() {
                assert!(*e <= allowed, "{name} {dtype:?} index {i}: {e:.3e} > {allowed:.1e}");
            }
        }
    }
}
