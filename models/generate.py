"""`python -m models.generate`: speculative (EAGLE-3) vs plain decoding, metrics, lossless check.

With no arguments it runs the embedded default: the trained tiny pair shipped in
models/data/tiny_pair (`python -m models.train`: a 4-layer Kimi-K2.5-format target, MLA + MoE with
compressed-tensors INT4 experts and its own BPE tokenizer, trained on the Python standard library's
sources, and its trained EAGLE-3 draft), on held-out code prompts: it prints code continuing them and
acceptance figures that a broken draft wiring visibly lowers. The random fixtures (models.fixtures,
`default_checkpoints`) stay for tests. `--speculative-config` takes vLLM's JSON spelling
({"method": "eagle3", "num_speculative_tokens": 3, "model": DRAFT_DIR, "draft_tensor_parallel_size": 1}).

Tokenizer: the target checkpoint's tiktoken BPE when it ships `tiktoken.model` (Kimi-K2 / K2.5:
with `tokenizer_config.json`; special tokens written in a prompt become their ids), else byte-level
(token id = byte value, ids >= 256 print as <id>; the random fixtures). Generation stops at the
checkpoint's generation eos (generation_config.json, else config.json, else tokenizer_config.json).
--temperature > 0 uses sampled acceptance (target distribution preserved, chain or tree); --topk > 1
is tree drafting (--draft-tokens = tree size incl. the root; on the triton backend at most 8, the
verify kernels' q_len limit). Both backends run every combination, with a Llama- or an MLA-midlayer
draft.

Aux layers: the target captures the layers the draft's `eagle_config.eagle_aux_hidden_state_layer_ids`
name (models.config: as given, +1 on each when the first id is 1), the default (2, N//2, N-3) when
absent, or `--aux-ids` (taken as given); the report and the JSON say which ids were used and why.
Bad input (flags, paths, configs, checkpoints) ends in one line on stderr naming it and exit status 2;
counts are bounded by the model (positions, draft vocab) and by the memory available.
Device: --device (default cuda when torch sees a GPU, else cpu) holds the weights, caches and every
step tensor; the triton backend runs its kernels on the GPU there (the interpreter on CPU tensors).
--graphs on (default on a GPU) captures the decode, verify and draft steps as CUDA graphs per padded
batch bucket. --prompt-ids 1,2,3 (repeatable) gives a prompt as token ids. With --temperature > 0
each prompt samples from its own generator seeded from (--seed, prompt index).
Parallel: `torchrun --nproc-per-node N -m models.generate --tp N [--moe-parallel ep|tp]` runs one rank
per process (models.parallel: MLA by heads, experts by expert or by intermediate, vocab-parallel
lm_head, the draft replicated); each rank loads only its shard and only rank 0 prints.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from models.tokenizer import ByteTokenizer

__all__ = ["main", "ByteTokenizer", "default_checkpoints", "DEFAULT_PROMPTS"]

DEFAULT_PROMPTS = ["The quick brown fox", "def fib(n):", "Speculative decoding is", "1, 2, 3, 5, 8,"]
TARGET_SEED, DRAFT_SEED = 0, 1


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kdsl" / "fixtures"


_STALE_S = 600          # a writer's temp directory older than this is from a killed run


def _usable_root(root: Path) -> Path:
    """`root` if a directory can be made and written there; else a per-user temp directory, with a
    one-line notice on stderr (an unwritable cache is not an error)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe-", delete=True)
        probe.close()
        return root
    except OSError as e:
        alt = Path(tempfile.gettempdir()) / f"kdsl-{os.getuid() if hasattr(os, 'getuid') else 'user'}" / "fixtures"
        print(f"note: fixture cache {root} is not writable ({e.strerror or e}); using {alt}", file=sys.stderr)
        alt.mkdir(parents=True, exist_ok=True)
        return alt


def _clean_stale(root: Path) -> None:
    """Remove temp directories of writers killed mid-write (`.KIND-*` / `.stale-*`, older than _STALE_S)."""
    now = time.time()
    for e in root.glob(".*-*"):
        try:
            if e.is_dir() and not e.is_symlink() and now - e.stat().st_mtime > _STALE_S:
                shutil.rmtree(e, ignore_errors=True)
        except OSError:
            pass


