"""A tiny EAGLE-3-style drafter head trained on hidden states streamed from a running layertap
server, with no disk in between (``layertap_client.online``).

Needs torch (``pip install 'layertap-client[torch,async]'``); runs on the CPU.

    make run      # the default model (SmolLM2-135M-Instruct) on :8080
    python clients/python/examples/drafter_online.py --server http://127.0.0.1:8080 --steps 240

The input is ``--input`` (JSONL or Parquet, read as ``layertap bulk`` reads it, with its column
options), or by default the repository's Markdown documents cut into text chunks. Each step takes
a batch of samples from :class:`layertap_client.online.OnlineIterableDataset`: the states of the
EAGLE-3 layers ``2, L/2, L-3`` and the target model's top-k next-token log-probabilities, fetched
a few requests ahead of the loop (``--max-requests``, ``--buffer-mib``), in the order of the seed.

The head, as EAGLE-3's: the three states fused by one linear layer (each normed first), the next
token's embedding beside them, one causal transformer layer and an output layer over a draft
vocabulary (the ``--draft-vocab`` most frequent tokens of the input, as EAGLE-3 picks its own).
Position ``t`` sees the target's states at ``t`` and token ``t+1`` and learns the target's
distribution of token ``t+2`` (its top-k log-probabilities at row ``t+1``, renormalised over the
draft vocabulary), with a soft cross-entropy on the rows whose ``loss_mask`` is 1. A real
drafter feeds its own states back for the later draft steps (test-time training) and uses the
target's LM head; the data it is fed has this shape.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

try:
    import torch
    from torch.utils.data import DataLoader
except ImportError:
    print("drafter_online.py needs torch: pip install 'layertap-client[torch]' (or the torch build you need)", file=sys.stderr)
    sys.exit(2)

from layertap_client import Client
from layertap_client.online import OnlineIterableDataset

REPO = Path(__file__).resolve().parents[3]


def doc_chunks(chars: int) -> List[Dict[str, Any]]:
    """The repository's Markdown documents as text samples of about ``chars`` characters (whole words)."""
    out = []
    for path in sorted(REPO.glob("*.md")) + sorted(REPO.glob("*/README.md")) + sorted(REPO.glob("clients/*/README.md")):
        words = re.sub(r"\s+", " ", path.read_text(encoding="utf-8", errors="replace")).split(" ")
        piece: List[str] = []
        for w in words:
            piece.append(w)
            if sum(len(x) + 1 for x in piece) >= chars:
                out.append({"id": f"{path.relative_to(REPO)}#{len(out)}", "text": " ".join(piece)})
                piece = []
    return out


def collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Pads a batch: ``aux [B, T, 3, H]``, ``input_ids``, ``loss_mask``, ``attention_mask`` ``[B, T]``,
    ``topk_ids``, ``topk_logprobs`` ``[B, T, K]``."""
    b, t = len(samples), max(len(s["input_ids"]) for s in samples)
    _, n, h = samples[0]["hidden_states"].shape
    k = samples[0]["topk_ids"].shape[1]
    out = {
        "aux": torch.zeros(b, t, n, h, dtype=samples[0]["hidden_states"].dtype),
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool),
        "topk_ids": torch.zeros(b, t, k, dtype=torch.long),
        "topk_logprobs": torch.full((b, t, k), -math.inf),
        "ids": [s["id"] for s in samples],
    }
    for i, s in enumerate(samples):
        m = len(s["input_ids"])
        out["aux"][i, :m] = s["hidden_states"]
        out["input_ids"][i, :m] = s["input_ids"]
        out["loss_mask"][i, :m] = s["loss_mask"].bool()
        out["attention_mask"][i, :m] = True
        out["topk_ids"][i, :m] = s["topk_ids"]
        out["topk_logprobs"][i, :m] = s["topk_logprobs"]
    return out


class TinyEagle3(torch.nn.Module):
    """EAGLE-3's drafter in miniature: fused target states + next-token embedding -> one causal layer -> draft logits."""

    def __init__(self, hidden: int, n_aux: int, vocab: int, draft_vocab: int, d: int = 256, heads: int = 4):
        super().__init__()
        self.norm_aux = torch.nn.LayerNorm(hidden, elementwise_affine=False)
        self.fc = torch.nn.Linear(n_aux * hidden, d)
        self.embed = torch.nn.Embedding(vocab, d)
        self.inp = torch.nn.Linear(2 * d, d)
        self.layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, draft_vocab)

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        fused = self.fc(self.norm_aux(aux.float()).flatten(2))  # [B, T, d]
        x = self.inp(torch.cat([self.embed(next_ids), fused], dim=-1))
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)  # True: not attended
        x = self.layer(x, src_mask=causal, src_key_padding_mask=pad, is_causal=True)
        return self.head(self.norm(x))


