//! Multi-head latent attention and DeepSeek's routing on the CPU against transformers, on the tiny
//! checkpoints of scripts/make_mla_fixtures.py (tests/fixtures/mla): DeepSeek-V3 (low-rank queries,
//! sigmoid scores with the correction bias, expert groups, YaRN with mscale, a multi-token-prediction
//! layer in the file), DeepSeek-V2-Lite's shape (a plain q_proj, softmax scores, greedy and
//! group-limited routing), GLM-4.7-Flash's (V larger than Q/K, tied head), and DeepSeek-V3.2's and
//! GLM-5's (sparse attention, on sequences up to its index_topk, where it is dense): every index within
//! 1e-5 of transformers-f32 (or twice its own distance from float64), packed sequences the same bits
//! as alone, next-token log-probabilities (also served over HTTP), `/v1/info`'s layer kinds and the
//! self-check, each feature changing the states, and the refusals: on CUDA, and every config field
//! not built. DeepSeek-V3 in its release's block-wise FP8 layout (scripts/make_mla_fp8_fixtures.py)
//! the same way, with what its reading depends on (the e4m3 rows reordered for the interleaved
//! rotation, the block scales of ragged blocks) and what it refuses.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use common::{load_cpu, read_safetensors, reference_ids, reference_sequences, rel_err, run_packed, Read};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, ModelEngine};

