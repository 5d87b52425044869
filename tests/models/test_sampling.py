"""coli.sampling: non-finite logits masked, settings validated, no overflow, seed -1, llama.cpp's filters and
penalties (src/llama-sampling.cpp definitions; the expected sets are computed here with NumPy's softmax)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from coli.base.errors import ColiError
from coli.sampling import Sampler, SamplingParams

from conftest import ROOT


class FixedU:
    """An RNG stand-in whose ``random()`` returns given numbers: probes the sampler's CDF exactly."""

    def __init__(self, *us):
        self.us = list(us)

    def random(self):
        return self.us.pop(0)


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _logits(n=1000, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)


# -- kind 5: non-finite logits ------------------------------------------------------------------------------
def test_nan_in_one_entry_is_never_picked():
    """The issue's example: a NaN at the best position must not make greedy emit it; sampled runs never draw it."""
    lg = _logits()
    best = int(np.argmax(lg))
    lg[best] = np.nan
    s = Sampler(temp=0.0)
    assert s.sample(lg) == int(np.nanargmax(lg)) and s.masked_steps == 1 and s.masked_logits == 1
    picks = {Sampler(temp=5.0, top_k=0, top_p=1.0, seed=i).sample(lg) for i in range(300)}
    assert best not in picks and len(picks) > 20


def test_positive_infinity_is_masked_not_picked():
    """Second case of the kind: +inf (an overflowed row) is no more a sure pick than NaN; -inf stays excluded."""
    lg = _logits()
    lg[[3, 7]] = np.inf
    lg[11] = -np.inf
    finite = np.where(np.isfinite(lg), lg, -np.inf)
    assert Sampler(temp=0.0).sample(lg) == int(np.argmax(finite))
    picks = {Sampler(temp=10.0, top_k=0, top_p=1.0, seed=i).sample(lg) for i in range(300)}
    assert not picks & {3, 7, 11}


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_no_finite_logit_is_one_clear_error(fill, temp):
    lg = np.full(50, fill, np.float32)
    with pytest.raises(ColiError, match="non-finite logits"):
        Sampler(temp=temp).sample(lg)


def test_caller_row_is_not_changed():
    lg = _logits()
    lg[5] = np.nan
    keep = lg.copy()
    s = Sampler(temp=0.7, repeat_penalty=1.3, seed=1)
    s.accept_many([1, 2, 3])
    s.sample(lg)
    np.testing.assert_array_equal(lg, keep)


# -- kind 5: validated settings -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,value", [
    ("temp", -0.1), ("temp", float("nan")), ("temp", float("inf")), ("temp", "hot"),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("top_p", -0.1), ("top_p", 1.5), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", float("inf")),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_penalty", float("nan")),
    ("repeat_last_n", -2), ("repeat_last_n", 1.5),
    ("presence_penalty", float("inf")), ("frequency_penalty", float("-inf")), ("frequency_penalty", "x"),
    ("seed", -2), ("seed", 1.5), ("seed", "abc"),
])
def test_bad_setting_names_the_argument_and_flag(name, value):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ColiError) as e:
        Sampler(**{name: value})
    assert name in str(e.value) and flag in str(e.value) and "\n" not in str(e.value)


def test_good_settings_are_normalised():
    p = SamplingParams(temp=1, top_k=40.0, top_p=None, min_p=np.float32(0.05), seed=np.int64(3)).validated()
    assert p.temp == 1.0 and type(p.top_k) is int and p.top_k == 40 and p.top_p == 0.95
    assert abs(p.min_p - 0.05) < 1e-8 and p.seed == 3 and type(p.seed) is int


# -- kind 5: the scaled logits cannot overflow --------------------------------------------------------------
@pytest.mark.parametrize("temp", [1e-300, 5e-324, 1e-30])
def test_tiny_temperature_is_the_argmax_without_overflow(temp):
    lg = _logits()
    lg[17] = 3e38  # near f32's max: / 1e-30 would be 3e68; / 5e-324 overflows f64 unless shifted first
    lg[18] = -3e38
    with np.errstate(all="raise"):
        for seed in range(5):
            assert Sampler(temp=temp, top_k=0, top_p=1.0, seed=seed).sample(lg) == 17


def test_huge_penalties_do_not_overflow():
    """Penalty settings that push a logit past f64's range: clamped, still finite, the token still loses."""
    lg = _logits(20)
    lg[4] = 3e38
    s = Sampler(temp=0.0, repeat_penalty=1e-300, frequency_penalty=-1e308, presence_penalty=-1e308)
    s.accept_many([4, 4])
    with np.errstate(invalid="raise"):
        assert s.sample(lg) == 4  # a penalty below 1 rewards: the token stays first, finite
    s = Sampler(temp=0.9, repeat_penalty=1e300, frequency_penalty=1e308, presence_penalty=1e308, seed=0)
    s.accept(4)
    assert all(s.sample(lg) != 4 for _ in range(50))


