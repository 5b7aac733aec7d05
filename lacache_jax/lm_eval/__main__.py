"""`python -m lacache_jax.lm_eval ARGS`: lm-eval's command line with the `lacache_jax` model
registered, e.g.

    python -m lacache_jax.lm_eval --model lacache_jax --tasks gsm8k --num_fewshot 5 \\
        --model_args checkpoint=DIR,gen_length=256,block_length=32,threshold=0.9,cache=dual

Before lm-eval starts (it loads its tasks first, 10-20 s), the `lacache_jax` model's args are
checked as the model's construction checks them without its weights (`harness.preflight`): a
mistake is one line on stderr and exit status 1, as in `python -m lacache_jax generate`.
lm-eval passes its `--batch_size` (1 when omitted) to every model, which would override the
model arg's default: when it is omitted, the model's own batch size (the `batch_size` model
arg, default 32) is passed instead. `--help` adds the model args to lm-eval's help.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

PROG = "python -m lacache_jax.lm_eval"


def model_args_of(values: list[str] | None) -> dict:
    """lm-eval's `--model_args` values (each `k=v,k2=v2`, or one JSON object) as one dict."""
    from lm_eval.utils import simple_parse_args_string
    out: dict = {}
    for value in values or ():
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        out.update(parsed if isinstance(parsed, dict) else simple_parse_args_string(value))
    return out


def model_args_help() -> str:
    from lacache_jax.lm_eval.model_args import EVAL_ARGS, REFERENCE_NAMES, known_args
    theirs = [*REFERENCE_NAMES, "use_cache", "dual_cache"]
    lines = ["lacache_jax model args (--model lacache_jax --model_args k=v,k2=v2):"]
    lines += [f"  {name}: {text}" + ("" if "default" in text else f" (default: {default})")
              for name, (_, default, text) in EVAL_ARGS.items()]
    gen = [n for n in known_args() if n not in EVAL_ARGS and n not in theirs]
    lines.append("  every lj.GenerationConfig field, a nested config's as <field>_<name>: "
                 + ", ".join(gen))
    lines.append("  the reference harness's names: " + ", ".join(theirs))
    return "\n".join(lines)


def as_lm_eval_reads(argv: list[str]) -> dict | None:
    """The settings lm-eval will run `argv` with (its `--config` YAML under the flags, which
    it reads abbreviated too), by lm-eval's own parser; None where that parser stops (help,
    a usage error: lm-eval then reports it itself) or is not this version's."""
    try:
        from lm_eval._cli.harness import HarnessCLI
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:
        return None
    saved = sys.argv
    sys.argv = [PROG, *argv]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # lm-eval says it again, once
            ns = HarnessCLI().parse_args()
    except SystemExit:
        return None
    finally:
        sys.argv = saved
    if getattr(ns, "command", None) != "run":
        return None
    settings = {}
    if getattr(ns, "config", None):
        try:
            settings.update(EvaluatorConfig.load_yaml_config(ns.config))
        except (OSError, TypeError, ValueError):
            return None  # lm-eval reports the file itself
    settings.update({k: v for k, v in vars(ns).items()
                     if (v or v == 0) and k not in ("command", "func")})
    if isinstance(settings.get("model_args"), str):
        settings["model_args"] = model_args_of([settings["model_args"]])
    return settings


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from lm_eval.__main__ import cli_evaluate

        import lacache_jax
        import lacache_jax.lm_eval  # noqa: F401  (registers the model)
        from lacache_jax.lm_eval.harness import (CHAT_TWICE, LM_EVAL_DEVICE, names_jax_device,
                                                 preflight)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "lm_eval" and "lm-eval" not in str(e):
            raise
        print("error: lm-eval is not installed: pip install -e '.[eval]' (or "
              "'lacache_jax[eval]')", file=sys.stderr)
        return 1
    if lacache_jax.take_early_interrupt():  # pressed during the imports (lacache_jax/__init__)
        print("interrupted", file=sys.stderr)
        return 130
    helping = "-h" in argv or "--help" in argv
    if helping:  # ours, then lm-eval's (its parser prints it: not read here as well)
        print(model_args_help() + "\n")
    settings = None if helping else as_lm_eval_reads(argv)
    if settings is not None and settings.get("model") == "lacache_jax":
        try:
            ours = preflight(settings.get("model_args") or {})
            if ours.chat and settings.get("apply_chat_template"):
                raise ValueError(CHAT_TWICE)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        device = settings.get("device")
        if any(a.startswith("--device") for a in argv) and device == LM_EVAL_DEVICE \
                and not names_jax_device(device):  # the model takes lm-eval's default as unset
            import jax
            print(f"warning: --device {device} is not read: lacache_jax runs on jax's default "
                  f"device ({jax.devices()[0]}; pick it with JAX_PLATFORMS or "
                  "CUDA_VISIBLE_DEVICES)", file=sys.stderr)
        if "batch_size" not in settings:  # neither a flag nor the YAML: lm-eval's 1 otherwise
            argv += ["--batch_size", str(ours.batch_size)]
    sys.argv = [PROG, *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    from lacache_jax.checkpoint import drop_late_tensorstore_errors
    drop_late_tensorstore_errors()
    if rc := main():
        sys.exit(rc)
