#!/usr/bin/env python3
"""Generate tiny random-weight decoder checkpoints plus Hugging Face reference
hidden states, used by the Rust test-suite.

Output layout (default: tests/fixtures/tiny relative to the repository root):

    <out>/tokenizer_reference.json
    <out>/<variant>/config.json, model*.safetensors[, model.safetensors.index.json]
    <out>/<variant>/tokenizer.json, tokenizer_config.json[, chat_template.jinja, ...]
    <out>/<variant>/reference.safetensors   seq{i}.input_ids      int64   [T_i]
                                            seq{i}.hidden_states  float32 [L+1, T_i, H]
                                            seq{i}.final_prenorm  float32 [T_i, H]
                                                the last decoder layer's output BEFORE the
                                                final norm (forward hook on model.model.layers[-1],
                                                same forward pass; hidden_states[L] is after it)
    <out>/<variant>/reference.json

Pinned package versions: scripts/requirements-fixtures.txt.
Usage: python scripts/make_fixtures.py [--out tests/fixtures/tiny]

The committed files were generated with torch's AVX2 CPU kernels: on a machine with AVX-512,
run with ATEN_CPU_CAPABILITY=avx2 to reproduce them bit for bit (the default AVX-512 kernels
differ in the last bits, ~1e-6 relative, from position 16 on).
"""

import copy
import os
import tempfile

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from fixture_common import (
    TINY_DIR,
    as_id_list,
    check_final_prenorm,
    copy_files,
    dir_size,
    dump_json,
    fixture_args,
    forward_with_last_layer,
    fresh_dir,
    randn,
    random_sequences,
    read_json,
    reference_tensors,
    save_tensors,
    selected,
    setup_torch,
    token_ids,
    versions,
    write_json,
)

DEFAULT_OUT = TINY_DIR

SEQ_LENGTHS = [1, 7, 33]
SEQ_SEED = 1234
WEIGHT_SEED = 0

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of
tokens and produces a hidden state for every position at every layer. Those hidden
states are vectors of floating point numbers, and they can be used as features for
probing, retrieval, steering or interpretability research.

In the morning the market opened at nine o'clock; by noon, 1,234 shares had been
sold at $56.78 each. "Is that a good price?" she asked. "It depends," he replied,
"on what you expect the company to earn next year (and the year after that)."

Rust is a systems programming language that runs blazingly fast, prevents
segfaults, and guarantees thread safety. fn main() { println!("hello, world"); }
Python, on the other hand, is often used for quick experiments: def f(x): return x * 2

Once upon a time there was a little village by the sea. The people who lived there
were fishermen and farmers, and every evening they gathered in the square to talk
about the weather, the harvest, the price of bread and the news from the city.
Children played between the houses while their parents worked in the fields.

