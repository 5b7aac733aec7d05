"""lm-evaluation-harness integration (the `eval` extra: `pip install lacache_jax[eval]`).

Importing this package registers the lm-eval model `lacache_jax` (harness.py); the `lm_eval`
command does not import it by itself, so run it through `python -m lacache_jax.lm_eval`
(same arguments), or from Python:

    import lm_eval
    from lacache_jax.lm_eval import LaCacheLM
    lm = LaCacheLM(checkpoint="ckpt", gen_length=256, threshold=0.9, cache="dual")
    results = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k"], num_fewshot=5)

elbo.py holds the log-likelihood estimator, model_args.py the model-arg parsing.
"""

try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models stay registered beside ours)
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("lacache_jax.lm_eval needs lm-eval: pip install 'lacache_jax[eval]' "
                      "(or pip install 'lm-eval>=0.4')") from e

from lacache_jax.lm_eval.harness import LaCacheLM  # noqa: E402  (registers "lacache_jax")

__all__ = ["LaCacheLM"]
