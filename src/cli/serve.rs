//! `layertap serve`'s flags: the model, the devices, and every limit the server enforces, with
//! their defaults written once.

use clap::Args;

use crate::engine::{ComputeDType, Quantize};

/// What the start-up self-check does with its verdict (see `--selfcheck`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SelfCheckMode {
    /// No self-check.
    Off,
    /// Run it, report it (metrics, /v1/info), and turn ready even when it fails (logged at WARN).
    Warn,
    /// Run it, report it, and stay unready when it fails (logged at ERROR).
    #[default]
    Enforce,
}

impl SelfCheckMode {
    pub fn name(self) -> &'static str {
        match self {
            SelfCheckMode::Off => "off",
            SelfCheckMode::Warn => "warn",
            SelfCheckMode::Enforce => "enforce",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Model: a Hugging Face folder, a .gguf file, or a hub repo id (owner/name).
    #[arg(long, env = "LAYERTAP_MODEL")]
    pub model: String,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0", env = "LAYERTAP_HOST")]
    pub host: String,
    /// Port to listen on (0 picks a free one and logs it).
    #[arg(long, default_value_t = 8080, env = "LAYERTAP_PORT")]
    pub port: u16,
    /// Devices: cpu, cuda:0, cuda:0,1 or cuda:all. One resident model per device.
    #[arg(long, default_value = "cpu", env = "LAYERTAP_DEVICE")]
    pub device: String,
    /// Compute dtype (also the default output dtype): f32, bf16 or f16.
    #[arg(long, default_value = "f32", env = "LAYERTAP_DTYPE")]
    pub dtype: ComputeDType,
    /// Stages per replica: the decoder's layers split into N consecutive stages, each on its own
    /// device, balanced by weight bytes (the embeddings with the first, the final norm and head
    /// with the last). The devices are grouped in order: --device cuda:0,1,2,3 --pipeline 2 makes
    /// two replicas of two stages; on the CPU every stage is the CPU. The device count must be a
    /// multiple of N, and N at most the model's layer count.
    #[arg(long, default_value_t = 1, env = "LAYERTAP_PIPELINE")]
    pub pipeline: usize,
    /// Quantise the float checkpoint's projections at load: fp8 is Qwen's block-wise FP8
    /// (e4m3 weights in 128x128 blocks, dynamic per-token fp8 activations; attention, MLP and
    /// expert projections, the Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj). Reads
    /// safetensors checkpoints with float weights only.
    #[arg(long, value_enum, env = "LAYERTAP_QUANTIZE")]
    pub quantize: Option<Quantize>,
    /// Benchmarks only: serve random weights of the real layout instead of a checkpoint, from the
    /// model folder's config.json and synthetic-weights.json (made by
    /// bench/gpu/synthetic_manifest.py). The hidden states mean nothing; /v1/info's model id says
    /// "(synthetic weights)".
    /// LAYERTAP_SYNTHETIC_WEIGHTS takes 1/0, true/false, yes/no, on/off.
    #[arg(long, env = "LAYERTAP_SYNTHETIC_WEIGHTS", value_parser = clap::builder::BoolishValueParser::new())]
    pub synthetic_weights: bool,
    /// Most tokens in one forward pass (a longer input runs alone). Default: 1024 on CPU; on CUDA sized from free memory after loading.
    #[arg(long, env = "LAYERTAP_MAX_BATCH_TOKENS")]
    pub max_batch_tokens: Option<usize>,
    /// Longest single input in tokens; longer ones are refused with 413. Default: on CUDA the
    /// model's context length (max_position_embeddings: an input longer than the batch budget
    /// runs in a batch of its own), on the CPU 8192.
    #[arg(long, env = "LAYERTAP_MAX_INPUT_TOKENS")]
    pub max_input_tokens: Option<usize>,
    /// Most tokens waiting in the queue; past it requests are refused with 429 and Retry-After.
    /// Default: 131072, or the longest input when that is longer.
    #[arg(long, env = "LAYERTAP_MAX_QUEUE_TOKENS")]
    pub max_queue_tokens: Option<usize>,
    /// Bearer tokens accepted on /v1 routes (comma-separated or repeated). None: no auth.
    #[arg(long = "api-key", env = "LAYERTAP_API_KEY", value_delimiter = ',', hide_env_values = true)]
    pub api_keys: Vec<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = default::MAX_BODY_BYTES, env = "LAYERTAP_MAX_BODY_BYTES")]
    pub max_body_bytes: usize,
    /// Most hidden-state values in a JSON answer (Accept: application/json).
    #[arg(long, default_value_t = default::MAX_JSON_VALUES, env = "LAYERTAP_MAX_JSON_VALUES")]
    pub max_json_values: usize,
    /// zstd level for answers: 1-22 (higher is smaller and slower), or -7 to -1, zstd's fast
    /// levels (faster still, larger). Default 1: on bf16 states it compresses as much as 3 with
    /// two thirds of the CPU; the fast levels compress them hardly at all.
    #[arg(long, default_value_t = default::ZSTD_LEVEL, env = "LAYERTAP_ZSTD_LEVEL", allow_negative_numbers = true)]
    pub zstd_level: i32,
    /// Seconds a request may take end to end before it is answered 503.
    #[arg(long = "request-timeout", default_value_t = default::REQUEST_TIMEOUT_S, env = "LAYERTAP_REQUEST_TIMEOUT")]
    pub request_timeout_s: u64,
    /// Seconds to let in-flight requests finish on SIGTERM/SIGINT before exiting.
    #[arg(long = "shutdown-timeout", default_value_t = 30, env = "LAYERTAP_SHUTDOWN_TIMEOUT")]
    pub shutdown_timeout_s: u64,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "LAYERTAP_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Start-up self-check: before turning ready, each device runs a fixed probe (four short
    /// sequences, packed) through its first layers and compares every hidden-state index with the
    /// portable f32 path; `enforce` stays unready when an index is off by more than the compute
    /// dtype's tolerance, `warn` only logs it, `off` skips it.
    #[arg(long, value_enum, default_value_t = SelfCheckMode::Enforce, env = "LAYERTAP_SELFCHECK")]
    pub selfcheck: SelfCheckMode,
    /// Most tokens in one request over all its inputs; more is refused with 413 before any work.
    /// Default: 65536 (or --max-queue-tokens when that is smaller), at least the longest input.
    #[arg(long, env = "LAYERTAP_MAX_REQUEST_TOKENS")]
    pub max_request_tokens: Option<usize>,
    /// Most inputs in one request.
    #[arg(long, default_value_t = default::MAX_INPUTS, env = "LAYERTAP_MAX_INPUTS")]
    pub max_inputs: usize,
    /// Most messages in one chat input (rendering a chat costs messages x assistant turns).
    #[arg(long, default_value_t = default::MAX_MESSAGES, env = "LAYERTAP_MAX_MESSAGES")]
    pub max_messages: usize,
    /// Largest answer in bytes of hidden states (before compression), in every encoding.
    #[arg(long, default_value_t = default::MAX_ANSWER_BYTES, env = "LAYERTAP_MAX_ANSWER_BYTES")]
    pub max_answer_bytes: usize,
    /// Largest `logprobs.top_k` a request may ask (1 to 64): the top-k next-token
    /// log-probabilities returned next to the hidden states.
    #[arg(long, default_value_t = default::MAX_TOP_K, env = "LAYERTAP_MAX_TOP_K")]
    pub max_top_k: usize,
    /// Seconds a client has to send a request's line and headers (from accept, or from the first
    /// byte of a later request on a keep-alive connection); then the connection is closed.
    #[arg(long = "header-read-timeout", default_value_t = default::HEADER_READ_TIMEOUT_S, env = "LAYERTAP_HEADER_READ_TIMEOUT")]
    pub header_read_timeout_s: u64,
    /// Seconds a client has to send a request's whole body once its headers are in; then 408.
    #[arg(long = "body-read-timeout", default_value_t = default::BODY_READ_TIMEOUT_S, env = "LAYERTAP_BODY_READ_TIMEOUT")]
    pub body_read_timeout_s: u64,
    /// Seconds an idle keep-alive connection stays open (and the longest a response write may
    /// stay blocked on a client that does not read).
    #[arg(long = "idle-timeout", default_value_t = default::IDLE_TIMEOUT_S, env = "LAYERTAP_IDLE_TIMEOUT")]
    pub idle_timeout_s: u64,
    /// Most open client connections; past it a new connection gets 503 and is closed at once.
    /// Lowered to fit the open-file limit when that is smaller.
    #[arg(long, default_value_t = default::MAX_CONNECTIONS, env = "LAYERTAP_MAX_CONNECTIONS")]
    pub max_connections: usize,
}

