//! `layertap serve`: load the model on every device, start one worker per device, serve HTTP,
//! and shut down gracefully.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::answer::layers::name as layer_name;
use crate::batching::{spawn_worker, Queue, WorkerHandle};
use crate::cli::{default, SelfCheckMode, ServeArgs};
use crate::engine::loader::ModelFiles;
use crate::engine::selfcheck::{self, Probe, Reference, Report, SharedReference};
use crate::engine::{
    parse_device, tokens_for_memory, ComputeDType, Engine, EngineError, EngineOptions, LoadedEngine, MemoryProbe,
    ModelInfo,
};
use crate::http::{app, conn, AppState, Limits, SelfCheckState};
use crate::metrics::Metrics;
use crate::tokenizer::TextTokenizer;

/// A running server, for tests and embedding: its address, state and a way to stop it.
pub struct Running {
    pub addr: std::net::SocketAddr,
    pub state: AppState,
    pub shutdown: CancellationToken,
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// Why loading the model failed, if it did (the server then stops by itself).
    pub load_error: Arc<std::sync::Mutex<Option<String>>>,
}

/// After the drain deadline, how long the 503s of what was still in flight get to be written
/// before the connections that still hold are closed.
const ANSWER_GRACE: Duration = Duration::from_secs(1);
/// How long to wait for the workers to stop once the queue is closed; a worker still in a long
/// batch is not waited for (the process may exit under it: every answer is written by then).
const WORKER_GRACE: Duration = Duration::from_millis(300);

/// Serves `state` on `listener` until `shutdown` is cancelled, then drains: readiness turns 503,
/// the listener is closed, idle connections are closed and busy ones finish their request (new
/// requests get 503 with Retry-After and `Connection: close`). At `drain_timeout` (or when
/// `state.abandon` is cancelled, e.g. by a second signal) whatever is still queued or running is
/// answered 503 with Retry-After; connections still open [`ANSWER_GRACE`] later are closed.
/// Then the queue is closed and the workers are given [`WORKER_GRACE`] to stop.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    workers: Vec<WorkerHandle>,
    shutdown: CancellationToken,
    drain_timeout: Duration,
) -> anyhow::Result<()> {
    let router = app(state.clone());
    let closing = CancellationToken::new();
    let mut conns = tokio::task::JoinSet::new();
    conn::accept_until(listener, router, state.clone(), &shutdown, closing.clone(), &mut conns).await;
    state.draining.store(true, Ordering::SeqCst);
    closing.cancel();
    tracing::info!(
        open_connections = conns.len(),
        timeout_s = drain_timeout.as_secs_f64(),
        "shutting down: readiness is now 503, no new connections; letting in-flight requests finish"
    );
    let drained = tokio::select! {
        _ = join_all(&mut conns) => true,
        _ = tokio::time::sleep(drain_timeout) => false,
        _ = state.abandon.cancelled() => false,
    };
    if !drained {
        tracing::warn!(
            open_connections = conns.len(),
            "drain time is up: answering the requests still queued or running with 503"
        );
        state.abandon.cancel();
        if tokio::time::timeout(ANSWER_GRACE, join_all(&mut conns)).await.is_err() {
            tracing::warn!(
                open_connections = conns.len(),
                "closing connections whose answers could not be written in time"
            );
            conns.abort_all();
            join_all(&mut conns).await;
        }
    }
    state.scheduler.close();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        workers.into_iter().for_each(WorkerHandle::join);
        let _ = tx.send(());
    });
    if tokio::time::timeout(WORKER_GRACE, rx).await.is_err() {
        tracing::warn!("a worker is still in a batch; not waiting for it");
    }
    tracing::info!("stopped");
    Ok(())
}

async fn join_all(conns: &mut tokio::task::JoinSet<()>) {
    while conns.join_next().await.is_some() {}
}

/// How often freed heap memory is handed back to the operating system.
const TRIM_EVERY: Duration = Duration::from_secs(2);
/// How often idle answer buffers are looked at, and how long one may stay idle.
const ANSWER_BUFFERS_EVERY: Duration = Duration::from_millis(500);
const ANSWER_BUFFERS_IDLE: Duration = Duration::from_secs(1);