def default_checkpoints(root: Optional[Path] = None) -> tuple[Path, Path]:
    """Write (once) the tiny kimi-k25 target and eagle3 draft fixtures; return their directories.

    A cached directory is used only when its completion marker and file hashes check out
    (models.fixtures.verify_fixture); a partial or corrupt one is rebuilt, a writer's leftover temp
    directory is removed."""
    from models.fixtures import verify_fixture, write_fixture

    root = _usable_root(root or cache_dir())
    _clean_stale(root)
    out = []
    for kind, seed in (("kimi-k25", TARGET_SEED), ("eagle3", DRAFT_SEED)):
        d = root / f"{kind}-seed{seed}"
        if verify_fixture(d, kind) is not None:
            tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
            write_fixture(kind, tmp, seed=seed)
            if d.exists() or d.is_symlink():
                old = root / f".stale-{kind}-{os.getpid()}-{time.time_ns()}"
                try:
                    d.rename(old)
                except OSError:
                    pass
                shutil.rmtree(old, ignore_errors=True)
            try:
                tmp.rename(d)                      # atomic: a concurrent writer's copy wins
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
            why = verify_fixture(d, kind)
            if why is not None:
                raise ValueError(f"fixture cache {d}: {why} after rebuilding it")
        out.append(d)
    return out[0], out[1]


class CliExit(SystemExit):
    """Exit status 2 for bad input; the one-line message was printed to stderr and is str(self)."""

    def __init__(self, msg: str):
        super().__init__(2)
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


def _fail(msg: str) -> "CliExit":
    line = msg.splitlines()[0] if msg else "error"
    print(line, file=sys.stderr)
    return CliExit(line)


def _checkpoint_dir(p: str, flag: str) -> Path:
    d = Path(p).expanduser()
    if not d.exists():
        raise _fail(f"error: {flag} {p}: no such directory")
    if not d.is_dir() or not (d / "config.json").is_file():
        raise _fail(f"error: {flag} {p}: not a checkpoint directory (no config.json)")
    return d


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        raise _fail(f"{self.prog}: error: {message}")


# Static bounds on counts (before any model is known); the model and the memory bound them further
# at run time (_check_model_bounds).
LIMITS = {"--steps": 64, "--topk": 64, "--draft-tokens": 1024, "--max-new-tokens": 1 << 20, "--batch": 4096}
MIN_TEMPERATURE = 1e-3


def _finite_float(flag: str):
    def conv(v: str) -> float:
        try:
            f = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {v!r}") from None
        if not math.isfinite(f):
            raise argparse.ArgumentTypeError(f"{flag} must be finite, got {v!r}")
        return f
    return conv


