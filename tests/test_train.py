"""models.train: tokenizer learner, determinism, and trainer == loaded inference model (target and draft).

The trainer nets are their own torch modules; these tests prove that what they export, loaded through
models.loader and run by models.kimi.KimiModel / models.eagle3.Eagle3Draft (torch backend, float32),
computes the trainer's logits (max abs difference <= 1e-4 on logits of magnitude ~1-10).
"""
from __future__ import annotations

import pytest
import torch

from models.eagle3 import Eagle3Draft
from models.kimi import KimiModel
from models.loader import load_draft, load_target
from models.tokenizer import load_tokenizer
from models.train.bpe import learn_merges, piece_counts, write_kimi_tokenizer
from models.train.export import (CAPTURE_IDS, TARGET_SIZES, draft_config, export_draft, export_target, export_view, parse,
                                 target_config, target_from_checkpoint, weights_hash)
from models.train.loop import DraftRun, TargetRun, simulated_accept, train_draft, train_target
from models.train.nets import DraftNet, TargetNet, fake_quant_int4, quant_int4

TINY = dict(hidden=64, layers=4, heads=2, q_lora=32, kv_lora=32, nope=16, rope=16, v=16, intermediate=64,
            moe_intermediate=32, experts=4, topk=2)
TINY_DRAFT = dict(heads=2, kv_heads=1, head_dim=32, intermediate=64)
VOCAB, BPE = 512, 256
TOL = 1e-4


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TEXT = ("def add(a, b):\n    return a + b\n\n" * 3 + "class Point:\n    def __init__(self, x, y):\n"
        "        self.x = x\n        self.y = y\n" * 2 + "# the quick brown fox jumps over the lazy dog\n")


def test_bpe_is_deterministic_and_loads_as_kimi_tiktoken(tmp_path):
    m1 = learn_merges(piece_counts([TEXT]), 256 + 40)
    m2 = learn_merges(piece_counts([TEXT]), 256 + 40)
    assert m1 == m2 and len(m1) == 40 and len(set(m1)) == 40
    assert m1[0] == b"  "                             # indentation: the most frequent pair
    n, names = write_kimi_tokenizer(tmp_path, m1)
    assert n == 296 and names[n] == "[BOS]" and names[n + 1] == "[EOS]" and names[n + 255] == "[PAD]"
    tok = load_tokenizer(tmp_path, n + 256)           # the real code path: TiktokenTokenizer
    assert tok.kind == "tiktoken" and tok.eos_id == n + 1 and tok.vocab_size == n + 256
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and len(ids) < len(TEXT.encode()) // 2
    with pytest.raises(ValueError, match="room for"):
        learn_merges(piece_counts(["ab"]), 256 + 5)


