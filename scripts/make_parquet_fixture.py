#!/usr/bin/env python3
"""FastVideo-schema parquet fixtures for vqad's data tests (needs only pyarrow).

  make_parquet_fixture.py write OUT_DIR   writes OUT_DIR/t2v/... and OUT_DIR/text_only/...
  make_parquet_fixture.py verify KIND PATH   reads a vqad-written file with pyarrow and
                                             checks schema and values (prints OK ...)
  make_parquet_fixture.py bench OUT_DIR ROWS  Wan-sized rows for reader benchmarks: latent
                                             [16, 20, 60, 104], text [512, 4096], random
                                             finite float32, zstd, 8 rows per file

Values follow closed formulas of the global row g so both sides can recompute them:
  latent[i] = 100 g + 0.5 (i mod 251) - 60
  text[i]   = g + 0.125 (i mod 13) - 0.75          (real tokens; padding rows are 0)
Ids are clip_<g:03d>, captions "caption <g>".
"""
import os
import struct
import sys

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA_T2V = pa.schema([
    pa.field("id", pa.string()),
    pa.field("vae_latent_bytes", pa.binary()),
    pa.field("vae_latent_shape", pa.list_(pa.int64())),
    pa.field("vae_latent_dtype", pa.string()),
    pa.field("text_embedding_bytes", pa.binary()),
    pa.field("text_embedding_shape", pa.list_(pa.int64())),
    pa.field("text_embedding_dtype", pa.string()),
    pa.field("file_name", pa.string()),
    pa.field("caption", pa.string()),
    pa.field("media_type", pa.string()),
    pa.field("width", pa.int64()),
    pa.field("height", pa.int64()),
    pa.field("num_frames", pa.int64()),
    pa.field("duration_sec", pa.float64()),
    pa.field("fps", pa.float64()),
])
SCHEMA_TEXT_ONLY = pa.schema([
    pa.field("id", pa.string()),
    pa.field("text_embedding_bytes", pa.binary()),
    pa.field("text_embedding_shape", pa.list_(pa.int64())),
    pa.field("text_embedding_dtype", pa.string()),
    pa.field("caption", pa.string()),
])

LATENT_SHAPE = [16, 3, 4, 6]
TEXT_DIM = 4096


def latent_values(g, n):
    return [100.0 * g + 0.5 * (i % 251) - 60.0 for i in range(n)]


def text_values(g, tokens, stored_tokens, dim):
    real = tokens * dim
    return [g + 0.125 * (i % 13) - 0.75 if i < real else 0.0 for i in range(stored_tokens * dim)]


def pack(vals):
    return struct.pack("<%df" % len(vals), *vals)


def t2v_row(g, tokens):
    n = 1
    for d in LATENT_SHAPE:
        n *= d
    return {
        "id": "clip_%03d" % g,
        "vae_latent_bytes": pack(latent_values(g, n)),
        "vae_latent_shape": LATENT_SHAPE,
        "vae_latent_dtype": "float32",
        "text_embedding_bytes": pack(text_values(g, tokens, tokens, TEXT_DIM)),
        "text_embedding_shape": [tokens, TEXT_DIM],
        "text_embedding_dtype": "float32",
        "file_name": "clip_%03d.mp4" % g,
        "caption": "caption %d" % g,
        "media_type": "video",
        "width": LATENT_SHAPE[3] * 8,
        "height": LATENT_SHAPE[2] * 8,
        "num_frames": LATENT_SHAPE[1],
        "duration_sec": 1.5 + g,
        "fps": 16.0,
    }


