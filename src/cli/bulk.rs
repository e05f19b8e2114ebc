//! `layertap bulk`'s flags: the input, the servers, the output folder and its layout, shards.

use std::path::PathBuf;

use clap::Args;

use crate::answer::{LayerRef, Selection};

#[derive(Args, Debug, Clone, Default)]
pub struct BulkArgs {
    /// Server URL, e.g. http://localhost:8080; repeat it (or separate with commas) to spread the
    /// requests over several servers: each goes to the one with the fewest in flight, and a server
    /// that fails is left alone for a while.
    #[arg(long, env = "LAYERTAP_SERVER", value_delimiter = ',', required_unless_present = "verify")]
    pub server: Vec<String>,
    /// Input: a .parquet file (one of --text-column, --messages-column, --ids-column names the
    /// column to extract) or JSONL, each line {"input_ids": [...]} or {"text": "..."} or
    /// {"messages": [...]} with an optional "id".
    #[arg(long, required_unless_present = "verify")]
    pub input: Option<PathBuf>,
    /// Column of the text to extract (JSONL: the key read as "text").
    #[arg(long)]
    pub text_column: Option<String>,
    /// Column of the chats to extract, lists of {role, content} or ShareGPT's {from, value} (JSONL:
    /// the key read as "messages").
    #[arg(long)]
    pub messages_column: Option<String>,
    /// Column of the token ids to extract, lists of integers (JSONL: the key read as "input_ids").
    #[arg(long)]
    pub ids_column: Option<String>,
    /// Column of the sample ids; where the input has none, a Parquet row's id is its row number
    /// (from 0) and a JSONL line's is line-N (N from 1).
    #[arg(long, default_value = "id")]
    pub id_column: String,
    /// This worker's part of the input, I/N (0 <= I < N): the samples whose id's xxh64 modulo N
    /// is I. Its manifest and failures are manifest-I-of-N.jsonl and failures-I-of-N.jsonl;
    /// with --verify, only that manifest is checked.
    #[arg(long, value_parser = parse_shard)]
    pub shard: Option<Shard>,
    /// Output folder (manifests, failures and the samples' files).
    #[arg(long)]
    pub out: PathBuf,
    /// Hugging Face hidden_states indices, comma-separated (negative from the end); the name
    /// final_prenorm asks for the last decoder layer's output before the final norm.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, required_unless_present = "verify")]
    pub layers: Vec<LayerRef>,
    /// Output dtype: float32, bfloat16, float16 or fp8 (float8_e4m3fn, with per-token scales;
    /// default: the server's).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Requests kept in flight (with --verify: files checked at once).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Bearer token for a server started with --api-key.
    #[arg(long, env = "LAYERTAP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Retries per sample on 429, 5xx, connection errors and answers that fail their checksums
    /// (exponential backoff).
    #[arg(long, default_value_t = 8)]
    pub retries: usize,
    /// Seconds one request may take (more than 0; fractions allowed).
    #[arg(long, default_value = "600", value_parser = parse_timeout)]
    pub timeout_s: f64,
    /// Re-read every file the manifests of --out list (all of them, or --shard's only) and check
    /// it against its checksums; files missing or corrupt are reported and dropped from their
    /// manifest (the next run redoes them).
    #[arg(long)]
    pub verify: bool,
    /// Files written: plain (shard-NNNNN/ID-HASH.safetensors: the id made safe for a file name and
    /// the xxh64 of the exact id; the server's answer as it is) or
    /// speculators (hs_I.safetensors with hidden_states and token_ids, and hidden_states_scales for
    /// fp8; I the sample's index in the input, as speculators' trainers read them).
    #[arg(long, value_enum, default_value_t = BulkLayout::Plain)]
    pub layout: BulkLayout,
    /// Rows kept of each sample: all, assistant (rows whose loss_mask is 1) or last:K.
    #[arg(long, default_value = "all", value_parser = Selection::parse_flag)]
    pub tokens: Selection,
    /// Also the teacher's top-K next-token log-probabilities of every returned row (1 to the
    /// server's max_top_k): topk_ids [rows, K] int64 and topk_logprobs [rows, K] float32 in each
    /// file (plain layout only).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Template variables for every chat, a JSON object, as transformers'
    /// apply_chat_template(**kwargs) takes them (e.g. '{"reasoning_effort": "high"}' for gpt-oss,
    /// '{"enable_thinking": false}' for Qwen3); a line's own "chat_template_kwargs" override
    /// them key by key. Recorded in the folder's bulk.json.
    #[arg(long, value_parser = parse_template_kwargs)]
    pub chat_template_kwargs: Option<crate::tokenizer::TemplateKwargs>,
    /// With --top-k: also target_logprobs [rows] float32, the log-probability of each row's next
    /// input token (NaN on a sample's last token).
    #[arg(long, requires = "top_k")]
    pub target_logprobs: bool,
}

