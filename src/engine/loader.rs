//! Finding a model (local folder, GGUF file, or Hugging Face hub repo id) and loading it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};

use super::config::quant::Quantize;
use super::config::ModelConfig;
use super::decoder::Decoder;
use super::gguf::{GgufFile, GgufTensors, GgufTokenizerData};
use super::options::EngineOptions;
use super::synthetic::{SyntheticTensors, MANIFEST};
use super::weights::{Store, TensorSource, Weights};
use super::{ComputeDType, EngineError, ModelEngine, ModelInfo};

/// Where the tokenizer of a model comes from.
pub enum TokenizerSource {
    /// `tokenizer.json` plus optional `tokenizer_config.json` and `chat_template.jinja`.
    HfFiles {
        tokenizer_json: PathBuf,
        tokenizer_config: Option<PathBuf>,
        chat_template: Option<PathBuf>,
    },
    Gguf(Box<GgufTokenizerData>),
    /// The model ships no tokenizer: only token ids are accepted.
    None,
}

enum Files {
    Hf {
        config: ModelConfig,
        shards: Vec<PathBuf>,
    },
    /// `--synthetic-weights`: the random tensors of the folder's manifest.
    Synthetic {
        config: ModelConfig,
        tensors: Arc<SyntheticTensors>,
    },
    Gguf {
        file: Arc<GgufFile>,
        config: ModelConfig,
    },
}

/// A model located and its config read, ready to be loaded onto one or more devices.
pub struct ModelFiles {
    /// The model id reported to clients: the hub repo id, or the local folder or file name.
    pub id: String,
    files: Files,
    root: Option<PathBuf>,
}

/// Everything a one-shot run needs: the engine on its device and the model's description.
pub struct LoadedModel {
    pub engine: ModelEngine,
    pub info: ModelInfo,
}

fn err(msg: impl Into<String>) -> EngineError {
    EngineError::Load(msg.into())
}

fn read_json(path: &Path) -> Result<serde_json::Value, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read {}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| err(format!("{} is not valid JSON: {e}", path.display())))
}

/// Shard files of a Hugging Face folder: `model.safetensors` or those listed by the index.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        let synthetic = if dir.join(MANIFEST).is_file() {
            format!("; its {MANIFEST} describes random weights for benchmarks, served only with --synthetic-weights")
        } else {
            String::new()
        };
        return Err(err(format!(
            "{} has neither model.safetensors nor model.safetensors.index.json (only safetensors weights are \
             supported; convert .bin checkpoints with transformers' save_pretrained){synthetic}",
            dir.display()
        )));
    }
    let v = read_json(&index)?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| err(format!("{}: no \"weight_map\" object", index.display())))?;
    let mut names: Vec<&str> = map.values().filter_map(|s| s.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let files: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(err(format!("shard {} listed in {} is missing", missing.display(), index.display())));
    }
    Ok(files)
}

/// True when `spec` looks like `owner/name` on the hub rather than a local path.
fn looks_like_repo_id(spec: &str) -> bool {
    let parts: Vec<&str> = spec.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) && !p.starts_with('.')
        })
}

/// Fails fast (no hang) when the hub cannot be reached.
fn check_hub_reachable(endpoint: &str) -> Result<(), String> {
    use std::net::{TcpStream, ToSocketAddrs};
    let host = endpoint.trim_start_matches("https://").trim_start_matches("http://");
    let host = host.split('/').next().unwrap_or(host);
    let with_port = if host.contains(':') { host.to_string() } else { format!("{host}:443") };
    let addrs = with_port.to_socket_addrs().map_err(|e| format!("cannot resolve {host}: {e}"))?;
    for a in addrs {
        if TcpStream::connect_timeout(&a, Duration::from_secs(10)).is_ok() {
            return Ok(());
        }
    }
    Err(format!("cannot connect to {host}"))
}

