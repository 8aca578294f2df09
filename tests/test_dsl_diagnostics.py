"""Diagnostics and generated-code quality: trace errors name the DSL file:line, kernel name clashes
say how to rename, generated Triton keeps user variable names, shares common subexpressions and
hoists loop invariants (results unchanged); the `kd.triton_call` escape hatch against torch."""
from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch

import kdsl as kd
from kdsl.errors import ConfigError, TraceError
from tests.conftest import poisoned

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "docs"))
import my_kernels as mk  # noqa: E402


def test_trace_error_names_file_and_line():
    @kd.kernel(name="g_bad_axis")
    def bad(x: kd.In["M", "N", kd.f32], out: kd.Out["M", kd.f32]):
        m, n = kd.grid("M", "N")
        out[m] = kd.sum(x[m, n], axis=kd.arange(16))        # not an axis of the value

    line = inspect.getsourcelines(bad.fn)[1] + 3
    with pytest.raises(TraceError) as e:
        bad.source({}, "interpret")
    assert f"test_dsl_diagnostics.py:{line}" in str(e.value) and "kd.sum(x[m, n]" in str(e.value)
    assert e.value.loc.line == line


def test_trace_error_inside_fold_body_names_that_line():
    @kd.kernel(name="g_bad_fold")
    def bad(x: kd.In["M", "N", kd.f32], out: kd.Out["M", kd.f32]):
        m, = kd.grid("M")
        out[m] = kd.fold("N", kd.zeros((m,), kd.f32),
                         lambda n, s: s + x[m, n] + x[n])     # x has 2 dims

    line = inspect.getsourcelines(bad.fn)[1] + 4
    with pytest.raises(TraceError, match=f"test_dsl_diagnostics.py:{line}"):
        bad.source({}, "interpret")


def test_name_clash_says_how_to_rename():
    def body(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
        m, = kd.grid("M")
        out[m] = x[m]

    with pytest.raises(ConfigError, match=r"rename this one with @kd.kernel\(name="):
        kd.kernel(name="scale_rows")(body)                  # docs/my_kernels.py has a scale_rows


@kd.kernel(example={"M": 64, "N": 256})
def g_attn_like(x: kd.In["M", "N", kd.f32], sm_scale: kd.Scalar[kd.f32], out: kd.Out["M", kd.f32]):
    m, = kd.grid(kd.tile("M", domain=(1, 2, 4), default=2))

    def step(n, acc):
        qk = x[m, n] * (sm_scale * 1.4427)                    # loop-invariant scalar
        e1 = kd.exp2(qk - 1.0)
        e2 = kd.exp2(qk - 1.0)                                # the same expression again
        return acc + kd.sum(e1 + e2, axis=n)

    acc = kd.fold(kd.tiles("N", block=32), kd.zeros((m,), kd.f32), step)
    out[m] = acc


def test_names_cse_and_hoisting():
    src = g_attn_like.source({}, "gfx942")
    code = "\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith("#"))   # no DSL-line comments
    head, body = code.split("\n    for ", 1)
    assert "sm_scale * 1.4427" in head and "sm_scale * 1.4427" not in body    # hoisted
    assert body.count("tl.exp2(") == 1                                       # shared
    for name in ("qk = ", "e1 = ", "acc = "):
        assert name in src, name
    assert "'cse': " in src and "'hoisted': 1" in src


def test_cse_and_hoisting_keep_results():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 77, generator=g)
    out = poisoned((7,), torch.float32)
    g_attn_like(x, 0.3, out)
    ref = (2 * torch.exp2(x * (0.3 * 1.4427) - 1.0)).sum(1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_triton_call_softplus():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 37, generator=g) * 8
    out = poisoned((5, 37), torch.float32)
    mk.softplus_rows(x, 1.5, out, config={"BLOCK_M": 16, "BLOCK_N": 16})
    torch.testing.assert_close(out, torch.nn.functional.softplus(x, beta=1.5), rtol=1e-6, atol=1e-6)


def test_triton_call_rejects_plain_python():
    @kd.kernel(name="g_call_plain")
    def k(x: kd.In["M", kd.f32], out: kd.Out["M", kd.f32]):
        m, = kd.grid("M")
        out[m] = kd.triton_call(lambda v: v, x[m])

    with pytest.raises(TraceError, match="needs a @triton.jit function"):
        k.source({}, "interpret")


def test_topk_router_example():
    g = torch.Generator().manual_seed(7)
    M, E, K = 5, 37, 6
    logits = torch.randn(M, E, generator=g)
    ids, wts = poisoned((M, K), torch.int32), poisoned((M, K), torch.float32)
    mk.topk_router(logits, ids, wts)
    p = torch.softmax(logits, -1)
    ref = torch.sort(p, dim=-1, descending=True, stable=True)
    assert torch.equal(ids.long(), ref.indices[:, :K])
    top = ref.values[:, :K]
    torch.testing.assert_close(wts, top / top.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "sm90"])
@pytest.mark.parametrize("kern", [mk.softplus_rows, mk.topk_router, g_attn_like], ids=lambda k: k.name)
def test_compiles_without_spills(kern, arch):
    from kdsl import aot

    r = aot.report(kern, arch)
    assert r.ok and r.spills == 0, (r.errors, r.text())


def test_readme_router_and_persistent_snippet(monkeypatch):
    """The top-k router / persistent GEMM snippet in README "## Writing a kernel" runs as written."""
    import re

    root = os.path.join(os.path.dirname(__file__), "..")
    text = open(os.path.join(root, "README.md")).read()
    section = text.split("## Writing a kernel", 1)[1].split("\n## ", 1)[0]
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "topk_router(logits, ids, wts)" in b)
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(compile(snippet, "README.md", "exec"), {"__name__": "readme_snippet"})


def test_emit_ir_and_verifier(capsys):
    from kdsl.__main__ import main
    from kdsl.irtools import verify

    assert main(["-m", "docs/my_kernels.py", "show", "softmax_rows", "--emit", "ir"]) == 0
    out = capsys.readouterr().out
    assert "fold %" in out and "yield %m_new, %l_new" in out and "my_kernels.py:" in out

    from kdsl.targets import get_target

    ctx = g_attn_like._trace(get_target("interpret"), {"BLOCK_M": 2}, {})
    verify(ctx.root)                               # a valid kernel passes; now break one on purpose
    fold = next(n for n in ctx.root.nodes if n.op == "fold")
    inner = fold.blocks[0].nodes[-1]
    ctx.root.nodes.insert(0, inner)                # a use before its operands are defined
    with pytest.raises(TraceError, match="IR verifier after trace: .*before .*definition .*test_dsl_diagnostics.py:"):
        verify(ctx.root)