/// One worker's part of a `layertap bulk` input: the samples whose id hashes to `index` modulo
/// `count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: u64,
    pub count: u64,
}

impl Shard {
    /// Whether the sample `id` is this shard's: xxh64 (seed 0) of its UTF-8 bytes, modulo N.
    pub fn holds(self, id: &str) -> bool {
        xxhash_rust::xxh64::xxh64(id.as_bytes(), 0) % self.count == self.index
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

/// Parses `--shard I/N`: whole numbers with N >= 1 and 0 <= I < N.
pub fn parse_shard(s: &str) -> Result<Shard, String> {
    let (i, n) = s
        .trim()
        .split_once('/')
        .ok_or_else(|| format!("{s:?}: --shard takes I/N, e.g. 0/4 for the first of four workers"))?;
    let num = |x: &str, what: &str| {
        x.trim().parse::<u64>().map_err(|_| format!("{s:?}: --shard I/N needs whole numbers; {what} is {x:?}"))
    };
    let (index, count) = (num(i, "I")?, num(n, "N")?);
    if count == 0 {
        return Err(format!("{s:?}: --shard I/N needs N >= 1 workers"));
    }
    if index >= count {
        return Err(format!("{s:?}: --shard I/N needs 0 <= I < N (workers are numbered from 0 to {})", count - 1));
    }
    Ok(Shard { index, count })
}

/// Parses `--chat-template-kwargs`: a JSON object, without the variables the server sets itself.
pub fn parse_template_kwargs(s: &str) -> Result<crate::tokenizer::TemplateKwargs, String> {
    let v: serde_json::Value =
        serde_json::from_str(s).map_err(|e| format!("--chat-template-kwargs takes a JSON object: {e}"))?;
    let serde_json::Value::Object(kwargs) = v else {
        return Err(format!("--chat-template-kwargs takes a JSON object, not {s}"));
    };
    crate::tokenizer::check_template_kwargs(&kwargs).map_err(|e| format!("--chat-template-kwargs: {e}"))?;
    Ok(kwargs)
}

/// Parses `--timeout-s`: a number of seconds, more than 0 and finite (under 3e9, some 95 years,
/// so that the deadline it sets can be reckoned).
pub fn parse_timeout(s: &str) -> Result<f64, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("{s:?}: --timeout-s takes a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0 && secs < 3.0e9) {
        return Err(format!("{s:?}: --timeout-s needs a number of seconds more than 0 and finite (under 3e9)"));
    }
    Ok(secs)
}

/// How `layertap bulk` lays out its files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BulkLayout {
    /// `shard-NNNNN/ID-HASH.safetensors`: the answer as the server sent it.
    #[default]
    Plain,
    /// `hs_I.safetensors`: `hidden_states` and `token_ids` (and `hidden_states_scales` for fp8), as
    /// speculators and hs-connectors read them.
    Speculators,
}
