//! Checkpoints layertap cannot read exactly are refused, with a message naming what is wrong:
//! quantisation configs it does not implement, tensors in dtypes the loader does not read, and
//! decoder tensors nothing reads. Each case is a tiny fixture edited in the test.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{refusal, with_config, with_tensors, OwnedTensor};
use safetensors::tensor::Dtype;
use serde_json::{json, Value};

const DENSE: &str = "tiny/qwen3_qknorm";
const HYBRID: &str = "tiny/qwen3_5_hybrid";

/// Gives tensor `name` another dtype, with bytes of the right size for its shape.
fn retype(ts: &mut [OwnedTensor], name: &str, dtype: Dtype) {
    let t = ts.iter_mut().find(|t| t.0 == name).unwrap_or_else(|| panic!("{name} is in the fixture"));
    let n: usize = t.2.iter().product();
    t.1 = dtype;
    t.3 = (0..n * (dtype.bitsize() / 8)).map(|i| (i * 37 % 251) as u8).collect();
}

fn add(ts: &mut Vec<OwnedTensor>, name: &str, dtype: Dtype, shape: &[usize]) {
    let n: usize = shape.iter().product();
    ts.push((name.into(), dtype, shape.to_vec(), vec![0x3c; n * (dtype.bitsize() / 8)]));
}

#[test]
fn every_quantisation_config_the_engine_does_not_implement_is_refused_naming_its_method() {
    // Qwen's block-wise FP8 scheme loads (tests/fp8.rs); its variants and every other method do not.
    let cases = [
        (json!({"quant_method": "fp8", "activation_scheme": "static"}), vec!["\"fp8\"", "static"]),
        (
            json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [1, 128]}),
            vec!["\"fp8\"", "e4m3", "dynamic", "[1,128]"],
        ),
        (json!({"quant_method": "gptq", "bits": 4, "group_size": 128}), vec!["\"gptq\"", "bits 4", "group_size 128"]),
        (json!({"quant_method": "awq", "bits": 4}), vec!["\"awq\""]),
        (
            json!({"quant_method": "bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4"}),
            vec!["\"bitsandbytes\"", "nf4"],
        ),
        (json!({"quant_method": "compressed-tensors", "format": "float-quantized"}), vec!["\"compressed-tensors\""]),
        (json!({"quant_method": "mxfp4"}), vec!["\"mxfp4\""]),
        (json!({"bits": 8}), vec!["\"unnamed\""]),
    ];
    for (q, want) in cases {
        let dir = with_config(DENSE, |c| c["quantization_config"] = q.clone());
        let msg = refusal(dir.path()).unwrap_or_else(|| panic!("{q} must be refused"));
        for w in want {
            assert!(msg.contains(w), "{q}: the message names {w:?}: {msg}");
        }
        assert!(msg.contains("supported quantisation: quant_method \"fp8\" with fmt \"e4m3\""), "{msg}");
    }
    // Multimodal configs keep it beside or inside text_config; compressed-tensors' older key too.
    let nested = with_config(HYBRID, |c| c["text_config"]["quantization_config"] = json!({"quant_method": "fp8"}));
    assert!(refusal(nested.path()).is_some_and(|m| m.contains("\"fp8\"")));
    let older = with_config(DENSE, |c| c["compression_config"] = json!({"quant_method": "compressed-tensors"}));
    assert!(refusal(older.path()).is_some_and(|m| m.contains("compression_config") && m.contains("compressed-tensors")));
    // A null entry declares nothing.
    let null = with_config(DENSE, |c| c["quantization_config"] = Value::Null);
    assert_eq!(refusal(null.path()), None);
}

#[test]
fn a_decoder_tensor_in_a_dtype_the_loader_does_not_read_is_refused_naming_it() {
    for dtype in [Dtype::F8_E4M3, Dtype::F8_E5M2, Dtype::I8, Dtype::U8, Dtype::I32, Dtype::I64] {
        let name = "model.layers.1.mlp.up_proj.weight";
        let dir = with_tensors(DENSE, |ts| retype(ts, name, dtype));
        let msg = refusal(dir.path()).unwrap_or_else(|| panic!("{dtype:?} must be refused"));
        assert!(msg.contains(name) && msg.contains(&format!("({dtype:?})")), "{msg}");
        assert!(msg.contains("decoder layer 1") && msg.contains("wrong hidden states"), "{msg}");
    }
    // The embeddings and the final norm too.
    for name in ["model.embed_tokens.weight", "model.norm.weight"] {
        let dir = with_tensors(DENSE, |ts| retype(ts, name, Dtype::F8_E4M3));
        let msg = refusal(dir.path()).unwrap_or_default();
        assert!(msg.contains(name) && msg.contains("of the decoder"), "{msg}");
    }
}

