//! Builds a Hugging Face tokenizer from the vocabulary stored in a GGUF file, the way transformers
//! does for the same file (byte-level BPE: vocabulary, merges, control tokens as special tokens,
//! the split regex named by `tokenizer.ggml.pre`).

use serde_json::{json, Value};

use crate::engine::gguf::GgufTokenizerData;

const LLAMA3_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
const QWEN2_SPLIT: &str = concat!(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// The split regex transformers uses for a `tokenizer.ggml.pre` value, if it overrides GPT-2's.
fn split_regex(pre: &str) -> Option<&'static str> {
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "dbrx"
        | "smaug-bpe" => Some(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => Some(QWEN2_SPLIT),
        _ => None,
    }
}

/// GPT-2's byte → printable character table.
fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap_or(' ');
    }
    table
}

/// What a GGUF file's metadata makes: the tokenizer, its chat template and its BOS / EOS tokens.
pub struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// Builds the tokenizer; the error says what in the metadata is unsupported or broken.
pub fn build(d: &GgufTokenizerData) -> Result<GgufTokenizer, String> {
    if d.model != "gpt2" {
        return Err(format!(
            "GGUF tokenizer type {:?} is not supported (supported: gpt2 byte-level BPE); use the model's \
             Hugging Face folder or send input_ids",
            d.model
        ));
    }
    let table = bytes_to_unicode();
    let alphabet: std::collections::HashSet<char> = table.iter().copied().collect();
    let spell = |t: &str| -> String {
        if t.chars().all(|c| alphabet.contains(&c)) {
            t.to_string()
        } else {
            t.bytes().map(|b| table[b as usize]).collect()
        }
    };
    let mut vocab = serde_json::Map::new();
    for (i, t) in d.tokens.iter().enumerate() {
        vocab.insert(spell(t), json!(i));
    }
    let types = |want: i32| {
        d.tokens
            .iter()
            .enumerate()
            .filter(move |(i, _)| d.token_types.get(*i) == Some(&want))
            .map(|(i, t)| (i, t.clone()))
    };
    let mut added: Vec<Value> = types(3)
        .filter(|(_, t)| t.chars().all(|c| alphabet.contains(&c)))
        .map(|(i, t)| added_token(i, &t, true))
        .collect();
    added.extend(types(4).map(|(i, t)| added_token(i, &t, false)));
    let byte_level =
        |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let pre_tokenizer = match d.pre.as_deref().and_then(split_regex) {
        Some(re) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
            byte_level(false)
        ]}),
        None => byte_level(true),
    };
    let token = |id: Option<u32>| id.and_then(|i| d.tokens.get(i as usize).cloned());
    let bos = token(d.bos_id);
    let post_processor = match (d.add_bos.unwrap_or(false), &bos, d.bos_id) {
        (true, Some(b), Some(id)) => json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": b, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": b, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {b: {"id": b, "ids": [id], "tokens": [b]}}
        }),
        _ => json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true}),
    };
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": d.merges,
        }
    });
    let tok: tokenizers::Tokenizer = serde_json::from_value::<tokenizers::Tokenizer>(tokenizer_json)
        .map_err(|e| format!("building the GGUF tokenizer: {e}"))?;
    Ok(GgufTokenizer {
        tokenizer: tok,
        chat_template: d.chat_template.clone(),
        bos_token: bos,
        eos_token: token(d.eos_id),
    })
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": false, "special": special})
}
