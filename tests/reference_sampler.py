"""A plain eager PyTorch sampler written from REFERENCE.md §4-6, one prompt at a time, driving
the transformers Llama reference model (tests/conftest.py). Deliberately loop-based, like the
released code, and sharing no code with lacache_jax."""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import DynamicCache


def _mask4d(keep: torch.Tensor, n_queries: int) -> torch.Tensor:
    """Additive [1, 1, Q, S] mask: 0 for kept keys, a large negative for dropped ones."""
    m = torch.zeros(1, 1, n_queries, keep.numel())
    m[..., ~keep] = torch.finfo(torch.float32).min
    return m


def _cache_from(kv, cols) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k[:, :, cols], v[:, :, cols], i)
    return cache


def _full(model, x, keep):
    T = x.shape[1]
    out = model(input_ids=x, attention_mask=_mask4d(keep, T), position_ids=torch.arange(T)[None],
                use_cache=True)
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return out.logits[0].double(), kv


def _step_prefix(model, x, keep, kv, s):
    """Queries [s, T) attend to the cached K/V of [0, s) and their own fresh K/V."""
    T = x.shape[1]
    out = model(input_ids=x[:, s:], attention_mask=_mask4d(keep, T - s),
                position_ids=torch.arange(s, T)[None], past_key_values=_cache_from(kv, slice(0, s)))
    return out.logits[0].double()


def _step_dual(model, x, keep, kv, s, e):
    """Queries [s, e) attend to the stale cached K/V outside the block and their own fresh
    K/V. transformers appends the fresh keys after the cached ones; attention does not depend
    on key order, so the key mask is permuted to match."""
    T = x.shape[1]
    outside = torch.cat([torch.arange(0, s), torch.arange(e, T)])
    key_order = torch.cat([outside, torch.arange(s, e)])
    out = model(input_ids=x[:, s:e], attention_mask=_mask4d(keep[key_order], e - s),
                position_ids=torch.arange(s, e)[None], past_key_values=_cache_from(kv, outside))
    return out.logits[0].double()


def _select(conf: torch.Tensor, masked: torch.Tensor, k, threshold, factor) -> torch.Tensor:
    conf = torch.where(masked, conf, torch.tensor(-math.inf, dtype=conf.dtype))
    n = int(masked.sum())
    reveal = torch.zeros_like(masked)
    if threshold is not None:
        order = torch.sort(conf, descending=True, stable=True).indices[:n]
        reveal[order[0]] = True
        for j in order[1:]:
            if conf[j] >= threshold:
                reveal[j] = True
        return reveal
    if factor is not None:
        sorted_conf = torch.sort(conf[masked], descending=True).values
        thresholds = [-1.0] + [1 - factor / (i + 2) for i in range(1, n)]
        top_i = 0
        for top_i in range(n):
            if sorted_conf[top_i] < thresholds[top_i]:
                break
        if top_i == 0 or top_i == n - 1:  # released code: the last candidate goes too
            top_i += 1
        k = top_i
    order = torch.sort(conf, descending=True, stable=True).indices[:k]
    reveal[order] = True
    return reveal


def reference_generate(model, prompt, *, gen_length, block_length, steps, mask_id, eos_id,
                       cache="none", threshold=None, factor=None, refresh_interval=None,
                       keep_fn=None, stop_at_eos=False, cfg_scale=0.0, logits_eos_inf=False,
                       confidence_eos_eot_inf=False, eot_id=None):
    """Temperature-0, low-confidence sampling of one prompt; returns (canvas, nfe).

    `keep_fn(block_index, T) -> bool [T]` gives DPad's kept columns for a block.
    """
    P = len(prompt)
    x = torch.tensor([list(prompt) + [mask_id] * gen_length])
    T = x.shape[1]
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    nfe = 0
    with torch.no_grad():
        for b in range(num_blocks):
            s, e = P + b * block_length, P + (b + 1) * block_length
            keep = torch.ones(T, dtype=torch.bool)
            if keep_fn is not None:
                keep = torch.as_tensor(np.array(keep_fn(b, T), dtype=bool))
            n = int((x[0, s:e] == mask_id).sum())
            base, rem = divmod(n, steps_per_block)
            schedule = [base + 1] * rem + [base] * (steps_per_block - rem)
            i, kv, kv_un = 0, None, None
            # Masks stay only where the model samples the mask id: LLaDA's fixed schedule
            # still stops after its steps; Fast-dLLM's parallel loop would go on until the
            # mask goes (the engine: at most block_length steps, kept here too).
            limit = block_length if (threshold is not None or factor is not None) \
                else steps_per_block
            while (x[0, s:e] == mask_id).any() and i < limit:
                # CFG guides every step: the unguided canvas (prompt masked) keeps a cache of
                # its own, refreshed with the guided one.
                views = [(x, "kv")]
                if cfg_scale > 0:
                    un = x.clone()
                    un[0, :P] = mask_id
                    views.append((un, "kv_un"))
                out = []
                for canvas, name in views:
                    if i == 0 or cache == "none" or (
                            cache == "dual" and refresh_interval and i % refresh_interval == 0):
                        full_logits, fresh = _full(model, canvas, keep)
                        kv, kv_un = (fresh, kv_un) if name == "kv" else (kv, fresh)
                        out.append(full_logits[s:e])
                    elif cache == "prefix":
                        out.append(_step_prefix(model, canvas, keep, kv if name == "kv" else kv_un,
                                                s)[: e - s])
                    else:
                        out.append(_step_dual(model, canvas, keep, kv if name == "kv" else kv_un,
                                              s, e))
                    nfe += 1
                logits = out[0]
                if cfg_scale > 0:
                    logits = out[1] + (cfg_scale + 1) * (out[0] - out[1])
                if logits_eos_inf:
                    logits[:, eos_id] = -math.inf
                x0 = logits.argmax(-1)
                if confidence_eos_eot_inf:
                    # As released: at T = 0 the "noisy" logits are `logits` itself, so this
                    # chained assignment drops both tokens from the softmax below.
                    noisy = logits
                    noisy[:, eos_id] = logits[:, eot_id] = -math.inf
                p = torch.softmax(logits, dim=-1)  # float64, as Fast-dLLM
                conf = p.gather(-1, x0[:, None])[:, 0]
                masked = x[0, s:e] == mask_id
                k = schedule[i] if i < steps_per_block else 0
                reveal = _select(conf, masked, k, threshold, factor)
                x[0, s:e] = torch.where(reveal, x0, x[0, s:e])
                i += 1
            if stop_at_eos and (x[0, s:e] == eos_id).any():
                x[0, e:] = eos_id
                break
    return x[0].numpy(), nfe
