//! `layertap bench`: the engine's throughput in process (no HTTP) on a workload file.
//!
//! A workload is a JSON sidecar `{"layers": [...], "dtype": "...", "file": "x.jsonl"}` and a JSONL
//! file of `{"input_ids": [...]}` lines. Sequences are sorted by length and packed (no padding)
//! into batches of at most `--max-batch-tokens`; every sequence's states end up in host memory in
//! the output dtype (addressed in place in the batch's buffer when its layout already matches, as
//! the server's answers are, copied out otherwise), so the extraction work is really done. Batch
//! i + 1 is launched before batch i is collected, as in the server. One untimed warm-up batch, then
//! the whole workload is timed; afterwards the last batch's answers are encoded as the server
//! encodes them, in the compute dtype and as fp8, to report their sizes (raw and zstd), the fp8
//! error per index and the speed of the checksum and of zstd. `--fp8` times the workload with
//! fp8 answers (quantised on the device), `--no-screen` without the non-finite screen, `--top-k K`
//! with every row's top-K next-token log-probabilities, to measure what each costs.

use std::path::PathBuf;
use std::time::Instant;

use crate::answer::{Assembly, LayerSet};
use crate::batching::Part;
use crate::cli::BenchArgs;
use crate::engine::loader::ModelFiles;
use crate::engine::{
    device_memory, parse_device, Batch, Engine, EngineOptions, LogprobRows, OutDType, Output, Pending, Rows,
};
use crate::tokenizer::Tokenized;

/// (layers, sequences) from a workload sidecar and its JSONL file.
pub fn read_workload(path: &str) -> anyhow::Result<(Vec<i64>, Vec<Vec<u32>>)> {
    let side: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let layers = side["layers"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("{path}: no \"layers\" list"))?
        .iter()
        .filter_map(|v| v.as_i64())
        .collect();
    let file = side["file"].as_str().ok_or_else(|| anyhow::anyhow!("{path}: no \"file\""))?;
    let jsonl = PathBuf::from(path).with_file_name(file);
    let mut seqs = Vec::new();
    for l in std::fs::read_to_string(&jsonl)?.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l)?;
        let ids = v["input_ids"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("{}: a line without input_ids", jsonl.display()))?;
        seqs.push(ids.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect());
    }
    Ok((layers, seqs))
}

