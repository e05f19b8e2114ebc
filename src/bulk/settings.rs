//! What a `layertap bulk` folder is made with, pinned in its `bulk.json`: the settings that shape
//! its files (the layers, resolved for the model; the dtype; the token selection; the
//! log-probabilities; the layout; the chat template variables) and the model that answers, as
//! the servers' `/v1/info` describes it (id, architecture, layer count, hidden size, vocabulary,
//! compute dtype, quantisation, layer kinds, output head, tokenizer and chat template). `/v1/info` gives no
//! fingerprint of the weights: two checkpoints of one name and shape pass for the same model.
//!
//! Before anything is written, every server must describe the same model, and a folder that holds
//! a `bulk.json` must have been made with the same settings and model; otherwise the run stops,
//! saying what differs. A folder without one (written by an earlier version) is checked against
//! the metadata of a file it holds, then gets one. Every answer is checked against the pinned model
//! too, so a server that changes model during the run is caught.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::manifest::manifests;
use super::paths::file_inside;
use crate::answer::LayerSet;
use crate::cli::{BulkArgs, BulkLayout};
use crate::engine::OutDType;

/// The settings file of a bulk folder.
pub(super) const SETTINGS: &str = "bulk.json";

/// The fields of `/v1/info` that say which model answers and how it computes.
const MODEL_KEYS: [&str; 11] = [
    "model_id",
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "dtype",
    "quantization",
    "layer_kinds",
    "lm_head",
    "has_tokenizer",
    "has_chat_template",
];

/// The settings recorded, with the flag that sets each.
const SETTING_FLAGS: [(&str, &str); 7] = [
    ("layers", "--layers"),
    ("dtype", "--dtype"),
    ("tokens", "--tokens"),
    ("top_k", "--top-k"),
    ("target_logprobs", "--target-logprobs"),
    ("layout", "--layout"),
    ("chat_template_kwargs", "--chat-template-kwargs"),
];

/// What a run makes its files with: the settings and the model, as `bulk.json` records them.
pub(super) struct Pinned {
    pub settings: Map<String, Value>,
    pub model: Map<String, Value>,
}

impl Pinned {
    fn to_json(&self) -> Value {
        json!({"format": "layertap-bulk/1", "settings": self.settings, "model": self.model})
    }

    /// What every answer's metadata must say: model, architecture, layer count, layers, dtype.
    pub fn expected_metadata(&self) -> Vec<(&'static str, String)> {
        let text = |v: &Value| v.as_str().map(String::from).unwrap_or_else(|| v.to_string());
        vec![
            ("model", text(&self.model["model_id"])),
            ("architecture", text(&self.model["architecture"])),
            ("num_layers", text(&self.model["num_layers"])),
            ("layers", self.settings["layers"].to_string()),
            ("dtype", text(&self.settings["dtype"])),
        ]
    }
}

