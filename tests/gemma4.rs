//! Gemma 4 (`Gemma4ForCausalLM`, and the text decoder of `Gemma4ForConditionalGeneration`) on the
//! CPU against transformers, on the tiny checkpoints of scripts/make_gemma4_fixtures.py
//! (tests/fixtures/gemma4): a dense release, one with `attention_k_eq_v` and the experts beside
//! the MLP, and one shaped as E2B and E4B (per-layer embeddings, key-value sharing, the
//! double-wide MLP of the sharing layers), every index within 1e-5 of transformers-f32 (or twice
//! its own distance from float64), packed sequences the same bits as alone, next-token
//! log-probabilities through the softcapped head, `/v1/info`'s layer kinds and the self-check,
//! each feature moving the states, the config forms read alike, and the refusals: what is not
//! built (bidirectional attention, sharing with no layer to share from), other rotary types, a
//! CUDA device.

mod common;

use std::path::PathBuf;

use common::{fixtures, load_cpu, read_safetensors, reference_ids, rel_err, run_packed};
use layertap::engine::config::{FfnKind, MixerKind, ModelConfig};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{DType, Device, ModelEngine};

const F32_TOLERANCE: f64 = 1e-5;
const VARIANTS: [&str; 3] = ["gemma4_dense", "gemma4_moe", "gemma4_e2b"];

fn dir(name: &str) -> PathBuf {
    fixtures().join("gemma4").join(name)
}

fn facts(name: &str) -> serde_json::Value {
    common::reference_facts(&dir(name))
}

/// An edit of a config.json.
type ConfigEdit = fn(&mut serde_json::Value);

/// The decoder's fields of a config.json: `text_config` where the model nests them.
fn text(c: &mut serde_json::Value) -> &mut serde_json::Value {
    if c.get("text_config").is_some() {
        &mut c["text_config"]
    } else {
        c
    }
}

/// `[T, layers, H]` of each sequence, all packed in one batch.
/// Every index of every sequence within 1e-5 of transformers-f32 (or, where transformers-f32 is
/// itself farther than half that from its float64 run, within twice that distance), and the last
/// layer's output before the final norm held to the last index's bound.
#[test]
fn every_index_matches_transformers() {
    for name in VARIANTS {
        common::every_index_within_tolerance(&dir(name), name);
    }
}

/// Sequences packed together (short and long, across the window) give the bits they give alone.
#[test]
fn packed_sequences_equal_solo_runs_bitwise() {
    for name in VARIANTS {
        common::packed_equals_alone(&dir(name), name, &[5, 3, 0, 4, 2, 1], |n| vec![n, 0, 1, 3, n + 1]);
    }
}

/// Next-token log-probabilities of every position: transformers' top ids, their values and the
/// target's within 1e-5 (or twice transformers-f32's own distance from float64), through the
/// tied head with the final-logit softcapping; without the cap they are far off.
#[test]
fn log_probabilities_match_transformers_through_the_softcap() {
    for name in VARIANTS {
        let d = dir(name);
        let reference = read_safetensors(&d.join("reference.safetensors"));
        let f = facts(name);
        let allowed = F32_TOLERANCE.max(2.0 * f["logprobs_f32_vs_f64_max_abs"].as_f64().unwrap());
        assert!(f["largest_logit_over_cap"].as_f64().unwrap() > 1.5, "the cap bites");
        let files = ModelFiles::locate(&d.to_string_lossy()).unwrap();
        assert!(files.config().tie_word_embeddings);
        assert_eq!(files.config().final_logit_softcapping, Some(5.0));
        let loaded = files.load(&Device::Cpu, DType::F32).unwrap();
        assert!(loaded.info.lm_head, "{name}: a head for log-probabilities");
        let mut engine = loaded.engine;
        let worst = common::logprob_error(&mut engine, &reference, name);
        println!("{name}: largest log-probability error {worst:.2e} (allowed {allowed:.1e})");
        assert!(worst <= allowed, "{name}: log-probabilities off by {worst:.3e}");
        let uncapped = common::with_config(&format!("gemma4/{name}"), |c| {
            text(c)["final_logit_softcapping"] = serde_json::Value::Null;
        });
        let e = common::logprob_error(&mut load_cpu(uncapped.path(), DType::F32), &reference, name);
        assert!(e > 1e-2, "{name}: without the cap the log-probabilities move by only {e:.1e}");
    }
}

