#!/usr/bin/env python3
"""Writes tests/fixtures/bulk/mixed.parquet with pyarrow, as datasets are shared: an id column
and text, messages (list of {role, content}) and ids (list of int64) columns, with the bad rows
tests/bulk/input.rs expects (a null text, a null and an empty list, a message with a null content).
Row groups of 2 rows, and each column compressed with another codec (zstd, snappy, gzip), so the
reader is proven on all three. Also tests/fixtures/bulk/sharegpt.parquet: ShareGPT chats
(`conversations`, lists of {from, value}) of the same messages as mixed.parquet's rows a and d,
and a row whose speaker is unknown.

    python3 -m venv /tmp/pq && /tmp/pq/bin/pip install pyarrow
    /tmp/pq/bin/python scripts/make_parquet_fixture.py
"""
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

from fixture_common import FIXTURES_DIR

ROWS = [
    # id, text, messages, ids
    ("a", "hello world", [("user", "Hi"), ("assistant", "Hello!")], [1, 2, 3]),
    ("b", None, None, []),
    ("c", "the quick brown fox", [("user", "Hi"), ("assistant", None)], None),
    ("d", "a b c", [("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4")], [7]),
    ("e", "Zürich ✓", [("user", "x"), ("assistant", "y")], [100, 200, 300, 400]),
    ("f", "last row", [], [511]),
]

message = pa.struct([("role", pa.string()), ("content", pa.string())])
schema = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("messages", pa.list_(message)),
        ("ids", pa.list_(pa.int64())),
    ]
)
table = pa.table(
    {
        "id": [r[0] for r in ROWS],
        "text": [r[1] for r in ROWS],
        "messages": [None if r[2] is None else [{"role": a, "content": b} for a, b in r[2]] for r in ROWS],
        "ids": [r[3] for r in ROWS],
    },
    schema=schema,
)


def write(table, out, **kwargs):
    pq.write_table(table, out, **kwargs)
    print(f"{out}: {out.stat().st_size} bytes, pyarrow {pa.__version__}")


out = pathlib.Path(FIXTURES_DIR).resolve() / "bulk" / "mixed.parquet"
out.parent.mkdir(parents=True, exist_ok=True)
write(
    table,
    out,
    row_group_size=2,
    compression={"id": "snappy", "text": "zstd", "messages": "snappy", "ids": "gzip"},
)

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}
turn = pa.struct([("from", pa.string()), ("value", pa.string())])
shared = [
    ("a", [{"from": SHAREGPT_FROM[a], "value": b} for a, b in ROWS[0][2]]),
    ("d", [{"from": SHAREGPT_FROM[a], "value": b} for a, b in ROWS[3][2]]),
    ("odd", [{"from": "narrator", "value": "Once"}]),
]
write(
    pa.table(
        {"id": [r[0] for r in shared], "conversations": [r[1] for r in shared]},
        schema=pa.schema([("id", pa.string()), ("conversations", pa.list_(turn))]),
    ),
    out.parent / "sharegpt.parquet",
)
