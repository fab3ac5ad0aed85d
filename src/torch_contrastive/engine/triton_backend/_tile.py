"""What every kernel does inside one tile, in registers: the logits (a GEMM loop over D with fp32 accumulation;
:func:`gemm_tile`, the fused matmul's, with a GEMM's unmasked loads), the exclusion rule, the validity mask, the
gradient tile, and which tile a program of a grouped grid owns."""

from __future__ import annotations

from ._host import tl, triton


@triton.jit
def logits(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
           PRECISION: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) tile of X @ Y.T (accumulated in ACC) for the given rows and columns
    (contiguous operands: a row's stride is ``d``)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    for k0 in range(0, d, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + rows[:, None] * d + ks[None, :], mask=(rows[:, None] < n_rows) & (ks[None, :] < d), other=0.0)
        y = tl.load(y_ptr + cols[:, None] * d + ks[None, :], mask=(cols[:, None] < n_cols) & (ks[None, :] < d), other=0.0)
        acc += tl.dot(x, tl.trans(y), out_dtype=ACC, input_precision=PRECISION)
    return acc


@triton.jit
def gemm_tile(x_ptr, y_ptr, rows, cols, n_rows, n_cols, d, EVEN_D: tl.constexpr, ACC: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """``X[rows] @ Y[cols].T`` over D, as a GEMM's main loop: rows past the end read row 0 (always there) and are
    left out by the caller, so only a ragged last slice of D is masked."""
    safe_r = tl.where(rows < n_rows, rows, 0)
    safe_c = tl.where(cols < n_cols, cols, 0)
    ks = tl.arange(0, BLOCK_D)
    x_at = x_ptr + safe_r[:, None] * d + ks[None, :]
    y_at = y_ptr + safe_c[:, None] * d + ks[None, :]
    acc = tl.zeros((BLOCK, BLOCK), dtype=ACC)
    for k0 in range(0, d, BLOCK_D):
        if EVEN_D:
            x = tl.load(x_at)
            y = tl.load(y_at)
        else:
            x = tl.load(x_at, mask=ks[None, :] < d - k0, other=0.0)
            y = tl.load(y_at, mask=ks[None, :] < d - k0, other=0.0)
        acc = tl.dot(x, tl.trans(y), acc, out_dtype=ACC, input_precision=PRECISION)
        x_at += BLOCK_D
        y_at += BLOCK_D
    return acc


@triton.jit
def with_factors(s, rows, cols, n_rows, n_cols, fx_ptr, fy_ptr):
    """``s * fx_i * fy_j``: the normalisation and the scale applied to the fp32 logit tile of the
    caller's own half-precision rows (never ``x / ||x||`` rounded to half, an error the
    temperature multiplies); ``s`` unchanged without factors (None)."""
    if fx_ptr is not None:
        fx = tl.load(fx_ptr + rows, mask=rows < n_rows, other=0.0)
        fy = tl.load(fy_ptr + cols, mask=cols < n_cols, other=0.0)
        s = s * fx[:, None] * fy[None, :]
    return s


@triton.jit
def fold_columns(g, cols, n_cols, f_ptr):
    """``g * f_j``: a column factor folded into a gradient tile before it is rounded for a product."""
    if f_ptr is not None:
        f = tl.load(f_ptr + cols, mask=cols < n_cols, other=0.0)
        g = g * f[None, :]
    return g


@triton.jit
def fold_rows(g, rows, n_rows, f_ptr):
    """``f_i * g``: a row factor folded into a gradient tile before it is rounded for a product."""
    if f_ptr is not None:
        f = tl.load(f_ptr + rows, mask=rows < n_rows, other=0.0)
        g = g * f[:, None]
    return g


@triton.jit
def store_gradient_tiles(g, local_r, local_c, tile_rows, tile_cols, col_width, rows_ptr, low_ptr, cols_ptr, fy_ptr, fz_ptr,
                         ACC: tl.constexpr):
    """An epilogue's gradient tile, written once in the GEMM operand dtype: ``G diag(fy)`` for the row
    product (and its rounding remainder when ``low_ptr`` is given), ``diag(fz) G`` for the column
    product over its first ``col_width`` columns when ``cols_ptr`` is given (row-major, widths
    ``tile_cols`` and ``col_width``)."""
    inside = (local_r[:, None] < tile_rows) & (local_c[None, :] < tile_cols)
    at = local_r[:, None] * tile_cols + local_c[None, :]
    g_rows = fold_columns(g, local_c, tile_cols, fy_ptr)
    high = g_rows.to(rows_ptr.dtype.element_ty)
    tl.store(rows_ptr + at, high, mask=inside)
    if low_ptr is not None:  # the rounding remainder of the row product's tile
        tl.store(low_ptr + at, (g_rows - high.to(ACC)).to(low_ptr.dtype.element_ty), mask=inside)
    if cols_ptr is not None:
        g_cols = fold_rows(g, local_r, tile_rows, fz_ptr)
        tl.store(cols_ptr + local_r[:, None] * col_width + local_c[None, :], g_cols.to(cols_ptr.dtype.element_ty),
                 mask=(local_r[:, None] < tile_rows) & (local_c[None, :] < col_width))


@triton.jit
def softplus(x):
    """``max(x, 0) + log1p(exp(-|x|))`` with ``log1p`` by Kahan's trick (exact for tiny
    arguments): a confident pair's small term is kept, never rounded to 0; ``softplus(-inf) = 0``."""
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    small = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.maximum(x, 0.0) + small


@triton.jit
def peaks(g, AXIS: tl.constexpr):
    """The largest magnitude along ``AXIS`` (1 where every entry is 0): fp16 gradient tiles
    (``FACTORS == 2``) are divided by it per output row before rounding, the product multiplied back."""
    m = tl.max(tl.abs(g), axis=AXIS)
    return tl.where(m > 0, m, 1.0)


@triton.jit
def scatter_products(g, rows, cols, d, y_ptr, z_ptr, ga_ptr, gb_ptr, row_ok, col_ok, out_ok, n_rows, n_cols, fy_ptr, fz_ptr,
                     FACTORS: tl.constexpr, COLUMNS: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """A gradient tile's two products, D block by D block, added with atomics: ``G diag(fy) @ Y``
    into its rows of ``ga`` and -- with ``COLUMNS`` -- ``(diag(fz) G).T @ Z`` into the rows of
    ``gb`` named by its columns where ``out_ok`` (the first ``grad_columns``; a single set's
    mirror rows, ``gb`` being ``ga``). ``row_ok`` / ``col_ok``: the tile's rows / columns in bounds."""
    g_rows = fold_columns(g, cols, n_cols, fy_ptr)
    g_cols = fold_rows(g, rows, n_rows, fz_ptr)
    if FACTORS == 2:  # fp16: each output row's entries scaled to <= 1 before rounding
        peak_r = peaks(g_rows, 1)
        g_rows = g_rows / peak_r[:, None]
        peak_c = peaks(g_cols, 0)
        g_cols = g_cols / peak_c[None, :]
    for k0 in range(0, d, BLOCK_D):
        ks = k0 + tl.arange(0, BLOCK_D)
        k_ok = ks < d
        y = tl.load(y_ptr + cols[:, None] * d + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(g_rows.to(y.dtype), y, out_dtype=ACC, input_precision=PRECISION)
        if FACTORS == 2:
            part = part * peak_r[:, None]
        tl.atomic_add(ga_ptr + rows[:, None] * d + ks[None, :], part, mask=row_ok[:, None] & k_ok[None, :], sem="relaxed")
        if COLUMNS:
            z = tl.load(z_ptr + rows[:, None] * d + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            part_t = tl.dot(tl.trans(g_cols.to(z.dtype)), z, out_dtype=ACC, input_precision=PRECISION)
            if FACTORS == 2:
                part_t = part_t * peak_c[:, None]
            tl.atomic_add(gb_ptr + cols[:, None] * d + ks[None, :], part_t, mask=out_ok[:, None] & k_ok[None, :],
                          sem="relaxed")


@triton.jit
def owned_product(acc, grad, rows, cols, ds, n_rows, n_cols, d, y_ptr, z_ptr, fy_ptr, fz_ptr,
                  FACTORS: tl.constexpr, COLUMNS: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """One step of a deterministic gradient: ``acc + G diag(fy) @ Y[cols, ds]`` for a program that owns
    rows, or (``COLUMNS``) ``acc + (diag(fz) G).T @ Z[rows, ds]`` for one that owns columns."""
    if COLUMNS:
        g = tl.trans(fold_rows(grad, rows, n_rows, fz_ptr))
        operand = tl.load(z_ptr + rows[:, None] * d + ds[None, :], mask=(rows[:, None] < n_rows) & (ds[None, :] < d),
                          other=0.0)
    else:
        g = fold_columns(grad, cols, n_cols, fy_ptr)
        operand = tl.load(y_ptr + cols[:, None] * d + ds[None, :], mask=(cols[:, None] < n_cols) & (ds[None, :] < d),
                          other=0.0)
    if FACTORS == 2:  # fp16: each output row's entries scaled to <= 1 before rounding
        peak = peaks(g, 1)
        acc += tl.dot((g / peak[:, None]).to(operand.dtype), operand, out_dtype=ACC, input_precision=PRECISION) * peak[:, None]
    else:
        acc += tl.dot(g.to(operand.dtype), operand, out_dtype=ACC, input_precision=PRECISION)
    return acc


@triton.jit
def related(rows, cols, r_ok, c_ok, rk0, ck0, rk1, ck1, partner):
    """(rows, cols) bool: any of the given id keys (``rk0 / ck0``, ``rk1 / ck1``) equal, or the
    column is the row's ``partner``; out-of-bounds entries never match (all None: nothing)."""
    out = (rows[:, None] < 0) & (cols[None, :] < 0)  # all False
    if rk0 is not None:
        a0 = tl.load(rk0 + rows, mask=r_ok, other=-1)
        b0 = tl.load(ck0 + cols, mask=c_ok, other=-2)
        out = out | (a0[:, None] == b0[None, :])
    if rk1 is not None:
        a1 = tl.load(rk1 + rows, mask=r_ok, other=-1)
        b1 = tl.load(ck1 + cols, mask=c_ok, other=-2)
        out = out | (a1[:, None] == b1[None, :])
    if partner is not None:
        p = tl.load(partner + rows, mask=r_ok, other=-1)
        out = out | (cols[None, :] == p[:, None])
    return out


@triton.jit
def _first_at_least(pair_col, lo, hi, value):
    """Per row: the first index in ``[lo, hi)`` whose listed column is ``>= value`` (``hi`` if
    none) -- a binary search over each row's sorted columns, all rows of the tile at once."""
    while tl.max(hi - lo, axis=0) > 0:
        busy = lo < hi
        mid = (lo + hi) // 2
        c = tl.load(pair_col + mid, mask=busy, other=0)
        right = busy & (c < value)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(busy & ~right, mid, hi)
    return lo


@triton.jit
def listed(rows, cols, r_ok, pair_ptr, pair_col):
    """(rows, cols) bool: the pair ``(row, col)`` is on the caller's list, stored per row as sorted
    columns ``pair_col[pair_ptr[r]:pair_ptr[r + 1]]`` (:attr:`Positives.row_lists`).

    An arbitrary list has no in-register rule, and "every pair minus the listed ones" loses a
    confident model's tiny negative terms, so membership is tested: each row's columns inside
    this tile's column range are found by binary search, then compared with the tile's columns
    one listed column per row at a time -- at most min(most listed in one row, tile width)
    compares of the tile, and no scratch beyond the O(P) list."""
    c_lo = tl.min(cols, axis=0)
    c_hi = tl.max(cols, axis=0) + 1
    start = tl.load(pair_ptr + rows, mask=r_ok, other=0)
    stop = tl.load(pair_ptr + rows + 1, mask=r_ok, other=0)
    first = _first_at_least(pair_col, start, stop, c_lo)
    last = _first_at_least(pair_col, first, stop, c_hi)
    out = (rows[:, None] < 0) & (cols[None, :] < 0)  # all False
    for k in range(0, tl.max(last - first, axis=0)):
        at = first + k
        c = tl.load(pair_col + at, mask=at < last, other=-1)
        out = out | (cols[None, :] == c[:, None])
    return out


@triton.jit
def excluded(orow, ocol, n_orows, n_ocols, excl, GACC: tl.constexpr, OM: tl.constexpr, ON: tl.constexpr,
             PRECISION: tl.constexpr):
    """(OM, ON) bool, in the problem's own orientation: candidate ``ocol_j`` leaves anchor
    ``orow_i``'s log-sum-exp -- ``(keys | partner | guide) & ~kept diagonal | diagonal``,
    the same rule as :class:`~torch_contrastive.positives.Exclusion`. ``excl`` is the exclusion as one tuple
    (:data:`~._host.EXCLUSION_FIELDS`: ``rk0, ck0, rk1, ck1, partner, g_rows, g_cols, threshold, dg, diagonal,
    keep_diagonal``; None where absent): one kernel argument instead of eleven."""
    r_ok = orow < n_orows
    c_ok = ocol < n_ocols
    out = related(orow, ocol, r_ok, c_ok, excl[0], excl[1], excl[2], excl[3], excl[4])
    if excl[5] is not None:  # contiguous guide rows (g_rows, g_cols): a row's stride is dg
        g = tl.zeros((OM, ON), dtype=GACC)
        for k0 in range(0, excl[8], 16):
            ks = k0 + tl.arange(0, 16)
            u = tl.load(excl[5] + orow[:, None] * excl[8] + ks[None, :], mask=r_ok[:, None] & (ks[None, :] < excl[8]),
                        other=0.0)
            v = tl.load(excl[6] + ocol[:, None] * excl[8] + ks[None, :], mask=c_ok[:, None] & (ks[None, :] < excl[8]),
                        other=0.0)
            g += tl.dot(u, tl.trans(v), out_dtype=GACC, input_precision=PRECISION)
        t = tl.load(excl[7] + orow, mask=r_ok, other=0.0)
        out = out | (g > t[:, None])
    if excl[10] is not None:  # keep_diagonal: the positive itself never leaves
        out = out & (ocol[None, :] != orow[:, None] + excl[10])
    if excl[9] is not None:  # diagonal: DCL's positive as a strided diagonal
        out = out | (ocol[None, :] == orow[:, None] + excl[9])
    return out


@triton.jit
def valid_mask(rows, cols, n_rows, n_cols, self_offset, excl, EXCLUDE: tl.constexpr, TRANSPOSED: tl.constexpr,
               GACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """(BLOCK_M, BLOCK_N) bool: in bounds, not a self pair (``self_offset`` None: none), not
    excluded. Kernel rows and columns are the problem's columns and rows when ``TRANSPOSED`` (a
    pass over ``S.T``)."""
    valid = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    if self_offset is not None:
        valid = valid & (cols[None, :] != rows[:, None] + self_offset)
    if EXCLUDE:
        if TRANSPOSED:
            out = tl.trans(excluded(cols, rows, n_cols, n_rows, excl, GACC, BLOCK_N, BLOCK_M, PRECISION))
        else:
            out = excluded(rows, cols, n_rows, n_cols, excl, GACC, BLOCK_M, BLOCK_N, PRECISION)
        valid = valid & ~out
    return valid


@triton.jit
def gradient_tile(s, rows, cols, n_rows, n_cols, lse_r_ptr, u_ptr, lse_c_ptr, v_ptr):
    """``G_ij = u_i exp(S_ij - L_i) (+ v_j exp(S_ij - M_j)`` when the column terms are given); a
    row (column) whose log-sum-exp is ``-inf`` has no candidate and no gradient."""
    row_ok = rows < n_rows
    lse_r = tl.load(lse_r_ptr + rows, mask=row_ok, other=0.0)
    u = tl.load(u_ptr + rows, mask=row_ok, other=0.0)
    u = tl.where(lse_r == float("-inf"), 0.0, u)
    lse_r = tl.where(lse_r == float("-inf"), 0.0, lse_r)
    g = u[:, None] * tl.exp(s - lse_r[:, None])
    if lse_c_ptr is not None:
        col_ok = cols < n_cols
        lse_c = tl.load(lse_c_ptr + cols, mask=col_ok, other=0.0)
        v = tl.load(v_ptr + cols, mask=col_ok, other=0.0)
        v = tl.where(lse_c == float("-inf"), 0.0, v)
        lse_c = tl.where(lse_c == float("-inf"), 0.0, lse_c)
        g += v[None, :] * tl.exp(s - lse_c[None, :])
    return g


@triton.jit
def block_stats(s, AXIS: tl.constexpr):
    """(maximum, ``sum exp(s - maximum)``) of a block along ``AXIS`` (left-out entries at ``-inf``;
    a line without entries: ``-inf`` and 0)."""
    m = tl.max(s, axis=AXIS)
    safe = tl.where(m == float("-inf"), 0.0, m)
    shifted = s - (safe[:, None] if AXIS == 1 else safe[None, :])
    return m, tl.sum(tl.exp(shifted), axis=AXIS)


@triton.jit
def merged(max_a, sum_a, max_b, sum_b):
    """Two (maximum, shifted exp-sum) statistics of the same entries' parts as one: the online
    maximum's step (a part without entries has maximum ``-inf`` and sum 0)."""
    new_max = tl.maximum(max_a, max_b)
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, sum_a * tl.exp(max_a - safe) + sum_b * tl.exp(max_b - safe)


@triton.jit
def fold_running(max_ptr, sum_ptr, at, ok, part_max, part_sum, FIXED: tl.constexpr):
    """Add a part into running statistics in memory (``at``, where ``ok``), whose only writer in this
    launch is the caller: plain sums in the bounded regime, :func:`merged` otherwise."""
    old_sum = tl.load(sum_ptr + at, mask=ok, other=0.0)
    if FIXED:
        tl.store(sum_ptr + at, old_sum + part_sum, mask=ok)
    else:
        old_max = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
        new_max, new_sum = merged(old_max, old_sum, part_max, part_sum)
        tl.store(sum_ptr + at, new_sum, mask=ok)
        tl.store(max_ptr + at, new_max, mask=ok)


@triton.jit
def tile_of(n_rows, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """``(row block, column block)`` of this program in grouped order: ``GROUP`` row blocks
    sweep the column blocks together, so their column operands are reused from L2."""
    pid = tl.program_id(0)
    n_bi = tl.cdiv(n_rows, BLOCK)
    n_bj = tl.cdiv(n_cols, BLOCK)
    in_group = GROUP * n_bj
    first = (pid // in_group) * GROUP
    size = tl.minimum(n_bi - first, GROUP)
    bi = first + (pid % in_group) % size
    bj = (pid % in_group) // size
    return bi, bj
