"""Checkpoint loading: sharded safetensors (+ `model.safetensors.index.json`) for the target and drafts.

- Tensor names are normalized: the target's `language_model.` prefix is stripped (other top-level
  trees, i.e. the vision tower / projector, are skipped), layers >= num_hidden_layers (MTP) are
  skipped; drafts drop a leading `model.` and read `layers.0.` as `midlayer.`.
- The format of every linear is detected from its tensors (models.formats) and the weight is put once
  into the kernels' layout (`QuantLinear`, or a dense tensor). Result keys are `<base>.weight` for
  every weight (quantized or not), plus the plain tensors (biases, `d2t`, ...) under their names.
- Tensors are read through safetensors' memory maps one at a time; each read is a single copy, and
  conversions (fp8 fn -> fnuz, scale folding, optional repack/dtype) are per tensor, so the peak is
  about one copy of the weights (plus one tensor's temporaries). A shard's map is closed as soon as
  all its tensors are read.
- Every expected tensor is checked against the shapes the config implies (errors name the tensor).
- Untrusted input (issue 11.5): the index may only name regular files inside the checkpoint
  directory (no absolute paths or `..`; a symlink is followed, as in the HF hub cache, but must end at
  a regular file); a tensor stored in two shards, or listed in the index but absent from its shard, is
  an error; every safetensors failure is re-raised as a LoadError naming the shard file. Before any
  tensor is read, the config's parameter count must fit the shard bytes (>= 0.5 byte per parameter,
  the int4 minimum), so a config with absurd sizes fails by name instead of exhausting memory.
  Non-finite values: norms, biases, `e_score_correction_bias`, quantization scales and other 1-D float
  tensors are refused (cheap); a non-finite large weight is reported with a warning naming it, checked
  whenever its bytes are read anyway (a move to a GPU, a dtype conversion) or with check_finite="all"
  (on the CPU a weight may stay memory-mapped, unread, until the model uses it).
"""
from __future__ import annotations

import json
import os
import re
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Sequence, Union

import torch
from safetensors import SafetensorError, safe_open

from models.config import (ConfigError, DeepseekV3Config, Eagle3Config, ModelConfig,
                           check_draft_matches_target, load_config)
from models.formats import AUX_SUFFIXES, FormatError, QuantLinear, Weight, build_linear, to_pack
from models.formats import dequantize  # MXFP4 routers

if TYPE_CHECKING:
    from models.parallel import ShardPlan

__all__ = ["Checkpoint", "LoadError", "load_checkpoint", "load_target", "load_draft",
           "expected_shapes", "list_tensors", "stack_experts", "iter_linears", "NonFiniteWeightWarning", "load_sharded"]

LoadError = FormatError   # one error type for bad checkpoints; ConfigError for bad config fields

_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class Checkpoint:
    """A loaded model: its config and weights (`<base>.weight` -> Tensor | QuantLinear, plus plain tensors)."""
    path: Path
    config: ModelConfig
    weights: dict[str, Weight]
    skipped: list[str] = field(default_factory=list)   # stored names not loaded (vision tower, MTP layers)

    def __getitem__(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise LoadError(f"tensor {name!r} is not in checkpoint {self.path}") from None

    def get(self, name: str) -> Optional[Weight]:
        return self.weights.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.weights

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes if isinstance(w, QuantLinear) else w.numel() * w.element_size()
                   for w in self.weights.values())


# ----------------------------------------------------------------------------------------------
# file discovery and name normalization


class NonFiniteWeightWarning(UserWarning):
    """A large dense weight holds NaN or Inf (named in the message); the model may produce garbage."""


_SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError, TypeError, KeyError)
_MAX_INDEX_BYTES = 256 << 20


def _open_shard(p: Path):
    """safe_open with every failure re-raised as a LoadError naming the shard file."""
    try:
        return safe_open(p, "pt")
    except _SAFETENSORS_ERRORS as e:
        raise LoadError(f"shard {p}: not a readable safetensors file ({e})") from None


def _shard_call(p: Path, what: str, fn):
    try:
        return fn()
    except LoadError:
        raise
    except _SAFETENSORS_ERRORS as e:
        raise LoadError(f"shard {p}: cannot read {what} ({e})") from None