/// The defaults of `layertap serve`'s limits, the one place they are written: the flags and
/// [`crate::http::Limits::default`] both read them.
pub mod default {
    /// Tokens in one forward pass on the CPU unless `--max-batch-tokens` says otherwise: a batch of
    /// this many tokens of the default model takes seconds on two cores, and larger batches are
    /// no faster per token there. A longer input still runs, in a batch of its own.
    pub const CPU_MAX_BATCH_TOKENS: usize = 1024;
    /// The longest input on the CPU unless `--max-input-tokens` says otherwise.
    pub const CPU_MAX_INPUT_TOKENS: usize = 8192;
    /// The queue's size in tokens unless `--max-queue-tokens` (or a longer input) says otherwise.
    pub const MAX_QUEUE_TOKENS: usize = 131072;
    /// Tokens in one request unless `--max-request-tokens` (or the queue, or a longer input) says
    /// otherwise.
    pub const MAX_REQUEST_TOKENS: usize = 65536;
    pub const MAX_BODY_BYTES: usize = 64 << 20;
    pub const MAX_JSON_VALUES: usize = 4 << 20;
    pub const ZSTD_LEVEL: i32 = 1;
    pub const REQUEST_TIMEOUT_S: u64 = 600;
    pub const MAX_INPUTS: usize = 1024;
    pub const MAX_MESSAGES: usize = 512;
    pub const MAX_ANSWER_BYTES: usize = 2 << 30;
    pub const MAX_TOP_K: usize = 64;
    pub const HEADER_READ_TIMEOUT_S: u64 = 10;
    pub const BODY_READ_TIMEOUT_S: u64 = 60;
    pub const IDLE_TIMEOUT_S: u64 = 75;
    pub const MAX_CONNECTIONS: usize = 1024;
}

