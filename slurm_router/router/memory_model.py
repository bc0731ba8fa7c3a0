"""Predicted peak memory of one micro-batch, seeded from model sizes and refit online from observed peaks.

    peak_bytes = scale * (fixed_bytes + per_token_bytes * padded_tokens + per_len2_bytes * n_samples * max_len^2)

The fixed term is weights + gradients + optimizer state; the per-token term is activations and logits; the
length^2 term is eager attention scores (near zero with flash / SDPA kernels, which the online fit discovers).
`scale` >= 1 is what an out-of-memory error teaches: the prediction for the size that failed is lifted above
the limit it hit. One model is shared by all devices of a job: they train the same variant, so the bytes per
token are the same; what differs per device is the budget, which the Router keeps.

The seed (from_model_bytes), before anything is measured, and its bound (tests/test_hf_models.py checks it on
GPT-2- and Llama-shaped models built on the meta device, frozen weights in fp32 and in bf16):
- fixed: exactly the bytes of the weights, each at its own dtype, plus the gradients and Adam's m and v of the
  trainable ones (as the trainable weights: fp32), plus workspace_bytes (a worker's: the bf16 copies autocast
  makes of fp32 frozen weights, which backward keeps);
- activations (per token and per len^2): within a factor of 2 of the bytes autograd saves for backward with
  eager attention. The seed is an estimate of what is kept, not of the allocator's transient peak; the online
  fit and the OOM scale correct both after the first steps.
"""

from __future__ import annotations

import math
from typing import Any, cast

_MAX_OOMS = 16
_OOM_MARGIN = 1.05  # after an OOM, predict this much above the limit that was hit
_OOM_UNKNOWN_LIMIT = 1.25  # no limit known: assume the prediction was this much too low
_MIN_POINTS_FOR_FIT = 6  # below this, only rescale the prior: 3 coefficients need spread-out points


