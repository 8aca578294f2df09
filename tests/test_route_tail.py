"""The route tail of the gate|up + router GEMM (ops.gemm_addnorm RouteTail, the *_route kernels):
the grid's last program routes and aligns the tokens over the router columns of the partials.

Tolerances: none; the tail runs ops.moe.route_and_align, moe_route_align's own helper, over the same
partials, so ids, weights, block map and sorted slots equal route_align's bit for bit, and the
GEMM's outputs equal the kernel without the tail (the interpreter). Outputs are views of bigger
poisoned buffers; the ticket counter is back at 0 after every launch."""
from __future__ import annotations

import os

import pytest
import torch

from ops import gemm_addnorm as A
from ops.moe import route_align


def _case(M, K, N, E, seed, splitk):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, M, K, generator=g) if splitk else (torch.randn(M, K, generator=g) * 2).bfloat16()
    res = (torch.randn(M, K, generator=g) * 3).bfloat16()
    xw = torch.randn(K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.1).bfloat16()
    bias = torch.randn(E, generator=g) * 0.1
    return x, res, xw, w, bias


@pytest.mark.parametrize("splitk", [False, True])
@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("M,local", [(1, None), (3, None), (4, (16, 24))])
def test_route_tail_equals_route_align(M, local, quant, splitk):
    K, N, E, top = 128, 96, 64, 4
    x, res, xw, w, bias = _case(M, K, N, E, seed=M * 7 + quant + 2 * splitk, splitk=splitk)
    cfg = {"BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 2}
    tail = A.RouteTail(bias=bias, top_k=top, block_m=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                       local=local)
    out = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, normed=True, quant=quant, route=tail)
    base = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, normed=True, quant=quant)
    n = len(base)
    for a, b in zip(out[:n], base):
        assert torch.equal(a, b)
    ref = route_align(out[2], w[N - E:], bias, top, 4, 2, True, 2.5, block_m=16, local=local,
                      logits=base[0][..., N - E:])
    for a, b in zip(out[n:], ref):
        assert torch.equal(a, b)
    assert A._ticket_counter(x.device).item() == 0
    torch_out = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, normed=True, quant=quant,
                                    route=tail, backend="torch")
    ids, wts, sid, bexp = torch_out[n:]     # the torch route: the same choice, weights within f32 rounding
    assert torch.equal(ids, ref[0]) and torch.equal(sid, ref[2]) and torch.equal(bexp, ref[3])
    torch.testing.assert_close(wts, ref[1], rtol=1e-6, atol=0)


def test_route_tail_refuses_what_one_program_cannot_route():
    x, res, xw, w, bias = _case(16, 128, 96, 64, seed=1, splitk=False)
    tail = A.RouteTail(bias=bias, top_k=8, block_m=16)
    assert not A.route_tail_fits(16, 64, 8)
    with pytest.raises(ValueError, match="route tail"):
        A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, normed=True, route=tail)
    with pytest.raises(ValueError, match="normed=True or quant=True"):
        A.gemm_bf16_addnorm(x[:1], res[:1], xw, w, 1e-6, route=tail)
    with pytest.raises(ValueError, match="router columns"):
        A.gemm_bf16_addnorm(x[:1], res[:1], xw, w[:32], 1e-6, normed=True, route=tail)


def test_route_tail_pays_where_the_files_say():
    """route_tail_pays reads the route form's own file (its base's numerics at each bucket, its own
    launch keys and figures): on gfx942 the W4A16 and W4A8 forms pay at 1 to 4 rows; at 8 rows the longer kernel
    spills where its base does not (its figure says so: the separate route_align launch stays); more
    tokens than one program routes (route_tail_fits), no files, or a split count without files: never."""
    pays = A.route_tail_pays
    kimi = dict(n_experts=384, top_k=8, n_group=1, n_local=384, block_m=16)
    for quant in (False, True):
        assert all(pays("gfx942", 4480, 7168, rows, quant, 4, **kimi) for rows in (1, 2, 4))
        assert not pays("gfx942", 4480, 7168, 8, quant, 4, **kimi)
    assert not pays("gfx942", 4480, 7168, 16, True, 4, **kimi)
    assert not pays("interpret", 4480, 7168, 1, True, 4, **kimi)
    assert not pays("gfx942", 4480, 7168, 1, True, 8, **kimi)            # no file at that split count