def _validate_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Every flag in its domain (one line naming the flag, exit 2); model-dependent bounds come later."""
    from models.config import ConfigError, parse_aux_ids

    cpus = os.cpu_count() or 1
    for name, v, lo, hi in (("--steps", a.steps, 1, LIMITS["--steps"]), ("--topk", a.topk, 1, LIMITS["--topk"]),
                            ("--max-new-tokens", a.max_new_tokens, 1, LIMITS["--max-new-tokens"]),
                            ("--batch", a.batch, 1, LIMITS["--batch"]), ("--threads", a.threads, 1, cpus),
                            ("--draft-tokens", a.draft_tokens, 2, LIMITS["--draft-tokens"])):
        if v is not None and v < lo:
            ap.error(f"{name} must be >= {lo}, got {v}")
        if v is not None and v > hi:
            ap.error(f"{name} must be <= {hi}{' (CPU count)' if name == '--threads' else ''}, got {v}")
    if a.temperature < 0:
        ap.error(f"--temperature must be >= 0, got {a.temperature}")
    if 0 < a.temperature < MIN_TEMPERATURE:
        ap.error(f"--temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {a.temperature:g}")
    if not 0 < a.top_p <= 1:
        ap.error(f"--top-p must be in (0, 1], got {a.top_p}")
    if not 0 <= a.seed < 2 ** 63:
        ap.error(f"--seed must be in [0, 2**63), got {a.seed}")
    if (a.target is None) != (a.draft is None):
        ap.error("--target and --draft go together (or give neither for the embedded default)")
    if a.prompt is not None and any(p == "" for p in a.prompt):
        ap.error("--prompt must not be empty")
    if a.prompt is not None:
        for p in a.prompt:
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:
                ap.error("--prompt must be valid text (it holds an unpaired surrogate)")
    a.aux_ids_list = None
    if a.aux_ids is not None:
        try:
            a.aux_ids_list = parse_aux_ids(a.aux_ids)
        except ConfigError as e:
            ap.error(str(e))


def _check_model_bounds(a: argparse.Namespace, tdir: Path, ddir: Path, num_draft_tokens: int) -> None:
    """Counts against the model (positions, draft vocab) and the memory available, from the configs
    only (before any weight is read). Raises ValueError naming the flag."""
    from models.config import DeepseekV3Config, Eagle3Config, available_memory_bytes, load_config

    tc, dc = load_config(tdir), load_config(ddir)
    if not isinstance(tc, DeepseekV3Config):
        raise ValueError(f"--target {tdir}: config.json describes a draft, not a target")
    if not isinstance(dc, Eagle3Config):
        raise ValueError(f"--draft {ddir}: config.json does not describe an EAGLE-3 draft")
    if a.topk > dc.draft_vocab_size:
        raise ValueError(f"--topk must be <= the draft vocab ({dc.draft_vocab_size}), got {a.topk}")
    id_lists = getattr(a, "prompt_id_lists", None) or []
    prompts = (a.prompt or ([] if id_lists else (trained_pair_prompts() if a.target is None else DEFAULT_PROMPTS)))
    longest = max([len(p.encode("utf-8")) for p in prompts]      # >= its token count (a token is >= 1 byte)
                  + [len(ids) for ids in id_lists])
    extra = num_draft_tokens + a.topk * a.topk * a.steps + a.steps + 2
    cap = longest + a.max_new_tokens + extra
    most = min(tc.max_position_embeddings, dc.max_position_embeddings)
    if cap > most:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens}: prompt (up to {longest} tokens) + new tokens + "
                         f"draft room ({extra}) = {cap} positions exceed the model's max_position_embeddings {most}")
    n = a.batch or (len(prompts) + len(id_lists))
    pages = n * -(-cap // 16) + 1
    kv_head = dc.kv_lora_rank + dc.qk_rope_head_dim if dc.kind == "mla" else 2 * dc.num_key_value_heads * dc.head_dim
    act = 4 if a.backend == "torch" else 2                       # float32 reference math, bf16 kernels
    cache = act * pages * 16 * (tc.num_hidden_layers * tc.kv_cache_dim + kv_head)
    rows = 4 * n * max(num_draft_tokens, 1) * (tc.vocab_size + 3 * tc.hidden_size)
    if a.backend == "torch":                                     # weights dequantized to float32
        weights = 4 * (tc.param_count() + dc.param_count())
    else:                                                        # kept as stored
        weights = sum(f.stat().st_size for d in (tdir, ddir) for f in d.glob("*.safetensors") if f.is_file())
    if getattr(a, "tp", 1) > 1:                                  # tensor parallel: about 1/N of it per rank
        weights //= a.tp
    device = str(getattr(a, "device", None) or "cpu")
    if device != "cpu":
        # caches and weights live on the device: bound by its free memory when it can be asked
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            return
        have = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        have = available_memory_bytes()
    need = weights + 2 * cache + 2 * rows
    if need > have:
        raise ValueError(f"--batch {n} / --max-new-tokens {a.max_new_tokens}: needs about {need / 2 ** 30:.2f} GiB "
                         f"(weights {weights / 2 ** 30:.2f}, KV caches {2 * cache / 2 ** 30:.2f}) but "
                         f"{have / 2 ** 30:.2f} GiB is available on {device}")


def resolve_capture_ids(a: argparse.Namespace, target_cfg: Any, draft_cfg: Any) -> tuple[tuple[int, ...], str]:
    """(target layers to capture, where they came from): --aux-ids if given, else the draft config's
    eagle_aux_hidden_state_layer_ids by the +1-when-first-is-1 rule, else the default (models.config)."""
    override = getattr(a, "aux_ids_list", None)
    ids = draft_cfg.capture_layer_ids(target_cfg.num_hidden_layers, override)
    return ids, draft_cfg.aux_ids_origin(override is not None)


def _json_safe(x: Any) -> Any:
    """Non-finite floats -> None, recursively, so the output is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = _Parser(prog="python -m models.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="target checkpoint dir; its tiktoken.model + tokenizer_config.json are the "
                                     "tokenizer when present (default: the shipped trained tiny pair, "
                                     "models/data/tiny_pair)")
    ap.add_argument("--draft", help="EAGLE-3 draft checkpoint dir (default: the shipped trained tiny draft)")
    ap.add_argument("--steps", type=int, default=3, help="draft steps per verify (chain: k draft tokens; tree: depth)")
    ap.add_argument("--topk", type=int, default=1, help="draft top-k (1 = chain; >1 = tree drafting)")
    ap.add_argument("--draft-tokens", type=int, default=None,
                    help="tokens per verify incl. the root (chain: steps + 1; tree: its size, default "
                         "1 + steps*topk, capped at 8 on the triton backend)")
    ap.add_argument("--temperature", type=_finite_float("--temperature"), default=0.0,
                    help=f"0 = greedy; >= {MIN_TEMPERATURE:g} = sampled acceptance, chain or tree (target "
                         "distribution preserved)")
    ap.add_argument("--top-p", type=_finite_float("--top-p"), default=1.0,
                    help="nucleus of the target distribution when sampling, in (0, 1]")
    ap.add_argument("--backend", choices=("torch", "triton"), default="torch",
                    help="torch: float32 reference math; triton: the kdsl kernels (on the GPU with a cuda "
                         "--device, the interpreter on cpu)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=None, help="number of sequences (prompts are cycled)")
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    ap.add_argument("--prompt-ids", action="append", metavar="ID,ID,...",
                    help="a prompt as comma-separated token ids (repeatable; after the --prompt texts)")
    ap.add_argument("--device", default=None,
                    help="cpu | cuda | cuda:N (default: cuda when a GPU is present, else cpu)")
    ap.add_argument("--graphs", choices=("on", "off"), default=None,
                    help="capture decode/verify/draft steps as CUDA graphs (default: on for cuda, off on cpu)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i draws from its own generator seeded from (seed, i))")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 for tiny models)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    ap.add_argument("--aux-ids", default=None,
                    help="target layers to capture for the draft, e.g. 2,4,5 (taken as given: the residual stream "
                         "entering each layer; repeats allowed); default: the draft config's "
                         "eagle_aux_hidden_state_layer_ids, else (2, N//2, N-3)")
    ap.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                    help="vLLM's spelling: {\"method\": \"eagle3\", \"num_speculative_tokens\": K, \"model\": "
                         "DRAFT_DIR, \"draft_tensor_parallel_size\": 1}; sets --steps (and --draft)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks (launch with `torchrun --nproc-per-node N -m models.generate --tp N`)")
    ap.add_argument("--moe-parallel", choices=("ep", "tp"), default="ep",
                    help="with --tp > 1: routed experts split whole across ranks (ep) or each expert's "
                         "intermediate split (tp)")
    a = ap.parse_args(argv)
    _apply_speculative_config(a)
    _validate_args(ap, a)
    _validate_parallel(ap, a)
    a.prompt_id_lists = [_ids(ap, x) for x in (a.prompt_ids or [])]
    a.device = _device(ap, a.device)
    _rank_device(a)
    if a.graphs is None:
        a.graphs = "on" if a.device.type == "cuda" else "off"
    elif a.graphs == "on" and a.device.type != "cuda":
        ap.error(f"--graphs on needs a cuda device, got --device {a.device}")
    return a