const F32_TOLERANCE: f64 = 1e-5;
const VARIANTS: [&str; 6] =
    ["deepseek_v3", "deepseek_v2_lite", "deepseek_v2_grouped", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"];
/// The sparse-attention variants (DeepSeek-V3.2, GLM-5: index_topk 16, sequences of at most 16
/// tokens, on which their attention is dense).
const SPARSE: [&str; 2] = ["deepseek_v32", "glm_moe_dsa"];
/// DeepSeek-V3 in its release's block-wise FP8 layout (scripts/make_mla_fp8_fixtures.py).
const FP8: &str = "deepseek_v3_fp8";

fn dir(name: &str) -> PathBuf {
    common::fixtures().join("mla").join(name)
}

fn facts(name: &str) -> serde_json::Value {
    common::reference_facts(&dir(name))
}

/// `[T, layers, H]` of each sequence, all packed in one batch.
/// The last index of the longest sequence.
fn last_state(engine: &mut ModelEngine, reference: &HashMap<String, Read>) -> Vec<f32> {
    let n = engine.decoder.cfg.num_hidden_layers;
    let last = reference_sequences(reference) - 1;
    run_packed(engine, &[reference_ids(reference, last)], &[n]).remove(0)
}

fn want_last(reference: &HashMap<String, Read>) -> Vec<f32> {
    let last = reference_sequences(reference) - 1;
    let hs = &reference[&format!("seq{last}.hidden_states")];
    let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
    hs.f32[(l1 - 1) * t * h..].to_vec()
}

/// Every index of every sequence within 1e-5 of transformers-f32 (or, where transformers-f32 is
/// itself farther than half that from its float64 run, within twice that distance); the distance
/// from the float64 run is measured too.
#[test]
fn every_index_matches_transformers() {
    for name in VARIANTS {
        every_index_within_tolerance(name);
    }
}

/// DeepSeek-V3's block-wise FP8 release layout (every linear of attention, of the dense MLP, of
/// each expert and of the shared expert in e4m3 with float32 `weight_scale_inv` per 128 x 128
/// block, ragged last row blocks in `kv_a_proj_with_mqa` and `q_b_proj`, the router in bf16, an FP8
/// multi-token-prediction layer after the decoder): read through the FP8 path, every index within
/// the same tolerance of transformers on the dequantised weights with W8A8 dynamic activations.
#[test]
fn fp8_deepseek_v3_matches_transformers_at_every_index() {
    let files = ModelFiles::locate(&dir(FP8).to_string_lossy()).unwrap();
    let loaded = files.load(&Device::Cpu, DType::F32).unwrap();
    let described = loaded.info.quantization.clone().unwrap_or_default();
    assert!(described.contains("fp8 e4m3") && described.contains("128x128"), "{described:?}");
    let facts = facts(FP8);
    let fp8 = facts["quantised_projections_of_the_decoder"].as_u64().unwrap();
    assert!(described.contains(&format!("{fp8} dequantised to f32 at load")), "{described:?} ({fp8} projections)");
    assert_eq!(facts["ragged_projections"], serde_json::json!(["kv_a_proj_with_mqa", "q_b_proj"]));
    every_index_within_tolerance(FP8);
}

fn every_index_within_tolerance(name: &str) {
    let reference = read_safetensors(&dir(name).join("reference.safetensors"));
    assert!(reference.contains_key("seq0.hidden_states_f64"), "{name}: the float64 states are in the reference");
    common::every_index_within_tolerance(&dir(name), name);
}

/// Sequences packed together give the bits they give alone.
#[test]
fn packed_sequences_equal_solo_runs_bitwise() {
    for name in VARIANTS.into_iter().chain([FP8]) {
        // The longest first, the others out of their order ([3, 0, 2, 1] for four sequences).
        let count = reference_sequences(&read_safetensors(&dir(name).join("reference.safetensors")));
        let mut order: Vec<usize> = (0..count).collect();
        order.rotate_right(1);
        order.swap(count - 2, count - 1);
        common::packed_equals_alone(&dir(name), name, &order, |n| vec![n, 0, 1, 2, n + 1]);
    }
}

/// Next-token log-probabilities of every position: transformers' top ids, their values and the
/// target's within 1e-5 (or twice transformers-f32's own distance from float64), through an
/// untied head (DeepSeek) and a tied one (GLM-4.7-Flash's fixture).
#[test]
fn log_probabilities_match_transformers() {
    for name in VARIANTS.into_iter().chain([FP8]) {
        let d = dir(name);
        let reference = read_safetensors(&d.join("reference.safetensors"));
        let allowed = F32_TOLERANCE.max(2.0 * facts(name)["logprobs_f32_vs_f64_max_abs"].as_f64().unwrap());
        let files = ModelFiles::locate(&d.to_string_lossy()).unwrap();
        assert_eq!(files.config().tie_word_embeddings, name == "glm4_moe_lite");
        let loaded = files.load(&Device::Cpu, DType::F32).unwrap();
        assert!(loaded.info.lm_head, "{name}: a head for log-probabilities");
        let mut engine = loaded.engine;
        let worst = common::logprob_error(&mut engine, &reference, name);
        println!("{name}: largest log-probability error {worst:.2e} (allowed {allowed:.1e})");
        assert!(worst <= allowed, "{name}: log-probabilities off by {worst:.3e}");
    }
}

/// `/v1/info`'s layer kinds, and the start-up self-check in f32 and bf16.
#[test]
fn info_and_selfcheck() {
    for name in VARIANTS {
        let files = ModelFiles::locate(&dir(name).to_string_lossy()).unwrap();
        let loaded = files.load(&Device::Cpu, DType::F32).unwrap();
        let k = &loaded.info.layer_kinds;
        assert_eq!((k.full_attention, k.latent_attention, k.linear_attention), (0, 3, 0), "{name}: {k:?}");
        assert_eq!(
            (k.dense_mlp, k.moe, k.experts, k.experts_per_token, k.shared_expert),
            (1, 2, Some(8), Some(3), true),
            "{name}"
        );
        assert_eq!(loaded.info.quantization, None);
        let probe = common::selfcheck_passes_on_cpu(&files, loaded.engine, name);
        assert!(probe.routed && !probe.fp8);
    }
}

/// The FP8 checkpoint's layer kinds and quantisation in `/v1/info`, and the start-up self-check in
/// f32 and bf16.
#[test]
fn fp8_info_and_selfcheck() {
    let files = ModelFiles::locate(&dir(FP8).to_string_lossy()).unwrap();
    let loaded = files.load(&Device::Cpu, DType::F32).unwrap();
    let k = &loaded.info.layer_kinds;
    assert_eq!((k.latent_attention, k.dense_mlp, k.moe, k.experts), (2, 1, 1, Some(8)), "{k:?}");
    let probe = common::selfcheck_passes_on_cpu(&files, loaded.engine, FP8);
    assert!(probe.routed && probe.fp8);
}

/// What the FP8 checkpoint's reading depends on: the interleaved rotation's reordering of the e4m3
/// rows, the block scales (the ragged last row block's included), the activations' quantisation
/// groups; and what is refused: an FP8 weight without its scale, `--quantize fp8` (latent
/// attention's projections are not among those it quantises), and a CUDA device.
#[test]
fn fp8_features_matter_and_what_is_not_built_is_refused() {
    let reference = read_safetensors(&dir(FP8).join("reference.safetensors"));
    let want = want_last(&reference);
    let e = rel_err(&last_state(&mut load_cpu(&dir(FP8), DType::F32), &reference), &want);
    assert!(e <= F32_TOLERANCE, "{e:.1e} unedited");
    let model = format!("mla/{FP8}");
    let copy = common::with_config(&model, |c| c["rope_interleave"] = false.into());
    let e = rel_err(&last_state(&mut load_cpu(copy.path(), DType::F32), &reference), &want);
    assert!(e > 1e-3, "rope_interleave moves the last state by only {e:.1e}");
    // The ragged last row blocks of kv_a_proj_with_mqa (the rotated key rows) and q_b_proj (two
    // heads), and o_proj's one block: their scales doubled in every decoder layer.
    let n = facts(FP8)["num_hidden_layers"].as_u64().unwrap() as usize;
    let mtp = format!(".layers.{n}.");
    let scaled = |suffix: &'static str, rows: std::ops::Range<usize>| {
        let mtp = mtp.clone();
        move |tensors: &mut Vec<common::OwnedTensor>| {
            let mut hit = 0;
            for (name, dtype, shape, data) in tensors.iter_mut() {
                if name.ends_with(suffix) && !name.contains(&mtp) {
                    assert_eq!(format!("{dtype:?}"), "F32");
                    let cols = shape[1];
                    for v in data.chunks_mut(4).skip(rows.start * cols).take((rows.end - rows.start) * cols) {
                        let x = 2.0 * f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
                        v.copy_from_slice(&x.to_le_bytes());
                    }
                    hit += 1;
                }
            }
            assert_eq!(hit, n, "{suffix} in every decoder layer");
        }
    };
    for (suffix, rows) in [
        ("kv_a_proj_with_mqa.weight_scale_inv", 1..2),
        ("q_b_proj.weight_scale_inv", 1..2),
        ("o_proj.weight_scale_inv", 0..1),
    ] {
        let copy = common::with_tensors(&model, scaled(suffix, rows.clone()));
        let e = rel_err(&last_state(&mut load_cpu(copy.path(), DType::F32), &reference), &want);
        assert!(e > 1e-3, "{suffix} rows {rows:?} doubled move the last state by only {e:.1e}");
    }
    let copy = common::with_tensors(&model, |t| {
        t.retain(|(n, ..)| n != "model.layers.1.self_attn.kv_b_proj.weight_scale_inv")
    });
    let e = common::refusal(copy.path()).expect("an FP8 weight without its scale");
    assert!(e.contains("kv_b_proj.weight") && e.contains("has no"), "{e}");
    let files = ModelFiles::locate(&dir(FP8).to_string_lossy()).unwrap();
    let needs = files.config().needs_beyond_cuda();
    assert!(needs.iter().any(|n| n.contains("multi-head latent attention")), "{needs:?}");
    let bf16 = ModelFiles::locate(&dir("deepseek_v3").to_string_lossy()).unwrap();
    let e = bf16.quantize(Some(layertap::engine::config::quant::Quantize::Fp8)).err().expect("--quantize fp8");
    assert!(e.to_string().contains("--quantize fp8 does not quantise DeepseekV3ForCausalLM"), "{e}");
}

