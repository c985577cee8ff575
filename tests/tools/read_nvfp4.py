#!/usr/bin/env python3
"""Independent reader of a packed NVFP4 export (ModelOpt's layout), numpy + safetensors only.

It does not use vqad code. For every layer that ModelOpt's post-processing would recognise
as NVFP4 (`<m>.weight` U8 + `<m>.weight_scale` F8_E4M3 + `<m>.weight_scale_2`) it checks the
shapes, decodes the weight with ModelOpt's documented formula

    W = e2m1(code) * fp32(weight_scale) * weight_scale_2      (fp32, left to right)

(even k in the low nibble of each byte), checks a 128x4 swizzled copy of the scales when
present, and reports the bytes per parameter of the quantized linears. With --reference
(a safetensors file holding FQ(W) of training as F32 [N, K] under the module name) every
decoded weight must equal the reference bit for bit.

Usage: read_nvfp4.py EXPORT_DIR [--reference REF.safetensors] [--json OUT.json]
Exit status 0 when every check passes, 1 otherwise.
"""
import argparse
import json
import os
import sys

import numpy as np
from safetensors import deserialize

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
NP_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "U8": np.uint8, "I8": np.int8,
             "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_}


def e4m3fn_table():
    """float32 value of every E4M3 (e4m3fn) byte: bias 7, subnormals man * 2^-9, 0x7F/0xFF NaN."""
    out = np.empty(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp = (b >> 3) & 0xF
        man = b & 7
        if exp == 0xF and man == 7:
            out[b] = np.nan
        elif exp == 0:
            out[b] = sign * man * 2.0 ** -9
        else:
            out[b] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return out


E4M3 = e4m3fn_table()


def load(path):
    """name -> (dtype string, shape, raw bytes as a uint8 array) via safetensors' own parser."""
    with open(path, "rb") as f:
        data = f.read()
    out = {}
    for name, info in deserialize(data):
        out[name] = (info["dtype"], tuple(info["shape"]), np.frombuffer(bytes(info["data"]), dtype=np.uint8))
    return out


def as_array(entry):
    dtype, shape, raw = entry
    if dtype not in NP_DTYPES:
        raise ValueError(f"dtype {dtype} has no numpy equivalent")
    return raw.view(NP_DTYPES[dtype]).reshape(shape)


def swizzled_offset(m, k, scale_cols):
    col_tiles = (scale_cols + 3) // 4
    tile = (m // 128) * col_tiles + k // 4
    return tile * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def decode_layer(tensors, m):
    """Returns (W fp32 [N, K], problems, bytes of the layer's packed tensors)."""
    problems = []
    wt, ws, ws2 = tensors[m + ".weight"], tensors[m + ".weight_scale"], tensors[m + ".weight_scale_2"]
    if wt[0] != "U8" or len(wt[1]) != 2:
        problems.append(f"{m}.weight: expected U8 [N, K/2], found {wt[0]} {list(wt[1])}")
    if ws[0] != "F8_E4M3" or len(ws[1]) != 2:
        problems.append(f"{m}.weight_scale: expected F8_E4M3 [N, K/16], found {ws[0]} {list(ws[1])}")
    if ws2[0] != "F32" or int(np.prod(ws2[1])) != 1:
        problems.append(f"{m}.weight_scale_2: expected an F32 scalar, found {ws2[0]} {list(ws2[1])}")
    if problems:
        return None, problems, 0
    n, half_k = wt[1]
    k = 2 * half_k
    if ws[1] != (n, k // 16):
        return None, [f"{m}.weight_scale: shape {list(ws[1])}, expected [{n}, {k // 16}] for weight [{n}, {half_k}]"], 0
    packed = wt[2].reshape(n, half_k)
    codes = np.empty((n, k), dtype=np.uint8)
    codes[:, 0::2] = packed & 0xF   # even k in the low nibble
    codes[:, 1::2] = packed >> 4
    mag = E2M1[codes & 7]
    e2m1 = np.where(codes & 8, -mag, mag).astype(np.float32)
    sf = E4M3[ws[2].reshape(n, k // 16)]
    if np.isnan(sf).any() or (sf < 0).any():
        problems.append(f"{m}.weight_scale: NaN or negative block scales")
    ws2v = np.float32(as_array(ws2).reshape(()))
    sf_full = np.repeat(sf, 16, axis=1)
    w = (e2m1 * sf_full).astype(np.float32) * ws2v  # e2m1 * f32(weight_scale) * weight_scale_2
    nbytes = wt[2].size + ws[2].size + ws2[2].size
    if m + ".input_scale" in tensors:
        ins = tensors[m + ".input_scale"]
        if ins[0] != "F32" or int(np.prod(ins[1])) != 1:
            problems.append(f"{m}.input_scale: expected an F32 scalar, found {ins[0]} {list(ins[1])}")
        elif not np.float32(as_array(ins).reshape(())) > 0:
            problems.append(f"{m}.input_scale: not positive")
        nbytes += ins[2].size
    sw_key = m + ".weight_scale_swizzled"
    if sw_key in tensors:
        sw = tensors[sw_key]
        cols = k // 16
        rows_p, cols_p = -(-n // 128) * 128, -(-cols // 4) * 4
        if sw[2].size != rows_p * cols_p:
            problems.append(f"{sw_key}: {sw[2].size} bytes, the 128x4 layout needs {rows_p * cols_p}")
        else:
            lin = ws[2].reshape(n, cols)
            mm, kk = np.meshgrid(np.arange(n), np.arange(cols), indexing="ij")
            back = sw[2][swizzled_offset(mm, kk, cols)]
            if not np.array_equal(back, lin):
                problems.append(f"{sw_key}: does not hold the scales of {m}.weight_scale in the 128x4 layout")
            mask = np.ones(sw[2].size, dtype=bool)
            mask[swizzled_offset(mm, kk, cols).ravel()] = False
            if sw[2][mask].any():
                problems.append(f"{sw_key}: pad bytes are not zero")
        nbytes += sw[2].size
    return w, problems, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--reference", help="safetensors with FQ(W) (F32 [N, K]) per module name")
    ap.add_argument("--json", help="write the report here")
    a = ap.parse_args()

    tdir = os.path.join(a.export_dir, "transformer")
    weights = os.path.join(tdir, "diffusion_pytorch_model.safetensors")
    problems = []
    with open(os.path.join(tdir, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    if not isinstance(qc, dict):
        problems.append("config.json: no quantization_config")
    else:
        for key, want in (("quant_method", "modelopt"), ("quant_algo", "NVFP4"), ("group_size", 16)):
            if qc.get(key) != want:
                problems.append(f"config.json quantization_config.{key} = {qc.get(key)!r}, expected {want!r}")
    tensors = load(weights)
    layers = sorted(n[: -len(".weight_scale")] for n in tensors
                    if n.endswith(".weight_scale") and tensors[n][0] == "F8_E4M3"
                    and n[: -len(".weight_scale")] + ".weight" in tensors
                    and n[: -len(".weight_scale")] + ".weight_scale_2" in tensors)
    ignored = set(qc.get("ignore", [])) if isinstance(qc, dict) else set()
    ref = load(a.reference) if a.reference else None
    report = {"layers": {}, "quantized_parameters": 0, "quantized_bytes": 0, "matched_reference": 0}
    for m in layers:
        if m in ignored:
            problems.append(f"{m}: packed but listed in quantization_config.ignore")
        w, p, nbytes = decode_layer(tensors, m)
        problems += p
        if w is None:
            continue
        entry = {"shape": list(w.shape), "bytes": int(nbytes), "bytes_per_parameter": nbytes / w.size}
        report["quantized_parameters"] += int(w.size)
        report["quantized_bytes"] += int(nbytes)
        if ref is not None:
            if m not in ref:
                problems.append(f"{m}: not in the reference file")
            else:
                r = as_array(ref[m])
                if r.shape != w.shape or r.dtype != np.float32:
                    problems.append(f"{m}: reference is {r.dtype} {list(r.shape)}, decoded {list(w.shape)}")
                else:
                    diff = int(np.count_nonzero(r.view(np.uint32) != w.view(np.uint32)))
                    entry["bit_mismatches"] = diff
                    if diff:
                        problems.append(f"{m}: {diff} of {w.size} decoded values differ from FQ(W) bit for bit")
                    else:
                        report["matched_reference"] += 1
        report["layers"][m] = entry
    if ref is not None:
        for name in ref:
            if name not in report["layers"]:
                problems.append(f"{name}: in the reference but not a packed NVFP4 layer of the export")
    qp = report["quantized_parameters"]
    report["bytes_per_parameter"] = report["quantized_bytes"] / qp if qp else 0.0
    report["problems"] = problems
    print(f"{len(layers)} NVFP4 layers, {qp} parameters, {report['quantized_bytes']} bytes, "
          f"{report['bytes_per_parameter']:.4f} bytes/parameter"
          + (f", {report['matched_reference']} equal to FQ(W) bit for bit" if ref is not None else ""))
    for p in problems:
        print("FAILED:", p)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    if not layers:
        print("FAILED: no NVFP4 layers found")
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