/// `GET /v1/info` of one server, retried (connection errors, 5xx) with a growing pause.
async fn server_info(client: &reqwest::Client, a: &BulkArgs, base: &str) -> anyhow::Result<Value> {
    let url = format!("{}/v1/info", base.trim_end_matches('/'));
    let mut pause = Duration::from_millis(500);
    let mut attempt = 0;
    loop {
        let mut req = client.get(&url);
        if let Some(k) = &a.api_key {
            req = req.bearer_auth(k);
        }
        let why = match req.send().await {
            Ok(r) if r.status().is_success() => {
                let body = r.bytes().await.map_err(|e| anyhow::anyhow!("reading {url}: {e}"))?;
                return serde_json::from_slice::<Value>(&body)
                    .ok()
                    .filter(Value::is_object)
                    .ok_or_else(|| anyhow::anyhow!("{url} answered something other than a JSON object"));
            }
            Ok(r) if !r.status().is_server_error() => {
                let status = r.status();
                anyhow::bail!("{url} answered HTTP {status}: {}", r.text().await.unwrap_or_default())
            }
            Ok(r) => format!("HTTP {}", r.status()),
            Err(e) => e.to_string(),
        };
        attempt += 1;
        if attempt > a.retries {
            anyhow::bail!(
                "cannot read the model of server {base} ({url}: {why}, {attempt} attempts): every --server must \
                 answer /v1/info at the start, so that its model can be checked against the others' and the folder's"
            );
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// The model fields of a `/v1/info` answer.
fn model_of(info: &Value) -> Map<String, Value> {
    MODEL_KEYS.iter().map(|&k| (k.to_string(), info.get(k).cloned().unwrap_or(Value::Null))).collect()
}

/// `key: A against B` for each key where `a` and `b` differ.
fn differences(keys: &[(&str, &str)], a: &Map<String, Value>, b: &Map<String, Value>) -> Vec<String> {
    keys.iter()
        .filter(|(k, _)| a.get(*k).unwrap_or(&Value::Null) != b.get(*k).unwrap_or(&Value::Null))
        .map(|(k, name)| {
            format!("{name}: {} against {}", a.get(*k).unwrap_or(&Value::Null), b.get(*k).unwrap_or(&Value::Null))
        })
        .collect()
}

fn model_keys() -> Vec<(&'static str, &'static str)> {
    MODEL_KEYS.iter().map(|&k| (k, k)).collect()
}

/// Asks every server what it serves and refuses servers that differ; then the run's settings
/// for that model (the layers resolved, the dtype by its canonical name: the server's own where
/// `--dtype` is not given).
pub(super) async fn pin_servers(client: &reqwest::Client, a: &BulkArgs, servers: &[String]) -> anyhow::Result<Pinned> {
    let infos = futures::future::try_join_all(servers.iter().map(|s| server_info(client, a, s))).await?;
    let model = model_of(&infos[0]);
    for (s, info) in servers.iter().zip(&infos).skip(1) {
        let diff = differences(&model_keys(), &model, &model_of(info));
        if !diff.is_empty() {
            anyhow::bail!(
                "the servers serve different models: {} against {} ({}); every --server must serve the same model, \
                 or the folder would mix their states",
                servers[0],
                s,
                diff.join("; ")
            );
        }
    }
    let num_layers = model["num_layers"].as_u64().ok_or_else(|| {
        anyhow::anyhow!("server {}'s /v1/info gives no num_layers: is it a layertap server?", servers[0])
    })? as usize;
    let layers = LayerSet::resolve(&a.layers, num_layers).map_err(|e| anyhow::anyhow!("--layers: {e}"))?;
    let dtype = match &a.dtype {
        Some(d) => OutDType::parse(d)
            .ok_or_else(|| anyhow::anyhow!("--dtype: {}", d.parse::<OutDType>().err().unwrap_or_default()))?
            .name()
            .to_string(),
        None => model["dtype"].as_str().unwrap_or_default().to_string(),
    };
    let layout = match a.layout {
        BulkLayout::Plain => "plain",
        BulkLayout::Speculators => "speculators",
    };
    let settings = json!({
        "layers": layers.labels(),
        "dtype": dtype,
        "tokens": a.tokens.label(),
        "top_k": a.top_k,
        "target_logprobs": a.target_logprobs,
        "layout": layout,
        "chat_template_kwargs": a.chat_template_kwargs,
    });
    let Value::Object(settings) = settings else { unreachable!("a JSON object") };
    Ok(Pinned { settings, model })
}

/// Checks `pinned` against what `out` was made with, and records it there if nothing is yet.
pub(super) fn pin_folder(out: &Path, pinned: &Pinned) -> anyhow::Result<()> {
    let path = out.join(SETTINGS);
    loop {
        match std::fs::read(&path) {
            Ok(bytes) => return compare(&path, &bytes, pinned),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
        }
        if let Some(legacy) = legacy_metadata(out) {
            check_legacy(out, &legacy, pinned)?;
        }
        // Written whole under a name of this process's own, then linked into place: a process
        // starting beside this one (another --shard) sees the file complete or not at all, and
        // whichever links first is the one every other compares with.
        let tmp = out.join(format!("{SETTINGS}.{}.tmp", std::process::id()));
        let text = serde_json::to_string_pretty(&pinned.to_json())? + "\n";
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(_) => {
                // A file system without hard links: written in place, once.
                let mut f = match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                    Ok(f) => f,
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => anyhow::bail!("cannot write {}: {e}", path.display()),
                };
                f.write_all(text.as_bytes())?;
                f.sync_all()?;
                return Ok(());
            }
        }
    }
}

/// Refuses a run whose settings or model differ from those `bulk.json` records.
fn compare(path: &Path, bytes: &[u8], pinned: &Pinned) -> anyhow::Result<()> {
    let recorded: Value = serde_json::from_slice(bytes).map_err(|e| {
        anyhow::anyhow!("{} is not JSON ({e}); it records what the folder was made with", path.display())
    })?;
    let part = |k: &str| recorded.get(k).and_then(Value::as_object).cloned().unwrap_or_default();
    let mut diff = differences(&SETTING_FLAGS, &part("settings"), &pinned.settings);
    diff.extend(
        differences(&model_keys(), &part("model"), &pinned.model).into_iter().map(|d| format!("the model's {d}")),
    );
    if diff.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "the folder was made with other settings or another model than this run's, as {} records them (the \
         folder's, then this run's): {}; resume it with its settings and a server of its model, or write to \
         another --out",
        path.display(),
        diff.join("; ")
    )
}