/// What answers of the last batch cost and hold, untimed: the batch is run once more with every
/// row returned both in the compute dtype and as fp8, and each sequence is encoded as the server
/// encodes answers (safetensors with checksums, zstd at the server's default level) in both
/// forms. Reports bytes (raw and zstd) and zstd speed, the fp8 states' relative error against the
/// compute-dtype states per index, and the speed of the checksum and of zstd on one thread.
fn answers(
    engine: &mut dyn Engine,
    engine_device: &candle_core::Device,
    b: &[Vec<u32>],
    cu: &[usize],
    layers: &LayerSet,
    dtype: OutDType,
) -> anyhow::Result<serde_json::Value> {
    let level = crate::http::Limits::default().zstd_level;
    let mut batch = Batch::pack(b.iter().map(|s| &s[..]), layers.indices().iter().copied());
    batch.output = Output { plain: Rows::All, fp8: Rows::All, ..Output::default() };
    let taps = std::sync::Arc::new(engine.launch(&batch)?.wait()?);
    let hidden = taps.host.shape[2];
    let width = layers.len();
    let (mut num, mut den) = (vec![0f64; width], vec![0f64; width]);
    let mut sizes = serde_json::Map::new();
    for fp8 in [false, true] {
        let (mut raw, mut enc, mut hash_s, mut zstd_s) = (0usize, 0usize, 0f64, 0f64);
        for (i, s) in b.iter().enumerate() {
            let part = Part {
                taps: taps.clone(),
                layers: layers.indices().into(),
                fp8,
                start: cu[i],
                rows: s.len(),
                logprobs: None,
            };
            let bytes = part.bytes(dtype)?;
            if fp8 {
                let q = part.gather(dtype)?.to_f32();
                let scale = part.scale()?;
                let x = taps.gather(cu[i], s.len(), layers.indices(), OutDType::Float32)?.to_f32();
                for (k, (&qv, &xv)) in q.iter().zip(&x).enumerate() {
                    let c = k / hidden % width;
                    let back = f64::from(qv) * f64::from(scale[k / hidden]);
                    num[c] += (back - f64::from(xv)).powi(2);
                    den[c] += f64::from(xv).powi(2);
                }
            }
            let t = Instant::now();
            std::hint::black_box(crate::answer::checksum::xxh64_hex([&bytes[..]]));
            hash_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut z = zstd::stream::Encoder::new(Vec::new(), level)?;
            std::io::Write::write_all(&mut z, &bytes)?;
            std::hint::black_box(z.finish()?);
            zstd_s += t.elapsed().as_secs_f64();
            let answer = Assembly {
                seqs: std::sync::Arc::new(vec![Tokenized { ids: s.clone(), loss_mask: vec![1; s.len()] }]),
                positions: None,
                parts: vec![part.clone()],
                layers: layers.clone(),
                dtype: if fp8 { OutDType::Float8E4M3 } else { dtype },
                hidden,
                logprobs: None,
                metadata: Default::default(),
            };
            raw += answer.encode(None, 1)?.0.len();
            enc += answer.encode(Some(level), 1)?.0.len();
        }
        let name = if fp8 { "float8_e4m3fn".to_string() } else { dtype.name().to_string() };
        sizes.insert(
            name,
            serde_json::json!({
                "answers": b.len(), "raw_bytes": raw, "zstd_bytes": enc, "zstd_ratio": raw as f64 / enc.max(1) as f64,
                "xxh64_gb_per_s_one_thread": raw as f64 / 1e9 / hash_s.max(1e-12),
                "zstd_mb_per_s_one_thread": raw as f64 / 1e6 / zstd_s.max(1e-12),
            }),
        );
    }
    // The screen and the quantisation alone, on the device, over the last batch's states (the
    // best of three, each waited for): what they add per token to the engine's own time.
    let device = engine_device;
    let states = candle_core::Tensor::from_vec(taps.host.to_f32(), taps.host.shape.clone(), &candle_core::Device::Cpu)?
        .to_dtype(dtype.candle())?
        .to_device(device)?;
    let time = |f: &dyn Fn() -> candle_core::Result<()>| -> anyhow::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            device.synchronize()?;
            let t = Instant::now();
            f()?;
            device.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let screen_s = time(&|| crate::engine::output::nonfinite(&states).map(drop))?;
    let fp8_s = time(&|| crate::engine::output::quantize_fp8(&states).map(drop))?;
    let rows = taps.host.shape[0] as f64;
    let err: Vec<serde_json::Value> = layers
        .indices()
        .iter()
        .enumerate()
        .map(|(c, l)| serde_json::json!({"index": l, "fp8_rel_err": (num[c] / den[c].max(1e-30)).sqrt()}))
        .collect();
    Ok(serde_json::json!({
        "zstd_level": level, "sizes": sizes, "fp8_vs_compute_dtype": err, "tokens": rows,
        "screen_seconds": screen_s, "fp8_quantise_seconds": fp8_s,
        "screen_ms_per_1k_tokens": screen_s * 1e6 / rows, "fp8_quantise_ms_per_1k_tokens": fp8_s * 1e6 / rows,
    }))
}

