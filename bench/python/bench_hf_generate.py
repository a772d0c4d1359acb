"""transformers end to end on one GPU: LUT-B routed experts (lutb.hf) against BF16 grouped_mm.

    python bench/python/bench_hf_generate.py            # Qwen3-30B-A3B shape, 48 layers (H100/H200)
    python bench/python/bench_hf_generate.py --small    # 2 layers, a 16-expert DeepSeek layer: a quick check

What it measures, in one run on one GPU:
1. a Qwen3-30B-A3B-shaped model (its real config below) with random BF16 weights (normal, std
   0.02; routing of random weights is close to uniform, which is the costly case for decode),
   written once as a safetensors checkpoint to --shm-dir (/dev/shm: the machine's disk is too
   small for 61 GB; when /dev/shm cannot hold every layer, fewer layers are used and the output
   says so);
2. LUT-B: wall time of from_pretrained(..., quantization_config=LutbConfig(), device_map="cuda")
   (reading, fitting on the GPU with binned-dp, packing), peak GPU memory during it, and greedy
   decode tokens/s with generate() at batch 1 and 16 (static cache, which transformers compiles with
   torch.compile; --no-compile for eager);
3. the same checkpoint in BF16 with experts_implementation="grouped_mm" (transformers' fastest
   portable experts kernel), the same measurements;
4. one DeepSeek-V3-shaped MoE layer (256 experts, H 7168, I 2048) fitted online on the GPU by
   lutb.quantize: weights/s and peak GPU memory.

Decode tokens/s = batch * new tokens / (time of generate(prompt, N + 1 new) - time of
generate(prompt, 1 new)), the median of --reps runs after a warm-up run (which pays the compile).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import time

import torch

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
DEEPSEEK_V3_LAYER = {"experts": 256, "hidden": 7168, "inter": 2048}


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def layer_tensor_shapes(cfg: dict) -> tuple[dict, dict]:
    """(per-layer shapes with '{L}' in the names, model-level shapes) in transformers' names:
    routed experts stored fused as gate_up_proj [E, 2I, H] and down_proj [E, H, I], which
    from_pretrained reads as they are."""
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    hd, nh, kv, V = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    p = "model.layers.{L}."
    layer = {
        p + "input_layernorm.weight": (H,),
        p + "post_attention_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (nh * hd, H),
        p + "self_attn.k_proj.weight": (kv * hd, H),
        p + "self_attn.v_proj.weight": (kv * hd, H),
        p + "self_attn.o_proj.weight": (H, nh * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate.weight": (E, H),
        p + "mlp.experts.gate_up_proj": (E, 2 * I, H),
        p + "mlp.experts.down_proj": (E, H, I),
    }
    model = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    return layer, model


def write_checkpoint(out: str, cfg: dict, layers: int, seed: int = 0) -> int:
    """Random BF16 checkpoint, one safetensors shard per layer; returns its bytes."""
    from safetensors.torch import save_file

    cfg = dict(cfg, num_hidden_layers=layers, max_window_layers=layers)
    layer, model = layer_tensor_shapes(cfg)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    g = torch.Generator(device="cuda").manual_seed(seed)
    weight_map, total = {}, 0

    def make(shape, name):
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.normal_(0.0, 0.02, generator=g)
        return t.cpu()

    shards = [("model", {k: v for k, v in model.items()})]
    shards += [(f"layer{L:03d}", {k.format(L=L): v for k, v in layer.items()}) for L in range(layers)]
    for i, (stem, shapes) in enumerate(shards):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: make(s, k) for k, s in shapes.items()}
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = fname
            total += t.numel() * 2
        del tensors
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return total


def layers_that_fit(cfg: dict, shm_dir: str, want: int) -> int:
    layer, model = layer_tensor_shapes(cfg)
    per_layer = sum(2 * math.prod(s) for s in layer.values())
    fixed = sum(2 * math.prod(s) for s in model.values())
    parent = shm_dir if os.path.isdir(shm_dir) else os.path.dirname(shm_dir.rstrip("/")) or "/"
    free = shutil.disk_usage(parent).free
    if os.path.isdir(shm_dir):
        free += sum(os.path.getsize(os.path.join(shm_dir, f)) for f in os.listdir(shm_dir))
    # Keep 4 GiB of /dev/shm free: it is RAM, and the loader and the BF16 copy on the host need room.
    usable = free - fixed - 4 * 2**30
    return max(1, min(want, usable // per_layer))


def sync():
    torch.cuda.synchronize()


def time_generate(model, batch: int, new_tokens: int, prompt_len: int, reps: int, vocab: int) -> float:
    """Decode tokens/s of greedy generate at this batch (see the module docstring)."""
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(model.device)
    mask = torch.ones_like(ids)

    def run(n):
        sync()
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
        sync()
        return time.perf_counter() - t

    run(new_tokens + 1)  # warm-up: compiles the forward for this batch
    run(1)
    full = statistics.median(run(new_tokens + 1) for _ in range(reps))
    first = statistics.median(run(1) for _ in range(reps))
    return batch * new_tokens / max(full - first, 1e-9)


def bench_model(name: str, ckpt: str, args, **kwargs) -> dict:
    from transformers import AutoModelForCausalLM

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda", **kwargs)
    sync()
    load_s = time.perf_counter() - t
    load_peak = torch.cuda.max_memory_allocated()
    resident = torch.cuda.memory_allocated()
    model.eval()
    if args.no_compile:
        model.generation_config.disable_compile = True
    row = {"name": name, "load_s": load_s, "load_peak": load_peak, "resident": resident}
    vocab = model.config.vocab_size
    row["mode"] = "eager" if args.no_compile else "compiled"
    for b in args.batches:
        # Each batch size compiles again (about a minute or more at 48 layers); past the deadline the
        # remaining cells decode eagerly, so the whole run stays within the machine's 10-minute limit.
        if not args.no_compile and time.perf_counter() - args.t0 > args.compile_deadline_s:
            model.generation_config.disable_compile = True
            row["mode"] = f"compiled until {args.compile_deadline_s:.0f} s into the run, then eager"
        try:
            row[f"tps{b}"] = time_generate(model, b, args.new_tokens, args.prompt_len, args.reps, vocab)
        except Exception as e:  # reported; a compile failure falls back to eager decoding for this model
            print(f"{name}: batch {b}: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr, flush=True)
            row[f"tps{b}"] = float("nan")
            if not model.generation_config.disable_compile:
                model.generation_config.disable_compile = True
                row["mode"] = "eager (compile failed)"
                try:
                    row[f"tps{b}"] = time_generate(model, b, args.new_tokens, args.prompt_len, args.reps, vocab)
                except Exception as e2:
                    print(f"{name}: batch {b}, eager: {type(e2).__name__}: {str(e2)[:500]}", file=sys.stderr)
    row["run_peak"] = torch.cuda.max_memory_allocated()
    del model
    torch._dynamo.reset()  # compiled graphs hold the model's tensors
    gc.collect()
    torch.cuda.empty_cache()
    return row


def bench_deepseek_layer(experts: int) -> dict:
    import lutb

    E, H, I = experts, DEEPSEEK_V3_LAYER["hidden"], DEEPSEEK_V3_LAYER["inter"]
    rows = {}
    for proj, shape in (("w13", (E, 2 * I, H)), ("w2", (E, H, I))):
        gc.collect()
        torch.cuda.empty_cache()
        w = torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02)
        lutb.quantize(w[:1])  # warm-up: loads the fitter
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        q = lutb.quantize(w)
        sync()
        dt = time.perf_counter() - t
        rows[proj] = {"shape": shape, "s": dt, "wps": w.numel() / dt,
                      "peak_over_input": torch.cuda.max_memory_allocated() - base, "input": w.numel() * 2}
        del q, w
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="2 layers and a 16-expert DeepSeek layer (about a minute)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 48, --small 2)")
    p.add_argument("--shm-dir", default="/dev/shm/lutb_bench_qwen3_30b")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint in --shm-dir afterwards")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--no-compile", action="store_true", help="eager decode (no torch.compile of the static-cache forward)")
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--compile-deadline-s", type=float, default=330.0,
                   help="no new torch.compile after this many seconds of the run (default 330)")
    args = p.parse_args(argv)
    args.t0 = time.perf_counter()
    if not torch.cuda.is_available():
        print("bench_hf_generate: needs a CUDA GPU", file=sys.stderr)
        return 1
    try:
        import accelerate  # noqa: F401  (from_pretrained's device_map needs it)
    except ImportError:
        print("bench_hf_generate: needs accelerate (pip install accelerate) for device_map", file=sys.stderr)
        return 1
    import lutb
    import lutb.hf

    want = args.layers or (2 if args.small else QWEN3_30B_A3B["num_hidden_layers"])
    if args.small:
        args.reps = min(args.reps, 2)
        args.new_tokens = min(args.new_tokens, 16)
    t0 = args.t0
    layers = layers_that_fit(QWEN3_30B_A3B, args.shm_dir, want)
    note = "" if layers == want else f" (/dev/shm holds {layers} of the {want} layers)"
    print(f"writing a random BF16 Qwen3-30B-A3B-shaped checkpoint, {layers} layers{note}, to {args.shm_dir}", flush=True)
    nbytes = write_checkpoint(args.shm_dir, QWEN3_30B_A3B, layers)
    print(f"  {gib(nbytes)} in {time.perf_counter() - t0:.0f} s", flush=True)

    rows = []
    try:
        rows.append(bench_model("LUT-B (lutb, MXFP8 act.)", args.shm_dir, args,
                                quantization_config=lutb.hf.LutbConfig(fitter="binned-dp")))
        print(f"  LUT-B done at {time.perf_counter() - t0:.0f} s", flush=True)
        if not args.skip_bf16:
            rows.append(bench_model("BF16 (grouped_mm)", args.shm_dir, args, experts_implementation="grouped_mm"))
            print(f"  BF16 done at {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.shm_dir, ignore_errors=True)
    ds = bench_deepseek_layer(16 if args.small else DEEPSEEK_V3_LAYER["experts"])

    dev = torch.cuda.get_device_name()
    print(f"\n### Qwen3-30B-A3B shape, {layers} layers{note}, random weights; {dev}, torch {torch.__version__}, "
          f"decode {args.new_tokens} tokens after a {args.prompt_len}-token prompt, "
          f"{'eager' if args.no_compile else 'static cache + torch.compile'}\n")
    bcols = " | ".join(f"decode tok/s B={b}" for b in args.batches)
    print(f"| experts | load + quantise s | peak GPU mem at load | resident after load | {bcols} | peak GPU mem | decode |")
    print("|---|---:|---:|---:|" + "---:|" * len(args.batches) + "---:|---|")
    for r in rows:
        tps = " | ".join(f"{r[f'tps{b}']:.1f}" for b in args.batches)
        print(f"| {r['name']} | {r['load_s']:.1f} | {gib(r['load_peak'])} | {gib(r['resident'])} | {tps} | "
              f"{gib(r['run_peak'])} | {r['mode']} |")
    if len(rows) == 2:
        ratio = " | ".join(f"{rows[0][f'tps{b}'] / rows[1][f'tps{b}']:.2f}x" for b in args.batches)
        print(f"| LUT-B / BF16 | | | | {ratio} | | |")
    E = 16 if args.small else DEEPSEEK_V3_LAYER["experts"]
    print(f"\n### One DeepSeek-V3-shaped MoE layer ({E} experts, H {DEEPSEEK_V3_LAYER['hidden']}, "
          f"I {DEEPSEEK_V3_LAYER['inter']}) fitted online on the GPU (binned-dp)\n")
    print("| tensor | shape | s | G weights/s | BF16 input | peak GPU mem above the input |")
    print("|---|---|---:|---:|---:|---:|")
    for k, r in ds.items():
        print(f"| {k} | {list(r['shape'])} | {r['s']:.2f} | {r['wps'] / 1e9:.2f} | {gib(r['input'])} | "
              f"{gib(r['peak_over_input'])} |")
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
