"""References for the chat-template tests on real tokenizers and real checkpoints' templates.

    python scripts/make_chat_fixtures.py --tokenizers .cache/tokenizers --out tests/fixtures/chat

Reads the real tokenizers fetched by scripts/fetch_tokenizers.py and the templates in
<out>/templates/ (see its README.md), renders every conversation below with transformers'
`apply_chat_template` (tokenize=False, with and without the generation prompt) and tokenizes it
(tokenize=True), and writes <out>/reference.json.
The date templates ask for (`strftime_now`) is fixed at 2025-01-01, as layertap renders it.

Needs transformers (and its tokenizers); keep fla and causal_conv1d out of the environment.
"""

import argparse
import datetime as _dt
import json
import os

import transformers
import transformers.utils.chat_template_utils as ctu
from transformers import AutoTokenizer


class _FixedDate(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 1, 1)


ctu.datetime = _FixedDate

# name, tokenizer package, template file (None: the one in the package's tokenizer_config.json),
# control tokens added to the package's tokenizer (as special tokens, in this order).
GEMMA4_CONTROL = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>",
                  "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"]
GLM_CONTROL = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
CASES = [
    ("gpt-oss", "gptoss", "gpt-oss.jinja", []),
    ("qwen3", "qwen3", None, []),
    ("llama3", "llama3", None, []),
    ("llama-3.1", "llama3", "llama-3.1.jinja", []),
    ("gemma3", "gemma3", None, []),
    ("deepseek-v3", "deepseek_v3", None, []),
    ("deepseek-v3.1", "deepseek_v3", "deepseek-v3.1.jinja", []),
    # No package ships these models' tokenizers: a relative's tokenizer with the model's control
    # tokens added stands in for it (the template and its rendering are the model's own).
    ("gemma-4", "gemma3", "gemma-4.jinja", GEMMA4_CONTROL),
    ("glm-4.7-flash", "qwen3", "glm-4.7-flash.jinja", GLM_CONTROL),
    ("qwen3.5", "qwen3", "qwen3.5.jinja", []),
]

CONVERSATIONS = {
    "one_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "system_two_turns": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another?"},
        {"role": "assistant", "content": "Green, or perhaps red."},
    ],
    "unicode": [
        {"role": "user", "content": "Café naïve — 日本語 😀\n\ttabs and  two spaces"},
        {"role": "assistant", "content": "Ünïcödé answer: 42 ✓\nline two"},
    ],
    # Reasoning: templates that write it (in the last turn) put it before the answer; the answers
    # also occur inside the reasoning, which the loss mask must not be fooled by.
    "reasoning_two_turns": [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "Three plus three is 6."},
    ],
    # Reasoning written into the content, as many datasets hold it: Qwen3's and DeepSeek's
    # templates split it off (and drop it from earlier turns).
    "reasoning_in_content": [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nTwo plus two is 4.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nThree plus three is 6.\n</think>\n\n6"},
    ],
    "prompt_only": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ],
}


# Template variables beside the messages (`apply_chat_template(..., **kwargs)`), each read by some
# of the templates: gpt-oss's reasoning effort and identity, Qwen3's / Qwen3.5's / GLM's switch for
# thinking, DeepSeek-V3.1's.
KWARGS = {
    "reasoning_effort": "high",
    "model_identity": "You are a test model.",
    "enable_thinking": False,
    "thinking": True,
}


def render(tok, messages, template, add_generation_prompt, tokenize, kwargs=None):
    try:
        out = tok.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=tokenize,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **(kwargs or {}),
        )
    except Exception as e:  # the template raised: layertap must refuse the same chat
        return {"error": str(e)}
    if tokenize:
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cases = []
    for name, package, template_file, added in CASES:
        tok = AutoTokenizer.from_pretrained(os.path.join(args.tokenizers, package))
        if added:
            tok.add_tokens(added, special_tokens=True)
        if template_file is None:
            template = tok.chat_template
        else:
            with open(os.path.join(args.out, "templates", template_file), encoding="utf-8") as f:
                template = f.read()
        convs = []
        for cname, messages in CONVERSATIONS.items():
            entry = {
                "name": cname,
                "messages": messages,
                "text": render(tok, messages, template, False, False),
                "text_with_generation_prompt": render(tok, messages, template, True, False),
            }
            entry["input_ids"] = render(tok, messages, template, False, True)
            convs.append(entry)
        messages = CONVERSATIONS["system_two_turns"]
        convs.append(
            {
                "name": "system_two_turns_with_kwargs",
                "messages": messages,
                "chat_template_kwargs": KWARGS,
                "text": render(tok, messages, template, False, False, KWARGS),
                "text_with_generation_prompt": render(tok, messages, template, True, False, KWARGS),
                "input_ids": render(tok, messages, template, False, True, KWARGS),
            }
        )
        cases.append(
            {
                "name": name,
                "tokenizer": package,
                "template": template_file,
                "added_special_tokens": added,
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "conversations": convs,
            }
        )
        print(f"{name}: {len(convs)} conversations")
    ref = {"transformers": transformers.__version__, "date": "2025-01-01", "cases": cases}
    with open(os.path.join(args.out, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