type Edit<'a> = (&'a str, &'a dyn Fn(&mut serde_json::Value));

/// Each routing option, the interleaved rotation, YaRN's mscale in the softmax scale and each
/// random tensor kind change the last state: a checkpoint read without any of them would fail the
/// fidelity test.
#[test]
fn each_feature_of_the_families_matters() {
    let config_edits: [(&str, Vec<Edit>); 3] = [
        (
            "deepseek_v3",
            vec![
                ("routed_scaling_factor", &|c| c["routed_scaling_factor"] = 1.0.into()),
                ("groups", &|c| c["topk_group"] = 4.into()),
                ("norm_topk_prob", &|c| c["norm_topk_prob"] = false.into()),
                ("rope_interleave", &|c| c["rope_interleave"] = false.into()),
                ("mscale_all_dim in the softmax scale", &|c| {
                    // Kept in the rotary tables' factor (given explicitly), gone from the scale.
                    let p = &mut c["rope_parameters"];
                    let (f, m, all) = (4f64, 1.0, 0.8);
                    let get = |s: f64| 0.1 * s * f.ln() + 1.0;
                    p["attention_factor"] = (get(m) / get(all)).into();
                    p["mscale_all_dim"] = 0.0.into();
                }),
            ],
        ),
        (
            "deepseek_v2_grouped",
            vec![
                ("topk_method", &|c| c["topk_method"] = "greedy".into()),
                ("routed_scaling_factor", &|c| c["routed_scaling_factor"] = 1.0.into()),
            ],
        ),
        ("glm4_moe_lite", vec![("groups", &|c| c["topk_group"] = 2.into())]),
    ];
    for (name, edits) in config_edits {
        let reference = read_safetensors(&dir(name).join("reference.safetensors"));
        let want = want_last(&reference);
        let e = rel_err(&last_state(&mut load_cpu(&dir(name), DType::F32), &reference), &want);
        assert!(e <= F32_TOLERANCE, "{name}: {e:.1e} unedited");
        for (what, edit) in edits {
            let copy = common::with_config(&format!("mla/{name}"), edit);
            let e = rel_err(&last_state(&mut load_cpu(copy.path(), DType::F32), &reference), &want);
            assert!(e > 1e-3, "{name}: changing {what} moves the last state by only {e:.1e}");
        }
    }
    // The dense first layer: read as a mixture of experts, its tensors are missing.
    let copy = common::with_config("mla/deepseek_v3", |c| c["first_k_dense_replace"] = 0.into());
    let e = common::refusal(copy.path()).expect("layer 0 read as experts");
    assert!(e.contains("layers.0.mlp.gate.weight") && e.contains("missing"), "{e}");
    let set = |suffix: &'static str, value: f32| {
        move |tensors: &mut Vec<common::OwnedTensor>| {
            let mut hit = false;
            for (name, dtype, _, data) in tensors.iter_mut() {
                if name.ends_with(suffix) {
                    assert_eq!(format!("{dtype:?}"), "BF16");
                    let bits = half::bf16::from_f32(value).to_bits().to_le_bytes();
                    data.chunks_mut(2).for_each(|b| b.copy_from_slice(&bits));
                    hit = true;
                }
            }
            assert!(hit, "no tensor ends with {suffix}");
        }
    };
    let tensors: [(&str, &str, f32); 6] = [
        ("deepseek_v3", "gate.e_score_correction_bias", 0.0),
        ("deepseek_v3", "q_a_layernorm.weight", 1.0),
        ("deepseek_v3", "kv_a_layernorm.weight", 1.0),
        ("deepseek_v3", "shared_experts.down_proj.weight", 0.0),
        ("deepseek_v2_lite", "shared_experts.up_proj.weight", 0.0),
        ("glm4_moe_lite", "gate.e_score_correction_bias", 0.0),
    ];
    for (name, suffix, value) in tensors {
        let reference = read_safetensors(&dir(name).join("reference.safetensors"));
        let copy = common::with_tensors(&format!("mla/{name}"), set(suffix, value));
        let e = rel_err(&last_state(&mut load_cpu(copy.path(), DType::F32), &reference), &want_last(&reference));
        assert!(e > 1e-3, "{name}: {suffix} set to {value} moves the last state by only {e:.1e}");
    }
}

