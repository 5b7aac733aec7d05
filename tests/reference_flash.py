"""Eager PyTorch reference of Flash-dLLM decoding (REFERENCE.md §8): sliding-window threshold
decoding with selective cache refresh, importance tracking and Flash-Verify, one prompt at a
time, driving the transformers Llama reference model (tests/conftest.py) in fp32.

Written from §8 and, where §8 leaves a choice open, from reading the released code
(VILA-Lab/Flash-dLLM @7437a55, llada/generate.py `generate_with_Flash_dLLM`,
llada/flash_cache_triton.py `flash_fused_elastic_cache`); the parity target is that code's
behaviour except its EOS padding of keys to a multiple of 128. Shares no code with lacache_jax.

Per row the decoder keeps an ordering of positions: `decoded` (prompt and accepted positions)
and `pending` (undecoded). Semantics, with where each comes from:
- Window: the first `window` entries of `pending`. After each acceptance the rejected window
  positions go back to the front of `pending` in descending confidence, ahead of the untouched
  positions, which stay in position order (generate.py rewrites `full_pos` this way). So the
  window is last step's rejects (confidence order) then the next positions (position order).
  As a set it is always the `window` smallest undecoded positions (every rejected position lies
  below every position not yet windowed); the order only breaks exact confidence ties.
- Step 1 is a prefill: every position is a query. Later main passes query the window, the next
  `lookahead` entries of `pending` (None: all of them) and the last `track` entries of
  `decoded`. track=None queries every position outside the window, decoded or not, whatever
  `lookahead` says (the code's `track_num < 0`), so it alone makes each step a full recompute.
  Every layer overwrites the cache rows of its query positions before attending to every
  position's cached K/V (RoPE applied before caching).
  Released-code note: its `mask_num` counts the window, so its look-ahead is
  `window * (mask_num - 1)` masks (48 at the published 16 / 4), and `track = window * track_num`.
- Importance: raw q.k (before 1/sqrt(d) and softmax) of the window queries against every key,
  averaged over those queries and the query heads, summed over 0-indexed layers 2..L-1
  (`if block_idx > 1` in flash_cache_triton.py), main pass only, this step's pass only (the
  code zeroes `attn_scores` every step). The mean runs over the actual window rows; the code
  divides by the full window width, a per-step constant that does not change the ranking.
- Re-ranking: after acceptance, `decoded` minus the positions accepted last in this step is
  sorted by ascending importance, so the last `track` entries are those accepted last plus the
  most important others. "Accepted last" is the main pass's acceptance without verify, but
  only the verify pass's acceptance with verify (the code reuses `keep_num`): with verify, this
  step's draft-accepted tokens compete on importance. Kept (released behaviour); hence γ > 1
  reproduces verify=False only when every decoded position is tracked (track >= P + G).
- Acceptance: float64 softmax of the window logits, argmax drafts; with EOS seen, confidence is
  0 at positions >= predicted length; accept all with confidence >= threshold, at least the most
  confident. EOS (stop_at_eos): the first step that accepts EOS sets predicted length = (largest
  accepted EOS position of that step) + 1; later EOS do not move it. The row finishes when no
  pending position lies below it; pending positions are then filled with `eos_id` (the project's
  stop-at-EOS convention). stop_at_eos=False: EOS is an ordinary token, every position decoded.
- Flash-Verify: S = min(#window positions below the predicted length as it was before this
  step minus the draft-accepted, window // 2) candidates = the next S of `pending` (descending
  draft confidence); T = 2*window - 2S tracked = last T of `decoded` after the draft acceptance
  (all of `decoded` if shorter: the code would misalign its mask there). Query [T tracked real
  tokens | S drafts | S masks] at positions [tracked | candidates | candidates]; keys: those
  rows plus the cache of every other position; `verify_mask` on the fresh block. Nothing is
  written to the cache. Mask-view probabilities of the drafts (float64) are zeroed at
  positions >= the predicted length (as updated by the draft acceptance); "cumprod": accept the
  longest prefix whose cumulative product is >= gamma; "agree": accept while argmax == draft and
  p >= gamma. NFE counts both passes, also when S = 0 (the code runs the verify forward for
  the whole batch); the code's `n_steps` counts steps. The mask isolates the views for one
  layer only: from the second layer on, mask row i sees mask rows j > i, which saw draft i
  (released design, kept).
- Padding quirk not kept: the code's rows run to a multiple of 128 with EOS tokens that are
  keys, can fill the window (its window is always `window` wide, ours stops at the canvas end)
  and count towards S; before any EOS is decoded they can even be accepted. Here the canvas is
  exactly [prompt | gen_length] and nothing else is a key.
Ties in sorts keep the current order (stable); the code's CUDA sorts are unstable, which only
matters on exactly equal float scores.
"""

