"""`python -m lacache_jax.lm_eval ARGS`: lm-eval's command line with the `lacache_jax` model
registered, e.g.

    python -m lacache_jax.lm_eval --model lacache_jax --tasks gsm8k --num_fewshot 5 \\
        --model_args checkpoint=DIR,gen_length=256,block_length=32,threshold=0.9,cache=dual
"""

import sys

import lacache_jax.lm_eval  # noqa: F401  (registers the model)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    sys.argv[0] = "python -m lacache_jax.lm_eval"
    cli_evaluate()