/// `/v1/info`'s layer kinds, and the start-up self-check in f32 and bf16.
#[test]
fn info_and_selfcheck() {
    for name in VARIANTS {
        let files = ModelFiles::locate(&dir(name).to_string_lossy()).unwrap();
        let loaded = files.load(&Device::Cpu, DType::F32).unwrap();
        let k = &loaded.info.layer_kinds;
        assert_eq!((k.full_attention, k.sliding_attention, k.linear_attention), (2, 4, 0), "{k:?}");
        let moe = name == "gemma4_moe";
        assert_eq!(
            (k.dense_mlp, k.moe, k.experts, k.experts_per_token, k.shared_expert),
            if moe { (6, 6, Some(6), Some(3), false) } else { (6, 0, None, None, false) }
        );
        let probe = common::selfcheck_passes_on_cpu(&files, loaded.engine, name);
        assert_eq!(probe.routed, moe);
    }
}

/// The window, the proportional rotary of the full layers, the default rotary's theta on the
/// sliding ones, the number of experts per token, and the per-layer scalars, the router's scales
/// and the norms' weights each change the states: a decoder without them would not pass the
/// fidelity test.
#[test]
fn each_feature_of_the_family_matters() {
    for name in VARIANTS {
        let d = dir(name);
        let model = format!("gemma4/{name}");
        let reference = read_safetensors(&d.join("reference.safetensors"));
        let seq = reference_ids(&reference, 5);
        let base = load_cpu(&d, DType::F32);
        let n = base.decoder.cfg.num_hidden_layers;
        let hs = &reference["seq5.hidden_states"];
        let want = &hs.f32[n * hs.shape[1] * hs.shape[2]..];
        let last = |engine: &mut ModelEngine| run_packed(engine, std::slice::from_ref(&seq), &[n]).remove(0);
        let mut edits: Vec<(&str, ConfigEdit)> = vec![
            ("window", |c| text(c)["sliding_window"] = 100_000.into()),
            ("proportional rotary", |c| {
                text(c)["rope_parameters"]["full_attention"]["partial_rotary_factor"] = 1.0.into()
            }),
            ("sliding rotary theta", |c| text(c)["rope_parameters"]["sliding_attention"]["rope_theta"] = 1000.0.into()),
        ];
        if name == "gemma4_moe" {
            edits.push(("top-k", |c| text(c)["top_k_experts"] = 2.into()));
        }
        for (what, edit) in edits {
            let copy = common::with_config(&model, edit);
            let got = last(&mut load_cpu(copy.path(), DType::F32));
            let e = rel_err(&got, want);
            assert!(e > 1e-3, "{name} {what}: changing it moves the last state by only {e:.1e}");
        }
        // bf16 1.0 in place of each of these tensors' values.
        let one = |suffix: &'static str| {
            move |tensors: &mut Vec<common::OwnedTensor>| {
                for (name, _, _, data) in tensors.iter_mut() {
                    if name.ends_with(suffix) {
                        data.chunks_mut(2).for_each(|b| b.copy_from_slice(&[0x80, 0x3F]));
                    }
                }
            }
        };
        let mut ones = vec!["layer_scalar", "post_attention_layernorm.weight", "post_feedforward_layernorm.weight"];
        if name == "gemma4_moe" {
            ones.extend(["router.scale", "router.per_expert_scale", "post_feedforward_layernorm_2.weight"]);
        }
        if name == "gemma4_e2b" {
            ones.extend(["per_layer_projection_norm.weight", "post_per_layer_input_norm.weight"]);
        }
        for suffix in ones {
            let copy = common::with_tensors(&model, one(suffix));
            let got = last(&mut load_cpu(copy.path(), DType::F32));
            let e = rel_err(&got, want);
            assert!(e > 1e-3, "{name}: {suffix} set to 1 moves the last state by only {e:.1e}");
        }
    }
}