# -- seeds ----------------------------------------------------------------------------------------------------
def test_seed_minus_one_is_random_and_reported():
    """llama.cpp's --seed -1 (LLAMA_DEFAULT_SEED): a random seed; the one drawn repeats the run when given."""
    lg = _logits()
    a, b = Sampler(temp=1.0, seed=-1), Sampler(temp=1.0, seed=None)
    assert 0 <= a.seed < 2**32 and a.seed != b.seed  # equal with probability 2**-32
    draws = [a.sample(lg) for _ in range(20)]
    again = Sampler(temp=1.0, seed=a.seed)
    assert [again.sample(lg) for _ in range(20)] == draws


# -- llama.cpp's filters -------------------------------------------------------------------------------------
def _support(lg, **kw):
    """The tokens that can be drawn: the least likely kept one is drawn by u just below 1, the first by u = 0."""
    order = []
    for u in (0.0, 1.0 - 1e-12):
        order.append(Sampler(rng=FixedU(u), **kw).sample(lg))
    return order


def test_top_p_0_keeps_the_most_likely_token_as_llama_cpp():
    """--top-p 0 was refused ("in (0, 1]"); llama.cpp's top-p keeps tokens until their mass reaches p and at least
    min_keep (1): p = 0 keeps the most likely one, at any temperature, with or without top-k and min-p."""
    lg = _logits(200, seed=3).astype(np.float64)
    for kw in (dict(top_k=0), dict(top_k=40), dict(top_k=0, min_p=0.01)):
        assert _support(lg, temp=5.0, top_p=0.0, **kw) == [int(np.argmax(lg))] * 2


def test_top_k_top_p_min_p_keep_llama_cpp_sets():
    lg = _logits(200, seed=3).astype(np.float64)
    order = np.argsort(-lg, kind="stable")
    # top-k 7: the 7 largest; the least likely kept one is the 7th
    assert _support(lg, temp=1.0, top_k=7, top_p=1.0) == [order[0], order[6]]
    # top-p 0.5 on the top-40 (llama.cpp: softmax over what top-k kept, before the temperature)
    p = _softmax(lg[order[:40]])
    n = int(np.argmax(np.cumsum(p) >= 0.5)) + 1
    assert _support(lg, temp=2.5, top_k=40, top_p=0.5) == [order[0], order[n - 1]]
    # min-p 0.2: probability >= 0.2 * the largest one's (same with any temperature: min-p sees raw logits)
    lg = lg / 3  # a flatter row: several tokens within a factor 5 of the best
    p = _softmax(lg)
    n = int((p >= 0.2 * p.max()).sum())
    assert 1 < n < len(lg)
    for t in (0.3, 3.0):
        assert _support(lg, temp=t, top_k=0, top_p=1.0, min_p=0.2) == [order[0], order[n - 1]]


