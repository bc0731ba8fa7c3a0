"""The verdict's statistics, pure (numpy and scipy; no torch, no pandas, nothing of the package above): the
intervals and p-values over seeds and eval batches (stats.py), prune=true's rule (pruning.py) and the verdict's
sentences (sentences.py). The worker decides pruning with it below; the report (analysis/) uses it above."""

LEVEL = 0.95  # every interval's coverage; 1 - LEVEL is the level a decision must reach
# Below this a difference is float reduction order (routing changes it, never the math), not an effect.
NEGLIGIBLE = 1e-4  # nats per token
AUTO_FIRST = 2  # seeds=auto: every variant starts with 2 replicates; later ones are reserves (verdict/contest.py Auto)
# prune=true looks only from this share of the longest training on (verdict/contest.py Schedule): the decision users
# care about is the end of training, and curves that cross are still crossing early (docs/design/pruning.md).
GRACE = 0.5
