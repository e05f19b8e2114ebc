"""The data side of a drafter-training loop (EAGLE-3 / DFlash style) over a ``layertap bulk`` folder.

Needs torch (``pip install 'layertap-client[torch]'``); runs on the CPU.

    layertap bulk --server http://127.0.0.1:8080 --input chats.jsonl --out hs \\
        --layers 2,15,27,final_prenorm --dtype bfloat16
    python clients/python/examples/drafter_data.py hs --batch-size 8 --workers 4          # padded batches
    python clients/python/examples/drafter_data.py hs --batch-size 8 --workers 4 --pack   # packed rows
    torchrun --nproc-per-node 2 clients/python/examples/drafter_data.py hs                # one share per rank

The pieces: :class:`layertap_client.dataset.BulkIterableDataset` over the folder
(sharded across the DataLoader's workers and, under torchrun, across ranks;
shuffled per epoch; every file's checksums verified), a collate function that
pads (:func:`pad_collate`) or packs (:func:`pack_collate`) a batch into
``hidden_states [B, T, n_layers, H]`` with an attention mask and the loss mask,
and a stand-in drafter step: the auxiliary layers (all but the last) are fused
by one linear layer, as EAGLE-3 fuses its three, and a small MLP predicts the
next token's last-layer state, with a loss on the assistant tokens only. A real
drafter puts its decoder layer and the target's LM head there; the data it is
fed has this shape.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional

try:
    import torch
    from torch.utils.data import DataLoader
except ImportError:
    print("drafter_data.py needs torch: pip install 'layertap-client[torch]' (or the torch build you need)", file=sys.stderr)
    sys.exit(2)

from layertap_client.dataset import BulkIterableDataset


def pad_collate(samples: List[Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    """Pads samples to the batch's longest: ``hidden_states [B, T, n_layers, H]``, and ``[B, T]``
    ``input_ids``, ``position_ids``, ``attention_mask`` (True on real tokens) and ``loss_mask``
    (True where the loss counts: assistant tokens of a chat, every token of plain text/ids)."""
    samples = [s for s in samples if s is not None]  # files skipped by skip_errors
    if not samples:
        return {}
    b, t = len(samples), max(len(s["input_ids"]) for s in samples)
    _, n_layers, hidden = samples[0]["hidden_states"].shape
    hs = torch.zeros(b, t, n_layers, hidden, dtype=samples[0]["hidden_states"].dtype)
    ids = torch.zeros(b, t, dtype=torch.long)
    pos = torch.zeros(b, t, dtype=torch.long)
    attn = torch.zeros(b, t, dtype=torch.bool)
    loss = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        hs[i, :n] = s["hidden_states"]
        ids[i, :n] = s["input_ids"]
        pos[i, :n] = s["positions"] if "positions" in s else torch.arange(n)
        attn[i, :n] = True
        loss[i, :n] = s["loss_mask"].bool() if "loss_mask" in s else True
    # A token's target is the next one's state: the pair must be in the same sequence.
    segment = attn.long()
    return {
        "hidden_states": hs,
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": attn,
        "loss_mask": loss,
        "segment_ids": segment,
        "ids": [s["id"] for s in samples],
    }


def pack_collate(samples: List[Optional[Dict[str, Any]]], row_tokens: int = 256) -> Dict[str, Any]:
    """Packs samples into rows of ``row_tokens`` (first fit; a longer sample gets a row of its
    own length): the same fields as :func:`pad_collate`, ``segment_ids`` numbering each row's
    samples from 1 (0 on padding; attend within a segment only: a block-diagonal causal mask,
    or ``cu_seqlens`` for varlen attention kernels), ``position_ids`` restarting per sample."""
    samples = [s for s in samples if s is not None]
    if not samples:
        return {}
    width = max(row_tokens, max(len(s["input_ids"]) for s in samples))
    rows: List[List[Dict[str, Any]]] = []
    free: List[int] = []
    for s in sorted(samples, key=lambda s: -len(s["input_ids"])):
        n = len(s["input_ids"])
        r = next((k for k, f in enumerate(free) if f >= n), None)
        if r is None:
            rows.append([])
            free.append(width)
            r = len(rows) - 1
        rows[r].append(s)
        free[r] -= n
    _, n_layers, hidden = samples[0]["hidden_states"].shape
    b, t = len(rows), width - min(free)
    hs = torch.zeros(b, t, n_layers, hidden, dtype=samples[0]["hidden_states"].dtype)
    ids = torch.zeros(b, t, dtype=torch.long)
    pos = torch.zeros(b, t, dtype=torch.long)
    seg = torch.zeros(b, t, dtype=torch.long)
    loss = torch.zeros(b, t, dtype=torch.bool)
    cu = [0]
    for i, row in enumerate(rows):
        at = 0
        for k, s in enumerate(row, start=1):
            n = len(s["input_ids"])
            hs[i, at : at + n] = s["hidden_states"]
            ids[i, at : at + n] = s["input_ids"]
            pos[i, at : at + n] = s["positions"] if "positions" in s else torch.arange(n)
            seg[i, at : at + n] = k
            loss[i, at : at + n] = s["loss_mask"].bool() if "loss_mask" in s else True
            at += n
            cu.append(i * t + at)
        if at < t:  # the row's padding is a segment of its own
            cu.append(i * t + t)
    return {
        "hidden_states": hs,
        "input_ids": ids,
        "position_ids": pos,
        "attention_mask": seg > 0,
        "loss_mask": loss,
        "segment_ids": seg,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "ids": [s["id"] for row in rows for s in row],
    }


class StandInDrafter(torch.nn.Module):
    """Fuses the auxiliary layers into one state and predicts the next token's last-layer state."""

    def __init__(self, n_layers: int, hidden: int):
        super().__init__()
        self.n_aux = max(n_layers - 1, 1)
        self.fuse = torch.nn.Linear(self.n_aux * hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(), torch.nn.Linear(2 * hidden, hidden))

    def forward(self, hs: torch.Tensor) -> torch.Tensor:  # [B, T, n_layers, H] -> [B, T, H]
        aux = hs[:, :, : self.n_aux].flatten(2)
        return self.mlp(self.fuse(aux))


