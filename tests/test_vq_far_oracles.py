"""benchmarks/vq_far_oracles.py: its oracle attentions agree with the reference kernel where they must."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from effattn.kernels.rope import apply_rope
from effattn.kernels.vq.naive import vq_attention_naive

_spec = importlib.util.spec_from_file_location(
    "vq_far_oracles", Path(__file__).parents[1] / "benchmarks" / "vq_far_oracles.py")
oracles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracles)


def _inputs(T=45, H=4, G=2, D=6, C=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(1, T, H, D, generator=gen), torch.randn(1, T, G, D, generator=gen), torch.randn(1, T, G, D, generator=gen)
    codebook = torch.randn(G, C, D, generator=gen)
    codes = torch.randint(0, C, (1, T, G), generator=gen)
    angles = torch.arange(T)[:, None] * 0.3 ** torch.arange(D // 2)[None, :]
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    far = torch.full((D // 2,), 7.0) * 0.3 ** torch.arange(D // 2)
    return q, k, v, codebook, codes, cos, sin, torch.cat((far.cos(), far.cos())), torch.cat((far.sin(), far.sin()))


@pytest.mark.parametrize("window,sinks,tile", [(4, 0, 8), (7, 3, 5), (1, 0, 16), (50, 0, 8)])
def test_code_spread_is_the_variance_of_each_codes_far_keys(window, sinks, tile):
    q, k, _, codebook, codes, *_ = _inputs()
    C, (B, T, H, D), G = codebook.shape[1], q.shape, k.shape[2]
    got = oracles.code_spread(q, k, codes, C, window, sinks, tile=tile)
    want = torch.zeros_like(got)
    for h in range(H):
        g = h // (H // G)
        for t in range(T):
            for c in range(C):
                far = [s for s in range(sinks, T) if s <= t - window and codes[0, s, g] == c]
                if far:
                    want[0, h, t, c] = (q[0, t, h] ** 2 * k[0, far, g].var(0, unbiased=False)).sum()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("sinks", [0, 3])
def test_base_is_key_means_and_exact_is_rerope_alone(sinks):
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = _inputs()
    args, kw = (q, k, v, codebook, codes, cos, sin, far_cos, far_sin), dict(window=4, block_size=8, sinks=sinks, scale=0.4)
    base = oracles.far_oracle("base")(*args, **kw)
    torch.testing.assert_close(base, vq_attention_naive(*args, **kw, key_means=True), atol=1e-5, rtol=1e-5)
    exact = oracles.far_oracle("exact")(*args, **kw)
    torch.testing.assert_close(exact, vq_attention_naive(*args, **(kw | {"sinks": q.shape[1]})), atol=1e-5, rtol=1e-5)
    assert (exact - base).abs().max() > 1e-3  # the codes do change the output here


def test_one_key_per_code_makes_every_oracle_exact():
    q, k, v, _, _, cos, sin, far_cos, far_sin = _inputs()
    T, G, D = q.shape[1], k.shape[2], q.shape[3]
    codes = torch.arange(T)[None, :, None].expand(1, T, G).contiguous()  # every key its own code
    args = (q, k, v, torch.zeros(G, T, D), codes, cos, sin, far_cos, far_sin)
    outs = {name: oracles.far_oracle(name)(*args, window=4, block_size=8, scale=0.4) for name in oracles.VARIANTS}
    for name in ("base", "var", "lse", "within", "cov"):
        torch.testing.assert_close(outs[name], outs["exact"], atol=1e-5, rtol=1e-5)


def test_lse_gives_each_code_its_keys_exact_weight():
    """Where the keys of a code share one value, only their total weight matters: lse is then exact."""
    q, k, _, codebook, codes, cos, sin, far_cos, far_sin = _inputs()
    G, C, D = codebook.shape
    per_code = torch.randn(G, C, D, generator=torch.Generator().manual_seed(1))
    v = per_code[torch.arange(G), codes]  # (1, T, G, D): a key's value is its code's
    args, kw = (q, k, v, codebook, codes, cos, sin, far_cos, far_sin), dict(window=4, block_size=8, scale=0.4)
    exact = oracles.far_oracle("exact")(*args, **kw)
    torch.testing.assert_close(oracles.far_oracle("lse")(*args, **kw), exact, atol=1e-5, rtol=1e-5)
    assert (oracles.far_oracle("base")(*args, **kw) - exact).abs().max() > 1e-3  # the mean logit is not


def test_within_keeps_each_codes_weight_and_shares_it_by_exact_logits():
    """Where the keys of a code share one value, how a code's weight is split inside it does not matter: within
    is then base. Where they do not, within moves the output."""
    q, k, _, codebook, codes, cos, sin, far_cos, far_sin = _inputs()
    G, C, D = codebook.shape
    per_code = torch.randn(G, C, D, generator=torch.Generator().manual_seed(1))
    shared = per_code[torch.arange(G), codes]
    kw = dict(window=4, block_size=8, scale=0.4)
    same = lambda v, name: oracles.far_oracle(name)(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, **kw)  # noqa: E731
    torch.testing.assert_close(same(shared, "within"), same(shared, "base"), atol=1e-5, rtol=1e-5)
    _, _, v, *_ = _inputs()
    assert (same(v, "within") - same(v, "base")).abs().max() > 1e-3


def _brute_force(q, k, v, codes, cos, sin, far_cos, far_sin, *, window, scale, code, kept=None):
    """The attention at every query, by loops: the window exact, the far keys marked in `kept` [T, G] with their
    own logit and value, and each code's other far keys through code(q_far, keys, values) -> (logit, value)
    (the logit counts all of the code's keys)."""
    B, T, H, D = q.shape
    G = k.shape[2]
    q_near = apply_rope(q, cos[:, None], sin[:, None]) * scale
    k_near = apply_rope(k, cos[:, None], sin[:, None])
    q_far = apply_rope(q, far_cos, far_sin) * scale
    kept = torch.zeros(T, G, dtype=torch.bool) if kept is None else kept
    out = torch.zeros_like(q)
    for h in range(H):
        g = h // (H // G)
        for t in range(T):
            near = list(range(max(0, t - window + 1), t + 1))
            own = [s for s in range(t - window + 1) if kept[s, g]]
            logits = [q_near[0, t, h] @ k_near[0, s, g] for s in near] + [q_far[0, t, h] @ k[0, s, g] for s in own]
            outs = [v[0, s, g] for s in near + own]
            for c in codes[0, :, g].unique().tolist():
                far = [s for s in range(t - window + 1) if codes[0, s, g] == c and not kept[s, g]]
                if far:
                    logit, value = code(q_far[0, t, h], k[0, far, g], v[0, far, g])
                    logits.append(logit)
                    outs.append(value)
            p = torch.softmax(torch.stack(logits), 0)
            out[0, t, h] = (p[:, None] * torch.stack(outs)).sum(0)
    return out


def _count(keys):
    return torch.tensor(float(len(keys))).log()


def test_cov_is_the_first_order_value_correction():
    """cov, by brute force: a code c of n far keys returns v̄_c + (1/n) Σ_i v_i (q·(k_i − k̄_c)) at the weight
    base gives it."""
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = _inputs(T=20)
    got = oracles.far_oracle("cov")(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window=4, block_size=8,
                                    scale=0.4)

    def code(qf, keys, values):
        mean = keys.mean(0)
        return qf @ mean + _count(keys), values.mean(0) + (values * ((keys - mean) @ qf)[:, None]).mean(0)

    want = _brute_force(q, k, v, codes, cos, sin, far_cos, far_sin, window=4, scale=0.4, code=code)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["base", "lse", "within", "cov"])