def test_recorded_step_routes_in_the_gemm_where_it_pays():
    """The recorded Kimi-K2.5 step (gfx942, batch 1): route_in_gemm "auto" takes the route form where
    route_tail_pays says so (TP1 at 1 and 4 rows; TP8's W4A16 _y form at 1 row, not at 4: 8.8 us
    against 3.4 + route_align + the gap), one launch fewer per MoE layer than False (no
    moe_route_align launch); True takes it wherever it fits."""
    from bench.meta_model import HostShadowMode, build_model
    from bench.step import load_model_config, record_step

    for tp, experts, ql, want in ((1, "w4a8", 1, True), (1, "w4a16", 4, True), (8, "w4a16", 1, True),
                                  (8, "w4a16", 4, False)):
        cfg = load_model_config("kimi-k2.5", tp=tp, layers=2)
        mode = HostShadowMode()
        model = build_model(cfg, experts, mode, tp, "tp")
        names = {}
        for how in ("auto", True, False):
            model.route_in_gemm = how
            names[how] = [r.kernel.name for r in record_step(cfg, experts, "gfx942", 1, 8192, ql, model,
                                                             mode).launches]
        base = A.kernel_for(True, experts == "w4a8", tp == 1).name
        assert base in names[False] and "moe_route_align" in names[False]
        assert base + "_route" in names[True] and "moe_route_align" not in names[True]
        assert len(names[True]) == len(names[False]) - 1
        assert names["auto"] == names[True if want else False], (tp, experts, ql)
    cfg = load_model_config("kimi-k2.5", layers=2)
    # tune-model tunes the route form at the step's routing problems whichever path the record took,
    # and the routing launch where the record took the tail
    from bench.step import _with_add_norm_paths
    from ops.moe import moe_route_align

    rp = {"E": 384, "TOPK": 8, "NG": 1, "EA": 384, "BM": 16}
    got = [(k.name, p) for k, p, _ in _with_add_norm_paths([(moe_route_align, rp, 1)], cfg, 1, "w4a8", "gfx942")]
    assert ("gemm_bf16_addnorm_splitk_yq_route", {"N": 4480, "K": 7168, "S": 4, **rp}) in got
    tail = A.kernel_for(True, True, True, route=True)
    got = [(k.name, p) for k, p, _ in _with_add_norm_paths([(tail, {"N": 4480, "K": 7168, "S": 4, **rp}, 1)], cfg, 1,
                                                            "w4a8", "gfx942")]
    assert ("moe_route_align", rp) in got
