//! End-to-end HTTP throughput: a concurrent client sends the workload of bench/workload_*.json to a
//! running layertap server, one sequence per request, and reads and decodes every answer
//! (zstd + safetensors), checking its shape.
//!
//! cargo run --release --example bench_http -- --url http://127.0.0.1:8080
//!     [--workload bench/workload_cpu.json] [--concurrency 8] [--dtype float32]
//!     [--encoding zstd|identity]
//!
//! The last stdout line is one JSON object (tokens/s, requests/s, bytes, compression ratio).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

fn arg(name: &str, default: &str) -> String {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let url = arg("--url", "http://127.0.0.1:8080");
    let workload = arg("--workload", "bench/workload_cpu.json");
    let concurrency: usize = arg("--concurrency", "8").parse()?;
    let dtype = arg("--dtype", "float32");
    let encoding = arg("--encoding", "zstd");
    anyhow::ensure!(encoding == "zstd" || encoding == "identity", "--encoding is zstd or identity");
    let (layers, seqs) = layertap::bench::read_workload(&workload)?;
    let seqs = Arc::new(seqs);
    let client = reqwest::Client::builder().no_proxy().build()?;
    let info: serde_json::Value = client.get(format!("{url}/v1/info")).send().await?.json().await?;
    let hidden = info["hidden_size"].as_u64().unwrap() as usize;
    // Warm-up: one request, untimed.
    client
        .post(format!("{url}/v1/hidden-states"))
        .json(&json!({"inputs": [{"input_ids": seqs[0]}], "layers": layers, "dtype": dtype}))
        .send()
        .await?
        .error_for_status()?;
    let next = Arc::new(AtomicUsize::new(0));
    let cpu_start = cpu_seconds();
    let encoded = Arc::new(AtomicUsize::new(0));
    let raw = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (client, url, seqs, next, layers, dtype, encoding) =
            (client.clone(), url.clone(), seqs.clone(), next.clone(), layers.clone(), dtype.clone(), encoding.clone());
        let (encoded, raw) = (encoded.clone(), raw.clone());
        tasks.push(tokio::spawn(async move {
            // Answers are read into buffers shared by every task (the server's pool of reused
            // buffers, `layertap::bufpool`): a buffer is taken when an answer starts to arrive
            // and given back once it is checked, so buffers are only held by answers in transit,
            // and after the first answers few pages are faulted in again, however many requests
            // are in flight.
            let mut dctx = zstd::bulk::Decompressor::new()?;
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(s) = seqs.get(i) else { return Ok::<(), anyhow::Error>(()) };
                let mut r = client
                    .post(format!("{url}/v1/hidden-states"))
                    .header("accept-encoding", encoding.as_str())
                    .json(&json!({"inputs": [{"input_ids": s}], "layers": layers, "dtype": dtype}))
                    .send()
                    .await?
                    .error_for_status()?;
                let mut body = layertap::bufpool::take(r.content_length().unwrap_or(0) as usize);
                while let Some(c) = r.chunk().await? {
                    body.as_mut_vec().extend_from_slice(&c);
                }
                encoded.fetch_add(body.len(), Ordering::SeqCst);
                let (n_layers, len) = (layers.len(), s.len());
                let zstd = encoding == "zstd";
                let decoded;
                (decoded, dctx) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                    let n = if zstd {
                        // The frame records the file's size: decode into a buffer of that size
                        // (a server too old to record it: as a stream).
                        match zstd::zstd_safe::get_frame_content_size(&body).ok().flatten() {
                            Some(size) => {
                                let mut out = layertap::bufpool::take(size as usize);
                                dctx.decompress_to_buffer(&body[..], out.as_mut_vec())?;
                                check(&out, len, n_layers, hidden)?
                            }
                            None => check(&layertap::answer::codec::unzstd(&body)?, len, n_layers, hidden)?,
                        }
                    } else {
                        check(&body, len, n_layers, hidden)?
                    };
                    Ok((n, dctx))
                })
                .await??;
                raw.fetch_add(decoded, Ordering::SeqCst);
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = start.elapsed().as_secs_f64();
    // The client's own CPU (receiving, decompressing, parsing) shares the host with the server.
    let client_cpu = cpu_seconds() - cpu_start;
    let tokens: usize = seqs.iter().map(Vec::len).sum();
    let (enc, rawb) = (encoded.load(Ordering::SeqCst), raw.load(Ordering::SeqCst));
    println!(
        "{}",
        json!({
            "contender": "layertap-http", "tokens": tokens, "requests": seqs.len(), "seconds": secs,
            "tokens_per_s": tokens as f64 / secs, "requests_per_s": seqs.len() as f64 / secs,
            "concurrency": concurrency, "dtype": dtype, "encoding": encoding, "encoded_bytes": enc, "decoded_bytes": rawb,
            "compression_ratio": rawb as f64 / enc.max(1) as f64,
            "client_cpu_seconds": client_cpu, "client_cores_busy": client_cpu / secs,
        })
    );
    Ok(())
}

/// Checks that `file` is safetensors whose hidden states are `[len, n_layers, hidden]`; its size.
fn check(file: &[u8], len: usize, n_layers: usize, hidden: usize) -> anyhow::Result<usize> {
    let st = safetensors::SafeTensors::deserialize(file)?;
    let hs = st.tensor("hidden_states")?;
    anyhow::ensure!(hs.shape() == [len, n_layers, hidden], "bad shape {:?}", hs.shape());
    Ok(file.len())
}

/// CPU seconds (user + system) this process has used.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given; a zeroed rusage is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer to an rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}
