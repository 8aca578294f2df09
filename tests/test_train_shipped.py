"""The shipped trained pair (models/data/tiny_pair) is what `python -m models.train` produces.

Checked here: every shipped file against the manifest's sha256; the formats (Kimi layout, INT4 g32
experts, BF16 draft with its eagle_config aux ids, Kimi tiktoken tokenizer); and, where this machine has
the same standard library sources the pair was trained on (the manifest's corpus digest), a re-derivation
of parts of the run: the first BPE merges, the first training step's loss from the seeded initial state,
and the held-out loss of the shipped checkpoint.
"""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from models.config import DeepseekV3Config, Eagle3Config
from models.loader import load_draft, load_target
from models.tokenizer import load_tokenizer
from models.train import PAIR_DIR, shipped_pair, shipped_prompts
from models.train.cli import BPE_TOKENS, tokenize_corpus
from models.train.export import CAPTURE_IDS, TARGET_SIZES, target_from_checkpoint
from models.train.loop import TargetRun, eval_windows, heldout_loss, windows

MANIFEST = json.loads((PAIR_DIR / "manifest.json").read_text())


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus():
    from models.train.corpus import load_corpus

    c = load_corpus()
    if c.digest() != MANIFEST["target"]["corpus_digest"]:
        pytest.skip("this Python's standard library differs from the one the pair was trained on "
                    f"(Python {MANIFEST['target']['python']})")
    return c


def test_files_match_manifest_and_size():
    files = {str(p.relative_to(PAIR_DIR)): p for p in PAIR_DIR.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(files) == set(MANIFEST["files"])
    for name, p in files.items():
        assert hashlib.sha256(p.read_bytes()).hexdigest() == MANIFEST["files"][name], name
    assert sum(p.stat().st_size for p in files.values()) < 30e6


def test_formats():
    t, d = shipped_pair()
    tk = load_target(t)
    c = tk.config
    assert isinstance(c, DeepseekV3Config) and c.tensor_prefix == "language_model."
    assert (c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.num_experts_per_tok) == \
        (TARGET_SIZES["hidden"], TARGET_SIZES["layers"], TARGET_SIZES["experts"], TARGET_SIZES["topk"])
    assert c.q_lora_rank and c.rope_scaling is not None and c.first_k_dense_replace == 1 and c.n_shared_experts == 1
    w = tk["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert w.source == "compressed-tensors" and w.group == 32
    dk = load_draft(d, c)
    assert isinstance(dk.config, Eagle3Config) and dk["midlayer.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert dk.config.capture_layer_ids(c.num_hidden_layers) == CAPTURE_IDS
    tok = load_tokenizer(t, c.vocab_size)
    assert tok.kind == "tiktoken" and tok.num_base == MANIFEST["target"]["bpe_tokens"]
    prompts = shipped_prompts()
    assert len(prompts) == MANIFEST["target"]["heldout_prompts"] >= 8


def test_tokenizer_first_merges_rederived(corpus):
    from models.train.bpe import learn_merges, piece_counts

    n = 120
    merges = learn_merges(piece_counts(t for _, t in corpus.train), 256 + n)
    shipped = (PAIR_DIR / "target" / "tiktoken.model").read_text().splitlines()[256:256 + n]
    import base64
    assert [base64.b64decode(ln.split()[0]) for ln in shipped] == merges


def test_first_training_step_and_heldout_loss_rederived(corpus):
    """From the seed: the initial weights and the first batch give the manifest's first-step loss; the
    shipped checkpoint gives the manifest's held-out loss (as exported: bf16, int4 experts)."""
    from models.train.export import parse, target_config
    from models.train.nets import TargetNet
    import torch.nn.functional as F

    m = MANIFEST["target"]
    t, _ = shipped_pair()
    tok = load_tokenizer(t, BPE_TOKENS + 256)
    train_ids, held_ids = tokenize_corpus(tok, corpus)
    assert train_ids.numel() == m["train_tokens"]
    run = TargetRun(seed=m["seed"], batch=m["batch"], seq=m["seq"])
    torch.manual_seed(run.seed)
    net = TargetNet(parse(target_config(tok.vocab_size, tok.num_base)), CAPTURE_IDS, max_len=max(run.seq, 1024))
    w = windows(train_ids, run.batch, run.seq + 1, torch.Generator().manual_seed(run.seed))
    with torch.no_grad():
        logits, _ = net(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
    assert float(loss) == pytest.approx(m["first_step_loss"], rel=1e-4)
    shipped = target_from_checkpoint(load_target(t))
    held = eval_windows(held_ids, run.eval_windows, run.seq)
    assert heldout_loss(shipped, held) == pytest.approx(m["heldout_loss_int4"], abs=2e-3)
