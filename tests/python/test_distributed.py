"""lutb.distributed at world 2 on gloo (CPU), against lutb.moe_experts holding all experts on one device.

The two ranks run once per module (torch.multiprocessing.spawn) over every case and save their
outputs; each test compares one case. Expected equalities (docs/design/expert-parallel.md):
  all_to_all: bit-identical to the single-device result (same per-pair expert outputs y, same
     slot-order FP32 sum fl(fl(w_0 y_0) + fl(w_1 y_1)) + ..., one BF16 rounding);
  allreduce: bit-identical to bf16(p_0 + p_1), where p_r is the single-device FP32 sum (out=float32)
     over rank r's experts only: the single-device result up to the order of the FP32 additions.
"""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import lutb  # noqa: E402
import lutb.distributed as ld  # noqa: E402

from conftest import shared_dir  # noqa: E402

WORLD = 2
SHARED_MODEL = "tiny-qwen3-moe"
SHARED_LAYER = 1
SHARED_TOKENS = 96


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _random_layer(seed: int, experts: int, hidden: int, inter: int, tokens: int, k: int, used: int,
                  marker_every: int) -> dict:
    """A random layer whose tokens route to the first `used` experts only (the others are empty), with
    transformers' marker id (E) in every marker_every-th slot (0: none)."""
    g = torch.Generator().manual_seed(seed)
    w13 = lutb.quantize((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.05).bfloat16())
    w2 = lutb.quantize((torch.randn(experts, hidden, inter, generator=g) * 0.05).bfloat16())
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(tokens)]).to(torch.int64)
    if marker_every:
        ids.view(-1)[::marker_every] = experts
    wts = torch.rand(tokens, k, generator=g)
    return {"w13": w13, "w2": w2, "x": x, "ids": ids, "wts": wts}


def _shared_layer() -> dict | None:
    """Layer SHARED_LAYER of the shared model: its checkpoint and SHARED_TOKENS MoE block inputs routed
    by the model's router (softmax top-k, renormalised)."""
    d = shared_dir()
    if d is None or not (d / "models" / SHARED_MODEL).is_dir():
        return None
    import json

    from safetensors import safe_open

    m = d / "models" / SHARED_MODEL
    cfg = json.loads((m / "config.json").read_text())
    with safe_open(str(m / "moe_activations.safetensors"), "pt") as f:
        x = f.get_tensor(f"layers.{SHARED_LAYER}.moe_input")[:SHARED_TOKENS].bfloat16().contiguous()
    with safe_open(str(m / "model.safetensors"), "pt") as f:
        gate = f.get_tensor(f"model.layers.{SHARED_LAYER}.mlp.gate.weight")
    logits = (x.float() @ gate.float().t()).contiguous()
    ids, wts = lutb.route_softmax_topk(logits, cfg["num_experts_per_tok"], cfg.get("norm_topk_prob", True))
    return {"checkpoint": str(m), "prefix": f"model.layers.{SHARED_LAYER}.mlp.experts",
            "experts": cfg.get("num_experts", cfg.get("num_local_experts")), "x": x, "ids": ids, "wts": wts}


def _cases() -> dict:
    c = {
        # E = 5 over 2 ranks: 3 + 2 experts; experts 3, 4 empty (rank 1 receives nothing).
        "uneven_empty": _random_layer(1, experts=5, hidden=64, inter=64, tokens=23, k=2, used=3, marker_every=0),
        # H, I not multiples of 64; marker ids; every expert used.
        "markers": _random_layer(2, experts=6, hidden=96, inter=40, tokens=70, k=3, used=6, marker_every=4),
        "one_token": _random_layer(3, experts=4, hidden=64, inter=64, tokens=1, k=2, used=4, marker_every=0),
    }
    return c


def _transformers_local_ids(ids: torch.Tensor, wts: torch.Tensor, experts: int) -> list | None:
    """Per rank, transformers' EpRouterParallel remap of (ids, weights): local ids, marker E / world
    with weight 0 for other ranks' experts. None when transformers is not installed."""
    try:
        from transformers.distributed.tensor_parallel import EpRouterParallel
    except ImportError:
        return None

    class Mesh:
        def __init__(self, rank):
            self.rank = rank

        def get_local_rank(self):
            return self.rank

        def size(self):
            return WORLD

    class Router(torch.nn.Module):
        num_experts = experts

    out = []
    for r in range(WORLD):
        _, w, i = EpRouterParallel().transform_output_post_forward(Router(), (None, wts, ids), Mesh(r))
        out.append((i.contiguous(), w.contiguous()))
    return out


def _local(w: lutb.LutbWeight, shard: ld.ExpertShard) -> lutb.LutbWeight:
    s = slice(shard.start, shard.stop)
    return lutb.LutbWeight(w.packed[s].contiguous(), w.codebook[s].contiguous(), w.scale[s].contiguous(),
                           (shard.local_experts,) + w.shape[1:])