def _stream(n: int = 4000, seed: int = 0) -> torch.Tensor:
    """A learnable token stream: a repeated random phrase with noise."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, BPE, (37,), generator=g)
    s = phrase.repeat(n // 37 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.1
    s[noise] = torch.randint(0, BPE, (int(noise.sum()),), generator=g)
    return s


def _train_tiny(seed: int = 0, steps: int = 3):
    run = TargetRun(seed=seed, steps=steps, batch=2, seq=32, warmup=1, eval_windows=4, sizes=TINY, qat_frac=0.34)
    return train_target(_stream(), _stream(800, 1), VOCAB, BPE, None, run, log=lambda s: None)


def test_target_training_is_deterministic():
    a, b, c = _train_tiny(0), _train_tiny(0), _train_tiny(1)
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]
    assert a["first_step_loss"] == b["first_step_loss"]
    for r in (a, b):
        assert r["heldout_loss_float"] > 0 and r["heldout_loss_int4"] > 0
    # the MoE correction bias moved (balancing ran) and is part of the hash
    assert any(m.e_score_correction_bias.abs().sum() > 0 for m in a["net"].moes())


def test_int4_fake_quant_is_what_ships():
    w = torch.randn(8, 64) * 0.1
    q, s = quant_int4(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7 and s.dtype == torch.bfloat16
    deq = (q.float().view(8, 2, 32) * s.float()[..., None]).view(8, 64)
    assert torch.equal(fake_quant_int4(w), deq)
    assert (deq - w).abs().max() <= s.float().max() / 2 + 1e-6


def _tiny_target(tmp_path, seed: int = 0):
    cfg = target_config(VOCAB, BPE, {**TARGET_SIZES, **TINY})
    torch.manual_seed(seed)
    net = TargetNet(parse(cfg), CAPTURE_IDS, max_len=128)
    with torch.no_grad():
        for m in net.moes():
            m.e_score_correction_bias.copy_(torch.randn(m.e_score_correction_bias.shape) * 0.01)
    export_target(net, cfg, tmp_path / "t")
    return net, cfg


def test_exported_target_runs_the_trainers_logits(tmp_path):
    net, cfg = _tiny_target(tmp_path)
    view = export_view(net)
    ck = load_target(tmp_path / "t")
    q = ck["model.layers.1.mlp.experts.0.up_proj.weight"]
    assert q.source == "compressed-tensors" and q.group == 32           # the Kimi-native INT4 format
    assert ck["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(3))
    lg, aux = view(ids)
    km = KimiModel(ck, capture_ids=CAPTURE_IDS)
    cache = km.new_cache(1, 64)
    out = km.forward(cache, [(0, ids[0].tolist()[:20])])              # prefill, then a ragged rest
    out2 = km.forward(cache, [(0, ids[0].tolist()[20:])])
    got = torch.cat([out.logits[0], out2.logits[0]])
    got_aux = torch.cat([out.aux[0], out2.aux[0]])
    assert (got - lg[0]).abs().max() <= TOL, (got - lg[0]).abs().max()
    assert (got_aux - aux[0]).abs().max() <= TOL
    back = target_from_checkpoint(ck, CAPTURE_IDS)                      # checkpoint -> trainer, same function
    assert (back(ids)[0] - lg).abs().max() <= TOL


def test_exported_draft_runs_the_trainers_unroll(tmp_path):
    net, cfg = _tiny_target(tmp_path)
    view = export_view(net)
    dcfg = draft_config(cfg, TINY_DRAFT)
    assert dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in CAPTURE_IDS]
    torch.manual_seed(1)
    d = DraftNet(parse(dcfg), view.embed_tokens.weight.detach(), max_len=128)
    export_draft(d, dcfg, tmp_path / "d")
    dv = export_view(d)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    _, aux = view(ids)
    tok, a = ids[:, 1:], aux[:, :-1]
    steps = [dv.head(y)[0] for y in dv.unroll(tok, a, 3)]
    ck = load_target(tmp_path / "t")
    dk = load_draft(tmp_path / "d", ck.config)
    assert dk.config.capture_layer_ids(ck.config.num_hidden_layers) == CAPTURE_IDS
    assert dk["fc.weight"].dtype == torch.bfloat16
    ed = Eagle3Draft(dk, target_hidden=ck.config.hidden_size)
    cache = ed.new_cache(1, 64)
    L = 25
    (lg, y), = ed.forward(cache, [(0, tok[0, :L].tolist(), a[0, :L])])
    assert (lg - steps[0][:L]).abs().max() <= TOL
    # the chain at inference: step 2 at row L on the carried state of row L-1, step 3 at row L+1
    (lg2, y2), = ed.forward(cache, [(0, [int(tok[0, L])], y[-1:])])
    (lg3, _), = ed.forward(cache, [(0, [int(tok[0, L + 1])], y2)])
    assert (lg2[0] - steps[1][L]).abs().max() <= TOL
    assert (lg3[0] - steps[2][L + 1]).abs().max() <= TOL


def test_draft_training_is_deterministic(tmp_path):
    net, cfg = _tiny_target(tmp_path)
    view = export_view(net)
    run = DraftRun(steps=2, batch=2, prompt_len=8, gen_len=8, sequences=4, heldout_sequences=2, warmup=1,
                   sizes=TINY_DRAFT)
    quiet = lambda s: None  # noqa: E731
    a = train_draft(view, _stream(), _stream(400, 1), cfg, None, run, log=quiet)
    b = train_draft(view, _stream(), _stream(400, 1), cfg, None, run, log=quiet)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert 1.0 <= a["simulated_accept_length"] <= 4.0


def test_simulated_accept_counts_chains():
    t, f = True, False
    # rows: step-1 agreement per row, step-2 at row p+1, step-3 at row p+2
    agree = [torch.tensor([[t, t, f, t, t]]), torch.tensor([[f, t, t, f, t]]), torch.tensor([[f, f, t, t, t]])]
    al, per = simulated_accept(agree, 0)
    # chains start at rows 0, 1, 2: row 0 (s1[0], s2[1], s3[2]) all accepted, row 1 (s1[1], s2[2], s3[3])
    # all accepted, row 2 rejected at its first draft
    assert per == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    assert al == pytest.approx(1 + sum(per))


def test_weights_hash_sees_buffers():
    torch.manual_seed(0)
    cfg = target_config(VOCAB, BPE, {**TARGET_SIZES, **TINY})
    net = TargetNet(parse(cfg), CAPTURE_IDS, max_len=64)
    h = weights_hash(net)
    with torch.no_grad():
        net.moes()[0].e_score_correction_bias[0] += 1e-3
    assert weights_hash(net) != h


@pytest.mark.parametrize("argv,msg", [
    (["target", "--steps", "0"], "--steps must be >= 1"),
    (["target", "--bpe-tokens", "10"], "--bpe-tokens must be >= 256"),
    (["draft", "--lr", "0"], "--lr must be > 0"),
])
def test_cli_bad_flags(argv, msg, capsys):
    from models.train.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_cli_draft_needs_a_target(tmp_path, capsys):
    from models.train.cli import main

    assert main(["draft", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no target checkpoint" in err and err.count("\n") == 1


def test_cli_target_end_to_end(tmp_path, capsys):
    """`python -m models.train target` on three stdlib files, one step: tokenizer, checkpoint, prompts,
    manifest (with every file's sha256) all written and loadable."""
    import json

    from models.train.cli import main

    out = tmp_path / "pair"
    assert main(["target", "--out", str(out), "--limit-files", "3", "--bpe-tokens", "300", "--steps", "1",
                 "--batch", "1", "--seq", "16"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["target"]["steps"] == 1 and m["target"]["bpe_tokens"] == 300 and "target/model.safetensors" in m["files"]
    ck = load_target(out / "target")
    assert ck.config.vocab_size == 300 + 256
    assert load_tokenizer(out / "target", ck.config.vocab_size).kind == "tiktoken"
