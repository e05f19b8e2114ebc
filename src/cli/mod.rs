//! Command-line interface: `layertap serve` (its flags in [`serve`]), `layertap bulk` ([`bulk`]),
//! `layertap extract` (one shot), `layertap bench` and `layertap openapi`.

mod bulk;
mod serve;

pub use bulk::{parse_shard, BulkArgs, BulkLayout, Shard};
pub use serve::{default, LogFormat, SelfCheckMode, ServeArgs, TokenLimits};

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::answer::LayerRef;
use crate::engine::{ComputeDType, OutDType, Quantize};

#[derive(Parser, Debug)]
#[command(
    name = "layertap",
    version,
    about = "Hidden states of chosen layers of a decoder LLM, exact to Hugging Face transformers"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one batch and write the hidden states to a safetensors file.
    Extract(ExtractArgs),
    /// Serve the HTTP API.
    Serve(ServeArgs),
    /// Print the OpenAPI document of the HTTP API.
    Openapi,
    /// Measure the engine's throughput in process on a workload file (see bench/).
    Bench(BenchArgs),
    /// Extract every row of a JSONL or Parquet file through running servers, one safetensors
    /// file per sample; resumes where it stopped.
    Bulk(BulkArgs),
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Workload sidecar JSON ({"layers": [...], "file": "x.jsonl"}).
    #[arg(long, default_value = "bench/workload_cpu.json")]
    pub workload: PathBuf,
    /// Model: a Hugging Face folder, a .gguf file, or a hub repo id.
    #[arg(long, default_value = ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: String,
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute and output dtype.
    #[arg(long, default_value = "f32")]
    pub dtype: ComputeDType,
    /// Quantise the float checkpoint's projections at load: fp8 is Qwen's block-wise FP8
    /// (e4m3 weights in 128x128 blocks, dynamic per-token fp8 activations; attention, MLP and
    /// expert projections, the Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj). Reads
    /// safetensors checkpoints with float weights only.
    #[arg(long, value_enum)]
    pub quantize: Option<Quantize>,
    /// Random weights of the real layout instead of a checkpoint, from the model folder's
    /// config.json and synthetic-weights.json (bench/gpu/synthetic_manifest.py): for shapes
    /// whose checkpoint is not at hand (speed does not depend on the weights' values).
    #[arg(long)]
    pub synthetic_weights: bool,
    /// Most tokens per forward pass.
    #[arg(long, default_value_t = 4096)]
    pub max_batch_tokens: usize,
    /// Split the decoder's layers into this many consecutive stages, all on --device (balanced
    /// by weight bytes, as `serve --pipeline` splits them over devices): what the stages cost
    /// against one.
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Time the workload with fp8 answers (quantised on the device, one scale per token and layer).
    #[arg(long)]
    pub fp8: bool,
    /// Time it without the non-finite screen (the service always screens): what the screen costs.
    #[arg(long)]
    pub no_screen: bool,
    /// Also return every row's top-K next-token log-probabilities (and its next token's): what
    /// the final norm, lm_head, log-softmax and top-k cost.
    #[arg(long)]
    pub top_k: Option<usize>,
}

#[derive(Args, Debug)]
pub struct ExtractArgs {
    /// Model: a Hugging Face folder, a .gguf file, or a hub repo id (owner/name).
    #[arg(long, env = "LAYERTAP_MODEL")]
    pub model: String,
    /// Hugging Face hidden_states indices, comma-separated: 0 = embeddings, i = output of decoder
    /// layer i, L (or -1) = final normed output; final_prenorm = the last layer's output before
    /// the final norm.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, required = true)]
    pub layers: Vec<LayerRef>,
    /// Token ids of one sequence, comma-separated; repeat the flag for several sequences.
    #[arg(long = "input-ids", value_delimiter = ';')]
    pub input_ids: Vec<String>,
    /// Text of one sequence, tokenized by the model's tokenizer; repeat for several.
    #[arg(long)]
    pub text: Vec<String>,
    /// Compute and output dtype: f32, bf16, f16 (or float32, bfloat16, float16).
    #[arg(long, default_value = "f32", env = "LAYERTAP_DTYPE")]
    pub dtype: ComputeDType,
    /// Quantise the float checkpoint's projections at load: fp8 is Qwen's block-wise FP8
    /// (e4m3 weights in 128x128 blocks, dynamic per-token fp8 activations; attention, MLP and
    /// expert projections, the Gated DeltaNet's in_proj_qkv, in_proj_z and out_proj). Reads
    /// safetensors checkpoints with float weights only.
    #[arg(long, value_enum, env = "LAYERTAP_QUANTIZE")]
    pub quantize: Option<Quantize>,
    /// Output dtype if different from the compute dtype (also fp8: float8_e4m3fn with one scale
    /// per token and layer, quantised on the device).
    #[arg(long = "out-dtype")]
    pub out_dtype: Option<OutDType>,
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu", env = "LAYERTAP_DEVICE")]
    pub device: String,
    /// Where to write the safetensors file.
    #[arg(long)]
    pub out: PathBuf,
    /// Write states holding NaN or infinity (as written, in the output dtype) instead of
    /// refusing; the file's `nonfinite` metadata counts them per layer.
    #[arg(long)]
    pub allow_nonfinite: bool,
}
