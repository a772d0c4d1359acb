"""Expert parallelism over torch.distributed: each rank holds E / world routed experts in LUT-B.

  expert_shard(experts, rank, world) -> ExpertShard     the contiguous expert range of a rank
  load_local_experts(checkpoint, prefix, shard, device)  read and fit only this rank's experts
  load_model_experts(checkpoint, shard, device, layers)  the same for every MoE layer
  ep_moe_experts(x, topk_ids, topk_weights, w13_local, w2_local, shard, group, mode)
                                                         the routed experts of one layer across ranks
  allreduce_local_experts(x, local_ids, weights, w13_local, w2_local, group)
                                                         the same on transformers' local ids + marker

The router stays replicated: every rank routes its tokens to global expert ids, and ep_moe_experts
brings each (token, slot) to the rank that holds the expert. Two modes (docs/design/expert-parallel.md):

  "all_to_all": counts exchanged, then one all_to_all_single of the token rows (one row per
     (token, slot) pair: BF16 row and the expert's id local to its owner); the owner runs lutb.moe_experts on what it
     received (top-1, weight 1, FP32 output, so it returns y exactly) and all_to_all_single sends the
     FP32 rows back; the home rank forms sum_j weight_j * y_j in slot order in FP32 and rounds to
     BF16 once. This is the order of the single-device kernels (spec 4 step 6; CPU and CUDA add
     fl(w * y) in slot order), so on the CPU the result is bit-identical to lutb.moe_experts on one
     device holding all experts (on CUDA, equal up to the GEMMs' FP32 accumulation order, which
     depends on the number of pairs per call).
  "allreduce": the tokens are replicated; each rank computes its experts' partial FP32 sums for
     every token (non-local slots get the marker id E_local and contribute nothing), all_reduce
     sums them in FP32 and the sum is rounded to BF16 once. Equal to the single-device result up
     to the order of the FP32 additions of step 6 (slots are summed per rank, then across ranks).
  "auto": "allreduce" for at most ALLREDUCE_MAX_TOKENS tokens, else "all_to_all".

Launch: torchrun --nproc-per-node=N script.py, with torch.distributed.init_process_group("nccl")
(GPUs; torch.cuda.set_device(local_rank) first) or "gloo" (CPU). Every rank of `group` must call
ep_moe_experts for every layer, in the same order (it runs collectives).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ._api import LutbWeight, moe_experts, quantize

# "auto" runs "allreduce" up to this many tokens (per call, replicated on every rank), else
# "all_to_all". Below it a layer's time is the latency of its collectives: one all_reduce of
# T x H FP32 against a count exchange, two dispatch and one combine all_to_all_single, a host read
# of the counts and an all_gather. Not measured (no multi-GPU machine yet): bench/python/bench_ep.py
# measures the crossover per batch size; docs/design/expert-parallel.md#the-rule.
ALLREDUCE_MAX_TOKENS = 64

MODES = ("auto", "all_to_all", "allreduce")


# ---------------------------------------------------------------------------------------------
# Which experts a rank holds
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertShard:
    """The contiguous block of global expert ids [start, stop) that rank `rank` of `world` holds.

    Rule (expert_shard): E experts over W ranks; the first E % W ranks hold E // W + 1 experts, the
    others E // W, in rank order. When W divides E this is transformers' expert-parallel split
    (rank r holds r * E / W .. (r + 1) * E / W - 1).
    """

    rank: int
    world: int
    experts: int
    start: int
    stop: int

    @property
    def local_experts(self) -> int:
        """Number of experts this rank holds (stop - start)."""
        return self.stop - self.start

    def bounds(self, rank: int) -> tuple[int, int]:
        """[start, stop) of `rank`'s experts under the same rule."""
        q, r = divmod(self.experts, self.world)
        start = rank * q + min(rank, r)
        return start, start + q + (1 if rank < r else 0)

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank holding each global expert id (int64, ids' shape and device); ids must be in 0..E-1."""
        q, r = divmod(self.experts, self.world)
        ids = ids.long()
        big = r * (q + 1)  # ids below `big` belong to the r ranks of q + 1 experts
        return torch.where(ids < big, ids // (q + 1), r + (ids - big) // max(q, 1))


def expert_shard(experts: int, rank: Optional[int] = None, world: Optional[int] = None,
                 group: Any = None) -> ExpertShard:
    """The experts of `rank` among `world` ranks (default: this process's rank and size in `group`,
    which needs torch.distributed initialised). See ExpertShard for the rule.
    Raises ValueError: experts < 1, world < 1, rank outside 0..world-1, or world > experts (a rank
    with no expert: use fewer ranks for expert parallelism)."""
    if rank is None or world is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("rank: not given and torch.distributed is not initialised")
        rank = dist.get_rank(group) if rank is None else rank
        world = dist.get_world_size(group) if world is None else world
    for v, n in ((experts, "experts"), (rank, "rank"), (world, "world")):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{n}: expected an int, got {type(v).__name__}")
    if experts < 1:
        raise ValueError(f"experts: {experts} < 1")
    if world < 1:
        raise ValueError(f"world: {world} < 1")
    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is not in 0..{world - 1}")
    if world > experts:
        raise ValueError(f"world: {world} ranks for {experts} experts would leave a rank without experts")
    shard = ExpertShard(rank, world, experts, 0, 0)
    start, stop = shard.bounds(rank)
    return ExpertShard(rank, world, experts, start, stop)


# ---------------------------------------------------------------------------------------------
# Loading: only this rank's experts, read lazily from safetensors
# ---------------------------------------------------------------------------------------------

# Per-expert projection names: (gate, up, down). Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3; Mixtral (spec 7).
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_STACKED_KEY = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


class _Checkpoint:
    """Tensor name -> safetensors file of a checkpoint directory (model.safetensors.index.json, or
    every *.safetensors file) or of one .safetensors file; files are opened lazily with safe_open,
    so a read touches only the bytes of the tensors asked for."""

    def __init__(self, path: Any):
        from safetensors import safe_open  # noqa: F401  (fail early when safetensors is missing)

        path = os.fspath(path)
        if os.path.isfile(path):
            files = [path]
        elif os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
                self._file_of = {k: os.path.join(path, v) for k, v in wm.items()}
                self._handles: dict[str, Any] = {}
                return
            files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise ValueError(f"checkpoint: no .safetensors file in {path}")
        else:
            raise ValueError(f"checkpoint: {path} is neither a file nor a directory")
        self._handles = {}
        self._file_of = {}
        for fn in files:
            for k in self._open(fn).keys():
                self._file_of[k] = fn

    def _open(self, fn: str) -> Any:
        from safetensors import safe_open

        if fn not in self._handles:
            self._handles[fn] = safe_open(fn, framework="pt", device="cpu")
        return self._handles[fn]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def has(self, key: str) -> bool:
        return key in self._file_of

    def get(self, key: str) -> torch.Tensor:
        return self._open(self._file_of[key]).get_tensor(key)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """key[start:stop] along dimension 0, reading only those rows."""
        return self._open(self._file_of[key]).get_slice(key)[start:stop]


def moe_prefixes(checkpoint: Any) -> list[str]:
    """The experts module prefixes of a checkpoint ("model.layers.L.mlp.experts", ...), in layer order.
    checkpoint: a directory (sharded or not) or a .safetensors file."""
    ck = checkpoint if isinstance(checkpoint, _Checkpoint) else _Checkpoint(checkpoint)
    found = set()
    for k in ck.keys():
        m = _EXPERT_KEY.match(k) or _STACKED_KEY.match(k)
        if m:
            found.add(m.group(1))

    def layer(p: str) -> tuple:
        m = re.search(r"\.(\d+)\.", p + ".")
        return (int(m.group(1)) if m else -1, p)

    return sorted(found, key=layer)


def _read_experts(ck: _Checkpoint, prefix: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 (as stored) w13 [n, 2I, H] (gate rows, then up) and w2 [n, H, I] of experts start..stop-1."""
    if ck.has(f"{prefix}.gate_up_proj") and ck.has(f"{prefix}.down_proj"):
        return ck.rows(f"{prefix}.gate_up_proj", start, stop), ck.rows(f"{prefix}.down_proj", start, stop)
    for gate, up, down in _PER_EXPERT_NAMES:
        if ck.has(f"{prefix}.{start}.{gate}.weight"):
            w13 = [torch.cat([ck.get(f"{prefix}.{e}.{gate}.weight"), ck.get(f"{prefix}.{e}.{up}.weight")], 0)
                   for e in range(start, stop)]
            w2 = [ck.get(f"{prefix}.{e}.{down}.weight") for e in range(start, stop)]
            return torch.stack(w13), torch.stack(w2)
    raise ValueError(f"prefix: no experts {start}..{stop - 1} under '{prefix}' "
                     f"(expected {prefix}.E.gate_proj.weight, .E.w1.weight or {prefix}.gate_up_proj)")


def _stack_weights(parts: list[LutbWeight]) -> LutbWeight:
    """Concatenates expert stacks [n_i, N, K] along the expert axis (the spec 2.2 layout is per expert)."""
    if len(parts) == 1:
        return parts[0]
    n = sum(p.shape[0] for p in parts)
    return LutbWeight(torch.cat([p.packed for p in parts]), torch.cat([p.codebook for p in parts]),
                      torch.cat([p.scale for p in parts]), (n,) + parts[0].shape[1:])


def load_local_experts(checkpoint: Any, prefix: str, shard: ExpertShard, device: Any = "cpu",
                       fitter: Optional[str] = None, experts_per_fit: int = 0) -> tuple[LutbWeight, LutbWeight]:
    """Online quantisation of this rank's experts of one layer: reads experts shard.start..stop-1 of
    `prefix` and fits them with lutb.quantize on `device`. Other ranks' experts are never read.

    checkpoint: a Hugging Face checkpoint directory (model.safetensors or shards with
       model.safetensors.index.json) or one .safetensors file.
    prefix: the experts module, e.g. "model.layers.3.mlp.experts" (moe_prefixes lists them).
       Per-expert keys PREFIX.e.{gate_proj,up_proj,down_proj}.weight (Mixtral: w1, w3, w2) or stacked
       PREFIX.gate_up_proj [E, 2I, H] and PREFIX.down_proj [E, H, I] (only this rank's rows are read).
    device: where the fit runs and the weights live ("cpu", "cuda:N").
    experts_per_fit: fit this many experts at a time (0 = all local experts at once): the BF16 held at
       once is experts_per_fit * 3 * I * H * 2 bytes on `device`.
    Returns (w13 [E_local, 2I, H], w2 [E_local, H, I]) as LutbWeight on `device`.
    Raises ValueError when the keys are missing or experts_per_fit < 0; lutb.quantize's errors.
    """
    if not isinstance(shard, ExpertShard):
        raise TypeError(f"shard: expected an ExpertShard, got {type(shard).__name__}")
    if experts_per_fit < 0:
        raise ValueError(f"experts_per_fit: {experts_per_fit} < 0")
    ck = checkpoint if isinstance(checkpoint, _Checkpoint) else _Checkpoint(checkpoint)
    step = experts_per_fit or shard.local_experts
    w13s, w2s = [], []
    for e0 in range(shard.start, shard.stop, step):
        e1 = min(shard.stop, e0 + step)
        b13, b2 = _read_experts(ck, prefix, e0, e1)
        b13 = b13.to(device).contiguous()
        w13s.append(quantize(b13, fitter, name=f"{prefix}.gate_up_proj"))
        del b13
        b2 = b2.to(device).contiguous()
        w2s.append(quantize(b2, fitter, name=f"{prefix}.down_proj"))
        del b2
    return _stack_weights(w13s), _stack_weights(w2s)


def load_model_experts(checkpoint: Any, shard: ExpertShard, device: Any = "cpu", layers: Optional[int] = None,
                       fitter: Optional[str] = None, experts_per_fit: int = 0
                       ) -> dict[str, tuple[LutbWeight, LutbWeight]]:
    """load_local_experts for every MoE layer of the checkpoint (the first `layers` of them when
    given): {prefix: (w13, w2)} in layer order."""
    ck = _Checkpoint(checkpoint)
    prefixes = moe_prefixes(ck)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers: {layers} < 1")
        prefixes = prefixes[:layers]
    return {p: load_local_experts(ck, p, shard, device, fitter, experts_per_fit) for p in prefixes}


# ---------------------------------------------------------------------------------------------
# The experts of one layer across ranks
# ---------------------------------------------------------------------------------------------


def choose_mode(tokens: int) -> str:
    """The rule of mode="auto": "allreduce" for tokens <= ALLREDUCE_MAX_TOKENS, else "all_to_all"."""
    return "allreduce" if tokens <= ALLREDUCE_MAX_TOKENS else "all_to_all"


def _check(x, topk_ids, topk_weights, w13_local, w2_local, shard, mode, replicated):
    if not isinstance(shard, ExpertShard):
        raise TypeError(f"shard: expected an ExpertShard, got {type(shard).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode: '{mode}' is not one of {', '.join(MODES)}")
    if not replicated and mode == "allreduce":
        raise ValueError("mode: 'allreduce' needs the same tokens on every rank (replicated=True)")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
        raise TypeError("x: expected a bfloat16 torch.Tensor [T, H]")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("topk_ids: expected an int32 or int64 torch.Tensor [T, k]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)} is not [T={x.shape[0]}, k]")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected a torch.Tensor of shape {tuple(topk_ids.shape)}")
    for v, n in ((w13_local, "w13_local"), (w2_local, "w2_local")):
        if not isinstance(v, LutbWeight) or len(v.shape) != 3:
            raise TypeError(f"{n}: expected a 3-D LutbWeight [E_local, N, K]")
        if v.shape[0] != shard.local_experts:
            raise ValueError(f"{n}: holds {v.shape[0]} experts, shard {shard.rank} of {shard.world} holds "
                             f"{shard.local_experts} (experts {shard.start}..{shard.stop - 1})")
    for a, n in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights"), (w13_local.scale, "w13_local"),
                 (w2_local.scale, "w2_local")):
        if not isinstance(a, torch.Tensor) or a.device != x.device:
            raise ValueError(f"{n}: not a torch tensor on x's device {x.device}")
    if x.device.type == "cpu" and topk_ids.numel() and int(topk_ids.min()) < 0:
        raise ValueError("topk_ids: holds a negative expert id")


def _check_group(shard: ExpertShard, group: Any) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (shard.rank, shard.world) != (rank, world):
        raise ValueError(f"shard: made for rank {shard.rank} of {shard.world}, but this process is rank {rank} "
                         f"of {world} in the group")


def ep_moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13_local: LutbWeight,
                   w2_local: LutbWeight, shard: ExpertShard, group: Any = None, mode: str = "auto",
                   act_format: str = "mxfp8", replicated: bool = True) -> torch.Tensor:
    """The routed experts of one MoE layer (spec 4 steps 2-6) with the experts spread over ranks.

    x: bfloat16 [T, H]; topk_ids: int32/int64 [T, k] GLOBAL expert ids (0..E-1; an id >= E, e.g.
       transformers' marker, contributes nothing; a negative id raises ValueError on the CPU and
       contributes nothing on CUDA, where it is not checked); topk_weights: float [T, k] (widened to
       float32 exactly). One device: CPU (gloo) or this rank's GPU (NCCL).
    w13_local [E_local, 2I, H], w2_local [E_local, H, I]: this rank's experts shard.start..stop-1
       (load_local_experts). shard: expert_shard(E, rank, world) of this rank in `group`.
    group: the torch.distributed process group of the expert-parallel ranks (None = the default).
    mode: "all_to_all", "allreduce" or "auto" (choose_mode(T); T is the same on every rank when
       replicated, so every rank picks the same mode).
    replicated: True when every rank passes the same x, topk_ids, topk_weights (the router runs
       replicated on replicated hidden states; transformers' expert-parallel mode); the output is then
       the same on every rank. False when each rank passes its own tokens (data-parallel attention;
       T may differ per rank); only "all_to_all" applies then ("auto" picks it).
    act_format: as lutb.moe_experts.
    Returns bfloat16 [T, H]: bf16(sum_j topk_weights[:, j] * y_j) with the sum in FP32 and one
       rounding. "all_to_all" adds in slot order like the single-device kernels: on the CPU
       bit-identical to lutb.moe_experts with all E experts on one device; on CUDA the kernels' GEMM
       accumulation order depends on how many pairs a call has, so equal up to FP32 summation order.
       "allreduce" sums per rank, then across ranks (equal up to the order of those FP32 additions).
    Every rank of `group` must call it with the same mode, replicated, act_format and k (collectives).
    "all_to_all" reads the pair counts on the host (one synchronisation; not CUDA-graph capturable);
    "allreduce" has no host synchronisation.
    Raises TypeError / ValueError naming the argument.
    """
    _check(x, topk_ids, topk_weights, w13_local, w2_local, shard, mode, replicated)
    _check_group(shard, group)
    if mode == "auto":
        mode = choose_mode(int(x.shape[0])) if replicated else "all_to_all"
    topk_weights = topk_weights.float()
    if mode == "allreduce":
        return _allreduce(x, topk_ids, topk_weights, w13_local, w2_local, shard, group, act_format)
    if not replicated:
        return _all_to_all(x, topk_ids, topk_weights, w13_local, w2_local, shard, group, act_format)
    # Replicated tokens: each rank dispatches its slice of ceil(T / world) tokens, and the BF16 outputs
    # of the slices are gathered (exact: a copy).
    t, h = x.shape
    per = -(-t // shard.world)
    lo, hi = min(t, shard.rank * per), min(t, (shard.rank + 1) * per)
    mine = _all_to_all(x[lo:hi].contiguous(), topk_ids[lo:hi].contiguous(), topk_weights[lo:hi].contiguous(),
                       w13_local, w2_local, shard, group, act_format)
    padded = torch.zeros(per, h, dtype=torch.bfloat16, device=x.device)
    padded[: hi - lo] = mine
    gathered = [torch.empty_like(padded) for _ in range(shard.world)]
    # BF16 travels as bytes (gloo has no BF16 collectives).
    dist.all_gather([g.view(torch.uint8) for g in gathered], padded.view(torch.uint8), group=group)
    return torch.cat(gathered)[:t]


def _allreduce(x, topk_ids, topk_weights, w13, w2, shard, group, act_format):
    """Replicated tokens with global ids: remapped to this rank's local ids, then allreduce_local_experts."""
    ids = topk_ids.long()
    local = (ids >= shard.start) & (ids < shard.stop)
    # Non-local slots: the marker id E_local (lutb.moe_experts skips ids >= its E) and weight 0.
    lid = torch.where(local, ids - shard.start, torch.full_like(ids, shard.local_experts))
    wts = torch.where(local, topk_weights, torch.zeros_like(topk_weights))
    return allreduce_local_experts(x, lid, wts, w13, w2, group, act_format)


def allreduce_local_experts(x: torch.Tensor, local_topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            w13_local: LutbWeight, w2_local: LutbWeight, group: Any = None,
                            act_format: str = "mxfp8") -> torch.Tensor:
    """The "allreduce" mode on ids already local to this rank: what an experts forward under
    transformers' expert-parallel mode calls. There EpRouterParallel has remapped each rank's slots
    to local ids (0..E_local-1), non-local slots to the marker E_local with weight 0, and the hidden
    states are replicated.

    x: bfloat16 [T, H], the same on every rank; local_topk_ids: int32/int64 [T, k] (ids >= E_local
    contribute nothing); topk_weights: float [T, k]; w13_local, w2_local: this rank's experts.
    Returns bfloat16 [T, H], the same on every rank: bf16(all_reduce_sum(p_rank)) where p_rank is
    lutb.moe_experts' FP32 sum over this rank's slots (out=float32). One BF16 rounding, after the
    FP32 all_reduce; no host synchronisation. The caller must not all-reduce the result again
    (transformers' MoeExpertsParallel all-reduces an experts module's output only when the module
    has DTensor-sharded parameters).
    """
    partial = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    moe_experts(x, local_topk_ids, topk_weights, w13_local, w2_local, act_format=act_format, out=partial)
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial.to(torch.bfloat16)


def _exchange(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single of rows [n, ...] with the given split sizes (rows travel as bytes, which every
    backend supports; gloo has no BF16 or int16 collectives)."""
    recv = send.new_empty((sum(recv_splits),) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv.view(torch.uint8), send.view(torch.uint8), recv_splits, send_splits, group=group)
    return recv


def _all_to_all(x, topk_ids, topk_weights, w13, w2, shard, group, act_format):
    """This rank's tokens: one row per (token, slot) pair to the expert's owner and its FP32 y back."""
    t, h = x.shape
    k = topk_ids.shape[1]
    world = shard.world
    ids = topk_ids.long().reshape(-1)
    valid = (ids >= 0) & (ids < shard.experts)
    pair = torch.nonzero(valid).reshape(-1)  # pair index t * k + j, ascending
    owner = shard.owner(ids[pair])
    order = torch.argsort(owner, stable=True)
    pair = pair[order]
    owner = owner[order]
    send_counts = torch.bincount(owner, minlength=world).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.tolist()
    recv_splits = recv_counts.tolist()

    # Dispatch: the token row and the expert's id local to its owner.
    starts = torch.tensor([shard.bounds(r)[0] for r in range(world)], dtype=torch.int64, device=x.device)
    # One message per pair: the BF16 row's 2H bytes, then the int32 local id's 4 bytes.
    send_ids = (ids[pair] - starts[owner]).to(torch.int32).reshape(-1, 1)
    send = torch.cat([x[pair // k].view(torch.uint8), send_ids.view(torch.uint8)], 1)
    recv = _exchange(send, send_splits, recv_splits, group)
    recv_x = recv[:, : 2 * h].contiguous().view(torch.bfloat16)
    recv_ids = recv[:, 2 * h :].contiguous().view(torch.int32)

    # Each received pair alone (top-1, weight 1): the FP32 output is y exactly (0 + 1 * y).
    y = torch.empty(recv_x.shape, dtype=torch.float32, device=x.device)
    if y.shape[0]:
        ones = torch.ones(y.shape[0], 1, dtype=torch.float32, device=x.device)
        moe_experts(recv_x, recv_ids.reshape(-1, 1), ones, w13, w2, act_format=act_format, out=y)

    # Combine: y back to the home rank, then spec 4 step 6 in slot order, as the single-device kernels
    # (acc = 0; acc += fl(w_j * y_j) for j = 0..k-1; one BF16 rounding).
    back = _exchange(y, recv_splits, send_splits, group)
    ys = torch.zeros(t * k, h, dtype=torch.float32, device=x.device)
    ys[pair] = back
    ys = ys.view(t, k, h)
    acc = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    valid = valid.view(t, k)
    for j in range(k):
        term = ys[:, j] * topk_weights[:, j : j + 1]
        acc = acc + torch.where(valid[:, j : j + 1], term, torch.zeros_like(term))
    return acc.to(torch.bfloat16)
