//! In-process engine throughput: the workload of bench/workload_*.json through the engine, no HTTP.
//!
//! cargo run --release --example bench_engine -- [--workload bench/workload_cpu.json]
//!     [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--device cpu] [--dtype f32]
//!     [--max-batch-tokens 4096]
//!
//! Sequences are sorted by length and packed (no padding) into batches of at most
//! --max-batch-tokens tokens; every sequence's states are gathered to host memory in the output
//! dtype, so the extraction work is really done. One untimed warm-up batch, then the whole
//! workload is timed. The last stdout line is one JSON object.

use std::path::PathBuf;
use std::time::Instant;

use layertap::engine::loader::ModelFiles;
use layertap::engine::{parse_device, Batch, Engine, OutDType};

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_string())
}

/// (layers, sequences) from a workload sidecar and its JSONL file.
pub fn read_workload(path: &str) -> (Vec<i64>, Vec<Vec<u32>>) {
    let side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let layers = side["layers"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect();
    let jsonl = PathBuf::from(path).with_file_name(side["file"].as_str().unwrap());
    let seqs = std::fs::read_to_string(jsonl)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        })
        .collect();
    (layers, seqs)
}

fn main() -> anyhow::Result<()> {
    let workload = arg("--workload", "bench/workload_cpu.json");
    let model = arg("--model", ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let dtype: OutDType = arg("--dtype", "f32").parse().map_err(anyhow::Error::msg)?;
    let max_tokens: usize = arg("--max-batch-tokens", "4096").parse()?;
    let device = parse_device(&arg("--device", "cpu"))?;
    let (layers, mut seqs) = read_workload(&workload);
    let files = ModelFiles::locate(&model)?;
    let layers = files.config().resolve_layers(&layers)?;
    let mut m = files.load(&device, dtype.candle())?;
    seqs.sort_by_key(|s| s.len());
    let mut batches: Vec<Vec<Vec<u32>>> = vec![vec![]];
    let mut cur = 0;
    for s in seqs {
        if cur + s.len() > max_tokens && !batches.last().unwrap().is_empty() {
            batches.push(vec![]);
            cur = 0;
        }
        cur += s.len();
        batches.last_mut().unwrap().push(s);
    }
    let run = |engine: &mut dyn Engine, b: &[Vec<u32>]| -> anyhow::Result<usize> {
        let mut cu = vec![0];
        for s in b {
            cu.push(cu.last().unwrap() + s.len());
        }
        let taps = engine.forward(&Batch { input_ids: b.concat(), cu_seqlens: cu.clone(), layers: layers.clone() })?;
        let mut bytes = 0;
        for (i, s) in b.iter().enumerate() {
            bytes += taps.gather(cu[i], s.len(), &layers, dtype)?.data.len();
        }
        Ok(bytes)
    };
    run(&mut m.engine, &batches[0])?;
    let tokens: usize = batches.iter().flatten().map(Vec::len).sum();
    let start = Instant::now();
    let mut bytes = 0;
    for b in &batches {
        bytes += run(&mut m.engine, b)?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "contender": "layertap-engine", "tokens": tokens, "seconds": secs, "tokens_per_s": tokens as f64 / secs,
            "batches": batches.len(), "max_batch_tokens": max_tokens, "dtype": dtype.name(), "output_bytes": bytes,
            "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        })
    );
    Ok(())
}