class MemoryModel:
    def __init__(
        self,
        fixed_bytes: float = 0.0,
        per_token_bytes: float = 0.0,
        per_len2_bytes: float = 0.0,
        max_observations: int = 64,
    ) -> None:
        if min(fixed_bytes, per_token_bytes, per_len2_bytes) < 0:
            raise ValueError("memory model terms must be >= 0")
        self.prior = (float(fixed_bytes), float(per_token_bytes), float(per_len2_bytes))
        self.coef = self.prior
        self.scale = 1.0
        self.max_observations = int(max_observations)
        self._obs: list[tuple[int, int, int, int]] = []  # (padded_tokens, n_samples, max_len, peak_bytes)
        self._ooms: list[tuple[int, int, int, float]] = []  # (padded_tokens, n_samples, max_len, limit_bytes)
        # Plans ask the same (length, budget) questions many times (equal devices); answers only change on refit.
        self._cache: dict[tuple[int, int], int] = {}

    @classmethod
    def from_model_bytes(
        cls,
        frozen_bytes: int,
        trainable_bytes: int,
        hidden_size: int,
        n_layers: int,
        vocab_size: int,
        compute_bytes: int = 4,
        n_heads: int | None = None,
        adapter_features: int = 0,
        gradient_checkpointing: bool = False,
        workspace_bytes: int = 0,
    ) -> "MemoryModel":
        """Seed terms from the model's own byte counts and shape (the online fit corrects them after a few steps).

        frozen_bytes / trainable_bytes: sum of numel * element_size over the frozen / trainable parameters
        (model.parameter_bytes); compute_bytes: 2 when activations are bf16 (autocast, or bf16 frozen weights),
        4 in fp32; adapter_features: per token, the input features of the LoRA-adapted layers.

        fixed:     frozen weights at their dtype + trainable weights, their gradients and Adam m and v, each the
                   size of the trainable weights: frozen + 4 * trainable (+ workspace_bytes)
        per token: transformer activations ~34 * hidden bytes per layer at 2-byte precision (Korthikanti et al.
                   2022, "Reducing Activation Recomputation in Large Transformer Models"), scaled to
                   compute_bytes; each adapted layer's input again for its fp32 LoRA branch (4 bytes a feature);
                   plus logits, their gradient and an fp32 log-softmax: vocab * (2 * compute_bytes + 4).
                   Gradient checkpointing keeps only each layer's input (hidden * compute_bytes) and one layer's
                   activations at a time (recomputed in backward)
        per len^2: eager attention keeps scores, softmax and dropout mask: ~5 * heads bytes per layer at 2 bytes
        """
        heads = n_heads or max(1, hidden_size // 64)
        act_scale = compute_bytes / 2
        fixed = frozen_bytes + 4 * trainable_bytes + workspace_bytes
        layer = 34 * hidden_size * act_scale + 4 * adapter_features / n_layers  # one layer's, per token
        kept = n_layers * hidden_size * compute_bytes + layer if gradient_checkpointing else n_layers * layer
        per_token = kept + vocab_size * (2 * compute_bytes + 4)
        per_len2 = (1 if gradient_checkpointing else n_layers) * 5 * heads * act_scale
        return cls(fixed, per_token, per_len2)

    @classmethod
    def from_model_sizes(
        cls,
        n_params: int,
        n_trainable_params: int,
        hidden_size: int,
        n_layers: int,
        vocab_size: int,
        bytes_per_param: int = 4,
        n_heads: int | None = None,
        workspace_bytes: int = 0,
    ) -> "MemoryModel":
        """from_model_bytes when only parameter counts are known: the frozen weights at bytes_per_param (also the
        activations' precision), the trainable ones in fp32."""
        return cls.from_model_bytes(
            (n_params - n_trainable_params) * bytes_per_param,
            4 * n_trainable_params,
            hidden_size,
            n_layers,
            vocab_size,
            compute_bytes=bytes_per_param,
            n_heads=n_heads,
            workspace_bytes=workspace_bytes,
        )

    # ---- prediction -------------------------------------------------------------------------------------
    def predict(self, padded_tokens: int, n_samples: int, max_len: int) -> int:
        f, a, b = self.coef
        return math.ceil(self.scale * (f + a * padded_tokens + b * n_samples * max_len * max_len))

    def predict_mb(self, mb: Any) -> int:
        n = len(mb.sample_ids)
        return self.predict(mb.n_padded_tokens, n, mb.n_padded_tokens // n if n else 0)

    def sample_bytes(self, length: int) -> float:
        """Bytes one sample adds on top of the fixed term (least_loaded's 'what it has been given')."""
        _, a, b = self.coef
        return self.scale * (a * length + b * length * length)

    def max_samples(self, max_len: int, budget_bytes: int | None) -> int:
        """How many samples padded to max_len fit one micro-batch (0: not even one). Large if unlimited."""
        if budget_bytes is None or max_len <= 0:
            return 1 << 40
        key = (max_len, budget_bytes)
        k = self._cache.get(key)
        if k is None:
            k = self._cache[key] = self._max_samples(max_len, budget_bytes)
            if len(self._cache) > 65536:
                self._cache.clear()
        return k

    def _max_samples(self, max_len: int, budget_bytes: int) -> int:
        f, a, b = self.coef
        per_sample = a * max_len + b * max_len * max_len
        room = budget_bytes / self.scale - f
        if per_sample <= 0:
            return 1 << 40 if room >= 0 else 0
        k = max(0, int(room / per_sample))
        # the closed form is in floats; settle the integer boundary with the exact predicate
        while k > 0 and self.predict(k * max_len, k, max_len) > budget_bytes:
            k -= 1
        while self.predict((k + 1) * max_len, k + 1, max_len) <= budget_bytes:
            k += 1
        return k

    def max_len_alone(self, budget_bytes: int | None) -> int:
        """Longest single sample that fits the budget (0 if none)."""
        if budget_bytes is None:
            return 1 << 40
        key = (-1, budget_bytes)
        length = self._cache.get(key)
        if length is None:
            length = self._cache[key] = self._max_len_alone(budget_bytes)
        return length

    def _max_len_alone(self, budget_bytes: int) -> int:
        f, a, b = self.coef
        room = budget_bytes / self.scale - f
        if room < 0:
            return 0
        if b > 0:
            length = int((-a + math.sqrt(a * a + 4 * b * room)) / (2 * b))
        elif a > 0:
            length = int(room / a)
        else:
            return 1 << 40
        while length > 0 and self.predict(length, 1, length) > budget_bytes:
            length -= 1
        while self.predict(length + 1, 1, length + 1) <= budget_bytes:
            length += 1
        return length

    # ---- learning ---------------------------------------------------------------------------------------
    def observe(self, padded_tokens: int, n_samples: int, max_len: int, peak_bytes: int) -> None:
        """Record a measured peak of a micro-batch and refit."""
        self._obs.append((int(padded_tokens), int(n_samples), int(max_len), int(peak_bytes)))
        del self._obs[: -self.max_observations]
        self._refit()

    def observe_oom(self, padded_tokens: int, n_samples: int, max_len: int, limit_bytes: float | None = None) -> None:
        """This size did not fit under limit_bytes (total or free memory at the time; None if unknown)."""
        if limit_bytes is None:
            limit_bytes = self.predict(padded_tokens, n_samples, max_len) * _OOM_UNKNOWN_LIMIT
        self._ooms.append((int(padded_tokens), int(n_samples), int(max_len), float(limit_bytes)))
        del self._ooms[:-_MAX_OOMS]
        self._refit()

    def _refit(self) -> None:
        self._cache.clear()
        obs = self._obs
        if len(obs) >= _MIN_POINTS_FOR_FIT and len({(p, n * m * m) for p, n, m, _ in obs}) >= 3:
            fitted = _nnls3([(1.0, float(p), float(n * m * m)) for p, n, m, _ in obs], [float(y) for *_, y in obs])
            self.coef = fitted if fitted is not None else self.prior
        elif obs:
            # Few points: keep the prior's shape, match its level (ratio of sums is robust to one outlier size).
            f, a, b = self.prior
            predicted = sum(f + a * p + b * n * m * m for p, n, m, _ in obs)
            factor = sum(y for *_, y in obs) / predicted if predicted > 0 else 1.0
            self.coef = (f * factor, a * factor, b * factor)
        else:
            self.coef = self.prior
        self.scale = 1.0
        for p, n, m, limit in self._ooms:
            f, a, b = self.coef
            base = f + a * p + b * n * m * m
            if base > 0:
                self.scale = max(self.scale, limit * _OOM_MARGIN / base)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "prior": list(self.prior),
            "max_observations": self.max_observations,
            "observations": [list(o) for o in self._obs],
            "ooms": [list(o) for o in self._ooms],
        }

    def load_state_dict(self, d: dict) -> None:
        self.prior = cast("tuple[float, float, float]", tuple(float(x) for x in d["prior"]))
        self.max_observations = int(d.get("max_observations", self.max_observations))
        self._obs = [cast("tuple[int, int, int, int]", tuple(int(x) for x in o)) for o in d.get("observations", [])]
        self._ooms = [(int(o[0]), int(o[1]), int(o[2]), float(o[3])) for o in d.get("ooms", [])]
        self._refit()


def _nnls3(rows: list[tuple[float, float, float]], ys: list[float]) -> tuple[float, float, float] | None:
    """Non-negative least squares for 3 unknowns by trying every active set (8 small solves: exact, no iteration
    order to worry about). Columns are normalised first: bytes, tokens and tokens^2 differ by 10 orders."""
    norms = [math.sqrt(sum(r[j] * r[j] for r in rows)) or 1.0 for j in range(3)]
    xs = [[r[j] / norms[j] for j in range(3)] for r in rows]
    best, best_sse = None, math.inf
    for mask in range(1, 8):
        cols = [j for j in range(3) if mask >> j & 1]
        sol = _solve_normal(xs, ys, cols)
        if sol is None or any(v < 0 for v in sol):
            continue
        coef = [0.0, 0.0, 0.0]
        for j, v in zip(cols, sol):
            coef[j] = v
        sse = sum((y - sum(c * x for c, x in zip(coef, row))) ** 2 for row, y in zip(xs, ys))
        if sse < best_sse * (1 - 1e-12):
            best, best_sse = coef, sse
    if best is None:
        return None
    return (best[0] / norms[0], best[1] / norms[1], best[2] / norms[2])


def _solve_normal(xs: list[list[float]], ys: list[float], cols: list[int]) -> list[float] | None:
    k = len(cols)
    a = [[sum(r[i] * r[j] for r in xs) for j in cols] + [sum(r[i] * y for r, y in zip(xs, ys))] for i in cols]
    for c in range(k):  # Gaussian elimination with partial pivoting
        piv = max(range(c, k), key=lambda r: abs(a[r][c]))
        if abs(a[piv][c]) < 1e-9:
            return None
        a[c], a[piv] = a[piv], a[c]
        for r in range(k):
            if r != c:
                factor = a[r][c] / a[c][c]
                for j in range(c, k + 1):
                    a[r][j] -= factor * a[c][j]
    return [a[i][k] / a[i][i] for i in range(k)]