from __future__ import annotations

from numbers import Integral, Real

import numpy as np
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

IMPORTANCE_FIRST_LAYER = 2  # flash_cache_triton.py: `if block_idx > 1`


def verify_mask(S: int, T: int) -> np.ndarray:
    """Bool [T + 2S, T + 2S], True where query row r may attend to fresh column c of the verify
    block [T tracked | S draft view | S mask view]; candidates i, j in draft-confidence order."""
    n = T + 2 * S

    def part(k):
        if k < T:
            return "tracked", k
        return ("draft", k - T) if k < T + S else ("mask", k - T - S)

    m = np.zeros((n, n), bool)
    for r in range(n):
        row_kind, i = part(r)
        for c in range(n):
            col_kind, j = part(c)
            if col_kind == "tracked":
                m[r, c] = True  # every row sees the tracked rows (the code's mask is 1 there)
            elif row_kind == "tracked":
                m[r, c] = col_kind == "mask"
            elif row_kind == "draft":
                m[r, c] = j <= i if col_kind == "draft" else j > i
            else:
                m[r, c] = j < i if col_kind == "draft" else j >= i
    return m


def _forward(model, kv, tokens, positions, cached, fresh_mask=None, score_rows=None):
    """One pass: query rows `tokens` at `positions` attend to the cached K/V of the positions
    `cached` plus their own fresh K/V (masked by `fresh_mask` [Q, Q] when given).

    Returns (logits [Q, V] float64, fresh [(k, v)] per layer for the query rows, importance
    [N] float64 or None). Importance: raw q.k of the query rows `score_rows` against every key,
    mean over those rows and the query heads, summed over layers >= IMPORTANCE_FIRST_LAYER.
    """
    Q, C = len(positions), len(cached)
    cache = DynamicCache()
    cols = torch.as_tensor(cached, dtype=torch.long)
    for layer, (k, v) in enumerate(kv):
        cache.update(k[:, :, cols], v[:, :, cols], layer)
    mask = torch.zeros(1, 1, Q, C + Q)
    if fresh_mask is not None:
        mask[0, 0, :, C:][~torch.as_tensor(fresh_mask)] = torch.finfo(torch.float32).min
    key_positions = np.asarray(list(cached) + list(positions))
    n_positions = kv[0][0].shape[2]
    importance = None if score_rows is None else np.zeros(n_positions)
    hooks = []

    def record_scores(module, args, kwargs, output):
        # Recomputes the rotated queries from the module's own inputs (same ops, same values)
        # because transformers only exposes post-softmax weights.
        h = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(h).view(1, Q, -1, module.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        keys = repeat_kv(cache.layers[module.layer_idx].keys, module.num_key_value_groups)
        raw = q[:, :, list(score_rows)] @ keys.transpose(2, 3)  # [1, H, W, C + Q]
        per_key = raw.double().mean(dim=(0, 1, 2)).numpy()
        np.add.at(importance, key_positions, per_key)

    if score_rows is not None:
        for layer in model.model.layers[IMPORTANCE_FIRST_LAYER:]:
            hooks.append(layer.self_attn.register_forward_hook(record_scores, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor([list(tokens)]), attention_mask=mask,
                        position_ids=torch.as_tensor([list(positions)]), cache=cache,
                        use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    fresh = [(layer.keys[:, :, C:], layer.values[:, :, C:]) for layer in cache.layers]
    return out.logits[0].double(), fresh, importance


def _prefill(model, x, window_pos):
    """Step 1: every position is a query; returns (logits at the window, cache, importance)."""
    N = len(x)
    empty = torch.zeros(1, model.config.num_key_value_heads, N, model.config.head_dim)
    kv0 = [(empty, empty) for _ in model.model.layers]
    logits, fresh, importance = _forward(model, kv0, x, range(N), [], score_rows=window_pos)
    kv = [(k.clone(), v.clone()) for k, v in fresh]
    return logits[list(window_pos)], kv, importance


def _main_pass(model, kv, x, queries, n_window):
    """A later step: `queries` (window first) overwrite their cache rows, then attend to the
    whole cache; returns (logits at the window, importance); updates `kv` in place."""
    N = len(x)
    qset = set(queries)
    cached = [p for p in range(N) if p not in qset]
    logits, fresh, importance = _forward(model, kv, [x[p] for p in queries], queries, cached,
                                         score_rows=range(n_window))
    rows = torch.as_tensor(queries, dtype=torch.long)
    for (k, v), (fk, fv) in zip(kv, fresh):
        k[:, :, rows] = fk
        v[:, :, rows] = fv
    return logits[:n_window], importance


def verify_pass(model, kv, x, tracked, candidates, drafts, mask_id):
    """Flash-Verify's second forward; returns the mask-view logits [S, V] (float64). Reads the
    cache, writes nothing."""
    S, T = len(candidates), len(tracked)
    queries = list(tracked) + list(candidates) * 2
    tokens = [x[p] for p in tracked] + list(drafts) + [mask_id] * S
    qset = set(queries)
    cached = [p for p in range(len(x)) if p not in qset]
    logits, _, _ = _forward(model, kv, tokens, queries, cached, fresh_mask=verify_mask(S, T))
    return logits[T + S:]


def _check(prompt, gen_length, window, lookahead, track, threshold, mask_id, eos_id, gamma,
           accept, record):
    def is_int(v):
        return isinstance(v, Integral) and not isinstance(v, bool)

    if not len(prompt) or not all(is_int(t) for t in prompt):
        raise ValueError(f"prompt must be a non-empty list of token ids, got {prompt!r}")
    for name, v in (("gen_length", gen_length), ("window", window)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    for name, v in (("lookahead", lookahead), ("track", track)):
        if v is not None and (not is_int(v) or v < 0):
            raise ValueError(f"{name} must be None or a non-negative int, got {v!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, Real) or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a number in (0, 1], got {threshold!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, Real) or not gamma > 0:
        raise ValueError(f"gamma must be a positive number, got {gamma!r}")
    if accept not in ("cumprod", "agree"):
        raise ValueError(f"accept must be 'cumprod' or 'agree', got {accept!r}")
    if not is_int(mask_id) or not is_int(eos_id) or mask_id == eos_id:
        raise ValueError(f"mask_id and eos_id must be distinct ints, got {mask_id!r}, {eos_id!r}")
    if record is not None and not isinstance(record, list):
        raise ValueError(f"record must be None or a list, got {type(record).__name__}")


def _n_verified(p, argmax, drafts, gamma, accept):
    """How many leading candidates the verify pass accepts."""
    if accept == "cumprod":
        # p <= 1, so the cumulative product never rises: counting = longest passing prefix.
        return int((np.cumprod(p) >= gamma).sum())
    n = 0
    while n < len(p) and argmax[n] == drafts[n] and p[n] >= gamma:
        n += 1
    return n


def reference_flash_generate(model, prompt, *, gen_length, window=16, lookahead=64, track=64,
                             threshold, mask_id, eos_id, verify=False, gamma=0.8,
                             accept="cumprod", stop_at_eos=True, record=None):
    """Flash-dLLM decoding of one prompt at temperature 0; returns (canvas int32 [P + gen_length],
    nfe, steps). See the module docstring for the semantics.

    When `record` is a list, one dict per step is appended: `canvas` (tokens before the step),
    `prefill`, `window`, `lookahead`, `tracked` (decoded positions queried), `logits` (window,
    float64 [W, V]), `draft`, `confidence`, `accepted` (confidence order), `importance` (float64
    [N]), `predicted_length` (after the step; N while no EOS), `next_tracked` (what the next
    step tracks; None once finished) and, with verify, `verify_tracked`, `candidates`,
    `verify_p`, `verify_argmax`, `verify_accepted`.
    """
    _check(prompt, gen_length, window, lookahead, track, threshold, mask_id, eos_id, gamma,
           accept, record)
    P = len(prompt)
    N = P + gen_length
    x = np.array(list(prompt) + [mask_id] * gen_length, np.int64)
    draft = x.copy()
    decoded, pending = list(range(P)), list(range(P, N))
    pred_len, eos_seen = N, False
    kv, nfe, steps = None, 0, 0

    def last_decoded(n):
        return list(decoded) if n is None else (decoded[-n:] if n else [])

    def note_eos(positions):
        nonlocal pred_len, eos_seen
        hits = [p for p in positions if x[p] == eos_id]
        if stop_at_eos and not eos_seen and hits:
            pred_len, eos_seen = max(hits) + 1, True

    while any(p < pred_len for p in pending):
        steps += 1
        rec = {"canvas": x.copy(), "prefill": kv is None}
        win = pending[:window]
        if kv is None:
            look, trk = pending[window:], list(decoded)
            logits, kv, importance = _prefill(model, x, win)
        else:
            everything = lookahead is None or track is None
            look = pending[window:] if everything else pending[window:window + lookahead]
            trk = last_decoded(track)
            logits, importance = _main_pass(model, kv, x, win + look + trk, len(win))
        nfe += 1
        probs = torch.softmax(logits, dim=-1)
        conf_t, x0_t = probs.max(dim=-1)
        conf, x0 = conf_t.numpy().copy(), x0_t.numpy()
        beyond = np.array([eos_seen and p >= pred_len for p in win])
        conf[beyond] = 0.0
        n_below = int((~beyond).sum())  # before this step's EOS, as the code's `length_num`
        order = sorted(range(len(win)), key=lambda i: -conf[i])
        keep = max(1, int((conf >= threshold).sum()))
        accepted = [win[i] for i in order[:keep]]
        for i in range(len(win)):
            draft[win[i]] = x0[i]
        x[accepted] = draft[accepted]
        decoded += accepted
        pending = [win[i] for i in order[keep:]] + pending[len(win):]
        note_eos(accepted)
        last_new = len(accepted)
        rec.update(window=win, lookahead=look, tracked=trk, logits=logits.numpy(),
                   draft=x0.astype(np.int32), confidence=conf, accepted=accepted,
                   importance=importance)
        if verify:
            nfe += 1
            S = min(max(n_below - keep, 0), window // 2)
            candidates = pending[:S]
            v_trk = last_decoded(2 * window - 2 * S)
            p, argmax, n_ok = np.zeros(0), np.zeros(0, np.int64), 0
            if S:
                v_logits = verify_pass(model, kv, x, v_trk, candidates, draft[candidates],
                                       mask_id)
                v_probs = torch.softmax(v_logits, dim=-1)
                argmax = v_probs.argmax(dim=-1).numpy()
                p = v_probs.gather(1, torch.as_tensor(draft[candidates])[:, None])[:, 0].numpy()
                p = np.where([eos_seen and c >= pred_len for c in candidates], 0.0, p)
                n_ok = _n_verified(p, argmax, draft[candidates], gamma, accept)
            v_acc = candidates[:n_ok]
            x[v_acc] = draft[v_acc]
            decoded += v_acc
            pending = pending[n_ok:]
            note_eos(v_acc)
            last_new = n_ok
            rec.update(verify_tracked=v_trk, candidates=candidates, verify_p=p,
                       verify_argmax=argmax, verify_accepted=v_acc)
        active = any(q < pred_len for q in pending)
        if active:
            split = len(decoded) - last_new
            decoded = sorted(decoded[:split], key=lambda q: importance[q]) + decoded[split:]
        rec.update(predicted_length=pred_len, next_tracked=last_decoded(track) if active else None)
        if record is not None:
            record.append(rec)
    if stop_at_eos:
        x[pending] = eos_id
    return x.astype(np.int32), nfe, steps