@pytest.mark.parametrize("n", [200, 50_000])
def test_top_ids_are_numpys_stable_sort(n):
    """``top_ids`` (a sampled threshold, then the few candidates sorted) is NumPy's stable argsort of -logits with
    the non-finite dropped, its first k: equal logits (many here: values in steps of 0.5) by lower id, masked
    ones never, fewer than k finite ones all of them; also on a sorted row, the sample's worst case."""
    from coli.sampling import top_ids

    rng = np.random.default_rng(n)
    rows = [np.round(rng.standard_normal(n) * 6) / 2, np.arange(n, dtype=np.float64)]
    few = np.full(n, -np.inf)
    few[rng.choice(n, 5, replace=False)] = [1.0, 3.0, 1.0, -2.0, 0.5]
    rows.append(few)
    masked = rows[0].copy()
    masked[rng.choice(n, n // 3, replace=False)] = -np.inf
    rows.append(masked)
    for v in rows:
        ref = np.argsort(-v, kind="stable")
        ref = ref[np.isfinite(v[ref])]
        for k in (1, 7, 40, n // 8 - 1, n // 8, n - 1, n, n + 3, 0):
            got = top_ids(v, k)
            assert got.dtype == np.int64 and np.array_equal(got, ref[:k] if k > 0 else ref), k


def test_top_ids_drop_nan_and_inf_where_the_sample_holds_them():
    """The function's contract (finite values only) on rows the Sampler never gives it (its rows are masked
    first): a +inf reaches any threshold and a NaN sorts above every number in the sample's partition, so the
    threshold's candidates held the +inf ids, or fewer than k finite ones. Reference: NumPy's stable argsort."""
    from coli.sampling import top_ids

    n, k = 1600, 5  # the sample: every 16th value
    v = np.full(n, 1.0)
    v[::16] = -5.0
    v[[0, 16, 32, 48]] = np.nan  # 4 NaNs in the sample: its 5th largest is its largest number, 10
    v[64] = 10.0
    inf = np.arange(n, dtype=np.float64)
    inf[[3, 700]] = np.inf
    for row in (v, inf):
        ref = np.argsort(-row, kind="stable")
        ref = ref[np.isfinite(row[ref])]
        assert np.array_equal(top_ids(row, k), ref[:k])


def _kept_by_full_sort(lg, top_k, top_p, min_p):
    """llama.cpp's chain with the whole row sorted (NumPy's stable argsort): the ids top-k, top-p, min-p keep."""
    order = np.argsort(-lg, kind="stable")
    order = order[np.isfinite(lg[order])]
    if top_k > 0:
        order = order[:top_k]
    v = lg[order]
    if top_p < 1.0 and order.size > 1:
        q = np.exp(v - v[0])
        order = order[:int(np.searchsorted(np.cumsum(q / q.sum()), top_p)) + 1]
        v = lg[order]
    if min_p > 0.0 and order.size > 1:
        order = order[:max(int(np.count_nonzero(v >= v[0] + np.log(min_p))), 1)]
    return order


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.95, 0.0), (0, 0.5, 0.0), (0, 0.999, 0.0), (0, 0.95, 0.05),
                                               (0, 1.0, 0.05), (0, 0.3, 0.5), (40, 0.95, 0.05), (0, 1.0, 0.0)])
