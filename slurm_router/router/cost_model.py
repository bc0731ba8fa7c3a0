"""The cost of a packed row, fit from measured step times (RouterSettings.row_cost="fitted", packed mode).

    compute_s(device d, step) = k_d * sum over the device's rows of
                                (per_token_s * tokens + per_len2_s * sum_i len_i^2 + fixed_s)

tokens: the row's real tokens (the linear layers, the loss); sum_i len_i^2: attention, each sample attending only
within itself; fixed: what one micro-batch costs whatever it holds (a forward and backward's launches and Python).
k_d is the device's own slowness: a nuisance term of the fit, so that unequal devices do not bend the shape (the
router's speed model goes on scaling plans per device, as it does for any cost).

The fit: one row per (device, step), its features summed over the rows the device ran and its compute seconds.
Alternating least squares: given the k_d, the three terms are non-negative least squares (memory_model's _nnls3)
on the rows k_d * (tokens, sum len^2, rows); given the terms, each k_d is its device's own least-squares scale
(normalised to a geometric mean of 1). Only a device's changes from step to step say anything about the shape:
its level is its k_d. Every rank fits the same rows in the same order, so every rank plans with the same terms.

What the router plans with is the shape in token units: a sample costs len + (per_len2_s / per_token_s) len^2
(cost=tokens_attention) and a row adds fixed_s / per_token_s tokens (microbatch_overhead_tokens). Until
_MIN_ROWS rows are in, or when a fit finds no per-token term, the configured values hold. After that, each term
moves from its configured value only as far as the data show it, as the robust speed model does: its offset
times max(0, 1 - z^2 v / offset^2), v the term's variance (the residual variance over the information about the
term once every device's k_d is profiled out), z = _Z. Noisy steps whose tokens barely change from one to the
next (what identifies the fixed cost) keep the configured values; clear evidence replaces them.

A refit runs once per step, at the plan after new rows: a median 0.6-1.5 ms here from 2 to 512 devices (at most
the first _FIT_DEVICES devices' rows are fitted), up to ~9 ms for the first fit, which starts cold.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import NamedTuple

from .memory_model import _nnls3
from .types import RouterSettings

_WINDOW = 32  # steps kept per device
_FIT_DEVICES = 4  # the first devices' rows are fitted (the shape is every device's): bounds the fit at scale
_MIN_ROWS = 8  # rows (device-steps) before the fit replaces the configured values
_ALS_ITERS = 4  # alternations at most per refit (warm-started from the last fit: the next refit goes on)
_ALS_TOL = 1e-3  # stop alternating when the token-unit terms move less than this, relatively
_Z = 2.0  # a term leaves its configured value by the part of its offset beyond ~2 standard errors


class RowFit(NamedTuple):
    """A fit: the terms in seconds (at k_d = 1), the shape in tokens, and the variances of the shape's terms."""

    per_token_s: float
    per_len2_s: float
    fixed_s: float
    per_len2_tokens: float  # per_len2_s / per_token_s
    fixed_tokens: float  # fixed_s / per_token_s
    var_per_len2: float
    var_fixed: float