/// The token limits in force once the model is known: one input, the queue, one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenLimits {
    pub input: usize,
    pub queue: usize,
    pub request: usize,
}

impl TokenLimits {
    /// The limits from `[--max-input-tokens, --max-queue-tokens, --max-request-tokens]` (each
    /// optional) for a model of `context` tokens, served on GPUs or the CPU: see
    /// [`ServeArgs::token_limits`].
    pub fn resolve(flags: [Option<usize>; 3], context: usize, gpu: bool) -> Result<TokenLimits, String> {
        let [max_input, max_queue, max_request] = flags;
        let input = max_input.unwrap_or(if gpu { context.max(1) } else { default::CPU_MAX_INPUT_TOKENS });
        if input == 0 {
            return Err("--max-input-tokens must be positive".into());
        }
        let queue = max_queue.unwrap_or(default::MAX_QUEUE_TOKENS.max(input));
        if queue < input {
            return Err(format!("--max-queue-tokens ({queue}) must be at least --max-input-tokens ({input})"));
        }
        let request = max_request.unwrap_or(queue.min(default::MAX_REQUEST_TOKENS).max(input));
        if request < input || request > queue {
            return Err(format!(
                "--max-request-tokens ({request}) must be at least --max-input-tokens ({input}) and at most \
                 --max-queue-tokens ({queue})"
            ));
        }
        Ok(TokenLimits { input, queue, request })
    }
}