def _no_dup_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise LoadError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _shard_path(root: Path, fn: object, idx: Path, name: str) -> Path:
    """The index's file name for tensor `name`, checked: a relative path inside `root` naming a regular
    file (a symlink is followed and must end at one)."""
    if not isinstance(fn, str) or not fn:
        raise LoadError(f"{idx}: weight_map entry for tensor {name!r} must be a file name, got {fn!r}")
    rel = Path(fn)
    if rel.is_absolute() or ".." in rel.parts or fn.startswith("~"):
        raise LoadError(f"{idx}: shard {fn!r} (holding tensor {name!r}) points outside the checkpoint directory")
    p = root / rel
    try:
        st = os.stat(p)
    except OSError:
        raise LoadError(f"{idx}: shard {fn!r} (holding tensor {name!r}) does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise LoadError(f"{idx}: shard {fn!r} (holding tensor {name!r}) is not a regular file")
    return p


def _shard_map(root: Path) -> dict[str, Path]:
    """stored tensor name -> shard file, from the index when present, else every *.safetensors; a name
    in two shards (or an index entry its shard lacks) is an error naming both files."""
    if not root.is_dir():
        raise LoadError(f"{root}: not a checkpoint directory")
    idx = root / "model.safetensors.index.json"
    if idx.exists() or idx.is_symlink():
        if not idx.is_file():
            raise LoadError(f"{idx}: not a regular file")
        try:
            if idx.stat().st_size > _MAX_INDEX_BYTES:
                raise LoadError(f"{idx}: larger than {_MAX_INDEX_BYTES >> 20} MiB; not a safetensors index")
            with open(idx, "rb") as f:
                doc = json.loads(f.read(), object_pairs_hook=_no_dup_keys)
        except LoadError as e:
            raise LoadError(f"{idx}: {e}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise LoadError(f"{idx}: not a readable JSON index ({e})") from None
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise LoadError(f"{idx}: field 'weight_map' is missing")
        out = {str(name): _shard_path(root, fn, idx, str(name)) for name, fn in wm.items()}
        by_file: dict[Path, list[str]] = {}
        for n, p in out.items():
            by_file.setdefault(p, []).append(n)
        seen: dict[str, Path] = {}
        for p in sorted(by_file):
            keys = set(_shard_call(p, "its header", lambda p=p: list(_open_shard(p).keys())))
            for n in by_file[p]:
                if n not in keys:
                    raise LoadError(f"{idx}: tensor {n!r} is mapped to shard {p.name!r}, which does not hold it")
            for k in keys:
                if k in seen:
                    raise LoadError(f"tensor {k!r} is stored in two shards: {seen[k].name!r} and {p.name!r}")
                seen[k] = p
        return out
    files = sorted(f for f in root.glob("*.safetensors") if f.is_file())
    if not files:
        raise LoadError(f"no *.safetensors files (and no model.safetensors.index.json) in {root}")
    out = {}
    for p in files:
        for k in _shard_call(p, "its header", lambda p=p: list(_open_shard(p).keys())):
            if k in out:
                raise LoadError(f"tensor {k!r} is stored in two shards: {out[k].name!r} and {p.name!r} "
                                "(a stale shard from an earlier write?)")
            out[k] = p
    return out


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _normalize_target(name: str, cfg: DeepseekV3Config, has_lm_prefix: bool) -> Optional[str]:
    if has_lm_prefix:
        if not name.startswith("language_model."):
            return None          # vision tower, projector, ...
        name = name[len("language_model."):]
    m = _LAYER_RE.match(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        return None              # MTP / next-n layers
    return name


def _normalize_draft(name: str) -> Optional[str]:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    elif name.startswith("layers."):
        return None
    return name


def list_tensors(path: Union[str, Path]) -> dict[str, tuple[str, list[int]]]:
    """Stored name -> (safetensors dtype string, shape), read from headers only (no data)."""
    root = Path(path)
    out: dict[str, tuple[str, list[int]]] = {}
    by_file: dict[Path, list[str]] = {}
    for n, p in _shard_map(root).items():
        by_file.setdefault(p, []).append(n)
    for p, names in by_file.items():
        def read(p: Path = p, names: list[str] = names) -> None:
            f = _open_shard(p)
            for n in names:
                s = f.get_slice(n)
                out[n] = (s.get_dtype(), list(s.get_shape()))
        _shard_call(p, "tensor headers", read)
    return out


# ----------------------------------------------------------------------------------------------
# expected tensors


def expected_shapes(cfg: ModelConfig) -> dict[str, Optional[tuple[int, ...]]]:
    """Logical shape of every tensor the model needs (linears as [out, in]); None marks optional names
    whose shape is checked elsewhere. Built from the config only: nothing is hard-coded."""
    if isinstance(cfg, DeepseekV3Config):
        return _target_shapes(cfg)
    return _draft_shapes(cfg)


def _mla_shapes(p: str, h_in: int, h_out: int, heads: int, q_lora: Optional[int], kv_lora: int,
                nope: int, rope: int, v: int) -> dict[str, tuple[int, ...]]:
    s: dict[str, tuple[int, ...]] = {}
    if q_lora:
        s[p + "q_a_proj.weight"] = (q_lora, h_in)
        s[p + "q_a_layernorm.weight"] = (q_lora,)
        s[p + "q_b_proj.weight"] = (heads * (nope + rope), q_lora)
    else:
        s[p + "q_proj.weight"] = (heads * (nope + rope), h_in)
    s[p + "kv_a_proj_with_mqa.weight"] = (kv_lora + rope, h_in)
    s[p + "kv_a_layernorm.weight"] = (kv_lora,)
    s[p + "kv_b_proj.weight"] = (heads * (nope + v), kv_lora)
    s[p + "o_proj.weight"] = (h_out, heads * v)
    return s


def _mlp_shapes(p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h), p + "down_proj.weight": (h, inter)}


def _target_shapes(c: DeepseekV3Config) -> dict[str, Optional[tuple[int, ...]]]:
    H, V = c.hidden_size, c.vocab_size
    s: dict[str, Optional[tuple[int, ...]]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (V, H)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        s.update(_mla_shapes(p + "self_attn.", H, H, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank,
                             c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim))
        if c.is_moe_layer(i):
            E = c.n_routed_experts
            s[p + "mlp.gate.weight"] = (E, H)
            if c.topk_method == "noaux_tc":
                s[p + "mlp.gate.e_score_correction_bias"] = (E,)
            if c.n_shared_experts:
                s.update(_mlp_shapes(p + "mlp.shared_experts.", H, c.moe_intermediate_size * c.n_shared_experts))
            for e in range(E):
                s.update(_mlp_shapes(f"{p}mlp.experts.{e}.", H, c.moe_intermediate_size))
        else:
            s.update(_mlp_shapes(p + "mlp.", H, c.intermediate_size))
    return s


def _draft_shapes(c: Eagle3Config) -> dict[str, Optional[tuple[int, ...]]]:
    H, V = c.hidden_size, c.vocab_size
    s: dict[str, Optional[tuple[int, ...]]] = {
        "fc.weight": (H, 3 * c.target_hidden_size), "norm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
    }
    if not c.tie_word_embeddings:
        s["lm_head.weight"] = (c.draft_vocab_size, H)
    if c.draft_vocab_size != V:
        s["d2t"] = (c.draft_vocab_size,)
    p = "midlayer.self_attn."
    if c.kind == "mla":
        s.update(_mla_shapes(p, 2 * H, H, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank,  # type: ignore[arg-type]
                             c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim))  # type: ignore[arg-type]
    else:
        hd = c.head_dim
        s[p + "q_proj.weight"] = (c.num_attention_heads * hd, 2 * H)
        s[p + "k_proj.weight"] = (c.num_key_value_heads * hd, 2 * H)
        s[p + "v_proj.weight"] = (c.num_key_value_heads * hd, 2 * H)
        s[p + "o_proj.weight"] = (H, c.num_attention_heads * hd)
    s.update(_mlp_shapes("midlayer.mlp.", H, c.intermediate_size))
    return s


_DRAFT_OPTIONAL = {"embed_tokens.weight": "(V, H)", "t2d": "(V,)"}


def _logical_shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape) if isinstance(w, QuantLinear) else tuple(w.shape)


def _validate(cfg: ModelConfig, weights: dict[str, Weight]) -> None:
    for name, shape in expected_shapes(cfg).items():
        if name not in weights:
            raise LoadError(f"tensor {name!r} is missing from the checkpoint (needed by the config)")
        got = _logical_shape(weights[name])
        if shape is not None and got != shape:
            raise LoadError(f"tensor {name!r} has wrong shape {list(got)}; the config implies {list(shape)}")
    if isinstance(cfg, Eagle3Config):
        if "embed_tokens.weight" in weights:
            got = _logical_shape(weights["embed_tokens.weight"])
            if got != (cfg.vocab_size, cfg.hidden_size):
                raise LoadError(f"tensor 'embed_tokens.weight' has wrong shape {list(got)}; the config implies "
                                f"{[cfg.vocab_size, cfg.hidden_size]}")
        if "d2t" in weights:
            d2t = weights["d2t"]
            assert isinstance(d2t, torch.Tensor)
            if d2t.dtype.is_floating_point or tuple(d2t.shape) != (cfg.draft_vocab_size,):
                raise LoadError(f"tensor 'd2t' must be integer [{cfg.draft_vocab_size}], got {d2t.dtype} "
                                f"{list(d2t.shape)}")
            tgt = torch.arange(cfg.draft_vocab_size) + d2t.long()
            if bool(((tgt < 0) | (tgt >= cfg.vocab_size)).any()):
                raise LoadError(f"tensor 'd2t' maps draft ids outside the target vocab [0, {cfg.vocab_size})")


# ----------------------------------------------------------------------------------------------
# loading


class _Shards:
    """Open safetensors memory maps lazily; close a shard once all its wanted tensors were read."""

    def __init__(self, where: dict[str, tuple[Path, str]]):
        self.where = where                     # normalized name -> (file, stored name)
        self.left: dict[Path, int] = {}
        for p, _ in where.values():
            self.left[p] = self.left.get(p, 0) + 1
        self.open: dict[Path, object] = {}
        self.dtypes: dict[str, torch.dtype] = {}

    def _handle(self, p: Path):
        h = self.open.get(p)
        if h is None:
            h = self.open[p] = _open_shard(p)
        return h

    def present(self, name: str) -> bool:
        return name in self.where

    def dtype_of(self, name: str) -> torch.dtype:
        if name not in self.dtypes:
            p, stored = self.where[name]
            s = _shard_call(p, f"tensor {stored!r}", lambda: self._handle(p).get_slice(stored).get_dtype())
            if s not in _ST_DTYPES:
                raise LoadError(f"tensor {name!r}: unsupported safetensors dtype {s}")
            self.dtypes[name] = _ST_DTYPES[s]
        return self.dtypes[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise LoadError(f"tensor {name!r} is missing")
        p, stored = self.where[name]
        t = _shard_call(p, f"tensor {stored!r}", lambda: self._handle(p).get_tensor(stored))
        self.left[p] -= 1
        if self.left[p] == 0:
            self.open.pop(p, None)             # drop the map (its pages) as soon as the shard is done
        return t


def _fp8_nan(t: torch.Tensor) -> torch.Tensor:
    """NaN codes by bits (no float copy): e4m3fn 0x7f / 0xff, e4m3fnuz 0x80."""
    b = t.view(torch.uint8)
    return b == 0x80 if t.dtype == torch.float8_e4m3fnuz else (b & 0x7F) == 0x7F


def _all_finite(t: torch.Tensor, chunk: int = 1 << 18) -> bool:
    """isfinite over bounded chunks, so the check's temporaries stay small next to the weights."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(c).all()) for c in flat.split(chunk))


_SMALL_SUFFIXES = ("norm.weight", "layernorm.weight", ".bias", "e_score_correction_bias")


def _check_finite(name: str, w: Weight, large: bool) -> None:
    """Refuse non-finite norms, biases, routing biases, quantization scales and other 1-D float tensors
    (cheap: always); with `large`, warn, naming the tensor, for a non-finite dense 2-D (or larger) weight."""
    if isinstance(w, QuantLinear):
        for what, t in (("scale", w.scale), ("input_scale", w.input_scale)):
            if t is not None and t.dtype.is_floating_point and not _all_finite(t):
                raise LoadError(f"tensor {name!r}: its quantization {what} holds NaN or Inf")
        if large and w.kind == "fp8" and any(bool(_fp8_nan(c).any()) for c in w.packed.reshape(-1).split(1 << 20)):
            warnings.warn(f"tensor {name!r}: fp8 weight holds NaN", NonFiniteWeightWarning, stacklevel=3)
        return
    if not w.dtype.is_floating_point or w.numel() == 0:
        return
    small = w.dim() <= 1 or name.endswith(_SMALL_SUFFIXES)
    if not (small or large) or _all_finite(w):
        return
    if small:
        raise LoadError(f"tensor {name!r} holds NaN or Inf (a norm, bias or scale must be finite)")
    warnings.warn(f"tensor {name!r} holds NaN or Inf", NonFiniteWeightWarning, stacklevel=3)


_FINITE_MODES = {False: "off", True: "all", "off": "off", "auto": "auto", "all": "all"}


def _check_budget(root: Path, cfg: ModelConfig, stored: dict[str, Path]) -> None:
    """The config's parameter count must fit the bytes the shards hold (>= 0.5 byte per parameter, the
    int4 minimum); otherwise a size field is wrong, and is refused before anything is allocated."""
    files = set(stored.values())
    total = sum(p.stat().st_size for p in files)
    n = cfg.param_count()
    if n // 2 > total:
        raise LoadError(f"{root}: config.json implies {n:,} parameters (at least {n // 2:,} bytes) but the "
                        f"shards hold {total:,} bytes; a size field (num_hidden_layers, hidden_size, "
                        "n_routed_experts, vocab_size, ...) does not match the checkpoint")


def load_checkpoint(path: Union[str, Path], *, arch: Optional[str] = None, dtype: Optional[torch.dtype] = None,
                    int4_pack: Optional[str] = None, device: Union[str, torch.device] = "cpu",
                    validate: bool = True, check_finite: Union[bool, str] = "auto",
                    shard: Optional["ShardPlan"] = None) -> Checkpoint:
    """Load a target or draft checkpoint directory (family from its config.json).

    arch: target GPU arch ("gfx942" converts fp8 weights to e4m3fnuz with doubled scales); None/"cpu"
    keeps e4m3fn. dtype: convert bf16/f16 tensors by value (f32 tensors such as the routing bias stay
    f32). int4_pack: repack int4 words to this packing (None keeps the stored one). device: each weight
    is moved there right after it is built (host peak stays ~ one tensor when loading to a GPU).
    check_finite: "auto" (default) refuses non-finite norms / biases / scales and warns for a non-finite
    large weight whenever its bytes are read anyway (moved to another device, or converted by `dtype`);
    "all" (or True) also reads the large weights that would stay memory-mapped on the CPU (their pages
    then count in the process's resident memory); "off" (or False) checks nothing.
    shard: a models.parallel.ShardPlan: read only this rank's slice of each tensor (load_sharded).
    """
    if check_finite not in _FINITE_MODES:
        raise ValueError(f"check_finite must be 'off', 'auto' or 'all', got {check_finite!r}")
    finite = _FINITE_MODES[check_finite]
    off_host = torch.device(device).type != "cpu"
    root = Path(path)
    cfg = load_config(root)
    stored = _shard_map(root)
    _check_budget(root, cfg, stored)
    where: dict[str, tuple[Path, str]] = {}
    skipped: list[str] = []
    if isinstance(cfg, DeepseekV3Config):
        has_lm = cfg.tensor_prefix == "language_model." or any(n.startswith("language_model.") for n in stored)
        norm = lambda n: _normalize_target(n, cfg, has_lm)  # noqa: E731
    else:
        norm = _normalize_draft
    for n, p in stored.items():
        m = norm(n)
        if m is None:
            skipped.append(n)
            continue
        if m in where:
            raise LoadError(f"tensor {m!r} appears twice (stored as {where[m][1]!r} and {n!r})")
        if shard is not None and not shard.keeps(m, getattr(cfg, "n_routed_experts", 0)):
            continue                           # another rank's expert: never read
        where[m] = (p, n)

    sh = _Shards(where) if shard is None else _SlicedShards(where, shard)
    q = cfg.quantization
    qm = q.method if q else None
    qpack = q.int4_pack if q else None
    weights: dict[str, Weight] = {}
    done: set[str] = set()

    # order by shard so each map is closed early
    names = sorted(where, key=lambda n: (str(where[n][0]), n))
    bases = []
    for n in names:
        if n.endswith(".weight_packed"):
            bases.append(n[: -len(".weight_packed")])
        elif n.endswith(".weight"):
            bases.append(n[: -len(".weight")])
    for b in bases:
        if b + ".weight" in weights:
            continue
        w, used = build_linear(b, sh.get, sh.present, sh.dtype_of, qm, qpack, arch=arch, int4_pack=int4_pack)
        w = _router_dense(b, w)
        conv = isinstance(w, torch.Tensor) and dtype is not None and w.dtype in (torch.bfloat16, torch.float16)
        if conv:
            w = w.to(dtype)
        if finite != "off":
            _check_finite(b + ".weight", w, finite == "all" or off_host or conv)
        weights[b + ".weight"] = w.to(device)
        done.update(used)
    for n in names:
        if n in done or n.rsplit(".", 1)[-1] in AUX_SUFFIXES:
            if n not in done and n.rsplit(".", 1)[0] + ".weight" not in weights:
                raise LoadError(f"tensor {n!r} has no matching weight")
            continue
        t = sh.get(n)
        conv = dtype is not None and t.dtype in (torch.bfloat16, torch.float16)
        if conv:
            t = t.to(dtype)
        if finite != "off":
            _check_finite(n, t, finite == "all" or off_host or conv)
        weights[n] = t.to(device)
    ck = Checkpoint(root, cfg, weights, skipped)
    if shard is not None:
        ck.shard, ck.bytes_read, ck.read_log = shard, sh.bytes_read, sh.read_log  # type: ignore[attr-defined]
        if validate:
            _validate_sharded(cfg, weights, shard)
    elif validate:
        _validate(cfg, weights)
    return ck


def load_target(path: Union[str, Path], **kw) -> Checkpoint:
    """Load a Kimi-K2.5 / DeepSeek-V3 checkpoint (error if the directory holds a draft)."""
    ck = load_checkpoint(path, **kw)
    if not isinstance(ck.config, DeepseekV3Config):
        raise ConfigError(f"{path}: config 'architectures' names a draft ({ck.config.architecture}), not a target")
    return ck


def load_draft(path: Union[str, Path], target: Optional[DeepseekV3Config] = None,
               aux_ids: Optional[Sequence[int]] = None, **kw) -> Checkpoint:
    """Load an EAGLE-3 draft; with `target`, check hidden size (fc input = 3 x target hidden), vocab and
    aux layer ids (`aux_ids` if given, e.g. --aux-ids, else the config's) against it (errors name the
    field or tensor)."""
    cfg = load_config(path)
    if not isinstance(cfg, Eagle3Config):
        raise ConfigError(f"{path}: config 'architectures' does not name an EAGLE-3 draft")
    if target is not None:
        check_draft_matches_target(cfg, target, aux_ids)
    ck = load_checkpoint(path, **kw)
    if target is not None:
        fc = ck["fc.weight"]
        if _logical_shape(fc)[1] != 3 * target.hidden_size:
            raise LoadError(f"tensor 'fc.weight' has input width {_logical_shape(fc)[1]}; the target's "
                            f"hidden_size {target.hidden_size} needs 3 x {target.hidden_size}")
        if "embed_tokens.weight" in ck and _logical_shape(ck["embed_tokens.weight"])[0] != target.vocab_size:
            raise LoadError("tensor 'embed_tokens.weight' rows do not match the target 'vocab_size' "
                            f"{target.vocab_size}")
    return ck


def iter_linears(ck: Checkpoint) -> Iterable[tuple[str, Weight]]:
    """(name, weight) for every 2-D weight (dense or quantized)."""
    for n, w in ck.weights.items():
        if isinstance(w, QuantLinear) or (n.endswith(".weight") and w.dim() == 2):
            yield n, w


_MOE_FMT = {"compressed-tensors": ("w4a16", "ct_reorder"), "quark-w4a8": ("w4a8", "quark_reorder"),
            "quark-int4": ("w4a8", "quark_reorder")}


def stack_experts(ck: Checkpoint, layer: int, pop: bool = True, experts: Optional[range] = None) -> dict[str, object]:
    """Stack layer `layer`'s routed experts into the fused-MoE layout (ops.moe.MoEWeights fields):
    {"fmt", "w13" [E, 2I, K'] (gate rows then up rows), "s13", "w2" [E, H, I'], "s2"}.

    fmt "w4a16": compressed-tensors int4 repacked to "ct_reorder" (the kernels' nibble order), bf16
    group scales [E, N, K/32];
    fmt "w4a8": Quark int4 per-channel, repacked to "quark_reorder" if stored otherwise, f32 [E, N];
    fmt "bf16": dense experts converted to bf16. With pop=True the per-expert entries leave
    `ck.weights` as they are copied, so the extra memory is about one layer's experts.
    Use as `MoEWeights(**stack_experts(ck, i))`. experts: the expert ids to stack (default all; an
    expert-parallel rank stacks its own block, stacked index = id - experts.start).
    """
    cfg = ck.config
    if not isinstance(cfg, DeepseekV3Config) or not cfg.is_moe_layer(layer):
        raise LoadError(f"layer {layer} is not a MoE layer of this checkpoint")
    p = f"model.layers.{layer}.mlp.experts."
    ids = experts if experts is not None else range(cfg.n_routed_experts)
    E = len(ids)
    first = ck[f"{p}{ids[0]}.gate_proj.weight"]
    if isinstance(first, QuantLinear) and first.kind == "mxfp4":
        return _stack_experts_mxfp4(ck, layer, pop, ids)
    if isinstance(first, QuantLinear):
        if first.kind != "int4" or first.source not in _MOE_FMT:
            raise LoadError(f"tensor '{p}0.gate_proj.weight': {first.source} experts have no fused-MoE format")
        fmt, pack = _MOE_FMT[first.source]
    else:
        fmt, pack = "bf16", None

    def take(name: str) -> Weight:
        w = ck.weights.pop(name) if pop else ck[name]
        if w is None:
            raise LoadError(f"tensor {name!r} is missing")
        if fmt == "bf16":
            if isinstance(w, QuantLinear):
                raise LoadError(f"tensor {name!r} is quantized but expert 0 is dense")
            return w.to(torch.bfloat16)
        if not isinstance(w, QuantLinear) or _MOE_FMT.get(w.source, (None,))[0] != fmt:
            raise LoadError(f"tensor {name!r} is not in the same format as expert 0 ({fmt})")
        return to_pack(w, pack) if w.pack != pack else w

    out: dict[str, object] = {"fmt": fmt}
    for key, parts in (("13", ("gate_proj", "up_proj")), ("2", ("down_proj",))):
        ws, ss = None, None
        for e, eid in enumerate(ids):
            rows = [take(f"{p}{eid}.{nm}.weight") for nm in parts]
            if fmt == "bf16":
                t = torch.cat(rows, 0) if len(rows) > 1 else rows[0]
                if ws is None:
                    ws = torch.empty((E, *t.shape), dtype=torch.bfloat16, device=t.device)
                ws[e] = t
            else:
                t = torch.cat([r.packed for r in rows], 0) if len(rows) > 1 else rows[0].packed
                s = torch.cat([r.scale for r in rows], 0) if len(rows) > 1 else rows[0].scale
                if ws is None:
                    ws = torch.empty((E, *t.shape), dtype=t.dtype, device=t.device)
                    ss = torch.empty((E, *s.shape), dtype=s.dtype, device=s.device)
                if tuple(t.shape) != tuple(ws.shape[1:]) or tuple(s.shape) != tuple(ss.shape[1:]):
                    raise LoadError(f"tensor '{p}{eid}.{parts[0]}.weight' has a different shape from expert 0")
                ws[e] = t
                ss[e] = s
            del rows
        out["w" + key] = ws
        out["s" + key] = ss
    return out


# ----------------------------------------------------------------------------------------------
# MXFP4 (Quark OCP MX, as in amd/Kimi-K2.5-MXFP4)

def _router_dense(base: str, w: Weight) -> Weight:
    """An MXFP4 router (`mlp.gate`, quantized in AMD's MXFP4 recipe per its model cards; UNCONFIRMED)
    becomes its exact values in bf16: e2m1 x 2^k has at most two significant bits and f32's exponent
    range, which bf16 shares, so routing sees the checkpoint's weights unchanged."""
    if isinstance(w, QuantLinear) and w.kind == "mxfp4" and base.endswith(".mlp.gate"):
        return dequantize(w, torch.bfloat16)
    return w


def mxfp4_activation(cfg: DeepseekV3Config) -> tuple[str, str]:
    """(act, rule) of a Quark MXFP4 checkpoint from `global_quant_config.input_tensors`:
    fp4 per_group dynamic -> ("mxfp4", its scale_calculation_mode, default "even") (W4A4);
    fp8_e4m3 per_tensor static -> ("fp8", "even") (W4A8, `input_scale` tensors); none -> ("bf16", "even")."""
    raw = dict(cfg.quantization.raw) if cfg.quantization is not None else {}
    g = raw.get("global_quant_config") or {}
    where = "quantization_config.global_quant_config.input_tensors"
    inp = g.get("input_tensors")
    if isinstance(inp, list):
        if len(inp) != 1:
            raise LoadError(f"config field {where!r}: MXFP4 experts take one activation spec, got {len(inp)}")
        inp = inp[0]
    if inp is None:
        return "bf16", "even"
    if not isinstance(inp, dict):
        raise LoadError(f"config field {where!r} must be an object or null")
    dt = inp.get("dtype")
    if dt == "fp4":
        rule = inp.get("scale_calculation_mode") or "even"
        if rule not in ("even", "floor") or not inp.get("is_dynamic", True) or inp.get("group_size", 32) != 32:
            raise LoadError(f"config field {where!r}: MXFP4 activations must be dynamic per 32 with "
                            f"scale_calculation_mode even|floor, got {inp}")
        return "mxfp4", rule
    if dt == "fp8_e4m3":
        if inp.get("is_dynamic") or inp.get("qscheme") != "per_tensor":
            raise LoadError(f"config field {where!r}: fp8 activations of MXFP4 experts must be static per_tensor")
        return "fp8", "even"
    raise LoadError(f"config field {where + '.dtype'!r}: unsupported activation dtype {dt!r} for MXFP4 experts "
                    "(fp4, fp8_e4m3 or null)")


def _stack_experts_mxfp4(ck: Checkpoint, layer: int, pop: bool, ids: Optional[range] = None) -> dict[str, object]:
    """MXFP4 experts in the fused-MoE layout (ops.mxfp4.MXFP4Weights fields): {"fmt": "mxfp4",
    "w13" uint8 [E, 2I, H/2], "s13" uint8 [E, 2I, H/32], "w2" uint8 [E, H, I/2], "s2" uint8 [E, H, I/32],
    "act", "act_rule", "a13_scale", "a2_scale"}. The W4A8-FP8 activation scales are per expert in the
    checkpoint; the fused kernels take one per stage: the max over experts (gate and up together), as
    vLLM's fused MoE does for static fp8 input scales (UNCONFIRMED for this scheme)."""
    cfg = ck.config
    p = f"model.layers.{layer}.mlp.experts."
    ids = ids if ids is not None else range(cfg.n_routed_experts)   # this rank's experts (EP)
    act, rule = mxfp4_activation(cfg)
    out: dict[str, object] = {"fmt": "mxfp4", "act": act, "act_rule": rule, "a13_scale": None, "a2_scale": None}
    for key, parts in (("13", ("gate_proj", "up_proj")), ("2", ("down_proj",))):
        ws = ss = None
        amax = None
        for j, e in enumerate(ids):
            rows = []
            for nm in parts:
                name = f"{p}{e}.{nm}.weight"
                w = ck.weights.pop(name, None) if pop else ck.get(name)
                if w is None:
                    raise LoadError(f"tensor {name!r} is missing")
                if not isinstance(w, QuantLinear) or w.kind != "mxfp4":
                    raise LoadError(f"tensor {name!r} is not MXFP4 like expert 0")
                if act == "fp8":
                    if w.input_scale is None:
                        raise LoadError(f"tensor {name[:-len('weight')] + 'input_scale'!r} is missing "
                                        "(static fp8 activations of the W4A8 scheme)")
                    amax = w.input_scale.reshape(()) if amax is None else torch.maximum(amax, w.input_scale.reshape(()))
                rows.append(w)
            t = torch.cat([r.packed for r in rows], 0)
            sc = torch.cat([r.scale for r in rows], 0)
            if ws is None:
                ws = torch.empty((len(ids), *t.shape), dtype=torch.uint8, device=t.device)
                ss = torch.empty((len(ids), *sc.shape), dtype=torch.uint8, device=sc.device)
            if tuple(t.shape) != tuple(ws.shape[1:]) or tuple(sc.shape) != tuple(ss.shape[1:]):
                raise LoadError(f"tensor '{p}{e}.{parts[0]}.weight' has a different shape from expert 0")
            ws[j], ss[j] = t, sc
        out["w" + key], out["s" + key] = ws, ss
        if act == "fp8":
            out["a" + key + "_scale"] = amax.float().reshape(1)
    return out


# sharded loading (tensor / expert parallel ranks)


class _SlicedShards(_Shards):
    """_Shards that read, for each tensor the plan splits, only this rank's contiguous 1/N slice along
    the split dim (safetensors get_slice on the memory map: the other ranks' bytes are never touched).
    Tensors without that dim, or of size 1 along it (per-channel and scalar scales of a row split),
    are read whole. `bytes_read` sums the bytes of every tensor or slice read."""

    def __init__(self, where: dict[str, tuple[Path, str]], plan: "ShardPlan"):
        super().__init__(where)
        self.plan = plan
        self.bytes_read = 0
        self.read_log: dict[str, int] = {}      # normalized name -> bytes read

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise LoadError(f"tensor {name!r} is missing")
        p, stored = self.where[name]
        dim = self.plan.split_dim(name)
        N, r = self.plan.world, self.plan.rank

        def read():
            s = self._handle(p).get_slice(stored)
            shape = s.get_shape()
            if dim is None or dim >= len(shape) or shape[dim] <= 1 or name.endswith(".weight_shape"):
                return self._handle(p).get_tensor(stored)
            if shape[dim] % N:
                raise LoadError(f"tensor {name!r}: dim {dim} of size {shape[dim]} is not divisible by the "
                                f"world size {N}")
            n = shape[dim] // N
            return s[r * n:(r + 1) * n] if dim == 0 else s[:, r * n:(r + 1) * n]

        t = _shard_call(p, f"tensor {stored!r}", read)
        if dim is not None and name.endswith(".weight_shape"):
            t = t.clone()
            t[dim] = t[dim] // N                  # the logical shape of this rank's slice
        self.bytes_read += t.numel() * t.element_size()
        self.read_log[name] = t.numel() * t.element_size()
        self.left[p] -= 1
        if self.left[p] == 0:
            self.open.pop(p, None)
        return t


def _validate_sharded(cfg: ModelConfig, weights: dict[str, Weight], plan: "ShardPlan") -> None:
    """_validate against this rank's shapes (split dims divided by the world size, other ranks'
    experts absent)."""
    E = getattr(cfg, "n_routed_experts", 0)
    for name, shape in expected_shapes(cfg).items():
        if not plan.keeps(name, E):
            continue
        if name not in weights:
            raise LoadError(f"tensor {name!r} is missing from the checkpoint (needed by the config)")
        d = plan.split_dim(name)
        if shape is not None and d is not None and d < len(shape):
            shape = tuple(x // plan.world if i == d else x for i, x in enumerate(shape))
        got = _logical_shape(weights[name])
        if shape is not None and got != shape:
            raise LoadError(f"tensor {name!r} has wrong shape {list(got)} on rank {plan.rank}; the config "
                            f"implies {list(shape)}")


def load_sharded(path: Union[str, Path], plan: "ShardPlan", **kw) -> Checkpoint:
    """Load this rank's shard of a target checkpoint (models.parallel.ShardPlan): every tensor the plan
    splits is read as a slice of the memory map; `ck.bytes_read` tells how many bytes were read."""
    plan.check(load_config(Path(path)))
    ck = load_checkpoint(path, shard=plan, **kw)
    if not isinstance(ck.config, DeepseekV3Config):
        raise ConfigError(f"{path}: config 'architectures' names a draft ({ck.config.architecture}), not a target")
    return ck
