use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use layertap::answer::{assemble, LayerSet};
use layertap::cli::{Cli, Command, ExtractArgs, LogFormat, ServeArgs};
use layertap::engine::{self, ModelEngine};
use layertap::tokenizer::{Input, TextTokenizer};

fn parse_ids(s: &str) -> anyhow::Result<Vec<u32>> {
    s.split(',')
        .map(|t| t.trim().parse::<u32>().map_err(|e| anyhow::anyhow!("bad token id {t:?} in --input-ids: {e}")))
        .collect()
}

fn extract(a: ExtractArgs) -> anyhow::Result<()> {
    let mut inputs: Vec<Input> = Vec::new();
    for s in &a.input_ids {
        inputs.push(Input::Ids(parse_ids(s)?));
    }
    inputs.extend(a.text.iter().cloned().map(Input::Text));
    if inputs.is_empty() {
        anyhow::bail!("give at least one --input-ids or --text");
    }
    let device = engine::parse_device(&a.device)?;
    let files = engine::loader::ModelFiles::locate(&a.model)?.quantize(a.quantize)?;
    let mut model = files.load(&device, a.dtype.candle())?;
    let tok_src = files.tokenizer_source()?;
    let tok = TextTokenizer::from_source(&tok_src)?;
    let layers = LayerSet::resolve(&a.layers, model.info.num_layers).map_err(anyhow::Error::msg)?;
    let seqs = inputs.iter().map(|i| i.tokenize(tok.as_ref())).collect::<Result<Vec<_>, _>>()?;
    let out_dtype = a.out_dtype.unwrap_or(a.dtype.out());
    let engine: &mut ModelEngine = &mut model.engine;
    let (x, found) = assemble::once(engine, &model.info, &seqs, &layers, out_dtype)?;
    if let (Some(why), false) = (found.refusal(&layers), a.allow_nonfinite) {
        anyhow::bail!("{why}; nothing was written. Pass --allow-nonfinite to write such states anyway");
    }
    let bytes = x.to_safetensors()?;
    std::fs::write(&a.out, &bytes).map_err(|e| anyhow::anyhow!("writing {}: {e}", a.out.display()))?;
    let counts = found.counts(&layers);
    eprintln!(
        "wrote {} ({} tokens, layers {}, {}, {} bytes{})",
        a.out.display(),
        x.input_ids.len(),
        serde_json::Value::from(layers.labels()),
        out_dtype.name(),
        bytes.len(),
        if counts.is_empty() {
            String::new()
        } else {
            format!("; non-finite rows: {}", serde_json::Value::Object(counts))
        }
    );
    Ok(())
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    // Tokenizing and encoding answers run on blocking threads; more of them than a few per core
    // only add threads (each with its own stack and allocator arena), not throughput.
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    // Threads are named for `top -H` and per-thread CPU accounting: the runtime starts its
    // `cores` workers (sockets, HTTP) first, so the threads after them are its blocking threads
    // (tokenizing, encoding answers).
    let started = std::sync::atomic::AtomicUsize::new(0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(cores)
        .thread_name_fn(move || {
            let n = started.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n < cores {
                "layertap-http".into()
            } else {
                "layertap-encode".into()
            }
        })
        .max_blocking_threads((4 * cores).max(8))
        .build()?;
    let r = rt.block_on(layertap::run(a));
    // Answers are written by now; do not wait on blocking tasks of abandoned requests.
    rt.shutdown_timeout(std::time::Duration::from_millis(500));
    r
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LAYERTAP_LOG").unwrap_or_else(|_| "info".into());
    // Colours only on a terminal, and never with NO_COLOR set (https://no-color.org).
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let b = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
    }
}

fn main() -> ExitCode {
    layertap::server::reuse_large_allocations();
    let cli = Cli::parse();
    let format = match &cli.command {
        Command::Serve(a) => a.log_format,
        _ => LogFormat::Text,
    };
    init_logging(format);
    let r = match cli.command {
        Command::Extract(a) => extract(a),
        Command::Serve(a) => serve(a),
        Command::Bulk(a) => match tokio::runtime::Runtime::new()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(layertap::bulk::run(a)))
        {
            Ok(0) => Ok(()),
            Ok(code) => return ExitCode::from(code as u8),
            Err(e) => Err(e),
        },
        Command::Bench(a) => layertap::bench::run(&a).map(|v| println!("{v}")),
        Command::Openapi => {
            print!("{}", layertap::http::openapi::openapi_pretty());
            Ok(())
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
