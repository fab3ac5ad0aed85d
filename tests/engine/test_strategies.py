"""The engine's strategies and the devices' policies, walked: every registered strategy, every rule of every policy.

A new strategy is covered by being registered (``engine/strategies.py``) and a new rule by being listed in a policy
(``engine/policy.py``): nothing here names one strategy's case by hand except the facts each asserts of all.
"""

from __future__ import annotations

import pytest
import torch

from device import DEVICE
from torch_contrastive.engine import Options, PairTerms, Problem, SigmoidPairs, Softmax, planner, policy
from torch_contrastive.engine.problem_plan import plan
from torch_contrastive.engine.strategies import STRATEGIES
from torch_contrastive.engine.strategy import Strategy
from torch_contrastive.positives import Exclusion, Positives

STATISTICS = (Softmax, PairTerms, SigmoidPairs)
POLICIES = {"cpu": policy.CPU, "cuda": policy.CUDA}


def _problems(backend: str, dtype: torch.dtype = torch.float32) -> dict[str, Problem]:
    """One problem of each statistic (and a soft-max with a per-call exclusion mask), asking for ``backend``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    y = torch.randn(12, 6, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    keys = torch.arange(12, device=DEVICE) % 3
    opts = Options(True, 1e-12, None, backend)
    labels = Positives.from_keys(keys, self_offset=0)
    partner = Positives.from_partner(torch.arange(12, device=DEVICE), 12, self_offset=None, layout="identity")
    kept = Exclusion(relation=Positives.from_keys(keys), keep=partner)  # a kept relation: not the kernels'
    return {
        "softmax": Problem(x, y, 10.0, Softmax(columns=True), positives=partner, bound=10.0, options=opts),
        "excluded": Problem(x, y, 10.0, Softmax(exclude=kept), positives=partner,
                            bound=10.0, options=opts),
        "pairs": Problem(x, x, 10.0, PairTerms("binary"), positives=labels, self_offset=0, symmetric=True, bound=10.0,
                         options=opts),
        "sigmoid": Problem(x, y, 10.0, SigmoidPairs(-10.0, 0), positives=partner, options=opts),
    }


def test_every_strategy_is_registered_by_its_backend_name_with_a_form_of_every_statistic():
    """The registry names each strategy by its ``backend=``, every explicit backend is a strategy, and each strategy
    runs every statistic (its ``serves`` says where it does not)."""
    assert set(STRATEGIES) == set(planner.BACKENDS) - {"auto"}
    for name, strategy in STRATEGIES.items():
        assert isinstance(strategy, Strategy) and strategy.name == name
        assert type(strategy).serves is not Strategy.serves, f"{name}: serves() is the base's"
        for stat in STATISTICS:
            assert (stat, name) in strategy.forms, f"{name} has no form for {stat.__name__}"
            assert callable(strategy.forms[stat, name].run)


def test_every_policy_names_registered_strategies_and_ends_with_one_that_serves_every_call():
    """Each rule names a registered strategy; each CUDA rule cites its measurement; the last rule of each policy
    covers every call, and its strategy serves every problem -- so ``choose`` always finds one."""
    for device, rules in POLICIES.items():
        assert rules, device
        for rule in rules:
            assert rule.strategy in STRATEGIES, f"{device}: {rule.strategy!r} is no strategy"
            assert device != "cuda" or rule.measured, f"{device}: {rule} cites no measurement"
        last = rules[-1]
        assert last.kernel is None and not last.dtypes and last.from_rows == 0, f"{device}: the last rule is narrow"
        for problem in _problems("auto").values():
            assert STRATEGIES[last.strategy].serves(problem, planner.target(problem.anchors.device)) is None


@pytest.mark.parametrize("device", sorted(POLICIES))
def test_the_policy_asks_only_the_strategies_of_the_rules_that_cover_the_call(device):
    """``choose`` asks ``serves`` of a rule's strategy only when the rule covers the call, in order, and stops at the
    first that serves: a CPU call never asks (never imports) the kernels, and a refusing strategy passes the call on."""
    for kernel in ("softmax", "pairwise", "sigmoid"):
        for side in (64, 8192, 65536):
            for dtype in (torch.float32, torch.bfloat16):
                covering = [r.strategy for r in POLICIES[device] if r.takes(kernel, side, dtype, dtype)]
                asked: list[str] = []

                def refuse_all_but_torch(name, asked=asked):
                    asked.append(name)
                    return None if name == "torch" else "refused"

                chosen, reason = policy.choose(device, kernel, side, dtype, dtype, refuse_all_but_torch)
                assert chosen == "torch" and asked == covering[:covering.index("torch") + 1]
                assert reason.startswith("policy: torch")
                first, _ = policy.choose(device, kernel, side, dtype, dtype, lambda name: None)
                assert first == covering[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", sorted(STRATEGIES))
def test_an_explicit_backend_runs_its_strategy_or_raises_its_reason(backend, dtype):
    """For every strategy and every statistic: where ``serves`` is None the plan is that strategy's and the call's
    value equals the torch loops'; where it gives a reason, asking for it by name is a ``ValueError`` that says
    the reason -- never a silent switch. (The suite runs the kernels in Triton's interpreter: the epilogue then
    refuses fp16 rows alone, the fused kernels the kept exclusion.)"""
    from torch_contrastive.engine import solve

    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    torch_values = {name: solve(p) for name, p in _problems("torch", dtype).items()}
    for name, problem in _problems(backend, dtype).items():
        why = STRATEGIES[backend].serves(problem, planner.target(problem.anchors.device))
        if why is None:
            assert plan(problem).backend == backend
            got, want = solve(problem), torch_values[name]
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                if w is None:
                    assert g is None
                else:
                    torch.testing.assert_close(g, w, **tol)
        else:
            assert isinstance(why, str) and why
            with pytest.raises(ValueError, match=f"backend={backend!r} cannot run this call"):
                plan(problem)


def test_the_kernel_strategies_refuse_what_their_kernels_do_not_cover_and_say_why():
    """Under Triton's interpreter (as the suite runs) the kernel strategies serve float32 rows; the epilogue refuses
    fp16 rows of every statistic (its gradient tiles would need a tile-wide rescale), the fused kernels an exclusion
    with a kept relation; the torch loops serve both."""
    for name, problem in _problems("epilogue", torch.float16).items():
        on = planner.target(problem.anchors.device)
        why = str(STRATEGIES["epilogue"].serves(problem, on))
        assert ("kept relation" if name == "excluded" else "fp16 gradient tiles need a tile-wide rescale") in why, name
        assert STRATEGIES["torch"].serves(problem, on) is None
    kept = _problems("triton")["excluded"]
    assert "does not cover an exclusion with a kept relation" in str(STRATEGIES["triton"].serves(kept, planner.target(kept.anchors.device)))
    assert STRATEGIES["triton"].serves(_problems("triton")["softmax"], planner.target(DEVICE)) is None


def test_a_strategy_runs_only_the_plans_made_for_it():
    """``run`` of a strategy handed a plan of a form it does not hold is an error naming both (a plan is made for
    the strategy that serves it: this is the engine's own consistency, never a caller's input)."""
    problem = _problems("torch")["softmax"]
    chosen = plan(problem)
    with pytest.raises(RuntimeError, match=f"'epilogue' strategy has no '{chosen.executor}' form for Softmax"):
        STRATEGIES["epilogue"].run(problem, chosen)