/// The multi-token-prediction layer DeepSeek-V3's file holds after the decoder is read only as
/// such: with `num_nextn_predict_layers` 0 the file is refused (a layer past the decoder).
#[test]
fn the_mtp_layer_is_ignored_only_where_the_config_declares_it() {
    let files = ModelFiles::locate(&dir("deepseek_v3").to_string_lossy()).unwrap();
    assert_eq!(files.config().mtp_layers, 1);
    let copy = common::with_config("mla/deepseek_v3", |c| c["num_nextn_predict_layers"] = 0.into());
    let e = common::refusal(copy.path()).expect("an undeclared layer past the decoder");
    assert!(e.contains("past the 3"), "{e}");
}

/// Every config field the engine does not build is refused by name, and the families are refused
/// on a CUDA device naming what the GPU paths lack.
#[test]
fn what_is_not_built_is_refused() {
    let cases: [(&str, Edit, &str); 15] = [
        ("deepseek_v32", ("", &|c| c["rope_interleave"] = false.into()), "rope_interleave"),
        ("glm_moe_dsa", ("", &|c| c["q_lora_rank"] = serde_json::Value::Null), "q_lora_rank"),
        ("glm_moe_dsa", ("", &|c| c["first_k_dense_replace"] = 3.into()), "first_k_dense_replace"),
        ("deepseek_v3", ("", &|c| c["num_key_value_heads"] = 2.into()), "num_key_value_heads"),
        ("deepseek_v2_lite", ("", &|c| c["norm_topk_prob"] = true.into()), "norm_topk_prob"),
        ("deepseek_v2_lite", ("", &|c| c["topk_method"] = "noaux_tc".into()), "topk_method"),
        ("deepseek_v2_lite", ("", &|c| c["rope_interleave"] = false.into()), "rope_interleave"),
        ("deepseek_v3", ("", &|c| c["scoring_func"] = "softmax".into()), "scoring_func"),
        ("deepseek_v3", ("", &|c| c["topk_method"] = "group_limited_greedy".into()), "topk_method"),
        ("deepseek_v3", ("", &|c| c["attention_bias"] = true.into()), "attention_bias"),
        ("deepseek_v3", ("", &|c| c["moe_layer_freq"] = 2.into()), "moe_layer_freq"),
        ("deepseek_v3", ("", &|c| c["rope_parameters"]["partial_rotary_factor"] = 0.5.into()), "partial_rotary_factor"),
        ("deepseek_v3", ("", &|c| c["topk_group"] = 1.into()), "num_experts_per_tok"),
        ("glm4_moe_lite", ("", &|c| c["first_k_dense_replace"] = 2.into()), "first_k_dense_replace"),
        ("glm4_moe_lite", ("", &|c| c["hidden_act"] = "gelu".into()), "hidden_act"),
    ];
    for (name, (_, edit), field) in cases {
        let copy = common::with_config(&format!("mla/{name}"), edit);
        let e = common::refusal(copy.path()).unwrap_or_else(|| panic!("{name}: {field} not refused"));
        assert!(e.contains(field), "{name}: {e}");
    }
    for name in VARIANTS {
        let files = ModelFiles::locate(&dir(name).to_string_lossy()).unwrap();
        let needs = files.config().needs_beyond_cuda();
        for what in ["multi-head latent attention", "DeepSeek's routing", "ungated shared experts"] {
            assert!(needs.iter().any(|n| n.contains(what)), "{name}: {what} not named in {needs:?}");
        }
    }
}