@pytest.mark.aot
def test_configs_of_tune_keeps_the_base_numerics_and_check_sees_them_move(tmp_path):
    """`autotune tune` of a route kernel keeps the base file's numerics tile at every bucket and
    searches only its launch keys (its own figures, the longer kernel's); `autotune check` flags the
    route file stale once the base's numerics change, not when only its launch keys do."""
    import json
    import shutil

    from autotune import store
    from autotune.__main__ import check_files
    from autotune.problems import launch_only_keys
    from autotune.search import file_numerics, predict_config, tune

    base = A.kernel_for(True, True, True)
    bprob = {"N": 4480, "K": 7168, "S": 4}
    os.makedirs(tmp_path / "gfx942")
    bpath = shutil.copy(store.file_path(base, "gfx942", bprob), tmp_path / "gfx942")
    route = A.kernel_for(True, True, True, route=True)
    rprob = {**bprob, "E": 384, "TOPK": 8, "NG": 1, "EA": 384, "BM": 16}
    _, doc = tune(route, "gfx942", rprob, [1], out=str(tmp_path), progress=False, workers=1, max_candidates=4)
    bdoc = store.load_file(bpath)
    tile = dict(file_numerics(base, bdoc))
    assert [e["bucket"] for e in doc["entries"]] == [1]
    got = doc["entries"][0]["config"]
    assert all(got[k] == v for k, v in tile.items()) and "BLOCK_N" not in tile
    assert "BLOCK_N" in launch_only_keys(route, got)
    # never worse than the config the base runs at that bucket (its BLOCK_M of 2 lies outside the
    # bucket-1 space the tuner samples: it must still be a candidate)
    ran = store.select_entry(store.load_file(bpath), 1)["config"]
    assert ran["BLOCK_M"] == 2
    at_base = predict_config(route, "gfx942", rprob, 1, dict(route.specialize(ran, "gfx942").config))
    assert doc["entries"][0]["figures"]["predicted_us"] <= at_base["predicted_us"] + 1e-3
    problems: list[str] = []
    assert check_files(str(tmp_path), compile=False, log=problems.append)[1:] == (0, 0), problems
    e1 = store.select_entry(bdoc, 1)
    e1["config"]["BLOCK_N"] = 2 * e1["config"]["BLOCK_N"]             # a launch key moved: still in step
    with open(bpath, "w") as f:
        json.dump(bdoc, f)
    problems = []
    assert check_files(str(tmp_path), compile=False, log=problems.append)[1:] == (0, 0), problems
    for e in bdoc["entries"]:                                          # the base re-tuned to another tile
        e["config"]["BLOCK_K"] = 64 if tile["BLOCK_K"] != 64 else 128
    with open(bpath, "w") as f:
        json.dump(bdoc, f)
    problems = []
    check_files(str(tmp_path), compile=False, log=problems.append)
    assert any("hold other numerics than" in p and "[1]" in p for p in problems), problems


@pytest.mark.parametrize("splitk,M", [(False, 2), (True, 3)])
def test_route_tail_writes_only_its_outputs(monkeypatch, splitk, M):
    """The tail's ids, weights and packed block map + slots (`aligned`: each segment's stores masked to
    it) land in views of bigger poisoned buffers: every element written, nothing around them."""
    from ops import moe
    from tests.conftest import poisoned

    real, guards = moe.route_align_operands, []

    def guarded(*a, **k):
        outs, args, aligned = real(*a, **k)
        views = []
        for t in (outs[0], outs[1], aligned):
            big = poisoned((t.numel() + 64,), t.dtype)
            views.append(big[32:32 + t.numel()].view(t.shape))
            guards.append((big, t.numel()))
        ids, wts, al = views
        nb = outs[3].shape[0]
        return (ids, wts, al[nb:], al[:nb]), (args[0], ids, wts, al[:nb], al[nb:], *args[5:]), al

    monkeypatch.setattr(moe, "route_align_operands", guarded)
    K, N, E, top = 128, 96, 64, 4
    x, res, xw, w, bias = _case(M, K, N, E, seed=11 + M, splitk=splitk)
    cfg = {"BLOCK_M": 2, "BLOCK_N": 32, "BLOCK_K": 32, "NORM_K": 128, "SPLIT_K": 2}
    tail = A.RouteTail(bias=bias, top_k=top, block_m=16, n_group=4, topk_group=2)
    out = A.gemm_bf16_addnorm(x, res, xw, w, 1e-6, config=cfg, partials=True, normed=True, route=tail)
    got = out[3:]
    ref = route_align(out[2], w[N - E:], bias, top, 4, 2, True, 1.0, block_m=16, logits=out[0][..., N - E:])
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert not (got[0] == -123).any() and not got[1].isnan().any() and not (got[2] == -123).any() \
        and not (got[3] == -123).any()
    for big, n in guards:
        head, tail_ = big[:32], big[32 + n:]
        if big.dtype.is_floating_point:
            assert head.isnan().all() and tail_.isnan().all()
        else:
            assert (head == -123).all() and (tail_ == -123).all()
