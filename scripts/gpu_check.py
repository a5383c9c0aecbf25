"""One GPU check for ringctx: correctness, kernel speed, and a single-GPU million-token prefill.

    python scripts/gpu_check.py --out DIR [--budget-s 420] [--dry-run]

Sections (each writes into DIR/gpu_check.json as soon as it finishes, so a run cut short still
leaves what it measured; a section that fails is recorded and the next one runs):

  env         GPU, versions, datasheet peaks, measured bf16 matmul rate and copy bandwidth
  correctness every attention backend (torch, triton, flash-attn when installed) against the
              float64 reference: bf16/fp16 by the 2x rule (error at most 2x that of PyTorch's own
              unsharded computation in that dtype), fp32 (Triton) within 1e-5; full and diagonal
              blocks, GQA, head dims 64/80/128, packed sequences
  band        sliding-window (banded) and soft-capped blocks against the float64 reference: the
              Triton kernel (q_offset, window, softcap), flash-attn's band path where its
              bottom-right alignment applies (and that it declines the other blocks), and the
              PyTorch band fallback; bf16 by the 2x rule, fp32 within 1e-5; the decode kernel's cap;
              a windowed block finished with per-head sink logits (LayerSoftmax.finish)
  attention   TFLOP/s of the Triton kernel, PyTorch's flash SDPA op and flash-attn (if installed),
              causal bf16, S = 16K and 64K, head dims 64 and 128
  window      a windowed block (T = S = 32K, W = 1024 and 4096, d 128, bf16) against the full
              causal block: Triton (and flash-attn when installed), TFLOP/s on the FLOPs actually
              in the band, and the time ratio full / windowed
  decode      decode attention of B = 1..16 query tokens (one per question about one document)
              against a long K/V: the split-K Triton decode kernel against float64 (bf16 within
              2x PyTorch's own bf16 error), and its K/V read bandwidth against the Triton block
              kernel, PyTorch's SDPA (expanded KV heads, what "auto" ran without flash-attn) and
              flash-attn when installed; SmolLM2 and Llama-3.1-8B shapes at 32K and 256K keys
  batch       continuous batching on the GPU (Engine.ask_many: one step for every question, each
              document's rows read once for all of them through the split-K decode kernel): the
              embedded SmolLM2, one document, 8 questions together against each asked alone, greedy;
              answers compared (float32 in --dry-run: identical; bf16: tokens agreeing, stated) and
              aggregate tokens/s against the lone answers' (the issue's 5x-at-8 target)
  build       the csrc CUDA extension (torch.utils.cpp_extension), built in a background thread
              from the start while the sections above use the GPU; this section waits for it
  merge       the merge kernel against float64 (2x rule against the torch float32 merge) and the
              KV scatter kernel against index_copy_ (bit-exact); GB/s of both against the torch
              paths, as fractions of the card's bandwidth (datasheet and measured copy)
  allreduce   the TP all-reduce on every GPU here (one: a one-rank group, fixed costs only):
              symmetric-memory one-shot and two-shot against NCCL, 4 KiB - 16 MiB of bf16, each
              result against the float64 sum and the same bits on every rank
  ep          expert parallelism's dispatch and combine (model/expert_parallel.py's two-shot
              all-to-all over NCCL, every GPU here): 1 - 8192 tokens a rank at Qwen3-30B-A3B's
              width and top-8, microseconds and GB/s, each result checked bit for bit
  experts     grouped experts at Qwen3-30B-A3B's expert shape (128 x top 8, 2048 x 768, bf16):
              torch._grouped_mm against moe.py's per-expert loop at 512-16K tokens, both against
              float32 products, ms and TFLOP/s (the GPU answer for selection.grouped_experts)
  prefill     chunked prefill (64K-token chunks) of SmolLM2-135M shapes, random weights, on one
              GPU at 128K and 1M tokens with the fastest backend that passed: tokens/s, time to
              first token, MFU, and time against what the attention FLOPs at the kernel rate
              measured above predict (1M is skipped, and says so, if the budget cannot fit it)

--dry-run runs every section on the CPU with tiny shapes (the Triton kernel in its interpreter,
float32, the torch fallbacks of the CUDA kernels) to check the script itself; its numbers mean
nothing. Exit status: 0 when every correctness check passed (speed targets are reported, never
asserted), 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Datasheet numbers (dense bf16 tensor FLOP/s, HBM bytes/s), matched on the device name.
DATASHEET = [("H200", 989e12, 4.8e12), ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12),
             ("A100-SXM4-80GB", 312e12, 2.039e12), ("A100", 312e12, 1.555e12), ("L40S", 362e12, 0.864e12)]


class Check:
    """Collects results by section and rewrites the JSON file after every section."""

    def __init__(self, out: Path, budget_s: float, dry: bool):
        self.out, self.dry, self.t0, self.budget = out, dry, time.monotonic(), budget_s
        self.results: dict = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "dry_run": dry, "sections": {}, "failures": [], "targets": {}}
        self.device = "cpu" if dry else "cuda"

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def fail(self, what: str) -> None:
        self.results["failures"].append(what)
        print(f"  FAIL {what}", flush=True)

    def section(self, name: str, fn) -> None:
        print(f"== {name} ({self.left():.0f} s of budget left)", flush=True)
        t = time.monotonic()
        try:
            data = fn(self)
        except Exception as e:  # noqa: BLE001 - record and go on to the next section
            data = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            self.fail(f"{name}: {type(e).__name__}: {e}")
        data = data if isinstance(data, dict) else {"value": data}
        data["seconds"] = round(time.monotonic() - t, 2)
        self.results["sections"][name] = data
        self.write()

    def write(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))


# --- timing ----------------------------------------------------------------------------------

def time_once(fn, dry: bool) -> float:
    """Seconds of one fn() call: CUDA events on a GPU, the wall clock in a dry run."""
    import torch

    if dry:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def timed(ck: Check, fn, *, min_reps: int = 3, min_seconds: float = 0.3, max_reps: int = 100) -> float:
    """Median seconds of fn() after two warm-up calls (CUDA events on GPU)."""
    for _ in range(2):
        fn()
    times: list[float] = []
    start = time.monotonic()
    while len(times) < max_reps and (len(times) < min_reps or time.monotonic() - start < min_seconds):
        times.append(time_once(fn, ck.dry))
    return statistics.median(times)


# --- env and build ---------------------------------------------------------------------------

def env_section(ck: Check) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "platform": platform.platform()}
    for pkg in ("triton", "flash_attn"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception as e:  # noqa: BLE001
            info[pkg] = f"unavailable ({type(e).__name__})"
    if ck.dry:
        info["gpu"] = "none (dry run)"
        return info
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}")
    for key, flops, bw in DATASHEET:
        if key in p.name:
            info.update(datasheet_bf16_tflops=flops / 1e12, datasheet_hbm_gbs=bw / 1e9)
            break
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    info["measured_bf16_matmul_tflops"] = round(2 * 8192**3 / timed(ck, lambda: a @ a) / 1e12, 1)
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    info["measured_copy_gbs"] = round(2 * x.numel() / timed(ck, lambda: y.copy_(x)) / 1e9, 1)  # read + write
    del a, x, y
    ck.results["env"] = info
    return info


def start_build(ck: Check) -> None:
    """Build the csrc extension in a background thread: ninja/nvcc work on the CPUs while the
    attention sections keep the GPU busy (the build releases the GIL while it waits)."""
    import threading

    from ringctx.attention import cuda_ext

    def build():
        t = time.monotonic()
        cuda_ext.load_extension()
        ck.results["build_thread_s"] = round(time.monotonic() - t, 1)

    threading.Thread(target=build, name="csrc-build", daemon=True).start()


def build_section(ck: Check) -> dict:
    from ringctx.attention import cuda_ext

    t = time.monotonic()
    mod = cuda_ext.load_extension()  # waits for the background build, or builds now
    res = {"loaded": mod is not None, "waited_s": round(time.monotonic() - t, 1),
           "build_s": ck.results.get("build_thread_s"), "error": cuda_ext.extension_error(),
           "csrc": str(cuda_ext.csrc_dir())}
    if mod is None and not ck.dry:
        ck.fail(f"csrc extension not available: {cuda_ext.extension_error()}")
    return res


# --- correctness -----------------------------------------------------------------------------

def _inputs(T, S, hq, hkv, d, dtype, device, seed):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(device, dtype) for n, h in ((T, hq), (S, hkv), (S, hkv))]


def _visible(T, S, causal, cu_q=None, cu_k=None, device="cpu"):
    import torch

    cu_q, cu_k = cu_q or [0, T], cu_k or [0, S]
    vis = torch.zeros(T, S, dtype=torch.bool, device=device)
    for b in range(len(cu_q) - 1):
        blk = torch.ones(cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], dtype=torch.bool, device=device)
        vis[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = blk.tril() if causal else blk
    return vis


def _torch_unsharded(q, k, v, visible):
    """PyTorch's own computation in the input dtype: SDPA with expanded KV heads (the 2x-rule baseline)."""
    import torch

    g = q.shape[1] // k.shape[1]
    ke, ve = (x.repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), ke, ve, attn_mask=visible)
    return out.transpose(0, 1).nan_to_num(0.0)  # SDPA gives NaN on fully masked rows