def test_kept_tokens_without_top_k_are_the_full_sorts(top_k, top_p, min_p):
    """Without top-k the sampler finds the top-p / min-p prefix without sorting the whole row (min-p's bound, or
    the nucleus in a growing top m): the ids kept and their order are the whole sort's (reference above), on
    peaked and flat rows of a 49,152 vocabulary (a nucleus of thousands: the top m grows to the whole row), rows
    with ties (logits in steps of 0.5), a third masked (-inf), and one finite logit; the draws of a seed too."""
    rng = np.random.default_rng(7)
    n = 49_152
    rows = [rng.standard_normal(n) * 2.5 + np.where(rng.random(n) < 0.001, 12.0, 0.0),  # a few far ahead
            rng.standard_normal(n) * 2.5, np.round(rng.standard_normal(n) * 4) / 2]
    masked = rows[0].copy()
    masked[rng.choice(n, n // 3, replace=False)] = -np.inf
    one = np.full(n, -np.inf)
    one[123] = 0.5
    rows += [masked, one]
    for lg in rows:
        s = Sampler(temp=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
        idx, v = s._kept(lg.copy())
        want = _kept_by_full_sort(lg, top_k, top_p, min_p)
        assert np.array_equal(idx, want) and np.array_equal(v, lg[want]), (idx.size, want.size)
        order = np.argsort(-lg, kind="stable")
        for u in (0.0, 0.37, 1.0 - 1e-12):  # the draw: softmax(kept / temp) in that order
            c = np.cumsum(np.exp((lg[want] - lg[want[0]]) / 0.8))
            exp = want[min(int(np.searchsorted(c, u * c[-1], side="right")), want.size - 1)]
            assert Sampler(temp=0.8, top_k=top_k, top_p=top_p, min_p=min_p, rng=FixedU(u)).sample(lg) == exp
        assert order[0] == want[0]


def test_draw_follows_softmax_over_temperature():
    """The draw's CDF is softmax(logits / temp) over the kept tokens: u picks the first token whose
    cumulative probability exceeds it."""
    lg = _logits(30, seed=5).astype(np.float64)
    order = np.argsort(-lg, kind="stable")
    p = _softmax(lg[order] / 0.7)
    c = np.cumsum(p)
    for u in (0.05, 0.3, 0.61, 0.9, 0.999):
        want = order[int(np.searchsorted(c, u, side="right"))]
        assert Sampler(temp=0.7, top_k=0, top_p=1.0, rng=FixedU(u)).sample(lg) == want


# -- llama.cpp's penalties -----------------------------------------------------------------------------------
def test_repeat_penalty_divides_positive_and_multiplies_negative():
    """llama_sampler_penalties_apply: logit / penalty when > 0, * penalty when <= 0."""
    lg = np.array([2.0, 1.5, -1.0, -1.2], np.float32)
    s = Sampler(temp=0.0, repeat_penalty=1.5, repeat_last_n=64)
    assert s.sample(lg) == 0
    s.accept(0)
    assert s.sample(lg) == 1  # 2.0 / 1.5 = 1.333 < 1.5
    lg = np.array([-1.0, -1.2, -5.0], np.float32)
    s = Sampler(temp=0.0, repeat_penalty=1.5)
    s.accept(0)
    assert s.sample(lg) == 1  # -1.0 * 1.5 = -1.5 < -1.2: negative logits are pushed down, not up


def test_frequency_counts_and_presence_does_not():
    """logit -= count * frequency_penalty + (count > 0) * presence_penalty."""
    lg = np.array([3.0, 2.5, 0.0], np.float32)
    s = Sampler(temp=0.0, frequency_penalty=0.3)
    s.accept_many([0])
    assert s.sample(lg) == 0  # 3.0 - 0.3 = 2.7 > 2.5
    s.accept_many([0])
    assert s.sample(lg) == 1  # 3.0 - 0.6 = 2.4 < 2.5
    s = Sampler(temp=0.0, presence_penalty=0.4)
    s.accept_many([0] * 5)
    assert s.sample(lg) == 0  # 3.0 - 0.4 = 2.6 > 2.5 however often token 0 came


def test_repeat_last_n_window():
    """Only the last ``repeat_last_n`` accepted tokens count; 0 turns the penalties off; -1 = the context."""
    lg = np.array([2.0, 1.9, 0.0], np.float32)
    s = Sampler(temp=0.0, repeat_penalty=2.0, repeat_last_n=2)
    s.accept_many([0, 2, 2])
    assert s.sample(lg) == 0  # token 0 left the window of 2
    s = Sampler(temp=0.0, repeat_penalty=2.0, repeat_last_n=0)
    s.accept(0)
    assert s.sample(lg) == 0
    s = Sampler(temp=0.0, repeat_penalty=2.0, repeat_last_n=-1, ctx=3)
    s.accept_many([0, 2, 2])
    assert s.sample(lg) == 1 and s.window.maxlen == 3


# -- the engine and the CLI ----------------------------------------------------------------------------------
def test_generate_masks_a_nan_output_row(model_path, engine, monkeypatch):
    """A NaN in the greedy token's logit (a corrupt output row) does not repeat that token; all-NaN logits stop
    the run with one ColiError."""
    eng = engine(model_path("smollm2"))
    ref = eng.generate("The capital of France is", max_tokens=3)
    bad = ref.ids[0]
    fwd = eng.model.forward

    def nan_row(*a, **k):
        lg = fwd(*a, **k).copy()
        lg[:, bad] = np.nan
        return lg

    monkeypatch.setattr(eng.model, "forward", nan_row)
    r = eng.generate("The capital of France is", max_tokens=3)
    assert bad not in r.ids and r.stats["masked_logit_steps"] == 3 and "non-finite" in eng.stats_line(r.stats)
    monkeypatch.setattr(eng.model, "forward", lambda *a, **k: np.full_like(fwd(*a, **k), np.nan))
    with pytest.raises(ColiError, match="non-finite logits"):
        eng.generate("The capital of France is", max_tokens=3)


def test_generate_penalty_changes_a_repeating_greedy_run(model_path, engine):
    """Greedy SmolLM2 repeats itself on this prompt; repeat_penalty 1.5 (prompt tokens in the window, as
    llama.cpp) gives fewer repeated tokens; the default is unchanged."""
    eng = engine(model_path("smollm2"))
    prompt = "one two one two one two one two"
    a = eng.generate(prompt, max_tokens=8)
    b = eng.generate(prompt, max_tokens=8, repeat_penalty=1.5)
    assert a.ids != b.ids
    seen = set(a.prompt_ids)
    assert sum(t in seen for t in b.ids) < sum(t in seen for t in a.ids)
    with pytest.raises(ColiError, match="min_p"):
        eng.generate(prompt, max_tokens=2, min_p=2.0)


def test_cli_seed_minus_one(demo_path):
    """``--seed -1`` runs, prints the seed it drew; that seed repeats the text."""
    cmd = [sys.executable, "-m", "coli", "run", "-m", str(demo_path), "-p", "Once", "-n", "6", "--temp", "1.0"]
    r = subprocess.run(cmd + ["--seed", "-1"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    seed = int(r.stderr.split("| seed ")[1].split()[0])
    r2 = subprocess.run(cmd + ["--seed", str(seed)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r2.returncode == 0 and r2.stdout == r.stdout
