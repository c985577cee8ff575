#!/usr/bin/env python3
"""Decoder parity: vqad's Wan VAE decoder against Diffusers' AutoencoderKLWan.

For each configuration (small random-weight ones and the real Wan2.1 VAE config with
random weights) this script builds the Diffusers model with seeded random weights, saves
it with save_pretrained, decodes seeded random latents with Diffusers (fp32, the
pipeline's de-normalisation latents * std + mean) and with `vqad decode --save-tensor`,
and reports the relative L2 error per output frame. Exit status 1 if any frame exceeds
the tolerance (1e-4).

Usage: tests/tools/vae_parity.py VQAD_BINARY WORK_DIR   (scripts/vae_parity.sh sets up a venv)
"""
import json
import os
import subprocess
import sys

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from safetensors.torch import load_file, save_file

TOL = 1e-4

CONFIGS = {
    "tiny": dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
    "small": dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True]),
    "wan2.1": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                   temperal_downsample=[False, True, True]),
}
# latent shapes [B, 16, T, H, W] per config (the real config at a small spatial size on CPU)
SHAPES = {"tiny": (2, 16, 4, 6, 8), "small": (1, 16, 3, 5, 7), "wan2.1": (1, 16, 3, 6, 8)}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gamma" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(fan_in, 1) ** 0.5))


def main():
    vqad, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    worst_all = 0.0
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoencoderKLWan(**cfg).eval()
        randomize(model, 1234)
        d = os.path.join(work, name)
        model.save_pretrained(os.path.join(d, "vae"), safe_serialization=True)
        g = torch.Generator().manual_seed(99)
        lat = torch.randn(SHAPES[name], generator=g)
        save_file({"latents": lat}, os.path.join(d, "latents.safetensors"))
        mean = torch.tensor(model.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(model.config.latents_std).view(1, -1, 1, 1, 1)
        with torch.no_grad():
            ref = model.decode(lat * std + mean, return_dict=False)[0].float()
        out = os.path.join(d, "out")
        subprocess.run([vqad, "decode", os.path.join(d, "latents.safetensors"), "--vae", d, "--out", out,
                        "--device", "cpu", "--no-video", "--save-tensor"], check=True)
        got = load_file(os.path.join(out, "decoded.safetensors"))["video"].float()
        assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} vs diffusers {tuple(ref.shape)}"
        errs = []
        for b in range(ref.shape[0]):
            for f in range(ref.shape[2]):
                r, x = ref[b, :, f].double(), got[b, :, f].double()
                errs.append(float((x - r).norm() / r.norm().clamp_min(1e-30)))
        worst = max(errs)
        worst_all = max(worst_all, worst)
        print(f"{name:8s} latents {list(SHAPES[name])} -> video {list(ref.shape)}: rel-L2 per frame "
              f"max {worst:.3e} mean {np.mean(errs):.3e} ({len(errs)} frames) {'ok' if worst <= TOL else 'FAIL'}")
    print(f"worst frame rel-L2 {worst_all:.3e} (tolerance {TOL:g})")
    sys.exit(0 if worst_all <= TOL else 1)


if __name__ == "__main__":
    main()