fn download_from_hub(repo_id: &str) -> Result<PathBuf, EngineError> {
    let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let cache = hf_hub::Cache::from_env();
    let cached = cache.model(repo_id.to_string());
    let hint = "pass a local folder or .gguf file, or populate the Hugging Face cache (HF_HOME) on a machine with \
                network access";
    if let (Some(cfg), true) = (cached.get("config.json"), offline) {
        return cfg.parent().map(Path::to_path_buf).ok_or_else(|| err("bad cache path"));
    }
    if offline {
        return Err(err(format!("{repo_id:?} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {hint}")));
    }
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
    if let Err(why) = check_hub_reachable(&endpoint) {
        if let Some(cfg) = cached.get("config.json") {
            tracing::warn!("hub unreachable ({why}); using the cached copy of {repo_id}");
            return cfg.parent().map(Path::to_path_buf).ok_or_else(|| err("bad cache path"));
        }
        return Err(err(format!("cannot download {repo_id:?} from the Hugging Face hub: {why}; {hint}")));
    }
    let api = hf_hub::api::sync::ApiBuilder::from_env()
        .with_progress(true)
        .build()
        .map_err(|e| err(format!("hub client: {e}")))?;
    let repo = api.model(repo_id.to_string());
    let get = |f: &str| repo.get(f).map_err(|e| err(format!("downloading {f} of {repo_id:?}: {e}")));
    let config = get("config.json")?;
    for optional in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        let _ = repo.get(optional);
    }
    if repo.get("model.safetensors").is_err() {
        let index = get("model.safetensors.index.json")?;
        let v = read_json(&index)?;
        let mut shards: Vec<String> = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .map(|m| m.values().filter_map(|s| s.as_str().map(String::from)).collect())
            .unwrap_or_default();
        shards.sort();
        shards.dedup();
        for s in shards {
            get(&s)?;
        }
    }
    config.parent().map(Path::to_path_buf).ok_or_else(|| err("bad cache path"))
}

/// The id of a model on disk: its folder or file name, never the path (answers and /v1/info
/// are seen by clients, who have no business knowing the server's file system).
fn local_id(path: &Path) -> String {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    canonical.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}

impl ModelFiles {
    /// Locates the model named by `spec`: a folder, a `.gguf` file, or a hub repo id.
    pub fn locate(spec: &str) -> Result<Self, EngineError> {
        Self::locate_with(spec, false)
    }