def correctness_section(ck: Check) -> dict:
    import torch

    from ringctx.attention import attention_block, reference_attention
    from ringctx.attention.kernels import flash_attn_available
    from ringctx.attention.triton_attn import triton_attention_block

    dev = ck.device
    lowp = torch.float32 if ck.dry else torch.bfloat16  # bf16 math is broken in the interpreter
    small = 0.125 if ck.dry else 1.0
    n = lambda x: max(4, int(x * small))  # noqa: E731
    cases = [  # name, T, S, hq, hkv, d, causal, dtype, cu (packed sequences)
        ("diag-d64-gqa3", n(1024), n(1024), 9, 3, 64, True, lowp, None),
        ("full-d128-gqa4", n(512), n(1536), 16, 4, 128, False, lowp, None),
        ("diag-d80-gqa4-odd", n(777), n(777), 8, 2, 80, True, lowp, None),
        ("full-d64-mha-fp16", n(640), n(320), 4, 4, 64, False, torch.float32 if ck.dry else torch.float16, None),
        ("diag-d128-fp32", n(512), n(512), 8, 2, 128, True, torch.float32, None),
    ]
    L = n(1400)
    cu = [0, L // 5, L // 5, (2 * L) // 3, L]
    cases.append(("packed-diag-d128", L, L, 8, 2, 128, True, lowp, (cu, cu)))
    backends = ["torch", "triton"] + (["flash-attn"] if not ck.dry and flash_attn_available() else [])
    rows = []
    for i, (name, T, S, hq, hkv, d, causal, dtype, cu_pair) in enumerate(cases):
        q, k, v = _inputs(T, S, hq, hkv, d, dtype, dev, seed=i)
        vis = _visible(T, S, causal, *(cu_pair or (None, None)), device=dev)
        ref_out, ref_lse = reference_attention(q, k, v, vis)
        base = _torch_unsharded(q, k, v, vis)
        base_err = (base.double() - ref_out).abs().max().item()
        for b in backends:
            if dtype == torch.float32 and b != "triton" and not ck.dry:
                continue  # fp32 is a Triton-kernel feature; the CUDA flash ops take 16-bit only
            if cu_pair is not None and b != "triton":
                continue  # packed sequences in one launch: the Triton kernel's own API
            row = {"case": name, "backend": b, "dtype": str(dtype).replace("torch.", ""), "T": T, "S": S}
            try:
                if cu_pair is not None:
                    out, lse = triton_attention_block(q, k, v, causal=causal, cu_seqlens_q=cu_pair[0], cu_seqlens_k=cu_pair[1])
                else:
                    out, lse = attention_block(q, k, v, causal=causal, backend=b)
                err = (out.double() - ref_out).abs().max().item()
                fin = torch.isfinite(ref_lse)
                lse_err = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
                tol = 1e-5 if dtype == torch.float32 else 2 * base_err
                lse_tol = 2e-5 if dtype == torch.float32 else 1e-4  # float32 lse from exact 16-bit products
                ok = (err <= tol and lse_err <= lse_tol and not torch.isnan(out).any().item()
                      and torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and out.dtype == dtype)
                row.update(err=err, torch_err=base_err, tol=tol, lse_err=lse_err, ok=bool(ok))
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            rows.append(row)
            print(f"  {name:22s} {b:10s} " + (f"err {row.get('err', float('nan')):.2e} (torch {base_err:.2e}) "
                                               f"lse {row.get('lse_err', float('nan')):.1e} " if "err" in row else
                                               row.get("error", "")) + ("ok" if row["ok"] else "FAIL"), flush=True)
            if not row["ok"]:
                ck.fail(f"correctness {name} {b}")
    return {"attention": rows}


def _torch_unsharded_capped(q, k, v, visible, scale, softcap):
    """The 2x-rule baseline for soft-capped blocks (SDPA cannot cap): PyTorch in the input dtype,
    explicit scores (expanded KV heads), capped, masked softmax, all in q's dtype. Returns
    (out [T, Hq, D], lse [Hq, T] float32 of those 16-bit scores: the lse baseline)."""
    import torch

    g = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(g, dim=1).transpose(0, 1), v.repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vh).transpose(0, 1), torch.logsumexp(s.float(), dim=-1)