/// The config as read: layer kinds, the full layers' own shape; transformers' defaults where
/// `rope_parameters` is absent; the released form (`global_head_dim`,
/// `num_global_key_value_heads`, no `per_layer_config`) reads as the written one.
#[test]
fn the_config_forms_read_alike() {
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(dir(name).join("config.json")).unwrap()).unwrap()
    };
    let moe = read("gemma4_moe");
    let cfg = ModelConfig::from_hf_json(&moe).unwrap();
    let kinds: Vec<MixerKind> = cfg.layers.iter().map(|l| l.mixer).collect();
    use MixerKind::{FullAttention as F, SlidingAttention as S};
    assert_eq!(kinds, vec![S, S, F, S, S, F]);
    assert!(cfg.layers.iter().all(|l| l.ffn == FfnKind::DenseAndMoe));
    let full = cfg.full_attention.clone().unwrap();
    assert_eq!((full.head_dim, full.num_key_value_heads, full.k_eq_v, full.rotated_pairs), (32, 1, true, 4));
    assert_eq!((cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window), (16, 2, Some(12)));
    assert_eq!((cfg.rope_theta, full.rope_theta), (10_000.0, 1_000_000.0));
    assert_eq!(cfg.embed_scale, Some(48f64.sqrt()));
    let mut released = moe.clone();
    let text = released["text_config"].as_object_mut().unwrap();
    text.remove("per_layer_config");
    text.insert("global_head_dim".into(), 32.into());
    text.insert("num_global_key_value_heads".into(), 1.into());
    assert_eq!(ModelConfig::from_hf_json(&released).unwrap().full_attention, Some(full.clone()));
    // No rope_parameters: transformers' defaults, the same as written here.
    released["text_config"].as_object_mut().unwrap().remove("rope_parameters");
    assert_eq!(ModelConfig::from_hf_json(&released).unwrap().full_attention, Some(full));
    let dense = ModelConfig::from_hf_json(&read("gemma4_dense")).unwrap();
    let f = dense.full_attention.unwrap();
    assert_eq!((f.head_dim, f.num_key_value_heads, f.k_eq_v), (32, 2, false));
    assert!(dense.moe.is_none() && dense.layers.iter().all(|l| l.ffn == FfnKind::Dense));
}

/// Refused by name: bidirectional attention, other rotary types and activations, key-value
/// sharing that leaves no layer (or no layer of a kind) to share from, a per-layer table shorter
/// than the vocabulary, `--quantize fp8`; and on a CUDA device, the features its kernels lack.
#[test]
fn what_is_not_built_is_refused() {
    type Edit = (&'static str, ConfigEdit, &'static str);
    let edits: [Edit; 5] = [
        ("bidirectional", |c| c["use_bidirectional_attention"] = "all".into(), "use_bidirectional_attention"),
        (
            "yarn",
            |c| c["rope_parameters"]["full_attention"]["rope_type"] = "yarn".into(),
            "rope_parameters.full_attention.rope_type \"yarn\"",
        ),
        ("activation", |c| c["hidden_activation"] = "silu".into(), "hidden_activation \"silu\""),
        ("every layer sharing", |c| c["num_kv_shared_layers"] = 6.into(), "num_kv_shared_layers 6 of 6 layers"),
        (
            "a full layer sharing with no full layer before it",
            |c| {
                c["layer_types"] = serde_json::json!(vec!["sliding_attention"; 6]);
                c["per_layer_config"].as_object_mut().unwrap().remove("2");
                c["num_kv_shared_layers"] = 1.into();
            },
            "num_kv_shared_layers 1 (layer 5, FullAttention, has no earlier layer of its kind",
        ),
    ];
    for (what, edit, named) in edits {
        let copy = common::with_config("gemma4/gemma4_dense", edit);
        let e = common::refusal(copy.path()).unwrap_or_else(|| panic!("{what}: not refused"));
        assert!(e.contains(named) && e.contains("Gemma4ForCausalLM"), "{what}: {e}");
    }
    let copy = common::with_config("gemma4/gemma4_e2b", |c| text(c)["vocab_size_per_layer_input"] = 100.into());
    let e = common::refusal(copy.path()).expect("a short per-layer table");
    assert!(e.contains("vocab_size_per_layer_input 100 is below vocab_size 512"), "{e}");
    // Per-layer embeddings are on by default in transformers' config: a config that leaves the
    // field out asks for a table of 256 per layer, which a checkpoint without one lacks.
    let copy = common::with_config("gemma4/gemma4_moe", |c| {
        c["text_config"].as_object_mut().unwrap().remove("hidden_size_per_layer_input");
    });
    let cfg = ModelFiles::locate(&copy.path().to_string_lossy()).unwrap().config().clone();
    assert_eq!(cfg.per_layer_inputs.map(|p| p.width), Some(256));
    let e = common::refusal(copy.path()).expect("per-layer embeddings by default");
    assert!(e.contains("per_layer") && e.contains("is missing"), "{e}");
    // null (or 0) is none, as in transformers ...
    let copy = common::with_config("gemma4/gemma4_moe", |c| {
        c["text_config"]["hidden_size_per_layer_input"] = serde_json::Value::Null;
    });
    assert_eq!(common::refusal(copy.path()), None);
    // ... and a checkpoint with per-layer tensors that its config turns off is refused, not run
    // without them.
    let copy = common::with_config("gemma4/gemma4_e2b", |c| text(c)["hidden_size_per_layer_input"] = 0.into());
    let e = common::refusal(copy.path()).expect("per-layer tensors unread");
    assert!(e.contains("per_layer") && e.contains("is not a parameter of the model"), "{e}");
    for name in VARIANTS {
        let files = ModelFiles::locate(&dir(name).to_string_lossy()).unwrap();
        let needs = files.config().needs_beyond_cuda();
        for what in ["own head size", "value norm", "sandwich norms", "embedding scale", "GELU-tanh", "softcapping"] {
            assert!(needs.iter().any(|n| n.contains(what)), "{name}: {what} not named in {needs:?}");
        }
        if name == "gemma4_moe" {
            for what in ["dense MLP beside the experts", "normed, scaled router"] {
                assert!(needs.iter().any(|n| n.contains(what)), "{name}: {what} not named in {needs:?}");
            }
        }
        let e2b = ["per-layer embeddings", "key-value sharing"];
        for what in e2b {
            let named = needs.iter().any(|n| n.contains(what));
            assert_eq!(named, name == "gemma4_e2b", "{name}: {what} in {needs:?}");
        }
        let e = files.quantize(Some(layertap::engine::config::quant::Quantize::Fp8)).err().expect("fp8").to_string();
        assert!(e.contains("--quantize fp8 does not quantise"), "{e}");
    }
}

