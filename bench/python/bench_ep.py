"""Expert parallelism of LUT-B experts (lutb.distributed) across the GPUs of one host.

Question: how long does one DeepSeek-V3-shaped routed-experts layer (E 256, H 7168, I 2048, top-8,
grouped sigmoid routing) take per batch size T with the experts spread over the ranks, in each
mode ("all_to_all", "allreduce"), what share of it is communication, and where is the crossover
that lutb.distributed.ALLREDUCE_MAX_TOKENS states. Second part: online quantisation across ranks of
a DeepSeek-V3-shaped checkpoint's routed experts (each rank reads and fits only its experts): load
time and peak memory per rank.

  torchrun --nproc-per-node=8 bench/python/bench_ep.py                  # GPUs, NCCL
  torchrun --nproc-per-node=8 bench/python/bench_ep.py --load-layers 2 --workdir /tmp/ep
  torchrun --nproc-per-node=2 bench/python/bench_ep.py --tiny            # CPU, gloo: checks the logic

Method: tokens, routing and weights are random (same seed on every rank: the router is
replicated); weights are random valid LUT-B bytes (the kernels' time does not depend on the
values). Per (T, mode): --warmup calls, then --iters calls, each between barriers, median reported.
Communication time comes from a second pass with every collective timed alone (synchronised before
and after): comm share = that time / the median of the first pass (capped at 1; a collective's time includes
waiting for the slowest rank).
Loading: rank 0 writes a synthetic checkpoint of --load-layers layers in the per-expert layout of
DeepSeek-V3 (model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight, one shard per layer, with
model.safetensors.index.json); every rank then runs lutb.distributed.load_model_experts on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import lutb
import lutb.distributed as ld

DEEPSEEK_V3 = {"experts": 256, "hidden": 7168, "inter": 2048, "k": 8, "n_group": 8, "topk_group": 4}
TINY = {"experts": 8, "hidden": 128, "inter": 64, "k": 2, "n_group": 4, "topk_group": 2}
DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
TINY_TOKENS = [1, 7, 64, 65, 200]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny layer on the CPU with gloo (checks the logic)")
    p.add_argument("--tokens", type=int, nargs="*", help="batch sizes T (default 1..4096, powers of 2)")
    p.add_argument("--modes", nargs="*", default=["all_to_all", "allreduce"], choices=["all_to_all", "allreduce"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--load-layers", type=int, default=0,
                   help="also measure online quantisation of this many synthetic layers (0: skip)")
    p.add_argument("--workdir", default="/tmp/lutb_bench_ep", help="where the synthetic checkpoint is written")
    p.add_argument("--experts-per-fit", type=int, default=0, help="load_local_experts experts_per_fit")
    p.add_argument("--json", help="write the results here (rank 0)")
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_lutb(experts: int, n: int, k: int, device: torch.device, g: torch.Generator) -> lutb.LutbWeight:
    """Random valid LUT-B bytes [experts, n, k]: any index bytes, non-NaN E4M3 codebooks, scales 120..127."""
    tn, tk = -(-n // 8), -(-k // 64)
    packed = torch.randint(0, 256, (experts, tn, tk, 192), dtype=torch.uint8, generator=g)
    cb = torch.randint(0, 256, (experts, tn, tk, 8), dtype=torch.uint8, generator=g)
    cb = torch.where((cb & 0x7F) == 0x7F, cb ^ 1, cb)  # 0x7F / 0xFF are E4M3 NaN
    scale = torch.randint(120, 128, (experts, tn, tk), dtype=torch.uint8, generator=g)
    return lutb.LutbWeight.from_tensors(packed.to(device), cb.to(device), scale.to(device), (experts, n, k))


class CollectiveTimer:
    """Wraps the torch.distributed collectives lutb.distributed calls; each call is synchronised
    before and after and its time added to `seconds`."""

    NAMES = ("all_to_all_single", "all_reduce", "all_gather")

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self.saved = {}

    def __enter__(self):
        for n in self.NAMES:
            f = getattr(dist, n)
            self.saved[n] = f

            def timed(*a, _f=f, **kw):
                sync(self.device)
                t0 = time.perf_counter()
                r = _f(*a, **kw)
                sync(self.device)
                self.seconds += time.perf_counter() - t0
                return r

            setattr(ld.dist, n, timed)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(ld.dist, n, f)


def time_layer(shape: dict, tokens: list[int], modes: list[str], shard: ld.ExpertShard, device: torch.device,
               warmup: int, iters: int) -> list[dict]:
    g = torch.Generator().manual_seed(1234 + shard.rank)
    w13 = random_lutb(shard.local_experts, 2 * shape["inter"], shape["hidden"], device, g)
    w2 = random_lutb(shard.local_experts, shape["hidden"], shape["inter"], device, g)
    rows = []
    for t in tokens:
        gt = torch.Generator().manual_seed(t)  # same tokens and routing on every rank
        x = torch.randn(t, shape["hidden"], generator=gt).bfloat16().to(device)
        logits = torch.randn(t, shape["experts"], generator=gt).to(device)
        bias = torch.zeros(shape["experts"], device=device)
        ids, wts = lutb.route_deepseek(logits, bias, shape["k"], shape["n_group"], shape["topk_group"])
        for mode in modes:
            def call():
                return ld.ep_moe_experts(x, ids, wts, w13, w2, shard, mode=mode)

            for _ in range(warmup):
                call()
            times = []
            for _ in range(iters):
                dist.barrier()
                sync(device)
                t0 = time.perf_counter()
                call()
                sync(device)
                times.append(time.perf_counter() - t0)
            with CollectiveTimer(device) as ct:
                for _ in range(iters):
                    dist.barrier()
                    call()
            med = statistics.median(times)
            comm = ct.seconds / iters
            rows.append({"tokens": t, "mode": mode, "us": med * 1e6, "comm_us": comm * 1e6,
                         "comm_share": min(1.0, comm / med) if med > 0 else 0.0})
    return rows


def write_synthetic_checkpoint(path: str, shape: dict, layers: int) -> None:
    """Per-expert BF16 keys of DeepSeek-V3's layout, one safetensors shard per layer, plus the index."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for layer in range(layers):
        g = torch.Generator().manual_seed(layer)
        tensors = {}
        pre = f"model.layers.{layer}.mlp.experts"
        for e in range(shape["experts"]):
            for name, (n, k) in (("gate_proj", (shape["inter"], shape["hidden"])),
                                 ("up_proj", (shape["inter"], shape["hidden"])),
                                 ("down_proj", (shape["hidden"], shape["inter"]))):
                tensors[f"{pre}.{e}.{name}.weight"] = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        fn = f"model-{layer:05d}.safetensors"
        save_file(tensors, os.path.join(path, fn))
        weight_map.update({k: fn for k in tensors})
        del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def measure_load(shape: dict, shard: ld.ExpertShard, device: torch.device, layers: int, workdir: str,
                 experts_per_fit: int) -> dict:
    ck = os.path.join(workdir, f"synthetic_E{shape['experts']}_H{shape['hidden']}_I{shape['inter']}_L{layers}")
    if shard.rank == 0 and not os.path.isfile(os.path.join(ck, "model.safetensors.index.json")):
        write_synthetic_checkpoint(ck, shape, layers)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    weights = ld.load_model_experts(ck, shard, device, layers=layers, experts_per_fit=experts_per_fit)
    sync(device)
    seconds = time.perf_counter() - t0
    held = sum(t.numel() for w13, w2 in weights.values() for v in (w13, w2)
               for t in (v.packed, v.codebook, v.scale))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"rank": shard.rank, "layers": layers, "seconds": seconds, "lutb_bytes": held, "peak_bytes": peak}


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    # Rank 0 may spend many minutes writing the synthetic checkpoint while the others wait in a barrier.
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    shape = TINY if args.tiny else DEEPSEEK_V3
    tokens = args.tokens or (TINY_TOKENS if args.tiny else DEFAULT_TOKENS)
    shard = ld.expert_shard(shape["experts"], rank, world)
    result = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu (gloo)",
              "shape": shape, "allreduce_max_tokens": ld.ALLREDUCE_MAX_TOKENS}
    result["layer"] = time_layer(shape, tokens, args.modes, shard, device, args.warmup, args.iters)
    if rank == 0:
        print(f"world {world}, {result['device']}, E {shape['experts']} H {shape['hidden']} I {shape['inter']} "
              f"top-{shape['k']}; rank 0's times")
        print(f"{'T':>6} {'mode':>11} {'us/layer':>10} {'comm us':>9} {'comm %':>7}")
        for r in result["layer"]:
            print(f"{r['tokens']:>6} {r['mode']:>11} {r['us']:>10.1f} {r['comm_us']:>9.1f} {100 * r['comm_share']:>6.1f}%")
        by_t = {}
        for r in result["layer"]:
            by_t.setdefault(r["tokens"], {})[r["mode"]] = r["us"]
        wins = {t: min(m, key=m.get) for t, m in by_t.items() if len(m) > 1}
        if wins:
            print("faster mode per T:", ", ".join(f"{t}: {m}" for t, m in wins.items()))
    if args.load_layers:
        load = measure_load(shape, shard, device, args.load_layers, args.workdir, args.experts_per_fit)
        loads = [None] * world
        dist.all_gather_object(loads, load)
        result["load"] = loads
        if rank == 0:
            print(f"online quantisation of {args.load_layers} layer(s), experts per rank {shard.local_experts}")
            for d in loads:
                peak = "n/a (CPU)" if d["peak_bytes"] is None else f"{d['peak_bytes'] / 2**20:.1f} MiB"
                print(f"  rank {d['rank']}: {d['seconds']:.2f} s, LUT-B held {d['lutb_bytes'] / 2**20:.1f} MiB, "
                      f"peak allocated {peak}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