/// DeepSeek-V3.2's and GLM-5's sparse attention keeps every causal key of a query that has at most
/// index_topk of them, so it is dense attention on sequences of at most index_topk tokens (the
/// fidelity tests above, up to 16 tokens): the indexer's weights are read for their shapes only
/// (zeroed, they change no bit; of another shape, they are refused), GLM-5's layers that share
/// another's selection store none, and a longer sequence is refused by the engine, naming why.
#[test]
fn sparse_attention_is_dense_up_to_index_topk_and_longer_sequences_are_refused() {
    for name in SPARSE {
        let d = dir(name);
        let files = ModelFiles::locate(&d.to_string_lossy()).unwrap();
        let (max, why) = files.config().max_sequence_tokens().expect("a sequence limit");
        assert_eq!(max, 16, "{name}");
        assert!(why.contains("index_topk = 16"), "{why}");
        let lengths = facts(name)["lengths"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).max();
        assert_eq!(lengths, Some(16), "{name}: the references reach index_topk");
        let reference = read_safetensors(&d.join("reference.safetensors"));
        let mut engine = load_cpu(&d, DType::F32);
        let got = last_state(&mut engine, &reference);
        let e = rel_err(&got, &want_last(&reference));
        assert!(e <= F32_TOLERANCE, "{name}: {e:.1e}");
        let long: Vec<u32> = (0..17).collect();
        let short: Vec<u32> = (0..16).collect();
        for seqs in [vec![&long[..]], vec![&short[..], &long[..]]] {
            let e = engine.forward(&Batch::pack(seqs, [0])).err().expect("17 tokens refused").to_string();
            assert!(e.contains("a sequence of 17 tokens is refused") && e.contains("index_topk = 16"), "{e}");
        }
        assert!(engine.forward(&Batch::pack([&short[..], &short[..]], [0])).is_ok(), "two of 16 tokens");
        let zeroed = common::with_tensors(&format!("mla/{name}"), |tensors| {
            let mut hit = 0;
            for (n, _, _, data) in tensors.iter_mut().filter(|(n, ..)| n.contains(".indexer.")) {
                assert!(!n.contains(".layers.1.") || name != "glm_moe_dsa", "{n}: a shared layer's indexer");
                data.fill(0);
                hit += 1;
            }
            assert_eq!(hit, if name == "glm_moe_dsa" { 10 } else { 15 }, "{name}: indexer tensors");
        });
        let again = last_state(&mut load_cpu(zeroed.path(), DType::F32), &reference);
        assert!(got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: the indexer was read");
        let wider = common::with_config(&format!("mla/{name}"), |c| c["index_n_heads"] = 4.into());
        let e = common::refusal(wider.path()).expect("indexer weights of another shape");
        assert!(e.contains("indexer.wq_b.weight"), "{e}");
    }
}

/// Over HTTP, an input longer than GLM-5's index_topk is refused (413) naming why, and one of
/// index_topk tokens is answered with transformers' states.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_inputs_longer_than_index_topk() {
    use serde_json::{json, Value};
    let limits = layertap::http::Limits { max_input_tokens: 512, max_batch_tokens: 1024, ..common::limits() };
    let (running, base) = common::real_server("mla/glm_moe_dsa", limits).await;
    let client = reqwest::Client::new();
    let info: Value = client.get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    assert_eq!(info["architecture"], "GlmMoeDsaForCausalLM");
    assert_eq!(info["max_input_tokens"], 16, "/v1/info gives the model's own limit where it is the lower");
    let ids: Vec<u32> = (0..17).collect();
    let body = json!({"inputs": [{"input_ids": ids}], "layers": [1], "dtype": "float32"});
    let r = client.post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
    let (status, _, message) = common::error_of(r).await;
    assert_eq!(status, 413, "{message}");
    assert!(message.contains("inputs[0] has 17 tokens") && message.contains("index_topk = 16"), "{message}");
    let reference = read_safetensors(&dir("glm_moe_dsa").join("reference.safetensors"));
    let last = reference_sequences(&reference) - 1;
    let hs = &reference[&format!("seq{last}.hidden_states")];
    let (t, h) = (hs.shape[1], hs.shape[2]);
    assert_eq!(t, 16);
    let body = json!({"inputs": [{"input_ids": reference[&format!("seq{last}.input_ids")].i64}], "layers": [2],
                      "dtype": "float32"});
    let r = client.post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let got = common::read_safetensors_bytes(&zstd::decode_all(&r.bytes().await.unwrap()[..]).unwrap()).0;
    let e = rel_err(&got["hidden_states"].f32, &hs.f32[2 * t * h..3 * t * h]);
    assert!(e <= F32_TOLERANCE, "index 2: relative error {e:.3e}");
    running.shutdown.cancel();
}