/// E2B's shape as read: the last three layers reuse the keys and values of the last earlier
/// layer of their kind (layer 1 for the sliding ones, layer 2 for the full one), their MLPs twice
/// as wide; per-layer inputs of 16 with transformers' scales.
#[test]
fn the_e2b_config_reads_as_transformers_builds_it() {
    let files = ModelFiles::locate(&dir("gemma4_e2b").to_string_lossy()).unwrap();
    let cfg = files.config();
    assert_eq!(cfg.kv_sources, vec![None, None, None, Some(1), Some(1), Some(2)]);
    assert_eq!(
        facts("gemma4_e2b")["kv_sharing_modes"],
        serde_json::json!([null, "store", "store", "reuse", "reuse", "reuse"])
    );
    assert_eq!(cfg.mlp_widths, vec![64, 64, 64, 128, 128, 128]);
    let p = cfg.per_layer_inputs.clone().unwrap();
    assert_eq!((p.width, p.vocab_size, p.layers), (16, 512, 6));
    assert_eq!((p.embed_scale, p.projection_scale, p.combine_scale), (4.0, 48f64.powf(-0.5), 2f64.powf(-0.5)));
    // Without use_double_wide_mlp the sharing layers keep the others' width (and this
    // checkpoint's wider MLPs no longer fit).
    let copy = common::with_config("gemma4/gemma4_e2b", |c| text(c)["use_double_wide_mlp"] = false.into());
    assert!(ModelFiles::locate(&copy.path().to_string_lossy()).unwrap().config().mlp_widths.is_empty());
    let e = common::refusal(copy.path()).expect("the wider MLPs");
    assert!(e.contains("layers.3.mlp") && e.contains("[128, 48]"), "{e}");
}

/// Checkpoints may still hold the key and value projections and norms of the layers that reuse
/// another's (transformers drops them on load): they are never read, NaN or not.
#[test]
fn the_sharing_layers_own_keys_and_values_are_never_read() {
    let nan_bf16 = |n: usize| [0xC0u8, 0x7F].repeat(n);
    let copy = common::with_tensors("gemma4/gemma4_e2b", |t| {
        for i in 3..6 {
            let hd = if i == 5 { 32 } else { 16 };
            let p = format!("model.language_model.layers.{i}.self_attn");
            for (part, shape) in [("k_proj", vec![2 * hd, 48]), ("v_proj", vec![2 * hd, 48]), ("k_norm", vec![hd])] {
                let n = shape.iter().product();
                t.push((format!("{p}.{part}.weight"), safetensors::Dtype::BF16, shape, nan_bf16(n)));
            }
        }
    });
    let reference = read_safetensors(&dir("gemma4_e2b").join("reference.safetensors"));
    let mut engine = load_cpu(copy.path(), DType::F32);
    let n = engine.decoder.cfg.num_hidden_layers;
    let got = run_packed(&mut engine, &[reference_ids(&reference, 5)], &[n]).remove(0);
    let hs = &reference["seq5.hidden_states"];
    let (t, h) = (hs.shape[1], hs.shape[2]);
    let allowed =
        F32_TOLERANCE.max(2.0 * facts("gemma4_e2b")["f32_vs_f64_relative_error_per_index"][n].as_f64().unwrap());
    let e = rel_err(&got, &hs.f32[n * t * h..(n + 1) * t * h]);
    assert!(e <= allowed, "relative error {e:.3e}");
}