#[test]
fn the_layout_of_an_fp8_release_is_refused_at_once_naming_the_first_tensor() {
    // Qwen's block-wise FP8 layout without its quantization_config: F8 weights plus
    // weight_scale_inv multipliers, which a loader that casts would read as garbage.
    let dir = with_tensors(DENSE, |ts| {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            for layer in 0..2 {
                let name = format!("model.layers.{layer}.self_attn.{p}.weight");
                retype(ts, &name, Dtype::F8_E4M3);
                add(ts, &format!("{name}_scale_inv"), Dtype::BF16, &[1, 1]);
            }
        }
    });
    let msg = refusal(dir.path()).unwrap_or_default();
    assert!(msg.contains("model.layers.0.self_attn.k_proj.weight") && msg.contains("F8_E4M3"), "{msg}");
}

#[test]
fn quantisation_data_and_decoder_tensors_nobody_reads_are_refused_naming_them() {
    let cases: [(&str, Dtype, &[usize], &str); 5] = [
        ("model.layers.0.mlp.down_proj.weight_scale_inv", Dtype::BF16, &[1, 1], "decoder layer 0"),
        ("model.layers.1.self_attn.q_proj.qzeros", Dtype::I32, &[1, 16], "decoder layer 1"),
        ("model.layers.1.self_attn.q_proj.input_scale", Dtype::F32, &[1], "decoder layer 1"),
        // An unknown parameter of a layer that runs, in a dtype the loader reads: caught after loading.
        ("model.layers.2.mlp.extra_proj.weight", Dtype::F32, &[4, 4], "decoder layer 2"),
        // Quantisation data outside the decoder and outside the parts never read.
        ("model.extra.weight_scale", Dtype::F32, &[1], "quantisation data"),
    ];
    for (name, dtype, shape, part) in cases {
        let dir = with_tensors(DENSE, |ts| add(ts, name, dtype, shape));
        let msg = refusal(dir.path()).unwrap_or_else(|| panic!("{name} must be refused"));
        assert!(msg.contains(name) && msg.contains(part) && msg.contains(&format!("{dtype:?}")), "{msg}");
    }
}

#[test]
fn vision_towers_mtp_heads_and_the_output_head_stay_ignorable_whatever_they_hold() {
    let dir = with_tensors(HYBRID, |ts| {
        retype(ts, "mtp.layers.0.self_attn.q_proj.weight", Dtype::F8_E4M3);
        add(ts, "mtp.layers.0.self_attn.q_proj.weight_scale_inv", Dtype::BF16, &[1, 1]);
        add(ts, "model.visual.blocks.0.attn.qkv.weight_scale_inv", Dtype::F32, &[1, 1]);
        add(ts, "lm_head.weight_scale_inv", Dtype::F32, &[1, 1]);
    });
    assert_eq!(refusal(dir.path()), None);
    // A buffer older checkpoints saved in every layer.
    let dir = with_tensors(DENSE, |ts| add(ts, "model.layers.0.self_attn.rotary_emb.inv_freq", Dtype::F32, &[16]));
    assert_eq!(refusal(dir.path()), None);
    // A layer past the config's num_hidden_layers is refused, whatever it holds: the checkpoint
    // does not match its config (transformers refuses unexpected weights too).
    let dir = with_tensors(DENSE, |ts| {
        add(ts, "model.layers.3.mlp.up_proj.weight", Dtype::F8_E4M3, &[128, 64]);
        add(ts, "model.layers.3.mlp.up_proj.weight_scale_inv", Dtype::BF16, &[1, 1]);
    });
    let msg = refusal(dir.path()).expect("a layer past num_hidden_layers is refused");
    assert!(msg.contains("decoder layers 3..=3") && msg.contains("num_hidden_layers"), "{msg}");
}

/// Runs `layertap serve` on `dir` until it exits, asking `/ready` all the while; returns its exit
/// status, stderr and whether `/ready` ever answered 200.
async fn serve_until_exit(dir: &std::path::Path) -> (std::process::ExitStatus, String, bool) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_layertap"))
        .args(["serve", "--model", &dir.to_string_lossy(), "--host", "127.0.0.1", "--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/ready");
    let client = reqwest::Client::builder().no_proxy().timeout(Duration::from_millis(500)).build().unwrap();
    let start = Instant::now();
    let mut ready = false;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        ready |= client.get(&url).send().await.is_ok_and(|r| r.status() == 200);
        assert!(start.elapsed() < Duration::from_secs(60), "serve did not exit");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status, err, ready)
}

#[tokio::test]
async fn serve_exits_non_zero_with_the_refusal_and_never_turns_ready() {
    // Refused when the config is read, before listening.
    let config = with_config(DENSE, |c| c["quantization_config"] = json!({"quant_method": "gptq", "bits": 4}));
    // Refused while the device loads, after listening: /ready answers 503 until the exit.
    let tensor = with_tensors(DENSE, |ts| retype(ts, "model.layers.2.mlp.down_proj.weight", Dtype::F8_E4M3));
    for (dir, want) in [(config.path(), "\"gptq\""), (tensor.path(), "model.layers.2.mlp.down_proj.weight")] {
        let (status, err, ready) = serve_until_exit(dir).await;
        assert!(!status.success(), "serve must exit non-zero: {err}");
        assert!(err.contains(want), "stderr names {want}: {err}");
        assert!(!ready, "/ready must never answer 200 for a refused checkpoint");
    }
}
