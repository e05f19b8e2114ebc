//! The Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) and Qwen3-MoE beyond the
//! per-index fidelity that tests/engine.rs checks for every fixture: no state leaks between
//! packed sequences across chunk boundaries, `layertap extract` and `serve` give the reference
//! states, `/v1/info` reports the layer kinds, and bad checkpoints are load errors naming what
//! is wrong. Fixtures: scripts/make_hybrid_fixtures.py.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{fixtures, read_safetensors, read_safetensors_bytes, rel_err};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, ModelEngine, OutDType};
use serde_json::{json, Value};

const HYBRIDS: [&str; 6] =
    ["qwen3_5_hybrid", "qwen3_5_moe_fused", "qwen3_next_per_expert", "qwen3_moe", "qwen3_5_text", "qwen3_5_deep"];

fn dir(name: &str) -> PathBuf {
    fixtures().join("tiny").join(name)
}

fn load(dir: &Path) -> ModelEngine {
    ModelFiles::locate(&dir.to_string_lossy()).expect("locate").load(&Device::Cpu, DType::F32).expect("load").engine
}

fn ids(reference: &std::collections::HashMap<String, common::Read>, i: usize) -> Vec<u32> {
    reference[&format!("seq{i}.input_ids")].i64.iter().map(|&x| x as u32).collect()
}