/// A real server on the release with experts: `/v1/info` reports its layer kinds, and the answer
/// for the 100-token sequence (past the window) equals transformers at the indices asked, with
/// its softcapped log-probabilities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_reports_layer_kinds_and_returns_exact_states_and_logprobs() {
    use serde_json::{json, Value};
    let name = "gemma4_moe";
    let d = dir(name);
    let limits = layertap::http::Limits { max_input_tokens: 512, max_batch_tokens: 1024, ..common::limits() };
    let (running, base) = common::real_server("gemma4/gemma4_moe", limits).await;
    let client = reqwest::Client::new();
    let info: Value = client.get(format!("{base}/v1/info")).send().await.unwrap().json().await.unwrap();
    let kinds = &info["layer_kinds"];
    assert_eq!(info["architecture"], "Gemma4ForConditionalGeneration");
    assert_eq!((kinds["sliding_attention"].as_u64(), kinds["full_attention"].as_u64()), (Some(4), Some(2)), "{info}");
    assert_eq!(
        (kinds["dense_mlp"].as_u64(), kinds["moe"].as_u64(), kinds["experts"].as_u64()),
        (Some(6), Some(6), Some(6))
    );

    let reference = read_safetensors(&d.join("reference.safetensors"));
    let hs = &reference["seq5.hidden_states"];
    let (l1, t, h) = (hs.shape[0], hs.shape[1], hs.shape[2]);
    let body = json!({"inputs": [{"input_ids": reference["seq5.input_ids"].i64}], "layers": [1, -1, 3],
                      "dtype": "float32", "logprobs": {"top_k": 5, "target": true}});
    let r = client.post(format!("{base}/v1/hidden-states")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let got = common::read_safetensors_bytes(&zstd::decode_all(&r.bytes().await.unwrap()[..]).unwrap()).0;
    let states = &got["hidden_states"];
    let drift = facts(name)["f32_vs_f64_relative_error_per_index"].clone();
    for (k, idx) in [1, l1 - 1, 3].into_iter().enumerate() {
        let want = &hs.f32[idx * t * h..(idx + 1) * t * h];
        let ours: Vec<f32> = (0..t).flat_map(|r| states.f32[(r * 3 + k) * h..][..h].to_vec()).collect();
        let e = rel_err(&ours, want);
        let allowed = F32_TOLERANCE.max(2.0 * drift[idx].as_f64().unwrap());
        assert!(e <= allowed, "index {idx}: relative error {e:.3e}");
    }
    assert_eq!(got["topk_ids"].i64, reference["seq5.logprob_ids"].i64);
    let worst = got["topk_logprobs"]
        .f32
        .iter()
        .zip(&reference["seq5.logprobs"].f32)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let allowed = F32_TOLERANCE.max(2.0 * facts(name)["logprobs_f32_vs_f64_max_abs"].as_f64().unwrap());
    assert!(f64::from(worst) <= allowed, "log-probabilities off by {worst:e}");
    running.shutdown.cancel();
}

/// The vision and audio towers of `Gemma4ForConditionalGeneration` are never read: NaN tensors
/// of any shape under their prefixes leave the decoder's states as they were.
#[test]
fn the_towers_are_never_read() {
    let nan = f32::NAN.to_le_bytes().to_vec();
    let copy = common::with_tensors("gemma4/gemma4_moe", |t| {
        for name in [
            "model.vision_tower.encoder.weight",
            "model.embed_vision.embedding_projection.weight",
            "model.audio_tower.layers.0.weight",
        ] {
            t.push((name.to_string(), safetensors::Dtype::F32, vec![1], nan.clone()));
        }
    });
    let reference = read_safetensors(&dir("gemma4_moe").join("reference.safetensors"));
    let mut engine = load_cpu(copy.path(), DType::F32);
    let n = engine.decoder.cfg.num_hidden_layers;
    let got = run_packed(&mut engine, &[reference_ids(&reference, 5)], &[n]).remove(0);
    let hs = &reference["seq5.hidden_states"];
    let (t, h) = (hs.shape[1], hs.shape[2]);
    let e = rel_err(&got, &hs.f32[n * t * h..(n + 1) * t * h]);
    assert!(e <= F32_TOLERANCE, "relative error {e:.3e}");
}