/// A real server on DeepSeek-V3's fixture: `/v1/info` reports the latent-attention layers, and the
/// answer for the longest sequence equals transformers at the indices asked, with its
/// log-probabilities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reports_layer_kinds_and_returns_exact_states_and_logprobs() {
    use serde_json::{json, Value};
    let d = dir("deepseek_v3");
    let limits = layertap::http::Limits { max_input_tokens: 512, max_batch_tokens: 1024, ..common::limits() };
    let (running, base) = common::real_server("mla/deepseek_v3", limits).await;
    let client = reqwest::Client::new();
    let info: Value = client.get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    let kinds = &info["layer_kinds"];
    assert_eq!(info["architecture"], "DeepseekV3ForCausalLM");
    assert_eq!((kinds["latent_attention"].as_u64(), kinds["full_attention"].as_u64()), (Some(3), Some(0)), "{info}");
    assert_eq!((kinds["moe"].as_u64(), kinds["dense_mlp"].as_u64()), (Some(2), Some(1)), "{info}");

    let reference = read_safetensors(&d.join("reference.safetensors"));
    let last = reference_sequences(&reference) - 1;
    let hs = &reference[&format!("seq{last}.hidden_states")];
    let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
    let body = json!({"inputs": [{"input_ids": reference[&format!("seq{last}.input_ids")].i64}], "layers": [1, -1, 2],
                      "dtype": "float32", "logprobs": {"top_k": 5, "target": true}});
    let r = client.post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let got = common::read_safetensors_bytes(&zstd::decode_all(&r.bytes().await.unwrap()[..]).unwrap()).0;
    let states = &got["hidden_states"];
    for (k, idx) in [1, l1 - 1, 2].into_iter().enumerate() {
        let want = &hs.f32[idx * t * h..(idx + 1) * t * h];
        let ours: Vec<f32> = (0..t).flat_map(|r| states.f32[(r * 3 + k) * h..][..h].to_vec()).collect();
        let e = rel_err(&ours, want);
        assert!(e <= F32_TOLERANCE, "index {idx}: relative error {e:.3e}");
    }
    assert_eq!(got["topk_ids"].i64, reference[&format!("seq{last}.logprob_ids")].i64);
    let worst = got["topk_logprobs"]
        .f32
        .iter()
        .zip(&reference[&format!("seq{last}.logprobs")].f32)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(f64::from(worst) <= F32_TOLERANCE, "log-probabilities off by {worst:e}");
    running.shutdown.cancel();
}