/// Answers and batches are megabytes each, allocated and freed on many threads: glibc keeps what
/// they free in its arenas, where it fragments, so resident memory creeps up under steady load.
/// A background thread hands the free pages back (`malloc_trim`) every [`TRIM_EVERY`], and at
/// once when it has freed answer buffers idle for [`ANSWER_BUFFERS_IDLE`] (see
/// [`crate::bufpool`]); live memory is untouched. So within about 1.5 s of the last answer the
/// memory of answers is back with the system. (jemalloc held resident memory flatter in the
/// soak, but made the CPU engine about a third slower, so the system allocator stays.)
pub fn return_free_memory_periodically() {
    // The answer buffers are released on every platform; `malloc_trim` is glibc's.
    let spawned = std::thread::Builder::new().name("layertap-trim".into()).spawn(|| {
        let per_trim = (TRIM_EVERY.as_millis() / ANSWER_BUFFERS_EVERY.as_millis()).max(1);
        for tick in 1u128.. {
            std::thread::sleep(ANSWER_BUFFERS_EVERY);
            let freed = crate::bufpool::release_idle(ANSWER_BUFFERS_IDLE);
            #[cfg(all(target_os = "linux", target_env = "gnu"))]
            if freed > 0 || tick % per_trim == 0 {
                // SAFETY: malloc_trim only returns free heap pages to the system.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
            #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
            let _ = (freed, tick, per_trim);
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the memory trimming thread; serving without it");
    }
}

/// glibc serves allocations over its mmap threshold with fresh pages from the kernel, and hands
/// free memory at a heap's top back once it exceeds the trim threshold: each batch's
/// activations (megabytes to tens of megabytes per layer) then come back as page faults that the
/// kernel zero-fills. Setting the mmap threshold to its largest value (32 MiB) and the trim
/// threshold far above it keeps freed blocks for the next batch; the server's periodic
/// `malloc_trim` still hands free pages back at rest. Call once, at start-up.
/// `LAYERTAP_MALLOC_DEFAULTS=1` leaves glibc's thresholds as they are, for comparison.
pub fn reuse_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var("LAYERTAP_MALLOC_DEFAULTS").ok().and_then(|v| crate::engine::options::parse_bool(&v)) != Some(true)
    {
        // SAFETY: mallopt only changes glibc's allocation thresholds.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

/// The parts of a server that do not depend on the engine: used by `run` and by tests with a
/// fake engine.
pub struct Setup {
    pub info: ModelInfo,
    pub tokenizer: Option<TextTokenizer>,
    pub devices: Vec<String>,
    pub limits: Limits,
    pub api_keys: Vec<String>,
    /// Size the batch budget from free device memory once loaded (CUDA without --max-batch-tokens).
    pub auto_batch_tokens: bool,
    /// What a failed start-up self-check does (each device's engine factory runs it and hands
    /// its report over with the engine).
    pub selfcheck: SelfCheckMode,
}

/// Builds a device's engine on its worker thread.
pub type EngineFactory = Box<dyn FnOnce() -> Result<LoadedEngine, EngineError> + Send>;

/// Starts workers built by `make_engine(device)` and an HTTP server on `listener`.
pub fn start<F>(listener: TcpListener, setup: Setup, make_engine: F, drain_timeout: Duration) -> anyhow::Result<Running>
where
    F: Fn(&str) -> EngineFactory,
{
    let metrics = Arc::new(Metrics::new());
    let info = setup.info;
    metrics
        .model_info
        .with_label_values(&[
            &info.model_id,
            &info.architecture,
            &info.num_layers.to_string(),
            &info.hidden_size.to_string(),
            info.dtype.name(),
        ])
        .set(1);
    let queue = Queue::new(setup.limits.max_batch_tokens, setup.limits.max_queue_tokens, metrics.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    let mut workers = Vec::new();
    for d in &setup.devices {
        workers.push(spawn_worker(d.clone(), queue.clone(), make_engine(d), tx.clone())?);
    }
    drop(tx);
    let state = AppState {
        info: Arc::new(info),
        devices: Arc::new(setup.devices.clone()),
        tokenizer: setup.tokenizer.map(Arc::new),
        scheduler: queue,
        metrics,
        limits: Arc::new(setup.limits),
        api_keys: Arc::new(setup.api_keys),
        loaded: Arc::new(AtomicBool::new(false)),
        memory: Default::default(),
        stages: Default::default(),
        draining: Arc::new(AtomicBool::new(false)),
        abandon: CancellationToken::new(),
        selfcheck: Arc::new(SelfCheckState::new(setup.selfcheck)),
    };
    let shutdown = CancellationToken::new();
    // Readiness flips once every worker has its model; a failed load stops the server.
    let load_error = Arc::new(std::sync::Mutex::new(None::<String>));
    {
        let failed = load_error.clone();
        let loaded = state.loaded.clone();
        let scheduler = state.scheduler.clone();
        let probes = state.memory.clone();
        let stages = state.stages.clone();
        let limits = state.limits.clone();
        let auto_size = setup.auto_batch_tokens;
        let n = setup.devices.len();
        let stop = shutdown.clone();
        let selfcheck = state.selfcheck.clone();
        let metrics = state.metrics.clone();
        let num_layers = state.info.num_layers;
        std::thread::spawn(move || {
            let mut fits: Option<usize> = None;
            for _ in 0..n {
                match rx.recv() {
                    Ok(Ok(l)) => {
                        tracing::info!(device = %l.device, fits_tokens = ?l.max_batch_tokens, "model loaded");
                        if l.stages.len() > 1 {
                            let stages: Vec<String> = l
                                .stages
                                .iter()
                                .map(|s| {
                                    format!(
                                        "{} layers {}-{} ({} bytes)",
                                        s.device, s.first_layer, s.last_layer, s.weight_bytes
                                    )
                                })
                                .collect();
                            tracing::info!(device = %l.device, stages = %stages.join(", "), "stages of the replica");
                        }
                        if let Some(t) = l.max_batch_tokens {
                            fits = Some(fits.map_or(t, |f| f.min(t)));
                        }
                        if let Some(r) = l.selfcheck {
                            record_selfcheck(&r, &metrics, num_layers);
                            if let Ok(mut reports) = selfcheck.reports.lock() {
                                reports.push(r);
                            }
                        }
                        if let Ok(mut s) = stages.lock() {
                            s.push((l.device.clone(), l.stages));
                        }
                        if let Ok(mut p) = probes.lock() {
                            p.push((l.device, l.memory));
                        }
                    }
                    Ok(Err(e)) => {
                        tracing::error!(error = %e, "loading the model failed; stopping");
                        if let Ok(mut f) = failed.lock() {
                            *f = Some(e);
                        }
                        stop.cancel();
                        return;
                    }
                    Err(_) => {
                        tracing::error!("a worker exited before loading its model; stopping");
                        if let Ok(mut f) = failed.lock() {
                            *f = Some("a device worker exited before loading its model".into());
                        }
                        stop.cancel();
                        return;
                    }
                }
            }
            if let (true, Some(t)) = (auto_size, fits) {
                // Inputs longer than the budget run alone; the floor keeps packing short ones.
                let t = t.max(default::CPU_MAX_BATCH_TOKENS.min(limits.max_input_tokens));
                scheduler.set_max_batch_tokens(t);
                tracing::info!(
                    max_batch_tokens = t,
                    "batch budget sized from free device memory after loading: 80% of the smallest free memory \
                     over the devices (less one attention chunk of the longest input where the portable attention \
                     runs), divided by the activation bytes per token (all layers kept, q/k/v, MLP); longer inputs \
                     run alone"
                );
            }
            if !selfcheck_allows_readiness(&selfcheck, num_layers) {
                return;
            }
            loaded.store(true, Ordering::SeqCst);
            tracing::info!("ready");
        });
    }
    let addr = listener.local_addr()?;
    let task = tokio::spawn(serve(listener, state.clone(), workers, shutdown.clone(), drain_timeout));
    Ok(Running { addr, state, shutdown, task, load_error })
}

/// Exports one device's self-check and logs its figures.
fn record_selfcheck(r: &Report, metrics: &Metrics, num_layers: usize) {
    for &(index, e) in &r.errors {
        metrics.selfcheck_error.with_label_values(&[&r.device, &layer_name(index, num_layers)]).set(e);
    }
    metrics.selfcheck_seconds.with_label_values(&[&r.device]).set(r.seconds + r.waited_seconds);
    let (index, worst) = r.worst();
    tracing::info!(
        device = %r.device,
        worst_relative_error = worst,
        worst_index = %layer_name(index, num_layers),
        tolerance = r.tolerance,
        probe_seconds = r.seconds,
        reference_seconds = r.reference_seconds,
        waited_for_reference_seconds = r.waited_seconds,
        "self-check done"
    );
}

/// Whether the self-check's reports let the server turn ready: a failure refuses readiness
/// under `enforce` (logged once at ERROR; `/ready` answers selfcheck_failed) and is logged at
/// WARN under `warn`.
fn selfcheck_allows_readiness(s: &SelfCheckState, num_layers: usize) -> bool {
    let reports = s.reports.lock().map(|r| r.clone()).unwrap_or_default();
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.passed())
        .map(|r| {
            let (index, e) = r.worst();
            format!(
                "{}: index {} is off by {e:.3e} (relative), tolerance {:.1e} for {}",
                r.device,
                layer_name(index, num_layers),
                r.tolerance,
                r.dtype.name()
            )
        })
        .collect();
    if failed.is_empty() {
        return true;
    }
    let why = failed.join("; ");
    // Which is at fault: where the portable f32 reference is itself not finite, the checkpoint's
    // values overflow (or hold NaN) whatever path runs them.
    let checkpoint = reports.iter().find_map(|r| r.reference_nonfinite);
    let finding = match checkpoint {
        Some(index) => format!(
            "self-check failed: the checkpoint's own values are not finite: the portable f32 path (the reference) \
             gives NaN or infinity at index {} for the probe's tokens, so the model overflows or its weights are \
             damaged; no serving path can be exact for it ({why})",
            layer_name(index, num_layers)
        ),
        None => format!(
            "self-check failed: the serving path does not compute what the portable f32 path computes for this \
             checkpoint ({why}); its hidden states would be wrong. Report it with the model's config.json; \
             --selfcheck warn serves anyway"
        ),
    };
    if let Ok(mut f) = s.failed.lock() {
        *f = Some(finding.clone());
    }
    if s.mode == SelfCheckMode::Enforce {
        s.refused.store(true, Ordering::SeqCst);
        tracing::error!("{finding}; readiness refused");
        false
    } else {
        tracing::warn!("{finding}; serving anyway because of --selfcheck warn");
        true
    }
}

/// Runs the start-up self-check of `engine` on `device`: the probe through the engine, against
/// the portable f32 path (`reference`, shared by every device), or against `engine` itself, each
/// sequence alone, where it already is that path (the CPU in f32).
pub fn run_selfcheck(
    engine: &mut dyn Engine,
    files: &ModelFiles,
    device: &str,
    dtype: ComputeDType,
    reference: &SharedReference,
) -> Result<Report, EngineError> {
    let probe = Probe::new(files.config());
    tracing::info!(
        device,
        layers = probe.depth,
        tokens = probe.tokens(),
        "self-check: the probe through this device and through the portable f32 path"
    );
    let waiting = std::time::Instant::now();
    let own;
    let reference = if is_portable(device, dtype) {
        own = Reference::from_engine(engine, &probe)?;
        &own
    } else {
        let r = reference.get(files, &probe).as_ref();
        r.map_err(|e| EngineError::Load(format!("the self-check's reference could not be computed: {e}")))?
    };
    let waited = waiting.elapsed().as_secs_f64();
    let mut report = selfcheck::check(engine, &probe, reference, device, dtype)?;
    report.waited_seconds = waited;
    Ok(report)
}

/// A replica's name: its stages' devices, each once, joined by `+` (`cuda:0+cuda:1`; `cpu` for
/// a replica whose every stage is the CPU).
pub fn replica_name(devices: &[String]) -> String {
    let mut distinct: Vec<&str> = Vec::new();
    for d in devices {
        if !distinct.contains(&d.as_str()) {
            distinct.push(d);
        }
    }
    distinct.join("+")
}

/// Whether `device` in `dtype` runs the portable f32 path itself.
fn is_portable(device: &str, dtype: ComputeDType) -> bool {
    device == "cpu" && dtype == ComputeDType::Float32
}

/// `layertap serve`.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    args.validate().map_err(anyhow::Error::msg)?;
    args.validate_connections().map_err(anyhow::Error::msg)?;
    return_free_memory_periodically();
    let replicas = args.replicas().map_err(anyhow::Error::msg)?;
    // Each replica's worker is named by its devices ("cuda:0+cuda:1"; "cpu" for every stage on the CPU).
    let devices: Vec<String> = replicas.iter().map(|r| replica_name(r)).collect();
    let spec = args.model.clone();
    let (quantize, synthetic) = (args.quantize, args.synthetic_weights);
    let files = Arc::new(
        tokio::task::spawn_blocking(move || ModelFiles::locate_with(&spec, synthetic)?.quantize(quantize)).await??,
    );
    let tokenizer = TextTokenizer::from_source(&files.tokenizer_source()?)?;
    let cfg = files.config().clone();
    crate::engine::stages::check_stages(args.pipeline, cfg.num_hidden_layers)?;
    if let Some(t) = &tokenizer {
        if t.vocab_size() > cfg.vocab_size {
            tracing::warn!(
                tokenizer = t.vocab_size(),
                model = cfg.vocab_size,
                "the tokenizer knows more ids than the model"
            );
        }
    }
    let gpu = devices.iter().any(|d| d != "cpu");
    let tokens = args.token_limits(cfg.max_position_embeddings, gpu).map_err(anyhow::Error::msg)?;
    let max_batch_tokens = args.max_batch_tokens.unwrap_or(default::CPU_MAX_BATCH_TOKENS);
    let auto_batch_tokens = args.max_batch_tokens.is_none() && devices.iter().any(|d| d != "cpu");
    let max_input_tokens = tokens.input;
    let info = ModelInfo::new(&files.id, &cfg, args.dtype).with_head(files.has_head());
    let limits = Limits {
        max_connections: fit_open_file_limit(args.max_connections),
        ..Limits::from_args(&args, tokens, max_batch_tokens)
    };
    let listener = TcpListener::bind((args.host.as_str(), args.port)).await?;
    let weights = info.quantization.as_deref().unwrap_or("float");
    tracing::info!(addr = %listener.local_addr()?, model = %files.id, devices = ?devices, max_batch_tokens, weights, "listening; loading the model");
    let dtype: ComputeDType = args.dtype;
    let mode = args.selfcheck;
    // Computed on the CPU while the devices load, unless no device needs it.
    let reference = Arc::new(if mode != SelfCheckMode::Off && devices.iter().any(|d| !is_portable(d, dtype)) {
        SharedReference::start(files.clone())
    } else {
        SharedReference::default()
    });
    let stage_devices: std::collections::HashMap<String, Vec<String>> = devices.iter().cloned().zip(replicas).collect();
    let make = move |d: &str| -> EngineFactory {
        let files = files.clone();
        let reference = reference.clone();
        let d = d.to_string();
        let stage_devices = stage_devices.get(&d).cloned().unwrap_or_else(|| vec![d.clone()]);
        Box::new(move || {
            // Each device opened once, however many stages it serves.
            let mut opened: Vec<(&String, crate::engine::Device)> = Vec::new();
            for s in &stage_devices {
                if !opened.iter().any(|(name, _)| *name == s) {
                    opened.push((s, parse_device(s)?));
                }
            }
            let stages: Vec<_> = stage_devices
                .iter()
                .filter_map(|s| opened.iter().find(|(name, _)| *name == s).map(|(_, d)| d.clone()))
                .collect();
            let mut engine = files.load_stages(&stages, dtype.candle(), EngineOptions::startup())?.engine;
            let layout = engine.decoder.stages().iter().map(|s| s.layout()).collect();
            let selfcheck = match mode {
                SelfCheckMode::Off => None,
                _ => Some(run_selfcheck(&mut engine, &files, &d, dtype, &reference)?),
            };
            let memory = MemoryProbe::of(&stages);
            // Each stage's device sized on its own; the batch fits the tightest.
            let fits = stages
                .iter()
                .filter_map(|device| {
                    MemoryProbe::new(device).sample().map(|(used, total)| {
                        let free = total.saturating_sub(used);
                        tokens_for_memory(files.config(), device, dtype.candle(), free, max_input_tokens)
                    })
                })
                .min();
            Ok(LoadedEngine { engine: Box::new(engine), max_batch_tokens: fits, memory, selfcheck, stages: layout })
        })
    };
    let setup =
        Setup { info, tokenizer, devices, limits, api_keys: args.keys(), auto_batch_tokens, selfcheck: args.selfcheck };
    let running = start(listener, setup, make, Duration::from_secs(args.shutdown_timeout_s))?;
    let stop = running.shutdown.clone();
    let abandon = running.state.abandon.clone();
    tokio::spawn(async move {
        crate::signal::termination().await;
        stop.cancel();
        crate::signal::termination().await;
        tracing::warn!("second signal: answering what is still in flight with 503 now");
        abandon.cancel();
    });
    running.task.await??;
    match running.load_error.lock().ok().and_then(|mut e| e.take()) {
        Some(e) => Err(anyhow::anyhow!("loading the model failed: {e}")),
        None => Ok(()),
    }
}

/// File descriptors kept for everything but client connections (model files, the runtime,
/// logs, connections being refused).
const FD_RESERVE: usize = 128;

/// `want`, lowered so that the connections fit under the open-file limit (else accepting would
/// fail with EMFILE before the cap is reached).
fn fit_open_file_limit(want: usize) -> usize {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit only writes the struct it is given.
        let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0;
        if ok && r.rlim_cur != libc::RLIM_INFINITY {
            let room = (r.rlim_cur as usize).saturating_sub(FD_RESERVE).max(1);
            if room < want {
                tracing::warn!(
                    max_connections = room,
                    asked = want,
                    open_file_limit = r.rlim_cur,
                    "--max-connections lowered to fit the open-file limit (raise it with ulimit -n)"
                );
                return room;
            }
        }
    }
    want
}
