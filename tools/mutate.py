#!/usr/bin/env python3
"""Mutation check of the test suite: does a one-line bug in the library fail a test?

Each mutation below changes one line of the library (a sign, a dropped term, a wrong
index). For each, the repository's ``src`` and ``tests`` are copied to a scratch folder,
the line is changed there (never in the working tree), and the tests that should notice
run against the copy (``PYTHONPATH`` points at the copy's ``src``). A mutation is
*killed* when a test fails and *survives* when the suite passes. Every survivor needs a
new test or a written reason (``reason`` below, for mutations that cannot change any
result, e.g. an equivalent rewrite).

Usage::

    python tools/mutate.py                 # all mutations, a Markdown table at the end
    python tools/mutate.py --only 1 5      # some of them
    python tools/mutate.py --list          # what each one changes

``make mutate`` runs it with the project's virtual environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "src/torch_contrastive"
CORE_TESTS = ["tests/losses/test_losses.py", "tests/engine/test_engine.py", "tests/test_robustness.py", "tests/test_positives.py",
              "tests/test_validation.py", "tests/test_modules.py", "tests/losses/test_siglip.py"]
DIST_TESTS = ["tests/test_distributed.py"]
INTEGRATION_TESTS = ("tests/integrations/test_integrations.py",)


@dataclass(frozen=True)
class Mutation:
    path: str
    before: str  # must occur exactly once in the file
    after: str
    what: str
    tests: tuple[str, ...] = tuple(CORE_TESTS)
    reason: str = ""  # why a survivor is acceptable (equivalent mutant)


E = f"{PKG}/engine"
CONFIDENT_TESTS = ("tests/engine/test_confident.py", "tests/engine/test_engine.py")
EPILOGUE_TESTS = ("tests/engine/test_epilogue.py",)
MUTATIONS = [
    # engine: soft-max terms (NT-Xent pairing rules, SupCon, image-text)
    Mutation(f"{E}/driver.py", "            gscale = gscale / 2", "            gscale = gscale",
             "symmetric path: temperature gradient counts every pair twice"),
    Mutation(f"{E}/softmax_tiles.py", "        if plan.symmetric and c0 != r0:\n            row_sum[c0:c1] += e.sum(0)",
             "        if plan.symmetric and c0 == r0:\n            row_sum[c0:c1] += e.sum(0)",
             "tiled fixed forward: lower-triangle tiles missing from the row sums"),
    Mutation(f"{E}/softmax_tiles.py",
             "            diag = self_diagonal(e, 0, 0, plan.self_offset)\n            if diag is not None:\n                diag.zero_()",
             "            diag = self_diagonal(e, 0, 0, plan.self_offset)\n            if diag is not None:\n                pass",
             "one-tile forward: self pair left in the denominator"),
    Mutation(f"{E}/tiling.py", "    run_sum[i0:i1] *= torch.exp(run_max[i0:i1] - new_max)", "    run_sum[i0:i1] *= 1.0",
             "online maximum: running sum not rescaled when the maximum grows"),
    Mutation(f"{E}/softmax_tiles.py", "g.mul_(torch.add(u[r0:r1, None], v[None, c0:c1]", "g.mul_(torch.sub(u[r0:r1, None], v[None, c0:c1]",
             "tiled fixed backward: column soft-max gradient with the wrong sign"),
    Mutation(f"{E}/softmax_tiles.py", "            g.add_(s.sub_(col[1][None, c0:c1])", "            g.sub_(s.sub_(col[1][None, c0:c1])",
             "tiled online backward: column soft-max gradient with the wrong sign"),
    Mutation(f"{E}/softmax_tiles.py", "            g = (u[:, None] + v).mul_(kept)",
             "            g = (u[:, None] - v).mul_(kept)",
             "one-tile backward: column soft-max gradient with the wrong sign"),
    Mutation(f"{E}/tiling.py",
             "            if c0 != r0:  # a diagonal tile's G already holds both roles of its pairs\n                prod.add_columns(",
             "            if c0 != r0 and False:\n                prod.add_columns(",
             "symmetric tiled backward: transposed tile contribution dropped"),
    Mutation(f"{E}/softmax_tiles.py", "            flat.index_add_(0, places.mirrored, values)", "            pass",
             "one tile, pairing rule: positive gradient of the mirrored entries dropped"),
    Mutation(f"{E}/softmax_tiles.py", "        row_pos = s.gather(1, partner[:, None])[:, 0]",
             "        row_pos = s.gather(1, partner[:, None] * 0)[:, 0]",
             "one tile, partner relation: wrong positive logit"),
    Mutation(f"{E}/softmax_tiles.py", "            g.addcmul_(mask.t(), c_row[None, :])",
             "            g.addcmul_(mask, c_row[None, :])",
             "one tile, mask relation: transposed positive gradient uses the untransposed mask"),
    Mutation(f"{E}/softmax.py", "                plan.column_comm.all_sum(g_col_c)", "                pass",
             "distributed image-text: column gradient not summed over ranks", tests=tuple(DIST_TESTS)),
    Mutation(f"{E}/normalization.py", "    return torch.addcmul(g, y, radial, value=-1).mul_(factor)",
             "    return torch.addcmul(g, y, radial, value=1).mul_(factor)", "L2 normalisation: radial gradient with the wrong sign"),
    # engine: mask-in-tile kernels (PML NT-Xent, NT-BXent)
    Mutation(f"{E}/pairwise.py", "g = grads[0][r0:r1] * has_neg", "g = grads[0][r0:r1]",
             "tiled PML NT-Xent: rows without negatives keep a gradient"),
    Mutation(f"{E}/pairwise.py", "d_neg = torch.where(neg, torch.exp(-diff) * weight, 0.0)",
             "d_neg = torch.where(neg, torch.exp(diff) * weight, 0.0)",
             "one-tile PML NT-Xent: negative gradient uses the wrong exponent"),
    Mutation(f"{E}/pairwise.py", "signed = torch.where(pos, -s, s)", "signed = torch.where(pos, s, -s)",
             "one-tile NT-BXent: positive and negative terms swapped"),
    Mutation(f"{E}/pairwise.py", "self.pos[r0:r1] += torch.where(pos, torch.nn.functional.softplus(-s)",
             "self.pos[r0:r1] += torch.where(pos, torch.nn.functional.softplus(s)", "tiled NT-BXent: positive term with the wrong sign"),
    Mutation(f"{E}/pairwise.py", "torch.where(neg, torch.sigmoid(s) * g_neg, 0.0)", "torch.where(neg, torch.sigmoid(-s) * g_neg, 0.0)",
             "tiled NT-BXent: negative gradient with the wrong sign"),
    Mutation(f"{E}/planner.py", "mixed = tuple(tuple(not (r_hi < c_lo or c_hi < r_lo) for", "mixed = tuple(tuple(r_lo == c_lo for",
             "label-sorted tiles: a tile holding positives taken for all-negative"),
    Mutation(f"{E}/pairwise.py", "            self.neg_sum[r0:r1] += s.exp_().sum(1)  # s is a scratch tile buffer", "            pass",
             "label-sorted PML NT-Xent (fixed): all-negative tiles left out of the negatives' sum"),
    Mutation(f"{E}/pairwise.py", "        self.neg_sum[c0:c1] += e.sum(0)", "        pass",
             "label-sorted symmetric PML: column block of an all-negative tile left out"),
    Mutation(f"{E}/pairwise.py", "        if c0 == r0:\n            return torch.add(h, h.t(), out=bufs.get(r1 - r0, c1 - c0, 8))",
             "        if c0 == r0:\n            return h + 0",
             "label-sorted symmetric backward: diagonal tile's transposed gradient dropped"),
    # engine: SigLIP sigmoid kernel
    Mutation(f"{E}/sigmoid.py", "        if diag is not None:\n            diag.neg_()\n        return s, None",
             "        if diag is not None:\n            pass\n        return s, None", "SigLIP: diagonal positives scored as negatives"),
    Mutation(f"{E}/sigmoid.py", "    return grad.mul_(torch.where(pos, -g_row[:, None], g_row[:, None]))",
             "    return grad.mul_(torch.where(pos, g_row[:, None], g_row[:, None]))", "SigLIP with ids: positive gradient with the wrong sign"),
    Mutation(f"{E}/sigmoid.py", "            gbias.add_(grad.sum())", "            gbias.add_(0)", "SigLIP tiled: bias gradient dropped"),
    Mutation(f"{PKG}/losses/siglip.py", "    return reduce(per_image, float(n), reduction,", "    return reduce(per_image, float(n) + 1, reduction,",
             "SigLIP: mean over one image too many"),
    # losses
    Mutation(f"{PKG}/losses/nt_bxent.py", "n_pos = (counts + 1).to(cdtype)", "n_pos = (counts + 0).to(cdtype)",
             "NT-BXent: diagonal not counted among the positives"),
    Mutation(f"{PKG}/losses/supcon.py", "factor = base_scale / scale", "factor = scale / base_scale", "SupCon: tau / tau_base inverted"),
    Mutation(f"{PKG}/losses/supcon.py", "weights = (has_pos_f, has_pos_f / counts.clamp_min(1))",
             "weights = (has_pos_f, has_pos_f)",
             "SupCon: positive logits summed instead of averaged"),
    Mutation(f"{PKG}/losses/image_text.py", "                       columns_share_alpha=True, columns=True,",
             "                       columns_share_alpha=False, columns=True,",
             "image-text with ids: text direction ignores the positive counts"),
    Mutation(f"{PKG}/losses/image_text.py", "per_text = alpha * col_lse_all[offset : offset + n]", "per_text = col_lse_all[offset : offset + n]",
             "distributed image-text: text direction ignores the positive counts", tests=tuple(DIST_TESTS)),
    Mutation(f"{PKG}/losses/nt_xent.py", "rows.counts.sum(), reduction", "rows.counts.sum() + 1, reduction",
             "PML NT-Xent: mean over one pair too many"),
    Mutation(f"{PKG}/positives.py", "        return rows ^ 1\n", "        return rows ^ 3\n", "adjacent pairing: wrong partner"),
    # positives
    Mutation(f"{PKG}/positives.py", "        return total - candidates[self.self_offset : self.self_offset + self.num_rows]  # every key",
             "        return total + 0 * candidates[self.self_offset : self.self_offset + self.num_rows]  # every key",
             "Positives.aggregate (sorted keys): self row left in the positive sum"),
    Mutation(f"{PKG}/positives.py", "                weight &= p[:, 1] != p[:, 0] + self_offset", "                weight &= True",
             "Positives.from_pairs: self pairs counted"),
    Mutation(f"{PKG}/positives.py", "starts[1:] = (ordered[1:] != ordered[:-1]).any(1).long()",
             "starts[1:] = (ordered[1:] != ordered[:-1]).all(1).long()", "Positives (sorted keys): two-key groups merged when one key matches"),
    Mutation(f"{PKG}/positives.py", "                    dense.diagonal(k).fill_(False)", "                    pass",
             "Positives (dense keys): self pair left in the relation"),
    # distributed
    Mutation(f"{PKG}/distributed.py", "        dist.all_reduce(total, op=dist.ReduceOp.SUM)", "        dist.all_reduce(total, op=dist.ReduceOp.MAX)",
             "all_gather_with_grad: gradients not summed over ranks", tests=tuple(DIST_TESTS)),
    Mutation(f"{PKG}/distributed.py", 'factor = self.world_size if self.grad_reduction == "mean" else 1', "factor = 1",
             "Scope.finish: DDP averaging not undone", tests=tuple(DIST_TESTS)),
    # validation
    Mutation(f"{PKG}/_validation.py", "            if is_bad(got):\n                text = message()",
             "            if False:\n                text = message()", "value checks never raise",
             tests=("tests/test_validation.py", "tests/test_robustness.py")),
    # candidates beyond the batch (issue 13)
    Mutation(f"{E}/tiling.py", "        elif ga_acc is not None and c0 < wanted:", "        elif ga_acc is not None and c0 <= 0:",
             "tiled backward: only the first column tile of a live candidate set gets its gradient",
             tests=("tests/test_queue.py", "tests/losses/test_info_nce.py")),
    Mutation(f"{PKG}/losses/_info_nce_groups.py", "options=options))[0] - s_pos)",
             "options=options))[0])",
             "info_nce: the pool's log-sum-exp not taken relative to the positive logit",
             tests=("tests/losses/test_info_nce.py", "tests/test_queue.py")),
    Mutation(f"{PKG}/losses/_info_nce_groups.py", "            paired_logits = torch.bmm(own, q[:, :, None])[:, :, 0] * scale",
             "            paired_logits = torch.bmm(own, q[:, :, None])[:, :, 0]",
             "info_nce: paired negatives' logits not scaled by 1 / tau", tests=("tests/losses/test_info_nce.py",)),
    Mutation(f"{PKG}/losses/_info_nce_groups.py", 'pair_partner(n, "identity", scope.offset, q.device)', 'pair_partner(n, "identity", 0, q.device)',
             "distributed info_nce: a query's positive key not offset to its rank's rows", tests=tuple(DIST_TESTS)),
    Mutation(f"{PKG}/losses/_labelled.py", "torch.cat([col_keys, labels]), self_offset=positives.self_offset)",
             "torch.cat([col_keys, labels * 0 - 1]), self_offset=positives.self_offset)",
             "memory rows never positives (their labels ignored)", tests=("tests/test_queue.py",)),
    Mutation(f"{PKG}/queue.py", "        targets = [(self._ptr, 0, first), (0, first, b - first)]", "        targets = [(self._ptr, 0, first)]",
             "FeatureQueue: rows past the end of the ring dropped instead of wrapping", tests=("tests/test_queue.py",)),
    # own data, gradient caching, false negatives (issues 14-16)
    Mutation(f"{PKG}/grad_cache.py", "            with sync, state.restored():", "            with sync:",
             "grad_cache: second pass without the recorded RNG state (different dropout masks)", tests=("tests/test_grad_cache.py",)),
    Mutation(f"{PKG}/grad_cache.py", "                out.backward(cached[k][start:stop].to(out.dtype))",
             "                out.backward(cached[k][: stop - start].to(out.dtype))",
             "grad_cache: every micro-batch gets the first micro-batch's cached gradient", tests=("tests/test_grad_cache.py",)),
    Mutation(f"{PKG}/cli/checkpoint.py", "    gen.set_state(rng[\"augment\"])", "    pass",
             "resume: augmentation generator not restored", tests=("tests/cli/test_train.py",)),
    Mutation(f"{PKG}/positives.py", "                kept_diagonal.fill_(1.0)", "                pass",
             "guide masking: the positive itself can be masked", tests=("tests/losses/test_false_negatives.py",)),
    Mutation(f"{E}/left_out.py", "    diag = self_diagonal(t, r0, c0, plan.exclude.diagonal)\n    if diag is not None:\n        diag.zero_()",
             "    diag = self_diagonal(t, r0, c0, plan.exclude.diagonal)\n    if diag is not None:\n        pass",
             "DCL (fixed path): the positive stays in the denominator", tests=("tests/losses/test_false_negatives.py",)),
    Mutation(f"{PKG}/losses/image_text.py", "        factor = self.smoothing * n_gt.to(img.dtype) / (n_all * n_all)",
             "        factor = self.smoothing * n_gt.to(img.dtype) / n_all",
             "label smoothing: uniform part not averaged over candidates", tests=("tests/losses/test_false_negatives.py",)),
    Mutation(f"{PKG}/cli/data.py", "    return Data(\"folder\", torch.stack(images), train, test, labels=label_tensor,",
             "    return Data(\"folder\", torch.stack(images), train, train, labels=label_tensor,",
             "image folders: the test split is the training split", tests=("tests/cli/test_data.py",)),
    # small batches (issue 10): the reduction inside the engine, float masks, cheap checks
    Mutation(f"{E}/softmax.py", "        w_row = u / row_lse if ctx.by_sums else None",
             "        w_row = u * row_lse if ctx.by_sums else None",
             "fixed single tile: backward multiplies by the row sums instead of dividing"),
    Mutation(f"{E}/softmax_tiles.py", "    g.diagonal().add_(c_row + c_col)", "    g.diagonal().add_(c_row)",
             "one tile, two sets (CLIP): the column coefficient of the positive dropped"),
    Mutation(f"{E}/softmax.py", "        return (row_out + col_out).sum() * total[0]", "        return row_out.sum() * total[0]",
             "CLIP reduced inside the engine: the text direction dropped"),
    Mutation(f"{E}/pairwise.py", "        row = weight * g / neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny)",
             "        row = g / neg_sum.clamp_min(torch.finfo(neg_sum.dtype).tiny)",
             "PML single fixed tile: negatives' gradient without the positive weight w_i"),
    Mutation(f"{E}/pairwise.py", "        signed = s.mul_(neg - pos)", "        signed = s.mul_(pos - neg)",
             "NT-BXent single fixed tile: positive and negative signs swapped"),
    Mutation(f"{E}/pairwise.py", "            grads = tuple((grads[0] * total * w).expand(a.shape[0]) for w in weights)",
             "            grads = tuple((grads[0] * w).expand(a.shape[0]) for w in weights)",
             "pairwise combine: backward forgets the reduction factor"),
    Mutation(f"{PKG}/losses/_prologue.py", "            coef: Tensor | float = as_dtype(normaliser, dtype).clamp_min(1).reciprocal()",
             "            coef: Tensor | float = as_dtype(normaliser, dtype).clamp_min(1)",
             "engine_total: the mean multiplies by the count"),
    Mutation(f"{E}/normalization.py", "    radial = (g * y).sum(1, keepdim=True).masked_fill_(norm <= eps, 0.0)",
             "    radial = (g * y).sum(1, keepdim=True)",
             "normalisation backward: rows below eps keep the radial term"),
    Mutation(f"{PKG}/_validation.py", "            self.add(value, lambda: _covered_message(pending, overflow), _not_finite)\n        else:",
             "            pass\n        else:", "finite check answered by the loss value: never read",
             tests=("tests/test_validation.py",)),
    Mutation(f"{PKG}/_validation.py", "        self.add(total, lambda: None if bool(torch.isfinite(x).all()) else message(), _not_finite)",
             "        self.add(total, message, _not_finite)", "finite check: an overflowing sum of finite entries raises",
             tests=("tests/test_validation.py",)),
    Mutation(f"{PKG}/positives.py", "            if excluded == 0:\n                self.clear.add(tile_key)",
             "            if excluded >= 0:\n                self.clear.add(tile_key)",
             "guide masking: backward skips tiles that do exclude candidates", tests=("tests/losses/test_false_negatives.py",)),
    # guide masking: rows that exclude one candidate are scattered in backward
    Mutation(f"{PKG}/positives.py", "t.scatter_(1, column, t.gather(1, column) * kept.to(t.dtype)[:, None])",
             "t.scatter_(1, column, t.gather(1, column))", "guide masking: the scattered tile keeps its excluded column",
             tests=("tests/losses/test_false_negatives.py",)),
    Mutation(f"{PKG}/positives.py", "column = (width * (width - 1) // 2) - torch.mv(keep, index)",
             "column = (width * (width + 1) // 2) - torch.mv(keep, index)", "guide masking: the excluded column off by the width",
             tests=("tests/test_positives.py", "tests/losses/test_false_negatives.py")),
    Mutation(f"{PKG}/positives.py", "            if excluded == 0 or multiple != 0:",
             "            if excluded == 0:", "guide masking: a row excluding two candidates is scattered as one",
             tests=("tests/test_positives.py", "tests/losses/test_false_negatives.py")),
    # triton kernels (through the interpreter)
    Mutation(f"{E}/triton_backend/tile_sums.py", "        tl.atomic_add(row_sum_ptr + cols, tl.sum(e, axis=0), mask=mirror, sem=\"relaxed\")",
             "        pass", "triton: a triangle tile's column sums do not reach the mirror rows", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/_tile.py", "        out = out | (g > t[:, None])", "        out = out | (g > t[:, None] + 0.05)",
             "triton: guide verdict against the wrong threshold", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/_tile.py", "        out = out & (ocol[None, :] != orow[:, None] + keep_diagonal)", "        out = out",
             "triton: the positive itself can be excluded", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/_tile.py", "        out = out | (a1[:, None] == b1[None, :])", "        out = out",
             "triton: the second id key is ignored", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/_tile.py", "out = tl.trans(excluded(cols, rows, n_cols, n_rows,",
             "out = tl.trans(excluded(rows, cols, n_rows, n_cols,",
             "triton: the column pass reads the exclusion untransposed", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/tile_grad.py", "cols < grad_cols, n_rows, n_cols,", "cols < grad_cols - 1, n_rows, n_cols,",
             "triton: the last live candidate gets no gradient", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_executors.py", "        col_lse = complete_columns(torch.ones_like(col_lse), col_lse, plan)", "        pass",
             "triton, online regime: column log-sum-exps not completed across ranks", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/softmax_tiles.py",
             "        plan.column_comm.all_sum(col_sum)  # no per-rank shift: the sums just add",
             "        pass", "bounded regime (both backends): column sums not added across ranks",
             tests=("tests/engine/test_triton.py",)),
    Mutation(f"{PKG}/cli/infcl_formula.py", "        return (dq - k) * coef, (dk - q) * coef, None",
             "        return (dq - k) * coef, dk * coef, None",
             "bench peer (Inf-CL schedule): the key gradient loses its positive term", tests=("tests/cli/test_bench.py",)),
    # the confident regime: positives kept apart from the sums (engine/confident.py)
    Mutation(f"{E}/confident.py", "    out = torch.expm1(d.neg()).mul_(u)\n    return out if alike else out.add_(u + _given(c))",
             "    out = torch.expm1(d.neg()).mul_(u)\n    return out if alike else out.add_(_given(c))",
             "kept-apart positive: the alpha - beta part of its gradient coefficient dropped",
             CONFIDENT_TESTS),
    Mutation(f"{E}/confident.py", "    out = torch.addcmul(zero(w), w, excess, value=-1)", "    out = torch.addcmul(zero(w), w, excess, value=1)",
             "one bounded tile: the kept-apart positive's gradient coefficient with the wrong sign", CONFIDENT_TESTS),
    Mutation(f"{E}/softmax_tiles.py", "    sums: list[Tensor | None] = [excess + exp_pos, None, torch.log1p(excess / exp_pos), None, excess, None]",
             "    sums: list[Tensor | None] = [excess + exp_pos, None, torch.log(excess + exp_pos) - row_pos, None, excess, None]",
             "one bounded tile: the margin recomputed as log(total) - S_p (cancels)", CONFIDENT_TESTS),
    Mutation(f"{E}/confident.py", "    return torch.logaddexp(x, x.new_zeros(()))",
             "    return torch.nn.functional.softplus(x)", "kept-apart positive: softplus with its x > 20 cut-off",
             CONFIDENT_TESTS),
    Mutation(f"{PKG}/positives.py", "        for step, parity in ((1, 0), (-1, 1)):", "        for step, parity in ((1, 1), (-1, 0)):",
             "adjacent pairing: the positives' parity inside a tile swapped",
             CONFIDENT_TESTS),
    Mutation(f"{E}/softmax.py", "    return d if _alike(alpha, beta) else",
             "    return _weighted(pos + d, alpha) - _weighted(pos, beta) if True else",
             "kept-apart positive: the value recomputed as LSE - S_p (cancels)", CONFIDENT_TESTS),
    Mutation(f"{E}/left_out.py", "    if plan.apart is not None:\n        plan.apart.clear(t, r0, c0, 0.0)",
             "    if plan.apart is not None:\n        pass", "fixed path: the positive left in the sums and added back again",
             CONFIDENT_TESTS),
    # integrations (drop-ins against the installed peers)
    Mutation(f"{PKG}/integrations/sentence_transformers.py", "        keep[:, :world] = False", "        keep[:, :0] = False",
             "hard_negatives hardness also weights the in-batch positives' column block", INTEGRATION_TESTS),
    Mutation(f"{PKG}/integrations/sentence_transformers.py", "        mine[rows, own + k * world] = True\n    return mine",
             "        mine[rows, own] = True\n    return mine", "own docs: a row's own hard negatives are not its own",
             INTEGRATION_TESTS),
    Mutation(f"{PKG}/integrations/sentence_transformers.py", "            if keep_positive:\n                drop[rows, own] = False",
             "            if keep_positive:\n                pass", "GIST drops the positive itself when the guide ties", INTEGRATION_TESTS),
    Mutation(f"{PKG}/integrations/sentence_transformers.py", "out.backward(cached[k][offsets[k]:offsets[k] + rows]",
             "out.backward(cached[k][0:rows]", "cached MNRL pushes the first mini-batch's gradient slice every time", INTEGRATION_TESTS),
    Mutation(f"{PKG}/integrations/open_clip.py", 'grad_reduction="mean" if self.gather_with_grad else "sum"',
             'grad_reduction="mean"', "open_clip's gather_with_grad=False gets full-batch gradients", INTEGRATION_TESTS),
    Mutation(f"{PKG}/queue.py", "            rows = rows[: self.size - self._ptr]\n", "", "overflow='drop' wraps instead", INTEGRATION_TESTS),
    Mutation(f"{PKG}/losses/supcon.py", "    return (labels != first).any() | (candidates != first).any()",
             "    return (labels != first).any()", "single_class='zero' ignores the reference labels", INTEGRATION_TESTS),
    Mutation(f"{PKG}/losses/nt_xent.py", "    return -(weight - weight.detach()) * s_p.to(weight.dtype)",
             "    return -(weight - weight.detach()) * 0", "DCL weight_fn / a learnable positive_weight takes no gradient",
             (*INTEGRATION_TESTS, "tests/losses/test_false_negatives.py")),
    Mutation(f"{E}/triton_backend/sigmoid_pairs.py", "        pos = pos | (cols[None, :] == rows[:, None] + diagonal)", "        pos = pos",
             "triton SigLIP: the diagonal positives are negatives", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/_tile.py", "    small = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))",
             "    small = tl.log(w)", "triton SigLIP: softplus loses a confident pair's small term", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/sigmoid_pairs.py", "    tl.atomic_add(gbias_ptr, tl.sum(tl.sum(grad, axis=1), axis=0), sem=\"relaxed\")", "",
             "triton SigLIP: the bias gets no gradient", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/driver.py", "    norm_b = None if not plan.normalize or ctx.single else (norms[2], norms[3])",
             "    norm_b = None if not plan.normalize or ctx.single else (norms[0], norms[1])",
             "driver: the candidates' normalisation backward uses the anchors' norms"),
    Mutation(f"{PKG}/losses/_false_negatives.py", "keep_diagonal=offset, learn=learn and guide is not None)",
             "keep_diagonal=None, learn=learn and guide is not None)", "InfoNCE false negatives: the positive itself can leave",
             tests=("tests/losses/test_false_negatives.py", "tests/losses/test_info_nce.py")),
    Mutation(f"{E}/triton_backend/_tile.py", "        g = g * f[None, :]", "        g = g",
             "triton half inputs: the candidates' normalisation is not folded into G @ B", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/pair_terms.py", "        counted = counted & (cols[None, :] != rows[:, None] + self_offset)", "        pass",
             "triton pair kernels: the self pair counts", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/pair_terms.py", "        factor = tl.where(has_neg, w * g0, 0.0)", "        factor = tl.where(has_neg, g0, 0.0)",
             "triton PML NT-Xent: negatives' gradient without the pair weight w_i", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/pair_terms.py", "        second = tl.where(neg, softplus(s), 0.0)",
             "        second = tl.where(neg, softplus(-s), 0.0)",
             "triton NT-BXent: negatives scored as positives", tests=("tests/engine/test_triton.py",)),
    Mutation(f"{E}/planner.py", "bound=None if isinstance(stat, SigmoidPairs) else problem.bound,", "bound=None,",
             "planner: a problem's bound is ignored (never the one-exp algorithm)", tests=("tests/engine/test_planner.py",)),
    Mutation(f"{E}/problem.py", "            if self.symmetric and stat.exclude is not None and not stat.exclude.symmetric:",
             "            if False:", "problem: a one-sided exclusion accepted on the symmetric triangle",
             tests=("tests/engine/test_planner.py",)),
    Mutation(f"{E}/solve.py", '    (PairTerms, "torch"): pairwise.TORCH,', '    (PairTerms, "torch"): sigmoid.TORCH,',
             "solve: pair-term problems run as sigmoid problems", tests=("tests/engine/test_planner.py", "tests/losses/test_losses.py")),
    Mutation(f"{E}/driver.py", '        ctx.lean = getattr(plan, "operand_dtype", None) is not None', "        ctx.lean = False",
             "driver: the Triton half path keeps fp32 normalised copies for backward",
             tests=("tests/engine/test_triton.py::test_half_inputs_on_triton_keep_only_half_rows_for_backward",)),
    Mutation(f"{E}/driver.py", "        b_c = a_c if single else b_c / norms[2]", "        b_c = a_c if single else b_c / norms[0]",
             "driver: the candidates are rebuilt with the anchors' norms",
             tests=("tests/engine/test_triton.py::test_half_inputs_on_triton_keep_only_half_rows_for_backward",)),
    Mutation(f"{E}/triton_backend/_tile.py", "        right = busy & (c < value)", "        right = busy & (c <= value)",
             "listed pairs: the search skips a row's column at the tile's first column",
             tests=("tests/engine/test_triton.py::test_nt_bxent_with_pos_indices_on_triton_equals_the_float64_formula",)),
    Mutation(f"{PKG}/positives.py", "        code = torch.where(w, p[:, 0] * self.num_cols + p[:, 1], self.num_rows * self.num_cols)",
             "        code = p[:, 0] * self.num_cols + p[:, 1]", "row lists keep self pairs and repeats",
             tests=("tests/test_positives.py",)),
    Mutation(f"{E}/triton_backend/sigmoid_pairs.py", "    owned = not fused()\n", "    owned = False\n",
             "SigLIP forward adds with atomics in deterministic mode",
             tests=("tests/engine/test_triton.py::test_deterministic_mode_runs_no_atomic_kernel",)),
    Mutation(f"{E}/triton_backend/_tile.py", "        g = tl.trans(fold_rows(grad, rows, n_rows, fz_ptr))",
             "        g = tl.trans(grad)",
             "deterministic pair / SigLIP gradient: the column side drops the row factors",
             tests=("tests/engine/test_triton.py::test_half_inputs_on_triton_keep_only_half_rows_for_backward",)),
    Mutation(f"{E}/triton_backend/sigmoid_pairs.py", "            row_sum += tl.sum(grad, axis=1)\n", "            pass\n",
             "deterministic SigLIP: no bias gradient",
             tests=("tests/engine/test_triton.py::test_siglip_on_triton_equals_the_float64_formula",)),
    Mutation(f"{E}/triton_backend/_tile.py", "            part = part * peak_r[:, None]\n", "            part = part\n",
             "fp16 gradient tiles: the fused rows' product is not scaled back",
             tests=("tests/engine/test_triton.py::test_half_inputs_at_a_low_temperature_equal_the_float64_formula",)),
    Mutation(f"{E}/triton_backend/_tile.py", "                part_t = part_t * peak_c[:, None]\n", "                part_t = part_t\n",
             "fp16 gradient tiles: the fused columns' product is not scaled back",
             tests=("tests/engine/test_triton.py::test_half_inputs_at_a_low_temperature_equal_the_float64_formula",)),
    Mutation(f"{E}/triton_backend/_tile.py",
             "        acc += tl.dot((g / peak[:, None]).to(operand.dtype), operand, out_dtype=ACC, input_precision=PRECISION) * peak[:, None]",
             "        acc += tl.dot((g / peak[:, None]).to(operand.dtype), operand, out_dtype=ACC, input_precision=PRECISION)",
             "fp16 gradient tiles: a deterministic pair / SigLIP product is not scaled back",
             tests=("tests/engine/test_triton.py::test_half_inputs_on_triton_keep_only_half_rows_for_backward",)),
    Mutation(f"{E}/triton_backend/_tile.py", "        peak = peaks(g, 1)\n", "        peak = peaks(g, 1) * 0.0 + 1.0\n",
             "fp16 gradient tiles: the row-owned products are not scaled at all",
             tests=("tests/engine/test_triton.py::test_half_inputs_at_a_low_temperature_equal_the_float64_formula",),
             reason="equivalent on CPU: the interpreter widens half to fp32, so skipping the scaling changes nothing there"),
    # the small-call paths and the weights' gradients
    Mutation(f"{E}/softmax_tiles.py",
             "        left_out = flat if self_offset is None else torch.cat([rows * n + rows + self_offset, flat])",
             "        left_out = flat", "flat places: the self pairs stay in a pairing rule's one-tile sums"),
    Mutation(f"{PKG}/losses/nt_xent.py", "            per_row = per_row + weight_term.to(per_row.dtype)", "            per_row = per_row",
             "a learnable positive_weight's gradient term is never added", ("tests/losses/test_false_negatives.py",)),
    Mutation(f"{E}/problem.py", "    if any(isinstance(w, Tensor) and w.requires_grad for w in weights):", "    if False:",
             "the engine accepts weights that require grad (their gradient silently dropped)", ("tests/losses/test_false_negatives.py",)),
    Mutation(f"{E}/planner.py",
             "    key = (kernel, rows, cols, device, dtype, other_dtype, chunk_size, backend, fixed, half_ok, GPU_BUDGET, PRODUCTS, served,",
             "    key = (kernel, rows, cols, device, dtype, other_dtype, backend, fixed, half_ok, GPU_BUDGET, PRODUCTS, served,",
             "the planner's cache answers another chunk_size's question", ("tests/engine/test_planner.py",)),
    Mutation(f"{E}/softmax.py", "        mean = isinstance(total[0], float) and total[0] == 1.0 / max(row_out.numel(), 1)",
             "        mean = isinstance(total[0], float)", "a reduction inside the engine taken as a mean whatever its coefficient"),
    Mutation(f"{E}/products.py", "            return torch.addmm(zero(self.a), self.a, self.b.t(), beta=0, alpha=self.scale)",
             "            return torch.addmm(zero(self.a), self.a, self.b.t(), beta=0, alpha=1.0)",
             "one-tile logits without the scale"),
    Mutation(f"{PKG}/positives.py", "        values = self._dense_values.get(dtype)", "        values = None",
             "a dense relation converted to 0/1 values on every read (a small call's ops grow)", ("tests/test_small_batches.py",)),
    # the shared options
    Mutation(f"{PKG}/options.py", "        found = _KNOWN.get(key)", "        found = None",
             "shared options: every call checks its options again", ("tests/test_options.py",)),
    Mutation(f"{PKG}/options.py", "                type(normalize), type(reduction), type(chunk_size), type(gather),",
             "                type(normalize), type(reduction), object, type(gather),",
             "shared options: chunk_size=True taken for the known chunk_size=1", ("tests/test_options.py",)),
    # small calls (issue 33, second step): the soft-max weight, the plan cache, the one-value read, first order only
    Mutation(f"{E}/softmax.py", "    return torch.cat([row_out, col_out]).mean()  # CLIP's mean over both directions: two ops, not three",
             "    return torch.cat([row_out, row_out]).mean()  # CLIP's mean over both directions: two ops, not three",
             "CLIP's mean inside the engine: the column terms dropped"),
    Mutation(f"{E}/planner.py", "id(problem.positives), problem.self_offset, problem.symmetric, problem.grad_columns,",
             "id(problem.positives), problem.self_offset, problem.grad_columns,",
             "the kept soft-max plan ignores whether the tiles are walked as a triangle",
             ("tests/engine/test_planner.py", "tests/engine/test_engine.py", "tests/losses/test_losses.py")),
    Mutation(f"{PKG}/_validation.py", "                if not math.isfinite(value.item()):", "                if False:",
             "a validated small call no longer reads its loss value: non-finite inputs pass", ("tests/test_validation.py",)),
    Mutation(f"{E}/driver.py", "    if torch.is_grad_enabled():\n        raise RuntimeError(", "    if False:\n        raise RuntimeError(",
             "create_graph=True through a loss returns a gradient without a graph, silently", ("tests/engine/test_engine.py",)),
    # GPU cost counted on a CPU (issue 34)
    Mutation(f"{PKG}/cli/traffic.py", "        self.flops[str(own).replace(\"torch.\", \"\")] += 2 * batch * a.shape[-2]",
             "        self.flops[str(own).replace(\"torch.\", \"\")] += batch * a.shape[-2]",
             "cost counter: a product counted at half its FLOPs", ("tests/cli/test_traffic.py",)),
    Mutation(f"{PKG}/cli/traffic.py", "        if products.WIDENING[0]:  # a CPU-only copy: remember what it stands for",
             "        if False:  # a CPU-only copy: remember what it stands for",
             "cost counter: the CPU's widening copies counted as GPU work", ("tests/cli/test_traffic.py",)),
    Mutation(f"{PKG}/cli/traffic.py", "        return min(t.numel(), t.untyped_storage().nbytes() // t.itemsize) * width",
             "        return t.numel() * width", "cost counter: an expanded tensor counted as if stored in full",
             ("tests/cli/test_traffic.py",)),
    Mutation(f"{PKG}/cli/traffic.py", "        return 2 * touched * self._width(big[0])  # read and written (or gathered and stored)",
             "        return sum(t.numel() * self._width(t) for t in big)",
             "cost counter: an indexed op counted as a pass over the whole tile", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/cost.py", "    return gemm, counts.logit_bytes / g.bandwidth, counts.launches * g.launch",
             "    return gemm, counts.logit_bytes / g.bandwidth, counts.launches * g.launch * 2",
             "cost model: the per-op term doubled", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/planner.py", "        _SIMULATED, GPU_BUDGET, _SIMULATED_AREA = previous",
             "        _SIMULATED, _SIMULATED_AREA = previous[0], previous[2]",
             "simulate() leaves the simulated budget behind", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/products.py", "        return torch.mul(g, factor[None, :] if dim == 1 else factor[:, None], out=out)",
             "        return torch.mul(g, factor[:, None], out=out)",
             "tensor-core products: the bf16 gradient tile scaled along the wrong side", ("tests/engine/test_planner.py",)),
    Mutation(f"{E}/planner.py", "    return entries <= GPU_BUDGET and dense_relation_pays(rows, cols * _SIMULATED_AREA)",
             "    return entries <= GPU_BUDGET", "a GPU holds every label relation that fits the budget as a dense mask",
             ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/planner.py", "    return entries <= GPU_BUDGET and dense_relation_pays(rows, cols * _SIMULATED_AREA)",
             "    return entries <= GPU_BUDGET and dense_relation_pays(rows, cols)",
             "a problem counted small decides its relation's form at the counted size", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/planner.py", "                      half_ok=not isinstance(stat, SigmoidPairs), auto_triton=not isinstance(stat, SigmoidPairs),",
             "                      half_ok=softmax, auto_triton=not isinstance(stat, SigmoidPairs),",
             "the pair terms (PML NT-Xent, NT-BXent) widen half rows to fp32 products on a GPU", ("tests/engine/test_planner.py",)),
    Mutation(f"{E}/pairwise.py", "                return Gradients(prod.row_product(g + g.t()), None, True)",
             "                return Gradients(prod.row_product(g), None, True)",
             "one pair tile of a single set: the column role of every pair dropped"),
    Mutation(f"{E}/cost.py", "    return RELATION_FORMS.dense_passes * 4.0 * rows * cols / g.bandwidth < RELATION_FORMS.grouped_launches * g.launch",
             "    return False", "a GPU never holds a label relation as a dense mask (SupCon's launches grow)",
             ("tests/cli/test_traffic.py",)),
    # the cuBLAS + epilogue path (backend="epilogue") and the cost model's choice
    Mutation(f"{E}/epilogue.py", "        mirror = plan.symmetric and c0 != r0  # a single set's mirror tile: its columns are rows c0:c1",
             "        mirror = False", "epilogue: a single set's off-diagonal tiles never feed their mirror rows", EPILOGUE_TESTS),
    Mutation(f"{E}/epilogue.py", "            k = max(0, min(c1, wanted) - c0)", "            k = max(0, c1 - c0)",
             "epilogue: a queue's constant columns get gradient tiles (written past the accumulator)", EPILOGUE_TESTS),
    Mutation(f"{E}/epilogue.py",
             "        cols = torch.empty(h, k, dtype=self.dtype, device=like.device) if half and self.ops.factors is not None and k"
             " else None",
             "        cols = None", "epilogue: the column product reads the row tile, folded with the wrong side's factor", EPILOGUE_TESTS),
    Mutation(f"{E}/epilogue.py", "        low = torch.empty(h, w, dtype=self.dtype, device=like.device) if half and learned_scale else None",
             "        low = None",
             "epilogue: a learned scale's gradient from bf16-rounded gradient tiles only (no remainder)", ("tests/engine/test_epilogue.py",)),
    Mutation(f"{E}/triton_backend/epilogue_sums.py", "        valid = inside & valid_mask(rows, c0 + local_c,",
             "        valid = inside & valid_mask(rows, local_c,", "epilogue: the exclusion rule read at the tile's own indices", EPILOGUE_TESTS),
    Mutation(f"{E}/triton_backend/_tile.py", "    return new_max, sum_a * tl.exp(max_a - safe) + sum_b * tl.exp(max_b - safe)",
             "    return new_max, sum_a + sum_b * tl.exp(max_b - safe)", "online maximum: a raised maximum does not rescale the running sum",
             ("tests/engine/test_epilogue.py", "tests/engine/test_triton.py")),
    Mutation(f"{E}/triton_backend/fold_partials.py", "    fold_running(max_ptr, sum_ptr, cols, c_in, run_max, run_sum, FIXED)", "    pass",
             "epilogue: column partials are never folded into the column statistics", ("tests/engine/test_epilogue.py",)),
    Mutation(f"{E}/planner.py", "            chosen = min((t, name) for name, t in predicted if allowed[name])[1]",
             "            chosen = max((t, name) for name, t in predicted if allowed[name])[1]",
             "planner: auto on a GPU takes the slowest predicted backend", ("tests/engine/test_planner.py",)),
    Mutation(f"{E}/planner.py", '            allowed = {"torch": True, "triton": served[0], "epilogue": served[1]}',
             '            allowed = {"torch": True, "triton": True, "epilogue": True}',
             "planner: auto picks a backend that cannot serve the call", ("tests/engine/test_planner.py",)),
    Mutation(f"{PKG}/cli/traffic.py", "            self.logit_bytes += sum(self._bytes(t) for t in (*reads, *writes))", "            pass",
             "cost counter: a Triton launch's declared bytes are not counted", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/planner.py",
             '        fold_positives=tile_positives or (decision.backend == "epilogue" and isinstance(positives, (KeyPositives, PartnerPositives))),',
             "        fold_positives=tile_positives,",
             "epilogue: the positive part goes through aggregate in backward (launches per call the kernels save)",
             ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/confident.py", '    if not isinstance(positives, PartnerPositives) or backend not in ("torch", "epilogue"):',
             '    if not isinstance(positives, PartnerPositives) or backend != "torch":',
             "epilogue: a lone positive is never kept apart (a confident model's LSE - S_p cancels in fp32)",
             ("tests/engine/test_epilogue.py",)),
    Mutation(f"{E}/epilogue.py", '            out["diagonal"] = plan.apart.k', "            pass",
             "epilogue: a positive kept apart stays in the kernels' sums", ("tests/engine/test_epilogue.py",)),
    Mutation(f"{E}/triton_backend/epilogue_sigmoid_grad.py", "    return part[: programs[0]].sum()", "    return part[:1].sum()",
             "epilogue SigLIP: the bias gradient from the first program's part only", EPILOGUE_TESTS),
    Mutation(f"{E}/triton_backend/epilogue_sigmoid_sums.py", "        pos = pos | (cols[None, :] == rows[:, None] + diagonal)",
             "        pos = pos", "epilogue SigLIP: the diagonal positives are scored as negatives", ("tests/engine/test_triton.py",)),
    Mutation(f"{E}/epilogue.py",
             "            tiles = prod.gradient_tiles(r1 - r0, c1 - c0, c1 - c0, isinstance(saved.scale, Tensor), s)\n"
             "            parts.append(",
             "            tiles = prod.gradient_tiles(r1 - r0, c1 - c0, c1 - c0, False, s)\n            parts.append(",
             "epilogue SigLIP: a learned scale's gradient from bf16-rounded gradient tiles only", EPILOGUE_TESTS),
    Mutation(f"{E}/epilogue.py", "    excluded = triton_backend.exclusion(Exclusion(relation=plan.positives))", "    excluded = {}",
             "epilogue PML NT-Xent: the positives stay in the negatives' log-sum-exp", ("tests/engine/test_triton.py",)),
    Mutation(f"{E}/triton_backend/pair_terms.py",
             "        grad = tl.where(pos, -tl.sigmoid(-s) * g0[:, None], tl.where(neg, tl.sigmoid(s) * g1[:, None], 0.0))",
             "        grad = tl.where(pos, -tl.sigmoid(-s) * g0[:, None], tl.where(neg, tl.sigmoid(s) * g0[:, None], 0.0))",
             "NT-BXent kernels: the negatives' gradient weighted by the positives' incoming gradient", EPILOGUE_TESTS),
    Mutation(f"{E}/planner.py", '    kind = traits.pairs or ("columns" if traits.columns else "rows")',
             '    kind = "columns" if traits.columns else "rows"', "planner: the pair terms priced as soft-max row terms",
             ("tests/engine/test_planner.py",)),
    # issue 36: every door refuses what cannot give a right result
    Mutation(f"{PKG}/modules.py", "            if temperature < MIN_LEARNABLE_TEMPERATURE:", "            if False:",
             "a learnable temperature may start below its clamp (it never moves)", ("tests/test_modules.py",)),
    Mutation(f"{PKG}/losses/info_nce.py", "    no_negatives = negatives is None or negatives.shape[-2] == 0",
             "    no_negatives = negatives is None", "an empty negatives pool without in-batch negatives is a silent 0",
             ("tests/losses/test_info_nce.py",)),
    Mutation(f"{PKG}/integrations/sentence_transformers.py", "    docs = _check_mnrl_inputs(queries, docs, similarity, chunk_size)",
             "    docs = list(docs)", "mnrl_loss: the non-default directions skip the input checks",
             ("tests/integrations/test_integrations.py",)),
    Mutation(f"{PKG}/engine/triton_backend/normalize_rows.py", "            squares += tl.sum(x * x, axis=1)",
             "            squares += tl.sum(x, axis=1)", "the row kernel sums the features instead of their squares",
             ("tests/engine/test_normalize_rows.py",)),
    Mutation(f"{PKG}/engine/triton_backend/normalize_rows_grad.py",
             "    radial = tl.where(norm <= eps, 0.0, radial)  # below the floor the map is x / eps: no radial part",
             "    radial = radial", "the row kernel's backward keeps the radial part below the floor",
             ("tests/engine/test_normalize_rows.py",)),
    Mutation(f"{PKG}/engine/triton_backend/normalize_rows_grad.py", "        g += tl.load(g2_ptr + at, mask=inside, other=0.0)",
             "        g += 0.0", "the row kernel's backward drops a single set's second accumulator",
             ("tests/engine/test_normalize_rows.py",)),
    Mutation(f"{PKG}/engine/triton_backend/normalize_rows_grad.py", "        factor = factor * tl.load(scale_ptr).to(tl.float32)",
             "        factor = factor", "the row kernel's backward ignores a tensor scale",
             ("tests/engine/test_normalize_rows.py",)),
    Mutation(f"{PKG}/engine/driver.py", "        a_c = normalize_rows(a, 0.0, norms[0])[0]", "        a_c = normalize_rows(a, 0.0)[0]",
             "backward rebuilds half rows with a zero floor instead of the saved denominators",
             ("tests/engine/test_normalize_rows.py",)),
    Mutation(f"{PKG}/cli/_paths.py", "        tempfile.TemporaryDirectory(dir=existing).cleanup()", "        pass",
             "--out is not probed for writability", ("tests/cli/test_paths.py",)),
    Mutation(f"{PKG}/cli/train.py", "    if n_train < 2 or n_test < 2:", "    if n_train < 1 or n_test < 1:",
             "train accepts a split with one image on a side (it dies in the embedding plot)", ("tests/cli/test_paths.py",)),
    Mutation(f"{PKG}/cli/train_command.py", "        if created:  # a run that fails", "        if False:  # a run that fails",
             "a failed training run leaves its half-written folder", ("tests/cli/test_paths.py",)),
    Mutation(f"{PKG}/cli/embed.py", "    except RuntimeError:  # the encoder's first", "    except KeyError:  # the encoder's first",
             "embed with a run that does not fit the data ends in a traceback", ("tests/cli/test_paths.py",)),
    Mutation(f"{PKG}/_validation.py", "                renamed = pattern.sub(lambda m: names[m.group(1)], message)",
             "                renamed = message", "a module's errors name the function's arguments, not the caller's",
             ("tests/test_entry_points.py",)),
    Mutation(f"{PKG}/_validation.py", '    if "non-finite" in str(err):', "    if False:",
             "a non-finite row of a stacked input is named by the stacked tensor", ("tests/test_entry_points.py",)),
    Mutation(f"{PKG}/options.py", '        for name in ("normalize", "gather", "validate"):', "        for name in ():",
             "a bool option given as a string reads as a silent True", ("tests/test_entry_points.py",)),
    Mutation(f"{PKG}/losses/_pairing.py", "    if n_rows % 2:", "    if False:",
             "pair_keys keys an odd number of rows", ("tests/test_entry_points.py",)),
    Mutation(f"{PKG}/integrations/sentence_transformers.py", "    if not isinstance(model, nn.Module):", "    if False:",
             "the sentence-transformers losses take any object as their model", ("tests/test_entry_points.py",)),
    Mutation(f"{PKG}/cli/bench.py", "    if problem:  # before the output folder is made",
             "    out_dir.mkdir(parents=True, exist_ok=True)\n    if problem:",
             "bench writes its output folder before refusing a bad grid", ("tests/test_entry_points.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "    fresh = torch.logaddexp(old + math.log1p(-gamma), log_g + math.log(gamma))",
             "    fresh = torch.logaddexp(old + math.log(gamma), log_g + math.log1p(-gamma))",
             "global loss: the moving average's weights swapped", ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "    return torch.where(torch.isneginf(old), log_g, fresh)", "    return fresh",
             "global loss: a first visit mixes with an empty state instead of taking the batch's estimate",
             ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py",
             "    new_log_u = torch.stack([torch.logaddexp(log_u1, log_u2) - math.log(2.0), torch.full_like(log_u1, -math.inf)], 1)",
             "    new_log_u = torch.stack([log_u1, torch.full_like(log_u1, -math.inf)], 1)",
             "global loss (unimodal): the stored state is the first view's only", ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "    w_img, w_txt = torch.exp(d_img.detach() - log_u_img), torch.exp(d_txt.detach() - log_u_txt)",
             "    w_img, w_txt = torch.exp(d_img.detach()), torch.exp(d_txt.detach() - log_u_txt)",
             "global loss (bimodal): the image anchors' weights ignore the state", ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "            if repeats:", "            if False:",
             "global loss: a batch may repeat an index (two updates of one state collide)",
             ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "    moving = (1.0 - rule.beta) * state_grad + rule.beta * grad",
             "    moving = rule.beta * state_grad + (1.0 - rule.beta) * grad",
             "iSogCLR: the temperatures' moving gradient weighs the old gradient by beta", ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "    grad = log_ur + call.rule.rho - c * expected",
             "    grad = log_ur + call.rule.rho - expected",
             "iSogCLR (unimodal): the temperature gradient drops the negatives' weights g / u", ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/losses/global_contrastive.py", "        objective = tau * (call.rule.rho * n + (log_u_img.sum() + log_u_txt.sum()) / 2)",
             "        objective = tau.detach() * (call.rule.rho * n + (log_u_img.sum() + log_u_txt.sum()) / 2)",
             "RGCL-g: the global temperature misses the rho + log u part of its gradient", ("tests/losses/test_global_contrastive.py",)),
    Mutation(f"{PKG}/cli/train.py",
             "                      image_index * CAPTIONS_PER_IMAGE + torch.arange(CAPTIONS_PER_IMAGE).repeat_interleave(len(batch)))",
             "                      image_index)",
             "fastclip on digits: an image's two captions share one state row", ("tests/cli/test_train.py",)),
    Mutation(f"{PKG}/cli/train_command.py",
             "    if cfg.loss not in GLOBAL and (cfg.temperature_mode != \"auto\" or cfg.gamma_schedule != \"constant\"):",
             "    if False:", "a global-loss option on another recipe is silently ignored",
             ("tests/cli/test_train.py",)),
    Mutation(f"{PKG}/integrations/sentence_transformers.py",
             'SYMMETRIC_DIRECTIONS, SYMMETRIC_PARTITION = ("query_to_doc", "doc_to_query"), "per_direction"',
             'SYMMETRIC_DIRECTIONS, SYMMETRIC_PARTITION = ("query_to_doc", "doc_to_query"), "joint"',
             "the symmetric ranking loss takes one log-sum over both directions", ("tests/integrations/test_integrations.py",)),
    Mutation(f"{E}/cost.py", "    return max(sum(terms(counts, gpu)), host_time(counts, gpu, ours))",
             "    return sum(terms(counts, gpu)) + host_time(counts, gpu, ours)",
             "a call costs device and host time added, not the longer of the two", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/cost.py", "    return (g.host_call if ours else 0.0) + (counts.launches - k) * g.host_op + k * g.host_kernel",
             "    return (g.host_call if ours else 0.0) + counts.launches * g.host_op",
             "a Triton launch costs the host what an eager op does", ("tests/cli/test_traffic.py",)),
    Mutation(f"{E}/cost.py", "    return max(device, g.host_call + (launches - launched) * g.host_op + launched * g.host_kernel)",
             "    return device",
             "the planner prices the device alone (no host terms)", ("tests/engine/test_planner.py",)),
    Mutation(f"{E}/cost.py", "    call, kernel = (b1 * skk - bk * s1k) / det, (s11 * bk - s1k * b1) / det",
             "    kernel, call = (b1 * skk - bk * s1k) / det, (s11 * bk - s1k * b1) / det",
             "the host fit swaps the per-call and the per-Triton-launch costs", ("tests/cli/test_traffic.py",)),
    Mutation(f"{PKG}/_validation.py", '    check_same_device(emb, "memory_emb", device)\n', "",
             "a memory on another device than the batch is not refused", ("tests/test_validation.py",)),
    Mutation(f"{E}/triton_backend/_configs.py", "    if not tuning():\n        return [min(configs, key=lambda c: (_side(c), c.num_stages))]\n", "",
             "TORCH_CONTRASTIVE_AUTOTUNE=0 still times every config", ("tests/engine/test_triton.py",)),
]


def run_one(index: int, m: Mutation, python: str) -> tuple[str, str, float]:
    """Apply mutation ``index`` in a scratch copy and run its tests: (status, first failure, seconds)."""
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        scratch = Path(tmp)
        for part in ("src", "tests", "examples"):
            shutil.copytree(ROOT / part, scratch / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copy(ROOT / "pyproject.toml", scratch / "pyproject.toml")
        target = scratch / m.path
        text = target.read_text()
        if text.count(m.before) != 1:
            return "stale", f"snippet found {text.count(m.before)} times in {m.path}", 0.0
        target.write_text(text.replace(m.before, m.after))
        env = {**os.environ, "PYTHONPATH": str(scratch / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.perf_counter()
        out = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                             cwd=scratch, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if out.returncode == 0:
        return "SURVIVED", "", seconds
    failed = [line.split(" ")[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")]
    return "killed", (failed[0] if failed else out.stdout.strip().splitlines()[-1])[:90], seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, nargs="*", help="mutation numbers (1-based)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--python", default=sys.executable, help="interpreter with the test dependencies")
    args = parser.parse_args()
    chosen = args.only or list(range(1, len(MUTATIONS) + 1))
    if args.list:
        for i in chosen:
            m = MUTATIONS[i - 1]
            print(f"{i:>2} {m.path}: {m.what}\n     - {m.before.strip()}\n     + {m.after.strip()}")
        return 0
    rows = []
    for i in chosen:
        m = MUTATIONS[i - 1]
        status, failure, seconds = run_one(i, m, args.python)
        print(f"[{i}/{len(MUTATIONS)}] {status:<8} {seconds:6.1f}s  {m.what}  {failure}", flush=True)
        rows.append((i, m, status, failure))
    print("\n| # | file | mutation | result | first failing test |")
    print("|---|---|---|---|---|")
    for i, m, status, failure in rows:
        note = failure or m.reason or "**needs a test**"
        print(f"| {i} | `{m.path.removeprefix(PKG + '/')}` | {m.what} | {status} | {note} |")
    bad = [i for i, m, status, _ in rows if status in ("SURVIVED", "stale") and not m.reason]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutations killed or explained" + (f"; unexplained: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