def step_loss(model: TinyEagle3, batch: Dict[str, Any], to_draft: torch.Tensor):
    """Soft cross-entropy against the target's top-k at row t+1, over the draft vocabulary; and the
    share of rows where the head's first choice is the target's."""
    aux, ids = batch["aux"][:, :-1], batch["input_ids"]
    attn = batch["attention_mask"]
    logits = model(aux, ids[:, 1:], pad=~attn[:, :-1])  # position t: states at t, token t+1
    tk_ids, tk_lp = batch["topk_ids"][:, 1:], batch["topk_logprobs"][:, 1:]  # the target at row t+1
    draft = to_draft[tk_ids]  # [B, T-1, K], -1 outside the draft vocabulary
    lp = tk_lp.masked_fill(draft < 0, -math.inf)
    keep = attn[:, 1:] & batch["loss_mask"][:, 1:] & torch.isfinite(lp).any(-1)
    p = torch.softmax(lp.masked_fill(~keep[..., None], 0.0), dim=-1)  # renormalised over the draft entries
    target = torch.zeros_like(logits).scatter_add_(-1, draft.clamp(min=0), p * (draft >= 0))
    ce = -(target * torch.log_softmax(logits, dim=-1)).sum(-1)
    n = keep.sum().clamp(min=1)
    agree = ((logits.argmax(-1) == draft[..., 0]) & keep).sum() / n
    return (ce * keep).sum() / n, float(agree), int(keep.sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", action="append", default=[], help="a layertap server (repeat for several)")
    ap.add_argument("--input", help="JSONL or Parquet samples (default: the repository's Markdown documents)")
    ap.add_argument("--text-column", help="as layertap bulk's --text-column")
    ap.add_argument("--messages-column", help="as layertap bulk's --messages-column")
    ap.add_argument("--chunk-chars", type=int, default=160, help="characters per document chunk (default input)")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=16, help="the target's top-k log-probabilities per row")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-requests", type=int, default=4, help="requests in flight ahead of the loop")
    ap.add_argument("--buffer-mib", type=int, default=256, help="answers buffered ahead of the loop")
    ap.add_argument("--request-tokens", type=int, default=512, help="tokens per request (several samples each)")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="where the head trains: cpu, or cuda:N (batches pinned, copied without blocking)")
    a = ap.parse_args()
    servers = a.server or ["http://127.0.0.1:8080"]
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {a.device}: torch sees no CUDA device", file=sys.stderr)
        return 2

    with Client(servers[0]) as c:
        info = c.info()
        samples: Any = a.input or doc_chunks(a.chunk_chars)
        L, hidden, vocab = info["num_layers"], info["hidden_size"], info["vocab_size"]
        # EAGLE-3's draft vocabulary: the most frequent tokens of the input (tokenised by the server)
        counts: collections.Counter = collections.Counter()
        if isinstance(samples, list):
            for i in range(0, len(samples), 64):
                for t in c.tokenize([{"text": s["text"]} for s in samples[i : i + 64]]):
                    counts.update(t["input_ids"])
    layers = [2, L // 2, L - 3]
    kept = [t for t, _ in counts.most_common(a.draft_vocab)] or list(range(a.draft_vocab))
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[torch.tensor(kept)] = torch.arange(len(kept))
    to_draft = to_draft.to(device)

    ds = OnlineIterableDataset(
        samples, servers, layers=layers, dtype="bfloat16", logprobs={"top_k": a.top_k},
        text_column=a.text_column, messages_column=a.messages_column,
        shuffle=True, seed=a.seed, batch_size=a.batch_size, request_tokens=a.request_tokens,
        max_requests=a.max_requests, max_buffered_bytes=a.buffer_mib << 20,
    )
    n = len(ds.source.samples)
    print(f"{n} samples; layers {layers} of {L}, hidden {hidden}; draft vocabulary {len(kept)} of {vocab}; "
          f"servers {', '.join(servers)}")
    loader = DataLoader(ds, batch_size=a.batch_size, num_workers=0, collate_fn=collate, pin_memory=device.type == "cuda")
    model = TinyEagle3(hidden, len(layers), vocab, len(kept)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    losses: List[float] = []
    agrees: List[float] = []
    step, tokens, t0 = 0, 0, time.perf_counter()
    waited = 0.0
    for epoch in itertools.count():
        ds.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            loss, agree, rows = step_loss(model, batch, to_draft)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            agrees.append(agree)
            tokens += int(batch["attention_mask"].sum())
            step += 1
            if step % a.log_every == 0 or step == 1:
                k = min(a.log_every, len(losses))
                st = ds.stats()
                print(f"step {step:4d} (epoch {epoch}): loss {sum(losses[-k:]) / k:.4f}, top-1 agreement "
                      f"{sum(agrees[-k:]) / k:.1%}; {tokens / (time.perf_counter() - t0):.0f} tokens/s, "
                      f"waited {waited + st.get('waited_s', 0):.1f} s, buffered {st.get('buffered_bytes', 0) >> 10} KiB",
                      flush=True)
            if step >= a.steps:
                break
        waited += ds.stats().get("waited_s", 0.0)
        if step >= a.steps:
            break
    ds.close()
    k = min(a.log_every, len(losses))
    secs = time.perf_counter() - t0
    print(f"done: {step} steps, {tokens} tokens in {secs:.0f} s; loss {sum(losses[:k]) / k:.4f} (first {k} steps) -> "
          f"{sum(losses[-k:]) / k:.4f} (last {k}); top-1 agreement {sum(agrees[:k]) / k:.1%} -> {sum(agrees[-k:]) / k:.1%}; "
          f"the loop waited {waited:.1f} s for samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