impl ServeArgs {
    /// Checks that the limits other than the token limits are consistent ([`ServeArgs::token_limits`]
    /// checks those once the model is known); the message says which flag to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_inputs == 0 || self.max_messages == 0 || self.max_answer_bytes == 0 {
            return Err("--max-inputs, --max-messages and --max-answer-bytes must be positive".into());
        }
        if !(1..=crate::engine::MAX_TOP_K).contains(&self.max_top_k) {
            return Err(format!("--max-top-k must be between 1 and {}", crate::engine::MAX_TOP_K));
        }
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(
                "--api-key / LAYERTAP_API_KEY holds an empty key; remove it (or unset the variable for no auth)".into(),
            );
        }
        if !(1..=22).contains(&self.zstd_level) && !(-7..=-1).contains(&self.zstd_level) {
            return Err("--zstd-level must be between 1 and 22, or a fast level from -7 to -1".into());
        }
        Ok(())
    }

    /// The token limits for a model of `context` tokens (its max_position_embeddings), served on
    /// GPUs (`gpu`) or the CPU, with the defaults filled in: the longest input is the model's
    /// context on GPUs and [`default::CPU_MAX_INPUT_TOKENS`] on the CPU; the queue holds
    /// [`default::MAX_QUEUE_TOKENS`] or the longest input; a request [`default::MAX_REQUEST_TOKENS`] (at most the
    /// queue, at least the longest input). Checked for consistency; the message says which flag
    /// to change.
    pub fn token_limits(&self, context: usize, gpu: bool) -> Result<TokenLimits, String> {
        TokenLimits::resolve([self.max_input_tokens, self.max_queue_tokens, self.max_request_tokens], context, gpu)
    }

    /// The API keys as they will be compared: surrounding whitespace removed (`--api-key 'k1, k2'`
    /// means k1 and k2; a header value never carries such whitespace).
    pub fn keys(&self) -> Vec<String> {
        self.api_keys.iter().map(|k| k.trim().to_string()).collect()
    }

    /// The device list: `cpu`, `cuda:0`, `cuda:0,1`, or `cuda:all` (every visible GPU).
    pub fn devices(&self) -> Result<Vec<String>, String> {
        let d = self.device.trim();
        if d == "cpu" {
            return Ok(vec!["cpu".into()]);
        }
        let rest = d
            .strip_prefix("cuda:")
            .ok_or_else(|| format!("unknown --device {d:?}; use cpu, cuda:0, cuda:0,1 or cuda:all"))?;
        if rest == "all" {
            let n = crate::engine::cuda_device_count();
            if n == 0 {
                return Err(
                    "--device cuda:all: no CUDA device is visible (or layertap was built without --features cuda)"
                        .into(),
                );
            }
            return Ok((0..n).map(|i| format!("cuda:{i}")).collect());
        }
        rest.split(',')
            .map(|i| {
                i.trim()
                    .parse::<usize>()
                    .map(|i| format!("cuda:{i}"))
                    .map_err(|_| format!("bad device index {i:?} in --device"))
            })
            .collect()
    }

    /// The replicas: each one's devices, one per stage, in order (`--device` grouped by
    /// `--pipeline`). On the CPU, one replica whose every stage is the CPU; with CUDA devices,
    /// as many replicas as the device count holds `--pipeline`s, refused unless it holds a whole
    /// number of them.
    pub fn replicas(&self) -> Result<Vec<Vec<String>>, String> {
        let n = self.pipeline;
        if n < 1 {
            return Err(format!("--pipeline {n}: a replica needs at least 1 stage"));
        }
        let devices = self.devices()?;
        if devices == ["cpu"] {
            return Ok(vec![vec!["cpu".into(); n]]);
        }
        if devices.len() % n != 0 {
            return Err(format!(
                "--pipeline {n} needs a multiple of {n} devices (each replica takes {n}, grouped in order); --device \
                 names {} ({})",
                devices.len(),
                devices.join(",")
            ));
        }
        Ok(devices.chunks(n).map(<[String]>::to_vec).collect())
    }

    /// Checks the connection limits (timeouts and the connection cap must be positive).
    pub fn validate_connections(&self) -> Result<(), String> {
        for (v, flag) in [
            (self.header_read_timeout_s, "--header-read-timeout"),
            (self.body_read_timeout_s, "--body-read-timeout"),
            (self.idle_timeout_s, "--idle-timeout"),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1 second"));
            }
        }
        if self.max_connections == 0 {
            return Err("--max-connections must be positive".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn serve(extra: &[&str]) -> Result<ServeArgs, String> {
        let mut args = vec!["layertap", "serve", "--model", "m"];
        args.extend_from_slice(extra);
        match Cli::try_parse_from(args).map_err(|e| e.to_string())?.command {
            Command::Serve(a) => a.validate().map(|_| a),
            _ => Err("not serve".into()),
        }
    }

    /// The longest input follows the model's context on GPUs and stays 8192 on the CPU; the
    /// queue and request limits make room for it; explicit flags win and are checked.
    #[test]
    fn token_limits_follow_the_model_on_gpus() {
        let t = |extra: &[&str], context, gpu| serve(extra).unwrap().token_limits(context, gpu);
        let limits = |input, queue, request| Ok(TokenLimits { input, queue, request });
        assert_eq!(t(&[], 262_144, true), limits(262_144, 262_144, 262_144));
        assert_eq!(t(&[], 40_960, true), limits(40_960, 131_072, 65_536));
        assert_eq!(t(&[], 262_144, false), limits(8192, 131_072, 65_536));
        assert_eq!(t(&["--max-input-tokens", "1000"], 262_144, true), limits(1000, 131_072, 65_536));
        assert_eq!(
            t(&["--max-queue-tokens", "4096"], 40_960, false),
            Err("--max-queue-tokens (4096) must be at least --max-input-tokens (8192)".to_string())
        );
        // An input longer than the batch budget runs in a batch of its own.
        assert_eq!(t(&["--max-batch-tokens", "32768"], 262_144, true), limits(262_144, 262_144, 262_144));
        let e = t(&["--max-request-tokens", "10"], 262_144, false).unwrap_err();
        assert!(e.contains("--max-request-tokens (10)"), "{e}");
    }

    /// zstd's fast levels (-7 to -1) and its ordinary ones (1 to 22) are accepted, as separate
    /// arguments too; 0 and the rest are refused with the range.
    /// The limits a server gets without flags are `http::Limits::default()`: one set of defaults.
    #[test]
    fn the_serving_limits_default_to_the_flags_defaults() {
        let a = serve(&[]).unwrap();
        let tokens = a.token_limits(32768, false).unwrap();
        let batch = a.max_batch_tokens.unwrap_or(default::CPU_MAX_BATCH_TOKENS);
        let from_flags = crate::http::Limits::from_args(&a, tokens, batch);
        assert_eq!(format!("{from_flags:?}"), format!("{:?}", crate::http::Limits::default()));
        assert_eq!((tokens.input, tokens.queue, tokens.request), (8192, 131072, 65536));
    }

    /// `--pipeline N` groups the devices in order, N per replica; the CPU serves every stage of
    /// one replica; a device count that is not a multiple of N, and N below 1, are refused with
    /// the numbers.
    #[test]
    fn pipeline_groups_the_devices_into_replicas() {
        let r = |extra: &[&str]| serve(extra).unwrap().replicas();
        let names = |v: &[&[&str]]| Ok(v.iter().map(|r| r.iter().map(|d| d.to_string()).collect()).collect());
        assert_eq!(r(&[]), names(&[&["cpu"]]));
        assert_eq!(r(&["--pipeline", "3"]), names(&[&["cpu", "cpu", "cpu"]]));
        assert_eq!(r(&["--device", "cuda:0,1"]), names(&[&["cuda:0"], &["cuda:1"]]));
        assert_eq!(
            r(&["--device", "cuda:0,1,2,3", "--pipeline", "2"]),
            names(&[&["cuda:0", "cuda:1"], &["cuda:2", "cuda:3"]])
        );
        assert_eq!(r(&["--device", "cuda:3,1", "--pipeline", "2"]), names(&[&["cuda:3", "cuda:1"]]));
        let e = r(&["--device", "cuda:0,1,2", "--pipeline", "2"]).unwrap_err();
        assert!(
            e.contains("--pipeline 2 needs a multiple of 2 devices") && e.contains("names 3 (cuda:0,cuda:1,cuda:2)"),
            "{e}"
        );
        let e = r(&["--pipeline", "0"]).unwrap_err();
        assert!(e.contains("--pipeline 0"), "{e}");
    }

    #[test]
    fn zstd_levels_fast_and_ordinary() {
        assert_eq!(serve(&["--zstd-level", "-3"]).unwrap().zstd_level, -3);
        assert_eq!(serve(&["--zstd-level=1"]).unwrap().zstd_level, 1);
        assert_eq!(serve(&[]).unwrap().zstd_level, 1);
        for bad in ["0", "23", "-8"] {
            let e = serve(&["--zstd-level", bad]).unwrap_err();
            assert!(e.contains("--zstd-level must be between 1 and 22"), "{bad}: {e}");
        }
    }
}