def drafter_loss(model: StandInDrafter, batch: Dict[str, Any]) -> torch.Tensor:
    hs = batch["hidden_states"].float()
    pred = model(hs)[:, :-1]
    target = hs[:, 1:, -1]
    # Position t predicts t + 1: both real, in the same sequence, and t + 1 is a loss token.
    seg = batch["segment_ids"]
    keep = (seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] > 0) & batch["loss_mask"][:, 1:]
    err = ((pred - target) ** 2).mean(-1)
    return (err * keep).sum() / keep.sum().clamp(min=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", help="a `layertap bulk --out` folder")
    ap.add_argument("--batch-size", type=int, default=8, help="samples per batch")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    ap.add_argument("--pack", action="store_true", help="pack samples into rows instead of padding")
    ap.add_argument("--row-tokens", type=int, default=256, help="tokens per packed row (--pack)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="shuffling seed (the same on every rank)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--skip-errors", action="store_true", help="leave out files that fail their checksums")
    ap.add_argument("--show", type=int, default=2, help="batches to describe")
    a = ap.parse_args()

    # Under torchrun each rank reads its own share (init_process_group is the trainer's business).
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    ds = BulkIterableDataset(a.folder, rank=rank, world_size=world, shuffle=True, seed=a.seed, skip_errors=a.skip_errors)
    folder = ds.folder
    print(f"{folder.root}: {len(folder)} samples, {folder.tokens} tokens in {len(folder.manifests)} manifest(s); "
          f"rank {rank}/{world} reads {len(ds)}")
    collate = (lambda b: pack_collate(b, a.row_tokens)) if a.pack else pad_collate
    loader = DataLoader(ds, batch_size=a.batch_size, num_workers=a.workers, collate_fn=collate,
                        persistent_workers=False, pin_memory=torch.cuda.is_available())

    model: Optional[StandInDrafter] = None
    opt: Optional[torch.optim.Optimizer] = None
    seen, real, slots, loss_tokens, steps, batches = set(), 0, 0, 0, 0, 0
    losses: List[float] = []
    start = time.perf_counter()
    first: Optional[float] = None  # when the first batch arrived (workers started, files opened)
    for epoch in range(a.epochs):
        ds.set_epoch(epoch)
        for batch in loader:
            if not batch:
                continue
            if first is None:
                first = time.perf_counter() - start
            hs = batch["hidden_states"]
            if model is None:
                model = StandInDrafter(hs.shape[2], hs.shape[3])
                opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
            loss = drafter_loss(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            n_real = int(batch["attention_mask"].sum())
            n_loss = int(batch["loss_mask"].sum())
            if batches < a.show:
                extra = f", cu_seqlens {batch['cu_seqlens'].tolist()}" if "cu_seqlens" in batch else ""
                print(f"batch {batches}: hidden_states [{', '.join(map(str, hs.shape))}] {str(hs.dtype).replace('torch.', '')}, "
                      f"attention_mask [{', '.join(map(str, batch['attention_mask'].shape))}], "
                      f"{len(batch['ids'])} samples, {n_real} tokens in {batch['attention_mask'].numel()} slots, "
                      f"{n_loss} loss tokens{extra}, loss {losses[-1]:.4f}")
            seen.update(batch["ids"])
            real += n_real
            slots += batch["attention_mask"].numel()
            loss_tokens += n_loss
            steps += 1
            batches += 1
    secs = time.perf_counter() - start
    if not steps:
        print("no batches: the folder's share for this rank is empty", file=sys.stderr)
        return 1
    print(f"done: {len(seen)} samples, {steps} steps over {a.epochs} epoch(s), {real} tokens "
          f"({real / slots:.0%} of {slots} slots {'packed' if a.pack else 'padded'}), {loss_tokens} loss tokens, "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {real / secs:.0f} tokens/s, {len(seen) * a.epochs / secs:.1f} samples/s "
          f"({secs:.2f} s with {a.workers} workers, the first batch after {first:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