def test_outliers_leave_their_code_and_keep_their_own_logit_and_value(variant):
    """With --outliers F, the keys farthest from their codeword are scored like sinks (own logit, own value),
    and each code's logit and value come from the far keys it still holds. Brute force at every query."""
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = _inputs(T=24)
    T, G = k.shape[1], k.shape[2]
    got = oracles.far_oracle(variant, 0.25)(q, k, v, codebook, codes, cos, sin, far_cos, far_sin, window=4,
                                            block_size=8, scale=0.4)
    err = torch.stack([(k[0, :, g] - codebook[g][codes[0, :, g]]).square().sum(-1) for g in range(G)], 1)  # (T, G)
    kept = err > torch.quantile(err, 0.75, dim=0)
    assert ((0 < kept.sum(0)) & (kept.sum(0) < T)).all()

    def code(qf, keys, values):
        logits = keys @ qf
        logit = logits.logsumexp(0) if variant == "lse" else logits.mean() + _count(keys)
        if variant == "within":
            return logit, torch.softmax(logits, 0) @ values
        if variant == "cov":
            return logit, values.mean(0) + (values * (logits - logits.mean())[:, None]).mean(0)
        return logit, values.mean(0)

    want = _brute_force(q, k, v, codes, cos, sin, far_cos, far_sin, window=4, scale=0.4, code=code, kept=kept)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _heavy_by_hand(probs: torch.Tensor, group: int, window: int, sinks: int, budget: int) -> torch.Tensor:
    """H2O's choice, one KV head and one query at a time: a key that leaves the window joins; over budget,
    the member with the least attention from the queries before t leaves for good."""
    B, H, T, _ = probs.shape
    kept = torch.zeros(B, H, T, T, dtype=torch.bool)
    for b in range(B):
        for g in range(H // group):
            received = probs[b, g * group:(g + 1) * group].sum(0)  # (T, T): query t, key s
            members: list[int] = []
            for t in range(window, T):
                if t - window >= sinks:
                    members.append(t - window)
                    if len(members) > budget:
                        so_far = received[:t].sum(0)
                        members.remove(min(members, key=lambda s: (so_far[s].item(), s)))
                kept[b, g * group:(g + 1) * group, t, members] = True
    return kept


@pytest.mark.parametrize("window,sinks,budget", [(4, 0, 3), (6, 2, 5), (3, 0, 1)])
def test_heavy_hitters_are_h2os_online_choice(window, sinks, budget):
    gen = torch.Generator().manual_seed(window + budget)
    probs = torch.softmax(torch.randn(2, 6, 30, 30, generator=gen), -1)
    got = oracles.heavy_hitters(probs, 3, window, sinks, budget)
    torch.testing.assert_close(got, _heavy_by_hand(probs, 3, window, sinks, budget), rtol=0, atol=0)
    assert got.sum(-1).max() == budget  # the set fills and stays at the budget


def test_a_heavy_budget_spans_base_to_exact():
    q, k, v, codebook, codes, cos, sin, far_cos, far_sin = _inputs()
    args, kw = (q, k, v, codebook, codes, cos, sin, far_cos, far_sin), dict(window=4, block_size=8, sinks=2, scale=0.4)
    base, exact = oracles.far_oracle("base")(*args, **kw), oracles.far_oracle("exact")(*args, **kw)
    torch.testing.assert_close(oracles.far_oracle("base", heavy=q.shape[1])(*args, **kw), exact, rtol=0, atol=1e-6)
    some = oracles.far_oracle("base", heavy=5)(*args, **kw)
    assert (some - base).abs().max() > 1e-3 and (some - exact).abs().max() > 1e-3  # between the two