def band_section(ck: Check) -> dict:
    """Windowed and soft-capped blocks (q_offset, window, softcap) against float64."""
    import math

    import torch

    from ringctx.attention.gpu_blocks import flash_attn_band_block, torch_band_block
    from ringctx.attention.kernels import flash_attn_available
    from ringctx.attention.reference import band_mask, reference_attention
    from ringctx.attention.triton_attn import triton_attention_block, triton_decode_attention

    dev = ck.device
    lowp = torch.float32 if ck.dry else torch.bfloat16
    small = 0.125 if ck.dry else 1.0
    n = lambda x: max(4, int(x * small))  # noqa: E731
    cases = [  # name, T, S, q_offset, window, softcap, hq, hkv, d, dtype
        ("square-w256-d128-gqa4", n(1024), n(1024), 0, n(256), 0.0, 16, 4, 128, lowp),
        ("aligned-w300-cap30-d64", n(512), n(1536), n(1536) - n(512), n(300), 30.0, 9, 3, 64, lowp),
        ("ring-w384-cap50-d128", n(512), n(1024), n(256), n(384), 50.0, 8, 2, 128, lowp),
        ("empty-rows-w64-d80", n(300), n(200), -n(50), n(64), 0.0, 8, 2, 80, lowp),
        ("w1-d64", n(256), n(256), 0, 1, 0.0, 4, 4, 64, lowp),
        ("fp32-w100-cap20-d64", n(600), n(600), 0, n(100), 20.0, 8, 2, 64, torch.float32),
    ]
    flash = not ck.dry and flash_attn_available()
    rows = []
    for i, (name, T, S, off, w, cap, hq, hkv, d, dtype) in enumerate(cases):
        q, k, v = _inputs(T, S, hq, hkv, d, dtype, dev, seed=100 + i)
        q = q * 2  # scores large enough for the cap to bend them
        scale = 1.0 / math.sqrt(d)
        vis = band_mask(T, S, off, w, device=dev)
        ref_out, ref_lse = reference_attention(q, k, v, vis, scale, softcap=cap)
        # 2x rule: out against PyTorch's own 16-bit computation (SDPA, or explicit scores when
        # capped); lse within 1e-4 (float32 from exact 16-bit products) or, capped, twice the
        # 16-bit baseline's (flash-attn caps with an approximate tanh).
        fin = torch.isfinite(ref_lse)
        base_lse_err = 0.0
        if cap > 0:
            base, base_lse = _torch_unsharded_capped(q, k, v, vis, scale, cap)
            base_lse_err = (base_lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        else:
            base = _torch_unsharded(q, k, v, vis)
        base_err = (base.double() - ref_out).abs().max().item()
        runs = {"triton": lambda: triton_attention_block(q, k, v, causal=True, softmax_scale=scale, q_offset=off,
                                                         window=w, softcap=cap),
                "torch-band": lambda: torch_band_block(q, k, v, scale=scale, q_offset=off, window=w, softcap=cap)}
        if flash:
            runs["flash-attn"] = lambda: flash_attn_band_block(q, k, v, scale=scale, q_offset=off, window=w, softcap=cap)
        for b, fn in runs.items():
            row = {"case": name, "backend": b, "dtype": str(dtype).replace("torch.", ""), "T": T, "S": S,
                   "q_offset": off, "window": w, "softcap": cap}
            try:
                res = fn()
                if res is None:  # flash-attn declines: it must be exactly the blocks it cannot express
                    expected = off != S - T or dtype == torch.float32
                    row.update(declined=True, ok=bool(expected))
                else:
                    out, lse = res
                    err = (out.double() - ref_out).abs().max().item()
                    lse_err = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
                    tol = 1e-5 if dtype == torch.float32 else 2 * base_err
                    lse_tol = 2e-5 if dtype == torch.float32 else max(1e-4, 2 * base_lse_err)
                    ok = (err <= tol and lse_err <= lse_tol and not torch.isnan(out).any().item()
                          and torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and out.dtype == dtype)
                    row.update(err=err, torch_err=base_err, tol=tol, lse_err=lse_err, ok=bool(ok))
            except Exception as e:  # noqa: BLE001
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            rows.append(row)
            what = ("declined (not its alignment / dtype)" if row.get("declined") else
                    f"err {row['err']:.2e} (torch {base_err:.2e}) lse {row['lse_err']:.1e}" if "err" in row
                    else row.get("error", ""))
            print(f"  {name:24s} {b:10s} {what} " + ("ok" if row["ok"] else "FAIL"), flush=True)
            if not row["ok"]:
                ck.fail(f"band {name} {b}")
    # The decode kernel's cap (a decode block is full: no band).
    q, k, v = _inputs(8, n(4096), 32, 8, 128, lowp, dev, seed=199)
    q = q * 2
    ref_out, ref_lse = reference_attention(q, k, v, None, 1 / math.sqrt(128), softcap=30.0)
    base, base_lse = _torch_unsharded_capped(q, k, v, torch.ones(8, k.shape[0], dtype=torch.bool, device=dev),
                                             1 / math.sqrt(128), 30.0)
    base_err = (base.double() - ref_out).abs().max().item()
    out, lse = triton_decode_attention(q, k, v, softcap=30.0)
    err = (out.double() - ref_out).abs().max().item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    tol = 1e-5 if lowp == torch.float32 else 2 * base_err
    lse_tol = 2e-5 if lowp == torch.float32 else max(1e-4, 2 * (base_lse.double() - ref_lse).abs().max().item())
    ok = err <= tol and lse_err <= lse_tol
    rows.append({"case": "decode-cap30-d128", "backend": "triton-decode", "err": err, "torch_err": base_err,
                 "tol": tol, "lse_err": lse_err, "ok": bool(ok)})
    print(f"  {'decode-cap30-d128':24s} {'triton-dec':10s} err {err:.2e} (torch {base_err:.2e}) lse {lse_err:.1e} "
          + ("ok" if ok else "FAIL"), flush=True)
    if not ok:
        ck.fail("band decode-cap30-d128 triton-decode")
    # Sinks (gpt-oss): a windowed Triton block finished with per-head sink logits (LayerSoftmax.finish,
    # the one place every path applies them) against the float64 reference with the sinks in it.
    from ringctx.attention.spans import LayerSoftmax, Span

    T, w = n(512), n(128)
    q, k, v = _inputs(T, T, 8, 2, 64, lowp, dev, seed=198)
    sinks = torch.linspace(-2.0, 3.0, 8, device=dev)
    softmax = LayerSoftmax(1 / math.sqrt(64), span=Span(window=w), sinks=sinks)
    ref_out, _ = reference_attention(q, k, v, band_mask(T, T, 0, w, device=dev), softmax.scale, sinks=sinks)
    out = softmax.finish(*triton_attention_block(q, k, v, causal=True, softmax_scale=softmax.scale, window=w))
    base = softmax.finish(*_torch_unsharded_capped(q, k, v, band_mask(T, T, 0, w, device=dev), softmax.scale, 0.0))
    base_err = (base.double() - ref_out).abs().max().item()
    err = (out.double() - ref_out).abs().max().item()
    tol = 1e-5 if lowp == torch.float32 else 2 * base_err
    ok = err <= tol
    rows.append({"case": "sinks-w128-d64", "backend": "triton+finish", "err": err, "torch_err": base_err, "tol": tol,
                 "ok": bool(ok)})
    print(f"  {'sinks-w128-d64':24s} {'triton':10s} err {err:.2e} (torch {base_err:.2e}) " + ("ok" if ok else "FAIL"),
          flush=True)
    if not ok:
        ck.fail("band sinks-w128-d64 triton")
    return {"rows": rows}


def kv8_section(ck: Check) -> dict:
    """8-bit KV caches on the device: attention_block_quantized (its blocked path there) against
    float64 on the dequantized rows, then one decode step's attention over a long cache, bf16
    against fp8 and int8 (the 8-bit ones should read about half the bytes)."""
    import torch

    from ringctx.attention import attention_block, reference_attention
    from ringctx.attention.quant import attention_block_quantized, dequantize_rows, quantize_rows

    dev, rows = ck.device, []
    long_s = 4096 if ck.dry else 1 << 20
    for kind in ("int8", "fp8"):
        for T, S in ((1, 5000), (64, 9000)):
            q, k, v = _inputs(T, S, 32, 8, 128, torch.float32, dev, seed=T + S)
            (kd, ks), (vd, vs) = quantize_rows(k, kind), quantize_rows(v, kind)
            ref, ref_lse = reference_attention(q, dequantize_rows(kd, ks), dequantize_rows(vd, vs), None)
            out, lse = attention_block_quantized(q, kd, ks, vd, vs, block_rows=2048)
            err = (out.double() - ref).abs().max().item()
            ok = err <= 1e-5 and (lse.double() - ref_lse).abs().max().item() <= 2e-5
            rows.append({"kind": kind, "T": T, "S": S, "err": err, "ok": bool(ok)})
            print(f"  kv8 {kind} T={T} S={S}: err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
            if not ok:
                ck.fail(f"kv8 {kind} T={T}")
    dtype = torch.float32 if ck.dry else torch.bfloat16
    q, k, v = _inputs(1, long_s, 32, 8, 128, dtype, dev, seed=7)
    times = {"bf16": timed(ck, lambda: attention_block(q, k, v))}
    for kind in ("int8", "fp8"):
        (kd, ks), (vd, vs) = quantize_rows(k, kind), quantize_rows(v, kind)
        times[kind] = timed(ck, lambda: attention_block_quantized(q, kd, ks, vd, vs))
    print("  decode attention over " + f"{long_s:,} keys (ms): " + ", ".join(f"{k} {1e3 * t:.2f}" for k, t in times.items()))
    return {"correctness": rows, "decode_ms": {k: 1e3 * t for k, t in times.items()}, "keys": long_s}


def _check_merge(ck: Check) -> dict:
    import torch

    from ringctx.attention import cuda_ext, merge_partials

    dev, dtype = ck.device, (torch.float32 if ck.dry else torch.bfloat16)
    T, H, D, N = (64, 4, 64, 3) if ck.dry else (4096, 16, 128, 3)
    g = torch.Generator().manual_seed(0)
    parts = []
    for _ in range(N):
        lse = torch.randn(H, T, generator=g) * 3
        lse[torch.rand(H, T, generator=g) < 0.1] = float("-inf")  # rows this partial saw nothing of
        parts.append((torch.randn(T, H, D, generator=g).to(dev, dtype), lse.to(dev)))
    lse = torch.stack([p[1].double() for p in parts])
    total = torch.logsumexp(lse, 0)
    w = torch.where(torch.isfinite(total), torch.exp(lse - total.nan_to_num(neginf=0.0)), 0.0).nan_to_num(0.0)
    want = (torch.stack([p[0].double() for p in parts]) * w.transpose(1, 2)[..., None]).sum(0)
    got = cuda_ext.try_merge_partials_cuda(parts)
    with cuda_ext.csrc_disabled():
        torch_out, _ = merge_partials(parts)
    torch_err = (torch_out.double() - want).abs().max().item()
    res = {"kernel_used": got is not None, "torch_err": torch_err}
    if got is None:
        if not ck.dry:
            ck.fail(f"merge kernel unavailable: {cuda_ext.extension_error()}")
        return res
    err = (got[0].double() - want).abs().max().item()
    fin = torch.isfinite(total)
    lse_err = (got[1].double()[fin] - total[fin]).abs().max().item()
    ok = err <= 2 * torch_err + 1e-6 and lse_err <= 1e-5 and torch.equal(torch.isinf(got[1]), torch.isinf(total))
    res.update(err=err, lse_err=lse_err, ok=bool(ok))
    print(f"  merge kernel err {err:.2e} (torch {torch_err:.2e}) lse {lse_err:.1e} {'ok' if ok else 'FAIL'}")
    if not ok:
        ck.fail("merge kernel against float64")
    return res


def _check_scatter(ck: Check) -> dict:
    import torch

    from ringctx.attention import cuda_ext

    dev = ck.device
    L, P, n = (3, 64, 40) if ck.dry else (30, 8192, 5000)
    mk = lambda rows: [torch.randn(rows, 3, 64, device=dev, dtype=torch.bfloat16) for _ in range(L)]  # noqa: E731
    kc, vc, ks, vs = mk(P), mk(P), mk(n), mk(n)
    pos = torch.randperm(P, device=dev)[:n]
    kc2, vc2 = [x.clone() for x in kc], [x.clone() for x in vc]
    cuda_ext.scatter_kv(kc, vc, ks, vs, pos)
    cuda_ext.scatter_kv_torch(kc2, vc2, ks, vs, pos)
    ok = all(torch.equal(a, b) for a, b in zip(kc + vc, kc2 + vc2))
    print(f"  scatter_kv {'ok' if ok else 'FAIL'} (kernel {'used' if cuda_ext.extension_available() else 'not used'})")
    if not ok:
        ck.fail("scatter kernel against index_copy_")
    return {"ok": ok, "kernel_used": cuda_ext.extension_available()}


# --- speed -----------------------------------------------------------------------------------

def attention_section(ck: Check) -> dict:
    import torch

    from ringctx.attention.kernels import flash_attn_available
    from ringctx.attention.triton_attn import triton_attention_block

    shapes = [(128, 64, 4, 2)] if ck.dry else [(16384, 64, 32, 8), (16384, 128, 32, 8), (65536, 64, 32, 8),
                                                (65536, 128, 32, 8)]
    dtype = torch.float32 if ck.dry else torch.bfloat16
    rows = []
    for S, d, hq, hkv in shapes:
        if ck.left() < 60:
            rows.append({"S": S, "d": d, "skipped": "time budget"})
            continue
        q, k, v = _inputs(S, S, hq, hkv, d, dtype, ck.device, seed=S + d)
        flops = 4 * hq * d * S * S / 2  # two matmuls over the S(S+1)/2 visible pairs (causal)
        # SDPA's flash op has no GQA: expand KV once, outside the timed region (same FLOPs).
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k.repeat_interleave(hq // hkv, 1),
                                                                v.repeat_interleave(hq // hkv, 1)))
        runs = {"triton": lambda: triton_attention_block(q, k, v, causal=True)}
        if ck.dry:
            runs["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        else:
            runs["sdpa-flash"] = lambda: torch.ops.aten._scaled_dot_product_flash_attention(qb, kb, vb, 0.0, True, False)
            if flash_attn_available():
                from flash_attn import flash_attn_func

                runs["flash-attn"] = lambda: flash_attn_func(q[None], k[None], v[None], causal=True)
        row = {"S": S, "d": d, "hq": hq, "hkv": hkv, "dtype": str(dtype).replace("torch.", "")}
        for name, fn in runs.items():
            try:
                sec = timed(ck, fn)
                row[name] = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1)}
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {e}"}
        base = row.get("sdpa-flash", row.get("sdpa", {})).get("tflops")
        if base and "tflops" in row["triton"]:
            row["triton_vs_sdpa"] = round(row["triton"]["tflops"] / base, 3)
        rows.append(row)
        print("  " + json.dumps(row), flush=True)
        del q, k, v, qb, kb, vb
    target = next((r for r in rows if r.get("S") == 16384 and r.get("d") == 128 and "triton_vs_sdpa" in r), None)
    if target:
        ck.results["targets"]["triton >= 0.7 x sdpa flash (S=16K, d=128, causal bf16)"] = {
            "ratio": target["triton_vs_sdpa"], "met": target["triton_vs_sdpa"] >= 0.7}
    return {"rows": rows}


def _band_pairs(T: int, S: int, q_offset: int, window: int) -> int:
    """Visible (query, key) pairs of a band block, counted in closed form per row:
    row i sees min(i + q_offset, S - 1) - max(i + q_offset - window + 1, 0) + 1 keys (if > 0)."""
    total = 0
    for i in range(T):  # T <= 64K here: a Python loop is fast enough
        hi = min(i + q_offset, S - 1)
        lo = max(i + q_offset - window + 1, 0) if window else 0
        total += max(0, hi - lo + 1)
    return total


def window_section(ck: Check) -> dict:
    """A windowed block against the full causal block: TFLOP/s on the band's own FLOPs."""
    import torch

    from ringctx.attention.gpu_blocks import flash_attn_band_block
    from ringctx.attention.kernels import flash_attn_available
    from ringctx.attention.triton_attn import triton_attention_block

    S, d, hq, hkv = (256, 64, 4, 2) if ck.dry else (32768, 128, 32, 8)
    windows = (32, 64) if ck.dry else (1024, 4096)
    dtype = torch.float32 if ck.dry else torch.bfloat16
    q, k, v = _inputs(S, S, hq, hkv, d, dtype, ck.device, seed=77)
    scale = d ** -0.5
    flash = not ck.dry and flash_attn_available()
    rows = []
    full_flops = 4 * hq * d * _band_pairs(S, S, 0, 0)
    full = {}
    for name, fn in [("triton", lambda: triton_attention_block(q, k, v, causal=True)),
                     ("flash-attn", lambda: flash_attn_band_block(q, k, v, scale=scale, q_offset=0, window=0))]:
        if name == "flash-attn" and not flash:
            continue
        try:
            sec = timed(ck, fn)
            full[name] = {"ms": round(sec * 1e3, 3), "tflops": round(full_flops / sec / 1e12, 1), "s": sec}
        except Exception as e:  # noqa: BLE001
            full[name] = {"error": f"{type(e).__name__}: {e}"}
    rows.append({"T": S, "S": S, "window": 0, "d": d, "hq": hq, "hkv": hkv, "band_flops": full_flops,
                 **{name: {x: y for x, y in r.items() if x != "s"} for name, r in full.items()}})
    print("  " + json.dumps(rows[-1]), flush=True)
    for w in windows:
        if ck.left() < 30:
            rows.append({"window": w, "skipped": "time budget"})
            continue
        flops = 4 * hq * d * _band_pairs(S, S, 0, w)  # two matmuls over the pairs in the band
        row = {"T": S, "S": S, "window": w, "d": d, "hq": hq, "hkv": hkv, "band_flops": flops}
        runs = {"triton": lambda: triton_attention_block(q, k, v, causal=True, window=w)}
        if flash:
            runs["flash-attn"] = lambda: flash_attn_band_block(q, k, v, scale=scale, q_offset=0, window=w)
        for name, fn in runs.items():
            try:
                sec = timed(ck, fn)
                row[name] = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1)}
                if "s" in full.get(name, {}):  # unrounded: a dry run's TFLOP/s round to 0
                    row[name]["full_over_window_time"] = round(full[name]["s"] / sec, 2)
                    row[name]["window_over_full_tflops"] = round(flops / sec / (full_flops / full[name]["s"]), 3)
            except Exception as e:  # noqa: BLE001
                row[name] = {"error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        print("  " + json.dumps(row), flush=True)
    del q, k, v
    return {"rows": rows}


def decode_section(ck: Check) -> dict:
    import torch

    from ringctx.attention.kernels import flash_attn_available
    from ringctx.attention.reference import reference_attention
    from ringctx.attention.triton_attn import triton_attention_block, triton_decode_attention

    env = ck.results.get("env", {})
    peak_bw, copy_bw = env.get("datasheet_hbm_gbs"), env.get("measured_copy_gbs")
    dtype = torch.float32 if ck.dry else torch.bfloat16
    # correctness first: B tokens x GQA group rows against an odd length, float64 reference
    checks = []
    for B, hq, hkv, d, S in [(1, 9, 3, 64, 301), (8, 9, 3, 64, 1001), (16, 32, 8, 128, 777)][: 2 if ck.dry else 3]:
        q, k, v = _inputs(B, S, hq, hkv, d, dtype, ck.device, seed=B + S)
        out, lse = triton_decode_attention(q, k, v)
        ref_out, ref_lse = reference_attention(q.cpu(), k.cpu(), v.cpu())
        err = (out.cpu().double() - ref_out).abs().max().item()
        if dtype == torch.float32:
            ok, bound = err <= 1e-5, 1e-5
        else:  # the 2x rule against PyTorch's own bf16 computation (expanded KV heads)
            ke, ve = (x.repeat_interleave(hq // hkv, 1) for x in (k, v))
            base = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), ke.transpose(0, 1),
                                                                    ve.transpose(0, 1)).transpose(0, 1)
            bound = 2 * (base.cpu().double() - ref_out).abs().max().item() + 1e-6
            ok = err <= bound
        lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
        ok = ok and lse_err <= (1e-5 if dtype == torch.float32 else 1e-2)
        checks.append({"B": B, "hq": hq, "hkv": hkv, "d": d, "S": S, "err": err, "bound": bound, "lse_err": lse_err,
                       "ok": ok})
        if not ok:
            ck.fail(f"decode kernel B={B} S={S} d={d}: error {err:.3g} > {bound:.3g} or lse {lse_err:.3g}")
    # speed: bytes of K and V read per call / time
    shapes = [("smollm2", 9, 3, 64, 512)] if ck.dry else [("smollm2", 9, 3, 64, 32768), ("smollm2", 9, 3, 64, 262144),
                                                            ("llama-3.1-8b", 32, 8, 128, 32768),
                                                            ("llama-3.1-8b", 32, 8, 128, 262144)]
    rows = []
    for name, hq, hkv, d, S in shapes:
        k, v = (torch.randn(S, hkv, d, device=ck.device, dtype=dtype) for _ in range(2))  # made where they are used
        ke, ve = (x.repeat_interleave(hq // hkv, 1).transpose(0, 1).unsqueeze(0) for x in (k, v))
        kv_bytes = 2 * k.numel() * k.element_size()
        for B in ((1, 4) if ck.dry else (1, 2, 4, 8, 16)):
            if ck.left() < 30:
                rows.append({"model": name, "S": S, "B": B, "skipped": "time budget"})
                continue
            q = torch.randn(B, hq, d, device=ck.device, dtype=dtype)
            qb = q.transpose(0, 1).unsqueeze(0)
            runs = {"triton-decode": lambda: triton_decode_attention(q, k, v),
                    "triton-block": lambda: triton_attention_block(q, k, v),
                    # what "auto" ran on CUDA without flash-attn before the decode kernel, KV
                    # heads expanded outside the timed region (a lower bound on its time)
                    "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qb, ke, ve)}
            if not ck.dry and flash_attn_available():
                from flash_attn import flash_attn_func

                runs["flash-attn"] = lambda: flash_attn_func(q[None], k[None], v[None])
            row = {"model": name, "S": S, "B": B, "kv_bytes": kv_bytes}
            for run_name, fn in runs.items():
                try:
                    sec = timed(ck, fn)
                    row[run_name] = {"us": round(sec * 1e6, 1), "gbs": round(kv_bytes / sec / 1e9, 1)}
                    if peak_bw:
                        row[run_name]["of_datasheet"] = round(kv_bytes / sec / 1e9 / peak_bw, 3)
                    if copy_bw:
                        row[run_name]["of_copy"] = round(kv_bytes / sec / 1e9 / copy_bw, 3)
                except Exception as e:  # noqa: BLE001
                    row[run_name] = {"error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print("  " + json.dumps(row), flush=True)
        del k, v, ke, ve
    target = next((r for r in rows if r.get("S") == 32768 and r.get("B") == 8 and r.get("model") == "llama-3.1-8b"
                   and "of_copy" in r.get("triton-decode", {})), None)
    if target:
        ck.results["targets"]["triton decode >= 0.6 x copy bandwidth (Llama-8B shapes, 32K keys, B = 8)"] = {
            "fraction": target["triton-decode"]["of_copy"], "met": target["triton-decode"]["of_copy"] >= 0.6}
    return {"checks": checks, "rows": rows}


def merge_section(ck: Check) -> dict:
    import torch

    from ringctx.attention import cuda_ext, merge_partials

    env = ck.results.get("env", {})
    peak_bw = env.get("datasheet_hbm_gbs")
    copy_bw = env.get("measured_copy_gbs")
    T, H, D = (256, 4, 64) if ck.dry else (65536, 32, 128)
    dtype = torch.float32 if ck.dry else torch.bfloat16
    rows = []
    for N in (2, 4, 8):
        parts = [(torch.randn(T, H, D, device=ck.device, dtype=dtype), torch.randn(H, T, device=ck.device))
                 for _ in range(N)]
        nbytes = (N + 1) * (T * H * D * parts[0][0].element_size() + H * T * 4)  # read N, write 1
        row = {"N": N, "T": T, "H": H, "D": D, "bytes": nbytes}
        if cuda_ext.try_merge_partials_cuda(parts) is not None:
            sec = timed(ck, lambda: cuda_ext.try_merge_partials_cuda(parts))
            row["kernel_gbs"] = round(nbytes / sec / 1e9, 1)
            if peak_bw:
                row["kernel_frac_datasheet"] = round(row["kernel_gbs"] / peak_bw, 3)
            if copy_bw:
                row["kernel_frac_copy"] = round(row["kernel_gbs"] / copy_bw, 3)
        with cuda_ext.csrc_disabled():
            sec = timed(ck, lambda: merge_partials(parts))
        row["torch_gbs"] = round(nbytes / sec / 1e9, 1)
        rows.append(row)
        print("  " + json.dumps(row), flush=True)
        del parts
    fracs = [r["kernel_frac_datasheet"] for r in rows if "kernel_frac_datasheet" in r]
    if fracs:
        ck.results["targets"]["merge kernel >= 70% of HBM bandwidth (datasheet)"] = {
            "fractions_by_N": fracs, "met": min(fracs) >= 0.7}
    return {"merge": rows, "scatter": _scatter_speed(ck), "merge_check": _check_merge(ck),
            "scatter_check": _check_scatter(ck)}


def _scatter_speed(ck: Check) -> dict:
    import torch

    from ringctx.attention import cuda_ext

    L, P, n = (3, 256, 128) if ck.dry else (30, 262144, 131072)  # SmolLM2: 30 layers, 3 KV heads x 64
    mk = lambda rows: [torch.empty(rows, 3, 64, device=ck.device, dtype=torch.bfloat16) for _ in range(L)]  # noqa: E731
    kc, vc, ks, vs = mk(P), mk(P), mk(n), mk(n)
    pos = torch.randperm(P, device=ck.device)[:n]
    nbytes = 2 * 2 * L * n * 3 * 64 * 2  # K and V, read + write
    res = {"layers": L, "rows": n, "bytes": nbytes}
    if cuda_ext.extension_available():
        res["kernel_gbs"] = round(nbytes / timed(ck, lambda: cuda_ext.scatter_kv(kc, vc, ks, vs, pos, check=False)) / 1e9, 1)
    res["torch_gbs"] = round(nbytes / timed(ck, lambda: cuda_ext.scatter_kv_torch(kc, vc, ks, vs, pos)) / 1e9, 1)
    print("  scatter " + json.dumps(res), flush=True)
    return res


# --- prefill ---------------------------------------------------------------------------------

class ChunkAttend:
    """attend(layer, q, k, v) for one sequence prefilled chunk by chunk on one device.

    The chunk's K/V go into preallocated [L, N, Hkv, D] buffers at its rows; its queries see the
    rows before it as a full block and themselves as a diagonal block, merged by (out, lse).
    """

    def __init__(self, cfg, total, dtype, device, backend):
        import torch

        shape = (cfg.n_layers, total, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.start, self.backend = 0, backend

    def __call__(self, layer, q, k, v):
        from ringctx.attention import attention_block, cuda_ext, merge_partials

        s, T = self.start, q.shape[0]
        self.k[layer, s:s + T] = k
        self.v[layer, s:s + T] = v
        diag = attention_block(q, k, v, causal=True, backend=self.backend)
        if s == 0:
            return diag[0]
        full = attention_block(q, self.k[layer, :s], self.v[layer, :s], causal=False, backend=self.backend)
        merged = cuda_ext.try_merge_partials_cuda([full, diag]) or merge_partials([full, diag])
        return merged[0]


def _model(ck: Check, dtype):
    from ringctx.model.presets import get_preset
    from ringctx.model.weights import empty_model, init_random

    model = empty_model(get_preset("smollm2-135m"), dtype=dtype, device=ck.device)
    init_random(model, 0)
    return model.eval()


def _prefill_once(model, n_tokens, chunk, backend, ck) -> dict:
    import torch

    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (n_tokens,), device=ck.device)
    attend = ChunkAttend(cfg, n_tokens, model.dtype, ck.device, backend)
    sync = (lambda: None) if ck.dry else torch.cuda.synchronize
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, n_tokens, chunk):
            e = min(n_tokens, s + chunk)
            attend.start = s
            logits = model(ids[s:e], torch.arange(s, e, device=ck.device), attend,
                           logits="last" if e == n_tokens else "none")
        first = int(logits.argmax())  # the first generated token (greedy)
    sync()
    sec = time.perf_counter() - t0
    del attend
    return {"tokens": n_tokens, "chunk": chunk, "seconds": round(sec, 3), "first_token": first}


def prefill_section(ck: Check) -> dict:
    import torch

    dtype = torch.float32 if ck.dry else torch.bfloat16
    backend = "torch" if ck.dry else ck.results.get("prefill_backend", "auto")
    model = _model(ck, dtype)
    cfg = model.config
    chunk = 128 if ck.dry else 65536
    lengths = [256, 512] if ck.dry else [131072, 1048576]
    env = ck.results.get("env", {})
    peak = env.get("datasheet_bf16_tflops", 0) * 1e12
    rate = _attention_rate(ck)  # FLOP/s of the kernel the prefill uses, measured above
    linear_params = cfg.n_layers * (cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
                                    + cfg.n_heads * cfg.head_dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim)
    res = {"backend": backend, "model": "smollm2-135m shapes, random weights", "dtype": str(dtype), "runs": []}
    _prefill_once(model, lengths[0] // 4, chunk // 4, backend, ck)  # warm-up: compiles, autotunes
    attn_flops_of = lambda n: cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim * n * (n + 1) / 2  # noqa: E731
    fits = lambda n: not rate or attn_flops_of(n) / rate * 1.25 + 10 <= ck.left()  # noqa: E731
    for n in lengths:
        if not fits(n):
            # Too little time left for this length: record the prediction, and measure the
            # largest power-of-two fraction that fits instead (a smaller point on the same curve).
            res["runs"].append({"tokens": n, "skipped": f"needs ~{attn_flops_of(n) / rate * 1.25:.0f} s, "
                                f"{ck.left():.0f} s left", "predicted_attention_s": round(attn_flops_of(n) / rate, 1)})
            n = next((n >> i for i in range(1, 4) if n >> i > lengths[0] and fits(n >> i)), None)
            if n is None:
                continue
        attn_flops = attn_flops_of(n)
        predicted = attn_flops / rate if rate else None
        torch.cuda.empty_cache() if not ck.dry else None
        run = _prefill_once(model, n, chunk, backend, ck)
        flops = attn_flops + 2 * linear_params * n
        run.update(tokens_per_s=round(n / run["seconds"], 1), time_to_first_token_s=run["seconds"],
                   attention_tflop=round(attn_flops / 1e12, 1), model_tflop=round(flops / 1e12, 1))
        if peak:
            run["mfu_datasheet"] = round(flops / run["seconds"] / peak, 3)
        if predicted:
            run["predicted_attention_s"] = round(predicted, 2)
            run["vs_prediction"] = round(run["seconds"] / predicted, 3)
        if not ck.dry:
            run["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        res["runs"].append(run)
        print("  " + json.dumps(run), flush=True)
    million = next((r for r in res["runs"] if r.get("tokens") == 1048576 and "vs_prediction" in r), None)
    if million:
        ck.results["targets"]["1M prefill <= 1.3 x attention FLOPs / kernel rate"] = {
            "ratio": million["vs_prediction"], "met": million["vs_prediction"] <= 1.3}
    return res


def _attention_rate(ck: Check) -> float | None:
    """The prefill backend's measured causal rate at head dim 64 (the longest S measured)."""
    rows = ck.results["sections"].get("attention", {}).get("rows", [])
    key = {"triton": "triton", "flash-attn": "flash-attn"}.get(ck.results.get("prefill_backend"), "sdpa-flash")
    best = [r[key]["tflops"] for r in rows if r.get("d") == 64 and "tflops" in r.get(key, {})]
    return best[-1] * 1e12 if best else None


def batch_section(ck: Check) -> dict:
    import torch

    from ringctx import Engine

    dtype = "float32" if ck.dry else "bfloat16"
    doc_tokens, n_questions, new_tokens = (300, 3, 6) if ck.dry else (8192, 8, 32)
    g = torch.Generator().manual_seed(0)
    document_ids = torch.randint(100, 20000, (doc_tokens,), generator=g).tolist()
    questions = [f"Question {i}: what does part {i} of the document say about the weather?" for i in range(n_questions)]
    with Engine(nproc=1, device=ck.device, dtype=dtype, allow_long_context=True) as engine:
        document = engine.ingest(document_ids)
        engine.ask(document, questions[0], max_new_tokens=2)  # warm-up (kernels built, caches touched)
        t0 = time.perf_counter()
        alone_tokens = []
        for q in questions:  # one after another: each read to its end before the next is asked
            answer = engine.generate(document, q, max_new_tokens=new_tokens, stop=[])
            "".join(answer)
            alone_tokens.append(list(answer.result.token_ids))
        alone_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        many = engine.ask_many(document, questions, max_new_tokens=new_tokens, stop=[])
        for _ in many:
            pass
        batch_s = time.perf_counter() - t0
        batch_tokens = [list(r.token_ids) for r in many.results]
    same = sum(a == b for a, b in zip(alone_tokens, batch_tokens))
    agree = sum(x == y for a, b in zip(alone_tokens, batch_tokens) for x, y in zip(a, b))
    total = sum(min(len(a), len(b)) for a, b in zip(alone_tokens, batch_tokens))
    tokens = sum(len(b) for b in batch_tokens)
    out = {"dtype": dtype, "document_tokens": doc_tokens, "questions": n_questions, "new_tokens": new_tokens,
           "answers_identical": f"{same}/{n_questions}", "tokens_agreeing": f"{agree}/{total}",
           "alone_s": round(alone_s, 3), "batch_s": round(batch_s, 3),
           "aggregate_vs_alone": round(alone_s / batch_s, 2) if batch_s > 0 else None}
    ck.results["targets"]["batch: 8 questions >= 5x one's tokens/s (prefill included here)"] = out["aggregate_vs_alone"]
    if dtype == "float32" and same != n_questions:
        ck.fail(f"batch: float32 answers differ from the questions asked alone ({same}/{n_questions} identical)")
    print(f"  batch: {tokens} tokens, {out['answers_identical']} answers identical, {out['aggregate_vs_alone']}x")
    return out


ALLREDUCE_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _allreduce_job(rank: int, world: int, dry: bool) -> dict:
    """On every rank: the TP all-reduce of ringctx/parallel/allreduce.py (symmetric memory on CUDA,
    built even for a one-rank group; shared memory in --dry-run) against the float64 sum and the
    group's all_reduce (NCCL; gloo dry), bf16."""
    import torch
    import torch.distributed as dist

    from ringctx.parallel.allreduce import ShmAllReduce, SymmMemAllReduce

    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    reducer = ShmAllReduce.create(None, 60) if dry else SymmMemAllReduce.create(None, device)
    if reducer is None:
        raise RuntimeError(f"the symmetric-memory all-reduce could not be built here: {SymmMemAllReduce.why_not}")
    out = {"world": world, "kind": type(reducer).__name__, "rows": []}
    sizes = ALLREDUCE_SIZES[:3] if dry else ALLREDUCE_SIZES

    def addend(r: int, n: int):
        return torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).bfloat16()

    def median_s(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            times.append(time_once(fn, dry))
        return statistics.median(times)

    for nbytes in sizes:
        n = nbytes // 2
        x = addend(rank, n).to(device)
        reference = sum(addend(r, n).double() for r in range(world))
        magnitude = sum(addend(r, n).double().abs() for r in range(world))
        row, results = {"bytes": nbytes}, {}
        for algorithm in ("one-shot", "two-shot", "group"):
            y = x.clone()
            reducer(y, algorithm) if algorithm != "group" else dist.all_reduce(y)
            results[algorithm] = y.cpu()
            everyone = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(everyone, y)
            err = (y.cpu().double() - reference).abs()
            row[algorithm] = {
                "same_bits_on_every_rank": all(torch.equal(e, everyone[0]) for e in everyone),
                "max_error_over_bound": float((err / (2.0 ** -8 * reference.abs() + world * 2.0 ** -8 * magnitude
                                                      + 1e-30)).max()),
                "us": 1e6 * median_s(lambda: reducer(y, algorithm) if algorithm != "group" else dist.all_reduce(y),
                                     5 if dry else 30)}
        row["one_shot_equals_two_shot"] = torch.equal(results["one-shot"], results["two-shot"])
        row["nccl/one-shot"] = row["group"]["us"] / row["one-shot"]["us"]
        row["nccl/two-shot"] = row["group"]["us"] / row["two-shot"]["us"]
        row["chosen"] = reducer.algorithm(nbytes)
        out["rows"].append(row)
    return out


def _expert_pairs(T: int, E: int, k: int, device, seed: int = 0):
    """T tokens' k distinct experts each (uniform, as a random router spreads them): the (token,
    expert) pairs sorted by expert (token order within one), as moe.py sorts them: (tokens [T k],
    counts [E] list)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    chosen = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :k]
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return (order // k).to(device), torch.bincount(flat, minlength=E).tolist()


def experts_section(ck: Check) -> dict:
    """Grouped experts at Qwen3-30B-A3B's expert shape (128 experts, top 8, dim 2048, width 768;
    bf16): torch._grouped_mm (one call for every expert's rows) against moe.py's loop (one GEMM
    pair per expert that got rows), T = 512 .. 16384 tokens, both against a float32 computation of
    the same products (relative error, bf16 rounding), TFLOP/s of the active experts' products
    (2 T k 3 dim F). The answer is the rule kernels/selection.py's `grouped_experts` would take on
    GPUs. --dry-run: 8 experts of 64 x 32 on the CPU."""
    import torch

    E, k, dim, F = (8, 2, 64, 32) if ck.dry else (128, 8, 2048, 768)
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * F, dim, generator=g) * dim ** -0.5).to(ck.device, dtype)
    w2 = (torch.randn(E, dim, F, generator=g) * F ** -0.5).to(ck.device, dtype)

    def loop(x, tokens, counts):
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                gate, up = torch.nn.functional.linear(x[tokens[start:start + n]], w13[e]).chunk(2, dim=-1)
                ys.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e]))
            start += n
        return torch.cat(ys)

    def grouped(x, tokens, offsets):
        gate, up = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm((torch.nn.functional.silu(gate) * up).contiguous(), w2.transpose(1, 2), offs=offsets)

    def exact(x, tokens, counts):  # float32 products of the same bf16 inputs
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                gate, up = (x[tokens[start:start + n]].float() @ w13[e].float().T).chunk(2, dim=-1)
                ys.append((torch.nn.functional.silu(gate) * up) @ w2[e].float().T)
            start += n
        return torch.cat(ys)

    rows = []
    for T in ((16, 64) if ck.dry else (512, 2048, 8192, 16384)):
        if ck.left() < 30:
            break
        x = torch.randn(T, dim, generator=g).to(ck.device, dtype)
        tokens, counts = _expert_pairs(T, E, k, ck.device)
        offsets = torch.tensor(counts, device=ck.device).cumsum(0).to(torch.int32)
        flops = 2 * T * k * 3 * dim * F
        truth = exact(x, tokens, counts)
        row = {"tokens": T, "experts": E, "top_k": k, "dim": dim, "width": F}
        for name, fn in (("loop", lambda: loop(x, tokens, counts)), ("grouped_mm", lambda: grouped(x, tokens, offsets))):
            try:
                err = ((fn().float() - truth).abs().max() / truth.abs().max()).item()
                sec = timed(ck, fn, min_reps=3, max_reps=20)
                row[name] = {"ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1), "rel_err": err}
                if err > 2e-2:
                    ck.fail(f"experts: {name} at {T} tokens is {err:.1e} from float32")
            except (RuntimeError, NotImplementedError) as e:  # grouped_mm's CUDA kernel: sm90+ and bf16
                row[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if "ms" in row["loop"] and "ms" in row.get("grouped_mm", {}):
            row["grouped_over_loop_time"] = round(row["grouped_mm"]["ms"] / row["loop"]["ms"], 3)
        rows.append(row)
        print("  " + json.dumps(row), flush=True)
    return {"rows": rows}


def allreduce_section(ck: Check) -> dict:
    """The TP all-reduce (ringctx/parallel/allreduce.py) on every GPU of this machine: PyTorch's
    symmetric-memory one-shot and two-shot against NCCL at 4 KiB - 16 MiB of bf16, medians of CUDA
    event times, each result against the float64 sum (same bits on every rank, error within bf16
    rounding). With one GPU the group has one rank: the times are then each call's fixed cost only.
    --dry-run: two CPU ranks, shared memory against gloo."""
    import torch

    from ringctx.parallel.launch import RankPool

    world = 2 if ck.dry else max(1, torch.cuda.device_count())
    with RankPool(world, backend="gloo" if ck.dry else "nccl", timeout=120) as pool:
        result = pool.run(_allreduce_job, ck.dry)[0]
    for row in result["rows"]:
        for algorithm in ("one-shot", "two-shot", "group"):
            r = row[algorithm]
            if not r["same_bits_on_every_rank"] or r["max_error_over_bound"] > 1:
                ck.fail(f"allreduce: {algorithm} at {row['bytes']} bytes: {r}")
        print(f"  {row['bytes'] >> 10:>6} KiB  one-shot {row['one-shot']['us']:8.1f} us  two-shot "
              f"{row['two-shot']['us']:8.1f} us  {'gloo' if ck.dry else 'NCCL'} {row['group']['us']:8.1f} us  "
              f"(chosen: {row['chosen']})", flush=True)
    return result


EP_TOKENS = [1, 64, 1024, 8192]
"""Tokens per rank of the ep section: a decode row, a batch, a CPU chunk's share, a GPU chunk's share."""


def _ep_job(rank: int, world: int, dry: bool) -> dict:
    """On every rank: expert parallelism's two-shot all-to-all (ringctx/model/expert_parallel.py
    run_experts: counts, rows to their experts' ranks, outputs back) with Qwen3-30B-A3B's shapes
    (dim 2048, top-8 of 8 x world experts, bf16; dry: dim 64, float32), every expert a row-wise map
    so the result is checked bit for bit against the same rows through their experts on this rank."""
    import torch
    import torch.distributed as dist

    from ringctx.model.expert_parallel import ExpertParallel, run_experts

    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    dim, k, dtype = (64, 8, torch.float32) if dry else (2048, 8, torch.bfloat16)
    n_experts = 8 * world
    ep = ExpertParallel(size=world, rank=rank, group=None)
    first, _ = ep.experts(n_experts)
    out = {"world": world, "dim": dim, "experts_per_token": k, "n_experts": n_experts, "rows": []}
    for tokens in (EP_TOKENS[:2] if dry else EP_TOKENS):
        g = torch.Generator().manual_seed(rank * 100 + tokens)
        chosen = torch.randint(n_experts, (tokens * k,), generator=g).sort().values
        counts = torch.bincount(chosen, minlength=n_experts).tolist()
        rows = torch.randn(tokens * k, dim, generator=g).to(device, dtype)
        want = rows * (chosen.to(device)[:, None] + 2).to(dtype)
        got = run_experts(rows, counts, lambda j, r: r * (first + j + 2), ep)

        def exchange():
            run_experts(rows, counts, lambda j, r: r, ep)

        for _ in range(3):
            exchange()
        times = []
        for _ in range(5 if dry else 20):
            dist.barrier()
            times.append(time_once(exchange, dry))
        seconds = statistics.median(times)
        moved = 2 * rows.numel() * rows.element_size()  # every row out and back (the ones kept local too)
        out["rows"].append({"tokens": tokens, "exact": bool(torch.equal(got, want)), "us": 1e6 * seconds,
                            "GB/s": moved / seconds / 1e9})
    return out


def ep_section(ck: Check) -> dict:
    """Expert parallelism's dispatch and combine (the two-shot all-to-all of
    ringctx/model/expert_parallel.py) on every GPU of this machine over NCCL: 1 - 8192 tokens a rank,
    Qwen3-30B-A3B's width and top-8, medians of CUDA event times and the bytes a rank moves per
    second; each result checked bit for bit. With one GPU the group has one rank: the times are the
    counts' all-to-all and the local copies only. --dry-run: two CPU ranks over gloo."""
    import torch

    from ringctx.parallel.launch import RankPool

    world = 2 if ck.dry else max(1, torch.cuda.device_count())
    with RankPool(world, backend="gloo" if ck.dry else "nccl", timeout=120) as pool:
        results = pool.run(_ep_job, ck.dry)
    for r, result in enumerate(results):
        for row in result["rows"]:
            if not row["exact"]:
                ck.fail(f"ep dispatch: rank {r}, {row['tokens']} tokens: rows came back wrong")
    for row in results[0]["rows"]:
        print(f"  {row['tokens']:>6} tokens/rank x top-{results[0]['experts_per_token']}  {row['us']:10.1f} us  "
              f"{row['GB/s']:7.2f} GB/s out and back  ({'exact' if row['exact'] else 'WRONG'})", flush=True)
    return results[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting work after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the script, not the GPU")
    ap.add_argument("--only", nargs="*", help="run only these sections")
    args = ap.parse_args()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernel is first built
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    ck = Check(args.out, args.budget_s, args.dry_run)
    sections = [("env", env_section), ("correctness", correctness_section), ("band", band_section),
                ("attention", attention_section), ("window", window_section), ("decode", decode_section), ("kv8", kv8_section), ("batch", batch_section), ("allreduce", allreduce_section), ("ep", ep_section), ("experts", experts_section), ("build", build_section), ("merge", merge_section), ("prefill", prefill_section)]
    if not args.dry_run and (not args.only or "build" in args.only or "merge" in args.only):
        start_build(ck)
    for name, fn in sections:
        if args.only and name not in args.only:
            continue
        if name == "prefill":  # the fastest backend that passed every correctness case
            rows = ck.results["sections"].get("correctness", {}).get("attention", [])
            good = {b for b in ("triton", "flash-attn") if any(r["backend"] == b for r in rows)
                    and all(r["ok"] for r in rows if r["backend"] == b)}
            ck.results["prefill_backend"] = "triton" if "triton" in good else ("flash-attn" if "flash-attn" in good else "torch")
        ck.section(name, fn)
    ck.write()
    print("== targets")
    for k, v in ck.results["targets"].items():
        print(f"  {k}: {v}")
    print(f"== {len(ck.results['failures'])} failure(s); results in {args.out / 'gpu_check.json'}")
    return 1 if ck.results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