def _worker(rank: int, port: int, path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cases = torch.load(os.path.join(path, "cases.pt"), weights_only=False)
        out = {}
        for name, c in cases.items():
            if name == "shared":
                shard = ld.expert_shard(c["experts"])
                w13, w2 = ld.load_local_experts(c["checkpoint"], c["prefix"], shard)
            else:
                shard = ld.expert_shard(c["w13"].shape[0])
                w13, w2 = _local(c["w13"], shard), _local(c["w2"], shard)
            args = (c["x"], c["ids"], c["wts"], w13, w2, shard)
            for mode in ("all_to_all", "allreduce", "auto"):
                out[(name, mode)] = ld.ep_moe_experts(*args, mode=mode)
            if c.get("hf_local") is not None:
                lid, lw = c["hf_local"][rank]
                out[(name, "hf_local")] = ld.allreduce_local_experts(c["x"], lid, lw, w13, w2)
            # Data-parallel tokens: rank r keeps tokens r, r + 2, ... (rank 1 holds none for one token).
            own = slice(rank, None, WORLD)
            out[(name, "local")] = ld.ep_moe_experts(
                c["x"][own].contiguous(), c["ids"][own].contiguous(), c["wts"][own].contiguous(), w13, w2, shard,
                replicated=False)
        # A shard made for the other rank is refused before any collective.
        c = cases["one_token"]
        other = ld.expert_shard(c["w13"].shape[0], 1 - rank, WORLD)
        try:
            ld.ep_moe_experts(c["x"], c["ids"], c["wts"], _local(c["w13"], other), _local(c["w2"], other), other)
        except ValueError as e:
            out["wrong_shard"] = str(e)
        torch.save(out, os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """(cases, [rank 0 outputs, rank 1 outputs]) of one world-2 gloo run over every case."""
    import torch.multiprocessing as mp

    path = str(tmp_path_factory.mktemp("ep"))
    cases = _cases()
    shared = _shared_layer()
    if shared is not None:
        cases["shared"] = shared
    for name in ("markers", "shared"):  # E divisible by the world, as transformers requires
        if name in cases:
            c = cases[name]
            e = c["experts"] if name == "shared" else c["w13"].shape[0]
            c["hf_local"] = _transformers_local_ids(c["ids"].long(), c["wts"], e)
    torch.save(cases, os.path.join(path, "cases.pt"))
    mp.spawn(_worker, args=(_free_port(), path), nprocs=WORLD, join=True)
    return cases, [torch.load(os.path.join(path, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _full_weights(name: str, c: dict) -> tuple[lutb.LutbWeight, lutb.LutbWeight]:
    if name == "shared":
        return ld.load_local_experts(c["checkpoint"], c["prefix"], ld.expert_shard(c["experts"], 0, 1))
    return c["w13"], c["w2"]


def _single_device(name: str, c: dict) -> torch.Tensor:
    w13, w2 = _full_weights(name, c)
    return lutb.moe_experts(c["x"], c["ids"], c["wts"], w13, w2)


def _allreduce_order(name: str, c: dict) -> torch.Tensor:
    """bf16(p_0 + p_1): the single-device FP32 sums over each rank's experts, added across ranks."""
    w13, w2 = _full_weights(name, c)
    ids = c["ids"].long()
    total = None
    for r in range(WORLD):
        shard = ld.expert_shard(w13.shape[0], r, WORLD)
        mine = (ids >= shard.start) & (ids < shard.stop)
        p = torch.empty(c["x"].shape, dtype=torch.float32)
        lutb.moe_experts(c["x"], torch.where(mine, ids, torch.full_like(ids, w13.shape[0])), c["wts"], w13, w2, out=p)
        total = p if total is None else total + p
    return total.bfloat16()


NAMES = ["uneven_empty", "markers", "one_token", "shared"]


def _case(ranks, name):
    cases, outs = ranks
    if name not in cases:
        pytest.skip(f"../shared/models/{SHARED_MODEL} is absent (set LUTB_SHARED_DIR)")
    return cases[name], outs


@pytest.mark.parametrize("name", NAMES)
def test_all_to_all_is_bit_identical_to_one_device(ranks, name):
    c, outs = _case(ranks, name)
    ref = _single_device(name, c)
    for r in range(WORLD):
        assert torch.equal(outs[r][(name, "all_to_all")], ref), f"rank {r}"


@pytest.mark.parametrize("name", NAMES)
def test_data_parallel_tokens_are_bit_identical_to_one_device(ranks, name):
    c, outs = _case(ranks, name)
    ref = _single_device(name, c)
    for r in range(WORLD):
        assert torch.equal(outs[r][(name, "local")], ref[r::WORLD]), f"rank {r}"


@pytest.mark.parametrize("name", NAMES)
def test_allreduce_equals_one_device_up_to_fp32_order(ranks, name):
    c, outs = _case(ranks, name)
    ordered = _allreduce_order(name, c)
    ref = _single_device(name, c)
    for r in range(WORLD):
        got = outs[r][(name, "allreduce")]
        assert torch.equal(got, ordered), f"rank {r}"
        # Only the FP32 addition order differs: at most one BF16 step from the one-device result.
        step = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
        assert bool(((got.float() - ref.float()).abs() <= step).all()), f"rank {r}"


@pytest.mark.parametrize("name", NAMES)
def test_auto_follows_the_rule(ranks, name):
    c, outs = _case(ranks, name)
    want = ld.choose_mode(c["x"].shape[0])
    for r in range(WORLD):
        assert torch.equal(outs[r][(name, "auto")], outs[r][(name, want)])


@pytest.mark.parametrize("name", ["markers", "shared"])
def test_transformers_local_ids_give_the_allreduce_result(ranks, name):
    """Ids remapped by transformers' EpRouterParallel (local ids, marker E / world, weight 0) through
    allreduce_local_experts: the same bits as mode "allreduce" on global ids."""
    c, outs = _case(ranks, name)
    if c.get("hf_local") is None:
        pytest.skip("transformers is not installed")
    for r in range(WORLD):
        assert torch.equal(outs[r][(name, "hf_local")], outs[r][(name, "allreduce")]), f"rank {r}"


def test_shard_rule():
    assert [(s.start, s.stop) for s in (ld.expert_shard(5, r, 2) for r in range(2))] == [(0, 3), (3, 5)]
    assert [(s.start, s.stop) for s in (ld.expert_shard(256, r, 8) for r in (0, 7))] == [(0, 32), (224, 256)]
    shard = ld.expert_shard(10, 0, 4)  # 3, 3, 2, 2
    assert shard.owner(torch.arange(10)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert ld.choose_mode(ld.ALLREDUCE_MAX_TOKENS) == "allreduce"
    assert ld.choose_mode(ld.ALLREDUCE_MAX_TOKENS + 1) == "all_to_all"


def test_a_shard_of_another_rank_is_refused(ranks):
    _, outs = ranks
    for r in range(WORLD):
        assert outs[r].get("wrong_shard") == (f"shard: made for rank {1 - r} of 2, but this process is rank {r} "
                                              "of 2 in the group")


@pytest.mark.parametrize("args, message", [
    ((4, 0, 5), "world: 5 ranks for 4 experts"),
    ((4, 2, 2), "rank: 2 is not in 0..1"),
    ((0, 0, 1), "experts: 0 < 1"),
])
def test_shard_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        ld.expert_shard(*args)


def test_ep_moe_experts_refuses_bad_arguments():
    c = _random_layer(4, experts=4, hidden=64, inter=64, tokens=3, k=2, used=4, marker_every=0)
    shard = ld.expert_shard(4, 0, 2)
    w13, w2 = _local(c["w13"], shard), _local(c["w2"], shard)
    with pytest.raises(ValueError, match="mode: 'ring'"):
        ld.ep_moe_experts(c["x"], c["ids"], c["wts"], w13, w2, shard, mode="ring")
    with pytest.raises(ValueError, match="mode: 'allreduce' needs the same tokens"):
        ld.ep_moe_experts(c["x"], c["ids"], c["wts"], w13, w2, shard, mode="allreduce", replicated=False)
    with pytest.raises(ValueError, match="w13_local: holds 4 experts, shard 0 of 2 holds 2"):
        ld.ep_moe_experts(c["x"], c["ids"], c["wts"], c["w13"], w2, shard)
    with pytest.raises(ValueError, match="topk_ids: holds a negative expert id"):
        ld.ep_moe_experts(c["x"], -c["ids"] - 1, c["wts"], w13, w2, shard)


def test_loading_reads_only_this_ranks_experts(monkeypatch):
    d = shared_dir()
    if d is None or not (d / "models" / SHARED_MODEL).is_dir():
        pytest.skip(f"../shared/models/{SHARED_MODEL} is absent (set LUTB_SHARED_DIR)")
    read = []
    get = ld._Checkpoint.get
    monkeypatch.setattr(ld._Checkpoint, "get", lambda self, key: read.append(key) or get(self, key))
    prefix = f"model.layers.{SHARED_LAYER}.mlp.experts"
    shard = ld.expert_shard(16, 1, 2)
    w13, w2 = ld.load_local_experts(str(d / "models" / SHARED_MODEL), prefix, shard)
    assert w13.shape == (8, 512, 256) and w2.shape == (8, 256, 256)
    experts = sorted({int(k.split(".")[-3]) for k in read})
    assert experts == list(range(8, 16))
    assert len(read) == 3 * 8