/// Runs the workload through the engine in process and returns the result line.
pub fn run(a: &BenchArgs) -> anyhow::Result<serde_json::Value> {
    let (dtype, max_tokens) = (a.dtype.out(), a.max_batch_tokens);
    let device = parse_device(&a.device)?;
    let (layers, mut seqs) = read_workload(&a.workload.to_string_lossy())?;
    anyhow::ensure!(!seqs.is_empty(), "the workload has no sequences");
    let files = ModelFiles::locate_with(&a.model, a.synthetic_weights)?.quantize(a.quantize)?;
    let layers = LayerSet::of_indices(&layers, files.config().num_hidden_layers).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(a.pipeline >= 1, "--pipeline {}: a decoder needs at least 1 stage", a.pipeline);
    let mut m = files.load_stages(&vec![device.clone(); a.pipeline], dtype.candle(), EngineOptions::startup())?;
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
    let cu_of = |b: &[Vec<u32>]| -> Vec<usize> {
        let mut cu = vec![0];
        for s in b {
            cu.push(cu.last().unwrap() + s.len());
        }
        cu
    };
    let output = Output {
        screen: !a.no_screen,
        logprobs: a.top_k.map(|top_k| LogprobRows { rows: Rows::All, top_k }),
        ..if a.fp8 { Output::all_fp8() } else { Output::default() }
    };
    let launch = |engine: &mut dyn Engine, b: &[Vec<u32>]| -> anyhow::Result<Pending> {
        let mut batch = Batch::pack(b.iter().map(|s| &s[..]), layers.indices().iter().copied());
        batch.output = output.clone();
        Ok(engine.launch(&batch)?)
    };
    // Waits for a batch and gathers every sequence's answer, as the server does per request.
    let finish = |pending: Pending, b: &[Vec<u32>]| -> anyhow::Result<(usize, crate::engine::Taps)> {
        let mut since = Instant::now();
        let taps = pending.wait()?;
        let cu = cu_of(b);
        let mut bytes = 0;
        for (i, s) in b.iter().enumerate() {
            bytes += if a.fp8 {
                taps.fp8_bytes(cu[i], s.len(), layers.indices())?.len()
                    + taps.fp8_scale(cu[i], s.len(), layers.indices())?.len() * 4
            } else {
                taps.bytes(cu[i], s.len(), layers.indices(), dtype)?.len()
            };
        }
        if let Some(l) = &taps.logprobs {
            bytes += l.ids.len() * 8 + (l.logprobs.len() + l.target.len()) * 4;
        }
        crate::engine::profile::mark(&device, crate::engine::profile::Phase::HostCopy, &mut since);
        Ok((bytes, taps))
    };
    let warm = launch(&mut m.engine, &batches[0])?;
    finish(warm, &batches[0])?;
    let tokens: usize = batches.iter().flatten().map(Vec::len).sum();
    let start = Instant::now();
    let mut bytes = 0;
    let mut peak = 0u64;
    let bar = indicatif::ProgressBar::new(tokens as u64).with_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} tokens {per_sec} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    // Batch i + 1 is launched before batch i's results are collected, as the server's worker does.
    let mut prev: Option<(Pending, &Vec<Vec<u32>>)> = None;
    for b in &batches {
        let pending = launch(&mut m.engine, b)?;
        if let Some((p, pb)) = prev.take() {
            bytes += finish(p, pb)?.0;
            bar.inc(pb.iter().map(Vec::len).sum::<usize>() as u64);
        }
        prev = Some((pending, b));
        if let Some((used, _)) = device_memory(&device) {
            peak = peak.max(used);
        }
    }
    let mut last = None;
    if let Some((p, pb)) = prev.take() {
        let (n, taps) = finish(p, pb)?;
        bytes += n;
        bar.inc(pb.iter().map(Vec::len).sum::<usize>() as u64);
        last = Some((taps, pb));
    }
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    // Untimed above: the answers of the last batch encoded as the server does (safetensors +
    // zstd at the server's default level), for the compression ratio and zstd speed.
    let answers = match last {
        Some((taps, b)) => {
            drop(taps);
            Some(answers(&mut m.engine, &device, b, &cu_of(b), &layers, dtype)?)
        }
        None => None,
    };
    Ok(serde_json::json!({
            "contender": "layertap-engine", "tokens": tokens, "seconds": secs, "tokens_per_s": tokens as f64 / secs,
            "batches": batches.len(), "max_batch_tokens": max_tokens, "dtype": dtype.name(), "output_bytes": bytes,
            "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "device": a.device, "max_device_memory_used_after_batch_bytes": peak, "answers": answers,
            "output": if a.fp8 { "float8_e4m3fn" } else { dtype.name() }, "screen": !a.no_screen,
            "top_k": a.top_k, "pipeline": a.pipeline,
            "stages": m.engine.decoder.stages().iter().map(|s| [s.layers.start, s.layers.end]).collect::<Vec<_>>(),
            "profile_seconds": crate::engine::profile::enabled().then(|| {
                crate::engine::profile::totals().into_iter().collect::<std::collections::HashMap<_, _>>()
            }),
    }))
}
