"""lm-eval `--model_args` for the `lacache_jax` model: parsed, typed and validated.

Every `GenerationConfig` field is a model arg of the same name, read from its type hint, so a
field added to `GenerationConfig` becomes an arg with no change here. A field holding a
config dataclass (`dpad: DPadConfig | None`, Flash-dLLM's `flash: FlashConfig | None`) takes
its own fields as `<field>_<name>` (`dpad_window=64`), and `<field>=true|false` switches it
on with defaults or off; `dpad=gaussian|uniform` also picks DPad's strategy.
The evaluation's own args are in `EVAL_ARGS`. The reference harness's names (LLaDA's and
Fast-dLLM's `eval_llada.py`, model `llada_dist`) are accepted for the same settings
(`REFERENCE_NAMES`; `use_cache=true[,dual_cache=true]` is `cache=prefix|dual`), so its
`--model_args` carry over. Unlike `GenerationConfig`, `steps` defaults to the args'
`gen_length` and `stop_at_eos` to false here (without `flash`): the reference decodes the whole canvas and keeps text after an EOS, which
an early stop would replace by EOS (`stop_at_eos=true` is faster and changes only text after
a block holding an EOS). With `flash` it stays true: Flash-dLLM's predicted length (REFERENCE.md
§8) is part of its decoder. Values may be strings (the command line), or
Python values; lm-eval has already turned `none` into None, so a string field reads None as
"none" (`cache=none`). Every bad value raises ValueError naming the arg.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from lacache_jax.config import WEIGHT_DTYPES, GenerationConfig

# name -> (type, default, help); types: int, float, bool, str, or "int?"-style optional.
EVAL_ARGS: dict[str, tuple[str, Any, str]] = {
    "checkpoint": ("str?", None, "directory written by `python -m convert`"),
    "dtype": ("str?", None, "weights' dtype on load: bfloat16 | float32 (default: as stored)"),
    "batch_size": ("int", 32, "rows per forward pass: prompts (generation), samples (ELBO)"),
    "slots": ("int?", None, "slot refill: rows in flight for generate_until (default: "
                             "ragged batches of batch_size)"),
    "mc_num": ("int", 128, "Monte-Carlo samples per loglikelihood request"),
    "mc_batch": ("int?", None, "samples sharing one stratified draw of mask counts; "
                 "divides mc_num (default: batch_size, the reference's, or the largest "
                 "divisor of mc_num below it)"),
    "check_greedy": ("bool", True, "compute is_greedy (one forward per continuation token)"),
    "chat": ("bool", False, "wrap each context as one user turn of the chat template"),
    "seed": ("int", 0, "seed of the mask draws and of sampling at temperature > 0"),
    "max_length": ("int?", None, "most tokens of a context and its continuation or "
                   "generation (default, and at most: the model's max_sequence_length)"),
    "show_speed": ("bool", False, "after generate_until, log the tokens generated (up to "
                   "each row's first EOS), seconds, tokens/s and NFE"),
    "save_dir": ("str?", None, "append each generate_until answer to "
                 "SAVE_DIR/rank_<rank>.jsonl as it is made; a rerun reuses those of the same "
                 "request and settings (resume)"),
}
# Names of DPad's eval_llada.py whose meaning differs from ours: refused with a pointer.
DPAD_NAMES = ("dropout", "sigma", "scale", "window", "preserved_tokens", "early_termination",
              "from_scratch")
# Harness-level settings lm-eval passes to every model; read or ignored, never an error.
HARNESS_ARGS = ("max_batch_size", "device")
# The reference harness's name -> ours (model_path must be a converted checkpoint here).
REFERENCE_NAMES = {"model_path": "checkpoint", "is_check_greedy": "check_greedy",
                   "cfg": "cfg_scale"}


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    gen: GenerationConfig   # every generate_until request's settings
    checkpoint: str | None
    dtype: str | None
    batch_size: int
    slots: int | None
    mc_num: int
    mc_batch: int
    check_greedy: bool
    chat: bool
    seed: int
    max_length: int | None
    show_speed: bool
    save_dir: str | None


def parse(args: dict[str, Any]) -> EvalSettings:
    """Model args (lm-eval's parsed `--model_args`, or Python keywords) -> EvalSettings."""
    args = _our_names({k: v for k, v in args.items() if k not in HARNESS_ARGS})
    ev = {name: default for name, (_, default, _) in EVAL_ARGS.items()}
    for name in [n for n in args if n in EVAL_ARGS]:
        kind = EVAL_ARGS[name][0]
        ev[name] = _coerce(args.pop(name), kind.rstrip("?"), kind.endswith("?"), name)
    gen_kwargs = _generation_kwargs(args)
    if dpad := sorted(set(args) & set(DPAD_NAMES)):
        raise ValueError(f"{dpad}: DPad's harness args are not read here; DPad is dpad=gaussian"
                         "|uniform with dpad_window, dpad_k, dpad_scale, dpad_keep, and EOS "
                         "early stop is stop_at_eos=true")
    if args:
        raise ValueError(f"unknown model args {sorted(args)}; known: {known_args()}")
    for name in ("batch_size", "mc_num"):
        if ev[name] <= 0:
            raise ValueError(f"{name} must be a positive integer, got {ev[name]}")
    for name in ("slots", "max_length"):
        if ev[name] is not None and ev[name] <= 0:
            raise ValueError(f"{name} must be a positive integer, got {ev[name]}")
    mc_batch = ev["mc_batch"]
    if mc_batch is None:  # the reference stratifies over its batch_size (REFERENCE.md §9)
        mc_batch = max(d for d in range(1, min(ev["batch_size"], ev["mc_num"]) + 1)
                       if ev["mc_num"] % d == 0)
    if mc_batch <= 0 or ev["mc_num"] % mc_batch:
        raise ValueError(f"mc_batch={mc_batch} must be a positive divisor of "
                         f"mc_num={ev['mc_num']}")
    if ev["dtype"] is not None and ev["dtype"] not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be {' or '.join(WEIGHT_DTYPES)}, got {ev['dtype']!r}")
    gen_length = gen_kwargs.get("gen_length", GenerationConfig.gen_length)
    if gen_kwargs.get("flash") is None:  # Flash-dLLM has no blocks and no step schedule
        gen_kwargs.setdefault("steps", gen_length)
        gen_kwargs.setdefault("stop_at_eos", False)  # the reference's whole canvas (docstring)
    gen = GenerationConfig(**gen_kwargs)  # validates every field, naming it
    return EvalSettings(gen=gen, checkpoint=ev["checkpoint"],
                        dtype=ev["dtype"], batch_size=ev["batch_size"], slots=ev["slots"],
                        mc_num=ev["mc_num"], mc_batch=mc_batch,
                        check_greedy=ev["check_greedy"], chat=ev["chat"], seed=ev["seed"],
                        max_length=ev["max_length"], show_speed=ev["show_speed"],
                        save_dir=ev["save_dir"])


def _our_names(args: dict[str, Any]) -> dict[str, Any]:
    """The reference harness's arg names replaced by ours; a setting named both ways is
    refused rather than one silently winning."""
    args = dict(args)
    for theirs, ours in REFERENCE_NAMES.items():
        if theirs in args:
            if ours in args:
                raise ValueError(f"{theirs} and {ours} name the same setting: give one")
            args[ours] = args.pop(theirs)
    if "use_cache" in args or "dual_cache" in args:  # dual_cache counts only with use_cache
        if "cache" in args:
            raise ValueError("use_cache/dual_cache and cache name the same setting: give one")
        use = _coerce(args.pop("use_cache", False), "bool", False, "use_cache")
        dual = _coerce(args.pop("dual_cache", False), "bool", False, "dual_cache")
        args["cache"] = ("dual" if dual else "prefix") if use else "none"
    return args


def known_args() -> list[str]:
    """Every model arg name, nested ones (`dpad_window`, ...) included."""
    names = [*EVAL_ARGS, *REFERENCE_NAMES, "use_cache", "dual_cache"]
    for name, hint in _gen_fields().items():
        names.append(name)
        for kind in _kinds(hint)[0]:
            if dataclasses.is_dataclass(kind):
                names += [f"{name}_{f.name}" for f in dataclasses.fields(kind)]
    return sorted(names)


def _gen_fields() -> dict[str, Any]:
    """GenerationConfig field name -> resolved type hint."""
    return typing.get_type_hints(GenerationConfig)


def _generation_kwargs(args: dict[str, Any]) -> dict[str, Any]:
    """Pop the GenerationConfig args (and nested `<field>_<name>` ones) out of `args`."""
    out = {}
    for name, hint in _gen_fields().items():
        kinds, optional = _kinds(hint)
        nested = [k for k in kinds if dataclasses.is_dataclass(k)]
        if nested:
            out_value = _nested(args, name, nested[0])
            if out_value is not _ABSENT:
                out[name] = out_value
            continue
        if name in args:
            out[name] = _coerce(args.pop(name), kinds[0], optional, name)
    return out


_ABSENT = object()


def _nested(args: dict[str, Any], name: str, cls: type) -> Any:
    """A nested config from `name=` and `name_<field>=` args, or _ABSENT if none is given."""
    fields = typing.get_type_hints(cls)
    sub = {f: args.pop(f"{name}_{f}") for f in fields if f"{name}_{f}" in args}
    switch = args.pop(name, _ABSENT)
    if switch is _ABSENT and not sub:
        return _ABSENT
    if switch is not _ABSENT:
        if isinstance(switch, str) and switch.lower() not in ("true", "false", "none"):
            if "strategy" not in fields:
                raise ValueError(f"{name} must be true or false, got {switch!r}")
            sub.setdefault("strategy", switch)
        elif switch is None or _coerce(switch, "bool", False, name) is False:
            if sub:
                raise ValueError(f"{name} is off but {sorted(f'{name}_{f}' for f in sub)} "
                                 "are set")
            return None
    kwargs = {}
    for f, v in sub.items():
        kinds, optional = _kinds(fields[f])
        kwargs[f] = _coerce(v, kinds[0], optional, f"{name}_{f}")
    return cls(**kwargs)  # validates, naming `name.field`


def _kinds(hint) -> tuple[list[Any], bool]:
    """The non-None members of a type hint and whether None is allowed."""
    members = list(typing.get_args(hint)) if isinstance(
        hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    optional = type(None) in members
    kinds = [m for m in members if m is not type(None)]
    return [{int: "int", float: "float", bool: "bool", str: "str"}.get(k, k) for k in kinds], \
        optional


def _coerce(value: Any, kind: Any, optional: bool, name: str) -> Any:
    """`value` as `kind` ("int", "float", "bool", "str"), or None when `optional` allows."""
    if isinstance(value, str) and value.strip().lower() in ("none", "null"):
        value = None
    if value is None:
        if optional:
            return None
        if kind == "str":  # lm-eval parses the word `none` to None before we see it
            return "none"
        raise ValueError(f"{name} needs a value ({kind}), got none")
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
            return value.strip().lower() in ("true", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if kind == "float":
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise ValueError(f"{name} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if kind == "str":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # lm-eval reads `checkpoint=2024` as a number
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value.strip()
    raise ValueError(f"{name}: arguments of type {kind} are not supported")