Tokenizers split text into pieces. Byte-level BPE starts from the 256 possible
bytes and repeatedly merges the most frequent pair of adjacent symbols until the
vocabulary reaches the requested size. Because every byte is in the alphabet,
any string -- even one with emoji or accents -- can be encoded without unknown
tokens.
"""

TOKENIZER_TEXTS = [
    "Hello world, this is a simple sentence about the market.",
    "Prices: $56.78 (+3.5%) on 2024-01-31; ids #42, #1337 & 9/10!?",
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001F600\U0001F680 \u2014 r\u00e9sum\u00e9",
    "   leading spaces\n\n\tand a tab, then  double  spaces\n",
]

TOKENIZER_CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
    ],
]

COMMON = dict(
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    # ids for the special tokens of the tiny tokenizer (trained first, so 0..2)
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)

VARIANTS = {
    "llama_gqa_rope3": dict(
        config_cls=LlamaConfig,
        model_cls=LlamaForCausalLM,
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        max_shard_size="100KB",
    ),
    "llama_headdim_bias_tied": dict(
        config_cls=LlamaConfig,
        model_cls=LlamaForCausalLM,
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        ),
    ),
    "mistral_sliding": dict(
        config_cls=MistralConfig,
        model_cls=MistralForCausalLM,
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=8,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_bias_tied": dict(
        config_cls=Qwen2Config,
        model_cls=Qwen2ForCausalLM,
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
    ),
    "qwen3_qknorm": dict(
        config_cls=Qwen3Config,
        model_cls=Qwen3ForCausalLM,
        kwargs=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
        ),
    ),
}


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(tmp_dir):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    assert tok.get_vocab_size() <= 512
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    hf_tok.save_pretrained(tmp_dir)

    files = sorted(os.listdir(tmp_dir))
    template_in_config = False
    cfg_path = os.path.join(tmp_dir, "tokenizer_config.json")
    cfg = read_json(cfg_path)
    if "chat_template" in cfg:
        template_in_config = True
    else:
        cfg["chat_template"] = CHATML_TEMPLATE
        write_json(cfg, cfg_path, ensure_ascii=False)
    info = {
        "files_written_by_save_pretrained": files,
        "chat_template_written_to": (
            "tokenizer_config.json"
            if template_in_config
            else ("chat_template.jinja" if "chat_template.jinja" in files else "?")
        ),
        "vocab_size": tok.get_vocab_size(),
    }
    print(f"tokenizer: vocab={info['vocab_size']} files={files} "
          f"chat_template written to {info['chat_template_written_to']}")
    return info


def tokenizer_reference(tok_dir, out_path, info):
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    assert tok.chat_template is not None
    texts = []
    for t in TOKENIZER_TEXTS:
        ids = token_ids(tok, t)
        assert tok.decode(ids) == t, (tok.decode(ids), t)
        texts.append({"text": t, "input_ids": ids})
    chats = []
    for msgs in TOKENIZER_CHATS:
        rendered = tok.apply_chat_template(msgs, tokenize=False)
        ids = as_id_list(tok.apply_chat_template(msgs, tokenize=True))
        gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        chats.append({
            "messages": msgs,
            "rendered": rendered,
            "input_ids": ids,
            "rendered_with_generation_prompt": gen,
        })
    ref = {
        "transformers": transformers.__version__,
        "tokenizer": info,
        "special_tokens": {s: tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS},
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "texts": texts,
        "chats": chats,
    }
    dump_json(ref, out_path)


# --------------------------------------------------------------------------- models


def perturb_weights(model, gen):
    """Make norm weights != 1 and biases != 0 so that bugs are not hidden."""
    n_norm = n_bias = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if "RMSNorm" in type(mod).__name__:
                w = mod.weight
                w.mul_(randn(w.shape, gen, 0.1, 1.0))
                n_norm += 1
            elif isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.copy_(randn(mod.bias.shape, gen, 0.1))
                n_bias += 1
    return n_norm, n_bias


@torch.no_grad()
def run_reference(model, ids):
    base = model.model
    L = model.config.num_hidden_layers
    assert len(base.layers) == L
    out, last = forward_with_last_layer(base, ids)
    hs = torch.stack(out.hidden_states)[:, 0].contiguous().float()
    assert hs.shape[0] == L + 1, hs.shape
    assert torch.equal(hs[L], out.last_hidden_state[0])
    raw = last[0]
    normed = base.norm(last)[0]
    is_raw = torch.equal(hs[L], raw)
    is_post_norm = torch.allclose(hs[L], normed, atol=1e-6, rtol=0)
    assert is_raw != is_post_norm, "hidden_states[L] is neither raw nor normed output"
    # the pre-norm state of the last decoder layer (what hidden_states never returns when the
    # last index is post-norm): the model's final norm applied to it gives hidden_states[L]
    prenorm = raw.contiguous().float()
    assert prenorm.shape == hs[L].shape, (prenorm.shape, hs[L].shape)
    check_final_prenorm(base.norm, prenorm, hs[L])
    return hs, prenorm, is_post_norm


def check_sliding_window_matters(model, ids):
    """Mistral: confirm the sliding window changes the result of a long sequence."""
    other = copy.deepcopy(model)
    other.config.sliding_window = None
    other.model.config.sliding_window = None
    with torch.no_grad():
        a = model.model(input_ids=ids[None]).last_hidden_state
        b = other.model(input_ids=ids[None]).last_hidden_state
    w = model.config.sliding_window
    # positions < w see the same keys in both; later ones must differ
    same_prefix = torch.allclose(a[0, :w], b[0, :w], atol=1e-6)
    differs_after = not torch.allclose(a[0, w:], b[0, w:], atol=1e-4)
    return same_prefix, differs_after


def make_variant(name, spec, out_dir, tok_dir):
    torch.manual_seed(WEIGHT_SEED)
    cfg = spec["config_cls"](**COMMON, **spec["kwargs"], attn_implementation="eager")
    cfg._attn_implementation = "eager"
    model = spec["model_cls"](cfg).float().eval()
    n_norm, n_bias = perturb_weights(model, torch.Generator().manual_seed(WEIGHT_SEED + 1))

    vdir = os.path.join(out_dir, name)
    fresh_dir(vdir)
    save_kwargs = {"safe_serialization": True}
    if "max_shard_size" in spec:
        save_kwargs["max_shard_size"] = spec["max_shard_size"]
    model.save_pretrained(vdir, **save_kwargs)
    copy_files(tok_dir, vdir)

    saved_cfg = read_json(os.path.join(vdir, "config.json"))
    if "max_shard_size" in spec:
        assert os.path.exists(os.path.join(vdir, "model.safetensors.index.json")), "not sharded"

    L = cfg.num_hidden_layers
    seqs = random_sequences(cfg.vocab_size, SEQ_LENGTHS, SEQ_SEED)
    hidden, prenorms, post_norm_flags = [], [], set()
    for ids in seqs:
        hs, prenorm, post = run_reference(model, ids)
        post_norm_flags.add(post)
        hidden.append(hs)
        prenorms.append(prenorm)
    assert len(post_norm_flags) == 1
    post_norm = post_norm_flags.pop()
    tensors = reference_tensors(seqs, hidden, prenorms)
    save_tensors(tensors, os.path.join(vdir, "reference.safetensors"))

    notes = [
        "hidden_states = torch.stack(model.model(input_ids[None], output_hidden_states=True)"
        ".hidden_states)[:, 0]; index 0 is the embedding output, index l (1..L) the output "
        "of decoder layer l.",
        f"hidden_states[L] {'IS' if post_norm else 'is NOT'} the final-norm output "
        "(checked against a forward hook on the last decoder layer).",
        "final_prenorm = output of the last decoder layer before the final norm [T, H], captured "
        "with a forward hook on model.model.layers[-1] in the same forward pass; checked that "
        "model.model.norm(final_prenorm) equals hidden_states[L] to float32 tolerance.",
        f"float32, eager attention, torch.manual_seed({WEIGHT_SEED}); RMSNorm weights multiplied "
        "by (1 + 0.1*randn) and every Linear bias set to 0.1*randn after init.",
        f"input ids: torch.randint(0, vocab_size) with torch.Generator().manual_seed({SEQ_SEED}), "
        "lengths in order.",
    ]
    extra = {}
    if name == "mistral_sliding":
        same_prefix, differs_after = check_sliding_window_matters(model, tensors["seq2.input_ids"])
        assert same_prefix and differs_after, (same_prefix, differs_after)
        extra["sliding_window_changes_seq2"] = True
        notes.append(
            "sliding_window=8: HF masks key j for query i unless i - 8 < j <= i (the window "
            "includes the query itself, 8 keys at most); verified that seq2 (33 tokens) "
            "differs from full causal attention after position 8 and matches before."
        )
    ref = {
        **versions(),
        "model_class": type(model).__name__,
        "lengths": SEQ_LENGTHS,
        "num_hidden_layers": L,
        "hidden_size": cfg.hidden_size,
        "last_index_is_post_norm": post_norm,
        "num_rmsnorm_perturbed": n_norm,
        "num_biases_randomized": n_bias,
        "rope_in_config_json": {
            k: saved_cfg[k]
            for k in ("rope_theta", "rope_scaling", "rope_parameters")
            if k in saved_cfg
        },
        **extra,
        "notes": " ".join(notes),
    }
    dump_json(ref, os.path.join(vdir, "reference.json"))
    files = sorted(os.listdir(vdir))
    print(f"{name}: {type(model).__name__} post_norm={post_norm} norms={n_norm} "
          f"biases={n_bias} rope={ref['rope_in_config_json']} files={files}")
    return post_norm


def main():
    args = fixture_args(__doc__.split("\n")[0], DEFAULT_OUT)
    setup_torch()
    os.makedirs(args.out, exist_ok=True)

    with tempfile.TemporaryDirectory() as tok_dir:
        info = build_tokenizer(tok_dir)
        tokenizer_reference(tok_dir, os.path.join(args.out, "tokenizer_reference.json"), info)
        flags = {}
        for name, spec in selected(VARIANTS, args.only):
            flags[name] = make_variant(name, spec, args.out, tok_dir)

    print("last_index_is_post_norm:", flags)
    print(f"total size of {os.path.relpath(args.out)}: {dir_size(args.out) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