class RowCostModel:
    """Per-device windows of (tokens, sum len^2, rows, compute_s) and the row terms fit to them."""

    def __init__(self, n_devices: int, window: int = _WINDOW) -> None:
        self.n_devices, self.window = n_devices, window
        self._rows: list[deque[tuple[float, ...]]] = [deque(maxlen=window) for _ in range(min(n_devices, _FIT_DEVICES))]
        self._k = [1.0] * len(self._rows)  # the fitted devices' slowness, warm start of the next fit
        self._fit: RowFit | None = None
        self._warm = False  # the k_d come from a previous refit
        self._dirty = False

    def observe(self, device: int, tokens: int, len2: int, n_rows: int, compute_s: float) -> None:
        """One device's step: it ran n_rows rows of `tokens` real tokens (sum of squared sample lengths `len2`)
        in compute_s seconds. An idle device or a clock glitch carries nothing."""
        if device >= _FIT_DEVICES or n_rows <= 0 or tokens <= 0 or not compute_s > 0 or not math.isfinite(compute_s):
            return  # a device past the fitted ones (its rows would only fill the checkpoint), or nothing learned
        self._rows[device].append((float(tokens), float(len2), float(n_rows), float(compute_s)))
        self._dirty = True

    def fit(self) -> RowFit | None:
        """The fit of the rows so far (refit when rows came in), or None before enough rows or without a
        per-token term."""
        if self._dirty:
            self._dirty = False
            self._fit = self._refit()
        return self._fit

    def token_terms(self, prior: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """(attention per len^2, fixed per row) in tokens, None before a fit. With prior (the configured terms),
        each moves from it only as far as the data show (the module's shrinkage)."""
        f = self.fit()
        if f is None:
            return None
        if prior is None:
            return f.per_len2_tokens, f.fixed_tokens
        return _shrink(f.per_len2_tokens, f.var_per_len2, prior[0]), _shrink(f.fixed_tokens, f.var_fixed, prior[1])

    def settings_for(self, settings: RouterSettings) -> RouterSettings:
        """`settings` with the fitted terms in the knobs the policies read, or unchanged before a fit."""
        attention = (
            settings.attention_weight / settings.attention_ref_len if settings.cost == "tokens_attention" else 0.0
        )
        terms = self.token_terms((attention, float(settings.microbatch_overhead_tokens)))
        if terms is None:
            return settings
        per_len2, fixed = terms
        return dataclasses.replace(
            settings,
            cost="tokens_attention",
            attention_weight=per_len2 * settings.attention_ref_len,
            microbatch_overhead_tokens=int(round(fixed)),
        )

    def _refit(self) -> RowFit | None:
        devices = [d for d in range(len(self._rows)) if self._rows[d]]
        rows = {d: list(self._rows[d]) for d in devices}
        if sum(map(len, rows.values())) < _MIN_ROWS:
            return None
        if not self._warm:  # nothing to start from: each device's seconds per token, a first guess at k_d
            k = {d: math.fsum(r[3] for r in rows[d]) / math.fsum(r[0] for r in rows[d]) for d in devices}
            self._warm = True
        else:
            k = {d: self._k[d] for d in devices}
        ys = [r[3] for d in devices for r in rows[d]]
        shape = None
        for _ in range(_ALS_ITERS):
            coef = _nnls3([(k[d] * t, k[d] * q, k[d] * m) for d in devices for t, q, m, _ in rows[d]], ys)
            if coef is None:
                return None
            a, b, c = coef
            for d in devices:
                preds = [(a * t + b * q + c * m, y) for t, q, m, y in rows[d]]
                pp = math.fsum(p * p for p, _ in preds)
                if pp > 0:
                    k[d] = math.fsum(p * y for p, y in preds) / pp
            g = math.exp(math.fsum(math.log(v) for v in k.values() if v > 0) / len(k))
            k = {d: (v / g if v > 0 else 1.0) for d, v in k.items()}
            new_shape = (b, c) if a <= 0 else (b / a, c / a)
            if shape is not None and all(abs(n - o) <= _ALS_TOL * max(abs(o), 1e-12) for n, o in zip(new_shape, shape)):
                break
            shape = new_shape
        for d, v in k.items():
            self._k[d] = v
        if a <= 0:  # no per-token term (yet): nothing to express in tokens; the next refit goes on from here
            return None
        var_len2, var_fixed = _shape_variances(rows, {d: k[d] * a for d in devices}, b / a, c / a)
        return RowFit(a, b, c, b / a, c / a, var_len2, var_fixed)

    # ---- checkpoints (JSON-serialisable) -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"window": self.window, "rows": [[list(r) for r in rows] for rows in self._rows], "k": list(self._k)}

    def load_state_dict(self, d: dict) -> None:
        """A requeued job may come back with another device count: the devices that overlap keep their rows."""
        n = min(self.n_devices, _FIT_DEVICES)
        rows = [deque((tuple(float(x) for x in r) for r in rs), self.window) for rs in d.get("rows", [])][:n]
        self._rows = rows + [deque(maxlen=self.window) for _ in range(n - len(rows))]
        k = [float(x) for x in d.get("k", [])][:n]
        self._k = k + [1.0] * (n - len(k))
        self._fit = None
        self._warm = bool(d.get("k"))
        self._dirty = True


def _shape_variances(
    rows: dict[int, list[tuple[float, ...]]], scale: dict[int, float], r_len2: float, r_fixed: float
) -> tuple[float, float]:
    """Variances of the token-unit terms of y = K_d (tokens + r_len2 len2 + r_fixed rows): the residual variance
    times the inverse of their information with each device's K_d profiled out (Gauss-Newton at the fit)."""
    sse, n = 0.0, 0
    i11 = i12 = i22 = 0.0
    for d, rs in rows.items():
        kd = scale[d]
        s11 = s12 = s22 = su1 = su2 = suu = 0.0
        for t, q, m, y in rs:
            u = t + r_len2 * q + r_fixed * m  # dy/dK_d
            z1, z2 = kd * q, kd * m  # dy/dr_len2, dy/dr_fixed
            sse += (y - kd * u) ** 2
            s11, s12, s22 = s11 + z1 * z1, s12 + z1 * z2, s22 + z2 * z2
            su1, su2, suu = su1 + z1 * u, su2 + z2 * u, suu + u * u
            n += 1
        if suu > 0:
            s11, s12, s22 = s11 - su1 * su1 / suu, s12 - su1 * su2 / suu, s22 - su2 * su2 / suu
        i11, i12, i22 = i11 + s11, i12 + s12, i22 + s22
    dof = n - 2 - len(rows)
    det = i11 * i22 - i12 * i12
    if dof <= 0 or det <= 1e-12 * max(i11 * i22, 1e-300):
        return math.inf, math.inf
    s2 = sse / dof
    return s2 * i22 / det, s2 * i11 / det


def _shrink(value: float, var: float, prior: float) -> float:
    """prior + the offset times max(0, 1 - z^2 var / offset^2): the configured value until the data stand out."""
    off = value - prior
    if off == 0 or not math.isfinite(var):
        return prior if not math.isfinite(var) else value
    return prior + off * max(0.0, 1.0 - _Z * _Z * var / (off * off))