def write(out_dir):
    # t2v: two workers (tests recursive discovery and path order); the first file has
    # row groups of 2 rows so rows are addressed across row groups.
    tokens = {0: 3, 1: 5, 2: 7, 3: 4, 4: 9}
    layout = [("t2v/worker_0/data_chunk_0.parquet", [0, 1, 2], 2),
              ("t2v/worker_1/data_chunk_0.parquet", [3, 4], None)]
    for rel, rows, rg in layout:
        path = os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        table = pa.Table.from_pylist([t2v_row(g, tokens[g]) for g in rows], schema=SCHEMA_T2V)
        pq.write_table(table, path, compression="zstd", row_group_size=rg)
    # text_only stores the 512-padded embedding.
    rows = []
    for g in range(3):
        rows.append({
            "id": "clip_%03d" % g,
            "text_embedding_bytes": pack(text_values(g, 2 + g, 512, TEXT_DIM)),
            "text_embedding_shape": [512, TEXT_DIM],
            "text_embedding_dtype": "float32",
            "caption": "caption %d" % g,
        })
    path = os.path.join(out_dir, "text_only/data_chunk_0.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA_TEXT_ONLY), path, compression="zstd")


def verify(kind, path):
    table = pq.read_table(path)
    want = SCHEMA_T2V if kind == "t2v" else SCHEMA_TEXT_ONLY
    def norm(t):  # list child names differ between writers ("item" / "element")
        return "list<%s>" % t.value_type if pa.types.is_list(t) else str(t)
    got = [(f.name, norm(f.type)) for f in table.schema]
    if got != [(f.name, norm(f.type)) for f in want]:
        raise SystemExit("schema mismatch:\n%s\nexpected:\n%s" % (table.schema, want))
    for row in table.to_pylist():
        g = int(row["id"].split("_")[1])
        if row["caption"] != "caption %d" % g:
            raise SystemExit("row %d: caption %r" % (g, row["caption"]))
        tshape = row["text_embedding_shape"]
        text = struct.unpack("<%df" % (len(row["text_embedding_bytes"]) // 4), row["text_embedding_bytes"])
        if len(text) != tshape[0] * tshape[1] or row["text_embedding_dtype"] != "float32":
            raise SystemExit("row %d: text bytes/shape/dtype mismatch" % g)
        if list(text) != text_values(g, tshape[0], tshape[0], tshape[1]):
            raise SystemExit("row %d: text values differ" % g)
        if kind == "t2v":
            shape = row["vae_latent_shape"]
            lat = struct.unpack("<%df" % (len(row["vae_latent_bytes"]) // 4), row["vae_latent_bytes"])
            n = 1
            for d in shape:
                n *= d
            if len(lat) != n or row["vae_latent_dtype"] != "float32":
                raise SystemExit("row %d: latent bytes/shape/dtype mismatch" % g)
            if list(lat) != latent_values(g, n):
                raise SystemExit("row %d: latent values differ" % g)
            if row["media_type"] != "video" or row["fps"] != 16.0 or row["num_frames"] != shape[1]:
                raise SystemExit("row %d: metadata differs: %r" % (g, {k: row[k] for k in ("media_type", "fps", "num_frames")}))
    print("OK %s %d rows %d row groups" % (kind, table.num_rows, pq.ParquetFile(path).num_row_groups))


def bench(out_dir, rows):
    latent_shape, text_shape = [16, 20, 60, 104], [512, 4096]
    # Clearing bit 30 of every float keeps |x| < 2 (finite) and the bytes incompressible.
    table = bytes((b & 0xBF) for b in range(256))

    def rand_floats(n):
        raw = bytearray(os.urandom(4 * n))
        raw[3::4] = raw[3::4].translate(table)
        return bytes(raw)

    nl = 16 * 20 * 60 * 104
    nt = 512 * 4096
    per_file = 8
    os.makedirs(out_dir, exist_ok=True)
    for f in range((rows + per_file - 1) // per_file):
        batch = []
        for g in range(f * per_file, min(rows, (f + 1) * per_file)):
            batch.append({
                "id": "bench_%05d" % g, "vae_latent_bytes": rand_floats(nl),
                "vae_latent_shape": latent_shape, "vae_latent_dtype": "float32",
                "text_embedding_bytes": rand_floats(nt), "text_embedding_shape": text_shape,
                "text_embedding_dtype": "float32", "file_name": "bench_%05d.mp4" % g,
                "caption": "benchmark row %d" % g, "media_type": "video", "width": 832,
                "height": 480, "num_frames": 20, "duration_sec": 77 / 16.0, "fps": 16.0,
            })
        pq.write_table(pa.Table.from_pylist(batch, schema=SCHEMA_T2V),
                       os.path.join(out_dir, "data_chunk_%05d.parquet" % f), compression="zstd")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        write(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "bench":
        bench(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 4 and sys.argv[1] == "verify":
        verify(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