/// The metadata of a file a manifest of `out` records, where the folder has one (it was written
/// by an earlier version, which kept no `bulk.json`).
fn legacy_metadata(out: &Path) -> Option<(String, HashMap<String, String>)> {
    for m in manifests(out) {
        let Ok(bytes) = std::fs::read(&m) else { continue };
        for line in bytes.split(|&b| b == b'\n') {
            let Ok(v) = serde_json::from_slice::<Value>(line) else { continue };
            let Some(file) = v["file"].as_str() else { continue };
            let Ok(path) = file_inside(out, file) else { continue };
            if let Some(meta) = read_metadata(&path) {
                return Some((file.to_string(), meta));
            }
        }
    }
    None
}

/// The metadata of a safetensors file, read from its header alone (None where it has none or is
/// not one).
fn read_metadata(path: &Path) -> Option<HashMap<String, String>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let n = usize::try_from(u64::from_le_bytes(len)).ok().filter(|&n| n <= 100 << 20)?;
    let mut header = vec![0; n];
    f.read_exact(&mut header).ok()?;
    let v: Value = serde_json::from_slice(&header).ok()?;
    serde_json::from_value(v.get("__metadata__")?.clone()).ok()
}

/// Refuses a run into a folder without `bulk.json` whose file's metadata says it was made with
/// another model, layers or dtype.
fn check_legacy(out: &Path, (file, meta): &(String, HashMap<String, String>), pinned: &Pinned) -> anyhow::Result<()> {
    let mut diff = Vec::new();
    for (key, want) in pinned.expected_metadata() {
        let Some(got) = meta.get(key) else { continue };
        let same = match key {
            "layers" => serde_json::from_str::<Value>(got).ok() == serde_json::from_str::<Value>(&want).ok(),
            _ => *got == want,
        };
        if !same {
            diff.push(format!("{key}: {got} against {want}"));
        }
    }
    if let Some(got) = meta.get("tokens") {
        let want = pinned.settings["tokens"].as_str().unwrap_or_default();
        if got != want {
            diff.push(format!("tokens: {got} against {want}"));
        }
    }
    if diff.is_empty() {
        eprintln!(
            "note: {} has no {SETTINGS} (an earlier version wrote it); its file {file} matches this run, whose \
             settings and model are now recorded there",
            out.display()
        );
        return Ok(());
    }
    anyhow::bail!(
        "{} (written without a {SETTINGS}) was made with other settings or another model than this run's, as the \
         metadata of its file {file} says (the folder's, then this run's): {}; resume it with its settings and a \
         server of its model, or write to another --out",
        out.display(),
        diff.join("; ")
    )
}

/// Refuses an answer whose metadata says it comes from another model or holds other layers or
/// another dtype than the folder's.
pub(super) fn check_answer(meta: &HashMap<String, String>, expected: &[(&str, String)]) -> Result<(), String> {
    let diff: Vec<String> = expected
        .iter()
        .filter_map(|(key, want)| {
            let got = meta.get(*key).map(String::as_str).unwrap_or("(none)");
            let same = match *key {
                "layers" => serde_json::from_str::<Value>(got).ok() == serde_json::from_str::<Value>(want).ok(),
                _ => got == want,
            };
            (!same).then(|| format!("{key} {got:?}, not {want:?}"))
        })
        .collect();
    if diff.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "the answer is not what the folder holds ({}): the server changed model or settings since the run began",
            diff.join(", ")
        ))
    }
}
