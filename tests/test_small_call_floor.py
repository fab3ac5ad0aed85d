"""tools/small_call_floor.py: its floor is the loss it stands for (value and gradient), so its timings compare like with like."""

from __future__ import annotations

import torch

from helpers import ROOT, load_file


def test_the_floor_is_the_loss_and_the_table_prints(capsys, monkeypatch):
    tool = load_file("small_call_floor", ROOT / "tools" / "small_call_floor.py")
    fns, x = tool.calls(16, 8)
    results = []
    for name in ("loss", "floor (same ops)", "plain formula", "engine (solve)"):
        x.grad = None
        value = fns[name]()
        value.backward()
        results.append((value.detach(), x.grad.clone()))
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, results[0][1], rtol=1e-4, atol=1e-6)
    monkeypatch.setattr("sys.argv", ["small_call_floor.py", "--rows", "8", "--dim", "4", "--reps", "3"])
    tool.main()
    out = capsys.readouterr().out
    assert "floor (same ops)" in out and "/ plain" in out