def _ids(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """--prompt-ids value -> token ids (range-checked against the vocab after loading)."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        ap.error(f"--prompt-ids must be comma-separated integers, got {text!r}")
    if not ids:
        ap.error("--prompt-ids must hold at least one id")
    return ids


def _device(ap: argparse.ArgumentParser, name: Optional[str]) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if dev.type not in ("cpu", "cuda"):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {name}: no GPU is visible to torch")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        ap.error(f"--device {name}: only {torch.cuda.device_count()} GPU(s)")
    return dev


def _table(rows: list[tuple[str, str, str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}" for r in rows]
    lines.insert(1, "-" * (sum(w) + 4))
    return "\n".join(lines)


def run(a: argparse.Namespace) -> dict[str, Any]:
    from models.eagle3 import Eagle3Draft
    from models.kimi import KimiModel
    from models.loader import load_draft, load_target
    from models.spec import Engine, SpecParams

    from ops.mla import MAX_Q_LEN
    from models.tokenizer import generation_eos_ids, load_tokenizer

    params = SpecParams(steps=a.steps, topk=a.topk, draft_tokens=a.draft_tokens, temperature=a.temperature,
                        top_p=a.top_p)
    params.validate()                          # bad combinations fail before any loading
    if a.topk > 1 and a.backend == "triton" and params.num_draft_tokens > MAX_Q_LEN:
        if a.draft_tokens is not None:
            raise ValueError(f"--draft-tokens must be <= {MAX_Q_LEN} on the triton backend (tree verify runs in one "
                             f"mla_decode call, q_len <= {MAX_Q_LEN}), got {a.draft_tokens}")
        params.draft_tokens = MAX_Q_LEN
    torch.manual_seed(a.seed)
    if a.target is None:
        tdir, ddir = trained_pair()
    else:
        tdir, ddir = _checkpoint_dir(a.target, "--target"), _checkpoint_dir(a.draft, "--draft")
    _check_model_bounds(a, tdir, ddir, params.num_draft_tokens)
    t0 = time.perf_counter()
    tk, comm = _load_target_ranked(a, tdir)
    dk = load_draft(ddir, tk.config, aux_ids=getattr(a, "aux_ids_list", None))
    capture, aux_src = resolve_capture_ids(a, tk.config, dk.config)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    elif tk.config.hidden_size <= 1024:
        torch.set_num_threads(1)               # tiny model: thread overhead dominates
    target = KimiModel(tk, backend=a.backend, capture_ids=capture, device=a.device, comm=comm)
    draft = Eagle3Draft(dk, target_embed=tk.get("model.embed_tokens.weight"),
                        target_hidden=tk.config.hidden_size, backend=a.backend, device=a.device)
    load_s = time.perf_counter() - t0
    tok = load_tokenizer(tdir, tk.config.vocab_size)
    V = tk.config.vocab_size
    for ids in a.prompt_id_lists:
        bad = [i for i in ids if not 0 <= i < V]
        if bad:
            raise ValueError(f"--prompt-ids: token id {bad[0]} outside the vocab [0, {V})")
    given = [(t, tok.encode(t)) for t in (a.prompt or [])] + [(f"ids:{','.join(map(str, ids))}", ids)
                                                               for ids in a.prompt_id_lists]
    if not given:
        given = [(t, tok.encode(t)) for t in (trained_pair_prompts() if a.target is None else DEFAULT_PROMPTS)]
    n = a.batch or len(given)
    texts = [given[i % len(given)][0] for i in range(n)]
    prompts = [given[i % len(given)][1] for i in range(n)]
    eos = generation_eos_ids(tdir, tok)
    engine = Engine(target, draft, graphs=a.graphs)

    from tqdm import tqdm

    results = {}
    for mode in ("spec", "plain"):
        with tqdm(total=n * a.max_new_tokens, desc=f"{mode} ({a.backend})", unit="tok", file=sys.stderr,
                  leave=False, disable=int(os.environ.get("RANK", "0")) != 0) as bar:
            results[mode] = engine.generate(prompts, a.max_new_tokens, mode, params, eos_id=eos, progress=bar.update,
                                            seed=a.seed)
    spec, plain = results["spec"], results["plain"]
    # greedy: token-for-token identity; sampled: the two runs draw different random streams (the
    # engine preserves the target distribution, tested statistically), so identity is not defined
    lossless = spec.outputs == plain.outputs if a.temperature == 0 else None
    ms, mp = spec.metrics, plain.metrics
    return {
        "lossless": lossless, "backend": a.backend, "device": str(a.device), "graphs": a.graphs, "steps": a.steps, "topk": a.topk,
        "draft_tokens": params.num_draft_tokens, "temperature": a.temperature, "batch": n,
        "tokenizer": tok.kind, "eos_ids": sorted(eos), "aux_ids": list(capture), "aux_ids_source": aux_src,
        "max_new_tokens": a.max_new_tokens, "target": str(tdir), "draft": str(ddir), "load_s": load_s,
        "accept_length": ms.accept_length, "acceptance_rate": ms.acceptance_rate,
        "per_position_acceptance": ms.per_position_acceptance, "accept_histogram": ms.histogram,
        "target_forwards_per_token": ms.target_forwards_per_token,
        "target_forwards_per_token_plain": mp.target_forwards_per_token,
        "tokens_per_s_spec": ms.tokens_per_s, "tokens_per_s_plain": mp.tokens_per_s,
        "tpot_ms_spec": ms.time_per_output_token_ms, "tpot_ms_plain": mp.time_per_output_token_ms,
        "prefill_s_spec": ms.prefill_s, "prefill_s_plain": mp.prefill_s,
        "prompts": texts, "tp": comm.world, "moe_parallel": a.moe_parallel, "collective_bytes": dict(comm.bytes),
        "collective_calls": dict(comm.calls),
        "outputs": [{"prompt": t, "prompt_ids": pi, "spec_ids": s, "plain_ids": p, "spec_text": tok.decode(s),
                     "plain_text": tok.decode(p)} for t, pi, s, p in zip(texts, prompts, spec.outputs, plain.outputs)],
    }


def report(r: dict[str, Any]) -> str:
    out = [f"target {r['target']}", f"draft  {r['draft']}",
           f"backend {r['backend']} on {r['device']} (graphs {r['graphs']}), steps {r['steps']}, topk {r['topk']}, draft tokens {r['draft_tokens']}, "
           f"temperature {r['temperature']}, batch {r['batch']}, max new tokens {r['max_new_tokens']}, "
           f"tokenizer {r['tokenizer']}",
           f"aux ids (target layers captured) {r['aux_ids']}: {r['aux_ids_source']}", ""]
    for o in r["outputs"]:
        same = "" if r["lossless"] is None else "  [same]" if o["spec_ids"] == o["plain_ids"] else "  [DIFFERENT]"
        out.append(f"> {o['prompt']!r}\n  spec : {o['spec_text']!r}\n  plain: {o['plain_text']!r}{same}")
    f = lambda x: f"{x:.3f}"  # noqa: E731
    rows = [("metric", "spec", "plain"),
            ("accept length (tokens/verify)", f(r["accept_length"]), "1.000"),
            ("acceptance rate", f(r["acceptance_rate"]), "-"),
            ("per-position acceptance", " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]), "-"),
            ("accept histogram (0..k)", " ".join(map(str, r["accept_histogram"])), "-"),
            ("target forwards / token", f(r["target_forwards_per_token"]), f(r["target_forwards_per_token_plain"])),
            ("tokens/s (decode)", f"{r['tokens_per_s_spec']:.1f}", f"{r['tokens_per_s_plain']:.1f}"),
            ("time per output token (ms)", f"{r['tpot_ms_spec']:.2f}", f"{r['tpot_ms_plain']:.2f}")]
    ll = ("n/a (sampled: distribution-preserving, outputs differ by random stream)" if r["lossless"] is None
          else str(r["lossless"]).lower())
    out += ["", _table(rows), "", f"lossless (spec == plain greedy): {ll}"]
    return "\n".join(out)


def _one_line(e: BaseException) -> str:
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(e, OSError) and e.filename is not None:
        msg = f"{e.filename}: {e.strerror or e}"
    msg = str(msg).strip().splitlines()[0] if str(msg).strip() else type(e).__name__
    return msg


def trained_pair() -> tuple[Path, Path]:
    """The embedded default: the trained pair shipped with the package (models.train)."""
    from models.train import shipped_pair

    return shipped_pair()


def trained_pair_prompts(n: int = 4) -> list[str]:
    """The first n held-out prompts shipped with the trained pair (code the target never saw)."""
    from models.train import shipped_prompts

    return shipped_prompts()[:n]


_SPEC_KEYS = {"method", "num_speculative_tokens", "model", "draft_tensor_parallel_size"}


def _speculative_config(v: str) -> dict[str, Any]:
    """Parse and check --speculative-config (vLLM's JSON); errors name the field."""
    try:
        d = json.loads(v)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    bad = sorted(set(d) - _SPEC_KEYS)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown field {bad[0]!r} (known: {', '.join(sorted(_SPEC_KEYS))})")
    if d.get("method", "eagle3") not in ("eagle3", "eagle"):
        raise argparse.ArgumentTypeError(f"field 'method' must be \"eagle3\", got {d['method']!r}")
    k = d.get("num_speculative_tokens", 3)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise argparse.ArgumentTypeError(f"field 'num_speculative_tokens' must be an integer >= 1, got {k!r}")
    tp = d.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise argparse.ArgumentTypeError(f"field 'draft_tensor_parallel_size' must be 1 (one process), got {tp!r}")
    if "model" in d and not isinstance(d["model"], str):
        raise argparse.ArgumentTypeError(f"field 'model' must be a draft directory path, got {d['model']!r}")
    return d


def _apply_speculative_config(a: argparse.Namespace) -> None:
    """--speculative-config sets --steps (num_speculative_tokens, a chain of that many drafts) and --draft."""
    d = a.speculative_config
    if not d:
        return
    a.steps = d.get("num_speculative_tokens", a.steps)
    if "model" in d:
        a.draft = d["model"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit 0 (lossless or sampled), 1 (greedy spec != plain), 2 (bad input: one line on stderr)."""
    a = parse_args(argv)
    try:
        r = run(a)
    except NotImplementedError as e:
        print(f"error: not implemented yet: {_one_line(e)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("error: out of memory; lower --batch or --max-new-tokens", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError, RuntimeError) as e:   # config / checkpoint / tokenizer / file errors
        print(f"error: {_one_line(e)}", file=sys.stderr)
        _leave_group()
        return 2
    if int(os.environ.get("RANK", "0")) == 0:          # tensor parallel: only rank 0 prints
        print(json.dumps(_json_safe(r), allow_nan=False) if a.json else report(r))
    _leave_group()
    return 1 if r["lossless"] is False else 0


def _validate_parallel(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """--tp within [1, 1024] and equal to the launched world size; each rank on its own GPU."""
    if not 1 <= a.tp <= 1024:
        ap.error(f"--tp must be in [1, 1024], got {a.tp}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.tp != world:
        ap.error(f"--tp {a.tp} does not match the {world} launched process(es) (launch with "
                 f"`torchrun --nproc-per-node {a.tp} -m models.generate --tp {a.tp}`)")


def _rank_device(a: argparse.Namespace) -> None:
    """Under torchrun with --tp > 1, `--device cuda` means this rank's GPU, cuda:$LOCAL_RANK."""
    if a.tp > 1 and a.device.type == "cuda" and a.device.index is None:
        a.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _load_target_ranked(a: argparse.Namespace, tdir: Path):
    """(checkpoint, models.parallel.Comm): the whole target at --tp 1, else this rank's shard (read as
    slices of the memory maps). A rank that fails names itself and the tensor; every rank then learns
    of it through an all-reduce of an ok flag (the process group has a timeout) and stops."""
    from models.loader import load_sharded, load_target
    from models.parallel import init_from_env

    if a.tp == 1:
        return load_target(tdir), init_from_env(1, a.moe_parallel)
    if a.device.type == "cuda":
        torch.cuda.set_device(a.device)
    comm = init_from_env(a.tp, a.moe_parallel, a.device)
    err, ck = None, None
    try:
        ck = load_sharded(tdir, comm.plan)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        err = f"rank {comm.rank} failed to load its shard: {_one_line(e)}"
    if not comm.all_ok(err is None, a.device):
        raise RuntimeError(err or f"rank {comm.rank}: another rank failed to load its shard; stopping")
    return ck, comm


def _leave_group() -> None:
    """Tear the process group down (torchrun ranks) so every rank exits without a warning or a hang."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
