"""Plain-Python loop references the algorithms' tensor code is checked against."""

from __future__ import annotations


def agg_ref(loss, mask, mode, normalizer=None, horizon=None):
    if mode == "token-sum":  # no normaliser, whatever was passed
        return sum(x for row, mr in zip(loss, mask) for x, m in zip(row, mr) if m)
    if mode == "token-mean":
        total = sum(x for row, mr in zip(loss, mask) for x, m in zip(row, mr) if m)
        n = sum(sum(mr) for mr in mask)
        return total / (normalizer if normalizer is not None else max(n, 1))
    per_seq = []
    for row, mr in zip(loss, mask):
        if not any(mr):
            continue
        s = sum(x for x, m in zip(row, mr) if m)
        if mode == "seq-mean-token-mean":
            s /= sum(mr)
        elif mode == "seq-mean-token-sum-norm":
            s /= horizon if horizon is not None else len(mr)
        per_seq.append(s)
    return sum(per_seq) / (normalizer if normalizer is not None else max(len(per_seq), 1))