    /// [`ModelFiles::locate`]; with `synthetic`, the folder `spec`'s config with the random
    /// weights its `synthetic-weights.json` describes instead of a checkpoint (benchmarks of
    /// shapes whose checkpoint is not at hand; see [`super::synthetic`]).
    pub fn locate_with(spec: &str, synthetic: bool) -> Result<Self, EngineError> {
        if synthetic {
            let dir = Path::new(spec);
            if !dir.join("config.json").is_file() || !dir.join(MANIFEST).is_file() {
                return Err(err(format!(
                    "--synthetic-weights reads a folder with config.json and {MANIFEST} (made by \
                     bench/gpu/synthetic_manifest.py); {spec:?} is not one"
                )));
            }
            let config = ModelConfig::from_hf_json(&read_json(&dir.join("config.json"))?)?;
            let tensors = Arc::new(SyntheticTensors::open(dir)?);
            tracing::warn!(model = %spec, "serving synthetic random weights (--synthetic-weights): for benchmarks only, \
                 the hidden states mean nothing");
            return Ok(ModelFiles {
                id: format!("{} (synthetic weights)", local_id(dir)),
                files: Files::Synthetic { config, tensors },
                root: Some(dir.to_path_buf()),
            });
        }
        let path = Path::new(spec);
        let dir = if path.is_file() {
            if path.extension().is_some_and(|e| e == "gguf") {
                let file = Arc::new(GgufFile::open(path)?);
                let config = file.model_config()?;
                return Ok(ModelFiles { id: local_id(path), files: Files::Gguf { file, config }, root: None });
            }
            return Err(err(format!("{spec} is a file but not a .gguf file; pass a model folder or a .gguf file")));
        } else if path.is_dir() {
            path.to_path_buf()
        } else if looks_like_repo_id(spec) {
            download_from_hub(spec)?
        } else {
            return Err(err(format!("{spec:?} is neither an existing path nor a Hugging Face repo id (owner/name)")));
        };
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            let ggufs: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map(|rd| {
                    rd.filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
                        .collect()
                })
                .unwrap_or_default();
            if let [one] = ggufs.as_slice() {
                return Self::locate(&one.to_string_lossy()).map(|mut m| {
                    m.id = if path.is_dir() { local_id(path) } else { spec.into() };
                    m
                });
            }
            return Err(err(format!("{} has no config.json (and not exactly one .gguf file)", dir.display())));
        }
        let config = ModelConfig::from_hf_json(&read_json(&config_path)?)?;
        let shards = shard_files(&dir)?;
        let id = if path.is_dir() { local_id(path) } else { spec.into() };
        Ok(ModelFiles { id, files: Files::Hf { config, shards }, root: Some(dir) })
    }

    /// These files with their float projections quantised at load as `quantize` says
    /// (`--quantize`; `None` leaves them as they are): every later load from them, the start-up
    /// self-check's reference included, reads the projections so, and the config says so
    /// (`/v1/info`). Refused for a GGUF file and for a checkpoint that declares its own
    /// quantisation.
    pub fn quantize(mut self, quantize: Option<Quantize>) -> Result<Self, EngineError> {
        let Some(q) = quantize else { return Ok(self) };
        let flag = q.flag();
        match &mut self.files {
            Files::Gguf { .. } => Err(err(format!(
                "{flag} reads safetensors checkpoints (float32, float16 or bfloat16 weights in a Hugging Face \
                 folder or hub repo); {:?} is a GGUF file, read in the types it stores: drop {flag}, or pass the \
                 model's safetensors checkpoint",
                self.id
            ))),
            Files::Hf { config, .. } | Files::Synthetic { config, .. } => match &config.quantization {
                Some(declared) => Err(err(format!(
                    "{flag} quantises float checkpoints, and the config.json of {:?} already declares its own \
                     quantization_config ({}): the checkpoint is read as it is quantised; drop {flag}",
                    self.id,
                    declared.describe()
                ))),
                None => {
                    let scheme = q.scheme();
                    super::config::quant::check_family(&scheme, config.family, &config.architecture)?;
                    config.quantization = Some(scheme);
                    Ok(self)
                }
            },
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match &self.files {
            Files::Hf { config, .. } | Files::Synthetic { config, .. } | Files::Gguf { config, .. } => config,
        }
    }

    pub fn tokenizer_source(&self) -> Result<TokenizerSource, EngineError> {
        match (&self.files, &self.root) {
            (Files::Gguf { file, .. }, _) => Ok(TokenizerSource::Gguf(Box::new(file.tokenizer_data()?))),
            (Files::Hf { .. } | Files::Synthetic { .. }, Some(root)) => {
                let tj = root.join("tokenizer.json");
                if !tj.is_file() {
                    return Ok(TokenizerSource::None);
                }
                let opt = |n: &str| Some(root.join(n)).filter(|p| p.is_file());
                Ok(TokenizerSource::HfFiles {
                    tokenizer_json: tj,
                    tokenizer_config: opt("tokenizer_config.json"),
                    chat_template: opt("chat_template.jinja"),
                })
            }
            _ => Ok(TokenizerSource::None),
        }
    }

    /// Whether the model has an output head: tied embeddings, or an `lm_head` tensor.
    pub fn has_head(&self) -> bool {
        self.config().tie_word_embeddings || self.weights(&[Device::Cpu], DType::F32).is_ok_and(|w| w.has_head())
    }

    /// The checkpoint's tensors, read onto `devices[0]` (the first stage's; the other stages
    /// read theirs onto their own) in `dtype`, checked before anything is loaded.
    fn weights(&self, devices: &[Device], dtype: DType) -> Result<Weights, EngineError> {
        let device = devices.first().ok_or_else(|| err("no device to load the model onto"))?;
        let needs = self.config().needs_beyond_cuda();
        if devices.iter().any(Device::is_cuda) && !needs.is_empty() {
            return Err(err(format!(
                "{} ({}) needs {}, which layertap's GPU paths do not compute yet (or not yet checked against transformers \
                 on a GPU); it runs exactly on the CPU \
                 (--device cpu). layertap refuses it on a CUDA device rather than return wrong hidden states",
                self.id,
                self.config().architecture,
                needs.join(", ")
            )));
        }
        let source = match &self.files {
            Files::Hf { shards, .. } => {
                // SAFETY: the files are memory-mapped read-only; layertap does not modify them while loaded.
                let tensors = unsafe { MmapedSafetensors::multi(shards) }
                    .map_err(|e| err(format!("cannot open safetensors shards: {e}")))?;
                TensorSource::Safetensors { files: shards.clone(), tensors: Store::Files(tensors) }
            }
            Files::Synthetic { tensors, .. } => {
                // Before anything is drawn: a manifest larger than the device's memory cannot
                // load, and is refused here rather than by an allocation failure.
                let mut distinct: Vec<&Device> = Vec::new();
                for d in devices {
                    if !distinct.iter().any(|o| o.same_device(d)) {
                        distinct.push(d);
                    }
                }
                let totals: Option<Vec<u64>> =
                    distinct.iter().map(|d| super::device_memory(d).map(|(_, total)| total)).collect();
                let (what, memory) = match totals {
                    Some(t) if t.len() > 1 => ("the stages' devices'", t.iter().sum()),
                    Some(t) => ("the device's", t.iter().sum()),
                    None => ("the host's", crate::metrics::host_memory().1),
                };
                let need = tensors.total_bytes() as u64;
                if memory > 0 && need > memory {
                    return Err(err(format!(
                        "{}: its tensors hold {:.1} GiB, more than {what} {:.1} GiB of memory: it cannot load here",
                        tensors.path().display(),
                        need as f64 / (1u64 << 30) as f64,
                        memory as f64 / (1u64 << 30) as f64
                    )));
                }
                TensorSource::Safetensors {
                    files: vec![tensors.path().to_path_buf()],
                    tensors: Store::Synthetic(tensors.clone()),
                }
            }
            Files::Gguf { file, config } => TensorSource::Gguf(GgufTensors::new(file.clone(), config)),
        };
        let quantization = self.config().quantization.clone();
        let weights = Weights::new(source, device.clone(), dtype).with_quantization(quantization);
        weights.check_before_load(self.config().num_hidden_layers, self.config().mtp_layers)?;
        Ok(weights)
    }

    /// Loads the decoder onto `device` in `dtype`, with a progress bar on a terminal, with this
    /// process's options ([`EngineOptions::startup`]: the `LAYERTAP_*` variables).
    pub fn load(&self, device: &Device, dtype: DType) -> Result<LoadedModel, EngineError> {
        self.load_with(device, dtype, EngineOptions::startup())
    }

    /// [`ModelFiles::load`] with the given options.
    pub fn load_with(
        &self,
        device: &Device,
        dtype: DType,
        options: &EngineOptions,
    ) -> Result<LoadedModel, EngineError> {
        self.load_stages(std::slice::from_ref(device), dtype, options)
    }

    /// The decoder in `devices.len()` consecutive stages (`--pipeline`), stage `k` on
    /// `devices[k]` (the same device may serve several), split where the stages' weight bytes
    /// come out most even ([`super::stages::split`]); one device is the ordinary decoder.
    pub fn load_stages(
        &self,
        devices: &[Device],
        dtype: DType,
        options: &EngineOptions,
    ) -> Result<LoadedModel, EngineError> {
        let config = self.config().clone();
        let mut weights = self.weights(devices, dtype)?;
        let bytes = weights.stage_bytes(config.num_hidden_layers, config.tie_word_embeddings);
        let stages = super::stages::plan(&bytes, devices)?;
        weights.fp8_gemm = options.fp8_gemm;
        weights.fp8_fused = options.fp8_fused;
        let bar = indicatif::ProgressBar::new(config.num_hidden_layers as u64).with_style(
            indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(self.id.clone());
        let decoder = Decoder::load(config.clone(), &mut weights, stages, options, |_, _| bar.inc(1));
        bar.finish_and_clear();
        let decoder = decoder?;
        weights.check_unread(config.num_hidden_layers)?;
        weights.check_finite()?;
        let mut info =
            ModelInfo::new(&self.id, &config, ComputeDType::from_candle(dtype)).with_head(decoder.head().is_some());
        if let Some(paths) = weights.fp8_summary() {
            tracing::info!(model = %self.id, devices = ?devices, "FP8 projections: {paths}");
            info.quantization = info.quantization.map(|q| format!("{q}; projections: {paths}"));
        }
        Ok(LoadedModel { engine: ModelEngine::new(decoder)?, info })
    }

    /// The model's first `depth` decoder layers on the CPU in f32 (the portable path), with the
    /// embedding rows of `tokens` only: token `tokens[i]` is id `i` for this engine. With
    /// `depth` below the model's layer count, index `depth + 1` ("final_prenorm" of the
    /// truncated decoder) is the output of layer `depth` and index `depth` is not that output
    /// (it has the final norm applied).
    pub fn load_prefix_f32(&self, depth: usize, tokens: &[u32]) -> Result<ModelEngine, EngineError> {
        let config = self.config().truncated(depth);
        let mut weights = self.weights(&[Device::Cpu], DType::F32)?;
        ModelEngine::new(Decoder::load_for_tokens(config, &mut weights, tokens, EngineOptions::startup())?)
    }
}

/// Locates and loads in one step (the one-shot path).
pub fn load(spec: &str, device: &Device, dtype: DType) -> Result<(LoadedModel, TokenizerSource), EngineError> {
    let files = ModelFiles::locate(spec)?;
    let model = files.load(device, dtype)?;
    Ok((model, files.tokenizer_source()?))
}