/// `[T, layers, H]` of each sequence, all packed in one batch.
fn run(engine: &mut ModelEngine, seqs: &[Vec<u32>], layers: &[usize]) -> Vec<Vec<u32>> {
    let mut cu = vec![0];
    for s in seqs {
        cu.push(cu.last().unwrap() + s.len());
    }
    let taps = engine.forward(&Batch::new(seqs.concat(), cu.clone(), layers.to_vec())).unwrap();
    (0..seqs.len())
        .map(|i| {
            let v = taps.gather(cu[i], seqs[i].len(), layers, OutDType::Float32).unwrap().to_f32();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect()
}

/// A sequence's states do not depend on which sequence precedes it in the batch, however many
/// chunks either spans: the conv window, the delta-rule state and the attention restart.
#[test]
fn no_state_leaks_between_packed_sequences() {
    for name in HYBRIDS {
        let d = dir(name);
        let reference = read_safetensors(&d.join("reference.safetensors"));
        let mut engine = load(&d);
        let n = engine.decoder.cfg.num_hidden_layers;
        let all: Vec<usize> = (0..=n).collect();
        // seq4: 65 tokens (two chunks), seq5: 130 (three), seq6: 300; seq1: 3.
        let b = ids(&reference, 4);
        let alone = run(&mut engine, std::slice::from_ref(&b), &all).remove(0);
        for a in [ids(&reference, 5), ids(&reference, 1), ids(&reference, 6)] {
            let packed = run(&mut engine, &[a.clone(), b.clone()], &all);
            assert!(packed[1] == alone, "{name}: sequence B changed after a sequence of {} tokens", a.len());
            let after = run(&mut engine, &[b.clone(), a.clone()], &all);
            assert!(after[0] == alone, "{name}: sequence B changed before a sequence of {} tokens", a.len());
        }
    }
}

/// `layertap extract` on the 130-token sequence returns every index within 1e-5 of transformers.
#[test]
fn extract_matches_transformers_for_every_hybrid_family() {
    let tmp = tempfile::tempdir().unwrap();
    for name in HYBRIDS {
        let d = dir(name);
        let reference = read_safetensors(&d.join("reference.safetensors"));
        let hs = &reference["seq5.hidden_states"];
        let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
        let ids: Vec<String> = reference["seq5.input_ids"].i64.iter().map(|x| x.to_string()).collect();
        let out = tmp.path().join(format!("{name}.safetensors"));
        let layers: Vec<String> = (0..l1).map(|i| i.to_string()).collect();
        let st = Command::new(env!("CARGO_BIN_EXE_layertap"))
            .args(["extract", "--model", &d.to_string_lossy(), "--layers", &layers.join(",")])
            .args(["--input-ids", &ids.join(","), "--dtype", "float32", "--out", &out.to_string_lossy()])
            .status()
            .unwrap();
        assert!(st.success(), "{name}: extract failed");
        let got = &read_safetensors(&out)["hidden_states"];
        assert_eq!(got.shape, vec![t, l1, h]);
        for idx in 0..l1 {
            let want = &hs.f32[idx * t * h..(idx + 1) * t * h];
            let ours: Vec<f32> = (0..t).flat_map(|r| got.f32[(r * l1 + idx) * h..][..h].to_vec()).collect();
            let e = rel_err(&ours, want);
            assert!(e <= 1e-5, "{name} index {idx}: relative error {e:.3e}");
        }
    }
}

/// A deeper Qwen3.5 stack (6 layers, each kind more than once, linear attention last) on the
/// 65-token sequence (two chunks): every index, and the last layer's output before the final
/// norm, within 1e-5 of transformers. Its f32 references are within 1.9e-6 of a float64 run, so
/// the tolerance measures the engine, not the model's sensitivity to rounding.
#[test]
fn a_deeper_hybrid_stack_matches_at_every_index() {
    let d = dir("qwen3_5_deep");
    let reference = read_safetensors(&d.join("reference.safetensors"));
    let mut engine = load(&d);
    let n = engine.decoder.cfg.num_hidden_layers;
    assert_eq!(n, 6);
    let seq = ids(&reference, 4);
    let all: Vec<usize> = (0..=n + 1).collect();
    let got = f32_of(&run(&mut engine, std::slice::from_ref(&seq), &all).remove(0));
    let hs = &reference["seq4.hidden_states"];
    let (t, h) = (hs.shape[1], hs.shape[2]);
    assert_eq!(t, 65);
    let at = |idx: usize| -> Vec<f32> { (0..t).flat_map(|r| got[(r * (n + 2) + idx) * h..][..h].to_vec()).collect() };
    for idx in 0..=n {
        let e = rel_err(&at(idx), &hs.f32[idx * t * h..(idx + 1) * t * h]);
        assert!(e <= 1e-5, "index {idx}: relative error {e:.3e}");
    }
    let e = rel_err(&at(n + 1), &reference["seq4.final_prenorm"].f32);
    assert!(e <= 1e-5, "before the final norm: relative error {e:.3e}");
}

/// A real server on a hybrid MoE checkpoint: `/v1/info` reports the layer kinds, and the
/// answer for the 300-token sequence equals transformers at the requested indices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reports_layer_kinds_and_returns_exact_states() {
    let d = dir("qwen3_5_moe_fused");
    let limits = layertap::http::Limits { max_input_tokens: 512, max_batch_tokens: 1024, ..common::limits() };
    let (running, base) = common::real_server("tiny/qwen3_5_moe_fused", limits).await;
    let client = reqwest::Client::new();
    let info: Value = client.get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    let kinds = &info["layer_kinds"];
    assert_eq!(info["architecture"], "Qwen3_5MoeForConditionalGeneration");
    assert_eq!((kinds["linear_attention"].as_u64(), kinds["full_attention"].as_u64()), (Some(2), Some(2)), "{info}");
    assert_eq!((kinds["moe"].as_u64(), kinds["dense_mlp"].as_u64()), (Some(4), Some(0)), "{info}");
    assert_eq!((kinds["experts"].as_u64(), kinds["experts_per_token"].as_u64()), (Some(8), Some(2)), "{info}");
    assert_eq!(kinds["shared_expert"], true);

    let reference = read_safetensors(&d.join("reference.safetensors"));
    let hs = &reference["seq6.hidden_states"];
    let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
    let body =
        json!({"inputs": [{"input_ids": reference["seq6.input_ids"].i64}], "layers": [1, -1, 3], "dtype": "float32"});
    let r = client.post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let got = read_safetensors_bytes(&zstd::decode_all(&r.bytes().await.unwrap()[..]).unwrap()).0;
    let got = &got["hidden_states"];
    for (k, idx) in [1, l1 - 1, 3].into_iter().enumerate() {
        let want = &hs.f32[idx * t * h..(idx + 1) * t * h];
        let ours: Vec<f32> = (0..t).flat_map(|r| got.f32[(r * 3 + k) * h..][..h].to_vec()).collect();
        let e = rel_err(&ours, want);
        assert!(e <= 1e-5, "index {idx}: relative error {e:.3e}");
    }
    running.shutdown.cancel();
}

fn edited_copy(
    name: &str,
    edit: impl Fn(&mut Vec<common::OwnedTensor>),
    config: impl Fn(&mut Value),
) -> tempfile::TempDir {
    common::edited_fixture(&dir(name), edit, config)
}

fn load_error(d: &Path) -> String {
    match ModelFiles::locate(&d.to_string_lossy()).and_then(|f| f.load(&Device::Cpu, DType::F32).map(|_| ())) {
        Ok(()) => panic!("{} loaded", d.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_hybrid_checkpoints_are_load_errors_that_name_the_problem() {
    // A missing Gated DeltaNet tensor.
    let d = edited_copy("qwen3_5_hybrid", |t| t.retain(|x| !x.0.ends_with("layers.1.linear_attn.A_log")), |_| {});
    let e = load_error(d.path());
    assert!(e.contains("layers.1.linear_attn.A_log") && e.contains("missing"), "{e}");
    // A conv kernel of the wrong width.
    let d = edited_copy(
        "qwen3_next_per_expert",
        |t| {
            for x in t.iter_mut().filter(|x| x.0 == "model.layers.0.linear_attn.conv1d.weight") {
                let (c, k) = (x.2[0], x.2[2]);
                x.2 = vec![c, 1, k - 1];
                x.3.truncate(c * (k - 1) * 4);
            }
        },
        |_| {},
    );
    let e = load_error(d.path());
    assert!(e.contains("model.layers.0.linear_attn.conv1d.weight") && e.contains("shape"), "{e}");
    // An unknown layer type names the entry and its value.
    let d = edited_copy("qwen3_next_per_expert", |_| {}, |c| c["layer_types"][2] = json!("sliding_attention"));
    let e = load_error(d.path());
    assert!(e.contains("layer_types[2]") && e.contains("sliding_attention"), "{e}");
    // Missing experts name both layouts.
    let d = edited_copy("qwen3_moe", |t| t.retain(|x| !x.0.contains("layers.1.mlp.experts.")), |_| {});
    let e = load_error(d.path());
    assert!(e.contains("model.layers.1.mlp.experts") && e.contains("gate_up_proj"), "{e}");
    // A variant transformers does not compute the same way is refused, not approximated.
    let d = edited_copy("qwen3_5_text", |_| {}, |c| c["attn_output_gate"] = json!(false));
    let e = load_error(d.path());
    assert!(e.contains("attn_output_gate"), "{e}");
}

/// In a bf16 checkpoint whose `A_log` and gated-norm weights are stored in f32, computing in
/// bf16 keeps those tensors in f32 (they are never rounded to the compute dtype). How close
/// bf16 compute stays to the f32 reference is checked for every fixture in tests/engine.rs.
#[test]
fn f32_tensors_of_a_bf16_checkpoint_keep_their_precision() {
    use candle_core::safetensors::MmapedSafetensors;
    use layertap::engine::weights::{TensorSource, Weights};
    let file = dir("qwen3_5_moe_fused").join("model.safetensors");
    let tensors = unsafe { MmapedSafetensors::new(&file) }.unwrap();
    let name = "model.language_model.layers.0.linear_attn.A_log";
    let stored = tensors.load(name, &Device::Cpu).unwrap();
    assert_eq!(stored.dtype(), DType::F32, "the fixture stores A_log in f32");
    let bf16_weights = tensors.load("model.language_model.embed_tokens.weight", &Device::Cpu).unwrap();
    assert_eq!(bf16_weights.dtype(), DType::BF16, "the fixture stores the rest in bf16");
    let w = Weights::new(
        TensorSource::Safetensors {
            files: vec![file.clone()],
            tensors: layertap::engine::weights::Store::Files(tensors),
        },
        Device::Cpu,
        DType::BF16,
    );
    let a = w.get_f32("layers.0.linear_attn.A_log", &[stored.dim(0).unwrap()]).unwrap();
    assert_eq!(a.dtype(), DType::F32);
    assert_eq!(a.to_vec1::<f32>().unwrap(), stored.to_vec1::<f32>().unwrap());
}

/// The vision tower and the multi-token-prediction head are never read: replaced by NaN
/// tensors of the wrong shape, the checkpoint still loads and gives the reference states.
#[test]
fn vision_and_mtp_tensors_are_never_read() {
    let nan = f32::NAN.to_le_bytes().to_vec();
    let d = edited_copy(
        "qwen3_5_hybrid",
        |t| {
            let mut n = 0;
            for x in t.iter_mut().filter(|x| x.0.starts_with("model.visual.") || x.0.starts_with("mtp.")) {
                *x = (x.0.clone(), safetensors::Dtype::F32, vec![1], nan.clone());
                n += 1;
            }
            assert!(n > 20, "the fixture has a vision tower and an MTP head ({n} tensors)");
        },
        |_| {},
    );
    let mut engine = load(d.path());
    let reference = read_safetensors(&dir("qwen3_5_hybrid").join("reference.safetensors"));
    let n = engine.decoder.cfg.num_hidden_layers;
    let seq = ids(&reference, 5);
    let got = f32_of(&run(&mut engine, std::slice::from_ref(&seq), &[n]).remove(0));
    let hs = &reference["seq5.hidden_states"];
    let (t, h) = (hs.shape[1], hs.shape[2]);
    let e = rel_err(&got, &hs.f32[n * t * h..(n + 1) * t * h]);
    assert!(e <= 1e-5, "relative error {e:.3e}");
}

fn f32_of(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|&b| f32::from_bits(b)).collect()
}

/// The automatic batch budget sizes each layer kind by its own working set: a linear-attention
/// layer holds its f32 chunk matrices, a MoE layer every token's k expert rows.
#[test]
fn the_batch_budget_counts_linear_attention_and_expert_activations() {
    use layertap::engine::config::{FfnKind, LayerSpec, MixerKind};
    let files = ModelFiles::locate(&dir("qwen3_5_moe_fused").to_string_lossy()).unwrap();
    let mut cfg = files.config().clone();
    let spec = |mixer, ffn| LayerSpec { mixer, ffn };
    let attn = cfg.layer_bytes_per_token(&spec(MixerKind::FullAttention, FfnKind::Moe), 2);
    let gdn = cfg.layer_bytes_per_token(&spec(MixerKind::LinearAttention, FfnKind::Moe), 2);
    assert!(gdn > attn, "linear attention {gdn} B/token vs full attention {attn}");
    let moe = cfg.moe.clone().unwrap();
    let top2 = cfg.layer_bytes_per_token(&spec(MixerKind::LinearAttention, FfnKind::Moe), 2);
    cfg.moe = Some(layertap::engine::config::MoeConfig { experts_per_token: 8, ..moe });
    let top8 = cfg.layer_bytes_per_token(&spec(MixerKind::LinearAttention, FfnKind::Moe), 2);
    assert!(top8 > top2, "more experts per token, more activations: {top8} vs {top2}");
    // And the budget follows: a hybrid fits fewer tokens than the same shape with attention only.
    let gib = 1u64 << 30;
    let hybrid = layertap::engine::tokens_for_memory(&cfg, &Device::Cpu, DType::BF16, gib, 4096);
    cfg.layers = vec![spec(MixerKind::FullAttention, FfnKind::Moe); cfg.num_hidden_layers];
    let dense_attention = layertap::engine::tokens_for_memory(&cfg, &Device::Cpu, DType::BF16, gib, 4096);
    assert!(hybrid > 0 && hybrid < dense_attention, "{hybrid} vs {dense_attention}");
}
